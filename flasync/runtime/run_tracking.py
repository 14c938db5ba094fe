"""What a federation tells its tracker: the run's opening (params, tags, ``config.yaml``, the dataset input, the
model's export ahead), the metrics its log lines become, and the alerts and constant metrics it tags."""

from __future__ import annotations

import asyncio
import functools
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import UTC, datetime
from types import MappingProxyType
from typing import Any

import numpy as np

from flasync import tracking
from flasync.config import RunConfig, flatten
from flasync.runtime import checkpoint, tracked
from flasync.runtime.build import AggregatorFactory
from flasync.runtime.naming import dataset_record, rule_name, run_name, run_tags
from flasync.runtime.prepare import Prepared
from flasync.runtime.tracked import redacted
from flasync.training.local import LocalObjective, objective_name

__all__ = [
    "CONSTANT_KEYS",
    "DETAIL_KEYS",
    "METRIC_EXCLUDE",
    "example",
    "federation_tags",
    "log_config",
    "make_tracker",
    "open_run",
    "prepare_model",
    "run_logger",
    "tag_alerts",
    "tag_constants",
]

METRIC_EXCLUDE = frozenset(tracking.DEFAULT_EXCLUDE | {"version", "of", "eta_s"})  # progress, not measurements
# Per-update figures logged only with ``tracking.metrics = "all"``; their per-version sums are in ``profile/version/*``
# and profile.json either way. Each MLflow metric row costs the store's writer process some microseconds of CPU,
# taken from the cores that train.
# Per-update figures that often stay the same all run long (a dense codec's bytes, equal partitions' samples and
# training memory, synchronous rounds' staleness): held back while constant and then recorded once, as the tag
# ``constant/<key>``, rather than as thousands of identical rows (see tracking.ConstantSeries).
CONSTANT_KEYS = frozenset(
    {
        "client/upload_bytes",
        "client/download_bytes",
        "client/samples",
        "client/peak_mem_bytes",
        "client/sim_download_s",
        "client/compression",
        "server/update/staleness",
        "server/update/staleness_weight",
    }
)
DETAIL_KEYS = frozenset(  # MLflow keys (see tracking.metric_key)
    {
        "client/sim_train_s",
        "client/sim_download_s",
        "client/encode_s",
        "client/compression",
        "client/residual_norm",
        "server/update/staleness_weight",
        "server/update/decode_s",
        "server/update/norm",
        # Two timings of every update: their per-version sums (profile/version/compute_s, .../queue_wait_s) and
        # their distributions (profile.json) are kept; the 2 x 2,000 rows of a short run's 100 x 20 updates took the
        # writer process's CPU beside training (a vectorized cohort's train_s is each member's share of one time).
        "client/train_s",
        "server/update/queue_wait_s",
    }
)

_NO_TAGS: Mapping[str, str] = MappingProxyType({})


def make_tracker(config: RunConfig, given: tracking.Tracker | None) -> tracking.Tracker:
    """Return the tracker the run was given, else the one ``config.tracking`` asks for (a null one when disabled)."""
    if given is not None:
        return given
    cfg = config.tracking
    if not cfg.enabled:
        return tracking.NullTracker()
    return tracked.mlflow_tracker(config)


def run_logger(config: RunConfig, tracker: tracking.Tracker) -> tuple[Any, tracking.ConstantSeries | None]:
    """Return the run's logger, whose numeric fields become the tracker's metrics, and the series of its held-back
    constant metrics (None when the run is not tracked)."""
    metrics: tracking.MetricsProcessor | None = None
    constant: tracking.ConstantSeries | None = None
    if not isinstance(tracker, tracking.NullTracker):
        drop = DETAIL_KEYS if config.tracking.metrics == "standard" else ()
        constant = tracking.ConstantSeries(tracker.log_metrics, CONSTANT_KEYS)
        metrics = tracking.MetricsProcessor(constant, exclude=METRIC_EXCLUDE, drop_keys=drop)
    # Metrics are taken at each log call; events below the log level skip structlog's chain.
    return tracking.make_logger(level=config.tracking.log_level, metrics=metrics), constant


def federation_tags(
    config: RunConfig,
    *,
    virtual_clock: bool,
    aggregator: AggregatorFactory | None,
    objective: LocalObjective | None,
) -> dict[str, str]:
    """Return the run's tags, with the names of a user's aggregation rule and objective."""
    tags = run_tags(config, virtual_clock=virtual_clock)
    if aggregator is not None:
        tags["aggregator.custom"] = rule_name(aggregator)
    if objective is not None:
        tags["objective"] = objective_name(objective)
    return tags


async def open_run(
    tracker: tracking.Tracker,
    prepared: Prepared,
    log: Any,
    *,
    resume: checkpoint.ResumePoint | None,
    custom: bool,
    tags: dict[str, str],
    on_unopened: Callable[[str], None],
) -> tuple[str, Future[str] | None]:
    """Start the tracking run (or resume the checkpoint's) and log its inputs; return its id and, for an MLflow run
    opened in the background, the future of its id (``on_unopened`` is called on the loop with the reason if that
    run cannot be opened)."""
    cfg = prepared.config
    opening: Future[str] | None = None
    if resume is not None and resume.run_id:
        run_id = await asyncio.to_thread(tracker.resume, resume.run_id)
        await asyncio.to_thread(log_config, tracker, cfg, log)  # a resumed run's stop.* may differ
        await asyncio.to_thread(prepare_model, tracker, prepared, log)
    else:
        start = functools.partial(
            tracker.start,
            experiment=cfg.tracking.experiment,
            run_name=run_name(cfg, started=datetime.now(UTC), run_id=uuid.uuid4().hex[:6], custom=custom),
            params={**flatten(redacted(cfg)), **(prepared.privacy.params() if prepared.privacy else {})},
            tags=tags,
        )
        if isinstance(tracker, tracking.MlflowTracker):
            # Training does not wait for the writer process to import MLflow and create the run (seconds
            # when the caller imported torch already): metrics queue until the run exists.
            run_id = await asyncio.to_thread(functools.partial(start, wait=False))
            opening = _open_in_background(tracker, prepared, custom, log, on_unopened)
        else:
            run_id = await asyncio.to_thread(start)
            if not isinstance(tracker, tracking.NullTracker):
                await asyncio.to_thread(_log_inputs, tracker, prepared, custom, log)
    return run_id, opening


