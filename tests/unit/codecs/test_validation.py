"""Update validation: the pure checks, the robust z-score and the norm bound."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flasync.codecs.validation import UpdateValidator, clip_to_norm, finite_norm, robust_zscore


def test_accepts_a_plain_update() -> None:
    """A finite float32 vector of the right length passes and reports its norm."""
    verdict, norm = UpdateValidator(4).check(torch.tensor([3.0, 4.0, 0.0, 0.0]))
    assert verdict is None and norm == pytest.approx(5.0)


@pytest.mark.parametrize(
    ("delta", "reason"),
    [
        (torch.zeros(3), "shape"),
        (torch.zeros(2, 2), "shape"),
        (torch.zeros(4, dtype=torch.float64), "dtype"),
        (torch.tensor([0.0, math.nan, 0.0, 0.0]), "non_finite"),
        (torch.tensor([0.0, math.inf, 0.0, 0.0]), "non_finite"),
        (torch.tensor([100.0, 0.0, 0.0, 0.0]), "norm"),
    ],
)
def test_refuses_malformed_or_oversized_updates(delta: torch.Tensor, reason: str) -> None:
    """Wrong length/shape/dtype, NaN/Inf and a norm above the bound each have their reason."""
    verdict, _ = UpdateValidator(4, max_norm=10.0).check(delta)
    assert verdict is not None and verdict.reason == reason
    assert verdict.detail and "\n" not in verdict.detail


def test_finite_update_whose_norm_overflows_is_refused() -> None:
    """Elements near float32's maximum overflow the norm to infinity: folded in, they would overflow the model."""
    verdict, norm = UpdateValidator(4).check(torch.tensor([3e38, 3e38, 0.0, 0.0]))
    assert verdict is not None and verdict.reason == "non_finite" and "overflows" in verdict.detail
    assert norm == math.inf
    verdict, _ = UpdateValidator(4).check(torch.tensor([3e38, -math.inf, 0.0, 0.0]))
    assert verdict is not None and verdict.reason == "non_finite"


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ([3.0, 4.0], 5.0),
        ([3e38, 3e38], math.inf),  # finite elements, the norm overflows
        ([1.0, math.nan], math.nan),
        ([1.0, -math.inf], math.nan),
        ([math.inf, -math.inf], math.nan),
    ],
)
def test_finite_norm_is_nan_exactly_for_non_finite_elements(values: list[float], expected: float) -> None:
    """The norm of a finite vector (inf when it overflows); NaN when an element is NaN or infinite."""
    norm = finite_norm(torch.tensor(values))
    assert math.isnan(norm) if math.isnan(expected) else norm == pytest.approx(expected)


def test_robust_zscore() -> None:
    """The z-score uses median and MAD, so one outlier in the history does not hide the next."""
    history = [1.0, 1.1, 0.9, 1.0, 1.05, 0.95, 50.0]
    assert robust_zscore(1.0, history) == pytest.approx(0.0)
    assert robust_zscore(10.0, history) > 50
    assert robust_zscore(5.0, []) == 0.0
    assert robust_zscore(2.0, [1.0, 1.0, 1.0]) == math.inf
    assert robust_zscore(1.0, [1.0, 1.0, 1.0]) == 0.0


def test_zscore_check_needs_history_and_records_only_accepted_norms() -> None:
    """The z-score check applies after min_history accepted norms; refused norms never enter the history."""
    validator = UpdateValidator(2, zscore_threshold=4.0, window=5, min_history=3)
    big = torch.tensor([100.0, 0.0])
    assert validator.check(big)[0] is None  # no history yet
    for value in (1.0, 1.2, 0.8):
        verdict, norm = validator.check(torch.tensor([value, 0.0]))
        assert verdict is None
        validator.accepted(norm)
    verdict, _ = validator.check(big)
    assert verdict is not None and verdict.reason == "zscore"
    assert validator.norms == pytest.approx([1.0, 1.2, 0.8])
    for _ in range(10):
        validator.accepted(1.0)
    assert len(validator.norms) == 5


def test_clip_to_norm() -> None:
    """Longer updates are scaled to the bound, shorter ones returned as they are."""
    short = torch.tensor([0.3, 0.4])
    same, norm = clip_to_norm(short, 1.0)
    assert same is short and norm == pytest.approx(0.5)
    clipped, norm = clip_to_norm(torch.tensor([30.0, 40.0]), 1.0)
    assert norm == pytest.approx(50.0)
    torch.testing.assert_close(clipped, torch.tensor([0.6, 0.8]))
    with pytest.raises(ValueError, match="max_norm"):
        clip_to_norm(short, 0.0)


def test_the_norm_bound_follows_accepted_norms_and_refused_ones_cannot_move_it() -> None:
    """norm_bound_factor refuses norms over factor x the median of accepted ones, once min_history were accepted;
    a stream of refused large updates leaves the reference where it was."""
    validator = UpdateValidator(2, min_history=3, norm_bound_factor=3.0)
    big = torch.tensor([30.0, 40.0])  # norm 50
    assert validator.check(big)[0] is None  # no history yet: nothing to compare with
    for value in (1.0, 1.1, 0.9):
        verdict, norm = validator.check(torch.tensor([value, 0.0]))
        assert verdict is None
        validator.accepted(norm)
    for _ in range(100):
        verdict, _ = validator.check(big)
        assert verdict is not None and verdict.reason == "norm_bound"
    assert validator.check(torch.tensor([2.9, 0.0]))[0] is None  # under 3 x median 1.0
    assert validator.norms == [1.0, pytest.approx(1.1), pytest.approx(0.9)]


