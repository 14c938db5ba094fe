"""The inputs of one small training job (seeded data, an MLP's weights, a RandomK codec), for tests that train a
task alone."""

from __future__ import annotations

import torch

from flasync import codecs
from flasync.training.executors.threads import ModelPool
from flasync.training.jobs import JobContext
from flasync.training.local import LocalTraining, flat_parameters
from flasync.training.models import MLP


def small_job() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, LocalTraining, torch.Tensor, JobContext]:
    """Return 60 samples of 8 features and 3 classes, a shuffled index over them, one epoch's settings, an MLP's
    flat weights and the job context (the global torch seed set to 3 first)."""
    torch.manual_seed(3)
    x, y = torch.randn(60, 8), torch.randint(0, 3, (60,))
    index = torch.randperm(60)
    cfg = LocalTraining(epochs=1, batch_size=8, lr=0.1)
    base = flat_parameters(MLP(8, [16], 3))
    ctx = JobContext(
        models=ModelPool(lambda: MLP(8, [16], 3)),
        local=cfg,
        upload_codec=codecs.Pipeline([codecs.RandomK(0.3)]),
        num_params=base.numel(),
    )
    return x, y, index, cfg, base, ctx
