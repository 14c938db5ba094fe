"""A search: Optuna's sampler draws each run's values from a space, guided by the objective of the runs before.

``[sweep.search]`` names a sampler (``tpe`` or ``random``), a number of trials, a seed and each searched field's
space. Trial ``n`` is drawn by a sampler seeded from ``(seed, n)`` with a study that holds exactly the trials before
its batch (finished ones with their objective, failed ones as failed) plus those of its own batch drawn before it;
a batch is ``parallel`` trials, drawn together and all finished before the next is drawn. So a search's trials
depend on its seed and on the runs' results only, not on when the runs end, and the study needs no store of its own:
it is rebuilt from the sweep's child runs (each keeps its trial's number and values as tags), which is how an
interrupted search resumes with the trials it had, none repeated, the interrupted ones continued.

Optuna is the ``sweep`` extra (``pip install flasync[sweep]``); it is imported when a search draws its first trial.
"""

from __future__ import annotations

import copy
import hashlib
import importlib.util
import json
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from flasync.config import RunConfig
from flasync.config.sweep import (
    CategoricalParameter,
    FloatParameter,
    IntParameter,
    SearchConfig,
    SearchParameter,
    parse_objective,
    value_text,
)
from flasync.core.errors import ConfigError
from flasync.runtime.sweep import DEFAULT_OBJECTIVE, VALUES_TAG, SweepPoint, SweepRow, point_config

if TYPE_CHECKING:
    import optuna
    from optuna.distributions import BaseDistribution

__all__ = ["SearchPlan", "trial_seed"]

_STUDY = "flasync-sweep"


def trial_seed(seed: int, trial: int) -> int:
    """Return the seed of trial ``trial``'s sampler: a function of the search's seed and the trial's number only."""
    return int(np.random.SeedSequence([seed, trial]).generate_state(1, dtype=np.uint32)[0])