def test_the_norm_bound_holds_from_the_third_update_on() -> None:
    """Before min_history updates were accepted the bound uses every norm seen: early attackers are refused too."""
    validator = UpdateValidator(2, min_history=10, norm_bound_factor=3.0)
    for value in (1.0, 1.2, 0.8):
        assert validator.check(torch.tensor([value, 0.0]))[0] is None
    verdict, _ = validator.check(torch.tensor([30.0, 40.0]))
    assert verdict is not None and verdict.reason == "norm_bound"


def test_a_norm_taken_ahead_is_used_and_a_non_finite_one_is_checked_again() -> None:
    """check() uses a norm it is given (a batch's, from one reduction); given a NaN or Inf norm it looks at the
    elements again, so an overflowing finite update and a NaN one keep their own verdicts."""
    validator = UpdateValidator(3, max_norm=10.0)
    delta = torch.tensor([3.0, 4.0, 0.0])
    assert validator.check(delta, 5.0) == (None, 5.0)
    verdict, _ = validator.check(delta, 11.0)
    assert verdict is not None and verdict.reason == "norm"
    assert validator.check(delta, math.nan) == (None, 5.0)
    verdict, norm = validator.check(torch.tensor([1.0, math.inf, 0.0]), math.inf)
    assert verdict is not None and verdict.reason == "non_finite" and math.isnan(norm)


def _rows(seed: int, count: int, length: int) -> torch.Tensor:
    """Random deltas of several scales, some with a NaN, an Inf or elements whose squares overflow float32."""
    generator = torch.Generator().manual_seed(seed)
    rows = torch.randn((count, length), generator=generator)
    rows *= torch.exp(4.0 * torch.rand((count, 1), generator=generator))  # norms from about 1 to 400
    kinds = torch.randint(0, 6, (count,), generator=generator).tolist()
    for k, kind in enumerate(kinds):
        if kind == 1:
            rows[k, k % length] = math.nan
        elif kind == 2:
            rows[k, (k + 1) % length] = -math.inf
        elif kind == 3:
            rows[k, :2] = 3e38  # every element finite, the norm overflows
    return rows


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    count=st.integers(1, 24),
    max_norm=st.one_of(st.none(), st.floats(1.0, 500.0)),
)
def test_rows_checked_together_get_the_verdicts_and_norms_each_gets_alone(
    seed: int, count: int, max_norm: float | None
) -> None:
    """check_rows gives every row of a batch the verdict and the norm check_alone gives it with the batch's norm:
    NaN, Inf, an overflowing norm, a norm over max_norm, or none, and the same float norm."""
    validator = UpdateValidator(7, max_norm=max_norm)
    rows = _rows(seed, count, 7)
    norms = torch.linalg.vector_norm(rows, dim=1).tolist()
    together = validator.check_rows(rows, norms)
    alone = [validator.check_alone(row, norm) for row, norm in zip(rows.unbind(0), norms, strict=True)]
    assert [verdict for verdict, _ in together] == [verdict for verdict, _ in alone]
    for (_, norm), (_, expected) in zip(together, alone, strict=True):
        assert norm == expected or (math.isnan(norm) and math.isnan(expected))


def test_rows_of_another_form_are_refused_row_by_row_as_alone() -> None:
    """A batch of the wrong dtype or length gives each row the form's verdict, as each gets alone."""
    validator = UpdateValidator(3)
    for rows in (torch.ones((2, 3), dtype=torch.float64), torch.ones((2, 4))):
        norms = torch.linalg.vector_norm(rows, dim=1).tolist()
        together = validator.check_rows(rows, norms)
        assert together == [validator.check_alone(row, norm) for row, norm in zip(rows.unbind(0), norms, strict=True)]
        assert {verdict.reason for verdict, _ in together if verdict is not None} == {
            "dtype" if rows.dtype == torch.float64 else "shape"
        }


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1))
def test_check_is_the_checks_alone_then_those_against_the_history(seed: int) -> None:
    """check() over a stream of updates, with the norm bound and the z-score on and every passing norm accepted,
    gives what check_alone then check_norm give, update by update, and leaves the same history."""
    options = {"max_norm": 300.0, "zscore_threshold": 2.5, "window": 8, "min_history": 4, "norm_bound_factor": 3.0}
    whole, split = UpdateValidator(5, **options), UpdateValidator(5, **options)  # type: ignore[arg-type]
    for row in _rows(seed, 60, 5).unbind(0):
        expected = whole.check(row)
        verdict, norm = split.check_alone(row)
        if verdict is None:
            verdict = split.check_norm(norm)
        assert verdict == expected[0]
        assert norm == expected[1] or (math.isnan(norm) and math.isnan(expected[1]))
        if verdict is None:
            whole.accepted(norm)
            split.accepted(norm)
    assert whole.norms == split.norms


@given(norms=st.lists(st.one_of(st.floats(0.0, 100.0), st.sampled_from([math.nan, math.inf])), max_size=12))
def test_accepted_many_records_as_each_accepted_in_turn(norms: list[float]) -> None:
    """Norms recorded together join the history as each recorded alone would (those not finite left out), oldest
    first, within the window."""
    together, one_by_one = UpdateValidator(3, window=5), UpdateValidator(3, window=5)
    together.accepted_many(norms)
    for norm in norms:
        one_by_one.accepted(norm)
    assert together.norms == one_by_one.norms


def test_a_validator_judges_history_only_with_a_norm_bound_or_a_zscore() -> None:
    """Without a norm bound or a z-score the checks against the norms seen pass every norm and record none."""
    assert not UpdateValidator(3, max_norm=2.0).judges_history
    assert UpdateValidator(3, zscore_threshold=3.0).judges_history
    assert UpdateValidator(3, norm_bound_factor=4.0).judges_history
    plain = UpdateValidator(3)
    assert plain.check_norm(1e9) is None and plain.check_norm(0.0) is None
    assert not plain._seen and not plain.norms
