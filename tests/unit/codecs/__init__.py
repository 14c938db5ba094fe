"""Unit tests of flasync.codecs."""
