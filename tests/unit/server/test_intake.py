"""The intake: each refusal with its reason, the forged ones refused before they can close a task."""

from __future__ import annotations

import gc
import math
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flasync import codecs
from flasync.aggregation.scaffold import ControlVariate
from flasync.algorithms.scaffold import ScaffoldServer
from flasync.codecs.validation import UpdateValidator
from flasync.core.events import ClientId, UpdateUploaded, Version
from flasync.server import Admitted, Intake, Refused
from flasync.server.intake import Decoded, RowDecoder
from flasync.testing import ServerHarness
from tests.unit.server.stand_ins import TasksInFlight

pytestmark = pytest.mark.timeout(30)

N = 4


def _upload(task_id: int, client: int, base: int, delta: torch.Tensor | bytes) -> UpdateUploaded:
    payload = delta if isinstance(delta, bytes) else codecs.Pipeline().encode(delta).payload
    return UpdateUploaded(
        task_id=task_id,
        client_id=ClientId(client),
        base_version=Version(base),
        num_samples=10,
        payload=payload,
        train_loss=0.0,
        simulated_s=0.0,
        sent_wall_s=0.0,
    )


def _Tasks(*tasks: tuple[int, int, int]) -> TasksInFlight:
    """The tasks in flight, of a model of ``N`` parameters."""
    return TasksInFlight(N, *tasks)


def _intake(tasks: _Tasks, **kwargs: object) -> Intake:
    options: dict[str, object] = {"max_staleness": None, "clip_norm": None}
    options.update(kwargs)
    return Intake(
        registry=tasks,  # type: ignore[arg-type]
        codec=codecs.Pipeline(),
        num_params=N,
        device=torch.device("cpu"),
        validator=UpdateValidator(N, max_norm=options.pop("max_norm", None)),  # type: ignore[arg-type]
        wall=lambda: 0.0,
        **options,  # type: ignore[arg-type]
    )


def test_an_answer_to_a_task_in_flight_is_admitted_and_releases_it() -> None:
    """A good update is admitted with its staleness and norm, and its task is released."""
    tasks = _Tasks((0, 3, 1))
    verdict = _intake(tasks).admit(_upload(0, 3, 1, torch.full((N,), 0.5)), version=4)
    assert isinstance(verdict, Admitted)
    assert verdict.staleness == 3 and verdict.norm == pytest.approx(1.0)
    assert tasks.released == [0]


def test_a_version_never_published_is_refused_without_closing_the_task() -> None:
    """A forged base version is refused before release: the real answer can still come."""
    tasks = _Tasks((0, 3, 9))
    verdict = _intake(tasks).admit(_upload(0, 3, 9, torch.zeros(N)), version=4)
    assert verdict == Refused("unknown_version", "base version 9 was never published")
    assert tasks.released == []


def test_an_answer_to_no_task_is_unexpected() -> None:
    """An upload for a task not in flight is refused as unexpected."""
    verdict = _intake(_Tasks()).admit(_upload(7, 3, 0, torch.zeros(N)), version=0)
    assert isinstance(verdict, Refused) and verdict.reason == "unexpected"


def test_staleness_over_the_limit_is_refused_after_release() -> None:
    """Too stale: refused as 'stale', and the task is over (it answered)."""
    tasks = _Tasks((0, 1, 0))
    verdict = _intake(tasks, max_staleness=2).admit(_upload(0, 1, 0, torch.zeros(N)), version=3)
    assert isinstance(verdict, Refused) and verdict.reason == "stale"
    assert tasks.released == [0]


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        (b"garbage", "decode"),
        (codecs.Pipeline().encode(torch.zeros(N + 1)).payload, "decode"),
        (codecs.Pipeline().encode(torch.tensor([1.0, math.nan, 0.0, 0.0])).payload, "non_finite"),
        (codecs.Pipeline().encode(torch.full((N,), 100.0)).payload, "norm"),
    ],
    ids=["garbage", "wrong-length", "nan", "norm"],
)
def test_unusable_updates_are_refused_with_their_reason(payload: bytes, reason: str) -> None:
    """Bytes that do not decode to the model's length, NaN, or a norm over the bound are refused by name."""
    verdict = _intake(_Tasks((0, 1, 0)), max_norm=10.0).admit(_upload(0, 1, 0, payload), version=0)
    assert isinstance(verdict, Refused) and verdict.reason == reason


