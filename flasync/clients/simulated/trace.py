"""Device traces: each client's compute speed and the intervals it is online, read from a file.

Two formats (the suffix picks one):

* **CSV** (``.csv``), flasync's own: a header row naming the columns ``client``, ``speed``, ``online`` and
  optionally ``period_s``, then one row per client. ``client`` numbers the clients ``0..T-1`` (each once, any
  order); ``speed`` is the client's relative compute speed (> 0: 2 trains twice as fast as 1, whose steps take
  ``population.speed.seconds_per_step``); ``online`` lists its online intervals as ``start-end`` pairs in simulated
  seconds, separated by spaces or ``;`` (empty: always online); ``period_s`` is the length of the client's cycle
  (its intervals repeat every ``period_s`` seconds; default: the latest interval end in the whole file); the
  optional ``upload_bytes_per_s`` and ``download_bytes_per_s`` give its links' bandwidths (both or neither).
* **FedScale** (``.json``): FedScale's two device files (``client_behave_trace`` and ``client_device_capacity``,
  Lai et al., "FedScale: Benchmarking Model and System Performance of Federated Learning at Scale", ICML 2022),
  which FedScale ships as pickles, as one JSON object with those two keys: ``client_behave_trace`` maps a client
  id to ``{"active": [...], "inactive": [...], "finish_time": T}`` (online from ``active[i]`` to ``inactive[i]``
  seconds, repeating every ``finish_time``) and the optional ``client_device_capacity`` maps it to
  ``{"computation": ms, "communication": kbps}``. A client's relative speed is the median ``computation`` over
  its own (``computation`` is a latency: larger is slower), and ``communication`` is its bandwidth both ways
  (``kbps * 1000 / 8`` bytes a second). Clients are taken in increasing order of id.

Population client ``k`` follows trace client ``k mod T`` (FedScale reuses its trace the same way). A trace is data,
not randomness: the same file gives the same windows and speeds in every run.
"""

from __future__ import annotations

import csv
import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from flasync.core import seeding
from flasync.core.errors import ConfigError

__all__ = ["DeviceTrace", "TraceWindows", "read_trace", "synthetic_trace", "write_trace"]

TRACE_FORMATS = (".csv", ".json")
_CSV_COLUMNS = ("client", "speed", "online", "period_s", "upload_bytes_per_s", "download_bytes_per_s")
_LINKS = ("upload_bytes_per_s", "download_bytes_per_s")
_PAIR = re.compile(r"^\s*([^-\s]+)\s*-\s*([^-\s]+)\s*$")


@dataclass(frozen=True, slots=True, eq=False)
class DeviceTrace:
    """``T`` clients' relative speeds and online intervals, each client's intervals sorted and disjoint.

    Attributes:
        speed: Relative compute speed of each trace client, ``float64`` of shape ``(T,)``, all positive.
        starts: Every client's interval starts one after another (seconds within its cycle), ``float64``.
        ends: The matching interval ends, each above its start and at most the client's period.
        offsets: ``int64`` of shape ``(T + 1,)``: client ``j`` holds intervals ``offsets[j]:offsets[j + 1]``
            (at least one each).
        period: Each client's cycle length in seconds, ``float64`` of shape ``(T,)``.
        upload_bytes_per_s: Each trace client's uplink (None: the network model's).
        download_bytes_per_s: Each trace client's downlink (None: the network model's).
    """

    speed: np.ndarray
    starts: np.ndarray
    ends: np.ndarray
    offsets: np.ndarray
    period: np.ndarray
    upload_bytes_per_s: np.ndarray | None = None
    download_bytes_per_s: np.ndarray | None = None

    def __len__(self) -> int:
        """Return the number of trace clients."""
        return int(self.speed.shape[0])

    def intervals(self, client: int) -> list[tuple[float, float]]:
        """Return trace client ``client``'s online intervals within one cycle."""
        lo, hi = int(self.offsets[client]), int(self.offsets[client + 1])
        return list(zip(self.starts[lo:hi].tolist(), self.ends[lo:hi].tolist(), strict=True))

    def online_share(self) -> np.ndarray:
        """Return the share of its cycle each trace client is online."""
        lengths = np.add.reduceat(self.ends - self.starts, self.offsets[:-1])
        share: np.ndarray = lengths / self.period
        return share


