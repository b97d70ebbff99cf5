"""Faults and hostile input through the real Envoy: nothing leaks, nothing is spoofed."""

from __future__ import annotations

import asyncio

import pytest

from devtools.fleet import wait_for
from devtools.httpclient import Exchange, chat_body, request
from devtools.stack import Stack
from tests.conftest import StackFactory, settle, until
from tests.test_e2e import PRIORITY, SECRET, capacity_is, inflight_is, queued_is, token

pytestmark = pytest.mark.e2e


async def bulk_streams(stack: Stack, n: int, gate: str = "never") -> list[Exchange]:
    """Open ``n`` streaming bulk requests and wait for their response headers; each
    holds its slot after the first token until the test opens ``gate``."""
    out = []
    for _ in range(n):
        ex = await Exchange.send(stack.listen_port, body=chat_body(stream=True),
                                 headers={"x-smg-priority": "bulk", "x-fake-stream-gate": gate})
        await ex.read_head()
        out.append(ex)
    return out


async def test_envoy_killed_leases_expire_then_accounting_resumes(
        make_stack: StackFactory) -> None:
    stack = await make_stack(priority_yaml=PRIORITY, flush_interval_secs=0.3, lease_secs=1.2)
    streams = await bulk_streams(stack, 2)  # held open until aborted
    await until(stack, inflight_is("bulk", 2))
    # periodic access-log entries keep the leases alive past their TTL
    await asyncio.sleep(1.8)
    assert (await stack.metric("smg_scheduler_inflight", **{"class": "bulk"})) == 2
    stack.kill_envoy()  # SIGKILL: no final access-log entry will ever come
    for ex in streams:
        await ex.abort()
    await until(stack, inflight_is("bulk", 0), timeout=5)
    assert await stack.metric("smg_sidecar_lease_expired_total", **{"class": "bulk"}) == 2
    stack.start_envoy()
    await stack.wait_envoy_ready()
    for _ in range(3):
        assert (await request(stack.listen_port, headers={"x-smg-priority": "bulk"})).status == 200
    m = await settle(stack)
    assert m['smg_sidecar_released_total{class="bulk",reason="completed"}'] == 3
    assert m['smg_sidecar_released_total{class="bulk",reason="lease_expired"}'] == 2


async def test_sidecar_restart_under_load_converges(make_stack: StackFactory) -> None:
    stack = await make_stack(priority_yaml=PRIORITY, flush_interval_secs=0.3)
    [ex] = await bulk_streams(stack, 1, gate="finish")
    stack.kill_sidecar()
    assert (await request(stack.listen_port)).status == 503  # fail closed
    stack.start_sidecar()
    await stack.wait_sidecar_ready()
    # The new process starts empty and learns of the running stream from Envoy's
    # periodic access-log entries: it holds a real slot, so it counts as in flight.
    await until(stack, lambda m: m.get('smg_sidecar_adopted_total{class="bulk"}') == 1, timeout=5)
    assert await stack.metric("smg_scheduler_inflight", **{"class": "bulk"}) == 1
    stack.fleet.gates.open("finish")
    await asyncio.wait_for(ex.read_body(), 10)  # the old stream finishes undisturbed
    await ex.close()
    assert (await request(stack.listen_port)).status == 200
    m = await settle(stack)  # ...and its final entry releases it: no phantom in-flight
    assert m['smg_sidecar_released_total{class="bulk",reason="completed"}'] == 1


async def test_worker_dies_mid_stream(make_stack: StackFactory) -> None:
    stack = await make_stack(priority_yaml=PRIORITY, workers=2, max_running_requests=2)
    await until(stack, capacity_is(4))
    victim = stack.fleet.workers[0]
    exchanges = await bulk_streams(stack, 2)  # held open until aborted
    await wait_for(lambda: victim.running == 1, 5)
    await victim.stop()  # the worker process dies
    await until(stack, capacity_is(2), timeout=3)
    await until(stack, inflight_is("bulk", 1), timeout=5)
    for ex in exchanges:
        await ex.abort()
    await settle(stack)


