"""Per-client values drawn from a seeded NumPy stream, held whole for a small population and a block at a time for a
large one.

A population's traits (speed factors, link latencies and bandwidths) are ``n`` consecutive elementwise draws of one
generator. Elementwise draws consume the generator in order, so the values of clients ``[s, s + b)`` are the draws of
a block of ``b`` made from the generator's state at ``s``: a large population keeps that state at each block's start
(a few bytes per block) and draws a block again when one of its clients is asked for, instead of ``n`` floats.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

__all__ = ["DrawnColumn"]

EAGER_UP_TO = 65_536
"""Populations of at most this many clients hold their values whole (as one call would draw them)."""

BLOCK = 512
"""Clients per block of a large population."""

_LOW_64 = (1 << 64) - 1

_CACHED_BLOCKS = 64
"""Blocks a column keeps drawn, most recently used first."""

Draw = Callable[[np.random.Generator, int], np.ndarray]
"""Draw ``count`` values from a generator, one per client, elementwise (e.g. ``g.normal(0.0, sigma, count)``)."""

Transform = Callable[[np.ndarray], np.ndarray]
"""Turn drawn values into the column's values, elementwise (e.g. ``median * np.exp(z)``)."""


class DrawnColumn:
    """``n`` per-client float64 values: ``transform(draw(rng, n))``, as a view indexed by client id.

    Building it consumes ``n`` draws of ``rng`` (block by block where ``n > eager_up_to``, the same draws), so a
    column built after another from the same generator continues its stream. A large column keeps each block's
    generator state (24 bytes a block) and the most recently used blocks drawn; asking for a client of
    another block draws that block again (microseconds), so memory does not grow with the population or with the
    clients touched.

    Args:
        rng: The generator, at the first client's draw; left after the last client's.
        n: Number of clients.
        draw: Draws values elementwise.
        transform: Maps drawn values elementwise.
        eager_up_to: Hold the values whole up to this many clients.
        block: Clients per block beyond that.
    """

    def __init__(
        self,
        rng: np.random.Generator,
        n: int,
        draw: Draw,
        transform: Transform,
        *,
        eager_up_to: int = EAGER_UP_TO,
        block: int = BLOCK,
    ) -> None:
        """Draw every value once, keeping them (small ``n``) or each block's starting state (large ``n``)."""
        if block < 1:
            raise ValueError(f"block must be >= 1, got {block}")
        self._n = n
        self._draw = draw
        self._transform = transform
        self._block = block
        self._whole: np.ndarray | None = None
        self._cache: OrderedDict[int, np.ndarray] = OrderedDict()
        bits = rng.bit_generator
        if n <= eager_up_to or not isinstance(bits, np.random.PCG64):
            self._whole = np.asarray(transform(draw(rng, n)), dtype=np.float64)
            return
        self._template: dict[str, Any] = dict(bits.state)
        count = -(-n // block)
        # Each block's starting 128-bit counter as two 64-bit halves, and the generator's buffered 32-bit half-word.
        self._high = np.empty(count, dtype=np.uint64)
        self._low = np.empty(count, dtype=np.uint64)
        self._buffered = np.empty(count, dtype=np.int64)
        for index in range(count):
            state = bits.state
            counter = int(state["state"]["state"])
            self._high[index], self._low[index] = counter >> 64, counter & _LOW_64
            self._buffered[index] = int(state["uinteger"]) if state["has_uint32"] else -1
            draw(rng, min(block, n - index * block))
        self._replay = np.random.Generator(np.random.PCG64(0))

    def __len__(self) -> int:
        """Return the number of clients."""
        return self._n

    @property
    def nbytes(self) -> int:
        """Return the bytes held: the values of a small column, the blocks drawn and the block states otherwise."""
        if self._whole is not None:
            return int(self._whole.nbytes)
        states = self._high.nbytes + self._low.nbytes + self._buffered.nbytes
        return sum(int(b.nbytes) for b in self._cache.values()) + int(states)

    def __getitem__(self, clients: int | np.ndarray) -> Any:
        """Return one client's value (a NumPy float64) or an array of the values of an array of clients."""
        if self._whole is not None:
            return self._whole[clients]
        if isinstance(clients, int | np.integer):
            client = int(clients)
            if not 0 <= client < self._n:
                raise IndexError(f"client {client} is out of range for {self._n} clients")
            return self._values_of(client // self._block)[client % self._block]
        ids = np.asarray(clients, dtype=np.int64)
        out = np.empty(ids.shape, dtype=np.float64)
        flat = ids.reshape(-1)
        if flat.size and (int(flat.min()) < 0 or int(flat.max()) >= self._n):
            raise IndexError(f"client ids out of range for {self._n} clients")
        order = np.argsort(flat // self._block, kind="stable")
        ordered = flat[order]
        blocks, starts = np.unique(ordered // self._block, return_index=True)
        values = out.reshape(-1)
        for index, begin, end in zip(blocks.tolist(), starts.tolist(), [*starts[1:].tolist(), len(flat)], strict=True):
            values[order[begin:end]] = self._values_of(index)[ordered[begin:end] % self._block]
        return out

    def floats(self, clients: Sequence[int]) -> list[float]:
        """Return the values of ``clients`` as Python floats (the same numbers as indexing), without an array pass
        for a few clients of a column held whole."""
        if self._whole is not None:
            item = self._whole.item
            return [item(client) for client in clients]
        values: list[float] = self[np.asarray(clients, dtype=np.int64)].tolist()
        return values

    @property
    def item(self) -> Callable[[int], float]:
        """What returns one client's value as a Python float (the number indexing gives): the values' own ``item``
        for a column held whole, a call of ``float(column[client])`` otherwise."""
        if self._whole is not None:
            item: Callable[[int], float] = self._whole.item
            return item
        return self._float_of

    def _float_of(self, client: int) -> float:
        return float(self[client])

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        """Return every value as one array (a large column draws all its blocks)."""
        whole = self._whole if self._whole is not None else self[np.arange(self._n)]
        return np.asarray(whole, dtype=dtype)

    def _values_of(self, index: int) -> np.ndarray:
        values = self._cache.get(index)
        if values is not None:
            self._cache.move_to_end(index)
            return values
        template, buffered = self._template, int(self._buffered[index])
        counter = (int(self._high[index]) << 64) | int(self._low[index])
        self._replay.bit_generator.state = {
            **template,
            "state": {**template["state"], "state": counter},
            "has_uint32": int(buffered >= 0),
            "uinteger": max(buffered, 0),
        }
        start = index * self._block
        values = np.asarray(self._transform(self._draw(self._replay, min(self._block, self._n - start))), np.float64)
        self._cache[index] = values
        if len(self._cache) > _CACHED_BLOCKS:
            self._cache.popitem(last=False)
        return values
