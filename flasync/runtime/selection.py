"""The best model of a run: the weights of the version a metric of the evaluation rated best (``eval.select``).

:class:`BestVersion` watches the bus for :class:`~flasync.core.events.Evaluated` and copies the evaluated version's
weights when its figure beats the best so far (ties keep the earlier version). The evaluation happens anyway, every
``eval.every_versions`` versions and at the end, so keeping the best costs one copy of the flat weights per
improvement and nothing on the server loop's path.

A client-side metric (``client_eval/<metric>/<figure>``) is known only when a version's evaluation closes
(:class:`~flasync.core.events.ClientsEvaluated`), often after newer versions were made: the weights of a version are
copied at its first client report (while that client's task holds them) and kept until its evaluation closes, so
the copies held are those of the versions whose evaluation is open.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from flasync import tracking
from flasync.config import RunConfig
from flasync.config.runtime import parse_select
from flasync.core.bus import EventBus
from flasync.core.errors import CheckpointError
from flasync.core.events import ClientEvaluated, ClientsEvaluated, Evaluated, Version
from flasync.core.instruments import Instrument
from flasync.core.snapshots import ModelSnapshot
from flasync.observe.summary import RunSummary, weights_sha256
from flasync.tracking.registry import Registration, register_champion

__all__ = [
    "BEST_MODEL",
    "DEFAULT_SELECT",
    "LAST_MODEL",
    "SELECTION",
    "Best",
    "BestVersion",
    "RunModel",
    "better",
    "register_selected",
    "run_models",
    "summary_value",
    "with_best",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class Best:
    """The best version so far: its number, the metric it was selected by and that metric's value, its weights."""

    version: int
    """The model version."""
    metric: str
    """The metric key, e.g. ``server/eval/accuracy``."""
    direction: str
    """``max`` or ``min``: whether a larger or a smaller value is better."""
    value: float
    """The metric's value at ``version``."""
    weights: torch.Tensor
    """The server's flat weights of ``version`` (a copy on the host)."""


LAST_MODEL = "model"
"""The name of the run's last model among its logged models."""
BEST_MODEL = "best_model"
"""The name of the best version's model among the run's logged models (with ``eval.select``)."""
DEFAULT_SELECT = "server/eval/accuracy:max"
"""What a run without ``eval.select`` compares its registered (last) model by."""
SELECTION = "selection"
"""The checkpoint component holding the best version so far (:meth:`BestVersion.state_dict`)."""


def better(value: float, than: float, direction: str) -> bool:
    """Tell whether ``value`` is strictly better than ``than`` for ``direction`` (``max`` or ``min``); NaN never is."""
    if math.isnan(value):
        return False
    if math.isnan(than):
        return True
    return value > than if direction == "max" else value < than


