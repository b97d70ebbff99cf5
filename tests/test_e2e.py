"""End to end through a real Envoy: client -> Envoy -> sidecar -> fake workers.

Each test starts its own stack on free loopback ports and, on the way out, the
fixture checks that the sidecar reports in-flight 0 and queue depth 0.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest

from devtools.demo import make_token
from devtools.fleet import wait_for
from devtools.httpclient import Exchange, chat_body, request
from devtools.stack import Stack
from tests.conftest import (
    Metrics,
    StackFactory,
    assert_denied,
    complete_held,
    preempt_held_bulk,
    settle,
    until,
)

pytestmark = pytest.mark.e2e

# Small numbers so every scenario is quick; no reservations unless a test asks.
PRIORITY = """
classes:
  system: {reserved_floor: 0, queue_size: 2, queue_timeout_secs: 5}
  interactive: {reserved_floor: 0, reserved_per_slot: 0.0, queue_size: 2, queue_timeout_secs: 5}
  default: {reserved_per_slot: 0.0, queue_size: 1, queue_timeout_secs: 0.6}
  bulk: {queue_size: 2, queue_timeout_secs: 5}
tenant_policies:
  "auth:gold": {max_class: system}
"""
SECRET = "e2e-test-secret"


def token(tenant: str) -> str:
    return make_token(tenant, SECRET)


async def hold(stack: Stack, gate: str, priority: str = "default") -> Exchange:
    """Start a request the worker holds until the test opens ``gate``
    (``stack.fleet.gates.open(gate)``); return its exchange."""
    return await Exchange.send(stack.listen_port,
                               headers={"x-smg-priority": priority, "x-fake-gate": gate})


async def inflight(stack: Stack) -> float:
    m = await stack.metrics()
    return sum(v for k, v in m.items() if k.startswith("smg_scheduler_inflight{"))


def inflight_is(cls: str, n: int) -> Callable[[Metrics], bool]:
    return lambda m: m.get(f'smg_scheduler_inflight{{class="{cls}"}}', 0) == n


def queued_is(cls: str, n: int) -> Callable[[Metrics], bool]:
    return lambda m: m.get(f'smg_scheduler_queue_depth{{class="{cls}"}}', 0) == n


def capacity_is(n: int) -> Callable[[Metrics], bool]:
    return lambda m: m.get("smg_sidecar_capacity") == n


async def test_admitted_non_streaming_reaches_worker_and_releases(make_stack: StackFactory) -> None:
    stack = await make_stack(priority_yaml=PRIORITY)
    r = await request(stack.listen_port, headers={"x-smg-priority": "bulk"})
    assert r.status == 200 and r.json()["object"] == "chat.completion"
    records = [rec for w in stack.fleet.workers for rec in w.records]
    assert len(records) == 1
    rec = records[0]
    assert rec.priority_class == "bulk" and rec.outcome == "finished"
    assert rec.admission_id is not None and len(rec.admission_id) == 32
    m = await settle(stack)
    assert m['smg_scheduler_admit_total{class="bulk",outcome="admitted"}'] == 1
    assert m['smg_sidecar_released_total{class="bulk",reason="completed"}'] == 1
    assert m.get('smg_sidecar_lease_expired_total{class="bulk"}', 0) == 0
    # One ext_proc stream, answered once (request_headers) and then closed by the sidecar
    # at the response headers instead of a second CONTINUE: a clean end, not a failure.
    assert await stack.envoy_stat("http.ingress.ext_proc.streams_started") == 1
    assert await stack.envoy_stat("http.ingress.ext_proc.stream_msgs_received") == 1
    assert await stack.envoy_stat("http.ingress.ext_proc.streams_failed") == 0
    assert await stack.envoy_stat("http.ingress.ext_proc.failure_mode_allowed") == 0


async def test_admitted_streaming_releases_at_end(make_stack: StackFactory) -> None:
    stack = await make_stack(priority_yaml=PRIORITY)
    ex = await Exchange.send(stack.listen_port, headers={"x-smg-priority": "interactive"},
                             body=chat_body(stream=True))
    await ex.read_head()
    assert ex.status == 200 and ex.headers["content-type"].startswith("text/event-stream")
    body = (await asyncio.wait_for(ex.read_body(), 10)).decode()
    await ex.close()
    assert body.count("data: ") == 6 and "data: [DONE]" in body
    m = await settle(stack)
    # anonymous tenant: interactive clamps to the default ceiling
    assert m['smg_scheduler_admit_total{class="default",outcome="admitted"}'] == 1
    assert m['smg_scheduler_clamp_total{effective_class="default",requested_class="interactive",'
             'tenant="anonymous"}'] == 1


async def test_queue_full_429_and_timeout_503(make_stack: StackFactory) -> None:
    # no periodic access-log entries in this test: only final ones are counted below
    stack = await make_stack(priority_yaml=PRIORITY, workers=1, max_running_requests=1,
                             flush_interval_secs=60, lease_secs=120)
    busy = await hold(stack, "busy")
    await until(stack, inflight_is("default", 1))
    queued = asyncio.ensure_future(request(stack.listen_port))
    await until(stack, queued_is("default", 1))
    full = await request(stack.listen_port)
    assert_denied(full, 429, "scheduler_queue_full", "2")
    timed_out = await asyncio.wait_for(queued, 5)
    assert_denied(timed_out, 503, "scheduler_queue_timeout", "2")
    await complete_held(stack, busy, "busy")
    m = await settle(stack)
    assert m['smg_scheduler_admit_total{class="default",outcome="rejected_queue_full"}'] == 1
    assert m['smg_scheduler_admit_total{class="default",outcome="rejected_queue_timeout"}'] == 1
    # the worker only ever saw the one admitted request
    assert stack.fleet.workers[0].started == 1
    # and only its access-log entry was sent: denied requests are filtered out in Envoy
    admitted_logs = await stack.envoy_stat("access_logs.grpc_access_log.logs_written")
    assert admitted_logs == 1


async def test_tenant_from_trusted_jwt_only_and_clamp(make_stack: StackFactory) -> None:
    stack = await make_stack(priority_yaml=PRIORITY, jwt_secret=SECRET)
    # A default-ceiling tenant asking for system is admitted as default, counted.
    r = await request(stack.listen_port, headers={"x-smg-priority": "system",
                                                  "authorization": f"Bearer {token('auth:plain')}"})
    assert r.status == 200
    # A gold tenant (policy: system) keeps system.
    r = await request(stack.listen_port, headers={"x-smg-priority": "system",
                                                  "authorization": f"Bearer {token('auth:gold')}"})
    assert r.status == 200
    # A client naming itself gold with a header gets nothing for it: it is anonymous.
    r = await request(stack.listen_port, headers={"x-smg-priority": "system",
                                                  "x-smg-tenant": "auth:gold"})
    assert r.status == 200
    # A forged token never reaches the sidecar.
    forged = token("auth:gold")[:-4] + "AAAA"
    r = await request(stack.listen_port, headers={"authorization": f"Bearer {forged}"})
    assert r.status == 401
    classes = [rec.priority_class for w in stack.fleet.workers for rec in w.records]
    assert sorted(classes) == ["default", "default", "system"]
    m = await settle(stack)
    assert m['smg_scheduler_clamp_total{effective_class="default",requested_class="system",'
             'tenant="auth:plain"}'] == 1
    assert m['smg_scheduler_clamp_total{effective_class="default",requested_class="system",'
             'tenant="anonymous"}'] == 1
    assert m['smg_scheduler_admit_total{class="system",outcome="admitted"}'] == 1


PREEMPT = """
classes:
  system: {reserved_floor: 0}
  interactive: {reserved_floor: 0, reserved_per_slot: 0.0, can_preempt: true}
  default: {reserved_per_slot: 0.0}
