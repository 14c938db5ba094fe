"""Client-side (federated) evaluation as a plug-in: clients evaluate the model they downloaded, the server sums up.

A task chosen to evaluate (``eval.clients.fraction`` of tasks, a draw keyed by client and participation, or every
``eval.clients.every``-th participation of each client) evaluates, in its worker thread once its training is done,
either the model it downloaded (``when = "before"``) or the model it trained from it (``"after"``) on the client's
held-out samples (a split of each client's samples the partitioner made, never trained on). When the training ends
in (virtual) time the client publishes a :class:`~flasync.core.events.ClientEvaluated` report, attributed to the
version it downloaded; a task abandoned before then reports nothing. Remote clients send the same report over HTTP.

:class:`ClientEvaluation` is the clients' side (a :class:`~flasync.training.plugins.ClientPlugin`); the tasks of a
vectorized cohort evaluate together: the held-out samples of the cohort's clients that evaluate one model pass
through it in shared batches (:func:`~flasync.training.local.evaluate_segments`). :class:`EvaluationSummary` is the
server's side: it gathers the reports per version and closes a version's evaluation once ``min_reports`` reports
arrived or ``deadline_s`` (simulated) seconds passed since the version was published, then logs the figures of
:func:`~flasync.aggregation.evaluation.summarize` as ``client_eval/<metric>/<figure>`` at step = version. Open
versions close when the run finishes (an interrupted run's stay open in its checkpoint). It is a
:class:`~flasync.training.plugins.ServerPlugin` (its open versions are checkpoint state) that reads the reports off
the bus as an :class:`~flasync.core.instruments.Instrument`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from flasync.aggregation.evaluation import Report, summarize
from flasync.core import seeding
from flasync.core.client_table import ClientFigures
from flasync.core.errors import BusClosed, BusFull
from flasync.core.events import ClientEvaluated, ClientId, ClientsEvaluated, RunFinished, TaskAssigned, Version
from flasync.core.instruments import Instrument
from flasync.core.snapshots import ModelSnapshot
from flasync.training.executors.threads import ModelPool
from flasync.training.local import EvalResult, LocalResult, evaluate_segments
from flasync.training.metrics import MetricSet
from flasync.training.plugins import ClientPlugin, ServerPlugin, TaskPart

_INTERRUPTED = "interrupted"  # flasync.server.stopping.INTERRUPTED (the server's layer is not below this one)

__all__ = ["ClientEvaluation", "EvaluationSummary", "HeldOut", "Selection", "evaluates"]

HeldOut = Callable[[int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
"""A client id -> ``(x, y, rows)``: its held-out samples are ``x[rows]``, ``y[rows]``."""


@dataclass(frozen=True, slots=True)
class Selection:
    """Which tasks evaluate: a share of them, drawn per client and participation, or every Nth participation.

    Attributes:
        seed: The run's seed.
        fraction: Share of tasks that evaluate (with ``every`` None).
        every: Every Nth participation of each client evaluates (its 1st, N+1st, ...; None: by ``fraction``).
    """

    seed: int
    fraction: float = 0.0
    every: int | None = None


def evaluates(selection: Selection, client_id: int, participation: int) -> bool:
    """Tell whether a client's ``participation``-th task (0-based) evaluates: the same answer whoever asks, whenever."""
    if selection.every is not None:
        return participation % selection.every == 0
    if selection.fraction <= 0.0:
        return False
    return seeding.stream_uniform(selection.seed, seeding.CLIENT_EVAL, 1, client_id, participation) < selection.fraction


