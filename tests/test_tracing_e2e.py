"""Admission traces through a real Envoy: client -> Envoy -> sidecar, spans -> a real OTLP
receiver (devtools.otlp).

- A request's ``traceparent`` and ``tracestate`` reach the sidecar through Envoy's
  CheckRequest: its span has that trace id and that parent, and the decision's
  attributes: admitted at once, queued then admitted (its span covers the wait, ending
  when the answer went out), refused with 429 (the client's answer checked on status,
  ``X-SMG-Error-Code`` and body too).
- Parent-based at a ratio so small that no root is ever kept: requests without a
  ``traceparent`` or with an unsampled one produce no span; sampled ones all do.
- The receiver hung, then down: every request is still admitted and served, none held
  anywhere near the exporter's timeout.
- ``--trace-sample-ratio 0``: nothing at all, sampled parents included.
"""

from __future__ import annotations

import asyncio
import secrets
import time

import pytest

from devtools.httpclient import Exchange, request
from devtools.otlp import OtlpReceiver
from devtools.stack import Stack
from sidecar import tracing
from tests.conftest import StackFactory, assert_denied, settle, until
from tests.otlp_support import receiver, span_of

__all__ = ["receiver"]  # a fixture, used by name

pytestmark = pytest.mark.e2e

PRIORITY = """
classes:
  system: {reserved_floor: 0, queue_size: 2, queue_timeout_secs: 5}
  interactive: {reserved_floor: 0, reserved_per_slot: 0.0, queue_size: 2, queue_timeout_secs: 5}
  default: {reserved_per_slot: 0.0, queue_size: 1, queue_timeout_secs: 5}
  bulk: {queue_size: 0}
"""


def traceparent(trace_id: str, parent: str, sampled: bool) -> str:
    return f"00-{trace_id}-{parent}-{'01' if sampled else '00'}"


def ids() -> tuple[str, str]:
    return secrets.token_hex(16), secrets.token_hex(8)


async def traced_stack(make_stack: StackFactory, receiver: OtlpReceiver,
                       ratio: str, slots: int = 1) -> Stack:
    # No edge route: bulk's overflow must reach the sidecar's Check to be refused there.
    return await make_stack(priority_yaml=PRIORITY, workers=1, max_running_requests=slots,
                            edge_shed=False, sidecar_args=[
                                "--otlp-endpoint", receiver.endpoint,
                                "--trace-sample-ratio", ratio])


