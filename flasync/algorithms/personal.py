"""Personalization as plug-ins: FedBN's local layers, kept by each client and never sent; fine-tuning; Ditto.

Li et al., "FedBN: Federated Learning on Non-IID Features via Local Batch Normalization", ICLR 2021. Some layers of
the model (the normalization layers by default, any by name pattern) are *local*: each client trains its own copy
of them and keeps it between its tasks, and the server never sees them. In flasync's terms a task of client ``i``
starts local training from the downloaded weights ``w_v`` with ``i``'s own local values put in at the local
positions ``L`` (``w_v`` as is for a client's first task), and its delta is zero at ``L`` before it is encoded, so
the server's copy of the local layers keeps its initial values, bit for bit, across every version; the client keeps
the trained values ``(start - delta)[L]``. The local layers are the complement of what a partial exchange would send
(:func:`flasync.training.exchange.matches` picks them by name), but they train, where a frozen layer does not.

The clients' local values are one vector of ``|L|`` floats per client in a
:class:`~flasync.training.residuals.ResidualStore` (bounded in memory, spilled to disk, checkpointed with what each
task in flight started from, so a resumed run is bit-exact). :meth:`LocalLayers.personal` gives client-side
evaluation (``eval.clients``) the client's own model: the downloaded weights with its local layers in.

:class:`FineTune` is the simplest personalization baseline: an evaluating client evaluates the downloaded model
after ``K`` local SGD steps on its own training samples (its training and update are unchanged). :class:`Ditto`
trains a personal model per client beside the global update, pulled towards the downloaded model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from flasync.algorithms.per_client import PerClientPlugin, PerClientState
from flasync.codecs import Encoded, Pipeline
from flasync.core import seeding
from flasync.core.errors import ConfigError
from flasync.core.events import TaskAssigned
from flasync.core.snapshots import ModelSnapshot
from flasync.training.exchange import matches
from flasync.training.executors.threads import ModelPool
from flasync.training.local import LocalResult, LocalTraining, flat_layout, train
from flasync.training.plugins import Finished, TaskPart
from flasync.training.residuals import ResidualStore

__all__ = ["NORM_LAYERS", "Ditto", "FineTune", "LocalLayers", "local_positions"]

NORM_LAYERS: tuple[type[nn.Module], ...] = (
    nn.BatchNorm1d,
    nn.BatchNorm2d,
    nn.BatchNorm3d,
    nn.SyncBatchNorm,
    nn.InstanceNorm1d,
    nn.InstanceNorm2d,
    nn.InstanceNorm3d,
    nn.LayerNorm,
    nn.GroupNorm,
    nn.RMSNorm,
)
"""The layer types FedBN keeps local when no name pattern is given."""


def local_positions(module: nn.Module, layers: Sequence[str] | None) -> torch.Tensor:
    """Return the positions in ``module``'s flat vector of its local layers' parameters and float buffers.

    Args:
        module: The model, as the run builds it (its flat vector is
            :func:`~flasync.training.local.flat_parameters`'s).
        layers: Name patterns (see :func:`~flasync.training.exchange.matches`), or None: the tensors of every
            :data:`NORM_LAYERS` module.

    Returns:
        The positions, ascending, as an int64 tensor.

    Raises:
        ConfigError: If a pattern selects nothing, nothing is local, or everything is (nothing would be federated).
    """
    layout = flat_layout(module)
    named = [*layout.parameters, *layout.buffers]
    names = [name for name, _ in named]
    if layers is None:
        owners = {name for name, sub in module.named_modules() if isinstance(sub, NORM_LAYERS)}
        chosen = [name.rpartition(".")[0] in owners for name in names]
        if not any(chosen):
            raise ConfigError(
                "client.personal.layers: the model has no normalization layer; name its local layers "
                f"(e.g. [{names[-1].rpartition('.')[0]!r}])"
            )
    else:
        for pattern in layers:
            if not any(matches(name, pattern) for name in names):
                shown = ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")
                raise ConfigError(f"client.personal.layers: pattern {pattern!r} selects nothing of the model ({shown})")
        chosen = [any(matches(name, pattern) for pattern in layers) for name in names]
    if all(chosen):
        raise ConfigError("client.personal.layers: selects every tensor of the model; nothing would be federated")
    spans: list[torch.Tensor] = []
    offset = 0
    for (_, tensor), local in zip(named, chosen, strict=True):
        if local:
            spans.append(torch.arange(offset, offset + tensor.numel(), dtype=torch.int64))
        offset += tensor.numel()
    return torch.cat(spans)


class LocalLayers(PerClientPlugin):
    """The clients' own local layers (FedBN; checkpoint component ``personal``).

    Args:
        store: Where each client's local values live (``positions.numel()`` floats each; bounded in memory, spilled
            to disk).
        positions: The local layers' positions in the flat vector (:func:`local_positions`).
    """

    name = "personal"

    def __init__(self, store: ResidualStore, positions: torch.Tensor) -> None:
        """Bind the store and the positions."""
        self.state = PerClientState(store)
        self.positions = positions

    def task(self, task: TaskAssigned, model: ModelSnapshot) -> TaskPart:
        """Return the task's part: training starts from the downloaded weights with the client's own layers in."""
        own = self.state.begin(task)
        return _LocalPart(self, int(task.client_id), self._put_in(model.weights, own))

    def personal(self, client_id: int, weights: torch.Tensor) -> torch.Tensor:
        """Return ``client_id``'s own model made of ``weights``: its local layers put in (``weights`` itself for a
        client that has none yet)."""
        return self._put_in(weights, self.state.get(client_id))

    def _put_in(self, weights: torch.Tensor, own: torch.Tensor | None) -> torch.Tensor:
        if own is None:
            return weights
        mixed = weights.clone()
        mixed[self.positions.to(weights.device)] = own.to(weights.device)
        return mixed

    def close(self, log: Any) -> dict[str, int]:
        """Close the store (its spill folder goes)."""
        self.state.store.close()
        return {}


class _LocalPart(TaskPart):
    """A task's local layers: the weights it starts from; the trained local values, taken out of its delta."""

    __slots__ = ("begin", "client_id", "kept", "owner")

    def __init__(self, owner: LocalLayers, client_id: int, start: torch.Tensor) -> None:
        self.owner = owner
        self.client_id = client_id
        self.begin = start
        self.start = start
        self.kept: torch.Tensor | None = None

    def withhold(self, delta: torch.Tensor) -> None:
        """Keep the trained local values ``(start - delta)[L]`` and zero the delta there: they never leave."""
        positions = self.owner.positions.to(delta.device)
        self.kept = (self.begin.to(delta.device)[positions] - delta[positions]).cpu()
        delta[positions] = 0.0

    def finish(self, delta: torch.Tensor, result: LocalResult, encoded: Encoded, codec: Pipeline) -> Finished:
        """Hand the trained local values to :meth:`keep`."""
        return Finished(kept=self.kept)

    def keep(self, finished: Finished) -> None:
        """Store the client's trained local values."""
        if finished.kept is not None:
            self.owner.state.put(self.client_id, finished.kept)


