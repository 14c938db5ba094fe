"""Device traces: the CSV and FedScale readers, the windows they give, the generator and one-line errors."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from flasync.clients.simulated.population import Network, Population
from flasync.clients.simulated.trace import TraceWindows, read_trace, synthetic_trace, write_trace
from flasync.config import ConstantSpeed, LogNormalSpeed, NetworkConfig
from flasync.core.errors import ConfigError

CSV = """client,speed,online
0,1,0-10 20-30
1,2,5-15
2,0.5,
"""


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_csv_windows_speeds_and_default_period(tmp_path: Path) -> None:
    """Rows give speeds and intervals; the cycle is the latest end (30 s); an empty online column is always online."""
    trace = read_trace(_write(tmp_path, "t.csv", CSV))
    assert trace.speed.tolist() == [1.0, 2.0, 0.5]
    assert trace.intervals(0) == [(0.0, 10.0), (20.0, 30.0)]
    assert trace.intervals(2) == [(0.0, 30.0)]
    assert trace.period.tolist() == [30.0, 30.0, 30.0]
    windows = TraceWindows(trace, 3)
    assert windows.online_mask(7.0).tolist() == [True, True, True]
    assert windows.online_mask(12.0).tolist() == [False, True, True]
    assert windows.online_mask(15.0).tolist() == [False, False, True]
    assert windows.online_mask(37.0).tolist() == [True, True, True]  # the next cycle
    assert [windows.online(k, 12.0) for k in range(3)] == [False, True, True]


def test_offline_at_and_next_online(tmp_path: Path) -> None:
    """A window's end is when its client goes offline; a whole-cycle client never does; the next window is found."""
    windows = TraceWindows(read_trace(_write(tmp_path, "t.csv", CSV)), 2)
    assert windows.offline_at(0, 3.0) == 10.0
    assert windows.offline_at(0, 33.0) == 40.0
    assert windows.offline_at(0, 52.0) == 70.0  # 20-30 runs into the next cycle's 0-10
    assert windows.offline_at(1, 6.0) == 15.0
    assert math.isinf(TraceWindows(read_trace(_write(tmp_path, "t.csv", CSV)), 3).offline_at(2, 1.0))
    assert windows.next_online(16.0) == pytest.approx(20.0, abs=1e-6)
    assert windows.next_online(16.0) >= 20.0
    assert windows.next_online(3.0) == 3.0


def test_a_window_across_the_cycle_end_continues(tmp_path: Path) -> None:
    """A window ending at the period goes on into the next cycle's window starting at 0."""
    path = _write(tmp_path, "t.csv", "client,speed,online,period_s\n0,1,0-2 8-10,10\n")
    windows = TraceWindows(read_trace(path), 1)
    assert windows.offline_at(0, 9.0) == 12.0


def test_population_clients_wrap_around_the_trace(tmp_path: Path) -> None:
    """Population client k follows trace client k mod T, for windows and speed."""
    trace = read_trace(_write(tmp_path, "t.csv", CSV))
    windows = TraceWindows(trace, 7)
    mask = windows.online_mask(12.0)
    assert mask.tolist() == [False, True, True, False, True, True, False]
    population = Population(np.full(7, 10), ConstantSpeed(seconds_per_step=1.0), 0, trace_slowdown=1 / trace.speed)
    assert [population.train_seconds(k, 4, 0) for k in (0, 1, 2, 4)] == [4.0, 2.0, 8.0, 2.0]


def test_trace_speed_replaces_the_lognormal_factor_only(tmp_path: Path) -> None:
    """With a trace the lognormal model's per-client factor is the trace's; its per-task jitter stays."""
    trace = read_trace(_write(tmp_path, "t.csv", CSV))
    speed = LogNormalSpeed(seconds_per_step=1.0, sigma=3.0, jitter=0.0)
    population = Population(np.full(3, 10), speed, 0, trace_slowdown=1 / trace.speed)
    assert population.train_seconds(1, 10, 5) == 5.0
    assert population.slowdown is None


def test_fedscale_json_is_read(tmp_path: Path) -> None:
    """FedScale's behave trace and capacities: windows per finish_time cycle, speed = median latency / latency."""
    document = {
        "client_behave_trace": {
            "7": {"active": [0, 50], "inactive": [10, 60], "finish_time": 100, "duration": 20, "model": "x"},
            "3": {"active": [20], "inactive": [40], "finish_time": 50},
            "12": {"active": [5], "inactive": [90], "finish_time": 100},
        },
        "client_device_capacity": {
            "3": {"computation": 100.0, "communication": 5000.0},
            "7": {"computation": 50.0, "communication": 1000.0},
            "12": {"computation": 200.0, "communication": 1000.0},
        },
    }
    trace = read_trace(_write(tmp_path, "t.json", json.dumps(document)))
    # ids in increasing order: 3, 7, 12
    assert trace.intervals(0) == [(20.0, 40.0)] and trace.period[0] == 50.0
    assert trace.intervals(1) == [(0.0, 10.0), (50.0, 60.0)]
    assert trace.speed.tolist() == [1.0, 2.0, 0.5]
    assert trace.upload_bytes_per_s is not None and trace.download_bytes_per_s is not None
    assert trace.upload_bytes_per_s.tolist() == [625_000.0, 125_000.0, 125_000.0]  # kbps * 1000 / 8
    assert trace.download_bytes_per_s.tolist() == trace.upload_bytes_per_s.tolist()
    assert TraceWindows(trace, 3).online_mask(75.0).tolist() == [True, False, True]


