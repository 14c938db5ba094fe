"""Stand-ins the server's unit tests share."""

from __future__ import annotations

import torch

from flasync.core.events import UpdateUploaded, Version
from flasync.core.snapshots import ModelSnapshot


class TasksInFlight:
    """A registry stand-in: the tasks in flight by (task, client, base), every version published as zeros of
    ``num_params``; the tasks released, in order."""

    def __init__(self, num_params: int, *tasks: tuple[int, int, int]) -> None:
        self.num_params = num_params
        self.tasks = set(tasks)
        self.released: list[int] = []

    def base(self, version: Version) -> ModelSnapshot | None:
        weights = torch.zeros(self.num_params)
        return ModelSnapshot(version=version, weights=weights, exact=weights, download_bytes=0)

    def release(self, message: UpdateUploaded) -> bool:
        key = (message.task_id, int(message.client_id), int(message.base_version))
        if key not in self.tasks:
            return False
        self.tasks.remove(key)
        self.released.append(message.task_id)
        return True
