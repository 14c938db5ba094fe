"""The simulated client group's uploads: each made of its task, its plan and its trained update."""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any, cast

import torch

from flasync.clients.simulated import client as client_module
from flasync.core import seeding
from flasync.core.events import ClientId, TaskAssigned, TaskDiagnosis, UpdateUploaded, Version
from flasync.training.executors.threads import TrainingJob
from flasync.training.jobs import Finish, TrainedUpdate, train_job
from flasync.training.local import LocalResult
from tests.unit.training.job_inputs import small_job


def test_uploads_are_the_events_the_keyword_constructor_makes_of_each_task() -> None:
    """_uploads makes, for each live task due, the upload the keyword constructor makes of its task, its plan's
    seconds, its trained update and its time, in order; a released task's upload is dropped."""
    rng = random.Random(3)
    n = 6
    tasks = [
        TaskAssigned(
            task_id=10 + k,
            client_id=ClientId(rng.randrange(100)),
            participation=k,
            base_version=Version(rng.randrange(5)),
            simulated_s=rng.random(),
            reply_to=rng.choice(["cloud", "edge-1"]),
        )
        for k in range(n)
    ]
    trained = [
        TrainedUpdate(
            result=LocalResult(
                delta=torch.empty(0),
                num_samples=rng.randrange(1, 50),
                steps=3,
                loss=rng.random(),
                train_s=rng.random(),
                peak_mem_bytes=rng.randrange(1 << 20),
            ),
            payload=rng.randbytes(rng.randrange(1, 20)),
            encode_s=rng.random(),
            diagnosis=TaskDiagnosis(update_norm=rng.random()),
            extra=rng.randbytes(rng.choice([0, 4])),
        )
        for _ in range(n)
    ]
    plan = client_module._Plan(
        download_s=[rng.random() for _ in range(n)],
        simulated=[rng.random() for _ in range(n)],
        done_at=[rng.random() for _ in range(n)],
        parts=None,
        training={},
        faults={},
        offline=None,
    )
    upload_s = [rng.random() for _ in range(n)]
    state = client_module._GroupState(
        tasks=tasks,
        model=cast(Any, SimpleNamespace(download_bytes=1234)),
        plan=plan,
        jobs={},
        agenda=[],
        order=n,
        uploads={k: (trained[k], upload_s[k]) for k in range(n)},
    )
    world = cast(Any, SimpleNamespace(wall=lambda: 42.5))
    due, times = [4, 1, 3, 0], [7.0, 7.5, 8.0, 9.0]
    released = tasks[3]
    prepared: list[object] = []
    sent = client_module._uploads(world, state, due, times, lambda task: task is not released, prepared)
    expected = [
        UpdateUploaded(
            to=tasks[i].reply_to,
            task_id=tasks[i].task_id,
            client_id=tasks[i].client_id,
            base_version=tasks[i].base_version,
            num_samples=trained[i].result.num_samples,
            payload=trained[i].payload,
            extra=trained[i].extra,
            train_loss=trained[i].result.loss,
            simulated_s=at,
            sent_wall_s=42.5,
            compute_s=trained[i].result.train_s,
            encode_s=trained[i].encode_s,
            sim_download_s=plan.download_s[i],
            sim_train_s=plan.simulated[i],
            sim_upload_s=upload_s[i],
            download_bytes=1234,
            peak_mem_bytes=trained[i].result.peak_mem_bytes,
            diagnosis=trained[i].diagnosis,
        )
        for i, at in zip(due, times, strict=True)
        if i != 3
    ]
    assert sent == expected and all(type(event) is UpdateUploaded for event in sent)
    assert prepared == [None] * 3
    assert sorted(state.uploads) == [2, 5]  # the due ones taken, the released one's too


def test_a_tasks_job_trained_alone_is_train_job_of_its_own_attributes() -> None:
    """A task's job made without a closure trains alone (called as any executor calls it) to the very update that
    train_job of the same task, data span, stream keys, codec and attack gives."""
    x, y, index, cfg, base, ctx = small_job()
    key, codec = (5, seeding.TASK, 4, 2), (5, seeding.CODEC, 4, 2)
    finish = Finish(ctx, ClientId(4), codec, -2.0, (), 17)
    job: TrainingJob[TrainedUpdate] = TrainingJob.of(
        base, x, y, index, cfg, key, finish, None, None, None, None, None, (13, 41), client_module._train_alone
    )
    alone = job()
    expected = train_job(ctx, ClientId(4), base, (x, y, index), key, codec, 17, -2.0, (), (13, 41))
    assert alone.payload == expected.payload and alone.result.num_samples == expected.result.num_samples == 28
    assert alone.result.loss == expected.result.loss


def _due_state(rng: random.Random, n: int) -> client_module._GroupState:
    """A group of ``n`` tasks, a few uploads already kept, its next upload numbered at random."""
    tasks = [
        TaskAssigned(
            task_id=k, client_id=ClientId(k), participation=k, base_version=Version(0), simulated_s=rng.random()
        )
        for k in range(n)
    ]
    plan = client_module._Plan(
        download_s=[0.0] * n,
        simulated=[0.0] * n,
        done_at=[rng.uniform(0.0, 50.0) for _ in range(n)],
        parts=None,
        training={},
        faults={},
        offline=None,
    )
    kept = {n + k: (cast(Any, f"earlier {k}"), float(k)) for k in range(rng.randrange(3))}
    return client_module._GroupState(
        tasks=tasks, model=cast(Any, None), plan=plan, jobs={}, agenda=[], order=rng.randrange(100), uploads=kept
    )


def test_uploads_due_keeps_and_numbers_the_live_tasks_as_one_at_a_time() -> None:
    """_uploads_due asks once, in order, whether each task due is in flight; it keeps the trained update and upload
    seconds of each live one (in order, after those kept before), returns their agenda entries (their upload time,
    their number counted on from the group's, the upload kind, their index) and counts the group's numbers on: what
    taking them one at a time does, with every task, none or some of them released."""
    rng = random.Random(7)
    for trial in range(60):
        n = rng.randrange(1, 40)
        ours, reference = _due_state(random.Random(trial), n), _due_state(random.Random(trial), n)
        due = rng.sample(range(n), rng.randrange(n + 1))
        trained = [cast(Any, f"update {i}") for i in due]
        upload_s = [rng.expovariate(1.0) for _ in due]
        released = {i for i in due if rng.random() < [0.0, 1.0, 0.3][trial % 3]}
        asked: list[int] = []

        def live(task: TaskAssigned, asked: list[int] = asked, released: set[int] = released) -> bool:
            asked.append(task.task_id)
            return task.task_id not in released

        entries = client_module._uploads_due(ours, due, trained, upload_s, live)
        expected, order = [], reference.order
        for i, update, seconds in zip(due, trained, upload_s, strict=True):
            if i not in released:
                reference.uploads[i] = (update, seconds)
                expected.append((reference.plan.done_at[i] + seconds, order, client_module._UPLOAD, i))
                order += 1
        assert entries == expected
        assert asked == due
        assert list(ours.uploads.items()) == list(reference.uploads.items())
        assert ours.order == order
