"""Which remote devices count as connected: the population's mask agrees with each device's own answer."""

from __future__ import annotations

import numpy as np

from flasync.clients.remote.transport import _DeviceRegistry
from flasync.core.bus import EventBus
from flasync.core.events import ClientId


class _Wall:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _agrees(devices: _DeviceRegistry) -> None:
    expected = np.array([devices.online(i, 0.0) for i in range(devices.num_clients)])
    np.testing.assert_array_equal(devices.online_mask(0.0), expected)


def test_the_online_mask_is_each_devices_online_answer() -> None:
    """Heard, holding a task, polling, answered, silent past the window, heard before the run attached, and an id
    beyond the population: the mask over the population is what :meth:`online` says of each device."""
    wall = _Wall()
    devices = _DeviceRegistry(wall)
    devices.heard(ClientId(1), asking=True)  # before the run: remembered
    devices.poll(ClientId(2), 1)
    devices.attach(EventBus(), num_clients=6)
    _agrees(devices)
    assert devices.online_mask(0.0).tolist() == [False, True, True, False, False, False]
    devices.heard(ClientId(3))
    devices.hand(ClientId(3), 7)
    devices.heard(ClientId(4))
    devices.heard(ClientId(9))  # not in the population
    _agrees(devices)
    wall.now += 2.0
    devices.poll(ClientId(2), -1)
    devices.heard(ClientId(5), asking=True)
    _agrees(devices)
    wall.now += 2.0  # 1, 3 and 4 fall silent past the window; 2's poll ended and it was never heard
    _agrees(devices)
    assert devices.online_mask(0.0).tolist() == [False, False, False, False, False, True]
    devices.forget_task(ClientId(3), 7)
    devices.poll(ClientId(3), 1)
    devices.asks(ClientId(5))
    _agrees(devices)
    assert devices.online_mask(0.0).tolist() == [False, False, False, True, False, True]
