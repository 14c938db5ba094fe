"""Unit tests of flasync.core."""
