"""What a partition gives each client: per-client label histograms and sizes, and their summary as text.

``flasync data describe`` prints :func:`format_description` of :func:`describe_partition` and, with tracking on,
logs the per-client table and its charts to MLflow.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from flasync.data import Partition

__all__ = ["PartitionDescription", "describe_partition", "format_description"]


@dataclass(frozen=True, slots=True, eq=False)
class PartitionDescription:
    """Per-client label counts of a partition.

    Attributes:
        label_counts: ``int64`` of shape ``(K, C)``: samples of label ``c`` client ``k`` holds.
        noise_levels: Each client's feature-noise standard deviation (feature skew), else None.
    """

    label_counts: np.ndarray
    noise_levels: np.ndarray | None = None

    @property
    def sizes(self) -> np.ndarray:
        """Samples per client, ``int64`` of shape ``(K,)``."""
        sizes: np.ndarray = self.label_counts.sum(axis=1)
        return sizes

    @property
    def labels_per_client(self) -> np.ndarray:
        """Distinct labels per client, ``int64`` of shape ``(K,)``."""
        labels: np.ndarray = (self.label_counts > 0).sum(axis=1)
        return labels

    def summary(self) -> dict[str, float]:
        """Return the partition's figures: clients, samples, size moments and quantiles, labels per client."""
        sizes = self.sizes.astype(np.float64)
        labels = self.labels_per_client
        positive = sizes[sizes > 0]
        return {
            "clients": float(sizes.shape[0]),
            "samples": float(sizes.sum()),
            "size_min": float(sizes.min()),
            "size_median": float(np.median(sizes)),
            "size_mean": float(sizes.mean()),
            "size_max": float(sizes.max()),
            "size_std": float(sizes.std()),
            "size_log_std": float(np.log(positive).std()) if positive.shape[0] else 0.0,
            "labels_min": float(labels.min()),
            "labels_mean": float(labels.mean()),
            "labels_max": float(labels.max()),
        }

    def to_json(self) -> dict[str, Any]:
        """Return the summary and the per-client table as plain JSON values."""
        table: dict[str, Any] = {
            "size": self.sizes.tolist(),
            "label_counts": self.label_counts.tolist(),
        }
        if self.noise_levels is not None:
            table["noise_std"] = self.noise_levels.tolist()
        return {"summary": self.summary(), "clients": table}


def describe_partition(
    labels: np.ndarray, partition: Partition, num_classes: int, noise_levels: np.ndarray | None = None
) -> PartitionDescription:
    """Count each client's samples of every label.

    Args:
        labels: Labels of the training samples, integers in ``[0, num_classes)``, shape ``(N,)``.
        partition: Which samples each client holds.
        num_classes: ``C``.
        noise_levels: Each client's feature-noise level, kept for the table (feature skew).

    Returns:
        The per-client label counts.
    """
    client = np.repeat(np.arange(len(partition), dtype=np.int64), partition.sizes)
    flat = client * num_classes + np.asarray(labels, dtype=np.int64)[partition.indices]
    counts = np.bincount(flat, minlength=len(partition) * num_classes).reshape(len(partition), num_classes)
    return PartitionDescription(counts.astype(np.int64), noise_levels)


def _text_histogram(values: np.ndarray, bins: int, width: int = 40) -> list[str]:
    """Return one line per bin: its range, a bar of ``#`` and its count (one line per value for few integers)."""
    if np.issubdtype(values.dtype, np.integer) and int(values.max()) - int(values.min()) < 2 * bins:
        return _text_counts(values, width)
    counts, edges = np.histogram(values, bins=bins)
    top = max(int(counts.max()), 1)
    integer = np.issubdtype(values.dtype, np.integer)
    lines = []
    for count, low, high in zip(counts, edges[:-1], edges[1:], strict=True):
        span = f"{low:8.0f} - {high:<8.0f}" if integer else f"{low:8.3g} - {high:<8.3g}"
        lines.append(f"  {span} {'#' * round(width * int(count) / top):<{width}} {int(count)}")
    return lines


def _text_counts(values: np.ndarray, width: int = 40) -> list[str]:
    """Return one line per integer from the least to the greatest value: a bar of ``#`` and its count."""
    low = int(values.min())
    counts = np.bincount(values - low)
    top = max(int(counts.max()), 1)
    return [
        f"  {low + i:8d} {'#' * round(width * int(c) / top):<{width}} {int(c)}" for i, c in enumerate(counts.tolist())
    ]


def format_description(description: PartitionDescription, *, title: str = "", rows: int = 20) -> str:
    """Return the partition's summary, size histogram and the first ``rows`` clients' label counts as text.

    Args:
        description: What to show.
        title: The first line (e.g. the partition's config).
        rows: Clients listed one per line (the JSON artifact holds them all).
    """
    s = description.summary()
    lines = [title] if title else []
    lines += [
        f"clients {int(s['clients'])}, samples {int(s['samples'])}",
        f"size: min {s['size_min']:.0f}, median {s['size_median']:.0f}, mean {s['size_mean']:.1f}, "
        f"max {s['size_max']:.0f}, std {s['size_std']:.1f}, std of log {s['size_log_std']:.3f}",
        f"labels per client: min {s['labels_min']:.0f}, mean {s['labels_mean']:.2f}, max {s['labels_max']:.0f}",
        "client sizes:",
        *_text_histogram(description.sizes, bins=min(10, max(1, int(s["clients"])))),
        "labels per client:",
        *_text_counts(description.labels_per_client),
    ]
    counts = description.label_counts
    shown = min(rows, counts.shape[0])
    noise = description.noise_levels
    header = "client   size  " + ("noise   " if noise is not None else "") + "label counts (0..C-1)"
    lines += [f"first {shown} of {counts.shape[0]} clients:", header]
    for k in range(shown):
        level = f"{noise[k]:6.3f}  " if noise is not None else ""
        lines.append(f"{k:6d} {int(counts[k].sum()):6d}  {level}{' '.join(str(int(c)) for c in counts[k])}")
    return "\n".join(lines)
