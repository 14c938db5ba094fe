"""``flasync data``: what a config's partition gives each client (``describe``), and synthetic device traces
(``trace``)."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING, Any

from flasync.cli.shared import TRACKING_URI_HELP, Parser, UsageError
from flasync.config import FeatureSkewPartition, RunConfig, SyntheticData, load_config

if TYPE_CHECKING:
    # flasync.data imports torch: the command line (`flasync run` first of all) reads this module before it starts
    # MLflow's writer process, which should import MLflow while this process imports torch, not after.
    from flasync.data.describe import PartitionDescription

_PLOTTED_CLIENTS = 100  # the stacked label bars show at most this many clients (the JSON artifact holds every one)


def add_data_commands(commands: Any) -> None:
    """Add ``flasync data describe [CONFIG]`` and ``flasync data trace --clients N --out FILE``."""
    group = commands.add_parser(
        "data",
        help="describe a config's partition; write a synthetic device trace",
        description="Tools for a run's data and simulated devices.",
    )
    actions = group.add_subparsers(dest="data_command", metavar="ACTION", parser_class=Parser)
    describe = actions.add_parser(
        "describe",
        help="print each client's size and label histogram (and log them to MLflow)",
        description="Load the data a run config names, partition it as the run would, and print the clients' size "
        "and label histograms; with tracking on, log them as an MLflow run (data/describe.svg, data/clients.json).",
    )
    describe.add_argument("config", nargs="?", help="a .toml or .yaml run config (default: the built-in experiment)")
    describe.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="PATH=VALUE", help="override one field"
    )
    describe.add_argument("--rows", type=int, default=20, help="clients listed one per line (default 20)")
    describe.add_argument("--tracking-uri", help=TRACKING_URI_HELP)
    describe.add_argument("--experiment", help="MLflow experiment (default: the config's, with '.data' appended)")
    describe.add_argument("--no-tracking", action="store_true", help="print only; log nothing to MLflow")
    trace = actions.add_parser(
        "trace",
        help="write a synthetic device trace (per-client speed and online intervals) to show the format",
        description="Write a seeded synthetic trace for population.trace: a .csv (client, speed, online) or a "
        "FedScale-style .json (per client: computation speed and active/inactive times).",
    )
    trace.add_argument("--clients", type=int, required=True, help="number of clients")
    trace.add_argument("--out", required=True, help="the trace file to write (.csv or .json)")
    trace.add_argument("--horizon-s", type=float, default=86_400.0, help="simulated seconds covered (default 1 day)")
    trace.add_argument("--online-fraction", type=float, default=0.5, help="mean share of time online (default 0.5)")
    trace.add_argument("--sigma", type=float, default=0.5, help="log-space spread of the clients' speeds")
    trace.add_argument("--seed", type=int, default=0, help="the generator's seed")


def command_data(args: argparse.Namespace) -> int:
    """Run ``flasync data ACTION``; exit 0 (bad input is a one-line error, exit 2)."""
    if args.data_command == "describe":
        return _describe(args)
    if args.data_command == "trace":
        return _trace(args)
    raise UsageError("data: say what to do: describe [CONFIG] or trace --clients N --out FILE")


def _describe(args: argparse.Namespace) -> int:
    from flasync.data import prepare
    from flasync.data.describe import describe_partition, format_description
    from flasync.data.skew import feature_noise_levels

    if args.rows < 0:
        raise UsageError(f"--rows must be >= 0, got {args.rows}")
    config = load_config(args.config, list(args.overrides))
    if isinstance(config.data, SyntheticData) and config.data.lazy:
        raise UsageError("data describe: data.lazy = true draws each client's samples when sampled; nothing to split")
    loaded = prepare.load(config)
    partition = loaded.partition if loaded.partition is not None else prepare.partition(config, loaded.train)
    part = config.partition
    noise = feature_noise_levels(len(partition), part.noise) if isinstance(part, FeatureSkewPartition) else None
    description = describe_partition(loaded.train.y.numpy(), partition, loaded.train.num_classes, noise)
    title = f"partition {part.model_dump()} of {config.data.kind} data, seed {config.seed}"
    print(format_description(description, title=title, rows=args.rows), flush=True)
    if config.tracking.enabled and not args.no_tracking:
        run_id = _log_description(config, description, args)
        print(f"logged to MLflow run {run_id}", flush=True)
    return 0


def describe_chart(description: PartitionDescription, title: str = "") -> str:
    """Draw the first clients' stacked label counts and the histograms of sizes and labels per client as SVG."""
    from flasync.tracking.charts import Panel, Stairs, histogram, render

    counts = description.label_counts[:_PLOTTED_CLIENTS]
    edges = [float(k) for k in range(counts.shape[0] + 1)]
    stacked: list[Stairs] = []
    below = [0.0] * counts.shape[0]
    for label in range(counts.shape[1]):
        top = [b + float(c) for b, c in zip(below, counts[:, label], strict=True)]
        stacked.append(Stairs(values=top, edges=edges, baseline=below, label=f"label {label}"))
        below = top
    sizes, size_edges = histogram([float(s) for s in description.sizes], 20)
    labels = description.labels_per_client
    per_label = [float((labels == n).sum()) for n in range(1, counts.shape[1] + 1)]
    panels = [
        Panel(
            series=stacked if counts.shape[1] <= 20 else stacked[:20],
            title=f"label counts of the first {counts.shape[0]} clients",
            xlabel="client",
            ylabel="samples",
            integer_x=True,
        ),
        Panel(
            series=[Stairs(values=[float(c) for c in sizes], edges=size_edges)],
            title="client sizes",
            xlabel="samples",
            ylabel="clients",
        ),
        Panel(
            series=[Stairs(values=per_label, edges=[n + 0.5 for n in range(counts.shape[1] + 1)])],
            title="distinct labels per client",
            xlabel="labels",
            ylabel="clients",
            integer_x=True,
        ),
    ]
    return render(panels, width=1500, height=420, title=title)


