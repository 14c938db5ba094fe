"""The per-client table of whole runs: its rows add up to the run's counts, it leaves the weights alone, and a run
stopped and resumed logs the uninterrupted run's table; the best version's weights survive a stop and resume."""

from __future__ import annotations

import asyncio
import json
import xml.etree.ElementTree as ET
from typing import Any

import pytest

import flasync
from flasync.core.client_table import HISTOGRAMS_ARTIFACT as CLIENT_HISTOGRAMS
from flasync.core.client_table import TABLE_ARTIFACT as CLIENT_TABLE
from flasync.core.errors import CheckpointError
from flasync.runtime import checkpoint
from flasync.runtime.artifacts import HISTOGRAMS_PLOT
from flasync.runtime.selection import SELECTION
from flasync.testing import MemoryTracker, small_config
from tests.conftest import interrupt_at

FAULTY = ("faults.crash=0.2", "faults.hang=0.1", "faults.dropout=0.05", "resilience.task_timeout_s=3")
TABLE = ("tracking.client_table=true", "tracking.client_table_top=20")
REFUSING = "server.max_staleness=1"  # FedBuff with 8 in flight and K=4: some updates come too late


def _resumed(tracker: MemoryTracker) -> tuple[MemoryTracker, flasync.Federation, flasync.RunSummary]:
    """Resume the run ``tracker`` holds the checkpoints of, to its end."""
    config, state = checkpoint.decode(checkpoint.latest(tracker.artifacts))
    again = MemoryTracker()
    federation = flasync.Federation(config, tracker=again, resume=checkpoint.ResumePoint(None, state))
    summary = asyncio.run(federation.run())
    return again, federation, summary


def _table(tracker: MemoryTracker) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(tracker.artifacts[CLIENT_TABLE])
    return loaded


def _totals(table: dict[str, Any]) -> dict[str, int]:
    columns = table["columns"]
    return {
        name: sum(row[columns.index(name)] for row in table["data"])
        for name in ("tasks", "accepted", "refused", "failed", "timed_out", "upload_bytes", "download_bytes")
    }


@pytest.mark.parametrize(
    "sections",
    [
        {},
        {
            "server": {"kind": "fedbuff", "buffer_size": 4, "concurrency": 8, "max_staleness": 1},
            "topology": {"kind": "tree", "fanout": [2, 2], "buffer_size": 1},
        },
    ],
    ids=["flat", "tree-depth2"],
)
@pytest.mark.slow
def test_the_rows_add_up_to_the_runs_counts_and_leave_the_weights_alone(sections: dict[str, Any]) -> None:
    """With every client in the table, its rows sum to the summary's counts (outcomes the edges report too); the
    weights are those of a run without the table."""
    config = small_config("stop.max_versions=10", *FAULTY, *(() if sections else (REFUSING,)), **sections)
    plain = flasync.run(config)
    tracker = MemoryTracker()
    summary = flasync.run(
        config.model_copy(
            update={"tracking": config.tracking.model_copy(update={"client_table": True, "client_table_top": 20})}
        ),
        tracker=tracker,
    )
    assert summary.weights_sha256 == plain.weights_sha256
    table = _table(tracker)
    assert _totals(table) == {
        "tasks": summary.tasks_dispatched,
        "accepted": summary.updates_accepted,
        "refused": summary.updates_dropped,
        "failed": summary.updates_failed,
        "timed_out": summary.tasks_timed_out,
        "upload_bytes": summary.upload_bytes,
        "download_bytes": summary.download_bytes,
    }
    assert summary.updates_dropped > 0 and summary.updates_failed > 0  # every column is exercised
    columns = table["columns"]
    assert sum(row[columns.index("refused.stale")] for row in table["data"]) == summary.updates_dropped
    histograms = json.loads(tracker.artifacts[CLIENT_HISTOGRAMS])
    assert sum(histograms["events"]["staleness"]) == summary.updates_accepted
    assert histograms["refusals"] == {"stale": summary.updates_dropped}
    assert histograms["clients_seen"] == len(table["data"]) and not histograms["sampled"]
    chart = ET.fromstring(tracker.artifacts[HISTOGRAMS_PLOT])
    texts = {element.text for element in chart.iter() if element.text}
    assert {"Tasks per client", "Refused updates per client", "Staleness of accepted updates"} <= texts


@pytest.mark.slow
def test_a_resumed_run_logs_the_uninterrupted_runs_table() -> None:
    """Stopped at version 4 and resumed, a run with faults and refusals logs the same table and histograms as a
    run never stopped (rows are a sample: 8 of the 20 clients)."""
    config = small_config(
        "stop.max_versions=12", *FAULTY, REFUSING, *TABLE, "tracking.client_table_rows=8", "tracking.client_table_top=3"
    )
    whole = MemoryTracker()
    full = flasync.run(config, tracker=whole)
    stopped, _ = asyncio.run(interrupt_at(config, 4))
    _, state = checkpoint.decode(checkpoint.latest(stopped.artifacts))
    assert 4 <= state["version"] < 12 and len(state["accounting"]["clients"]["rows"]) == 8
    again, _, resumed = _resumed(stopped)
    assert resumed.weights_sha256 == full.weights_sha256
    assert _table(again) == _table(whole)
    assert json.loads(again.artifacts[CLIENT_HISTOGRAMS]) == json.loads(whole.artifacts[CLIENT_HISTOGRAMS])
    assert json.loads(whole.artifacts[CLIENT_HISTOGRAMS])["sampled"]


