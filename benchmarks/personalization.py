"""Personalization (FedBN, fine-tuning, Ditto) against the global model on non-IID digits, evaluated client-side.

    python benchmarks/personalization.py                 # about a minute on 2 cores
    python benchmarks/personalization.py --versions 150

FedBuff on digits split among 40 clients by label with Dirichlet(0.1) (most clients hold two or three digits), each
client holding out 20% of its samples; every task evaluates before training (``eval.clients.fraction = 1``,
``when = "before"``), a version closing at 5 reports. Two models, run in this process with the same seed:

* **mlp**: the built-in MLP (64-64-10), as one global model (the baseline), with its head local
  (``client.personal = {kind = "fedbn", layers = ["layers.2"]}``), and fine-tuned by each evaluating client for 5
  local steps before it evaluates (``client.personal = {kind = "finetune", steps = 5}``: training unchanged), and
  with Ditto's personal models (``client.personal = {kind = "ditto", lam = 0.1}``: training unchanged);
* **bn-mlp**: an MLP with a BatchNorm after its hidden layer (defined here, passed as the model factory), as one global
  model and with FedBN's default (``client.personal = {kind = "fedbn"}``: the BatchNorm's weight, bias and running
  statistics are local).

Printed per arm: the clients' mean accuracy of the downloaded (global) model and, for the personalized arms, of each
client's own model (``client_eval/personal/accuracy``), both averaged over the versions closed in the last quarter of
the run, the central accuracy at the end, and the bytes sent up per update (a withheld layer is sent as zeros: the
dense codec's bytes do not shrink). The ratio is personal over the baseline's global accuracy. The figures and the
machine's description go to ``benchmarks/results/personalization.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import flasync  # noqa: E402
from flasync.config import load_config  # noqa: E402
from flasync.core.events import ClientsEvaluated  # noqa: E402
from flasync.testing import EventRecorder  # noqa: E402

if __package__:
    from benchmarks.record import Figure, machine, store
else:
    from record import Figure, machine, store

_BASE = [
    "seed=0",
    "data.kind=digits",
    "partition.kind=dirichlet",
    "partition.alpha=0.1",
    "population.num_clients=40",
    "executor.kind=thread",
    "tracking.enabled=false",
    "tracking.log_level=warning",
    "eval.clients.held_out=0.2",
    "eval.clients.fraction=1.0",
    "eval.clients.min_reports=5",
]


class BatchNormMLP(nn.Module):
    """64 -> 64 -> BatchNorm -> ReLU -> 10: the built-in MLP with a normalization layer for FedBN to keep local."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(64, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return the logits."""
        out: torch.Tensor = self.layers(x)
        return out


def _arm(overrides: list[str], factory: Callable[[], nn.Module] | None) -> dict[str, Any]:
    federation = flasync.Federation(load_config(None, overrides), model_factory=factory)
    recorder = EventRecorder(federation.bus)
    start = time.perf_counter()
    summary = asyncio.run(federation.run())
    wall_s = time.perf_counter() - start
    closed = sorted(recorder.of(ClientsEvaluated), key=lambda event: int(event.version))
    tail = closed[len(closed) * 3 // 4 :]
    figures: dict[str, Any] = {
        "central_accuracy": summary.accuracy,
        "upload_bytes_per_update": summary.upload_bytes / max(summary.updates_accepted, 1),
        "versions_averaged": [int(event.version) for event in tail],
        "global_accuracy": statistics.fmean(event.figures["accuracy"]["mean"] for event in tail),
        "wall_s": wall_s,
        "weights_sha256": summary.weights_sha256,
    }
    if "personal/accuracy" in tail[0].figures:
        figures["personal_accuracy"] = statistics.fmean(event.figures["personal/accuracy"]["mean"] for event in tail)
        figures["personal_worst10"] = statistics.fmean(event.figures["personal/accuracy"]["worst10"] for event in tail)
    figures["global_worst10"] = statistics.fmean(event.figures["accuracy"]["worst10"] for event in tail)
    return figures


def measure(versions: int) -> dict[str, dict[str, Any]]:
    """Run the six arms; return their figures by name."""
    base = [*_BASE, f"stop.max_versions={versions}"]
    return {
        "mlp_global": _arm(base, None),
        "mlp_local_head": _arm([*base, "client.personal.kind=fedbn", "client.personal.layers=[layers.2]"], None),
        "mlp_finetune": _arm([*base, "client.personal.kind=finetune", "client.personal.steps=5"], None),
        "mlp_ditto": _arm([*base, "client.personal.kind=ditto", "client.personal.lam=0.1"], None),
        "bn_mlp_global": _arm(base, BatchNormMLP),
        "bn_mlp_fedbn": _arm([*base, "client.personal.kind=fedbn"], BatchNormMLP),
    }


def _baseline(name: str) -> str:
    """The arm of one global model on the same network as arm ``name``."""
    return "bn_mlp_global" if name.startswith("bn_mlp_") else "mlp_global"


def main() -> None:
    """Measure, print and store the result (``benchmarks/results/personalization.json``)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--versions", type=int, default=100, help="model versions of each run")
    parser.add_argument("--out", type=Path, help="results JSON (default: benchmarks/results/personalization.json)")
    args = parser.parse_args()
    described = machine()
    arms = measure(args.versions)
    print(f"{args.versions} versions; clients' accuracy, mean over the last quarter's closed versions")
    print("arm              global  personal  ratio  global w10  personal w10  central  up B/update")
    headline = []
    for name, row in arms.items():
        baseline = arms[_baseline(name)]["global_accuracy"]
        personal = row.get("personal_accuracy")
        shown = "      -" if personal is None else f"{personal:8.3f}"
        ratio = "    -" if personal is None else f"{personal / baseline:5.2f}"
        worst = "           -" if personal is None else f"{row['personal_worst10']:12.3f}"
        print(
            f"{name:<15} {row['global_accuracy']:7.3f}  {shown}  {ratio}  {row['global_worst10']:10.3f}  {worst}"
            f"  {row['central_accuracy']:7.3f}  {row['upload_bytes_per_update']:11.0f}"
        )
        if personal is not None:
            row["personal_over_global"] = personal / baseline
            label = f"{name}: clients' personalized accuracy"
            headline.append(
                Figure(
                    label,
                    round(personal, 4),
                    "accuracy",
                    f"{_baseline(name)} (one global model)",
                    round(personal / baseline, 3),
                )
            )
    settings = {"versions": args.versions, "config": _BASE}
    where = store(
        "personalization", described, settings=settings, headline=headline, figures={"arms": arms}, out=args.out
    )
    print(f"written to {where}")


if __name__ == "__main__":
    main()
