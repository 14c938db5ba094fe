"""Hierarchical runs: edges reproduce flat aggregation where the maths says so, shrink cloud traffic, nest."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import mlflow
import pytest
import torch

import flasync
from flasync.cli import main
from flasync.core.events import EdgeForwarded, TaskAssigned, TaskClosed, UpdateUploaded
from flasync.testing import EventRecorder, MemoryTracker, small_config

INSTANT = {"latency_s": 0.0, "upload_bytes_per_s": math.inf, "download_bytes_per_s": math.inf}


def _tree(**fields: Any) -> dict[str, Any]:
    return {"kind": "tree", **fields}


async def _run(config: Any, **kwargs: Any) -> tuple[flasync.RunSummary, torch.Tensor, EventRecorder]:
    federation = flasync.Federation(config, **kwargs)
    recorder = EventRecorder(federation.bus)
    summary = await federation.run()
    assert federation.weights is not None
    return summary, federation.weights, recorder


@pytest.mark.parametrize(
    "server",
    [
        {"kind": "fedbuff", "buffer_size": 4, "concurrency": 8},
        {"kind": "fedbuff", "buffer_size": 4, "concurrency": 8, "example_weight": "samples", "max_staleness": 3},
        {"kind": "fedasync", "concurrency": 8},
    ],
)
@pytest.mark.slow
async def test_edges_that_forward_each_update_unchanged_give_the_flat_result(server: dict[str, Any]) -> None:
    """buffer_size 1 and instant links: every edge relays each upload unchanged, and the weights are bit-identical."""
    flat, _, _ = await _run(small_config(server=server))
    tree, _, events = await _run(small_config(server=server, topology=_tree(fanout=[4], buffer_size=1, link=INSTANT)))
    assert tree.weights_sha256 == flat.weights_sha256
    assert tree.updates_accepted == flat.updates_accepted
    assert tree.updates_dropped == flat.updates_dropped
    assert not events.of(EdgeForwarded)
    uploads = events.of(UpdateUploaded)
    # Every client upload went to an edge, and each edge relayed it unchanged to the cloud.
    from_clients = [e for e in uploads if e.tier == "client"]
    relayed = [e for e in uploads if e.to == "cloud"]
    assert from_clients and {e.to for e in from_clients} <= {"edge0", "edge1", "edge2", "edge3"}
    assert sorted(e.task_id for e in relayed) == sorted(e.task_id for e in from_clients)
    assert all(e.tier == "edge1" for e in relayed)


@pytest.mark.slow
async def test_nested_raw_relays_are_still_flat() -> None:
    """A depth-2 tree of raw relays is also bit-identical to flat FedBuff."""
    flat, _, _ = await _run(small_config())
    tree, _, _ = await _run(small_config(topology=_tree(fanout=[2, 2], buffer_size=1, link=INSTANT)))
    assert tree.weights_sha256 == flat.weights_sha256
    assert 0 < tree.first_update_s < tree.wall_s  # the first update an edge relayed, counted by the cloud


@pytest.mark.slow
async def test_sync_hierfavg_with_kappa2_one_is_flat_fedavg() -> None:
    """HierFAVG with one edge round per cloud round equals FedAvg over the same sampled clients."""
    server = {"kind": "fedavg", "clients_per_round": 8}
    flat, flat_weights, flat_events = await _run(small_config("stop.max_versions=6", server=server))
    tree, tree_weights, tree_events = await _run(
        small_config("stop.max_versions=6", server=server, topology=_tree(fanout=[3], kappa2=1))
    )
    rounds = [sorted(e.client_id for e in flat_events.of(TaskAssigned) if e.base_version == v) for v in range(6)]
    tree_rounds = [sorted(e.client_id for e in tree_events.of(TaskAssigned) if e.base_version == v) for v in range(6)]
    assert rounds == tree_rounds
    assert tree.updates_accepted == flat.updates_accepted == 48
    torch.testing.assert_close(tree_weights, flat_weights, rtol=0, atol=1e-5)
    assert tree.accuracy == pytest.approx(flat.accuracy, abs=0.01)
    # At most three partials per round reach the cloud (one per edge with sampled clients) instead of eight updates.
    partials = [e for e in tree_events.of(EdgeForwarded) if e.to == "cloud"]
    assert tree.cloud_ingress_bytes == sum(len(e.payload) for e in partials)
    assert len(partials) <= 3 * 6
    assert tree.cloud_ingress_bytes * 8 <= flat.cloud_ingress_bytes * 3


async def test_sync_hierfavg_runs_kappa2_edge_rounds() -> None:
    """kappa2 = 3: three tasks per sampled client per cloud round, one partial per edge per round."""
    server = {"kind": "fedavg", "clients_per_round": 6}
    summary, _, events = await _run(
        small_config("stop.max_versions=4", server=server, topology=_tree(fanout=[2], kappa2=3))
    )
    assert summary.tasks_dispatched == 4 * 6 * 3
    assert summary.updates_accepted == 4 * 6 * 3
    to_cloud = [e for e in events.of(EdgeForwarded) if e.to == "cloud"]
    assert len(to_cloud) <= 4 * 2
    assert sum(e.count for e in to_cloud) == 4 * 6 * 3
    assert summary.tiers["edge1.aggregations"] == len(to_cloud) + sum(
        2 for e in to_cloud
    )  # two intermediate edge rounds per forwarded partial
    assert summary.accuracy > 0.5


@pytest.mark.slow
async def test_cloud_ingress_shrinks_by_the_fan_in() -> None:
    """Edges folding K_e = 4 updates send one dense partial per four dense uploads."""
    flat, _, _ = await _run(small_config())
    tree, _, events = await _run(small_config(topology=_tree(fanout=[4], buffer_size=4)))
    per_update_flat = flat.cloud_ingress_bytes / flat.updates_accepted
    partials = [e for e in events.of(EdgeForwarded) if e.to == "cloud"]
    folded = sum(e.count for e in partials)
    assert all(e.count == 4 for e in partials)
    assert tree.cloud_ingress_bytes == sum(len(e.payload) for e in partials)
    assert tree.cloud_ingress_bytes / folded == pytest.approx(per_update_flat / 4)
    assert tree.tiers["edge1.updates_per_aggregation"] == 4.0
    # The cloud's K counts partials: a version every 4 partials of 4 updates.
    assert tree.updates_accepted >= 12 * 16


@pytest.mark.slow
async def test_edge_deadline_forwards_a_partial_buffer() -> None:
    """max_wait_s makes an edge forward fewer than K_e updates."""
    _, _, events = await _run(small_config(topology=_tree(fanout=[4], buffer_size=50, max_wait_s=0.5)))
    partials = [e for e in events.of(EdgeForwarded) if e.to == "cloud"]
    assert partials and all(0 < e.count < 50 for e in partials)


@pytest.mark.slow
@pytest.mark.parametrize("server", [{"kind": "fedbuff"}, {"kind": "fedavg", "clients_per_round": 8}])
async def test_depth_three_tree_end_to_end(server: dict[str, Any]) -> None:
    """Clients -> edge3 -> edge2 -> edge1 -> cloud, async and sync, learning and counting per tier."""
    summary, _, events = await _run(
        small_config(
            "population.num_clients=24",
            server=server,
            topology=_tree(fanout=[2, 2, 2], buffer_size=2),
        )
    )
    assert summary.versions == 12
    assert summary.accuracy > 0.5
    assert set(summary.tiers) >= {"edge1.bytes_in", "edge2.bytes_in", "edge3.bytes_in"}
    tiers = {e.tier for e in events.of(EdgeForwarded)}
    assert tiers == {"edge1", "edge2", "edge3"}
    assert summary.topology == "tree(2x2x2)"


@pytest.mark.slow
async def test_task_outcomes_are_counted_once() -> None:
    """Every dispatched task ends in exactly one TaskClosed or is still open when the run stops."""
    summary, _, events = await _run(small_config(topology=_tree(fanout=[4], buffer_size=3)))
    closed = events.of(TaskClosed)
    assert len({e.task_id for e in closed}) == len(closed)
    assert sum(e.outcome == "accepted" for e in closed) == summary.updates_accepted
    assert summary.upload_bytes == sum(e.upload_bytes for e in closed)


@pytest.mark.slow
async def test_region_attribute_assignment() -> None:
    """population.regions draws a seeded region per client; assign = attribute gives one edge per region."""
    summary, _, events = await _run(
        small_config(
            "population.regions=3",
            topology=_tree(fanout=[3], assign="attribute", buffer_size=2),
        )
    )
    assert {e.edge for e in events.of(EdgeForwarded)} <= {"edge0", "edge1", "edge2"}
    assert summary.versions == 12


@pytest.mark.slow
async def test_client_attributes_from_the_caller() -> None:
    """Attributes passed to Federation drive the assignment; a wrong length is a one-line error."""
    labels = ["a" if i % 2 else "b" for i in range(20)]
    _, _, events = await _run(
        small_config(topology=_tree(fanout=[2], assign="attribute", attribute="site", buffer_size=2)),
        client_attributes={"site": labels},
    )
    uploads = events.of(UpdateUploaded)
    assert all((u.to == "edge0") == (labels[u.client_id] == "a") for u in uploads)
    with pytest.raises(flasync.ConfigError, match="3 values for 20 clients"):
        await flasync.Federation(
            small_config(topology=_tree(fanout=[2], assign="attribute", attribute="site")),
            client_attributes={"site": ["a", "b", "c"]},
        ).run()


@pytest.mark.slow
async def test_tier_metrics_are_bounded_and_per_edge_on_request() -> None:
    """Per-tier keys by default; per-edge keys only when configured; ingress per cloud version."""
    tracker = MemoryTracker()
    summary, _, _ = await _run(
        small_config("tracking.log_level=debug", topology=_tree(fanout=[2, 2], buffer_size=2)), tracker=tracker
    )
    keys = tracker.metric_keys()
    for key in (
        "tier/edge1/updates",
        "tier/edge1/bytes_in",
        "tier/edge1/bytes_out",
        "tier/edge1/aggregate_s",
        "tier/edge1/queue_depth",
        "tier/edge2/updates",
        "server/version/ingress_bytes",
        "server/partial/updates",
        "run/tiers/edge2/updates_per_aggregation",
    ):
        assert key in keys, key
    assert not any(key.startswith("edge.") for key in keys)
    ingress = sum(v for _, v in tracker.history("server/version/ingress_bytes"))
    assert ingress <= summary.cloud_ingress_bytes
    saved = json.loads(tracker.artifacts["summary.json"])
    assert saved["cloud_ingress_bytes"] == summary.cloud_ingress_bytes
    per_edge = MemoryTracker()
    await _run(
        small_config("tracking.log_level=debug", topology=_tree(fanout=[2], buffer_size=2, per_edge_metrics=True)),
        tracker=per_edge,
    )
    assert {"edge/edge0/updates", "edge/edge1/bytes_out"} <= set(per_edge.metric_keys())


@pytest.mark.slow
def test_hierarchical_run_lands_in_mlflow(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CLI runs a tree into a real store: tags, tier metrics and summary.json's cloud_ingress_bytes."""
    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    config = tmp_path / "tree.toml"
    config.write_text(
        "[population]\nnum_clients = 20\n[server]\nkind = 'fedbuff'\nbuffer_size = 2\nconcurrency = 8\n"
        "[topology]\nkind = 'tree'\nfanout = [2]\nbuffer_size = 3\n[stop]\nmax_versions = 6\n"
        "[tracking]\nlog_model = false\nlog_level = 'debug'\n"
    )
    assert main(["run", str(config), "--tracking-uri", uri, "--no-system-metrics", "--log-level", "warning"]) == 0
    client = mlflow.MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("flasync").experiment_id])
    assert run.info.status == "FINISHED"
    assert run.data.tags["topology"] == "tree(2)"
    assert "tier/edge1/bytes_out" in run.data.metrics
    summary = json.loads(Path(client.download_artifacts(run.info.run_id, "summary.json", str(tmp_path))).read_text())
    assert summary["cloud_ingress_bytes"] > 0
    assert summary["tiers"]["edge1.updates_per_aggregation"] == 3.0


