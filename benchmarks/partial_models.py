"""Partial-model exchange: LoRA adapters and a head-only exchange against full-model FedAvg, bytes and accuracy.

FedAvg on digits (Dirichlet 0.5, 100 clients, 10 a round) from ``examples/lora_adapters.toml``, fine-tuning an MLP
64 -> 256 -> 256 -> 10 that is first trained centrally, in this script, on a public share of the training data
(nothing is downloaded). Four federations start from that model, with the same seed:

* ``full``: every parameter trains and travels (the baseline);
* ``lora r=4 + head``: LoRA adapters (peft) on both hidden layers, and the head, train and travel;
* ``lora r=4``: the adapters only (on all three layers);
* ``head only``: ``model.exchange = ["layers.4"]``.

It prints each run's final accuracy, bytes up and down per client task, and the ratios to ``full``, and writes them
with a description of the machine to ``benchmarks/results/partial_models.json``.

    python benchmarks/partial_models.py [--versions 40] [--public 0.1]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import flasync
from flasync import tracking
from flasync.config import RunConfig, load_config
from flasync.data import prepare
from flasync.training.models import MLP

if __package__:
    from benchmarks.record import Figure, machine, store
else:
    from record import Figure, machine, store

_HERE = Path(__file__).resolve().parent
EXAMPLE = _HERE.parent / "examples" / "lora_adapters.toml"
HIDDEN = (256, 256)

VARIANTS: dict[str, dict[str, Any]] = {
    "full": {},
    "lora r=4 + head": {
        "adapter": {"kind": "lora", "r": 4, "target": ["layers.0", "layers.2"], "modules_to_save": ["layers.4"]}
    },
    "lora r=4": {"adapter": {"kind": "lora", "r": 4, "target": ["layers.0", "layers.2", "layers.4"]}},
    "head only": {"exchange": ["layers.4"]},
}
KEYS = {"full": "full", "lora r=4 + head": "lora_r4_head", "lora r=4": "lora_r4", "head only": "head_only"}
"""Each variant's key in the stored result (a figure marker's path names it)."""


def config_of(variant: dict[str, Any], *, versions: int, seed: int) -> RunConfig:
    """Return the example's config with the variant's model fields."""
    config = load_config(
        EXAMPLE,
        [f"seed={seed}", f"stop.max_versions={versions}", "tracking.enabled=false", "tracking.log_level=warning"],
    )
    data = config.model_dump()
    data["model"] = {"kind": "mlp", "hidden": list(HIDDEN), "exchange": None, "adapter": None, **variant}
    return RunConfig.model_validate(data)


def pretrain(config: RunConfig, public: float, *, epochs: int = 30, seed: int = 0) -> dict[str, torch.Tensor]:
    """Train the MLP centrally on the first ``public`` share of the run's training split; return its state dict."""
    train = prepare.load(config).train
    n = int(len(train.y) * public)
    x, y = train.x[:n].float(), train.y[:n]
    generator = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = MLP(x.shape[1], HIDDEN, int(train.num_classes))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for _ in range(epochs):
        for rows in torch.randperm(n, generator=generator).split(32):
            optimizer.zero_grad()
            F.cross_entropy(model(x[rows]), y[rows]).backward()  # type: ignore[no-untyped-call]
            optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def run_variant(config: RunConfig, state: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Run one federation from the pretrained ``state``; return its figures."""

    start = time.perf_counter()
    summary = flasync.run(config, model_factory=lambda: _loaded(state))
    tasks = max(summary.tasks_dispatched, 1)
    return {
        "accuracy": summary.accuracy,
        "upload_bytes": summary.upload_bytes,
        "download_bytes": summary.download_bytes,
        "upload_bytes_per_update": summary.upload_bytes / max(summary.updates_accepted, 1),
        "download_bytes_per_task": summary.download_bytes / tasks,
        "wall_s": round(time.perf_counter() - start, 2),
        "weights_sha256": summary.weights_sha256,
    }


def main() -> None:
    """Pretrain, run the four exchanges, print the table and write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--versions", type=int, default=40, help="FedAvg rounds of each run")
    parser.add_argument("--public", type=float, default=0.1, help="share of the training split used to pretrain")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=_HERE / "results" / "partial_models.json")
    args = parser.parse_args()
    tracking.configure_logging(level="warning")
    torch.set_num_threads(1)
    described = machine()
    state = pretrain(config_of({}, versions=args.versions, seed=args.seed), args.public, seed=args.seed)
    test = prepare.load(config_of({}, versions=1, seed=args.seed)).test
    with torch.no_grad():
        pretrained = float((_loaded(state)(test.x.float()).argmax(1) == test.y).float().mean())
    results = {
        name: run_variant(config_of(v, versions=args.versions, seed=args.seed), state) for name, v in VARIANTS.items()
    }
    full = results["full"]
    print(
        f"FedAvg on digits, Dirichlet(0.5), 100 clients, 10 a round, {args.versions} rounds, from an MLP 64-256-256-10 "
        f"pretrained on {args.public:.0%} of the training split (its test accuracy: {pretrained:.4f})"
    )
    print(
        f"{'exchange':<18} {'accuracy':>9} {'vs full':>9} {'up B/update':>12} {'down B/task':>12} {'fewer bytes':>12}"
    )
    for name, figures in results.items():
        figures["fewer_bytes_than_full"] = full["upload_bytes_per_update"] / figures["upload_bytes_per_update"]
        figures["accuracy_minus_full"] = figures["accuracy"] - full["accuracy"]
        print(
            f"{name:<18} {figures['accuracy']:>9.4f} {100 * figures['accuracy_minus_full']:>+7.2f}pt "
            f"{figures['upload_bytes_per_update']:>12.0f} {figures['download_bytes_per_task']:>12.0f} "
            f"{figures['fewer_bytes_than_full']:>11.1f}x"
        )
    headline = [
        Figure(
            f"upload bytes per update, {name}",
            figures["upload_bytes_per_update"],
            "bytes",
            "full model",
            figures["upload_bytes_per_update"] / full["upload_bytes_per_update"],
        )
        for name, figures in results.items()
        if name != "full"
    ]
    headline += [
        Figure(f"accuracy, {name}", accuracy, "accuracy", "full model", accuracy / full["accuracy"])
        for name, accuracy in ((name, figures["accuracy"]) for name, figures in results.items())
        if name != "full"
    ]
    settings = {"versions": args.versions, "public": args.public, "seed": args.seed, "hidden": list(HIDDEN)}
    runs = {KEYS[name]: {"exchange": name, **figures} for name, figures in results.items()}
    figures = {"pretrained_accuracy": pretrained, "runs": runs}
    store("partial_models", described, settings=settings, headline=headline, figures=figures, out=args.out)


def _loaded(state: dict[str, torch.Tensor]) -> MLP:
    model = MLP(64, HIDDEN, 10)
    model.load_state_dict(state)
    return model


if __name__ == "__main__":
    main()
