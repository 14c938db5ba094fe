"""Per-address limits on what a served run's HTTP endpoints refuse: a flood costs its sender, not the run.

Every request the server refuses (no or a wrong token, a malformed id or header, a task that is not the client's)
costs its address one token of a bucket that refills at a steady rate; an address whose bucket is empty is answered
429 with ``Retry-After`` before anything else is done for it, until the bucket refills. Well-behaved clients are
never refused often enough to notice. Memory is bounded: the least recently refused addresses are forgotten first.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["AddressLimits"]


@dataclass(slots=True)
class _Bucket:
    tokens: float
    at: float


class AddressLimits:
    """Token buckets of refusals, one per client address.

    Args:
        burst: Refusals an address may cost at once (the bucket's size), at least 1.
        per_s: Tokens an address gets back per second.
        max_addresses: Addresses remembered at most (the least recently refused one is forgotten first).
        clock: Monotonic seconds.

    Raises:
        ValueError: A limit is not positive.
    """

    def __init__(
        self,
        *,
        burst: float = 30.0,
        per_s: float = 10.0,
        max_addresses: int = 4096,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """Start with every address's bucket full."""
        if not burst >= 1 or not per_s > 0 or max_addresses < 1:
            raise ValueError(f"limits must be positive (burst >= 1), got {burst}, {per_s}, {max_addresses}")
        self.burst = float(burst)
        self.per_s = float(per_s)
        self.max_addresses = max_addresses
        self._clock = clock
        self._buckets: OrderedDict[str, _Bucket] = OrderedDict()

    def __len__(self) -> int:
        """Count the addresses remembered."""
        return len(self._buckets)

    def retry_after(self, address: str) -> int | None:
        """Return in how many whole seconds ``address`` may be served again, or None when it may be now."""
        bucket = self._refill(address)
        if bucket is None or bucket.tokens >= 1.0:
            return None
        return max(1, math.ceil((1.0 - bucket.tokens) / self.per_s))

    def refused(self, address: str) -> None:
        """Charge ``address`` one token for a request that was refused."""
        bucket = self._refill(address)
        if bucket is None:
            if len(self._buckets) >= self.max_addresses:
                self._buckets.popitem(last=False)
            bucket = self._buckets[address] = _Bucket(self.burst, self._clock())
        else:
            self._buckets.move_to_end(address)
        bucket.tokens -= 1.0

    def _refill(self, address: str) -> _Bucket | None:
        bucket = self._buckets.get(address)
        if bucket is None:
            return None
        now = self._clock()
        bucket.tokens = min(self.burst, bucket.tokens + (now - bucket.at) * self.per_s)
        bucket.at = now
        if bucket.tokens >= self.burst:  # full again: nothing to remember
            del self._buckets[address]
            return None
        return bucket
