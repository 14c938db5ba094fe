"""Unit tests of flasync.clients."""
