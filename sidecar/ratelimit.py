"""The request-rate check (``--rate-limit-tokens-per-second``): a token bucket.

Capacity is ``--max-concurrent-requests`` and the refill rate is the flag; a
request takes one token before admission and a request that finds none is shed.
When the bucket exists is :meth:`sidecar.config.LegacyLimits.bucket`.
"""

from __future__ import annotations

from collections.abc import Callable


class TokenBucket:
    """A classic token bucket on an injectable clock; starts full."""

    def __init__(self, capacity: int, rate: float, clock: Callable[[], float]) -> None:
        if capacity < 1 or rate <= 0:
            raise ValueError("token bucket needs capacity >= 1 and rate > 0")
        self.capacity = capacity
        self.rate = rate
        self._clock = clock
        self._tokens = float(capacity)
        self._stamp = clock()

    def try_take(self) -> bool:
        now = self._clock()
        elapsed = now - self._stamp
        if elapsed > 0:
            self._tokens = min(self.capacity, self._tokens + elapsed * self.rate)
        self._stamp = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return True
        return False

    @property
    def tokens(self) -> float:
        return self._tokens

