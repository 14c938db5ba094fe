"""What every command shares: the one-line usage error, the parser class, the tracking URI help, byte sizes."""

from __future__ import annotations

import argparse
from typing import NoReturn

TRACKING_URI_HELP = "MLflow tracking URI (default: $MLFLOW_TRACKING_URI, else sqlite:///mlruns/mlflow.db)"


class UsageError(Exception):
    """A malformed command line."""


class Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line and exit 2."""

    def error(self, message: str) -> NoReturn:
        """Raise instead of printing the usage block."""
        raise UsageError(f"{message} (see {self.prog} --help)")


def format_bytes(n: float) -> str:
    """Return ``n`` bytes as text: B, kB, MB or GB (powers of 1000), one decimal above bytes."""
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n:.1f} GB"  # pragma: no cover