async def test_spans_join_the_callers_trace_with_the_decision(
        make_stack: StackFactory, receiver: OtlpReceiver) -> None:
    stack = await traced_stack(make_stack, receiver, "1e-12")
    (t_now, p_now), (t_held, p_held), (t_queued, p_queued), (t_full, p_full) = (
        ids() for _ in range(4))

    r = await request(stack.listen_port, headers={
        "x-smg-priority": "interactive", "traceparent": traceparent(t_now, p_now, True),
        "tracestate": "vendor=abc,other=1"})
    assert r.status == 200
    # One request holds the only slot; the next queues behind it; bulk (queue 0) is refused.
    held = await Exchange.send(stack.listen_port, headers={
        "x-smg-priority": "default", "x-fake-gate": "held",
        "traceparent": traceparent(t_held, p_held, True)})
    await until(stack, lambda m: m.get('smg_scheduler_inflight{class="default"}') == 1)
    queued_at = time.monotonic()
    queued = asyncio.ensure_future(request(stack.listen_port, headers={
        "x-smg-priority": "default", "traceparent": traceparent(t_queued, p_queued, True)}))
    await until(stack, lambda m: m.get('smg_scheduler_queue_depth{class="default"}') == 1)
    full = await request(stack.listen_port, headers={
        "x-smg-priority": "bulk", "traceparent": traceparent(t_full, p_full, True)})
    assert_denied(full, 429, "scheduler_queue_full", "2")
    # Untraced and unsampled requests: at this ratio no span may come of them.
    unsampled = [ids() for _ in range(5)]
    for t, p in unsampled:
        assert (await request(stack.listen_port, headers={
            "x-smg-priority": "bulk", "traceparent": traceparent(t, p, False)})).status == 429
        assert (await request(stack.listen_port, headers={"x-smg-priority": "bulk"})
                ).status == 429
    await asyncio.sleep(0.3)  # the queued request waits a measurable time
    stack.fleet.gates.open("held")
    await held.read_head()
    assert held.status == 200
    await held.read_body()
    await held.close()
    answered = await asyncio.wait_for(queued, 10)
    waited = time.monotonic() - queued_at
    assert answered.status == 200

    spans = await receiver.wait_for(lambda s: len(s) >= 4, 15, "the four sampled decisions")
    for s in spans:
        assert s.name == tracing.SPAN_NAME and s.attributes["smg.pool"] == "default"
        assert s.attributes["smg.tenant"] == "anonymous"
    now = span_of(spans, t_now)
    assert now.parent_span_id == p_now and now.trace_state == "vendor=abc,other=1"
    assert now.attributes["smg.outcome"] == "admitted"
    assert now.attributes["smg.queued"] is False
    # anonymous: interactive is clamped to the default ceiling, and the span says so
    assert (now.attributes["smg.class.requested"], now.attributes["smg.class.effective"]) == (
        "interactive", "default")
    worker_ids = [rec.admission_id for w in stack.fleet.workers for rec in w.records]
    assert now.attributes["smg.admission.tag"] in {tracing.logs.id_tag(a) for a in worker_ids
                                                   if a is not None}

    q = span_of(spans, t_queued)
    assert q.parent_span_id == p_queued
    assert q.attributes["smg.outcome"] == "admitted" and q.attributes["smg.queued"] is True
    wait = q.attributes["smg.queue.wait_seconds"]
    assert 0.3 <= wait <= waited, (wait, waited)
    assert q.duration >= wait  # the span covers the wait, to the answer
    assert span_of(spans, t_held).attributes["smg.queued"] is False

    f = span_of(spans, t_full)
    assert f.parent_span_id == p_full
    assert (f.attributes["smg.outcome"], f.attributes["http.response.status_code"],
            f.attributes["smg.error_code"], f.attributes["smg.class.effective"]) == (
        "rejected_queue_full", 429, "scheduler_queue_full", "bulk")
    assert "smg.admission.tag" not in f.attributes

    # Nothing else arrives: wait two export periods past the last sampled span.
    await asyncio.sleep(2.5 * tracing.SCHEDULE_DELAY_MS / 1000)
    assert len(receiver.spans) == 4, [s.attributes for s in receiver.spans]
    assert not {s.trace_id for s in receiver.spans} & {t for t, _ in unsampled}
    await settle(stack)


async def test_a_hung_or_dead_receiver_does_not_hold_admission(
        make_stack: StackFactory, receiver: OtlpReceiver) -> None:
    stack = await traced_stack(make_stack, receiver, "1", slots=8)
    assert (await request(stack.listen_port)).status == 200
    await receiver.wait_for(lambda s: len(s) == 1, 10, "the first span")
    for fault in ("stalled", "down"):
        if fault == "stalled":
            receiver.stall()
        else:
            await receiver.stop()
        slowest = 0.0
        for _ in range(4):  # past the exporter's schedule, so it tries (and hangs/fails)
            t0 = time.monotonic()
            rs = await asyncio.gather(*(request(stack.listen_port, headers={
                "traceparent": traceparent(*ids(), True)}) for _ in range(8)))
            slowest = max(slowest, time.monotonic() - t0)
            assert [r.status for r in rs] == [200] * 8
            await asyncio.sleep(tracing.SCHEDULE_DELAY_MS / 1000)
        print(f"{fault}: slowest batch of 8 requests {slowest * 1000:.0f} ms")
        # An export to a hung receiver takes EXPORT_TIMEOUT_SECS before it gives up: no
        # request waited for one.
        assert slowest < tracing.EXPORT_TIMEOUT_SECS
    await settle(stack)
    assert stack.sidecar is not None and stack.sidecar.poll() is None
    assert "trace_export_problem" in stack.sidecar_log.read_text()


async def test_ratio_zero_sends_nothing_even_for_sampled_parents(
        make_stack: StackFactory, receiver: OtlpReceiver) -> None:
    stack = await traced_stack(make_stack, receiver, "0")
    for _ in range(10):
        r = await request(stack.listen_port, headers={"traceparent": traceparent(*ids(), True)})
        assert r.status == 200
    await asyncio.sleep(2.5 * tracing.SCHEDULE_DELAY_MS / 1000)
    assert receiver.exports == 0 and receiver.spans == []
    assert '"traces": null' in stack.sidecar_log.read_text()  # the banner: tracing off
    await settle(stack)