tenant_policies:
  "auth:gold": {max_class: system}
"""


async def test_preemption_of_bulk_by_interactive(make_stack: StackFactory) -> None:
    stack = await make_stack(priority_yaml=PREEMPT, workers=1, max_running_requests=1,
                             jwt_secret=SECRET)
    await preempt_held_bulk(stack, {"x-smg-priority": "interactive",
                                    "authorization": f"Bearer {token('auth:gold')}"})
    worker = stack.fleet.workers[0]
    bulk = [rec for rec in worker.records if rec.priority_class == "bulk"]
    await wait_for(lambda: bulk[0].outcome == "cancelled", 5)  # the worker saw the cancel
    m = await settle(stack)
    assert m['smg_scheduler_preemption_total{by_class="interactive",victim_class="bulk"}'] == 1
    assert m['smg_scheduler_admit_total{class="bulk",outcome="preempted"}'] == 1
    # the victim's own access-log entry arrives after its slot was freed: counted, ignored
    unmatched = 'smg_sidecar_completion_unmatched_total{reason="already_released"}'
    await until(stack, lambda m: m.get(unmatched, 0) == 1)


async def test_streaming_request_is_not_preempted_after_first_byte(
        make_stack: StackFactory) -> None:
    stack = await make_stack(priority_yaml=PREEMPT, workers=1, max_running_requests=1,
                             jwt_secret=SECRET)
    gold = {"authorization": f"Bearer {token('auth:gold')}"}
    streaming = await Exchange.send(stack.listen_port, body=chat_body(stream=True),
                                    headers={"x-smg-priority": "bulk",
                                             "x-fake-stream-gate": "rest"})
    await streaming.read_head()
    assert streaming.status == 200
    queued = asyncio.ensure_future(
        request(stack.listen_port, headers={"x-smg-priority": "interactive", **gold}))
    await until(stack, queued_is("interactive", 1))
    stack.fleet.gates.open("rest")  # the stream goes on; its slot is not preemptible
    body = await asyncio.wait_for(streaming.read_body(), 10)
    await streaming.close()
    assert b"[DONE]" in body
    r = await asyncio.wait_for(queued, 10)
    assert r.status == 200
    m = await settle(stack)
    assert m.get('smg_scheduler_preemption_total{by_class="interactive",victim_class="bulk"}',
                 0) == 0


async def test_client_disconnect_while_queued_and_while_streaming(
        make_stack: StackFactory) -> None:
    stack = await make_stack(priority_yaml=PRIORITY, workers=1, max_running_requests=1)
    worker = stack.fleet.workers[0]
    streaming = await Exchange.send(stack.listen_port, body=chat_body(stream=True),
                                    headers={"x-smg-priority": "bulk",
                                             "x-fake-stream-gate": "never"})
    await streaming.read_head()
    first = await streaming.read_chunk()
    assert first.startswith(b"data: ")
    waiting = await Exchange.send(stack.listen_port, headers={"x-smg-priority": "bulk"})
    await until(stack, queued_is("bulk", 1))
    await waiting.abort()  # gone while queued
    await until(stack, lambda m: m.get(
        'smg_scheduler_admit_total{class="bulk",outcome="client_cancelled"}') == 1)
    await streaming.abort()  # gone mid-stream: the access log releases the slot
    await until(stack, inflight_is("bulk", 0))
    await wait_for(lambda: worker.records[0].outcome == "cancelled", 5)
    m = await settle(stack)
    assert m['smg_sidecar_released_total{class="bulk",reason="completed"}'] == 1
    assert m.get('smg_sidecar_lease_expired_total{class="bulk"}', 0) == 0
    assert worker.started == 1  # the cancelled waiter never reached the worker


async def test_worker_health_drives_capacity(make_stack: StackFactory) -> None:
    stack = await make_stack(priority_yaml=PRIORITY, workers=2, max_running_requests=3)
    await until(stack, capacity_is(6))
    stack.fleet.workers[1].healthy = False
    await until(stack, capacity_is(3), timeout=3)
    assert (await stack.metrics())["smg_sidecar_healthy_workers"] == 1
    stack.fleet.workers[0].healthy = False
    # no healthy worker: the --max-concurrent-requests fallback (unset -> 1024), but never
    # above the last capacity read from workers: 3
    await until(stack, lambda m: m['smg_sidecar_capacity_source{source="fallback"}'] == 1,
                timeout=3)
    assert (await stack.metrics())["smg_sidecar_capacity"] == 3
    stack.fleet.workers[0].healthy = True
    stack.fleet.workers[1].healthy = True
    await until(stack, capacity_is(6), timeout=3)


async def test_capacity_from_envoy_admin_follows_routable_hosts(
        make_stack: StackFactory) -> None:
    stack = await make_stack(priority_yaml=PRIORITY, workers=2, max_running_requests=3,
                             capacity_from_envoy=True)
    await until(stack, capacity_is(6))
    stack.fleet.workers[0].healthy = False  # Envoy's active health check ejects it
    await until(stack, capacity_is(3), timeout=5)
    stack.fleet.workers[0].healthy = True
    await until(stack, capacity_is(6), timeout=5)


async def test_queued_requests_drain_when_capacity_grows(make_stack: StackFactory) -> None:
    stack = await make_stack(priority_yaml=PRIORITY, workers=2, max_running_requests=1)
    stack.fleet.workers[1].healthy = False
    await until(stack, capacity_is(1), timeout=3)
    busy = await hold(stack, "busy", "bulk")
    await until(stack, inflight_is("bulk", 1))
    queued = asyncio.ensure_future(request(stack.listen_port, headers={"x-smg-priority": "bulk"}))
    await until(stack, queued_is("bulk", 1))
    stack.fleet.workers[1].healthy = True
    r = await asyncio.wait_for(queued, 5)  # dispatched by the capacity change, not the release
    assert r.status == 200
    stack.fleet.gates.open("busy")
    await busy.read_head()
    await busy.close()
    await settle(stack)


async def test_sidecar_down_fails_closed_with_503(make_stack: StackFactory) -> None:
    stack = await make_stack(priority_yaml=PRIORITY)
    stack.kill_sidecar()
    r = await request(stack.listen_port)
    assert r.status == 503
    assert not any(w.records for w in stack.fleet.workers)
    stack.start_sidecar()
    await stack.wait_sidecar_ready()
    deadline = time.monotonic() + 5
    while (r := await request(stack.listen_port)).status != 200 and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    assert r.status == 200
