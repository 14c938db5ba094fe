"""The per-client table: exact rows for a bounded hash sample, fixed-size histograms, ranking, checkpoint state."""

from __future__ import annotations

import io
import random
from collections import Counter

import pytest
import torch

from flasync.core.client_table import BINS, MAX_FIGURES, MAX_REASONS, ClientTable, client_hash, log2_bin


def _feed(table: ClientTable, clients: range, rng: random.Random) -> dict[int, list[int]]:
    """Give each client of ``clients`` 1-3 tasks with random outcomes; return the exact figures per client."""
    exact: dict[int, list[int]] = {}
    for client in clients:
        figures = exact.setdefault(client, [0, 0, 0, 0])  # tasks, accepted, refused, staleness sum
        for _ in range(rng.randint(1, 3)):
            table.dispatched(client, 100)
            figures[0] += 1
            table.uploaded(client, 40)
            if rng.random() < 0.8:
                staleness = rng.randint(0, 5)
                table.accepted(client, staleness)
                figures[1] += 1
                figures[3] += staleness
            else:
                table.refused(client, "stale")
                figures[2] += 1
    return exact


def test_log2_bins_hold_zero_and_powers_of_two() -> None:
    """Bin 0 holds 0, bin b holds [2**(b-1), 2**b), the largest values fall in the last bin."""
    assert [log2_bin(v) for v in (0, 1, 2, 3, 4, 7, 8)] == [0, 1, 2, 2, 3, 3, 4]
    assert log2_bin(2**70) == BINS - 1


def test_a_small_population_has_every_client_exactly() -> None:
    """Below the capacity every client has a row, and the rows sum to the counts of every event."""
    table = ClientTable(rows=50, top=50)
    exact = _feed(table, range(30), random.Random(1))
    shown = table.table()
    columns = shown["columns"]
    rows = {row[columns.index("client_id")]: row for row in shown["data"]}
    assert set(rows) == set(exact) and not table.sampled and table.clients_seen() == 30
    for client, (tasks, accepted, refused, staleness) in exact.items():
        row = rows[client]
        assert row[columns.index("tasks")] == tasks
        assert row[columns.index("accepted")] == accepted
        assert row[columns.index("refused")] == refused == row[columns.index("refused.stale")]
        assert row[columns.index("download_bytes")] == 100 * tasks
        mean = row[columns.index("staleness_mean")]
        assert (mean is None) if accepted == 0 else mean == pytest.approx(staleness / accepted)


def test_a_large_population_keeps_exact_rows_for_the_smallest_hashes() -> None:
    """Past the capacity the rows are the clients of smallest hash, each exact since its first task."""
    table = ClientTable(rows=64, top=32)
    exact = _feed(table, range(5000), random.Random(2))
    expected = sorted(exact, key=client_hash)[:64]
    kept = {row[1]: row for row in table.table()["data"]}
    assert len(table) == 64 and table.sampled and set(kept) == set(expected)
    for client in expected:
        assert kept[client][2:5] == exact[client][:3]


def test_the_distinct_count_estimate_is_close() -> None:
    """The KMV estimate of the clients seen is within a few standard errors (1/sqrt(k)) of the truth."""
    table = ClientTable(rows=1000, top=10)
    for client in range(0, 100_000, 2):
        table.dispatched(client, 1)
    assert table.clients_seen() == pytest.approx(50_000, rel=0.1)


def _state_bytes(table: ClientTable) -> int:
    buffer = io.BytesIO()
    torch.save(table.state_dict(), buffer)
    return len(buffer.getvalue())


@pytest.mark.slow
def test_memory_is_bounded_whatever_the_population() -> None:
    """Ten times more clients keep as many rows and a checkpoint state of about the same size."""
    small, large = ClientTable(rows=200, top=10), ClientTable(rows=200, top=10)
    for table, clients in ((small, 20_000), (large, 200_000)):
        for client in range(clients):
            table.dispatched(client, 1 << 20)
            table.uploaded(client, 1 << 16)
            table.accepted(client, client % 7)
            table.record(client, {"accuracy": 0.5})
    assert len(small) == len(large) == 200
    assert len(large._heap) == 200 and len(large._heavy._counts) == 40
    assert _state_bytes(large) <= 1.05 * _state_bytes(small)
    histograms = large.histograms()
    assert histograms["events"]["staleness"][0] == sum(1 for c in range(200_000) if c % 7 == 0)
    assert histograms["figures"]["accuracy"]["reports"] == 200_000


def test_the_table_shows_the_top_and_bottom_by_the_rank() -> None:
    """With more rows than twice ``top``, the ``top`` most and least refused clients are shown, in order."""
    table = ClientTable(rows=100, top=2, rank="refused")
    for client in range(10):
        table.dispatched(client, 10)
        for _ in range(client):
            table.refused(client, "norm")
    data = table.table()["data"]
    assert [(row[0], row[1]) for row in data] == [("top", 9), ("top", 8), ("bottom", 1), ("bottom", 0)]


def test_staleness_rank_puts_clients_without_updates_last() -> None:
    """Ranking by mean staleness: highest first, clients with no accepted update at the bottom."""
    table = ClientTable(rows=10, top=5, rank="staleness")
    table.accepted(1, 4)
    table.accepted(2, 1)
    table.dispatched(3, 10)
    assert [row[1] for row in table.table()["data"]] == [1, 2, 3]


