"""Unit tests of flasync.clients.remote."""
