"""Tests of flasync.data.describe: per-client label counts and their summary."""

from __future__ import annotations

import numpy as np

from flasync.data import Partition
from flasync.data.describe import describe_partition, format_description


def test_label_counts_and_summary_match_a_hand_count() -> None:
    """Two clients' label counts, sizes, distinct labels and summary figures, counted by hand."""
    labels = np.array([0, 1, 1, 2, 2, 2, 0])
    part = Partition.from_lists([np.array([0, 1, 2]), np.array([3, 4, 5, 6])])
    described = describe_partition(labels, part, 3)
    assert described.label_counts.tolist() == [[1, 2, 0], [1, 0, 3]]
    assert described.sizes.tolist() == [3, 4]
    assert described.labels_per_client.tolist() == [2, 2]
    summary = described.summary()
    assert (summary["samples"], summary["size_mean"], summary["labels_max"]) == (7.0, 3.5, 2.0)
    text = format_description(described, rows=2)
    assert "     0      3  1 2 0" in text and "     1      4  1 0 3" in text