class SearchPlan:
    """What a search runs: a base config (a plain mapping, before validation) and its search's settings.

    Args:
        base: The config's tables with the sweep's fixed settings applied.
        search: The sampler, the number of trials, the seed and the space.
        uri: The MLflow store every run logs to (None: the config's); kept out of :meth:`to_json`.
        objective: ``KEY:max`` or ``KEY:min``: what the search optimizes.

    Raises:
        ConfigError: Optuna is not installed, the objective is wrong, or the config is not valid at an end of a
            field's range or with one of its choices (checked before any run).
    """

    def __init__(
        self, base: Mapping[str, Any], search: SearchConfig, uri: str | None = None, objective: str = DEFAULT_OBJECTIVE
    ) -> None:
        """Check the space's ends and choices against the config."""
        if importlib.util.find_spec("optuna") is None:
            raise ConfigError("sweep.search draws its trials with Optuna: pip install 'flasync[sweep]'")
        try:
            self._direction = parse_objective(objective)[1]
        except ValueError as exc:
            raise ConfigError(f"objective {objective!r}: {exc}") from None
        self.base: dict[str, Any] = copy.deepcopy(dict(base))
        self.search = search
        self.uri = uri
        self._objective = objective
        self._texts = {key: _choices(space) for key, space in search.space.items()}
        self._template = point_config(self.base, self._probe(0), uri)
        for index in range(1, max(len(texts) for texts in self._texts.values())):
            point_config(self.base, self._probe(index), uri)

    def _probe(self, index: int) -> SweepPoint:
        """Return a trial of each field's ``index``-th end or choice (its last one past its count)."""
        values = tuple((key, texts[min(index, len(texts) - 1)]) for key, texts in self._texts.items())
        return SweepPoint(0, values, trial=True)

    @property
    def size(self) -> int:
        """The number of trials."""
        return self.search.trials

    @property
    def keys(self) -> list[str]:
        """The searched fields."""
        return list(self.search.space)

    @property
    def objective(self) -> str:
        """What the search optimizes (``KEY:max`` or ``KEY:min``)."""
        return self._objective

    @property
    def template(self) -> RunConfig:
        """The config of a trial at each field's low end (or first choice)."""
        return self._template

    @property
    def grid(self) -> str:
        """The search in one line: ``tpe search, 20 trials, seed 0: client.lr=float[0.001, 0.3] log``."""
        spaces = " ".join(f"{key}={_describe(space)}" for key, space in self.search.space.items())
        search = self.search
        return f"{search.sampler} search, {search.trials} trials, seed {search.seed}: {spaces}"

    def params(self) -> dict[str, str | int]:
        """Return the search as the parent run's params (``sweep.search.*``, ``sweep.space.<field>``)."""
        search = self.search
        params: dict[str, str | int] = {"sweep.grid": self.grid, "sweep.points": search.trials}
        params |= {"sweep.search.sampler": search.sampler, "sweep.search.seed": search.seed}
        return params | {f"sweep.space.{key}": _describe(space) for key, space in search.space.items()}

    def to_json(self) -> dict[str, Any]:
        """Return what :meth:`from_json` rebuilds the plan from (the parent run keeps it as ``sweep/plan.json``)."""
        search = self.search.model_dump(mode="json")
        return {"base": self.base, "search": search, "objective": self._objective}

    @classmethod
    def from_json(cls, data: Mapping[str, Any], uri: str | None = None) -> SearchPlan:
        """Rebuild a plan from :meth:`to_json`'s mapping (its runs logging to ``uri``)."""
        search = SearchConfig.model_validate(data["search"])
        return cls(data["base"], search, uri, str(data.get("objective", DEFAULT_OBJECTIVE)))

    @property
    def key(self) -> str:
        """A digest of the base config, the search and the objective (16 hex digits)."""
        text = json.dumps(self.to_json(), sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def point_named(self, name: str, tags: Mapping[str, str]) -> SweepPoint | None:
        """Return the trial a child run ran, from its ``flasync.sweep.values`` tag (None: not one of this search's
        trials)."""
        try:
            recorded = json.loads(tags.get(VALUES_TAG, ""))
            point = SweepPoint(int(recorded["index"]), tuple((str(k), str(v)) for k, v in recorded["values"]), True)
        except (ValueError, KeyError, TypeError):
            return None
        keys = [key for key, _ in point.values]
        return point if point.name == name and keys == self.keys and point.index < self.size else None

    def config_of(self, point: SweepPoint) -> RunConfig:
        """Return the validated config of a trial."""
        return point_config(self.base, point, self.uri)

    def batches(
        self, rows: Mapping[int, SweepRow], unfinished: Sequence[SweepPoint], parallel: int
    ) -> Iterator[list[tuple[SweepPoint, RunConfig]]]:
        """Yield the trials without a row ``parallel`` at a time: trials ``k * parallel`` to ``(k + 1) * parallel - 1``
        drawn together once every trial before them has its row, the ones begun before (``unfinished``) with the
        values they had, until ``trials`` have run.

        Each batch's trials are drawn again in full, so a batch of which some trials had finished, some had begun and
        some had not yet started when the sweep was interrupted gets the values the uninterrupted search drew (with
        the same ``parallel``)."""
        begun = {point.index: point for point in unfinished}
        done_before = -1
        while True:
            start = next((i - i % parallel for i in range(self.size) if i not in rows), None)
            if start is None or start <= done_before:
                return
            done_before = start
            study = self._study({index: row for index, row in rows.items() if index < start})
            batch = []
            for index in range(start, min(start + parallel, self.size)):
                drawn = self._draw(study, index)
                if index not in rows:
                    point = begun.get(index, drawn)
                    batch.append((point, self.config_of(point)))
            yield batch

    def _draw(self, study: optuna.Study, index: int) -> SweepPoint:
        """Ask ``study`` for trial ``index``'s values with that trial's own seeded sampler."""
        import optuna

        seed = trial_seed(self.search.seed, index)
        tpe = self.search.sampler == "tpe"
        study.sampler = optuna.samplers.TPESampler(seed=seed) if tpe else optuna.samplers.RandomSampler(seed=seed)
        trial = study.ask(self._distributions())
        values = tuple((key, self._text(key, trial.params[key])) for key in self.keys)
        return SweepPoint(index, values, trial=True)

    def _study(self, rows: Mapping[int, SweepRow]) -> optuna.Study:
        """Return an in-memory study of the trials ``rows`` holds, in their numbers' order: a finished one with its
        objective, any other as failed (the samplers learn from finished ones only)."""
        import optuna
        from optuna.trial import TrialState, create_trial

        storage = optuna.storages.InMemoryStorage()
        direction = optuna.study.StudyDirection.MAXIMIZE if self._direction == "max" else None
        direction = direction or optuna.study.StudyDirection.MINIMIZE
        storage.create_new_study([direction], _STUDY)
        study = optuna.Study(study_name=_STUDY, storage=storage)
        distributions = self._distributions()
        for index in sorted(rows):
            row = rows[index]
            params = {key: self._value(key, text) for key, text in row.values.items() if key in distributions}
            if set(params) != set(distributions):
                continue
            done = row.status == "FINISHED" and math.isfinite(row.objective)
            study.add_trial(
                create_trial(
                    params=params,
                    distributions=distributions,
                    value=row.objective if done else None,
                    state=TrialState.COMPLETE if done else TrialState.FAIL,
                )
            )
        return study

    def _distributions(self) -> dict[str, BaseDistribution]:
        """Return Optuna's distribution of each searched field (a categorical one over its choices' texts)."""
        from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

        out: dict[str, BaseDistribution] = {}
        for key, space in self.search.space.items():
            if isinstance(space, IntParameter):
                out[key] = IntDistribution(space.low, space.high, log=space.log, step=space.step)
            elif isinstance(space, FloatParameter):
                out[key] = FloatDistribution(space.low, space.high, log=space.log, step=space.step)
            else:
                out[key] = CategoricalDistribution(self._texts[key])
        return out

    def _text(self, key: str, value: Any) -> str:
        """Return a drawn value as its ``--set`` text."""
        space = self.search.space[key]
        if isinstance(space, IntParameter):
            return str(int(value))
        if isinstance(space, FloatParameter):
            return value_text(float(value))
        return str(value)  # a categorical draw is one of the choices' texts

    def _value(self, key: str, text: str) -> Any:
        """Return a recorded ``--set`` text as the value Optuna drew."""
        space = self.search.space[key]
        if isinstance(space, IntParameter):
            return int(text)
        if isinstance(space, FloatParameter):
            return float(text)
        return text


def _choices(space: SearchParameter) -> list[str]:
    """Return the texts a space is checked with: its ends, or each of its choices."""
    if isinstance(space, CategoricalParameter):
        return [value_text(choice) for choice in space.choices]
    if isinstance(space, IntParameter):
        return [str(space.low), str(space.high)]
    return [value_text(space.low), value_text(space.high)]


def _describe(space: SearchParameter) -> str:
    """Return a space in a few words: ``float[0.001, 0.3] log``, ``int[1, 5]``, ``{fedavg, fedbuff}``."""
    if isinstance(space, CategoricalParameter):
        return "{" + ", ".join(value_text(choice) for choice in space.choices) + "}"
    step = f" step {space.step}" if space.step not in (None, 1) else ""
    return f"{space.kind}[{space.low}, {space.high}]" + (" log" if space.log else "") + step
