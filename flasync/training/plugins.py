"""The algorithm-state seam: what an algorithm keeps per client and on the server, plugged into one update's path.

A plug-in is an object of optional hooks that do nothing unless overridden (trio's ``Instrument`` shape). The
client coroutine, the training job, the intake and the server loop call the hooks of every plug-in a run has, at
fixed points of an update's path, and know nothing of which algorithms are on:

    client, event loop   a task is placed ....... ClientPlugin.task(task, model) -> TaskPart | None
    worker thread        local training ......... starts from TaskPart.start (the client's own layers put in),
                                                  TaskPart.correction, added to every local gradient, and
                                                  TaskPart.mask, multiplying it (only those weights train)
                         a cohort's parts ....... type(part).finish_together(parts, results)   (work they share)
                         before encoding ........ TaskPart.withhold(delta)   (what never leaves the client)
                         encoding the delta ..... TaskPart.residual(), carried into the upload codec
                         after encoding ......... TaskPart.finish(delta, result, encoded, codec) -> Finished
    client, event loop   training ended ......... TaskPart.keep(finished)   (in virtual time: an abandoned task
                                                                            keeps nothing)
                         task released .......... ClientPlugin.released(task)
    server loop          a model is published ... ServerPlugin.published(version, codec, generator) -> Extra
    intake               an upload is checked ... ServerPlugin.admit(message, version) -> refusal or None
                         its extra is decoded ... ServerPlugin.decode_extra(message) -> tensor, refusal or None
                         it is admitted ......... ServerPlugin.admitted(message, version)
    server loop          it is folded in ........ ServerPlugin.folded(extra)
                         a version is made ...... ServerPlugin.stepped(version)   (before it is published)
                         and published .......... ServerPlugin.version_made(version, log)
    checkpoint           every plug-in .......... state_dict() / load_state_dict()

Error feedback, SCAFFOLD and central differential privacy are plug-ins (:mod:`flasync.algorithms`). At most one
plug-in of a run sends an extra beside each delta (``UpdateUploaded.extra``) and one with each model
(``ModelSnapshot.extra``), and at most one gives a gradient correction, one a gradient mask, one a start and one an
error-feedback residual.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from flasync.codecs import Encoded, Pipeline
from flasync.core.events import TaskAssigned, UpdateUploaded
from flasync.core.snapshots import ModelSnapshot
from flasync.training.local import LocalResult

__all__ = ["ClientPlugin", "Extra", "Finished", "Refusal", "ServerPlugin", "TaskPart"]


@dataclass(frozen=True, slots=True)
class Finished:
    """What one plug-in's part of a trained task hands back from the worker thread.

    Attributes:
        extra: Bytes sent beside the delta (empty: none).
        kept: State :meth:`TaskPart.keep` stores for the client when the training ends (None: nothing).
        figures: Figures of the task's debug line (e.g. ``residual_norm``).
    """

    extra: bytes = b""
    kept: torch.Tensor | None = None
    figures: Mapping[str, float] = field(default_factory=dict)


class TaskPart:
    """One plug-in's part in one task, from its worker-thread side to its end on the event loop (no-op hooks).

    Attributes:
        correction: Added to every local gradient (None: nothing).
        mask: Multiplies every local gradient, after the correction, the proximal term and weight decay: the weights
            where it is 0 do not train (a pruning mask of 0s and 1s; None: nothing).
        start: The flat weights local training starts from instead of the downloaded model's (the downloaded
            weights with the client's own layers put in; None: the downloaded weights). The delta is taken from it.
    """

    correction: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    start: torch.Tensor | None = None

    def residual(self) -> torch.Tensor | None:
        """Return the error-feedback residual the upload codec adds to the delta (worker thread; None: none)."""
        return None

    @classmethod
    def finish_together(cls, parts: Sequence[TaskPart], results: Sequence[LocalResult]) -> None:
        """Do the work the parts of one class share, for tasks trained together (worker thread; no-op here).

        A cohort's tasks call it once with their parts of this class and their training results, in the cohort's
        order, before any of them finishes; then each task calls it again with its own part alone, before
        :meth:`finish` (a task trained alone calls only this). So it does the work of the parts that have not done
        it yet: a batched evaluation of a cohort, for example, rather than one per task.
        """

    def withhold(self, delta: torch.Tensor) -> None:
        """Take out of the trained ``delta``, in place, what never leaves the client (worker thread, after
        :meth:`finish_together` and before the delta is encoded; no-op here)."""

    def finish(self, delta: torch.Tensor, result: LocalResult, encoded: Encoded, codec: Pipeline) -> Finished:
        """Take the task's encoded delta (worker thread); return what to send beside it and what to keep."""
        return _NOTHING

    def keep(self, finished: Finished) -> None:
        """Store what :meth:`finish` returned, once the training ended in (virtual) time (event loop)."""


