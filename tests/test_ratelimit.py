"""The request-rate check (``--rate-limit-tokens-per-second``) on a fake clock."""

from __future__ import annotations

from sidecar.config import LegacyLimits
from sidecar.ratelimit import TokenBucket
from tests.clock import FakeClock


def test_token_bucket() -> None:
    clock = FakeClock()
    bucket = TokenBucket(2, 1.0, clock)
    assert bucket.try_take() and bucket.try_take()
    assert not bucket.try_take()
    clock.advance(0.5)
    assert not bucket.try_take()
    clock.advance(0.5)
    assert bucket.try_take()
    clock.advance(100)
    assert bucket.tokens <= 2
    assert bucket.try_take() and bucket.try_take() and not bucket.try_take()


def test_bucket_only_with_positive_rate_and_limit() -> None:
    clock = FakeClock()
    assert LegacyLimits(10, None).bucket(clock) is None
    assert LegacyLimits(10, 0).bucket(clock) is None
    assert LegacyLimits(0, 5).bucket(clock) is None  # --max-concurrent-requests 0 removes it
    assert LegacyLimits(-1, 5).bucket(clock) is None
    assert LegacyLimits(10, 5).bucket(clock) is not None