def test_admitted_updates_are_clipped_and_their_norm_remembered() -> None:
    """Clipping scales the admitted delta to the bound; accepted() adds its norm to the validator's history."""
    intake = _intake(_Tasks((0, 1, 0)), clip_norm=1.0)
    verdict = intake.admit(_upload(0, 1, 0, torch.full((N,), 3.0)), version=0)
    assert isinstance(verdict, Admitted)
    assert float(torch.linalg.vector_norm(verdict.delta)) == pytest.approx(1.0)
    assert verdict.norm == pytest.approx(6.0)
    intake.accepted(verdict)
    assert intake.state_dict() == {"validator_norms": [pytest.approx(6.0)]}


async def test_the_cloud_counts_each_refusal_once_and_keeps_serving() -> None:
    """Through a whole server: a NaN client's tasks are refused (not failed), counted once each, and the run ends."""
    harness = ServerHarness(
        max_versions=3,
        clients=lambda bus, clock: _nan_for_odd_clients(bus, clock),
    )
    stats = await harness.run()
    refused = harness.log.events("server.rejected")
    assert stats.versions == 3
    assert stats.updates_dropped == len(refused) > 0 == stats.updates_failed
    assert stats.drop_reasons == {"non_finite": len(refused)}


def _nan_for_odd_clients(bus: object, clock: object) -> object:
    from flasync.testing import ScriptedClients

    return ScriptedClients(
        bus,  # type: ignore[arg-type]
        clock,  # type: ignore[arg-type]
        N,
        delta=lambda task: torch.full((N,), math.nan if int(task.client_id) % 2 else 0.01),
    )


def _with_control(control: bytes) -> UpdateUploaded:
    return UpdateUploaded(
        task_id=0,
        client_id=ClientId(1),
        base_version=Version(0),
        num_samples=10,
        payload=codecs.Pipeline().encode(torch.zeros(4)).payload,
        extra=control,
        train_loss=0.0,
        simulated_s=0.0,
        sent_wall_s=0.0,
    )


@pytest.mark.parametrize(
    ("control", "reason"),
    [
        (b"", "decode"),
        (b"garbage", "decode"),
        (codecs.Pipeline().encode(torch.zeros(5)).payload, "decode"),
        (codecs.Pipeline().encode(torch.tensor([0.0, float("inf"), 0.0, 0.0])).payload, "non_finite"),
    ],
    ids=["missing", "garbage", "wrong-length", "inf"],
)
def test_a_broken_control_variate_is_refused_by_name(control: bytes, reason: str) -> None:
    """A missing, undecodable, wrong-length or non-finite Delta c_i is refused, never folded into c."""
    scaffold = ScaffoldServer(ControlVariate(N, num_clients=1), codecs.Pipeline())
    verdict = _intake(_Tasks((0, 1, 0)), plugins=[scaffold]).admit(_with_control(control), version=0)
    assert isinstance(verdict, Refused) and verdict.reason == reason
    assert scaffold.controls.count == 0


def test_uploads_decoded_together_are_admitted_as_if_decoded_alone() -> None:
    """A batch's deltas and norms, decoded together, give each upload the verdict it gets alone, the same delta bit
    for bit; a non-finite delta among them is still refused by name."""
    deltas = [torch.tensor([0.5, -1.0, 2.0, 0.25]) * (k + 1) for k in range(3)] + [torch.tensor([1.0, math.nan, 0, 0])]
    uploads = [_upload(k, k, 0, delta) for k, delta in enumerate(deltas)]
    together = _intake(_Tasks(*((k, k, 0) for k in range(4))))
    decoded = together.decode(uploads)
    assert all(entry.norm is not None for entry in decoded)  # decoded as one batch: norms taken together
    alone = _intake(_Tasks(*((k, k, 0) for k in range(4))))
    for upload, entry in zip(uploads, decoded, strict=True):
        batched, single = together.admit(upload, version=1, decoded=entry), alone.admit(upload, version=1)
        if isinstance(single, Refused):
            assert batched == single and single.reason == "non_finite"
            continue
        assert isinstance(batched, Admitted) and isinstance(single, Admitted)
        assert torch.equal(batched.delta, single.delta) and batched.norm == pytest.approx(single.norm, rel=1e-6)
        assert batched.staleness == single.staleness == 1


