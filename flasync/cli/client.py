"""``flasync client``: train as a remote client of ``flasync serve``."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from flasync.cli.shared import UsageError, format_bytes
from flasync.core.loops import run_loop


def add_client_parser(commands: Any) -> None:
    """Add ``flasync client --server URL --token-file F``."""
    client = commands.add_parser(
        "client",
        help="train as a remote client of `flasync serve`",
        description="Ask a flasync server for tasks, train them locally and upload the updates until the run ends.",
    )
    client.add_argument("--server", required=True, help="the server's URL, e.g. http://127.0.0.1:8080")
    client.add_argument("--token-file", required=True, help="a file holding this client's bearer token")
    client.add_argument(
        "--data",
        help="a .npz file with arrays x and y (default: this client's partition of the server's configured data)",
    )
    client.add_argument("--cafile", help="CA bundle that signs the server's certificate (HTTPS)")
    client.add_argument("--max-tasks", type=int, help="stop after answering this many tasks")
    client.add_argument("--poll-s", type=float, default=20.0, help="how long one request for a task waits")
    client.add_argument("--give-up-s", type=float, default=120.0, help="fail after the server is unreachable this long")
    client.add_argument("--threads", type=int, default=1, help="torch CPU threads for local training (default: 1)")


def command_client(args: argparse.Namespace, *, process_ends: bool = False) -> int:
    """Run ``flasync client``: answer the server's tasks until the run ends (or --max-tasks); exit 0."""
    if not args.server.startswith(("http://", "https://")):
        raise UsageError(f"--server: expected an http:// or https:// address, got {args.server!r}")
    try:
        with open(args.token_file, encoding="utf-8") as handle:
            token = handle.read().strip()
    except OSError as exc:
        raise UsageError(f"--token-file: cannot read {args.token_file}: {type(exc).__name__}") from None
    if not token:
        raise UsageError(f"--token-file: {args.token_file} is empty")
    import numpy as np
    import torch

    from flasync.clients.remote.client import Client
    from flasync.data import ArrayData

    torch.set_num_threads(max(1, args.threads))
    dataset = None
    if args.data:
        try:
            with np.load(args.data, allow_pickle=False) as arrays:
                labels = np.array(arrays["y"], dtype=np.int64)
                dataset = ArrayData(
                    x=torch.from_numpy(np.array(arrays["x"], dtype=np.float32)),
                    y=torch.from_numpy(labels),
                    num_classes=int(labels.max()) + 1 if labels.size else 1,
                )
        except (OSError, KeyError, ValueError) as exc:
            raise UsageError(f"--data: {args.data} needs arrays x and y ({type(exc).__name__}: {exc})") from None
    verify: Any = True
    if args.cafile:
        import ssl

        try:
            verify = ssl.create_default_context(cafile=args.cafile)
        except (OSError, ssl.SSLError) as exc:
            raise UsageError(f"--cafile: cannot load {args.cafile}: {type(exc).__name__}") from None
    client = Client(
        args.server,
        token,
        dataset,
        verify=verify,
        poll_s=args.poll_s,
        give_up_s=args.give_up_s,
        on_status=lambda line: print(f"flasync client: {line}", file=sys.stderr, flush=True),
    )
    stats = run_loop(client.run(max_tasks=args.max_tasks), process_ends=process_ends)
    print(
        f"flasync client {stats.client_id}: {stats.uploads} updates delivered of {stats.tasks} tasks, "
        f"{stats.dropped} no longer wanted (timed out, the run had ended, or {stats.stale} from before a server "
        f"restart), {stats.failures} failed, "
        f"{stats.retries} retries, "
        f"{format_bytes(stats.download_bytes)} down, {format_bytes(stats.upload_bytes)} up"
        + (" (the run ended)" if stats.finished else ""),
        flush=True,
    )
    return 0
