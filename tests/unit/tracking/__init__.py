"""Unit tests of flasync.tracking."""