def test_uploads_of_mixed_forms_and_an_upload_alone_are_decoded_one_by_one() -> None:
    """A batch that is not all of one dense form (a sparse payload, a broken one), and one upload alone, are decoded
    upload by upload: a broken payload's entry says why, and admission refuses it by name after its task checks."""
    dense = _upload(0, 0, 0, torch.ones(N))
    sparse = _upload(1, 1, 0, codecs.Pipeline([codecs.TopK(ratio=0.5)]).encode(torch.ones(N)).payload)
    junk = _upload(2, 2, 0, b"junk")
    intake = _intake(_Tasks((0, 0, 0), (1, 1, 0), (2, 2, 0)))
    mixed = intake.decode([dense, sparse])
    assert [entry.norm for entry in mixed] == [None, None]  # each alone: the validator takes the norms
    assert mixed[0].delta is not None and torch.equal(mixed[0].delta, torch.ones(N))
    assert mixed[1].delta is not None and int((mixed[1].delta != 0).sum()) == N // 2  # the top half sent
    broken = intake.decode([dense, junk])
    assert broken[0].delta is not None and broken[1].delta is None and broken[1].error
    (alone,) = intake.decode([dense])
    assert alone.norm is None and alone.delta is not None
    verdict = intake.admit(junk, version=0, decoded=broken[1])
    assert isinstance(verdict, Refused) and verdict.reason == "decode" and verdict.detail == broken[1].error
    stale = _intake(_Tasks((2, 2, 0)), max_staleness=0).admit(junk, version=1, decoded=broken[1])
    assert isinstance(stale, Refused) and stale.reason == "stale"  # the task's checks come before the payload's


def _checking_intake(tasks: _Tasks) -> Intake:
    """An intake with every check on: staleness, max_norm, the norm bound and the z-score."""
    validator = UpdateValidator(N, max_norm=50.0, zscore_threshold=3.0, window=6, min_history=3, norm_bound_factor=4.0)
    return Intake(
        registry=tasks,  # type: ignore[arg-type]
        codec=codecs.Pipeline(),
        num_params=N,
        device=torch.device("cpu"),
        validator=validator,
        max_staleness=1,
        clip_norm=None,
        wall=lambda: 0.0,
    )


def _random_batch(seed: int, count: int, wrong_size: bool) -> tuple[list[UpdateUploaded], list[tuple[int, int, int]]]:
    """Uploads of every fate (good, norm over the bound, NaN, Inf, stale, no such task, a wrong length) and the
    tasks in flight they may answer."""
    generator = torch.Generator().manual_seed(seed)
    uploads, tasks = [], []
    for k in range(count):
        fate = int(torch.randint(0, 8, (1,), generator=generator))
        delta = torch.randn(N, generator=generator) * float(torch.empty(1).uniform_(0.5, 4.0, generator=generator))
        base = 0 if fate == 4 else int(torch.randint(1, 3, (1,), generator=generator))  # version 2: base 0 is stale
        if fate == 1:
            delta = delta * 100.0  # over max_norm
        elif fate == 2:
            delta[k % N] = math.nan
        elif fate == 3:
            delta[k % N] = math.inf
        elif fate == 6:
            delta = delta * 8.0  # may pass max_norm but not the norm bound or the z-score
        uploads.append(_upload(k, k, base, delta))
        if fate != 5:  # 5: answers no task in flight
            tasks.append((k, k, base))
    if wrong_size:
        at = count // 2
        uploads[at] = _upload(at, at, 1, torch.ones(N + 1))
    return uploads, tasks


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), count=st.integers(2, 16), wrong_size=st.booleans())
def test_a_batch_checked_together_is_admitted_as_its_uploads_are_one_by_one(
    seed: int, count: int, wrong_size: bool
) -> None:
    """Random batches with refusals of every kind (a norm over the bound, NaN, Inf, stale, no such task, the wrong
    length, the norm bound and the z-score) get, upload by upload in order, what each gets when its checks are all
    made at its admission: the same refusals, deltas bit for bit, the same norms, the same history; and the verdicts
    of uploads admitted alone, each decoded by itself."""
    uploads, tasks = _random_batch(seed, count, wrong_size)
    together, checked_late, alone = (_checking_intake(_Tasks(*tasks)) for _ in range(3))
    entries = together.decode(uploads)
    assert all((entry.alone is None) == wrong_size for entry in entries)  # stacked and checked unless one is off
    for upload, entry in zip(uploads, entries, strict=True):
        outcomes = (
            together.admit(upload, version=2, decoded=entry),
            checked_late.admit(upload, version=2, decoded=entry._replace(alone=None)),
            alone.admit(upload, version=2),
        )
        for intake, outcome in zip((together, checked_late, alone), outcomes, strict=True):
            if isinstance(outcome, Admitted):
                intake.accepted(outcome)
        first, second, third = outcomes
        if isinstance(first, Refused):
            assert first == second and isinstance(third, Refused) and third.reason == first.reason
            continue
        assert isinstance(second, Admitted) and isinstance(third, Admitted)
        assert torch.equal(first.delta, second.delta) and torch.equal(first.delta, third.delta)
        assert first.norm == second.norm and first.norm == pytest.approx(third.norm, rel=1e-6)
        assert first.staleness == second.staleness == third.staleness
    assert together.validator.norms == checked_late.validator.norms


