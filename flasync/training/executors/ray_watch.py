"""A watch on the Ray cluster a run trains on: its GCS and this node's raylet, probed with bounded connects.

When the GCS and raylet are gone (killed, out of memory, the machine's Ray stopped), Ray's calls in the driver do
not fail: a result never comes, and once the GCS has not answered for ``gcs_rpc_server_reconnect_timeout_s`` (60 s
by default) Ray's core worker ends the whole process, without a word from flasync and with its MLflow run left
``RUNNING``. A ``ray.put`` once the raylet is gone ends it at once. The watch probes both every
:data:`PROBE_EVERY_S` seconds (a TCP connect, bounded by :data:`PROBE_TIMEOUT_S`) and says the cluster is gone once
they failed for ``misses`` probes in a row, so the run stops cleanly long before Ray would end it.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable

__all__ = ["CLUSTER_GONE", "PROBE_EVERY_S", "PROBE_TIMEOUT_S", "ClusterWatch", "answers"]

CLUSTER_GONE = "Ray cluster gone"
"""The stop reason of a run whose Ray cluster is gone."""

PROBE_EVERY_S = 1.0
"""Seconds between two probes of the cluster."""

PROBE_TIMEOUT_S = 1.0
"""Longest wait for one connect."""


def answers(address: tuple[str, int], timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """Return whether a TCP connect to ``(host, port)`` succeeds within ``timeout_s`` seconds."""
    try:
        with socket.create_connection(address, timeout=timeout_s):
            return True
    except OSError:
        return False


class ClusterWatch:
    """Probe a Ray cluster's GCS and this node's raylet in a thread; tell ``on_lost`` once when they are gone.

    Args:
        gcs: The GCS's ``(host, port)``.
        raylet: The ``(host, port)`` of the raylet this process is connected to.
        on_lost: Called once, from the watch's thread, with a sentence saying what is gone.
        misses: Probes in a row that must fail before the cluster is taken for gone (a restarted GCS of a cluster
            with GCS fault tolerance may come back meanwhile).
        every_s: Seconds between probes.
        probe: Says whether an address answers (injected for tests).

    Attributes:
        lost: The sentence given to ``on_lost`` once the cluster is gone; empty while it answers.
    """

    def __init__(
        self,
        *,
        gcs: tuple[str, int],
        raylet: tuple[str, int],
        on_lost: Callable[[str], None],
        misses: int = 2,
        every_s: float = PROBE_EVERY_S,
        probe: Callable[[tuple[str, int]], bool] = answers,
    ) -> None:
        """Start nothing yet (see :meth:`start`)."""
        if misses < 1:
            raise ValueError(f"misses must be >= 1, got {misses}")
        self.gcs = gcs
        self.raylet = raylet
        self.on_lost = on_lost
        self.misses = misses
        self.every_s = every_s
        self.probe = probe
        self.lost = ""
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="flasync-ray-watch", daemon=True)

    def start(self) -> None:
        """Start probing in the watch's thread."""
        self._thread.start()

    def close(self) -> None:
        """Stop probing and wait for the thread (at most one probe's time)."""
        self._closed.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()

    def silent(self) -> list[str]:
        """Probe once now; return the parts that did not answer (``"GCS"``, ``"raylet"``)."""
        return [name for name, address in (("GCS", self.gcs), ("raylet", self.raylet)) if not self.probe(address)]

    def raylet_answers(self) -> bool:
        """Return whether the cluster was not taken for gone and this node's raylet answers a probe now.

        Called before a ``ray.put``: a put to a raylet that is gone ends the process.
        """
        return not self.lost and self.probe(self.raylet)

    def _watch(self) -> None:
        missed = 0
        while not self._closed.wait(self.every_s):
            silent = self.silent()
            missed = missed + 1 if silent else 0
            if missed >= self.misses:
                host, port = self.gcs
                self.lost = f"the Ray cluster at {host}:{port} is gone ({' and '.join(silent)} not answering)"
                self.on_lost(self.lost)
                return
