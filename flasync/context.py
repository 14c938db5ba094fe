"""What the server and client coroutines of one run share."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from flasync.bus import EventBus
from flasync.clock import Clock
from flasync.codecs import Pipeline
from flasync.config import RunConfig
from flasync.data import Partition, SyntheticClients
from flasync.diagnostics import TrainingDiagnostics
from flasync.executors import ThreadTrainingExecutor
from flasync.faults import FaultModel
from flasync.population import Network, Population
from flasync.residuals import ResidualStore
from flasync.topology import Tree
from flasync.training import LocalTraining

__all__ = ["RunContext"]


@dataclass(frozen=True, slots=True, kw_only=True)
class RunContext:
    """The wiring of one run, built by :class:`flasync.Federation`.

    Attributes:
        config: The validated run configuration.
        clock: Virtual or wall clock.
        bus: The run's event bus.
        executor: Training threads and their models.
        train_x: All training inputs, one contiguous tensor ``(N, *features)``.
        train_y: All training labels ``(N,)``.
        test_x: Held-out inputs evaluated by the server.
        test_y: Held-out labels.
        partition: Client id -> indices into ``train_x``.
        population: Per-client sizes and speeds.
        network: Simulated links.
        local: Local training hyper-parameters.
        num_params: Length of the flat model vector.
        log: The run's structlog logger (metrics processor included when tracking is on).
        wall: Monotonic real seconds (injected; ``time.perf_counter`` by default).
        partition_index: ``partition.indices`` as one int64 tensor, sliced per client.
        upload_codec: How clients encode their deltas (the server decodes with it).
        download_codec: How the server encodes each published model.
        residuals: Clients' error-feedback residuals (None when the upload codec keeps none).
        residual_lock: Guards ``residuals``, which training threads read and write.
        tree: The aggregation tree (None: a flat run, every client talks to the cloud).
        edge_codec: How edges encode the partial aggregates they send up (and their parents decode them).
        lazy_clients: Clients whose samples are drawn when they are sampled (then ``train_x`` is unused).
        diagnostics: Training diagnostics run in the training threads (None: NaN/Inf checks only).
        faults: The simulated failure model (None: no faults).
        pre_task_residuals: When checkpoints are on, each in-flight task's residual as it was when the task
            started (None: not recorded), by task id; the server drops an entry when it closes the task.
    """

    config: RunConfig
    clock: Clock
    bus: EventBus
    executor: ThreadTrainingExecutor
    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    partition: Partition
    population: Population
    network: Network
    local: LocalTraining
    num_params: int
    log: Any
    wall: Callable[[], float]
    partition_index: torch.Tensor
    upload_codec: Pipeline
    download_codec: Pipeline
    residuals: ResidualStore | None
    residual_lock: threading.Lock
    tree: Tree | None = None
    edge_codec: Pipeline = field(default_factory=Pipeline)
    lazy_clients: SyntheticClients | None = None

    def client_samples(self, client_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Return ``(x, y, indices)``: a data tensor pair and the positions of ``client_id``'s samples in it."""
        lazy = self.lazy_clients
        if lazy is None:
            return self.train_x, self.train_y, self.client_indices(client_id)
        data = lazy.client(client_id)
        device = self.train_x.device
        x, y = data.x.to(device), data.y.to(device)
        return x, y, torch.arange(len(y), device=device)

    faults: FaultModel | None = None
    pre_task_residuals: dict[int, torch.Tensor | None] | None = field(default=None)

    diagnostics: TrainingDiagnostics | None = None

    def client_indices(self, client_id: int) -> torch.Tensor:
        """Return the indices of ``client_id``'s samples in :attr:`train_x` (a view, no copy)."""
        offsets = self.partition.offsets
        return self.partition_index[int(offsets[client_id]) : int(offsets[client_id + 1])]
