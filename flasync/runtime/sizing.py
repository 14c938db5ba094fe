"""How large a run's training is on this machine: the executor's kind, its training threads and cohorts."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Literal

import torch

from flasync.config import (
    FedAvgServer,
    RunConfig,
    TreeTopology,
)
from flasync.runtime.prepare import Prepared
from flasync.training.cohort import unsupported_reason
from flasync.training.executors.ray import RayTrainingExecutor
from flasync.training.executors.threads import ThreadTrainingExecutor, TrainingExecutor
from flasync.training.local import LocalObjective, objective_name

__all__ = [
    "AUTO_MAX_WORKERS",
    "AUTO_MIN_COHORT",
    "AUTO_MIN_CONCURRENCY",
    "AUTO_MIN_CONCURRENCY_OWN",
    "choose_executor",
    "default_workers",
    "make_executor",
]


def make_executor(
    config: RunConfig,
    prepared: Prepared,
    *,
    on_fallback: Callable[[str], None] | None = None,
    on_event: Callable[[str, str], None] | None = None,
    objective: LocalObjective | None = None,
) -> TrainingExecutor:
    """Build the executor a run's training jobs run in (threads, vectorized cohorts on the threads, or Ray actors),
    its threads started.

    ``auto`` picks threads or vectorized cohorts (:func:`choose_executor`) and tells ``on_event("auto", why)``.

    Raises:
        ConfigError: If Ray is asked for and cannot start or be reached.
    """
    executor = config.executor
    kind = executor.kind
    if kind == "auto":
        kind, why = choose_executor(config, prepared, objective)
        if on_event is not None:
            on_event("auto", f"{kind}: {why}")
    if kind == "ray":
        return RayTrainingExecutor(
            prepared.factory,
            executor.ray,
            device=prepared.device,
            on_fallback=on_fallback,
            on_event=on_event,
            lazy=prepared.lazy,
        )
    workers = executor.workers
    if workers is None:
        workers, why = default_workers(
            kind,
            prepared.device,
            cores=_cores(),
            num_params=prepared.initial.numel(),
            max_cohort=executor.max_cohort,
            available_bytes=_available_memory(),
        )
        if on_event is not None and workers > 1:
            on_event("workers", f"{workers} training threads: {why}")
    threads = ThreadTrainingExecutor(
        prepared.factory,
        workers=workers,
        threads_per_worker=executor.threads_per_worker,
        vectorized=kind == "vectorized",
        max_cohort=executor.max_cohort,
        device=prepared.device,
        on_fallback=on_fallback,
    )
    threads.start_threads()  # here, not on the event loop at the first jobs
    return threads


AUTO_MAX_WORKERS = 4
"""Most training threads an unset ``executor.workers`` gives vectorized cohorts on the CPU (one per core up to it)."""

# Bytes a cohort member's training holds per parameter: its weights, gradients and momentum in float32.
_COHORT_BYTES_PER_PARAM = 12


def default_workers(
    kind: str,
    device: torch.device,
    *,
    cores: int,
    num_params: int,
    max_cohort: int,
    available_bytes: int | None,
) -> tuple[int, str]:
    """Return the training threads of an executor whose ``executor.workers`` is unset, and why.

    Vectorized cohorts on the CPU get one thread per core, at most :data:`AUTO_MAX_WORKERS`: a round larger than
    ``max_cohort`` trains as several cohorts, and each thread trains one at a time on its own core (the weights do not
    depend on the number of threads). Cohorts training at once each hold their members' weights, gradients and
    momentum, so there are no more threads than full cohorts fit in half of ``available_bytes`` (None: unknown).
    Threads that train one client at a time, and cohorts on a GPU, get one: a small model's step is Python, which
    the threads would take turns at.
    """
    if kind != "vectorized" or device.type != "cpu":
        return 1, "one training thread"
    workers = max(1, min(cores, AUTO_MAX_WORKERS))
    why = f"one per core ({cores}, at most {AUTO_MAX_WORKERS}) for vectorized cohorts"
    if available_bytes is not None:
        cohort_bytes = _COHORT_BYTES_PER_PARAM * num_params * max_cohort
        fit = max(1, available_bytes // (2 * max(cohort_bytes, 1)))
        if fit < workers:
            workers = fit
            why = f"as many cohorts of {max_cohort} as half the free memory holds"
    return workers, why


def _cores() -> int:
    """Return the CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _available_memory() -> int | None:
    """Return the bytes of memory available to new allocations (None where the OS does not say)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


AUTO_MIN_COHORT = 32
"""Smallest FedAvg round ``executor.kind = "auto"`` trains as one vectorized cohort (the tutorial MLP on 2 cores:
vectorized 1.45x the threads at 50 clients per round, 1.9x at 100, 2.4x at 500)."""

AUTO_MIN_CONCURRENCY = 48
"""Fewest clients in flight for which ``executor.kind = "auto"`` trains an asynchronous server's clients as cohorts
when the model is batched through ``vmap``. A cohort is every client dispatched since the last one started (at any
model version), about a quarter to a third of the concurrency on the tutorial workload; through ``vmap``, small
cohorts gain little or nothing (0.84x the threads at concurrency 20, measured on 2 cores)."""

AUTO_MIN_CONCURRENCY_OWN = 16
"""The same for a model with its own ``cohort_forward`` (the built-in MLP), whose small cohorts pay: FedBuff on the
tutorial workload, vectorized against threads, whole-call updates/s on 2 idle cores, was 1.67x at concurrency 10,
1.92x at 16 and 1.93-2.04x at 20 (``benchmarks/matrix.py --concurrency 10 16 20``); the default run (digits,
C = 20) trains 1.5x faster."""


def choose_executor(
    config: RunConfig, prepared: Prepared, objective: LocalObjective | None = None
) -> tuple[Literal["thread", "vectorized"], str]:
    """Return the executor ``executor.kind = "auto"`` runs, and why.

    Vectorized cohorts pay when many clients train at once: FedAvg rounds of at least :data:`AUTO_MIN_COHORT`
    clients, or FedBuff / FedAsync with at least :data:`AUTO_MIN_CONCURRENCY` clients in flight
    (:data:`AUTO_MIN_CONCURRENCY_OWN` for a model with its own ``cohort_forward``), on a flat topology, with a model
    and objective ``vmap`` can batch and no gradient checkpointing. On an accelerator (``prepared.device`` not the
    CPU) two clients a round or in flight are enough: there one client at a time is bound by kernel launches (on an
    H200 the tutorial MLP trained 118-159 clients/s one at a time, slower than one CPU core), which a cohort makes
    once for all its members. Everything else trains on the threads.
    """
    server = config.server
    if config.task != "classification":
        return "thread", f"task = {config.task!r} trains on the threads (vectorized cohorts: classification only)"
    if isinstance(config.topology, TreeTopology):
        return "thread", "edges start their rounds apart: cohorts would be small"
    # On an accelerator one client's step is a few launches of small kernels, and a cohort's step the same launches
    # for all its members: cohorts pay from two members on (the sizes below were measured on CPU cores).
    on_cpu = prepared.device.type == "cpu"
    least_round = AUTO_MIN_COHORT if on_cpu else 2
    if isinstance(server, FedAvgServer) and server.clients_per_round < least_round:
        return "thread", f"rounds of {server.clients_per_round} clients (< {least_round}) gain nothing from cohorts"
    model = prepared.factory()
    where = "" if on_cpu else f" on {prepared.device.type}"
    if isinstance(server, FedAvgServer):
        why = f"FedAvg rounds of {server.clients_per_round} clients{where}: one cohort each"
    else:
        own = callable(getattr(model, "cohort_forward", None))
        least = (AUTO_MIN_CONCURRENCY_OWN if own else AUTO_MIN_CONCURRENCY) if on_cpu else 2
        if server.concurrency < least:
            how = ("its own cohort_forward" if own else "vmap") if on_cpu else prepared.device.type
            return "thread", f"{server.kind} with {server.concurrency} clients in flight (< {least} for {how})"
        why = f"{server.kind} with {server.concurrency} clients in flight{where}: cohorts of those sent together"
    if config.client.checkpoint_segments:
        return "thread", "gradient checkpointing trains one client at a time"
    if config.model.prune is not None:
        return "thread", "model.prune masks each client's gradients, which a cohort's step does not"
    if config.client.personal is not None:
        return "thread", "client.personal starts each client from its own layers, which a cohort's step does not"
    reason = unsupported_reason(model)
    if reason is not None:
        return "thread", reason
    if objective is not None and not objective.vectorizable:
        return "thread", f"the objective {objective_name(objective)} is not vectorizable"
    return "vectorized", why
