"""executor.kind = auto with a partial model or pruning: the threads, and the reason said."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from flasync.runtime.prepare import RunInputs
from flasync.runtime.sizing import choose_executor
from flasync.testing import small_config


@pytest.mark.parametrize(
    ("model", "why"),
    [
        ({"kind": "mlp", "hidden": [32], "exchange": ["layers.2"]}, "only part of the model trains (model.exchange)"),
        (
            {"kind": "mlp", "hidden": [32], "prune": {"target_density": 0.2}},
            "model.prune masks each client's gradients",
        ),
    ],
    ids=["exchange", "prune"],
)
def test_auto_trains_partial_and_pruned_models_on_the_threads(model: dict[str, object], why: str) -> None:
    """Where auto would train cohorts (FedBuff, 8 in flight, on CUDA), a partial or pruned model goes to the threads."""
    config = small_config(model=model)
    assert config.executor.kind == "auto"
    prepared = dataclasses.replace(RunInputs(config).prepare(), device=torch.device("cuda"))
    chosen, reason = choose_executor(config, prepared)
    assert chosen == "thread" and why in reason
