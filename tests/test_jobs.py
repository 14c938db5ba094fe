"""Tests for flasync.jobs: what a finished training job keeps."""

from __future__ import annotations

import torch

from flasync import codecs, seeding
from flasync.cohort import CohortMember, CohortTrainer
from flasync.events import ClientId
from flasync.executors import ModelPool
from flasync.jobs import JobContext, finish_job
from flasync.models import MLP
from flasync.training import LocalTraining, flat_parameters


def test_a_finished_cohort_member_keeps_its_payload_and_no_row_of_the_cohort() -> None:
    """A vectorized cohort's deltas are rows of one tensor; finishing a member encodes its row and keeps no tensor
    of it, so an upload delivered late holds its bytes, not every other member's delta."""
    torch.manual_seed(0)
    x, y = torch.randn(96, 8), torch.randint(0, 3, (96,))
    order = torch.randperm(96)
    parts = [order[:40], order[40:72], order[72:]]
    cfg = LocalTraining(epochs=1, batch_size=16, lr=0.1)
    base = flat_parameters(MLP(8, [16], 3))
    members = [
        CohortMember(indices=p, generator=seeding.torch_stream(0, seeding.TASK, k, 0)) for k, p in enumerate(parts)
    ]
    outcome = CohortTrainer(MLP(8, [16], 3)).train(base, x, y, members, cfg)
    assert outcome.vectorized
    storages = {r.delta.untyped_storage().data_ptr() for r in outcome.results}
    assert len(storages) == 1  # one tensor's rows, not a copy per member
    ctx = JobContext(
        models=ModelPool(lambda: MLP(8, [16], 3)), local=cfg, upload_codec=codecs.Pipeline(), num_params=base.numel()
    )
    for k, result in enumerate(outcome.results):
        trained = finish_job(ctx, ClientId(k), result, None)
        assert trained.result.delta.numel() == 0
        assert torch.equal(codecs.decode(trained.payload, expected_elements=base.numel()), result.delta)
        assert (trained.result.num_samples, trained.result.loss) == (result.num_samples, result.loss)
