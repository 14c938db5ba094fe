"""Clients behind the server: simulated coroutine clients and remote devices over HTTP."""
