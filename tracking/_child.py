"""``log_batch`` in a child process, so MLflow's SQL work never holds the training process's GIL.

Writing a metric to MLflow's SQLAlchemy store costs about 90 microseconds of pure-Python work. Done on a thread of
the training process, that work competes with the event loop and the training threads for the GIL; a run that logs a
dozen figures per client update loses a large share of its throughput. :class:`ChildLogBatch` starts
``python -m tracking._child URI RUN_ID`` and sends it each batch as one line of JSON (``[[key, value, timestamp,
step], ...]``) on its standard input; the child answers each line with one word on its standard output (``ready``
once connected, then ``ok`` or ``error: ...`` per batch). A plain subprocess, not ``multiprocessing``: it never
re-imports the parent's ``__main__`` (a script without an ``if __name__ == "__main__"`` guard stays safe), and
nothing is pickled.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import IO

from mlflow.entities import Metric

__all__ = ["ChildLogBatch"]

_STOP = "stop"
_EXIT_TIMEOUT_S = 10.0


def _serve(tracking_uri: str, run_id: str, requests: IO[str], replies: IO[str]) -> None:
    """Answer batches read from ``requests`` until told to stop (runs in the child)."""
    import mlflow

    if hasattr(os, "nice"):
        # Writing metrics is background work: on a busy machine it yields the CPU to training and catches up in
        # idle moments (and at the final flush).
        os.nice(19)

    def reply(word: str) -> None:
        replies.write(word.replace("\n", " ") + "\n")
        replies.flush()

    try:
        client = mlflow.MlflowClient(tracking_uri=tracking_uri)
        client.get_run(run_id)  # connect now, so a store the child cannot reach is known before training starts
    except Exception as exc:
        reply(f"error: {type(exc).__name__}: {exc}")
        return
    reply("ready")
    for line in requests:
        if line.strip() == _STOP:
            return
        try:
            metrics = [Metric(str(k), float(v), int(t), int(s)) for k, v, t, s in json.loads(line)]
            client.log_batch(run_id, metrics=metrics, synchronous=True)
            reply("ok")
        except Exception as exc:
            reply(f"error: {type(exc).__name__}: {exc}")


class ChildLogBatch:
    """A ``log_batch(metrics)`` callable whose MLflow calls run in a child process.

    Args:
        tracking_uri: The store the child writes to (absolute: the child does not share relative paths' meaning).
        run_id: The run the metrics belong to.
        extra_env: Environment variables set for the child only, e.g. bounds on MLflow's HTTP timeout and retries.

    ``__call__`` raises ``RuntimeError`` with the child's error message, or ``ConnectionError`` when the child is
    gone; the caller (a :class:`~tracking.writer.MetricWriter`) keeps the batch and retries or falls back.
    """

    def __init__(self, tracking_uri: str, run_id: str, *, extra_env: Mapping[str, str] | None = None) -> None:
        """Start the child (it imports MLflow and connects in the background)."""
        env = dict(os.environ)
        env.update(extra_env or {})
        # The child imports this package from wherever the parent did, installed or not.
        root = str(Path(__file__).resolve().parents[1])
        env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
        self._process = subprocess.Popen(
            [sys.executable, "-m", "tracking._child", tracking_uri, run_id],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            encoding="utf-8",
            env=env,
        )
        self._ready = False
        self._lock = threading.Lock()

    @property
    def alive(self) -> bool:
        """Tell whether the child process is running."""
        return self._process.poll() is None

    def _expect(self, word: str) -> None:
        assert self._process.stdout is not None
        answer = self._process.stdout.readline().strip()
        if not answer:
            raise ConnectionError("the MLflow writer process is gone")
        if answer.startswith("error: "):
            raise RuntimeError(answer.removeprefix("error: "))
        if answer != word:  # pragma: no cover - protocol violation
            raise ConnectionError(f"unexpected answer {answer!r} from the MLflow writer process")

    def wait_ready(self, timeout: float) -> None:
        """Block until the child has connected to the store.

        Raises:
            ConnectionError: If the child died or did not answer within ``timeout`` seconds.
            RuntimeError: If the child could not reach the store (its message).
        """
        with self._lock:
            if self._ready:
                return
            assert self._process.stdout is not None
            readable, _, _ = select.select([self._process.stdout], [], [], timeout)
            if not readable:
                raise ConnectionError(f"the MLflow writer process did not start within {timeout:.0f} s")
            self._expect("ready")
            self._ready = True

    def __call__(self, metrics: list[Metric]) -> None:
        """Write one batch through the child; return when the store has it."""
        line = json.dumps([[m.key, m.value, m.timestamp, m.step] for m in metrics])
        with self._lock:
            if not self._ready:
                self._expect("ready")
                self._ready = True
            assert self._process.stdin is not None
            try:
                self._process.stdin.write(line + "\n")
                self._process.stdin.flush()
            except (BrokenPipeError, OSError):
                raise ConnectionError("the MLflow writer process is gone") from None
            self._expect("ok")

    def close(self) -> None:
        """Stop the child (after the batches already sent) and reap it; idempotent."""
        with self._lock:
            stdin = self._process.stdin
            if stdin is not None and not stdin.closed:
                try:
                    stdin.write(_STOP + "\n")
                    stdin.close()
                except (BrokenPipeError, OSError):
                    pass
            try:
                self._process.wait(_EXIT_TIMEOUT_S)
            except subprocess.TimeoutExpired:  # pragma: no cover - a child stuck in the store
                self._process.kill()
                self._process.wait(_EXIT_TIMEOUT_S)
            if self._process.stdout is not None:
                self._process.stdout.close()


if __name__ == "__main__":
    _serve(sys.argv[1], sys.argv[2], sys.stdin, sys.stdout)
