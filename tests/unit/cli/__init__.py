"""Unit tests of flasync.cli."""
