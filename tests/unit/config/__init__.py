"""Unit tests of flasync.config."""
