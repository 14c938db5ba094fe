"""SCAFFOLD as a plug-in: each client's control variate ``c_i`` and the server's ``c``.

Karimireddy et al., "SCAFFOLD: Stochastic Controlled Averaging for Federated Learning", ICML 2020, Algorithm 1 with
option II; the math is :mod:`flasync.aggregation.scaffold`. A client trains with the correction ``c - c_i`` added to
every local gradient, sends ``Delta c_i`` beside its delta (through the upload codec), and keeps ``c_i + Delta c_i``
as the server decodes it, so that ``c`` stays the mean of the clients' variates whatever the codec loses. The server
sends ``c`` with every model (through the download codec), folds each admitted ``Delta c_i`` in, and steps ``c``
with every version.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from flasync.aggregation.scaffold import ControlVariate, control_delta
from flasync.algorithms.per_client import PerClientPlugin, PerClientState
from flasync.codecs import Encoded, Pipeline
from flasync.core import seeding
from flasync.core.errors import DecodeError
from flasync.core.events import TaskAssigned, UpdateUploaded
from flasync.core.snapshots import ModelSnapshot
from flasync.training.local import LocalResult
from flasync.training.plugins import Extra, Finished, Refusal, ServerPlugin, TaskPart
from flasync.training.residuals import ResidualStore

__all__ = ["ScaffoldClients", "ScaffoldServer"]


class ScaffoldClients(PerClientPlugin):
    """The clients' control variates ``c_i`` (checkpoint component ``variates``).

    Args:
        store: Where the variates live (bounded in memory, spilled to disk).
        seed: The run's seed (``Delta c_i`` is encoded with a stream keyed by client and participation).
        lr: ``eta_l``: the local learning rate.
    """

    name = "variates"

    def __init__(self, store: ResidualStore, *, seed: int, lr: float) -> None:
        """Bind the variates' store."""
        self.state = PerClientState(store)
        self.seed = seed
        self.lr = lr

    def task(self, task: TaskAssigned, model: ModelSnapshot) -> TaskPart | None:
        """Return the task's correction ``c - c_i`` (``c`` for a client without a variate yet)."""
        server = model.extra
        if server is None:
            return None
        own = self.state.begin(task)
        generator = seeding.torch_stream(self.seed, seeding.CONTROL_CODEC, task.client_id, task.participation)
        return _VariatePart(self, task.client_id, server, own, generator)

    def close(self, log: Any) -> dict[str, int]:
        """Close the store (its spill folder goes)."""
        self.state.store.close()
        return {}


class _VariatePart(TaskPart):
    """A task's SCAFFOLD state: ``c`` as downloaded and the client's own ``c_i``, and its correction."""

    __slots__ = ("client", "client_id", "generator", "owner", "server")

    def __init__(
        self,
        owner: ScaffoldClients,
        client_id: int,
        server: torch.Tensor,
        client: torch.Tensor | None,
        generator: torch.Generator,
    ) -> None:
        self.owner = owner
        self.client_id = client_id
        self.server = server
        self.client = client
        self.generator = generator
        self.correction = server if client is None else server - client.to(server.device)

    def finish(self, delta: torch.Tensor, result: LocalResult, encoded: Encoded, codec: Pipeline) -> Finished:
        """Encode ``Delta c_i`` (option II) beside the delta; keep ``c_i + Delta c_i`` as the server decodes it."""
        change = control_delta(delta, self.server.to(delta.device), steps=result.steps, lr=self.owner.lr)
        sent = codec.encode(change, generator=self.generator).payload
        if not codec.lossless:
            change = codec.decode(sent, expected_elements=change.numel())
        variate = change if self.client is None else change.add_(self.client)
        return Finished(extra=sent, kept=variate)

    def keep(self, finished: Finished) -> None:
        """Store the client's new variate."""
        if finished.kept is not None:
            self.owner.state.put(self.client_id, finished.kept)


class ScaffoldServer(ServerPlugin):
    """The server's control variate ``c`` (checkpoint component ``controls``).

    Args:
        controls: ``c`` and the changes folded since the last version.
        codec: The upload codec clients encode ``Delta c_i`` with.
    """

    name = "controls"
    decodes_extra = True

    def __init__(self, controls: ControlVariate, codec: Pipeline) -> None:
        """Bind the variate and the codec."""
        self.controls = controls
        self.codec = codec

    def published(self, version: int, codec: Pipeline, generator: torch.Generator | None) -> Extra:
        """Send ``c`` with the model, through the download codec."""
        control = self.controls.value.detach().clone()
        sent = codec.encode(control, generator=generator).payload
        if not codec.lossless:
            control = codec.decode(sent, expected_elements=control.numel()).to(control.device)
        return Extra(control, len(sent))

    def decode_extra(self, message: UpdateUploaded) -> torch.Tensor | Refusal:
        """Decode and check ``Delta c_i`` (like a delta, but not clipped)."""
        value = self.controls.value
        try:
            change = self.codec.decode(message.extra, expected_elements=value.numel())
        except DecodeError as exc:
            return Refusal("decode", f"control variate: {exc}")
        if not bool(torch.isfinite(change).all()):
            return Refusal("non_finite", "the control variate has NaN or Inf")
        return change if change.device == value.device else change.to(value.device)

    def folded(self, extra: torch.Tensor | None) -> None:
        """Fold an admitted ``Delta c_i`` into the next version's change of ``c``."""
        if extra is not None:
            self.controls.add(extra)

    def stepped(self, version: int) -> None:
        """Apply the version's changes to ``c``."""
        self.controls.step()

    def state_dict(self) -> dict[str, Any]:
        """Return ``c`` and the changes not applied yet."""
        return self.controls.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.controls.load_state_dict(dict(state))