@pytest.mark.parametrize("suffix", [".csv", ".json"])
def test_generated_trace_round_trips(tmp_path: Path, suffix: str) -> None:
    """A synthetic trace written and read back has the same windows; the same seed gives the same file."""
    trace = synthetic_trace(20, horizon_s=3600.0, online_fraction=0.4, seed=3)
    path = tmp_path / f"t{suffix}"
    write_trace(trace, path)
    back = read_trace(path)
    assert np.allclose(back.period, 3600.0)
    assert all(len(back.intervals(j)) >= 1 for j in range(20))
    first = path.read_bytes()
    write_trace(synthetic_trace(20, horizon_s=3600.0, online_fraction=0.4, seed=3), path)
    assert path.read_bytes() == first
    assert 0.2 < float(back.online_share().mean()) <= 0.4 + 1e-9


def test_csv_links_set_each_clients_transfer_times(tmp_path: Path) -> None:
    """Bandwidth columns replace the drawn links of client k mod T; latency stays the network model's."""
    path = _write(
        tmp_path,
        "t.csv",
        "client,speed,online,upload_bytes_per_s,download_bytes_per_s\n0,1,,1000,4000\n1,1,,500,2000\n",
    )
    trace = read_trace(path)
    assert trace.upload_bytes_per_s is not None and trace.download_bytes_per_s is not None
    links = (trace.upload_bytes_per_s, trace.download_bytes_per_s)
    network = Network(NetworkConfig(latency_s=0.5, bandwidth_sigma=2.0), 20, 0, links)
    assert [network.upload_seconds(k, 1000) for k in range(3)] == [1.5, 2.5, 1.5]
    assert network.download_seconds(3, 4000) == 2.5
    assert network.upload_seconds_many(list(range(20)), [1000] * 20) == [1.5, 2.5] * 10
    assert read_trace(_write(tmp_path, "u.csv", CSV)).upload_bytes_per_s is None


BAD = [
    ("a.csv", "client,speed\n0,1\n", "a.csv: row 1, field 'online': missing column"),
    ("a.csv", "client,speed,online,colour\n", "a.csv: row 1, field 'colour': unknown column"),
    ("a.csv", "client,speed,online\n0,fast,0-1\n", "a.csv: row 2, field 'speed': 'fast' is not a number"),
    ("a.csv", "client,speed,online\n0,0,0-1\n", "a.csv: row 2, field 'speed': must be > 0"),
    ("a.csv", "client,speed,online\n0,1,0-1\n0,1,0-1\n", "a.csv: row 3, field 'client': client 0 is listed twice"),
    ("a.csv", "client,speed,online\n0,1,0-1\n2,1,0-1\n", "a.csv: field 'client': clients are numbered 0..1; 1 is"),
    ("a.csv", "client,speed,online\n0,1,5-2\n", "a.csv: row 2, field 'online': interval 5-2 must have 0 <= start"),
    ("a.csv", "client,speed,online\n0,1,0-5 3-8\n", "a.csv: row 2, field 'online': intervals overlap at 3"),
    ("a.csv", "client,speed,online\n0,1,later\n", "a.csv: row 2, field 'online': 'later' is not a start-end pair"),
    ("a.csv", "client,speed,online,period_s\n0,1,0-20,10\n", "row 2, field 'online': interval 0-20 ends after"),
    ("a.csv", "client,speed,online\n0,1\n", "a.csv: row 2: 2 fields, the header names 3"),
    ("a.csv", "client,speed,online,upload_bytes_per_s\n", "row 1, field 'download_bytes_per_s': missing column"),
    (
        "a.csv",
        "client,speed,online,upload_bytes_per_s,download_bytes_per_s\n0,1,,0,5\n",
        "a.csv: row 2, field 'upload_bytes_per_s': must be > 0",
    ),
    ("a.json", "{", "a.json: invalid JSON"),
    ("a.json", "{}", "a.json: field 'client_behave_trace': missing"),
    ("a.json", '{"client_behave_trace": {"1": {"active": [0]}}}', "a.json: client 1, field 'inactive': missing"),
    (
        "a.json",
        '{"client_behave_trace": {"1": {"active": [0], "inactive": [5, 6], "finish_time": 9}}}',
        "a.json: client 1, field 'inactive': must be a list as long as 'active'",
    ),
    (
        "a.json",
        '{"client_behave_trace": {"1": {"active": [0], "inactive": [5], "finish_time": 9}},'
        ' "client_device_capacity": {}}',
        "a.json: client 1, field 'computation': missing",
    ),
]


@pytest.mark.parametrize(("name", "text", "expected"), BAD, ids=[b[2][:40] for b in BAD])
def test_bad_traces_are_one_line_naming_file_row_and_field(tmp_path: Path, name: str, text: str, expected: str) -> None:
    """Each defect is a ConfigError of one line naming the file, the row or client, and the field."""
    with pytest.raises(ConfigError) as info:
        read_trace(_write(tmp_path, name, text))
    message = str(info.value)
    assert "\n" not in message
    assert expected in message


def test_missing_trace_file(tmp_path: Path) -> None:
    """A trace that does not exist is one line naming it."""
    with pytest.raises(ConfigError, match=r"population.trace: cannot read .*nowhere\.csv: No such file"):
        read_trace(tmp_path / "nowhere.csv")
