"""``log_batch`` in a child process, so MLflow's SQL work never holds the training process's GIL.

Writing a metric to MLflow's SQLAlchemy store costs about 90 microseconds of pure-Python work. Done on a thread of
the training process, that work competes with the event loop and the training threads for the GIL; a run that logs a
dozen figures per client update loses a large share of its throughput. :class:`ChildLogBatch` sends each batch as
plain tuples over a pipe to a spawned process that owns its own ``MlflowClient`` and answers with a status. The
bytes on the pipe come from this process only (never from a client).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import threading
from multiprocessing.connection import Connection
from typing import Any

from mlflow.entities import Metric

__all__ = ["ChildLogBatch"]

_STOP = None
_JOIN_TIMEOUT_S = 10.0


def _serve(conn: Connection, tracking_uri: str, run_id: str) -> None:
    """Answer batches of ``(key, value, timestamp, step)`` tuples until told to stop (runs in the child)."""
    import mlflow

    try:
        client = mlflow.MlflowClient(tracking_uri=tracking_uri)
        client.get_run(run_id)  # connect now, so a store the child cannot reach is known before training starts
    except Exception as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", ""))
    while True:
        try:
            batch = conn.recv()
        except EOFError:
            return
        if batch is _STOP:
            conn.send(("stopped", ""))
            return
        try:
            metrics = [Metric(key, value, timestamp, step) for key, value, timestamp, step in batch]
            client.log_batch(run_id, metrics=metrics, synchronous=True)
            conn.send(("ok", ""))
        except Exception as exc:
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


class ChildLogBatch:
    """A ``log_batch(metrics)`` callable whose MLflow calls run in a spawned child process.

    Args:
        tracking_uri: The store the child writes to (absolute, as the child may not share the working directory's
            meaning of relative paths).
        run_id: The run the metrics belong to.

    Raises from ``__call__``: ``RuntimeError`` with the child's error message, or ``ConnectionError`` when the
    child is gone; the caller (a :class:`~tracking.writer.MetricWriter`) keeps the batch and retries.
    """

    def __init__(self, tracking_uri: str, run_id: str) -> None:
        """Spawn the child (it connects to the store in the background)."""
        context = multiprocessing.get_context("spawn")
        self._conn, child_end = context.Pipe()
        self._process: Any = context.Process(
            target=_serve, args=(child_end, tracking_uri, run_id), name="flasync-mlflow-writer", daemon=True
        )
        self._process.start()
        child_end.close()
        self._ready = False
        self._lock = threading.Lock()

    @property
    def alive(self) -> bool:
        """Tell whether the child process is running."""
        return bool(self._process.is_alive())

    def _expect(self, *states: str) -> None:
        try:
            state, detail = self._conn.recv()
        except (EOFError, OSError) as exc:
            raise ConnectionError(f"the MLflow writer process is gone ({type(exc).__name__})") from None
        if state == "error":
            raise RuntimeError(detail)
        if state not in states:  # pragma: no cover - protocol violation
            raise ConnectionError(f"unexpected answer {state!r} from the MLflow writer process")

    def wait_ready(self, timeout: float) -> None:
        """Block until the child has connected to the store.

        Raises:
            ConnectionError: If the child died, failed to connect, or did not answer within ``timeout`` seconds.
        """
        with self._lock:
            if self._ready:
                return
            if not self._conn.poll(timeout):
                raise ConnectionError(f"the MLflow writer process did not start within {timeout:.0f} s")
            self._expect("ready")
            self._ready = True

    def __call__(self, metrics: list[Metric]) -> None:
        """Write one batch through the child; return when the store has it."""
        batch = [(m.key, m.value, m.timestamp, m.step) for m in metrics]
        with self._lock:
            if not self._ready:
                self._expect("ready")
                self._ready = True
            try:
                self._conn.send(batch)
            except (BrokenPipeError, OSError) as exc:
                raise ConnectionError(f"the MLflow writer process is gone ({type(exc).__name__})") from None
            self._expect("ok")

    def close(self) -> None:
        """Stop the child (after the batches already sent) and reap it; idempotent."""
        with self._lock:
            if self._process.is_alive():
                with contextlib.suppress(BrokenPipeError, OSError):
                    self._conn.send(_STOP)
            self._process.join(_JOIN_TIMEOUT_S)
            if self._process.is_alive():  # pragma: no cover - a child stuck in the store
                self._process.terminate()
                self._process.join(_JOIN_TIMEOUT_S)
            self._conn.close()
