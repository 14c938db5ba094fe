"""``python -m flasync``."""

from __future__ import annotations

from flasync.cli import console

if __name__ == "__main__":
    console()
