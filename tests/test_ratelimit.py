"""The request-rate check (``--rate-limit-tokens-per-second``) on a fake clock."""

from __future__ import annotations

from sidecar.ratelimit import TokenBucket, build_bucket
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
    assert build_bucket(10, None, clock) is None
    assert build_bucket(10, 0, clock) is None
    assert build_bucket(0, 5, clock) is None  # --max-concurrent-requests 0 removes it
    assert build_bucket(-1, 5, clock) is None
    assert build_bucket(10, 5, clock) is not None