class TraceWindows:
    """A population's availability under a trace: who is online when, and when a client goes offline.

    Population client ``k`` follows trace client ``k mod T``. The windows of every trace client are laid end to end
    on one axis (client ``j``'s cycle at ``[base_j, base_j + period_j)``), so who is online at a time is one
    ``searchsorted`` over all intervals.

    Args:
        trace: The trace.
        num_clients: Population size.
    """

    def __init__(self, trace: DeviceTrace, num_clients: int) -> None:
        """Lay the trace's cycles end to end."""
        self.trace = trace
        self.num_clients = num_clients
        self._base = np.concatenate([[0.0], np.cumsum(trace.period)[:-1]])
        owner = np.repeat(np.arange(len(trace)), np.diff(trace.offsets))
        self._starts = trace.starts + self._base[owner]
        self._ends = trace.ends + self._base[owner]
        # A client online over its whole cycle (one interval [0, period)) never goes offline.
        whole = (np.diff(trace.offsets) == 1) & (trace.starts[trace.offsets[:-1]] == 0.0)
        self._always = whole & (trace.ends[trace.offsets[:-1]] >= trace.period)
        # The trace client each population client follows, where they differ (built once: the sampler asks often).
        self._follow = None if num_clients == len(trace) else np.arange(num_clients) % len(trace)

    def _trace_mask(self, t: float) -> np.ndarray:
        """Return which trace clients are online at ``t``."""
        trace = self.trace
        query = self._base + np.fmod(t, trace.period)
        index = np.searchsorted(self._starts, query, side="right") - 1
        inside = (index >= trace.offsets[:-1]) & (index < trace.offsets[1:])
        online: np.ndarray = inside & (query < self._ends[np.maximum(index, 0)])
        return online

    def online(self, client_id: int, t: float) -> bool:
        """Tell whether ``client_id`` is online at time ``t``."""
        j = client_id % len(self.trace)
        position = math.fmod(t, float(self.trace.period[j]))
        return any(start <= position < end for start, end in self.trace.intervals(j))

    def online_mask(self, t: float) -> np.ndarray:
        """Return a boolean array over the population: who is online at time ``t``."""
        mask = self._trace_mask(t)
        if self._follow is None:
            return mask
        followed: np.ndarray = mask[self._follow]
        return followed

    def offline_at(self, client_id: int, t: float) -> float:
        """Return when ``client_id``, online at ``t``, next goes offline (``inf`` if it never does)."""
        j = client_id % len(self.trace)
        if self._always[j]:
            return math.inf
        period = float(self.trace.period[j])
        cycle = math.floor(t / period) * period
        position = t - cycle
        intervals = self.trace.intervals(j)
        for i, (start, end) in enumerate(intervals):
            if start <= position < end:
                # A window that runs to the cycle's end goes on into the next cycle's window at 0.
                if end >= period and i != 0 and intervals[0][0] == 0.0:
                    return cycle + period + intervals[0][1]
                return cycle + end
        return t  # offline already: it goes (stays) offline now

    def next_online(self, t: float) -> float:
        """Return the first time ``>= t`` at which some client is online."""
        if self._trace_mask(t)[: self.num_clients].any():
            return t
        trace = self.trace
        position = np.fmod(t, trace.period)
        query = self._base + position
        later = np.searchsorted(self._starts, query, side="right")
        in_cycle = later < trace.offsets[1:]
        first = trace.starts[trace.offsets[:-1]]
        wait = np.where(
            in_cycle, self._starts[np.minimum(later, len(self._starts) - 1)] - query, trace.period - position + first
        )
        users = min(self.num_clients, len(trace))  # trace clients no population client follows do not count
        j = int(np.argmin(wait[:users]))
        # A hair past the window's start, so that rounding cannot leave the client just short of it.
        return t + float(wait[j]) + 1e-9 * float(trace.period[j])