class FineTune:
    """Fine-tune a downloaded model on a client's own training samples, for its evaluation (worker thread).

    The fine-tuning is ``steps`` SGD steps of the run's local training (``client.*``: batch size, momentum, weight
    decay, clipping, objective) at ``lr``, drawing its batches from a stream keyed by the run's seed, the client and
    its participation, so a run's figures are the same whoever evaluates, whenever.

    Args:
        samples: Client id -> ``(x, y, rows)``: its training samples are ``x[rows]``, ``y[rows]``.
        local: The run's local training.
        models: The worker threads' models (the fine-tuning trains the worker's own).
        seed: The run's seed.
        steps: SGD steps (None: those of ``local``).
        lr: Learning rate (None: ``local.lr``).
    """

    def __init__(
        self,
        samples: Callable[[int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
        local: LocalTraining,
        models: ModelPool,
        *,
        seed: int,
        steps: int | None,
        lr: float | None = None,
    ) -> None:
        """Bind the data, the training and the stream."""
        self.samples = samples
        rate = local.lr if lr is None else lr
        self.local = (
            dataclasses.replace(local, lr=rate)
            if steps is None
            else dataclasses.replace(local, epochs=steps, max_steps=steps, lr=rate)
        )
        self.models = models
        self.seed = seed

    def __call__(
        self, client_id: int, participation: int, weights: torch.Tensor, correction: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Return ``weights`` after the fine-tuning on ``client_id``'s samples (a new tensor on the model's device),
        ``correction`` added to every step's gradient (None: nothing)."""
        model = self.models.get()
        device = model.flat.device
        x, y, rows = self.samples(client_id)
        indices: torch.Tensor | None = rows
        if x.device != device or y.device != device or rows.device != device:
            x, y, indices = x[rows].to(device), y[rows].to(device), None
        base = weights.to(device)
        generator = seeding.torch_stream(self.seed, seeding.PERSONAL, client_id, participation)
        fix = None if correction is None else correction.to(device)
        result = train(model, base, x, y, self.local, generator, indices=indices, correction=fix)
        return base - result.delta


class Ditto(PerClientPlugin):
    """Ditto's personal models (Li et al., "Ditto: Fair and Robust Federated Learning Through Personalization",
    ICML 2021, Algorithm 1; checkpoint component ``ditto``).

    Beside its usual task on the global model (unchanged), client ``i`` trains its personal model ``v_i`` (the
    downloaded ``w`` at its first task) for ``steps`` SGD steps on ``f_i(v) + lambda/2 ||v - w||^2``:
    ``v <- v - lr (grad f_i(v) + lambda (v - w))``, with ``w`` the downloaded model, and keeps it. The proximal
    gradient is FedProx's term towards the start ``v_0`` plus the constant ``lambda (v_0 - w)`` (a gradient
    correction), which sums to ``lambda (v - w)``. ``v_i`` is one full vector per client, bounded in memory, spilled
    to disk and checkpointed; client-side evaluation evaluates it as the client's personal model.

    Args:
        store: Where the personal models live.
        tune: The personal model's local SGD (its ``local.proximal_mu`` is ``lambda``).
        lam: ``lambda``.
    """

    name = "ditto"

    def __init__(self, store: ResidualStore, tune: FineTune, *, lam: float) -> None:
        """Bind the store and the training."""
        self.state = PerClientState(store)
        self.tune = tune
        self.lam = lam
        tune.local = dataclasses.replace(tune.local, proximal_mu=lam)

    def task(self, task: TaskAssigned, model: ModelSnapshot) -> TaskPart:
        """Return the task's part: the personal model it starts from (the download for a first task)."""
        own = self.state.begin(task)
        return _DittoPart(self, task, model.weights, own)

    def personal(self, client_id: int, weights: torch.Tensor) -> torch.Tensor:
        """Return ``client_id``'s personal model (``weights`` for a client that has none yet)."""
        own = self.state.get(client_id)
        return weights if own is None else own.to(weights.device)

    def close(self, log: Any) -> dict[str, int]:
        """Close the store (its spill folder goes)."""
        self.state.store.close()
        return {}


class _DittoPart(TaskPart):
    """A task's personal update: ``v_i`` trained towards the downloaded model in the worker, kept at the end."""

    __slots__ = ("download", "own", "owner", "task")

    def __init__(self, owner: Ditto, task: TaskAssigned, download: torch.Tensor, own: torch.Tensor | None) -> None:
        self.owner = owner
        self.task = task
        self.download = download
        self.own = own

    def finish(self, delta: torch.Tensor, result: LocalResult, encoded: Encoded, codec: Pipeline) -> Finished:
        """Train the personal model (worker thread, once the global update is encoded); hand it to :meth:`keep`."""
        owner, task = self.owner, self.task
        start = self.download if self.own is None else self.own.to(self.download.device)
        correction = None if self.own is None else (start - self.download).mul_(owner.lam)
        trained = owner.tune(int(task.client_id), task.participation, start, correction)
        return Finished(kept=trained.cpu())

    def keep(self, finished: Finished) -> None:
        """Store the client's new personal model."""
        if finished.kept is not None:
            self.owner.state.put(int(self.task.client_id), finished.kept)
