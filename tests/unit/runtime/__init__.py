"""Unit tests of flasync.runtime."""