@pytest.mark.slow
@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("topology.fanout=[30]", "topology.fanout: 30 leaf edges but only 20 clients"),
        ("topology.edges=[{name: a, clients: [0-9]}]", "10 client(s) are in no edge"),
        (
            "topology.edges=[{name: a, parent: b, clients: [0-9]}, {name: b, parent: a, clients: [10-19]}]",
            "cycle (a -> b -> a)",
        ),
        ("topology.edges=[{name: a, clients: [0-19]}, {name: b}]", "edge 'b' has no clients"),
        ("topology.edges=[{name: a, clients: [0-10]}, {name: b, clients: [10-19]}]", "client 10 is in edges"),
        ("topology.buffer_size=0", "topology.buffer_size"),
    ],
)
def test_topology_errors_exit_2_without_a_run(
    override: str, expected: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """An invalid tree is one error line on stderr (after the phase lines), exit 2, and no MLflow run."""
    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    argv = ["run", "--set", "population.num_clients=20", "--set", "topology.kind=tree", "--set", override]
    assert main([*argv, "--tracking-uri", uri]) == 2
    err = [line for line in capsys.readouterr().err.strip().splitlines() if " run.phase " not in line]
    assert len(err) == 1 and expected in err[0], err
    if (tmp_path / "mlflow.db").exists():
        client = mlflow.MlflowClient(uri)
        experiment = client.get_experiment_by_name("flasync")
        assert experiment is None or not client.search_runs([experiment.experiment_id])


@pytest.mark.slow
async def test_edges_can_compress_their_partials() -> None:
    """topology.codec = int8: partials reach the cloud ~4x smaller, deterministically, and the run still learns."""
    dense, _, _ = await _run(small_config(topology=_tree(fanout=[4], buffer_size=4)))
    tree = _tree(fanout=[4], buffer_size=4, codec=[{"kind": "int8", "chunk": 256}])
    small, _, events = await _run(small_config(topology=tree))
    again, _, _ = await _run(small_config(topology=tree))
    partials = [e for e in events.of(EdgeForwarded) if e.to == "cloud"]
    per_partial = small.cloud_ingress_bytes / len(partials)
    assert per_partial < dense.cloud_ingress_bytes / dense.tiers["edge1.aggregations"] / 3.5
    assert small.weights_sha256 == again.weights_sha256
    assert small.accuracy > 0.5


def test_edge_codec_takes_one_value_encoder(capsys: pytest.CaptureFixture[str]) -> None:
    """A sparsifier (no residual at an edge) or two stages on the edge uplink are config errors."""
    argv = ["run", "--set", "topology.kind=tree", "--set", "topology.codec=[{kind: topk, ratio: 0.1}]"]
    assert main(argv) == 2
    assert "topology.codec: one fp16, bf16 or int8 stage at most" in capsys.readouterr().err


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(
    "server",
    [{"kind": "fedbuff", "buffer_size": 4, "concurrency": 8}, {"kind": "fedavg", "clients_per_round": 8}],
)
async def test_a_tree_runs_on_cuda_with_edge_buffers_on_the_device(server: dict[str, Any]) -> None:
    """Edges fold on the training device; the run finishes and learns like on the CPU."""
    topology = _tree(fanout=[2, 2], kappa2=2) if server["kind"] == "fedavg" else _tree(fanout=[2, 2], buffer_size=3)
    cuda = await flasync.Federation(small_config("executor.device=cuda", server=server, topology=topology)).run()
    cpu = await flasync.Federation(small_config(server=server, topology=topology)).run()
    assert cuda.versions == cpu.versions and cuda.updates_accepted == cpu.updates_accepted
    assert cuda.accuracy == pytest.approx(cpu.accuracy, abs=0.05)