def _open_in_background(
    tracker: tracking.MlflowTracker,
    prepared: Prepared,
    custom: bool,
    log: Any,
    on_unopened: Callable[[str], None],
) -> Future[str]:
    """Wait on a thread for the run ``tracker.start(wait=False)`` opens, then record the dataset input and the
    config; return the future of the run id. A run that cannot be opened (a deleted experiment) stops the
    federation."""
    loop = asyncio.get_running_loop()
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="flasync-open-run")

    def open_run() -> str:
        run_id = tracker.opened()
        if run_id:
            log.info("run.opened", run_id=run_id, experiment=prepared.config.tracking.experiment, metrics=False)
        _log_inputs(tracker, prepared, custom, log)
        return run_id

    def stop_if_failed(future: Future[str]) -> None:
        error = future.exception()
        if error is not None:
            loop.call_soon_threadsafe(on_unopened, f"the MLflow run could not be opened: {error}")

    opening = pool.submit(open_run)
    pool.shutdown(wait=False)
    opening.add_done_callback(stop_if_failed)
    return opening


def _log_inputs(tracker: tracking.Tracker, prepared: Prepared, custom: bool, log: Any) -> None:
    """Record the training data as the run's MLflow dataset input, log ``config.yaml`` and have the model
    exported ahead (a tracking failure is only logged)."""
    record = dataset_record(prepared.config, prepared, custom=custom)
    try:
        tracker.log_dataset(record.name, record.digest, record.source, record.profile)
    except Exception as exc:  # a tracking failure must not fail the run
        log.warning("tracking.dataset_failed", error=f"{type(exc).__name__}: {exc}", metrics=False)
    log_config(tracker, prepared.config, log)
    prepare_model(tracker, prepared, log)


def prepare_model(tracker: tracking.Tracker, prepared: Prepared, log: Any) -> None:
    """Have the writer process export the model's structure while the run trains, so that logging the trained
    model at the end only swaps its weights in (see :meth:`tracking.MlflowTracker.prepare_model_from`)."""
    if not (prepared.config.tracking.log_model and isinstance(tracker, tracking.MlflowTracker)):
        return
    if prepared.model_spec is None:
        return
    name, kwargs = prepared.model_spec
    try:
        tracker.prepare_model_from(
            tracked.MODEL_BUILDER, {"model": name, "weights": None, **kwargs}, input_example=example(prepared)
        )
    except Exception as exc:  # only a shortcut: the model's export at the end reports what fails
        log.debug("tracking.prepare_model_failed", error=f"{type(exc).__name__}: {exc}", metrics=False)


def log_config(tracker: tracking.Tracker, config: RunConfig, log: Any) -> None:
    """Log the run's configuration as ``config.yaml`` (secrets redacted), once its MLflow run is open: it is in
    the store while the run trains, and the store's first artifact (for MLflow, resolving where the run's
    artifacts go) is written then rather than at the end."""
    text = tracking.yaml_text(redacted(config).model_dump(mode="json"))
    try:
        tracker.log_bytes(text.encode(), "config.yaml")
    except Exception as exc:  # a tracking failure must not fail the run
        log.warning("tracking.config_failed", error=f"{type(exc).__name__}: {exc}", metrics=False)


def example(prepared: Prepared) -> np.ndarray:
    """Return the logged model's input example: the first two test inputs (its signature and ``pt2`` trace)."""
    inputs: np.ndarray = prepared.test.x[:2].detach().cpu().numpy()
    return inputs


def tag_constants(
    tracker: tracking.Tracker, constant: tracking.ConstantSeries | None, log: Any, also: Mapping[str, str] = _NO_TAGS
) -> None:
    """Tag the run with each held-back metric of ``constant`` whose value never changed (``constant/<key>``), and
    with ``also`` in the same call; a tracking failure is only logged."""
    found = constant.constants() if constant is not None else {}
    tags = {**also, **{f"constant/{key}": f"{value:.10g}" for key, value in sorted(found.items())}}
    if not tags:
        return
    try:
        tracker.set_tags(tags)
    except Exception as exc:  # a tracking failure must not fail the run
        log.warning("tracking.constants_failed", error=f"{type(exc).__name__}: {exc}", metrics=False)


def tag_alerts(tracker: tracking.Tracker, first: Mapping[str, str], log: Any) -> None:
    """Tag the run with the first alert of each kind (``alert.<kind>``); a tracking failure is only logged."""
    try:
        tracker.set_tags({f"alert.{kind}": message for kind, message in first.items()})
    except Exception as exc:  # a tracking failure must not fail the run
        log.warning("alert.tag_failed", error=f"{type(exc).__name__}: {exc}", metrics=False)
