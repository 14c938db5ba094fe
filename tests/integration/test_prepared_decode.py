"""A cohort's uploads decoded and checked in its training worker: the run is the run that decodes them on the loop."""

from __future__ import annotations

import gc
from typing import Any

import pytest

import flasync
from flasync.core.bus import EventBus
from flasync.core.events import UpdatesUploaded
from flasync.core.loops import run_loop
from flasync.runtime import build
from flasync.server.intake import Intake, RowDecoder
from flasync.testing import EventRecorder, small_config

pytestmark = pytest.mark.timeout(120)

_FACTS = ("task_id", "client_id", "base_version", "version", "staleness", "simulated_s", "reason", "num_samples")


def _facts(event: Any) -> tuple[Any, ...]:
    """What an event says of the run (its real-time figures left out): its kind and the simulated facts it carries."""
    return (type(event).__name__, *(getattr(event, name, None) for name in _FACTS))


def _batches(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Return a list that gets, for every UpdatesUploaded published from now on, whether it carries rows."""
    carried: list[bool] = []
    publish = EventBus.publish

    async def spied(bus: EventBus, event: object) -> None:
        if isinstance(event, UpdatesUploaded):
            carried.append(event.prepared is not None)
        await publish(bus, event)

    monkeypatch.setattr(EventBus, "publish", spied)
    return carried


def _taken(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Return a list that gets the size of every batch whose rows the cloud's intake takes from now on."""
    sizes: list[int] = []
    prepared = Intake._prepared

    def spied(intake: Intake, messages: Any, rows: Any) -> Any:
        taken = prepared(intake, messages, rows)
        if taken is not None:
            sizes.append(len(taken))
        return taken

    monkeypatch.setattr(Intake, "_prepared", spied)
    return sizes


def _recorded(*overrides: str) -> tuple[flasync.RunSummary, list[tuple[Any, ...]]]:
    federation = flasync.Federation(small_config("executor.kind=vectorized", *overrides))
    recorder = EventRecorder(federation.bus)
    summary = run_loop(federation.run())
    return summary, [_facts(event) for event in recorder.events]


@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param(("server={kind: fedavg, clients_per_round: 8}",), id="fedavg"),
        pytest.param(
            (
                "server={kind: fedbuff, buffer_size: 3, concurrency: 8, max_staleness: 1}",
                "population.speed={kind: constant}",
                "faults.byzantine=0.3",
                "resilience.max_update_norm=3.0",
            ),
            id="fedbuff-refusals",
        ),
        pytest.param(("server={kind: fedavg, clients_per_round: 6}", "codec.upload=[{kind: bf16}]"), id="fedavg-bf16"),
    ],
)
def test_a_run_whose_workers_decode_its_uploads_is_the_run_that_decodes_them_on_the_loop(
    overrides: tuple[str, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cloud takes rows decoded in the workers for its batches, and the run ends as one whose loop decodes every
    batch: the same weights bit for bit, counts, and events (kinds, tasks, versions, staleness, refusals) in order."""
    carried, taken = _batches(monkeypatch), _taken(monkeypatch)
    ahead, ahead_events = _recorded(*overrides)
    assert any(carried) and taken and max(taken) > 1
    monkeypatch.setattr(build, "_row_decoder", lambda *args: None)
    carried.clear()
    taken.clear()
    here, here_events = _recorded(*overrides)
    assert carried and not any(carried) and not taken  # batches still travel, decoded on the loop
    assert ahead.weights_sha256 == here.weights_sha256
    counts = ("updates_accepted", "updates_dropped", "updates_failed", "versions", "tasks_dispatched")
    assert [getattr(ahead, c) for c in counts] == [getattr(here, c) for c in counts]
    assert ahead_events == here_events
    if "faults.byzantine=0.3" in overrides:
        assert ahead.updates_dropped > 0


@pytest.mark.parametrize("executor", ["thread", "vectorized"])
def test_a_lone_upload_is_decoded_in_its_worker_and_the_run_is_the_run_that_decodes_it_on_the_loop(
    executor: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Uploads at their own times (clients of lognormal speeds) each go as a batch of one carrying the decoding its
    worker made, which the cloud takes; the run ends as one whose loop decodes each upload alone: the same weights
    bit for bit, counts and events in order."""
    overrides = ("server={kind: fedbuff, buffer_size: 3, concurrency: 6}", f"executor.kind={executor}")
    carried, taken = _batches(monkeypatch), _taken(monkeypatch)
    ahead, ahead_events = _recorded(*overrides)
    assert carried and all(carried) and 1 in taken
    monkeypatch.setattr(build, "_row_decoder", lambda *args: None)
    carried.clear()
    taken.clear()
    here, here_events = _recorded(*overrides)
    assert not any(carried) and not taken  # decoded on the loop, each upload alone
    assert ahead.weights_sha256 == here.weights_sha256
    counts = ("updates_accepted", "updates_dropped", "updates_failed", "versions", "tasks_dispatched")
    assert [getattr(ahead, c) for c in counts] == [getattr(here, c) for c in counts]
    assert ahead_events == here_events


@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param(("topology={kind: tree, fanout: [2], kappa2: 2}",), id="edges"),
        pytest.param(("secure_aggregation.enabled=true", "stop.max_versions=4"), id="secure-aggregation"),
        pytest.param(("codec.upload=[{kind: topk, ratio: 0.1}]",), id="sparse-codec"),
    ],
)
@pytest.mark.slow
def test_uploads_the_cloud_does_not_decode_in_batches_of_one_form_carry_no_rows(
    overrides: tuple[str, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Uploads that go to edges, wait for a secure group, or do not stack (a sparse codec) are decoded where they
    arrive, as without the seam: no batch carries rows and no intake takes any."""
    carried, taken = _batches(monkeypatch), _taken(monkeypatch)
    summary, _ = _recorded("server={kind: fedbuff, buffer_size: 4, concurrency: 8}", *overrides)
    assert summary.updates_accepted > 0
    assert not any(carried) and not taken


@pytest.mark.slow
def test_a_run_whose_decoder_may_hold_few_rows_makes_no_more_and_is_the_run_that_decodes_on_the_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rows made ahead are bounded all together (``RowDecoder.max_bytes``). With room for two rows, and each client's
    upload decoded alone in its worker while others wait for their times, the uploads that would pass the bound are
    decoded by the cloud as they arrive, the rows waiting reach it and never pass it, every batch's bytes come back
    once its entries are taken, and the run ends as one whose loop decodes every upload: the same weights bit for bit,
    counts and events in order. (Its events are read as they are published: a subscriber that keeps them keeps their
    rows.)"""
    overrides = ("server={kind: fedbuff, buffer_size: 3, concurrency: 6}",)
    made, take = build._row_decoder, RowDecoder._take
    decoders: list[RowDecoder] = []
    alive: list[int] = []

    def bounded(*args: Any) -> RowDecoder | None:
        decoder = made(*args)
        assert decoder is not None
        two_rows = 2 * decoder.num_params * 4
        options = {"codec": decoder.codec, "num_params": decoder.num_params, "max_norm": None, "wall": decoder.wall}
        decoders.append(RowDecoder(**options, max_bytes=two_rows))  # type: ignore[arg-type]
        return decoders[-1]

    def counted(decoder: RowDecoder, nbytes: int) -> bool:
        fits = take(decoder, nbytes)
        alive.append(decoder.alive_bytes)
        return fits

    published: list[tuple[Any, ...]] = []
    publish = EventBus.publish

    async def read(bus: EventBus, event: object) -> None:
        published.extend(_facts(e) for e in getattr(event, "members", (event,)))
        await publish(bus, event)

    monkeypatch.setattr(EventBus, "publish", read)
    monkeypatch.setattr(build, "_row_decoder", bounded)
    monkeypatch.setattr(RowDecoder, "_take", counted)
    taken = _taken(monkeypatch)
    ahead = run_loop(flasync.Federation(small_config("executor.kind=thread", *overrides)).run())
    ahead_events = list(published)
    (decoder,) = decoders
    assert taken and sum(taken) < ahead.updates_accepted + ahead.updates_dropped  # the others were left to the cloud
    assert max(alive) == decoder.max_bytes  # reached, never passed
    gc.collect()
    assert decoder.alive_bytes == 0
    monkeypatch.setattr(build, "_row_decoder", lambda *args: None)
    published.clear()
    here = run_loop(flasync.Federation(small_config("executor.kind=thread", *overrides)).run())
    assert ahead.weights_sha256 == here.weights_sha256
    counts = ("updates_accepted", "updates_dropped", "updates_failed", "versions", "tasks_dispatched")
    assert [getattr(ahead, c) for c in counts] == [getattr(here, c) for c in counts]
    assert ahead_events == published
