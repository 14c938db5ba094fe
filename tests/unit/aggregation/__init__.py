"""Unit tests of flasync.aggregation."""
