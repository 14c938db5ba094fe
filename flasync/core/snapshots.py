"""Published models: the weights every client of one version downloads, shared read-only."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flasync.core.events import Version

__all__ = ["ModelSnapshot"]


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelSnapshot:
    """One published global model: weights shared read-only by every client that downloads it.

    ``weights`` is what clients receive (the decoded download, equal to ``exact`` for a lossless download codec);
    ``exact`` is the server's own copy. ``extra`` is what an algorithm's plug-in sends with the model, as clients
    receive it (None: nothing); ``download_bytes`` counts it too. ``norm`` is ``||exact||_2`` as the server measured
    it when it made the version (None: not measured); readers of the weights' figures take it instead of measuring
    again.
    """

    version: Version
    weights: torch.Tensor
    exact: torch.Tensor
    download_bytes: int
    extra: torch.Tensor | None = None
    norm: float | None = None