@pytest.mark.slow
def test_the_best_version_survives_a_stop_and_resume() -> None:
    """A resumed run that never beats the best version found before the stop still reports and keeps that version's
    weights as its best; a run never stopped agrees."""
    # The lowest loss of a short run is near its end; the lowest accuracy (selected here) comes early, before the
    # stop, and no later version beats it.
    config = small_config("stop.max_versions=12", "eval.every_versions=1", "eval.select=server/eval/accuracy:min")
    full_federation = flasync.Federation(config)
    full = asyncio.run(full_federation.run())
    stopped, before = asyncio.run(interrupt_at(config, 6))
    assert before.best is not None
    _, state = checkpoint.decode(checkpoint.latest(stopped.artifacts))
    assert state[SELECTION]["version"] == before.best.version < state["version"]
    _, federation, resumed = _resumed(stopped)
    assert full.best_version is not None and full.best_version < state["version"]
    assert (resumed.best_version, resumed.best_value) == (full.best_version, full.best_value)
    assert resumed.best_weights_sha256 == full.best_weights_sha256
    assert federation.best is not None and federation.best.version == full.best_version
    assert resumed.weights_sha256 == full.weights_sha256


@pytest.mark.slow
def test_the_best_version_survives_a_kill_after_a_periodic_checkpoint() -> None:
    """A run killed after its periodic checkpoint of version 10 (no checkpoint of its own at the kill) resumes from
    it with the best version found before, and logs it as its best model."""
    config = small_config(
        "stop.max_versions=14",
        "checkpoint.every_versions=5",
        "eval.every_versions=1",
        "eval.select=server/eval/accuracy:min",
        *FAULTY,
    )
    tracker = MemoryTracker()
    full = flasync.run(config, tracker=tracker)
    _, state = checkpoint.decode(checkpoint.latest(tracker.artifacts))  # what a kill after version 10 leaves
    assert state["version"] == 10 and full.best_version is not None
    assert state[SELECTION]["version"] == full.best_version < 10
    _, federation, resumed = _resumed(tracker)
    assert (resumed.best_version, resumed.best_weights_sha256) == (full.best_version, full.best_weights_sha256)
    assert federation.best is not None and federation.best.version == full.best_version
    assert resumed.weights_sha256 == full.weights_sha256


@pytest.mark.slow
def test_a_resumed_run_that_improves_keeps_its_own_best() -> None:
    """Selected by the highest accuracy, the resumed run's later, better version is its best, as in a run never
    stopped."""
    config = small_config("stop.max_versions=12", "eval.every_versions=1", "eval.select=server/eval/accuracy:max")
    full = flasync.run(config)
    stopped, _ = asyncio.run(interrupt_at(config, 3))
    _, _, resumed = _resumed(stopped)
    assert (resumed.best_version, resumed.best_weights_sha256) == (full.best_version, full.best_weights_sha256)


@pytest.mark.slow
def test_a_client_side_selection_keeps_the_weights_of_versions_still_open_across_a_resume() -> None:
    """Selected by a client-side figure, a version's weights are copied at its first report and its evaluation closes
    later: the versions still open at a stop travel in the checkpoint, and the resumed run picks the uninterrupted
    run's best version and weights."""
    config = small_config(
        "stop.max_versions=12",
        "eval.clients.fraction=0.5",
        "eval.clients.min_reports=4",
        "eval.select=client_eval/accuracy/mean:max",
    )
    full = flasync.run(config)
    stopped, _ = asyncio.run(interrupt_at(config, 6))
    _, state = checkpoint.decode(checkpoint.latest(stopped.artifacts))
    pending = state[SELECTION].get("pending", {})
    assert pending, "no version's evaluation was open at the stop: the test needs one"
    assert all(version <= state["version"] for version in pending)
    _, _, resumed = _resumed(stopped)
    assert full.best_version is not None
    assert (resumed.best_version, resumed.best_value) == (full.best_version, full.best_value)
    assert resumed.best_weights_sha256 == full.best_weights_sha256
    assert resumed.weights_sha256 == full.weights_sha256


def test_a_checkpoint_whose_best_weights_do_not_fit_is_refused() -> None:
    """The best version's weights in a checkpoint are checked like the weights: another shape is a one-line error."""
    config = small_config("stop.max_versions=8", "eval.every_versions=1", "eval.select=server/eval/loss:min")
    stopped, _ = asyncio.run(interrupt_at(config, 3))
    _, state = checkpoint.decode(checkpoint.latest(stopped.artifacts))
    state[SELECTION]["weights"] = state[SELECTION]["weights"][:-1]
    with pytest.raises(CheckpointError, match=r"selection\.weights"):
        checkpoint.decode(checkpoint.encode(state, config))


def test_a_checkpoint_whose_client_table_does_not_fit_is_refused() -> None:
    """A per-client table with more rows than the config keeps, or a negative count, is a one-line error."""
    config = small_config("stop.max_versions=8", *TABLE, "tracking.client_table_rows=4")
    stopped, _ = asyncio.run(interrupt_at(config, 3))
    _, state = checkpoint.decode(checkpoint.latest(stopped.artifacts))
    rows = state["accounting"]["clients"]["rows"]
    assert len(rows) == 4
    state["accounting"]["clients"]["rows"] = [*rows, {**rows[0], "client_id": 19}]
    with pytest.raises(CheckpointError, match=r"accounting\.clients\.rows: 5 rows, more than"):
        checkpoint.decode(checkpoint.encode(state, config))
    state["accounting"]["clients"]["rows"] = [{**rows[0], "tasks": -1}, *rows[1:]]
    with pytest.raises(CheckpointError, match=r"accounting\.clients\.rows\[0\]\.tasks"):
        checkpoint.decode(checkpoint.encode(state, config))