FORGE = """
classes:
  default: {reserved_per_slot: 0.0, queue_size: 1, queue_timeout_secs: 10}
  interactive: {reserved_floor: 0, reserved_per_slot: 0.0}
  system: {reserved_floor: 0}
"""


async def test_forged_admission_id_header_releases_nothing(make_stack: StackFactory) -> None:
    stack = await make_stack(priority_yaml=FORGE, workers=1, max_running_requests=1)
    worker = stack.fleet.workers[0]
    holder = await Exchange.send(stack.listen_port, body=chat_body(),
                                 headers={"x-fake-gate": "holder"})
    await wait_for(lambda: worker.running == 1, 5)
    real_id = worker.records[0].admission_id
    assert real_id
    # Denied requests carrying the victim's id (queue fills, then 429s) and an admitted one.
    queued = asyncio.ensure_future(request(stack.listen_port,
                                           headers={"x-smg-admission-id": real_id}))
    await until(stack, queued_is("default", 1))
    for _ in range(5):
        r = await request(stack.listen_port, headers={"x-smg-admission-id": real_id})
        assert r.status == 429
    assert (await stack.metric("smg_scheduler_inflight", **{"class": "default"})) == 1
    stack.fleet.gates.open("holder")
    await holder.read_head()
    await holder.close()
    assert (await asyncio.wait_for(queued, 5)).status == 200
    # the worker saw each request's own id, never the forged one twice
    ids = [rec.admission_id for rec in worker.records]
    assert len(set(ids)) == 2
    m = await settle(stack)
    assert m['smg_sidecar_released_total{class="default",reason="completed"}'] == 2


async def test_hostile_priority_headers_fall_back_to_default(make_stack: StackFactory) -> None:
    stack = await make_stack(priority_yaml=PRIORITY)
    for value in ("x" * 8000, "sYsTeM\u00e9".encode().decode("latin-1"), "\tbulk\t", "",
                  "system;q=1", "sy\u00a0stem".encode().decode("latin-1")):
        r = await request(stack.listen_port, headers={"x-smg-priority": value})
        assert r.status == 200, value
    classes = [rec.priority_class for w in stack.fleet.workers for rec in w.records]
    assert sorted(classes) == ["bulk"] + ["default"] * 5
    m = await settle(stack)
    assert m['smg_scheduler_unknown_priority_value_total{tenant="anonymous"}'] == 4


async def test_many_tenants_are_capped_in_labels(make_stack: StackFactory) -> None:
    stack = await make_stack(priority_yaml=PRIORITY, jwt_secret=SECRET,
                             sidecar_args=["--priority-scheduler-tenant-metric-top-n", "5"])

    async def one(i: int) -> int:
        auth = {"authorization": f"Bearer {token(f'tenant-{i}')}", "x-smg-priority": "urgent"}
        return (await request(stack.listen_port, headers=auth)).status

    for start in range(0, 300, 50):
        statuses = await asyncio.gather(*(one(i) for i in range(start, start + 50)))
        assert all(s in (200, 429) for s in statuses)
    m = await settle(stack)
    tenants = {k for k in m if k.startswith("smg_scheduler_unknown_priority_value_total{")}
    assert len(tenants) == 6  # five named tenants and "other"
    assert 'smg_scheduler_unknown_priority_value_total{tenant="other"}' in tenants
    assert sum(m[k] for k in tenants) == 300


async def test_client_gone_before_first_byte_releases_and_cancels_worker(
        make_stack: StackFactory) -> None:
    stack = await make_stack(priority_yaml=PRIORITY, workers=1, max_running_requests=2)
    worker = stack.fleet.workers[0]
    ex = await Exchange.send(stack.listen_port, body=chat_body(),
                             headers={"x-smg-priority": "bulk", "x-fake-gate": "never"})
    await wait_for(lambda: worker.running == 1, 5)
    await ex.abort()  # admitted, at the worker, no response byte yet
    await wait_for(lambda: worker.records[0].outcome == "cancelled", 5)
    m = await settle(stack)
    assert m['smg_sidecar_released_total{class="bulk",reason="completed"}'] == 1
