"""An OTLP/gRPC receiver for the tracing tests (devtools.otlp, a real gRPC server), and a
helper to find a trace's one span in what it received.

Import the fixture into a test module: ``from tests.otlp_support import receiver``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from devtools.otlp import OtlpReceiver, ReceivedSpan


@pytest.fixture
async def receiver() -> AsyncIterator[OtlpReceiver]:
    r = OtlpReceiver()
    await r.start()
    yield r
    await r.stop()


def span_of(spans: list[ReceivedSpan], trace_id: str) -> ReceivedSpan:
    """The one span of ``trace_id`` in ``spans`` (none or several: the test fails)."""
    found = [s for s in spans if s.trace_id == trace_id]
    assert len(found) == 1, (trace_id, found)
    return found[0]