def read_trace(path: str | Path) -> DeviceTrace:
    """Read a device trace (``.csv`` or FedScale ``.json``; see the module's docs).

    Raises:
        ConfigError: The file cannot be read or a row or field is invalid; one line naming the file, the row or
            client, and the field.
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in TRACE_FORMATS:
        raise ConfigError(f"population.trace: unsupported format of {str(path)!r} (use .csv or FedScale .json)")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ConfigError(f"population.trace: cannot read {path}: {reason}") from None
    return _read_csv(path, text) if suffix == ".csv" else _read_fedscale(path, text)


def _number(text: str, where: str, name: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(f"{where}, field {name!r}: {text!r} is not a number") from None
    if not math.isfinite(value):
        raise ConfigError(f"{where}, field {name!r}: must be finite, got {text!r}")
    return value


def _intervals(pairs: list[tuple[float, float]], period: float | None, where: str, name: str) -> list[list[float]]:
    """Check ``[start, end)`` pairs (and the cycle); return them sorted, touching ones merged."""
    merged: list[list[float]] = []
    for start, end in sorted(pairs):
        if start < 0 or end <= start:
            raise ConfigError(f"{where}, field {name!r}: interval {start:g}-{end:g} must have 0 <= start < end")
        if period is not None and end > period:
            raise ConfigError(f"{where}, field {name!r}: interval {start:g}-{end:g} ends after the period {period:g}")
        if merged and start < merged[-1][1]:
            raise ConfigError(f"{where}, field {name!r}: intervals overlap at {start:g}")
        if merged and start == merged[-1][1]:
            merged[-1][1] = end
        else:
            merged.append([start, end])
    return merged


class _Row(NamedTuple):
    """One trace client as read: speed, online pairs, its cycle (None: the file's horizon), link bandwidths."""

    speed: float
    pairs: list[tuple[float, float]]
    period: float | None
    links: tuple[float, float] | None


def _read_csv(path: Path, text: str) -> DeviceTrace:
    rows = list(csv.reader(text.splitlines()))
    if not rows or not rows[0]:
        raise ConfigError(f"population.trace: {path}: empty file (expected a header row: client,speed,online)")
    header = [name.strip() for name in rows[0]]
    for name in header:
        if name not in _CSV_COLUMNS:
            raise ConfigError(f"{path}: row 1, field {name!r}: unknown column (use {', '.join(_CSV_COLUMNS)})")
    for name in (*_CSV_COLUMNS[:3], *(_LINKS if set(_LINKS) & set(header) else ())):
        if name not in header:
            raise ConfigError(f"{path}: row 1, field {name!r}: missing column")
    entries: dict[int, _Row] = {}
    for number, row in enumerate(rows[1:], start=2):
        if not any(cell.strip() for cell in row):
            continue
        where = f"{path}: row {number}"
        if len(row) != len(header):
            raise ConfigError(f"{where}: {len(row)} fields, the header names {len(header)}")
        cells = {name: cell.strip() for name, cell in zip(header, row, strict=True)}
        client = _number(cells["client"], where, "client")
        if client != int(client) or client < 0:
            raise ConfigError(f"{where}, field 'client': must be a whole number >= 0, got {cells['client']!r}")
        if int(client) in entries:
            raise ConfigError(f"{where}, field 'client': client {int(client)} is listed twice")
        entries[int(client)] = _csv_row(cells, where)
    if not entries:
        raise ConfigError(f"population.trace: {path}: no client rows")
    missing = sorted(set(range(len(entries))) - set(entries))
    if missing:
        raise ConfigError(
            f"{path}: field 'client': clients are numbered 0..{len(entries) - 1}; {missing[0]} is missing"
        )
    horizon = max((end for entry in entries.values() for _, end in entry.pairs), default=1.0)
    clients = []
    for client in range(len(entries)):
        entry = entries[client]
        cycle = horizon if entry.period is None else entry.period
        where = f"{path}: client {client}"
        windows = _intervals(entry.pairs, cycle, where, "online") if entry.pairs else [[0.0, cycle]]
        clients.append((entry.speed, windows, cycle, entry.links))
    return _assemble(clients)


def _positive(cells: dict[str, str], name: str, where: str) -> float:
    value = _number(cells[name], where, name)
    if value <= 0:
        raise ConfigError(f"{where}, field {name!r}: must be > 0, got {cells[name]!r}")
    return value


def _csv_row(cells: dict[str, str], where: str) -> _Row:
    """Read one CSV row's speed, intervals, cycle and links (checked, not yet against the file's horizon)."""
    speed = _positive(cells, "speed", where)
    period = _positive(cells, "period_s", where) if cells.get("period_s") else None
    links = (_positive(cells, _LINKS[0], where), _positive(cells, _LINKS[1], where)) if _LINKS[0] in cells else None
    pairs = []
    for item in re.split(r"[;\s]+", cells["online"]) if cells["online"] else []:
        match = _PAIR.match(item)
        if match is None:
            raise ConfigError(f"{where}, field 'online': {item!r} is not a start-end pair of seconds")
        pairs.append((_number(match[1], where, "online"), _number(match[2], where, "online")))
    _intervals(pairs, period, where, "online")
    return _Row(speed, pairs, period, links)


def _read_fedscale(path: Path, text: str) -> DeviceTrace:
    try:
        document = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"population.trace: {path}: invalid JSON: {exc.msg} (line {exc.lineno})") from None
    if not isinstance(document, dict) or not isinstance(document.get("client_behave_trace"), dict):
        raise ConfigError(f"{path}: field 'client_behave_trace': missing (a FedScale trace maps it to the clients)")
    behave: dict[str, Any] = document["client_behave_trace"]
    capacity = document.get("client_device_capacity")
    if capacity is not None and not isinstance(capacity, dict):
        raise ConfigError(f"{path}: field 'client_device_capacity': must map client ids to capacities")
    if not behave:
        raise ConfigError(f"population.trace: {path}: 'client_behave_trace' lists no client")
    try:
        ids = sorted(behave, key=int)
    except ValueError:
        bad = next(key for key in behave if not key.lstrip("-").isdigit())
        raise ConfigError(f"{path}: client {bad!r}: client ids must be whole numbers") from None
    latency = [_fedscale_capacity(path, capacity, key, "computation") for key in ids]
    # Bandwidths where the capacities give them (FedScale's own files do, for every client).
    links = capacity is not None and any(isinstance(e, dict) and "communication" in e for e in capacity.values())
    kbps = [_fedscale_capacity(path, capacity, key, "communication") for key in ids] if links else None
    median = float(np.median(latency))
    clients = []
    for index, (key, ms) in enumerate(zip(ids, latency, strict=True)):
        entry = behave[key]
        where = f"{path}: client {key}"
        if not isinstance(entry, dict):
            raise ConfigError(f"{where}: must be an object with active, inactive and finish_time")
        for name in ("active", "inactive", "finish_time"):
            if name not in entry:
                raise ConfigError(f"{where}, field {name!r}: missing")
        period = _number(str(entry["finish_time"]), where, "finish_time")
        if period <= 0:
            raise ConfigError(f"{where}, field 'finish_time': must be > 0, got {entry['finish_time']!r}")
        active, inactive = entry["active"], entry["inactive"]
        if not isinstance(active, list) or not isinstance(inactive, list) or len(active) != len(inactive):
            raise ConfigError(f"{where}, field 'inactive': must be a list as long as 'active'")
        pairs = [
            (_number(str(a), where, "active"), _number(str(b), where, "inactive"))
            for a, b in zip(active, inactive, strict=True)
        ]
        # FedScale counts the end instant as online; a window of length zero is none.
        windows = _intervals([p for p in pairs if p[1] > p[0]], period, where, "active")
        if not windows:
            raise ConfigError(f"{where}, field 'active': no online interval")
        bandwidth = None if kbps is None else kbps[index] * 1000.0 / 8.0  # kilobits a second -> bytes a second
        clients.append((median / ms, windows, period, None if bandwidth is None else (bandwidth, bandwidth)))
    return _assemble(clients)


