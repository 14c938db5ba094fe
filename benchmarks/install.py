"""What the README's install takes: seconds of each step and the size of the virtual environment it leaves.

Runs the README's install, step by step, into a new virtual environment in a temporary folder:
``python3 -m venv``, ``pip install torch==TORCH`` and ``pip install -e '.[EXTRAS]'`` from this checkout, and
measures the wall seconds of each step and the bytes of the environment afterwards (``du``-style: the blocks its
files take), with PyTorch's own folder apart. pip's cache is as the machine has it (a user installing a second time
finds the wheels in it); ``--no-cache`` gives pip an empty one. The baseline is the bare ``venv`` step. The figures
go to ``benchmarks/results/install.json`` (see ``benchmarks/record.py``).

    python benchmarks/install.py                    # the README's install, with the [dev] extra: minutes
    python benchmarks/install.py --extras dev,docs
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__:  # imported as benchmarks.install
    from benchmarks.record import Figure, machine, store
else:
    from record import Figure, machine, store

ROOT = Path(__file__).resolve().parents[1]


def _size(folder: Path) -> int:
    """Return the bytes the files under ``folder`` take on disk (each file counted once, links not followed)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for dirpath, _, names in os.walk(folder):
        for name in names:
            stat = os.lstat(os.path.join(dirpath, name))
            if (stat.st_dev, stat.st_ino) not in seen:
                seen.add((stat.st_dev, stat.st_ino))
                total += stat.st_blocks * 512
    return total


def _timed(command: list[str], env: dict[str, str]) -> float:
    """Run ``command`` in the checkout and return its wall seconds; stop the benchmark if it fails."""
    start = time.monotonic()
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return time.monotonic() - start


def main() -> None:
    """Install into a temporary environment, print and store the figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--torch", default="2.13.0", help="the torch version the README pins")
    parser.add_argument("--extras", default="dev", help="flasync's extras, comma-separated")
    parser.add_argument("--no-cache", action="store_true", help="give pip an empty cache")
    parser.add_argument("--out", type=Path, help="results JSON (default: benchmarks/results/install.json)")
    args = parser.parse_args()
    described = machine()
    with tempfile.TemporaryDirectory(prefix="flasync-install-") as tmp:
        venv = Path(tmp, "venv")
        env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
        if args.no_cache:
            env["PIP_CACHE_DIR"] = str(Path(tmp, "pip-cache"))
        pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet"]
        steps = {
            "venv": _timed([sys.executable, "-m", "venv", str(venv)], env),
            "torch": _timed([*pip, f"torch=={args.torch}"], env),
            "flasync": _timed([*pip, "-e", f".[{args.extras}]"], env),
        }
        venv_bytes = _size(venv)
        torch_dirs = list(venv.glob("lib/python*/site-packages/torch"))
        torch_bytes = sum(_size(path) for path in torch_dirs)
    total = sum(steps.values())
    print(f"install of flasync[{args.extras}] with torch {args.torch}")
    for step, seconds in steps.items():
        print(f"  {step:<8} {seconds:7.1f} s")
    print(f"  in all   {total:7.1f} s ({total / steps['venv']:.0f}x the bare venv)")
    print(f"  environment {venv_bytes / 1e9:.2f} GB, of which torch {torch_bytes / 1e9:.2f} GB")
    headline = [
        Figure("install, in all", round(total, 1), "s", "bare venv", round(total / steps["venv"], 1)),
        Figure("virtual environment", venv_bytes, "bytes"),
        Figure("of which PyTorch", torch_bytes, "bytes", "virtual environment", round(torch_bytes / venv_bytes, 3)),
    ]
    figures = {
        "steps_s": {step: round(seconds, 2) for step, seconds in steps.items()},
        "total_s": round(total, 2),
        "venv_bytes": venv_bytes,
        "torch_bytes": torch_bytes,
    }
    settings = {"torch": args.torch, "extras": args.extras, "pip_cache": "empty" if args.no_cache else "the machine's"}
    store("install", described, settings=settings, headline=headline, figures=figures, out=args.out)


if __name__ == "__main__":
    main()
