"""The Ray cluster watch: probes in a row that fail make the cluster gone, once; a probe that answers resets them."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import pytest

from flasync.training.executors.ray_watch import ClusterWatch, answers

pytestmark = pytest.mark.timeout(30)

GCS = ("gcs", 1)
RAYLET = ("raylet", 2)


def _scripted(rounds: list[set[tuple[str, int]]], done: threading.Event) -> Callable[[tuple[str, int]], bool]:
    """A probe answering as ``rounds`` say (each the addresses silent in one round); then always, and ``done`` set."""
    script: Iterator[set[tuple[str, int]]] = iter(rounds)
    current: set[tuple[str, int]] = set()

    def probe(address: tuple[str, int]) -> bool:
        nonlocal current
        if address == GCS:  # a round starts with the GCS
            nxt = next(script, None)
            if nxt is None:
                done.set()
                current = set()
            else:
                current = nxt
        return address not in current

    return probe


def _watch(
    rounds: list[set[tuple[str, int]]], misses: int
) -> tuple[ClusterWatch, list[str], threading.Event, threading.Event]:
    """A watch on a scripted probe; what it told, and events set when it told it and when the script ran out."""
    told: list[str] = []
    lost, done = threading.Event(), threading.Event()

    def on_lost(why: str) -> None:
        told.append(why)
        lost.set()

    watch = ClusterWatch(
        gcs=GCS, raylet=RAYLET, on_lost=on_lost, misses=misses, every_s=0.001, probe=_scripted(rounds, done)
    )
    return watch, told, lost, done


def test_the_cluster_is_gone_after_misses_in_a_row_and_told_once() -> None:
    """Two silent rounds in a row (misses=2): on_lost is told once, naming the address and what did not answer."""
    watch, told, lost, done = _watch([{GCS, RAYLET}, {GCS, RAYLET}, {GCS, RAYLET}], misses=2)
    watch.start()
    assert lost.wait(timeout=20)
    watch.close()
    assert told == ["the Ray cluster at gcs:1 is gone (GCS and raylet not answering)"]
    assert watch.lost == told[0]
    assert not done.is_set()  # the watch ended with the loss: the third round was never probed


def test_a_probe_that_answers_between_misses_keeps_the_cluster() -> None:
    """Silent, answering, silent (misses=2): never two in a row, so the cluster is not taken for gone."""
    watch, told, _, done = _watch([{RAYLET}, set(), {GCS}, set()], misses=2)
    watch.start()
    assert done.wait(timeout=20)
    watch.close()
    assert told == []
    assert watch.lost == ""
    assert watch.raylet_answers()


def test_a_closed_port_does_not_answer() -> None:
    """answers() is False for a port nothing listens on (the probe a gone raylet or GCS meets)."""
    import socket

    with socket.socket() as sock:  # a port just freed: nothing listens there
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    assert not answers(("127.0.0.1", port), timeout_s=5.0)
