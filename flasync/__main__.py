"""``python -m flasync``."""

from __future__ import annotations

import sys

from flasync.cli import main

if __name__ == "__main__":
    sys.exit(main())
