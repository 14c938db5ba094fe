"""Algorithms that keep state per client or on the server, as plug-ins of :mod:`flasync.training.plugins`."""
