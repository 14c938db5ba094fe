"""What each partitioner gives 100 digits clients: sizes, labels per client and label skew, against the IID split.

For every partition kind (as ``flasync data describe`` computes it from a run config) prints the client sizes'
spread (standard deviation, and of their logarithms), the distinct labels per client, the mean total-variation
distance of a client's label histogram from the global one (0: IID, 1: disjoint), and the same figures' ratio to the
IID split made in the same run; writes them to ``benchmarks/results/partitions.json``.

    python benchmarks/partitions.py            # a few seconds
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from flasync.config import RunConfig
from flasync.data import prepare
from flasync.data.describe import describe_partition

if __package__:
    from benchmarks.record import Figure, machine, store
else:
    from record import Figure, machine, store

RESULT = Path(__file__).resolve().parent / "results" / "partitions.json"
SEEDS = (0, 1, 2)

KINDS: dict[str, dict[str, Any]] = {
    "iid": {"kind": "iid"},
    "dirichlet(0.1)": {"kind": "dirichlet", "alpha": 0.1},
    "dirichlet(1.0)": {"kind": "dirichlet", "alpha": 1.0},
    "shards(2)": {"kind": "shards", "shards_per_client": 2},
    "label_quantity(k=2)": {"kind": "label_quantity", "labels_per_client": 2},
    "quantity(lognormal 1.0)": {"kind": "quantity", "distribution": "lognormal", "sigma": 1.0},
    "quantity(powerlaw 2.0)": {"kind": "quantity", "distribution": "powerlaw", "exponent": 2.0},
    "feature_skew(noise 0.5)": {"kind": "feature_skew", "noise": 0.5},
}
KEYS = {name: name.replace("(", "_").replace(")", "").replace(" ", "_").replace("k=", "") for name in KINDS}
"""Each kind's key in the stored result (``dirichlet_0.1``, ``quantity_lognormal_1.0``: a figure marker's path
names it)."""


def _figures(partition: dict[str, Any], seed: int) -> dict[str, float]:
    config = RunConfig.model_validate({"seed": seed, "population": {"num_clients": 100}, "partition": partition})
    loaded = prepare.load(config)
    split = prepare.partition(config, loaded.train)
    counts = describe_partition(loaded.train.y.numpy(), split, loaded.train.num_classes).label_counts
    sizes = counts.sum(axis=1)
    share = counts / np.maximum(sizes[:, None], 1)
    overall = counts.sum(axis=0) / counts.sum()
    figures = {}
    if partition["kind"] == "feature_skew":  # the noise each client's features carry, measured against clean ones
        clean = prepare.load(config.model_copy(update={"partition": RunConfig().partition})).train.x
        rows = [torch.from_numpy(np.array(part)) for part in split]
        residual = [(loaded.train.x[index] - clean[index]).std().item() for index in rows]
        figures = {"noise_std_first": residual[0], "noise_std_last": residual[-1]}
    return figures | {
        "size_std": float(sizes.std()),
        "size_log_std": float(np.log(sizes).std()),
        "size_max_over_median": float(sizes.max() / np.median(sizes)),
        "labels_per_client_mean": float((counts > 0).sum(axis=1).mean()),
        "label_tv_mean": float(0.5 * np.abs(share - overall).sum(axis=1).mean()),
    }


def main() -> None:
    """Describe each partition for three seeds; print the medians and their ratios to IID, and store them."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULT)
    args = parser.parse_args()
    described = machine()
    started = time.perf_counter()
    medians: dict[str, dict[str, float]] = {}
    for name, partition in KINDS.items():
        per_seed = [_figures(partition, seed) for seed in SEEDS]
        medians[name] = {key: float(np.median([f[key] for f in per_seed])) for key in per_seed[0]}
    base = medians["iid"]
    print("digits, 100 clients, median of seeds 0-2")
    print("| partition | size std | std of log size | labels per client | label TV distance | TV / IID |")
    print("|---|---|---|---|---|---|")
    for name, f in medians.items():
        print(
            f"| {name} | {f['size_std']:.1f} | {f['size_log_std']:.2f} | {f['labels_per_client_mean']:.2f} | "
            f"{f['label_tv_mean']:.3f} | {f['label_tv_mean'] / base['label_tv_mean']:.1f}x |"
        )
    tv_over_iid = {name: f["label_tv_mean"] / base["label_tv_mean"] for name, f in medians.items()}
    headline = [
        Figure(f"label TV distance, {name}", medians[name]["label_tv_mean"], "TV", "iid", tv_over_iid[name])
        for name in ("dirichlet(0.1)", "shards(2)", "label_quantity(k=2)")
    ]
    headline.append(
        Figure(
            "std of log client size, quantity(lognormal 1.0)",
            medians["quantity(lognormal 1.0)"]["size_log_std"],
            "log",
            "iid",
            medians["quantity(lognormal 1.0)"]["size_log_std"] / base["size_log_std"],
        )
    )
    wall_s = round(time.perf_counter() - started, 1)
    settings = {"data": "digits", "clients": 100, "seeds": list(SEEDS), "statistic": "median over the seeds"}
    figures = {
        "median": {KEYS[name]: {"partition": name, **f} for name, f in medians.items()},
        "tv_over_iid": {KEYS[name]: ratio for name, ratio in tv_over_iid.items()},
        "wall_s": wall_s,
    }
    noise = medians["feature_skew(noise 0.5)"]
    print(
        f"feature_skew(noise 0.5): measured noise std {noise['noise_std_first']:.4f} (client 0, configured 0.005), "
        f"{noise['noise_std_last']:.4f} (client 99, configured 0.5)"
    )
    print(f"({wall_s:.0f} s)")
    store("partitions", described, settings=settings, headline=headline, figures=figures, out=args.out)


if __name__ == "__main__":
    main()
