"""Unit tests of flasync.observe."""