def _log_description(config: RunConfig, description: PartitionDescription, args: argparse.Namespace) -> str:
    """Log the description as an MLflow run of its own; return its id."""
    import mlflow

    from flasync.config import flatten
    from flasync.tracking.store import prepare_sqlite_store, resolve_tracking_uri

    uri = resolve_tracking_uri(args.tracking_uri or config.tracking.uri)
    prepare_sqlite_store(uri)
    client = mlflow.MlflowClient(tracking_uri=uri)
    name = args.experiment or f"{config.tracking.experiment}.data"
    found = client.get_experiment_by_name(name)
    experiment = found.experiment_id if found is not None else client.create_experiment(name)
    run = client.create_run(
        experiment, run_name=f"describe {config.partition.kind}", tags={"flasync.command": "data describe"}
    )
    run_id: str = run.info.run_id
    flat = flatten(config)
    keys = [k for k in flat if k.startswith(("data.", "partition.", "population.num_clients", "seed"))]
    client.log_batch(
        run_id,
        params=[mlflow.entities.Param(k, str(flat[k])[:500]) for k in keys],
        metrics=[mlflow.entities.Metric(f"data.{k}", v, 0, 0) for k, v in description.summary().items()],
    )
    client.log_text(run_id, describe_chart(description, f"{config.partition.kind} partition"), "data/describe.svg")
    client.log_text(run_id, json.dumps(description.to_json()), "data/clients.json")
    client.set_terminated(run_id)
    return run_id


def _trace(args: argparse.Namespace) -> int:
    from flasync.clients.simulated.trace import synthetic_trace, write_trace

    if args.clients < 1:
        raise UsageError(f"--clients must be >= 1, got {args.clients}")
    if not args.horizon_s > 0:
        raise UsageError(f"--horizon-s must be > 0, got {args.horizon_s:g}")
    if not 0 < args.online_fraction <= 1:
        raise UsageError(f"--online-fraction must be in (0, 1], got {args.online_fraction:g}")
    if not args.sigma >= 0:
        raise UsageError(f"--sigma must be >= 0, got {args.sigma:g}")
    if not args.out.lower().endswith((".csv", ".json")):
        raise UsageError(f"--out: name a .csv or .json trace file (got {args.out!r})")
    trace = synthetic_trace(
        args.clients, horizon_s=args.horizon_s, online_fraction=args.online_fraction, sigma=args.sigma, seed=args.seed
    )
    write_trace(trace, args.out)
    share = trace.online_share()
    print(
        f"wrote {args.out}: {len(trace)} clients, online {share.mean():.0%} of {args.horizon_s:g} s on average, "
        f"speeds {trace.speed.min():.2f}..{trace.speed.max():.2f}",
        flush=True,
    )
    return 0
