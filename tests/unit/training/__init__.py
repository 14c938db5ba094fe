"""Unit tests of flasync.training."""
