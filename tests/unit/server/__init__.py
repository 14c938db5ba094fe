"""Unit tests of flasync.server."""
