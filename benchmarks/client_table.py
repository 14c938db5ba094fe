"""The per-client table's cost: its memory against a row per client, and a whole run with it against without it.

    python benchmarks/client_table.py [--populations 10000,100000,1000000] [--rows 1000] [--versions 40] [--repeats 3]

*Memory*: for each population size, every client takes one task (a download, an upload, an accepted update with a
staleness), fed to a :class:`~flasync.core.client_table.ClientTable` of ``--rows`` rows and, as the baseline, to a
plain dict holding the same figures for every client (what a table without a bound would keep). Printed: the
memory each holds after the feed (tracemalloc, the allocations still alive), its ratio to the dict's, the table's
checkpoint state in bytes, and the microseconds per event (timed in a second feed, without tracemalloc).

*Run*: the same small federation (digits, FedBuff, virtual time, no MLflow) with ``tracking.client_table`` on and
off, interleaved ``--repeats`` times; printed: the median wall seconds of each and their ratio, and whether the final
weights agree (they must: the table draws nothing and reads no clock).

The figures, with a description of the machine, go to ``benchmarks/results/client_table.json``
(``benchmarks/record.py``).
"""

from __future__ import annotations

import argparse
import io
import statistics
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

import torch

import flasync
from flasync.core.client_table import ClientTable
from flasync.testing import small_config

if __package__:  # imported as benchmarks.client_table
    from benchmarks.record import Figure, machine, store
else:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from record import Figure, machine, store


def _feed_table(clients: int, rows: int) -> tuple[ClientTable, float]:
    table = ClientTable(rows=rows, top=20)
    began = time.perf_counter()
    for client in range(clients):
        table.dispatched(client, 1 << 16)
        table.uploaded(client, 1 << 14)
        table.accepted(client, client % 9)
    return table, time.perf_counter() - began


def _feed_dict(clients: int) -> tuple[dict[int, list[int]], float]:
    rows: dict[int, list[int]] = {}
    began = time.perf_counter()
    for client in range(clients):
        row = rows.setdefault(client, [0, 0, 0, 0, 0])  # tasks, accepted, staleness sum, up, down
        row[0] += 1
        row[4] += 1 << 16
        row[3] += 1 << 14
        row[1] += 1
        row[2] += client % 9
    return rows, time.perf_counter() - began


def _alive_bytes(feed: Any, *args: int) -> tuple[Any, int, float]:
    """Return what ``feed`` made, the bytes of its allocations still alive (traced in one feed), and the seconds of
    another feed, untraced (tracemalloc slows every allocation)."""
    tracemalloc.start()
    made, _ = feed(*args)
    alive, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    _, seconds = feed(*args)
    return made, alive, seconds


def memory(populations: list[int], rows: int) -> list[dict[str, Any]]:
    """Measure the table against a dict of every client, per population size."""
    out = []
    for clients in populations:
        table, table_bytes, table_s = _alive_bytes(_feed_table, clients, rows)
        buffer = io.BytesIO()
        torch.save(table.state_dict(), buffer)
        del table
        _, dict_bytes, dict_s = _alive_bytes(_feed_dict, clients)
        row = {
            "clients": clients,
            "rows": rows,
            "table_bytes": table_bytes,
            "dict_bytes": dict_bytes,
            "table_over_dict": table_bytes / dict_bytes,
            "state_bytes": len(buffer.getvalue()),
            "table_us_per_event": 1e6 * table_s / (3 * clients),
            "dict_us_per_event": 1e6 * dict_s / (3 * clients),
        }
        print(
            f"{clients:>9} clients: table {table_bytes / 1e6:8.2f} MB, a dict of each client {dict_bytes / 1e6:8.2f} MB"
            f" (x{row['table_over_dict']:.3f}); checkpoint state {row['state_bytes'] / 1e3:.1f} kB; "
            f"{row['table_us_per_event']:.2f} us/event (dict {row['dict_us_per_event']:.2f})",
            flush=True,
        )
        out.append(row)
    return out


def run(versions: int, repeats: int) -> dict[str, Any]:
    """Time the same run with the table and without it, interleaved."""
    times: dict[bool, list[float]] = {False: [], True: []}
    hashes: dict[bool, str] = {}
    for _ in range(repeats):
        for on in (False, True):
            config = small_config(f"stop.max_versions={versions}", f"tracking.client_table={str(on).lower()}")
            began = time.perf_counter()
            summary = flasync.run(config)
            times[on].append(time.perf_counter() - began)
            hashes[on] = summary.weights_sha256
    off_s, on_s = statistics.median(times[False]), statistics.median(times[True])
    same = hashes[False] == hashes[True]
    print(f"run of {versions} versions: off {off_s:.3f} s, on {on_s:.3f} s (x{on_s / off_s:.3f}); same weights: {same}")
    return {"versions": versions, "repeats": repeats, "off_s": off_s, "on_s": on_s, "ratio": on_s / off_s, "same": same}


def main() -> None:
    """Measure and store the figures."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--populations", default="10000,100000,1000000")
    parser.add_argument("--rows", type=int, default=1000)
    parser.add_argument("--versions", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    described = machine()
    rows = memory([int(p) for p in args.populations.split(",")], args.rows)
    timed = run(args.versions, args.repeats)
    headline = [
        Figure(
            f"table of {row['clients']:,} clients, memory",
            row["table_bytes"],
            "bytes",
            "a row for every client",
            round(row["table_over_dict"], 4),
        )
        for row in rows
    ]
    headline.append(
        Figure("run with the table, wall", round(timed["on_s"], 3), "s", "without", round(timed["ratio"], 3))
    )
    settings = {"populations": args.populations, "rows": args.rows, "versions": args.versions, "repeats": args.repeats}
    store("client_table", described, settings=settings, headline=headline, figures={"memory": rows, "run": timed})


if __name__ == "__main__":
    main()