# ----------------------------------------------------------------------------------- rows decoded ahead (RowDecoder)
_STACKED_CODECS = {
    "float32": codecs.Pipeline(),
    "float16": codecs.Pipeline([codecs.Float16()]),
    "bfloat16": codecs.Pipeline([codecs.BFloat16()]),
}


def _same_float(a: float | None, b: float | None) -> bool:
    """Equal bit for bit, or both NaN (a NaN's bits are its element's, see _same_entry)."""
    if a is None or b is None:
        return a is b
    return (math.isnan(a) and math.isnan(b)) or struct.pack("<d", a) == struct.pack("<d", b)


def _same_entry(ahead: Decoded, here: Decoded) -> None:
    """Two entries of Intake.decode agree: the same delta bit for bit (a NaN element as NaN: the bits of a widened
    half-precision NaN are the vector unit's, and a delta with one is refused), norm and verdict of the checks alone."""
    assert ahead.delta is not None and here.delta is not None
    assert ahead.delta.dtype == here.delta.dtype and ahead.delta.shape == here.delta.shape
    nan = torch.isnan(ahead.delta)
    assert torch.equal(nan, torch.isnan(here.delta))
    assert torch.equal(ahead.delta.view(torch.int32)[~nan], here.delta.view(torch.int32)[~nan])
    assert _same_float(ahead.norm, here.norm) and ahead.error == here.error == ""
    assert ahead.alone is not None and here.alone is not None
    assert ahead.alone[0] == here.alone[0] and _same_float(ahead.alone[1], here.alone[1])


def _rows_intake(
    codec: codecs.Pipeline, n: int, max_norm: float | None, decoder: RowDecoder | None, *tasks: tuple[int, int, int]
) -> Intake:
    return Intake(
        registry=TasksInFlight(n, *tasks),  # type: ignore[arg-type]
        codec=codec,
        num_params=n,
        device=torch.device("cpu"),
        validator=UpdateValidator(n, max_norm=max_norm, zscore_threshold=3.0, norm_bound_factor=4.0),
        max_staleness=None,
        clip_norm=None,
        wall=lambda: 0.0,
        row_decoder=decoder,
    )


def _cohort_payloads(codec: codecs.Pipeline, seed: int, count: int, n: int) -> list[bytes]:
    """Payloads of every fate a delta alone can meet: good, over max_norm (10), NaN, Inf, overflowing float32."""
    generator = torch.Generator().manual_seed(seed)
    payloads = []
    for k in range(count):
        fate = int(torch.randint(0, 6, (1,), generator=generator))
        delta = torch.randn(n, generator=generator) * 3.0 / math.sqrt(n)
        if fate == 1:
            delta = delta * 100.0
        elif fate == 2:
            delta[k % n] = math.nan
        elif fate == 3:
            delta[(3 * k) % n] = -math.inf
        elif fate == 4 and codec.lossless:
            delta[:] = 3e38  # every element finite, the norm overflows
        payloads.append(codec.encode(delta).payload)
    return payloads


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    count=st.integers(2, 12),
    n=st.sampled_from([4, 1_000, 70_000]),
    codec_name=st.sampled_from(sorted(_STACKED_CODECS)),
    max_norm=st.sampled_from([None, 10.0]),
    data=st.data(),
)
def test_rows_decoded_ahead_are_what_the_intake_decodes_of_any_batch_of_them(
    seed: int, count: int, n: int, codec_name: str, max_norm: float | None, data: st.DataObject
) -> None:
    """A cohort's payloads decoded ahead by a RowDecoder give, for any batch of two or more of them in any order,
    what the intake decodes of that batch itself: the same deltas bit for bit, norms and verdicts (NaN, Inf, an
    overflowing norm, over max_norm), for every codec that decodes stacked; the intake takes the rows made ahead."""
    codec = _STACKED_CODECS[codec_name]
    payloads = _cohort_payloads(codec, seed, count, n)
    decoder = RowDecoder(codec=codec, num_params=n, max_norm=max_norm, wall=lambda: 0.0)
    rows = decoder(payloads)
    assert rows is not None and len(rows) == count
    uploads = [_upload(k, k, 0, payload) for k, payload in enumerate(payloads)]
    picked = data.draw(st.lists(st.integers(0, count - 1), min_size=2, max_size=count, unique=True))
    batch = [uploads[k] for k in picked]
    ahead = _rows_intake(codec, n, max_norm, decoder).decode(batch, [rows[k] for k in picked])
    here = _rows_intake(codec, n, max_norm, None).decode(batch)
    for k, entry_ahead, entry_here in zip(picked, ahead, here, strict=True):
        assert entry_ahead is rows[k].decoded  # taken, not decoded again
        _same_entry(entry_ahead, entry_here)