class ClientEvaluation(ClientPlugin):
    """The clients' side of client-side evaluation (checkpoint component ``client_eval``; it keeps no state).

    Args:
        selection: Which tasks evaluate.
        when: ``before`` or ``after`` local training.
        held_out: Each client's held-out samples.
        models: The worker threads' models (an evaluation loads the weights into the worker's own).
        metrics: What an evaluation computes besides accuracy and loss.
        publish: Sends a report (the run's bus's ``publish_nowait``).
        now: The clock's simulated seconds.
        batch_size: Samples per evaluation batch.
        wall: Monotonic real seconds (the evaluation's ``eval_s``).
        regression: Whether the task is a regression (loss: mean squared error; accuracy: NaN).
        personal: Client id, downloaded weights -> the client's own model (``client.personal``; e.g.
            :meth:`flasync.algorithms.personal.LocalLayers.personal`), evaluated beside the downloaded one: its
            figures are reported as ``personal/<metric>`` (``when = "before"`` only; None: no personal model).
        adapt: Client id, participation, weights -> the personal model made of them in the worker thread, e.g.
            :class:`flasync.algorithms.personal.FineTune` (None: none).
    """

    name = "client_eval"

    def __init__(
        self,
        selection: Selection,
        when: Literal["before", "after"],
        held_out: HeldOut,
        models: ModelPool,
        metrics: MetricSet,
        publish: Callable[[object], None],
        now: Callable[[], float],
        *,
        batch_size: int = 1024,
        wall: Callable[[], float] = time.perf_counter,
        regression: bool = False,
        personal: Callable[[int, torch.Tensor], torch.Tensor] | None = None,
        adapt: Callable[[int, int, torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        """Bind what the evaluations need."""
        if (personal is not None or adapt is not None) and when != "before":
            raise ValueError("a personal model is evaluated before local training only")
        self.selection = selection
        self.when = when
        self.held_out = held_out
        self.models = models
        self.metrics = metrics
        self.publish = publish
        self.now = now
        self.batch_size = batch_size
        self.wall = wall
        self.regression = regression
        self.personal = personal
        self.adapt = adapt

    def task(self, task: TaskAssigned, model: ModelSnapshot) -> TaskPart | None:
        """Return the evaluation part of a task chosen to evaluate (None for the others, and for a client that holds
        out no sample: it has nothing to report)."""
        client = int(task.client_id)
        if not evaluates(self.selection, client, task.participation) or self.held_out(client)[2].numel() == 0:
            return None
        own = None if self.personal is None else self.personal(client, model.weights)
        if own is None and self.adapt is not None:
            own = model.weights
        return _EvalPart(self, task, model.weights, own)


class _EvalPart(TaskPart):
    """A task's evaluation: made in the worker (with its cohort's, see :meth:`finish_together`), reported on keep."""

    __slots__ = ("base", "own", "own_result", "owner", "result", "task")

    def __init__(
        self, owner: ClientEvaluation, task: TaskAssigned, base: torch.Tensor, own: torch.Tensor | None = None
    ) -> None:
        self.owner = owner
        self.task = task
        self.base = base
        self.own = own
        self.result: tuple[EvalResult, float] | None = None
        self.own_result: EvalResult | None = None

    @classmethod
    def finish_together(cls, parts: Sequence[TaskPart], results: Sequence[LocalResult]) -> None:
        """Evaluate the parts not evaluated yet: those that evaluate one model in shared batches (see the module)."""
        groups: dict[int, list[tuple[_EvalPart, torch.Tensor]]] = {}
        for part, result in zip(parts, results, strict=True):
            if not isinstance(part, _EvalPart) or part.result is not None:
                continue
            if part.owner.when == "before":
                weights, key = part.base, id(part.base)
            else:
                weights = part.base.to(result.delta.device) - result.delta
                key = id(weights)
            groups.setdefault(key, []).append((part, weights))
        for members in groups.values():
            _evaluate_group(members)
        for part in parts:
            if isinstance(part, _EvalPart) and part.own is not None and part.own_result is None:
                part.own_result = _evaluate_own(part, part.own)

    def keep(self, finished: Any) -> None:
        """Publish the report, now that the training ended in (virtual) time."""
        if self.result is None:
            return
        result, eval_s = self.result
        owner, task = self.owner, self.task
        metrics = dict(result.metrics)
        if self.own_result is not None:
            own = self.own_result
            metrics.update({f"personal/{k}": v for k, v in own.metrics.items()})
            metrics.update({"personal/accuracy": own.accuracy, "personal/loss": own.loss})
        # A report is a figure: a full blocking subscription of the bus misses it rather than failing the task.
        with contextlib.suppress(BusFull, BusClosed):
            owner.publish(
                ClientEvaluated(
                    client_id=ClientId(task.client_id),
                    task_id=task.task_id,
                    version=task.base_version,
                    when=owner.when,
                    num_samples=result.num_samples,
                    accuracy=result.accuracy,
                    loss=result.loss,
                    metrics=metrics,
                    simulated_s=owner.now(),
                    eval_s=eval_s,
                )
            )


def _evaluate_group(members: list[tuple[_EvalPart, torch.Tensor]]) -> None:
    """Evaluate one model on the held-out samples of several tasks, in shared batches; store each task's result."""
    owner = members[0][0].owner
    start = owner.wall()
    model = owner.models.get()
    device = model.flat.device
    xs, ys, sizes = [], [], []
    for part, _ in members:
        x, y, rows = owner.held_out(int(part.task.client_id))
        xs.append(x[rows])
        ys.append(y[rows])
        sizes.append(int(rows.numel()))
    x_all = torch.cat(xs).to(device, non_blocking=True)
    y_all = torch.cat(ys).to(device, non_blocking=True)
    weights = members[0][1].to(device)
    evaluated = evaluate_segments(
        model,
        weights,
        x_all,
        y_all,
        sizes,
        batch_size=owner.batch_size,
        metrics=owner.metrics,
        regression=owner.regression,
    )
    share = (owner.wall() - start) / len(members)
    for (part, _), result in zip(members, evaluated, strict=True):
        part.result = (result, share)


def _evaluate_own(part: _EvalPart, weights: torch.Tensor) -> EvalResult:
    """Evaluate a task's personal model on its client's held-out samples, adapted first (fine-tuned) when the owner
    adapts; its seconds count in the task's."""
    owner = part.owner
    start = owner.wall()
    model = owner.models.get()
    device = model.flat.device
    client = int(part.task.client_id)
    if owner.adapt is not None:
        weights = owner.adapt(client, part.task.participation, weights)
    x, y, rows = owner.held_out(client)
    (result,) = evaluate_segments(
        model,
        weights.to(device),
        x[rows].to(device),
        y[rows].to(device),
        [int(rows.numel())],
        batch_size=owner.batch_size,
        metrics=owner.metrics,
    )
    if part.result is not None:
        part.result = (part.result[0], part.result[1] + owner.wall() - start)
    return result


@dataclass(slots=True)
class _Open:
    """A version's evaluation while it gathers reports."""

    published_s: float
    reports: list[Report] = field(default_factory=list)
    eval_s: float = 0.0


class EvaluationSummary(ServerPlugin, Instrument):
    """The server's side of client-side evaluation: reports gathered per version, summed up when it closes
    (checkpoint component ``client_eval_versions``).

    Args:
        names: The metrics a report holds (``accuracy``, ``loss`` and those ``eval.metrics`` adds).
        min_reports: A version closes once this many reports for it arrived.
        deadline_s: ... or once this many simulated seconds passed since it was published, with a report (None: no
            deadline).
        now: The clock's simulated seconds.
        log: The run's logger (the figures are metric lines).
        publish: Sends a :class:`~flasync.core.events.ClientsEvaluated` for each closed version (the run's bus's
            ``publish_nowait``; None: nothing is sent).
        clients: Where each report's figures are also recorded per client (the per-client table,
            ``tracking.client_table``; None: nowhere).
    """

    name = "client_eval_versions"
    takes_batches = True  # it reads ClientEvaluated and RunFinished only

    def __init__(
        self,
        names: Sequence[str],
        *,
        min_reports: int,
        deadline_s: float | None,
        now: Callable[[], float],
        log: Any,
        publish: Callable[[object], None] | None = None,
        clients: ClientFigures | None = None,
    ) -> None:
        """Gather nothing yet."""
        self.clients = clients
        self.names = tuple(names)
        self.min_reports = min_reports
        self.deadline_s = deadline_s
        self.now = now
        self.log = log
        self.publish = publish
        self._published: dict[int, float] = {}
        self._open: dict[int, _Open] = {}
        self._closed: set[int] = set()
        self.late = 0
        """Reports that arrived for a version already closed (not in its figures)."""
        self.last: tuple[int, dict[str, dict[str, float]]] | None = None
        """The version whose evaluation closed last, and its figures (None: none closed yet)."""

    def version_made(self, version: int, log: Any) -> None:
        """Note when ``version`` was published; close the versions whose deadline passed."""
        now = self.now()
        self._published[version] = now
        self._close_overdue(now)

    def event_published(self, event: object) -> None:
        """Take a report into its version; close what is due (all that is open when the run finishes)."""
        if isinstance(event, ClientEvaluated):
            self._take(event)
        elif isinstance(event, RunFinished) and event.reason != _INTERRUPTED:
            # An interrupted run's open versions stay open in its checkpoint: the resumed run closes them.
            for version in sorted(self._open):
                self._close(version, "end")

    def _take(self, event: ClientEvaluated) -> None:
        version = int(event.version)
        now = self.now()
        if self.clients is not None:  # the client's latest figures, late or not
            self.clients.record(int(event.client_id), event.figures())
        if version in self._closed:
            self.late += 1
            return
        opened = self._open.get(version)
        if opened is None:
            opened = self._open[version] = _Open(self._published.pop(version, 0.0))
        opened.reports.append(Report(event.num_samples, event.figures()))
        opened.eval_s += event.eval_s
        if len(opened.reports) >= self.min_reports:
            self._close(version, "min_reports")
        self._close_overdue(now)

    def _close_overdue(self, now: float) -> None:
        deadline = self.deadline_s
        if deadline is None:
            return
        for version in sorted(self._open):
            if now - self._open[version].published_s >= deadline:
                self._close(version, "deadline")

    def _close(self, version: int, reason: str) -> None:
        opened = self._open.pop(version)
        self._closed.add(version)
        figures = summarize(opened.reports, self.names)
        self.last = (version, figures)
        samples = sum(report.num_samples for report in opened.reports)
        self.log.debug(  # a metric line, not a console line: versions close as often as they are made
            "client_eval.version",
            step=version,
            version=version,
            reports=len(opened.reports),
            samples=samples,
            eval_s=opened.eval_s,
            late=self.late,
            closed_by=reason,
        )
        for name, values in figures.items():
            self.log.debug(f"client_eval.{name}", step=version, **values)
        if self.publish is not None:
            self.publish(
                ClientsEvaluated(
                    version=Version(version),
                    reports=len(opened.reports),
                    samples=samples,
                    figures=figures,
                    closed_by=reason,
                )
            )

    def state_dict(self) -> dict[str, Any]:
        """Return the versions open and closed, with the reports gathered so far."""
        return {
            "published": dict(self._published),
            "open": {
                version: {
                    "published_s": opened.published_s,
                    "eval_s": opened.eval_s,
                    "reports": [(r.num_samples, dict(r.figures)) for r in opened.reports],
                }
                for version, opened in self._open.items()
            },
            "closed": sorted(self._closed),
            "late": self.late,
            "last": self.last,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self._published = {int(k): float(v) for k, v in state.get("published", {}).items()}
        self._open = {
            int(version): _Open(
                float(opened["published_s"]),
                [Report(int(n), {str(k): float(v) for k, v in figures.items()}) for n, figures in opened["reports"]],
                float(opened["eval_s"]),
            )
            for version, opened in state.get("open", {}).items()
        }
        self._closed = {int(v) for v in state.get("closed", [])}
        self.late = int(state.get("late", 0))
        last = state.get("last")
        self.last = None if last is None else (int(last[0]), {str(k): dict(v) for k, v in last[1].items()})