def test_reported_figures_become_columns_and_summaries() -> None:
    """A sink's figures: the last value per row, count/mean/min/max over all reports, at most MAX_FIGURES names."""
    table = ClientTable(rows=10, top=10)
    table.record(1, {"accuracy": 0.5, "loss": 2.0})
    table.record(1, {"accuracy": 0.7})
    table.record(2, {"accuracy": 0.9})
    table.record(3, {f"m{i}": 1.0 for i in range(MAX_FIGURES)})
    shown = table.table()
    columns = shown["columns"]
    rows = {row[1]: row for row in shown["data"]}
    assert rows[1][columns.index("eval.accuracy")] == 0.7 and rows[1][columns.index("eval.loss")] == 2.0
    assert rows[2][columns.index("eval.loss")] is None
    summary = table.histograms()["figures"]["accuracy"]
    assert summary["reports"] == 3 and summary["mean"] == pytest.approx(0.7)
    assert (summary["min"], summary["max"]) == (0.5, 0.9)
    assert summary["clients"]["p50"] == pytest.approx(0.8)
    assert len(table.histograms()["figures"]) == MAX_FIGURES
    assert table.histograms()["figures_dropped"] == 2  # the two names past the cap


def test_refusal_reasons_are_capped() -> None:
    """Past MAX_REASONS distinct reasons, further ones count as ``other``."""
    table = ClientTable(rows=10, top=10)
    for i in range(MAX_REASONS + 3):
        table.refused(0, f"r{i}")
    refusals = table.histograms()["refusals"]
    assert len(refusals) == MAX_REASONS + 1 and refusals["other"] == 3


def test_state_round_trips_through_a_weights_only_load() -> None:
    """A table restored from its state (saved and loaded with weights_only) goes on exactly like the original."""
    rng = random.Random(3)
    table = ClientTable(rows=32, top=8)
    _feed(table, range(500), rng)
    table.record(5, {"accuracy": 0.25})
    buffer = io.BytesIO()
    torch.save(table.state_dict(), buffer)
    restored = ClientTable(rows=32, top=8)
    restored.load_state_dict(torch.load(io.BytesIO(buffer.getvalue()), weights_only=True))
    for copy in (table, restored):
        _feed(copy, range(400, 900), random.Random(4))
    assert restored.table() == table.table()
    assert restored.histograms() == table.histograms()


def test_a_state_larger_than_the_capacity_is_refused() -> None:
    """A state holding more rows than the table may keep is an error, not a silent growth."""
    table = ClientTable(rows=8, top=2)
    _feed(table, range(8), random.Random(5))
    with pytest.raises(ValueError, match="more than its 4"):
        ClientTable(rows=4, top=2).load_state_dict(table.state_dict())


@pytest.mark.parametrize(("rows", "top", "rank"), [(0, 1, "tasks"), (1, 0, "tasks"), (1, 1, "nope")])
def test_bad_arguments_are_refused(rows: int, top: int, rank: str) -> None:
    """Rows and top below 1 and an unknown rank are errors."""
    with pytest.raises(ValueError, match="must be"):
        ClientTable(rows=rows, top=top, rank=rank)


def test_the_hash_is_uniform_enough() -> None:
    """The hashes of consecutive ids spread evenly over [0, 1) (each tenth holds about a tenth)."""
    tenths = Counter(int(client_hash(c) * 10) for c in range(20_000))
    assert min(tenths.values()) > 1800 and max(tenths.values()) < 2200


def test_the_heaviest_client_is_found_outside_the_sample() -> None:
    """A client the sample left out but the server refused most is the first heavy hitter, its count an upper bound
    within its stated error of the truth."""
    table = ClientTable(rows=16, top=5, rank="refused")
    outside = max(range(5000), key=client_hash)  # the largest hash: never in the sample
    rng = random.Random(6)
    truth: Counter[int] = Counter()
    for step in range(20_000):
        client = outside if step % 50 == 0 else rng.randrange(5000)
        table.dispatched(client, 10)
        if client == outside or rng.random() < 0.01:
            table.refused(client, "norm")
            truth[client] += 1
    kept = {row[1] for row in table.table()["data"]}
    heavy = table.histograms()["heavy"]
    assert outside not in kept and heavy[0]["client_id"] == outside
    for entry in heavy:
        count, error = entry["refused"], entry["overstated_by_at_most"]
        assert count - error <= truth[entry["client_id"]] <= count
    assert len(heavy) == 5 and len(table._heavy._counts) == 20


def test_a_run_ranked_by_staleness_keeps_no_heavy_hitters() -> None:
    """Mean staleness is no count: nothing is kept for it beyond the rows."""
    table = ClientTable(rows=4, top=2, rank="staleness")
    for client in range(100):
        table.accepted(client, 3)
    assert table.histograms()["heavy"] == []


def test_the_heavy_hitters_match_the_plain_space_saving_algorithm() -> None:
    """The counters equal those of Space-Saving as written in the paper (a linear search for the smallest counter,
    ties to the smallest client id), on a skewed stream of weighted events."""
    table = ClientTable(rows=4, top=3, rank="upload_bytes")
    plain: dict[int, list[int]] = {}
    rng = random.Random(7)
    for _ in range(5000):
        client, amount = int(rng.paretovariate(1.2)) % 300, rng.randint(1, 50)
        table.uploaded(client, amount)
        if client in plain:
            plain[client][0] += amount
        elif len(plain) < 12:
            plain[client] = [amount, 0]
        else:
            smallest = min(plain, key=lambda c: (plain[c][0], c))
            floor = plain.pop(smallest)[0]
            plain[client] = [floor + amount, floor]
    assert table.state_dict()["heavy"] == [[c, total, error] for c, (total, error) in sorted(plain.items())]
