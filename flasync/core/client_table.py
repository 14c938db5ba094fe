"""Per-client views of a run, bounded whatever the population's size: exact rows for a sample of clients, and
fixed-size histograms over every client's tasks and updates (``tracking.client_table``).

A run of a million clients cannot keep a row per client. :class:`ClientTable` keeps exact rows (tasks, updates
accepted and refused by reason, staleness, bytes, the last figures a plug-in reported) for at most ``rows`` clients,
chosen by *bottom-k hash sampling* (Cohen and Kaplan, "Summarizing data using bottom-k sketches", PODC 2007): each
client id hashes to ``h(c)`` in ``[0, 1)`` and the table keeps the ``rows`` clients of smallest hash among those seen.
The largest hash kept only ever falls, so a client outside the table never enters it later and a client inside it
has been there since its first task: every row is exact, and the rows are a uniform sample of the clients seen
(all of them while fewer than ``rows`` were). The same sketch estimates how many distinct clients were seen,
``(k - 1) / h_(k)`` (the KMV estimator, Bar-Yossef et al., RANDOM 2002), exact while the table is not full.

Beside the rows, fixed-size histograms count every event of every client: the staleness of each accepted update,
the bytes of each upload and download (log2 bins), and refusals by reason. :meth:`ClientTable.table` selects the
``top`` rows ranked highest and lowest by a chosen figure (most tasks, most refusals, highest mean staleness, ...).
Since a sample can miss the one client that matters (the one the server refuses most), the table also keeps the
heaviest clients by that figure over *all* clients with the Space-Saving algorithm (Metwally, Agrawal and El Abbadi,
"Efficient computation of frequent and top-k elements in data streams", ICDT 2005): ``4 * top`` counters, each an
upper bound of its client's figure with the most it may overstate it; every client whose figure exceeds ``1 / (4 *
top)`` of the total is among them.

The table is a :class:`ClientFigures` sink: whatever learns a per-client figure (a plug-in evaluating on clients)
hands it to :meth:`ClientTable.record`, and it becomes a column of the rows (the last value per client) and a
summary over all reports. Nothing here draws random numbers or reads a clock: a run with the table is bit-identical
to one without it.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal, Protocol, get_args

from flasync.core.quantiles import percentile

__all__ = [
    "BINS",
    "HISTOGRAMS_ARTIFACT",
    "MAX_FIGURES",
    "MAX_REASONS",
    "RANKS",
    "TABLE_ARTIFACT",
    "ClientFigures",
    "ClientTable",
    "Rank",
    "client_hash",
    "log2_bin",
]

Rank = Literal["tasks", "accepted", "refused", "failed", "staleness", "upload_bytes", "download_bytes"]
"""The figure :meth:`ClientTable.table` ranks rows by (``staleness``: the mean staleness of accepted updates)."""
RANKS: Final[tuple[str, ...]] = get_args(Rank)
BINS: Final = 65
"""Log2 bins of a histogram: bin 0 holds 0, bin ``b`` holds ``[2**(b-1), 2**b)`` (so 64-bit values fit)."""
MAX_REASONS: Final = 32
"""Distinct refusal reasons counted by name; further ones count under ``other``."""
MAX_FIGURES: Final = 32
"""Distinct reported figure names kept; further ones are ignored (and counted in ``figures_dropped``)."""
TABLE_ARTIFACT: Final = "clients/table.json"
"""The run artifact of :meth:`ClientTable.table` (MLflow's table format, shown in the UI's artifact view)."""
HISTOGRAMS_ARTIFACT: Final = "clients/histograms.json"
"""The run artifact of :meth:`ClientTable.histograms`."""
_MASK = (1 << 64) - 1


class ClientFigures(Protocol):
    """A sink of per-client figures (e.g. a client-side evaluation's metrics of one report)."""

    def record(self, client_id: int, figures: Mapping[str, float]) -> None:
        """Take the latest ``figures`` of client ``client_id`` (metric name -> value)."""
        ...


def client_hash(client_id: int) -> float:
    """Return the client's sampling hash in ``[0, 1)``: SplitMix64 of its id (fixed: the same sample every run)."""
    z = (client_id + 0x9E3779B97F4A7C15) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return ((z ^ (z >> 31)) >> 11) / float(1 << 53)


def log2_bin(value: int) -> int:
    """Return the log2 bin of a non-negative integer (see :data:`BINS`)."""
    return min(max(int(value), 0).bit_length(), BINS - 1)


@dataclass(slots=True)
class _Row:
    """One sampled client's exact figures since its first task."""

    tasks: int = 0
    accepted: int = 0
    refused: int = 0
    failed: int = 0
    timed_out: int = 0
    staleness_sum: int = 0
    upload_bytes: int = 0
    download_bytes: int = 0
    reasons: Counter[str] = field(default_factory=Counter)
    figures: dict[str, float] = field(default_factory=dict)

    def rank(self, by: str) -> float:
        """Return the row's figure ``by`` (a :data:`Rank`)."""
        if by == "staleness":
            return self.staleness_sum / self.accepted if self.accepted else math.nan
        return float(getattr(self, by))

    _INTS = ("tasks", "accepted", "refused", "failed", "timed_out", "staleness_sum", "upload_bytes", "download_bytes")

    def state(self, client_id: int) -> dict[str, Any]:
        """Return the row as plain values."""
        out: dict[str, Any] = {name: getattr(self, name) for name in self._INTS}
        return {"client_id": client_id, **out, "reasons": dict(self.reasons), "figures": dict(self.figures)}

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> _Row:
        """Rebuild :meth:`state`."""
        row = cls()
        for name in cls._INTS:
            setattr(row, name, int(state[name]))
        row.reasons = Counter({str(k): int(v) for k, v in state["reasons"].items()})
        row.figures = {str(k): float(v) for k, v in state["figures"].items()}
        return row


class ClientTable:
    """Per-client accounting with bounded memory (see the module): exact rows for a hash sample, histograms of all.

    Args:
        rows: The most clients with a row of their own (at least 1).
        top: How many rows :meth:`table` shows at each end of the ranking (at least 1).
        rank: The figure the rows are ranked by.

    Raises:
        ValueError: If ``rows`` or ``top`` is below 1 or ``rank`` is not one of :data:`RANKS`.
    """

    def __init__(self, rows: int, top: int, rank: str = "tasks") -> None:
        """Start with no client seen."""
        if rows < 1 or top < 1:
            raise ValueError(f"rows and top must be at least 1, got {rows} and {top}")
        if rank not in RANKS:
            raise ValueError(f"rank must be one of {', '.join(RANKS)}, got {rank!r}")
        self.capacity = rows
        self.top = top
        self.rank = rank
        self._rows: dict[int, _Row] = {}
        self._heap: list[tuple[float, int]] = []  # (-hash, client) of every row: the largest hash on top
        self._full = False  # a client was turned away or evicted: the rows are a sample
        self._staleness = [0] * BINS
        self._upload = [0] * BINS
        self._download = [0] * BINS
        self._reasons: Counter[str] = Counter()
        self._figures: dict[str, list[float]] = {}  # name -> [count, sum, min, max] over every report
        self._figures_dropped = 0
        self._heavy = _SpaceSaving(4 * top)

    # ------------------------------------------------------------------------------------------------ events
    def _row(self, client_id: int) -> _Row | None:
        """Return the client's row, making it if the client belongs to the sample; None if it does not."""
        row = self._rows.get(client_id)
        if row is not None:
            return row
        key = client_hash(client_id)
        if len(self._rows) >= self.capacity:
            self._full = True
            if key >= -self._heap[0][0]:
                return None
            _, evicted = heapq.heappop(self._heap)
            del self._rows[evicted]
        row = self._rows[client_id] = _Row()
        heapq.heappush(self._heap, (-key, client_id))
        return row

    def dispatched(self, client_id: int, download_bytes: int) -> None:
        """Count a task given to the client and the model it downloads."""
        self._download[log2_bin(download_bytes)] += 1
        self._weigh(client_id, "tasks", 1)
        self._weigh(client_id, "download_bytes", download_bytes)
        row = self._row(client_id)
        if row is not None:
            row.tasks += 1
            row.download_bytes += download_bytes

    def uploaded(self, client_id: int, num_bytes: int) -> None:
        """Count the client's upload, whatever becomes of it."""
        self._upload[log2_bin(num_bytes)] += 1
        self._weigh(client_id, "upload_bytes", num_bytes)
        row = self._row(client_id)
        if row is not None:
            row.upload_bytes += num_bytes

    def accepted(self, client_id: int, staleness: int) -> None:
        """Count the client's update folded in with ``staleness``."""
        self._staleness[log2_bin(staleness)] += 1
        self._weigh(client_id, "accepted", 1)
        row = self._row(client_id)
        if row is not None:
            row.accepted += 1
            row.staleness_sum += staleness

    def refused(self, client_id: int, reason: str) -> None:
        """Count the client's update refused for ``reason``."""
        reason = self._reason(reason)
        self._reasons[reason] += 1
        self._weigh(client_id, "refused", 1)
        row = self._row(client_id)
        if row is not None:
            row.refused += 1
            row.reasons[reason] += 1

    def failed(self, client_id: int) -> None:
        """Count a task the client reported failed."""
        self._weigh(client_id, "failed", 1)
        row = self._row(client_id)
        if row is not None:
            row.failed += 1

    def timed_out(self, client_id: int) -> None:
        """Count a task of the client whose time limit passed."""
        row = self._row(client_id)
        if row is not None:
            row.timed_out += 1

    def record(self, client_id: int, figures: Mapping[str, float]) -> None:
        """Take the client's latest figures (:class:`ClientFigures`): the row keeps the last value of each, and each
        name's count, mean, min and max over every report are kept (at most :data:`MAX_FIGURES` names)."""
        kept: dict[str, float] = {}
        for name, raw in figures.items():
            value = float(raw)
            summary = self._figures.get(name)
            if summary is None:
                if len(self._figures) >= MAX_FIGURES:
                    self._figures_dropped += 1
                    continue
                summary = self._figures[name] = [0.0, 0.0, math.inf, -math.inf]
            kept[name] = value
            if math.isfinite(value):
                summary[0] += 1
                summary[1] += value
                summary[2] = min(summary[2], value)
                summary[3] = max(summary[3], value)
        row = self._row(client_id)
        if row is not None:
            row.figures.update(kept)

    def _weigh(self, client_id: int, figure: str, amount: int) -> None:
        """Add ``amount`` to the client's heavy-hitter counter when ``figure`` is the rank."""
        if figure == self.rank:
            self._heavy.add(client_id, amount)

    def _reason(self, reason: str) -> str:
        """Return the key a refusal reason counts under (``other`` past :data:`MAX_REASONS` reasons)."""
        return reason if reason in self._reasons or len(self._reasons) < MAX_REASONS else "other"

    # ----------------------------------------------------------------------------------------------- views
    @property
    def sampled(self) -> bool:
        """Whether the rows are a sample (more clients were seen than :attr:`capacity`)."""
        return self._full

    def __len__(self) -> int:
        """Return the number of rows kept."""
        return len(self._rows)

    def clients_seen(self) -> float:
        """Return the number of distinct clients seen: exact while the table is not full, else the KMV estimate."""
        if not self._full:
            return float(len(self._rows))
        return (len(self._rows) - 1) / max(-self._heap[0][0], 1e-300)

    def table(self) -> dict[str, Any]:
        """Return the selected rows as a table, ``{"columns": [...], "data": [[...], ...]}``.

        The rows are ranked by :attr:`rank` (highest first, ties by client id); with more than ``2 * top`` rows,
        the ``top`` highest (``group`` "top") and the ``top`` lowest ("bottom") are shown, else all ("all").
        Columns: ``group``, ``client_id``, the counts, ``staleness_mean``, the bytes, one ``refused.<reason>`` per
        reason seen and one ``eval.<name>`` per figure reported (None where a client has none).
        """
        ranked = sorted(self._rows.items(), key=lambda item: (-_finite(item[1].rank(self.rank)), item[0]))
        if len(ranked) > 2 * self.top:
            chosen = [("top", item) for item in ranked[: self.top]] + [("bottom", item) for item in ranked[-self.top :]]
        else:
            chosen = [("all", item) for item in ranked]
        reasons = sorted(self._reasons)
        names = sorted(self._figures)
        columns = [
            "group",
            "client_id",
            "tasks",
            "accepted",
            "refused",
            "failed",
            "timed_out",
            "staleness_mean",
            "upload_bytes",
            "download_bytes",
            *(f"refused.{reason}" for reason in reasons),
            *(f"eval.{name}" for name in names),
        ]
        data = []
        for group, (client_id, row) in chosen:
            staleness = row.rank("staleness")
            data.append(
                [
                    group,
                    client_id,
                    row.tasks,
                    row.accepted,
                    row.refused,
                    row.failed,
                    row.timed_out,
                    None if math.isnan(staleness) else staleness,
                    row.upload_bytes,
                    row.download_bytes,
                    *(row.reasons.get(reason, 0) for reason in reasons),
                    *(row.figures.get(name) for name in names),
                ]
            )
        return {"columns": columns, "data": data}

    def histograms(self) -> dict[str, Any]:
        """Return the histograms and summaries as plain values (JSON-ready).

        ``events``: log2 histograms over every client's events (``bins`` are the lower edges): accepted updates'
        staleness, uploads' and downloads' bytes. ``refusals``: refusals by reason. ``clients``: per-client
        distributions over the rows (a uniform sample when ``sampled``): p10/p50/p90 and a log2 histogram of each
        count. ``figures``: each reported figure's count, mean, min and max over every report, and p10/p50/p90 of
        the rows' last values.
        """
        rows = list(self._rows.values())
        per_client: dict[str, Any] = {}
        for name in ("tasks", "accepted", "refused", "failed", "timed_out", "upload_bytes", "download_bytes"):
            values = [getattr(row, name) for row in rows]
            per_client[name] = {**_spread(values), "histogram": _histogram(values)}
        staleness = [row.rank("staleness") for row in rows if row.accepted]
        per_client["staleness_mean"] = _spread(staleness)
        figures = {}
        for name, (count, total, low, high) in sorted(self._figures.items()):
            last = [row.figures[name] for row in rows if name in row.figures and math.isfinite(row.figures[name])]
            figures[name] = {
                "reports": int(count),
                "mean": total / count if count else None,
                "min": low if count else None,
                "max": high if count else None,
                "clients": _spread(last),
            }
        events = {
            "staleness": _trimmed(self._staleness),
            "upload_bytes": _trimmed(self._upload),
            "download_bytes": _trimmed(self._download),
        }
        used = max(
            [len(bins) for bins in events.values()]
            + [len(figure["histogram"]) for figure in per_client.values() if "histogram" in figure]
        )
        return {
            "rows": len(rows),
            "capacity": self.capacity,
            "rank": self.rank,
            "top": self.top,
            "sampled": self._full,
            "clients_seen": self.clients_seen(),
            "bins": [0] + [1 << (b - 1) for b in range(1, used)],
            "events": events,
            "refusals": dict(sorted(self._reasons.items())),
            "clients": per_client,
            "figures": figures,
            "figures_dropped": self._figures_dropped,
            "heavy": [
                {"client_id": client, self.rank: count, "overstated_by_at_most": error}
                for client, count, error in self._heavy.heaviest(self.top)
            ],
        }

    # ----------------------------------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Return the table's state for a checkpoint (plain values; its size is bounded by ``rows``)."""
        return {
            "rows": [row.state(client_id) for client_id, row in sorted(self._rows.items())],
            "full": self._full,
            "staleness": list(self._staleness),
            "upload": list(self._upload),
            "download": list(self._download),
            "reasons": dict(self._reasons),
            "figures": {name: list(summary) for name, summary in self._figures.items()},
            "figures_dropped": self._figures_dropped,
            "heavy": self._heavy.state(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` (an empty state: nothing seen yet).

        Raises:
            ValueError: If the state holds more rows than this table's capacity or a histogram of another size.
        """
        if not state:
            return
        rows = state["rows"]
        if len(rows) > self.capacity:
            raise ValueError(f"the client table holds {len(rows)} rows, more than its {self.capacity}")
        self._rows = {int(row["client_id"]): _Row.from_state(row) for row in rows}
        self._heap = [(-client_hash(client_id), client_id) for client_id in self._rows]
        heapq.heapify(self._heap)
        self._full = bool(state["full"])
        for name in ("staleness", "upload", "download"):
            bins = [int(x) for x in state[name]]
            if len(bins) != BINS:
                raise ValueError(f"the client table's {name} histogram has {len(bins)} bins, not {BINS}")
            setattr(self, f"_{name}", bins)
        self._reasons = Counter({str(k): int(v) for k, v in state["reasons"].items()})
        self._figures = {str(k): [float(x) for x in v] for k, v in state["figures"].items()}
        self._figures_dropped = int(state["figures_dropped"])
        self._heavy.load(state.get("heavy", []))


class _SpaceSaving:
    """The Space-Saving counters of the heaviest clients (see the module): at most ``capacity`` of them."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._counts: dict[int, list[int]] = {}  # client -> [count, error]
        # (count, client) of every counter as it was set, and older entries a later count made stale (skipped when
        # they come up): the smallest counter in O(log n); rebuilt when stale entries pile up, so it stays bounded.
        self._order: list[tuple[int, int]] = []

    def add(self, client_id: int, amount: int) -> None:
        """Add ``amount`` to the client's counter; a new client past the capacity takes the smallest counter over
        (its count plus ``amount``, that count its error; ties go to the smallest client id)."""
        counter = self._counts.get(client_id)
        if counter is None:
            if len(self._counts) < self.capacity:
                counter = self._counts[client_id] = [amount, 0]
            else:
                floor = self._pop_smallest()
                counter = self._counts[client_id] = [floor + amount, floor]
        else:
            counter[0] += amount
        heapq.heappush(self._order, (counter[0], client_id))
        if len(self._order) > 4 * self.capacity:
            self._rebuild()

    def _pop_smallest(self) -> int:
        """Remove the smallest counter (by count, then client id); return its count."""
        while True:
            count, client = heapq.heappop(self._order)
            counter = self._counts.get(client)
            if counter is not None and counter[0] == count:
                del self._counts[client]
                return count

    def _rebuild(self) -> None:
        """Keep one ordering entry per counter, its current one."""
        self._order = [(counter[0], client) for client, counter in self._counts.items()]
        heapq.heapify(self._order)

    def heaviest(self, count: int) -> list[tuple[int, int, int]]:
        """Return the ``count`` largest counters as ``(client, count, error)``, largest first (ties by client id)."""
        ranked = sorted(self._counts.items(), key=lambda item: (-item[1][0], item[0]))
        return [(client, total, error) for client, (total, error) in ranked[:count]]

    def state(self) -> list[list[int]]:
        """Return the counters as ``[client, count, error]`` lists, by client."""
        return [[client, total, error] for client, (total, error) in sorted(self._counts.items())]

    def load(self, state: Sequence[Sequence[int]]) -> None:
        """Restore :meth:`state`.

        Raises:
            ValueError: If it holds more counters than the capacity.
        """
        if len(state) > self.capacity:
            raise ValueError(f"the client table holds {len(state)} heavy-hitter counters, more than {self.capacity}")
        self._counts = {int(client): [int(total), int(error)] for client, total, error in state}
        self._rebuild()


def _finite(value: float) -> float:
    """Return ``value``, with NaN (no figure) ranked below every number."""
    return -math.inf if math.isnan(value) else value


def _histogram(values: Sequence[int]) -> list[int]:
    """Return the log2 histogram of ``values`` (trimmed)."""
    bins = [0] * BINS
    for value in values:
        bins[log2_bin(value)] += 1
    return _trimmed(bins)


def _trimmed(bins: Sequence[int]) -> list[int]:
    """Return ``bins`` without its trailing empty bins."""
    last = max((i for i, count in enumerate(bins) if count), default=-1)
    return list(bins[: last + 1])


def _spread(values: Sequence[float]) -> dict[str, float | None]:
    """Return the mean and p10/p50/p90 of ``values`` (None where there are none)."""
    if not values:
        return {"mean": None, "p10": None, "p50": None, "p90": None}
    ordered = sorted(float(v) for v in values)
    return {
        "mean": sum(ordered) / len(ordered),
        "p10": percentile(ordered, 0.1),
        "p50": percentile(ordered, 0.5),
        "p90": percentile(ordered, 0.9),
    }
