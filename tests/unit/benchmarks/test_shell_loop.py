"""How ``benchmarks/shell_loop.py`` sums up its loops: medians by each command's place in the loop."""

from __future__ import annotations

from benchmarks.shell_loop import Loop


def test_a_loop_s_medians_are_taken_place_by_place() -> None:
    loops = [
        Loop([9.0, 6.0], 15.0, 20.0, 170.0, 12.0),
        Loop([7.0, 5.0], 12.0, 18.0, 180.0, 11.0),
        Loop([8.0, 7.0], 15.0, 30.0, 160.0, 13.0),
    ]
    med = Loop.median(loops)
    assert med.walls == [8.0, 6.0]
    assert (med.wall, med.cpu, med.server_mb, med.server_unique_mb) == (15.0, 20.0, 170.0, 12.0)
