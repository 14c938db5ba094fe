"""Secure aggregation in a simulated run: the clients' :class:`~flasync.clients.simulated.secure.SecureRoom` and
its checkpoint component, built from ``[secure_aggregation]``."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Coroutine
from typing import Any

from flasync.aggregation import ExampleWeight, StalenessWeight
from flasync.clients.remote.secure import RemoteGroups
from flasync.clients.simulated.client import ClientWorld
from flasync.clients.simulated.secure import SecureRoom
from flasync.config import FedAvgServer, FedBuffServer, RunConfig
from flasync.core.bus import EventBus
from flasync.core.clock import Clock
from flasync.secure import Link, SecureAggregator
from flasync.server.registry import TaskRegistry

__all__ = ["RoomState", "group_size", "remote_groups", "secure_room"]


def group_size(config: RunConfig, num_clients: int) -> int:
    """Return the largest secure group of a run: FedBuff's buffer, or a FedAvg round's (over-selected) cohort."""
    server = config.server
    if isinstance(server, FedAvgServer):
        over = config.resilience.over_selection
        return min(num_clients, math.ceil((1.0 + over) * server.clients_per_round - 1e-9))
    if isinstance(server, FedBuffServer):
        return server.buffer_size
    raise ValueError(f"secure aggregation has no group with server.kind = {server.kind!r}")


def secure_room(
    config: RunConfig,
    world: ClientWorld,
    registry: Callable[[], TaskRegistry],
    *,
    staleness: StalenessWeight,
    example_weight: ExampleWeight,
    bus: EventBus,
    clock: Clock,
) -> SecureRoom:
    """Return the room where the run's simulated clients hold their updates for their secure groups.

    Args:
        config: The run's configuration (``secure_aggregation.enabled``).
        world: The simulated clients' world (their links, the seed, the worker pool).
        registry: Returns the run's task registry (built after the room: its tasks in flight and task group).
        staleness: ``s(tau)`` FedBuff's members apply to themselves.
        example_weight: ``e(n)`` of a client with ``n`` samples.
        bus: The run's event bus.
        clock: The run's clock.
    """
    secure, server = config.secure_aggregation, config.server
    size = group_size(config, len(world.population))
    aggregator = SecureAggregator(
        bits=secure.bits,
        clip=secure.clip,
        group_size=size,
        threshold=secure.effective_threshold(size),
        neighbours=secure.neighbours,
        seed=config.seed,
        link=Link(),
        dropout_rate=secure.dropout,
    )
    scale = secure.example_weight_scale
    if scale is None:
        scale = max(example_weight(int(n)) for n in world.population.sizes)

    def spawn(coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        return registry().spawn(coro, name)

    windows = world.faults if world.faults is not None and world.faults.windows else None

    return SecureRoom(
        aggregator=aggregator,
        buffer_size=None if isinstance(server, FedAvgServer) else size,
        staleness=staleness,
        example_weight=example_weight,
        example_scale=float(scale),
        network=world.network,
        clock=clock,
        bus=bus,
        pool=world.pool,
        in_flight=lambda: iter(registry()),
        spawn=spawn,
        held=lambda task: registry().hold(task),
        online=None if windows is None else windows.online,
        offline_at=None if windows is None else windows.offline_at,
    )


class RoomState:
    """The room's state as a checkpoint component: its held updates name tasks of the registry (restored first)."""

    def __init__(self, room: SecureRoom, registry: TaskRegistry) -> None:
        self.room = room
        self.registry = registry

    def state_dict(self) -> dict[str, Any]:
        """Return the room's state."""
        return self.room.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the room's state against the restored tasks in flight."""
        self.room.load_state_dict(state, {task.task_id: task for task in self.registry})


def remote_groups(
    config: RunConfig,
    world: ClientWorld,
    registry: TaskRegistry,
    *,
    staleness: StalenessWeight,
    example_weight: ExampleWeight,
    bus: EventBus,
    clock: Clock,
    num_params: int,
    model_version: Callable[[], int],
) -> RemoteGroups | None:
    """Return the server's side of secure aggregation with remote clients (None: ``[secure_aggregation]`` off).

    Each member's weights are ``(s(tau) e(n) / scale, e(n) / scale)`` (clipped to 1), with ``scale``
    ``example_weight_scale`` or the largest example weight of the population. ``model_version`` reads the model's
    version (FedBuff's first group steps from it: a resumed server's from its checkpoint's).
    """
    secure, server = config.secure_aggregation, config.server
    if not secure.enabled:
        return None
    size = group_size(config, len(world.population))
    scale = secure.example_weight_scale
    if scale is None:
        scale = max(example_weight(int(n)) for n in world.population.sizes)
    rounds = isinstance(server, FedAvgServer)

    def weights(staleness_versions: int, num_samples: int) -> tuple[float, float]:
        example = min(1.0, example_weight(num_samples) / float(scale))
        tau_weight = 1.0 if rounds else staleness(staleness_versions)
        return min(1.0, tau_weight * example), example

    return RemoteGroups(
        bits=secure.bits,
        clip=secure.clip,
        group_size=size,
        threshold=secure.effective_threshold(size),
        neighbours=secure.neighbours,
        buffer_size=None if rounds else size,
        weights=weights,
        num_params=num_params,
        seed=config.seed,
        round_timeout_s=secure.round_timeout_s,
        bus=bus,
        in_flight=lambda: iter(registry),
        spawn=registry.spawn,
        clock=clock,
        held=registry.hold,
        model_version=model_version,
    )