@settings(max_examples=20, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    n=st.sampled_from([4, 1_000, 70_000]),
    codec_name=st.sampled_from(sorted(_STACKED_CODECS)),
    max_norm=st.sampled_from([None, 10.0]),
)
def test_a_lone_upload_decoded_ahead_is_admitted_as_the_intake_admits_it_decoded_here(
    seed: int, n: int, codec_name: str, max_norm: float | None
) -> None:
    """A lone upload's row made ahead (a batch of one) is taken, and admitting the upload with it gives what the
    intake gives decoding it alone: the same delta bit for bit and norm, or the same refusal, for every fate (NaN,
    Inf, an overflowing norm, over max_norm) and codec that decodes stacked."""
    codec = _STACKED_CODECS[codec_name]
    for k, payload in enumerate(_cohort_payloads(codec, seed, 5, n)):
        upload = _upload(k, k, 0, payload)
        rows = RowDecoder(codec=codec, num_params=n, max_norm=max_norm, wall=lambda: 0.0)([payload])
        assert rows is not None and len(rows) == 1
        ahead_intake = _rows_intake(codec, n, max_norm, rows[0].decoder, (k, k, 0))
        (entry,) = ahead_intake.decode([upload], rows)
        assert entry is rows[0].decoded  # taken, not decoded again
        ahead = ahead_intake.admit(upload, version=0, decoded=entry)
        here_intake = _rows_intake(codec, n, max_norm, None, (k, k, 0))
        here = here_intake.admit(upload, version=0)
        assert type(ahead) is type(here)
        if isinstance(here, Refused):
            assert ahead == here
            continue
        assert isinstance(ahead, Admitted)
        nan = torch.isnan(ahead.delta)
        assert torch.equal(nan, torch.isnan(here.delta))
        assert torch.equal(ahead.delta.view(torch.int32)[~nan], here.delta.view(torch.int32)[~nan])
        assert _same_float(ahead.norm, here.norm)


def test_an_intake_takes_only_its_own_decoders_rows_of_the_uploads_they_came_with() -> None:
    """Rows of another decoder, of other payloads or of a batch of another length are not taken: the intake decodes
    the batch itself, as without them (a lone upload's own row is taken, another decoder's is not)."""
    codec = codecs.Pipeline()
    decoder = RowDecoder(codec=codec, num_params=N, max_norm=None, wall=lambda: 0.0)
    intake = _rows_intake(codec, N, None, decoder)
    assert intake.row_decoder is decoder
    payloads = [codec.encode(torch.randn(N)).payload for _ in range(3)]
    uploads = [_upload(k, k, 0, payload) for k, payload in enumerate(payloads)]
    rows = decoder(payloads)
    other = RowDecoder(codec=codec, num_params=N, max_norm=None, wall=lambda: 0.0)(payloads)
    assert rows is not None and other is not None
    taken = intake.decode(uploads, rows)
    assert all(entry is row.decoded for entry, row in zip(taken, rows, strict=True))
    swapped = [rows[1], rows[0], rows[2]]
    for wrong in (other, swapped, rows[:2], [object(), *rows[1:]]):
        for entry, row in zip(intake.decode(uploads, wrong), rows, strict=True):
            assert entry is not row.decoded
            _same_entry(entry, row.decoded)
    (alone,) = intake.decode(uploads[:1], rows[:1])
    assert alone is rows[0].decoded  # a lone upload's own row is taken too
    (alone,) = intake.decode(uploads[:1], other[:1])
    assert alone.norm is None and alone.alone is None  # decoded here alone, its checks made at admission


