"""Unit tests, one folder per flasync package."""
