"""Unit tests of flasync.data."""