def test_an_intake_ignores_a_decoder_that_would_decode_or_check_otherwise() -> None:
    """A decoder of another codec, model length or max_norm, or one given to an intake on another device or whose
    plug-ins decode extras beside the deltas, is not the intake's: none of its rows is ever taken."""
    codec = codecs.Pipeline()

    def decoder(**changes: object) -> RowDecoder:
        options: dict[str, object] = {"codec": codec, "num_params": N, "max_norm": 10.0, "wall": lambda: 0.0}
        options.update(changes)
        return RowDecoder(**options)  # type: ignore[arg-type]

    assert _rows_intake(codec, N, 10.0, decoder()).row_decoder is not None
    others = (decoder(codec=codecs.Pipeline([codecs.Float16()])), decoder(num_params=N + 1), decoder(max_norm=None))
    for other in others:
        assert _rows_intake(codec, N, 10.0, other).row_decoder is None
    meta = Intake(
        registry=_Tasks(),  # type: ignore[arg-type]
        codec=codec,
        num_params=N,
        device=torch.device("meta"),
        validator=UpdateValidator(N, max_norm=10.0),
        max_staleness=None,
        clip_norm=None,
        wall=lambda: 0.0,
        row_decoder=decoder(),
    )
    assert meta.row_decoder is None
    scaffold = ScaffoldServer(ControlVariate(N, num_clients=4), codec)
    assert scaffold.decodes_extra
    with_extras = _intake(_Tasks(), plugins=[scaffold], row_decoder=decoder(max_norm=None))
    assert with_extras.row_decoder is None


def test_a_decoder_declines_what_the_intake_would_decode_upload_by_upload() -> None:
    """No payload, payloads of several forms or lengths, or a sparse one: no rows (None)."""
    codec = codecs.Pipeline()
    decoder = RowDecoder(codec=codec, num_params=N, max_norm=None, wall=lambda: 0.0)
    dense = codec.encode(torch.ones(N)).payload
    assert decoder([]) is None
    assert decoder([dense, codecs.Pipeline([codecs.Float16()]).encode(torch.ones(N)).payload]) is None
    assert decoder([dense, codec.encode(torch.ones(N + 1)).payload]) is None
    assert decoder([dense, codecs.Pipeline([codecs.TopK(ratio=0.5)]).encode(torch.ones(N)).payload]) is None
    assert decoder([dense, b"junk"]) is None
    # Rows over the decoder's memory bound are left to the receiver; at the bound they are made.
    bounded = RowDecoder(codec=codec, num_params=N, max_norm=None, wall=lambda: 0.0, max_bytes=2 * N * 4)
    assert bounded([dense, dense, dense]) is None
    rows = bounded([dense, dense])
    assert rows is not None and len(rows) == 2


@pytest.mark.slow
def test_a_decoders_rows_alive_together_stay_within_its_bound() -> None:
    """The bound holds for every batch's rows together: a batch is made only while the rows still waiting and its own
    fit, and a batch's bytes come back once the last of its entries is dropped (taken by an intake, or dropped with
    its upload)."""
    codec = codecs.Pipeline()
    dense = codec.encode(torch.ones(N)).payload
    bounded = RowDecoder(codec=codec, num_params=N, max_norm=None, wall=lambda: 0.0, max_bytes=3 * N * 4)
    pair = bounded([dense, dense])
    assert pair is not None and bounded.alive_bytes == 2 * N * 4
    lone = bounded([dense])
    assert lone is not None and bounded.alive_bytes == 3 * N * 4
    assert bounded([dense]) is None  # the receiver decodes it: nothing more is made, nothing is counted
    assert bounded.alive_bytes == 3 * N * 4
    kept = pair[1]
    del pair
    gc.collect()
    assert bounded.alive_bytes == 3 * N * 4 and bounded([dense]) is None  # one entry of the pair still waits
    delta = kept.decoded.delta
    del kept
    assert bounded.alive_bytes == N * 4  # taken: the delta may live on, in the aggregator's hands
    again = bounded([dense, dense])
    assert again is not None and torch.equal(again[0].decoded.delta, delta)
    del lone, again
    assert bounded.alive_bytes == 0
    # A payload that does not decode gives its bytes back at once.
    assert bounded([dense, b"junk"]) is None and bounded.alive_bytes == 0
