"""Store a benchmark's result as JSON under ``benchmarks/results/``, with a description of the machine it ran on.

Every script that keeps its figures calls :func:`store` at the end: one file per benchmark
(``benchmarks/results/NAME.json``, replaced by the next run) holding

* ``benchmark``, ``command`` (as typed, from the repository root) and ``measured_at`` (UTC);
* ``machine``: :func:`machine`, the CPU model, its cores, the load average when the run started, the memory and the
  versions of Python, torch, MLflow and flasync, and the commit;
* ``settings``: the script's arguments that change what is measured;
* ``headline``: a few :class:`Figure` rows, each a value with its unit and, where the script measured one in the
  same run, the baseline it is compared to and the ratio;
* ``figures``: everything else the script measured, as nested JSON.

The documentation's performance page and the figures quoted in the README and the guides are rendered from these
files (``docs/_hooks/figures.py``), never typed.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
"""The folder the results are stored in (``benchmarks/results/``)."""

_VERSIONED = ("torch", "mlflow", "flasync")


@dataclass(frozen=True, slots=True)
class Figure:
    """One headline figure of a result: what it is, its value and unit, and its baseline from the same run.

    Attributes:
        name: What was measured, e.g. ``"whole call, 1,000 clients"``.
        value: The figure, in ``unit``.
        unit: Its unit (``"s"``, ``"updates/s"``, ``"GB/s"``, ``"bytes"``, ``"x"``...).
        baseline: What it is compared to (e.g. ``"plain PyTorch loop"``), or None.
        ratio: ``value`` over the baseline's value measured in the same run, or None.
    """

    name: str
    value: float
    unit: str
    baseline: str | None = None
    ratio: float | None = None


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _memory_bytes() -> int | None:
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    return None


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine() -> dict[str, Any]:
    """Describe the machine and the code a result is measured with.

    Returns:
        ``platform``, ``cpu`` (the model name), ``cpus`` (logical cores), ``load_average_1m`` (when called: call it
        before measuring), ``memory_bytes``, ``python``, the versions of ``torch``, ``mlflow`` and ``flasync`` (None
        when not installed) and ``commit`` (short hash of the checkout, with ``+dirty`` when it has changes).
    """
    here = Path(__file__).resolve().parent

    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], capture_output=True, text=True, cwd=here, check=False)
        return done.stdout.strip() if done.returncode == 0 else ""

    commit = git("rev-parse", "--short", "HEAD")
    if commit and git("status", "--porcelain", "--untracked-files=no"):
        commit += "+dirty"
    return {
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cpus": os.cpu_count(),
        "load_average_1m": round(os.getloadavg()[0], 2),
        "memory_bytes": _memory_bytes(),
        "python": platform.python_version(),
        **{name: _version(name) for name in _VERSIONED},
        "commit": commit,
    }


def describe(described: dict[str, Any]) -> str:
    """Return a machine description as one line: ``AMD EPYC, 2 cores, load 1.29, torch 2.13.0, commit 21a328b``."""
    parts = [str(described.get("cpu") or "unknown CPU"), f"{described.get('cpus')} cores"]
    parts.append(f"load {described.get('load_average_1m')}")
    parts += [f"{name} {described[name]}" for name in ("torch",) if described.get(name)]
    if described.get("commit"):
        parts.append(f"commit {described['commit']}")
    return ", ".join(parts)


def store(
    benchmark: str,
    described: dict[str, Any],
    *,
    settings: dict[str, Any],
    headline: list[Figure],
    figures: dict[str, Any],
    out: Path | None = None,
) -> Path:
    """Write a result to ``out`` (default ``benchmarks/results/BENCHMARK.json``) and return where it went.

    Args:
        benchmark: The benchmark's name (the script's stem).
        described: :func:`machine`, called before the measurement.
        settings: The arguments that change what is measured.
        headline: The figures the performance page shows first.
        figures: Everything else measured (JSON-serialisable).
        out: Where to write, or None for the results folder.
    """
    path = out if out is not None else RESULTS / f"{benchmark}.json"
    result = {
        "benchmark": benchmark,
        "command": " ".join(["python", *_relative_argv()]),
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": described,
        "settings": settings,
        "headline": [asdict(figure) for figure in headline],
        "figures": figures,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"written to {path}")
    return path


def _relative_argv() -> list[str]:
    """Return ``sys.argv`` with the script named from the repository root (``benchmarks/NAME.py``)."""
    script = Path(sys.argv[0]).resolve()
    root = Path(__file__).resolve().parents[1]
    with contextlib.suppress(ValueError):
        return [str(script.relative_to(root)), *sys.argv[1:]]
    return list(sys.argv)