def _fedscale_capacity(path: Path, capacity: dict[str, Any] | None, key: str, name: str) -> float:
    """Return a FedScale client's ``computation`` (ms per sample) or ``communication`` (kbps); 1 without
    capacities."""
    if capacity is None:
        return 1.0
    entry = capacity.get(key)
    if not isinstance(entry, dict) or name not in entry:
        raise ConfigError(f"{path}: client {key}, field {name!r}: missing from client_device_capacity")
    value = _number(str(entry[name]), f"{path}: client {key}", name)
    if value <= 0:
        raise ConfigError(f"{path}: client {key}, field {name!r}: must be > 0, got {entry[name]!r}")
    return value


_Assembled = tuple[float, list[list[float]], float, tuple[float, float] | None]
"""One trace client for :func:`_assemble`: speed, merged windows, cycle, link bandwidths (up, down) or None."""


def _assemble(clients: Sequence[_Assembled]) -> DeviceTrace:
    sizes = np.array([len(windows) for _, windows, _, _ in clients], dtype=np.int64)
    offsets = np.zeros(len(clients) + 1, dtype=np.int64)
    np.cumsum(sizes, out=offsets[1:])
    flat = np.array([pair for _, windows, _, _ in clients for pair in windows], dtype=np.float64).reshape(-1, 2)
    links = [link for _, _, _, link in clients]
    up = down = None
    if all(link is not None for link in links):
        table = np.array(links, dtype=np.float64).reshape(-1, 2)
        up, down = np.ascontiguousarray(table[:, 0]), np.ascontiguousarray(table[:, 1])
    return DeviceTrace(
        speed=np.array([speed for speed, _, _, _ in clients], dtype=np.float64),
        starts=np.ascontiguousarray(flat[:, 0]),
        ends=np.ascontiguousarray(flat[:, 1]),
        offsets=offsets,
        period=np.array([period for _, _, period, _ in clients], dtype=np.float64),
        upload_bytes_per_s=up,
        download_bytes_per_s=down,
    )


