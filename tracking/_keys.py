"""Make arbitrary strings valid MLflow metric, param and tag keys."""

from __future__ import annotations

import posixpath
import re

__all__ = ["MAX_KEY_LENGTH", "safe_key"]

MAX_KEY_LENGTH = 250
"""Longest key MLflow accepts (``mlflow.utils.validation.MAX_ENTITY_KEY_LENGTH``)."""

# MLflow also allows ':' except on Windows; leave it out so a key is valid on every store.
_INVALID = re.compile(r"[^\w./\- ]")


def safe_key(raw: str) -> str:
    """Return ``raw`` changed as little as possible into a key every MLflow store accepts.

    Characters other than alphanumerics, ``_``, ``-``, ``.``, ``/`` and spaces become ``_``, the
    key is cut to 250 characters, and a key that would not survive path normalisation (MLflow
    stores keys as file names in some backends) has its slashes replaced.

    Args:
        raw: The key as the code spelled it, e.g. ``"server.staleness.mean"``.

    Returns:
        A valid key; equal to ``raw`` whenever ``raw`` is already valid.
    """
    key = _INVALID.sub("_", raw)[:MAX_KEY_LENGTH]
    if _path_ok(key):
        return key
    key = key.replace("/", "_")
    return key if _path_ok(key) else "_" + key[: MAX_KEY_LENGTH - 1]


def _path_ok(key: str) -> bool:
    norm = posixpath.normpath(key)
    return bool(key) and norm == key and norm not in (".", "..") and not norm.startswith(("../", "/"))
