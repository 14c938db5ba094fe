"""Unit tests of flasync.clients.simulated."""
