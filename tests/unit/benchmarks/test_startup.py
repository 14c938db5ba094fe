"""The order ``benchmarks/startup.py`` runs its kinds and trees in: fair to each over the repeats."""

from __future__ import annotations

from benchmarks.startup import KINDS, kinds_in_turn, order

TRACKED = [kind for kind in KINDS if kind != "--no-tracking"]


def test_every_repeat_runs_each_kind_once_the_tracked_ones_in_their_order() -> None:
    for repeat in range(8):
        kinds = kinds_in_turn(repeat)
        assert sorted(kinds) == sorted(KINDS)
        assert [kind for kind in kinds if kind != "--no-tracking"] == TRACKED


def test_the_untracked_run_takes_every_place_in_turn_first_after_all() -> None:
    places = [kinds_in_turn(repeat).index("--no-tracking") for repeat in range(len(KINDS))]
    assert places[0] == len(KINDS) - 1
    assert sorted(places) == list(range(len(KINDS)))
    assert kinds_in_turn(len(KINDS)) == kinds_in_turn(0)


def test_the_trees_take_turns_going_first() -> None:
    assert [order(["this", "baseline"], repeat)[0] for repeat in range(4)] == ["this", "baseline"] * 2
    assert order(["this"], 3) == ["this"]