class ClientPlugin:
    """An algorithm's per-client state, on the clients' side of a run (no-op hooks).

    Attributes:
        name: The plug-in's name: its checkpoint component and its figures' prefix.
    """

    name: str = ""

    def task(self, task: TaskAssigned, model: ModelSnapshot) -> TaskPart | None:
        """Begin a task placed on its timeline (event loop): read the client's state; None: no part in it."""
        return None

    def released(self, task: TaskAssigned) -> None:
        """Forget what was recorded for a task that ended (event loop)."""

    def state_dict(self, in_flight: Iterable[TaskAssigned]) -> dict[str, Any]:
        """Return the clients' state for a checkpoint: each task in flight as it was when it started."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` before the run starts."""

    def close(self, log: Any) -> dict[str, int]:
        """Release what the plug-in holds (spilled files) at the run's end; return its memory figures."""
        return {}


class Refusal(NamedTuple):
    """Why a plug-in refuses an upload: the reason counted (a short key) and a detail for the log."""

    reason: str
    detail: str


class Extra(NamedTuple):
    """What a plug-in sends with a published model: a tensor clients receive, and its bytes on the wire."""

    value: torch.Tensor | None
    nbytes: int


class ServerPlugin:
    """An algorithm's server-side state and checks (no-op hooks).

    It sees the uploads that reach the cloud's intake: in a tree, edges fold their clients' updates without it.

    Attributes:
        name: The plug-in's name: its checkpoint component.
        decodes_extra: Whether :meth:`decode_extra` reads what clients send beside their deltas (the intake then
            decodes each upload on its own rather than a batch's deltas together).
    """

    name: str = ""
    decodes_extra: bool = False

    def published(self, version: int, codec: Pipeline, generator: torch.Generator | None) -> Extra:
        """Return what clients receive with the model of ``version`` (through the download ``codec``)."""
        return _NO_EXTRA

    def admit(self, message: UpdateUploaded, version: int) -> Refusal | None:
        """Check an upload before its delta is decoded (None: no objection)."""
        return None

    def decode_extra(self, message: UpdateUploaded) -> torch.Tensor | Refusal | None:
        """Decode what a client sent beside its delta (None: this plug-in sends nothing)."""
        return None

    def admitted(self, message: UpdateUploaded, version: int) -> None:
        """Learn that an upload passed every check into ``version``."""

    def folded(self, extra: torch.Tensor | None) -> None:
        """Learn that an admitted update was folded in, with its decoded extra."""

    def stepped(self, version: int) -> None:
        """Learn that the aggregator stepped to ``version``, before the model is published."""

    def version_made(self, version: int, log: Any) -> None:
        """Log the plug-in's figures of ``version``, once it is published."""

    def state_dict(self) -> dict[str, Any]:
        """Return the plug-in's state for a checkpoint."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` before the run starts."""


_NOTHING = Finished()
_NO_EXTRA = Extra(None, 0)
