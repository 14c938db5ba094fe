"""``flasync config explain PATH``: what a configuration field or section is, read from the schema."""

from __future__ import annotations

import argparse
from typing import Any

from flasync.cli.shared import Parser, UsageError


def add_config_commands(commands: Any) -> None:
    """Add ``flasync config explain PATH [PATH ...]``."""
    group = commands.add_parser(
        "config",
        help="explain configuration fields (type, default, bounds, what they do)",
        description="Tools for run configurations.",
    )
    actions = group.add_subparsers(dest="config_command", metavar="ACTION", parser_class=Parser)
    explain = actions.add_parser(
        "explain",
        help="print what a field or a section is, from the schema",
        description="Print a config field's type, default, bounds and description (once per choice of its "
        "section's kind that has it), or a section's fields: the text of the configuration reference.",
    )
    explain.add_argument("paths", nargs="+", metavar="PATH", help="a dotted path, e.g. server.buffer_size or server")


def command_config(args: argparse.Namespace) -> int:
    """Run ``flasync config ACTION``; exit 0 (an unknown path is a one-line error, exit 2)."""
    from flasync.config.explain import explain

    if args.config_command is None:
        raise UsageError("config: say what to do: explain PATH")
    print("\n\n".join(explain(path) for path in args.paths))
    return 0