def synthetic_trace(
    num_clients: int, *, horizon_s: float = 86_400.0, online_fraction: float = 0.5, sigma: float = 0.5, seed: int = 0
) -> DeviceTrace:
    """Draw a trace to show the format: lognormal speeds and a few online sessions per client.

    Client ``j`` draws from the stream ``(seed, AVAILABILITY, 1, j)``: its speed ``exp(N(0, sigma^2))``, a number
    of sessions ``1 + Poisson(2)``, and session lengths summing to about ``online_fraction`` of ``horizon_s`` (a
    Dirichlet split of that total, each placed in its own equal slot of the cycle at a random offset).

    Args:
        num_clients: Trace clients.
        horizon_s: Each client's cycle, in simulated seconds.
        online_fraction: Share of the cycle a client is online, in ``(0, 1]``.
        sigma: Log-space spread of the speeds.
        seed: The generator's seed.

    Raises:
        ValueError: If a parameter is out of range.
    """
    if num_clients < 1 or not horizon_s > 0 or not 0 < online_fraction <= 1 or sigma < 0:
        raise ValueError("need num_clients >= 1, horizon_s > 0, 0 < online_fraction <= 1 and sigma >= 0")
    clients = []
    for j in range(num_clients):
        rng = seeding.numpy_stream(seed, seeding.AVAILABILITY, 1, j)
        speed = float(np.exp(sigma * rng.standard_normal()))
        sessions = 1 + int(rng.poisson(2.0))
        slot = horizon_s / sessions
        lengths = rng.dirichlet(np.ones(sessions)) * online_fraction * horizon_s
        lengths = np.minimum(lengths, slot)
        windows = []
        for i, length in enumerate(lengths.tolist()):
            start = i * slot + float(rng.uniform(0.0, slot - length))
            windows.append([round(start, 3), round(min(start + max(length, 1.0), (i + 1) * slot), 3)])
        clients.append((round(speed, 4), windows, horizon_s, None))
    return _assemble(clients)


def write_trace(trace: DeviceTrace, path: str | Path) -> None:
    """Write ``trace`` as a ``.csv`` (client, speed, online, period_s) or a FedScale ``.json``.

    Raises:
        ConfigError: The suffix is neither, or the file cannot be written.
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix == ".csv":
        up, down = trace.upload_bytes_per_s, trace.download_bytes_per_s
        header = "client,speed,online,period_s" + (",upload_bytes_per_s,download_bytes_per_s" if up is not None else "")
        lines = [header]
        for j in range(len(trace)):
            online = " ".join(f"{a:g}-{b:g}" for a, b in trace.intervals(j))
            links = f",{up[j]:g},{down[j]:g}" if up is not None and down is not None else ""
            lines.append(f"{j},{trace.speed[j]:g},{online},{trace.period[j]:g}{links}")
        text = "\n".join(lines) + "\n"
    elif suffix == ".json":
        behave = {
            str(j + 1): {
                "active": [a for a, _ in trace.intervals(j)],
                "inactive": [b for _, b in trace.intervals(j)],
                "finish_time": float(trace.period[j]),
            }
            for j in range(len(trace))
        }
        # FedScale's computation is a latency (ms per sample): the slowest clients have the largest.
        capacity: dict[str, dict[str, float]] = {
            str(j + 1): {"computation": 100.0 / float(trace.speed[j])} for j in range(len(trace))
        }
        if trace.upload_bytes_per_s is not None:  # FedScale has one bandwidth, in kilobits a second
            for j in range(len(trace)):
                capacity[str(j + 1)]["communication"] = float(trace.upload_bytes_per_s[j]) * 8.0 / 1000.0
        text = json.dumps({"client_behave_trace": behave, "client_device_capacity": capacity}, indent=1) + "\n"
    else:
        raise ConfigError(f"--out: unsupported trace format {str(path)!r} (use .csv or .json)")
    try:
        path.write_text(text, encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"--out: cannot write {path}: {exc.strerror or exc}") from None