class BestVersion(Instrument):
    """Keep the weights of the best version the server evaluated (see the module).

    Args:
        select: The selection, ``KEY:max`` or ``KEY:min`` (``eval.select``).
        model_of: Returns the published model of a version while it is current (the server's
            :meth:`~flasync.server.registry.TaskRegistry.base`); the evaluation publishes its event before the next
            version is made, so the evaluated version is current when the event arrives.
    """

    takes_batches = True  # it reads Evaluated only: batches of other events pass it by

    def __init__(self, select: str, model_of: Callable[[Version], ModelSnapshot | None]) -> None:
        """Select nothing yet."""
        self.metric, self.direction = parse_select(select)
        self._model_of = model_of
        self._client_side = self.metric.startswith("client_eval/")
        self._pending: dict[int, torch.Tensor] = {}
        self.best: Best | None = None
        """The best version so far (None: no evaluation yet had a finite figure)."""

    def event_published(self, event: object) -> None:
        """Copy the weights of an evaluated version that beats the best so far (see the module)."""
        if self._client_side:
            self._client_event(event)
            return
        if not isinstance(event, Evaluated):
            return
        found = event.value(self.metric)
        if found is None or not self._improves(found):
            return
        snapshot = self._model_of(event.version)
        if snapshot is None:  # not the current model any more: nothing to copy
            return
        self._keep(int(event.version), found, snapshot.exact.detach().to("cpu", copy=True))

    def _client_event(self, event: object) -> None:
        if isinstance(event, ClientEvaluated):
            version = int(event.version)
            if version not in self._pending:
                snapshot = self._model_of(event.version)
                if snapshot is not None:
                    self._pending[version] = snapshot.exact.detach().to("cpu", copy=True)
        elif isinstance(event, ClientsEvaluated):
            weights = self._pending.pop(int(event.version), None)
            found = event.value(self.metric)
            if weights is not None and found is not None and self._improves(found):
                self._keep(int(event.version), found, weights)

    def _improves(self, value: float) -> bool:
        return not math.isnan(value) and (self.best is None or better(value, self.best.value, self.direction))

    def _keep(self, version: int, value: float, weights: torch.Tensor) -> None:
        self.best = Best(version=version, metric=self.metric, direction=self.direction, value=value, weights=weights)

    def state_dict(self) -> dict[str, Any]:
        """Return the best version so far for a checkpoint: its number, value and weights, and (a client-side
        figure) the weights of the versions whose evaluation is still open, by version (empty: none of these)."""
        state: dict[str, Any] = {}
        if self._pending:
            state["pending"] = {version: weights.clone() for version, weights in sorted(self._pending.items())}
        best = self.best
        if best is None:
            return state
        return state | {
            "version": best.version,
            "metric": best.metric,
            "direction": best.direction,
            "value": best.value,
            "weights": best.weights.clone(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (no ``version``: no best version yet).

        Raises:
            CheckpointError: If the state was selected by another metric or direction than this selection's.
        """
        pending = state.get("pending", {})
        self._pending = {int(v): weights.detach().to("cpu", copy=True) for v, weights in pending.items()}
        if "version" not in state:
            self.best = None
            return
        if state["metric"] != self.metric or state["direction"] != self.direction:
            raise CheckpointError(
                f"checkpoint field {SELECTION}: selected by {state['metric']}:{state['direction']}, this run by "
                f"{self.metric}:{self.direction}"
            )
        self.best = Best(
            version=int(state["version"]),
            metric=self.metric,
            direction=self.direction,
            value=float(state["value"]),
            weights=state["weights"].detach().to("cpu", copy=True),
        )

    def attach(self, bus: EventBus) -> BestVersion:
        """Watch ``bus`` from now on; return self."""
        bus.add_instrument(self)
        return self


def with_best(summary: RunSummary, selection: BestVersion | None) -> RunSummary:
    """Return ``summary`` saying which version ``selection`` rated best, with that metric's value and the version's
    weights' hash (``summary`` itself without a selection)."""
    if selection is None:
        return summary
    metric = f"{selection.metric}:{selection.direction}"
    best = selection.best
    if best is None:
        return replace(summary, best_metric=metric)
    return replace(
        summary,
        best_version=best.version,
        best_metric=metric,
        best_value=best.value,
        best_weights_sha256=weights_sha256(best.weights),
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class RunModel:
    """A model a run logs: its name among the run's logged models, weights, and what it was selected by."""

    name: str
    """``model`` (the last version) or ``best_model``."""
    version: int
    """The model version it holds."""
    weights: torch.Tensor
    """Its flat weights (on the host)."""
    metric: str
    """The metric key it is rated by."""
    direction: str
    """``max`` or ``min``."""
    value: float
    """The metric's value at ``version``."""

    @property
    def tags(self) -> dict[str, str]:
        """Return the logged model's tags: the version, the metric with its direction, and its value."""
        return {
            "flasync.version": str(self.version),
            "flasync.metric": self.metric,
            "flasync.direction": self.direction,
            "flasync.value": repr(self.value),
        }


def run_models(summary: RunSummary, weights: torch.Tensor, best: Best | None, select: str | None) -> list[RunModel]:
    """Return the models a run logs: the last version's and, with ``best``, the best version's (the selected one
    last).

    The last model is rated by the selection's metric (``eval.select``, else :data:`DEFAULT_SELECT`) as the run's
    final evaluation found it (the server evaluates the last version before it stops).
    """
    metric, direction = parse_select(select or DEFAULT_SELECT)
    value = summary_value(summary, metric)
    models = [
        RunModel(
            name=LAST_MODEL,
            version=summary.versions,
            weights=weights,
            metric=metric,
            direction=direction,
            value=value,
        )
    ]
    if best is not None:
        models.append(
            RunModel(
                name=BEST_MODEL,
                version=best.version,
                weights=best.weights,
                metric=best.metric,
                direction=best.direction,
                value=best.value,
            )
        )
    return models


def summary_value(summary: RunSummary, metric: str) -> float:
    """Return the final evaluation's figure of ``metric`` from a run's summary: the last central evaluation's, or the
    last closed client-side evaluation's (NaN: it has none)."""
    name = metric.rpartition("/")[2]
    if metric in ("server/eval/accuracy", "server/eval/loss"):
        return float(getattr(summary, name))
    if metric.startswith("server/eval/"):
        return float(summary.eval_metrics.get(name, math.nan))
    _, figure_of, figure = [*metric.split("/"), "", ""][:3]
    return float(summary.client_eval.get(figure_of, {}).get(figure, math.nan))


def register_selected(
    tracker: tracking.Tracker, config: RunConfig, models: list[RunModel], log: Any
) -> Registration | None:
    """Register the selected model (the last of ``models``: the best, else the last version's) under
    ``tracking.register`` and move the alias ``champion`` to it when it beats the champion (see
    :func:`flasync.tracking.registry.register_champion`); say what was done on the console. A store that refuses is a
    warning (None), never a failure of the finished run."""
    name = config.tracking.register
    if name is None or not models or not isinstance(tracker, tracking.MlflowTracker) or not tracker.run_id:
        return None
    import mlflow

    chosen = models[-1]
    try:
        done = register_champion(
            mlflow.MlflowClient(tracker.tracking_uri),
            name,
            run_id=tracker.run_id,
            model_name=chosen.name,
            metric=chosen.metric,
            direction=chosen.direction,
            value=chosen.value,
            tags={"flasync.version": str(chosen.version)},
        )
    except Exception as exc:
        log.warning("tracking.register_failed", model=name, error=f"{type(exc).__name__}: {exc}"[:300], metrics=False)
        return None
    # The command line prints the message in its summary; debug keeps the console from saying it twice.
    log.debug("tracking.registered", message=done.message, metrics=False)
    return done
