"""A hung coordination server (SIGSTOP): a degraded replica admits what its limit allows.

Two real stacks (an Envoy and a sidecar process each) in front of ONE fleet of fake
workers (capacity 4: two workers of two slots), their sidecars sharing ONE real
valkey-server. Each replica holds one request (held at a worker) when the server is
paused. Each one's degraded limit is then L = min(floor(4 ÷ 2), 1 + floor((4 − 2) ÷ 2))
= 2: one request more. Through A, for two whole heartbeat cycles (so every phase of its
heartbeat is covered, the recovery resync hanging until its call timeout included), a
bulk request that completes at once is admitted every time: bulk's queue size is 0 here,
so a refusal would be a 429 at once, never a wait. Then, A's second slot held, the next
one is beyond L: 429 ``scheduler_queue_full`` on status, ``X-SMG-Error-Code``, body and
metric. The workers' own count (the fleet's tally) never passes capacity meanwhile.

On the code before (a recovery resync in flight admitted nothing locally) this test fails:
A refused 106 of 140 such requests with 429 in one run (a refusal is quick, so many fall
into the resync's hang), every one of them within its limit.
"""

from __future__ import annotations

import time

import pytest

from devtools.fleet import wait_for
from tests.conftest import assert_denied
from tests.test_fleet_e2e import (
    CAPACITY,
    TTL,
    ReplicasFactory,
    fleet_inflight,
    held,
    inflight,
    make_replicas,
    send,
    state_is,
    until,
    until_heard,
)

__all__ = ["make_replicas"]  # the fixture, used by name

pytestmark = pytest.mark.e2e

# No reservations; bulk may not queue (a refusal is a 429 at once); default queues.
NO_BULK_QUEUE = """
classes:
  system: {reserved_floor: 0, reserved_per_slot: 0.0, queue_size: 16, queue_timeout_secs: 20,
           can_preempt: false}
  interactive: {reserved_floor: 0, reserved_per_slot: 0.0, queue_size: 16,
                queue_timeout_secs: 20, can_preempt: false}
  default: {reserved_floor: 0, reserved_per_slot: 0.0, queue_size: 16, queue_timeout_secs: 20}
  bulk: {reserved_floor: 0, reserved_per_slot: 0.0, queue_size: 0, queue_timeout_secs: 20}
"""
REJECTED = 'smg_scheduler_admit_total{class="bulk",outcome="rejected_queue_full"}'


async def test_a_hung_server_leaves_a_degraded_replica_admitting_up_to_its_limit(
        make_replicas: ReplicasFactory) -> None:
    r = await make_replicas(priority_yaml=NO_BULK_QUEUE, service_time=0.01)
    a, b = r.stacks
    for s in (a, b):
        await until(s, lambda m: m.get("smg_sidecar_live_replicas") == 2)
    # Each replica takes its share (2) once the other has heard of it (the share rule).
    await until_heard(r)
    holders = [await held(s, "default", "hold") for s in (a, b)]  # one each
    await wait_for(lambda: r.fleet.tally.running == 2, 5)
    # Each replica's view has the fleet at 2 of 4 (the gauges come from the same reply).
    for s in (a, b):
        await until(s, lambda m: fleet_inflight(m) == 2, timeout=2 * TTL)
    r.server.pause()
    try:
        await until(a, state_is("degraded"), timeout=TTL + 3)
        r.fleet.tally.reset()
        # Two whole heartbeat cycles: an interval (0.9 TTL / 3) plus a call timeout that
        # the hanging resync takes (TTL / 5), twice.
        cycle = 0.9 * TTL / 3 + TTL / 5
        statuses: list[int] = []
        deadline = time.monotonic() + 2 * cycle
        while time.monotonic() < deadline:
            resp = await send(a, "bulk")
            statuses.append(resp.status)
            # Its access-log entry releases it: A holds its one slot again before the next.
            await until(a, lambda m: inflight(m) == 1)
        print(f"hung server: A answered {len(statuses)} bulk requests within its limit: "
              f"{statuses.count(200)} admitted, {statuses.count(429)} refused")
        assert statuses and set(statuses) == {200}, statuses
        m = await a.metrics()
        assert m.get(REJECTED, 0) == 0
        # Beyond the limit: A holds 2 of its 2, the next is refused by the contract.
        extra = await held(a, "default", "hold")
        await until(a, lambda m: inflight(m) == 2)
        refused = await send(a, "bulk")
        assert_denied(refused, 429, "scheduler_queue_full", "2")
        await until(a, lambda m: m.get(REJECTED) == 1)
        assert r.fleet.tally.peak <= CAPACITY
        holders.append(extra)
    finally:
        r.server.resume()
    for s in (a, b):
        await until(s, state_is("ok"), timeout=2 * TTL + 2)
    r.fleet.gates.open("hold")
    for ex in holders:
        await ex.read_head()
        assert ex.status == 200
        await ex.close()
