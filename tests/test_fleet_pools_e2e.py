"""Model pools in a fleet through real Envoys: two replicas, two pools, one valkey-server.

Two Envoys and two sidecars (``devtools.stack.Replicas``) in front of one set of fake
workers per pool, shared by both replicas; the sidecars share one ledger server, a ledger
namespace per pool. Each pool's ``tally`` counts what its workers really run at once,
whichever replica admitted it: the ground truth compared with the pool's capacity.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from devtools.httpclient import request
from devtools.stack import Replicas, StackConfig
from tests.conftest import assert_denied, settle

pytestmark = pytest.mark.e2e

PRIORITY = """
classes:
  system: {reserved_floor: 0}
  interactive: {reserved_floor: 0, reserved_per_slot: 0.0}
  default: {reserved_per_slot: 0.0}
  bulk: {queue_size: 64, queue_timeout_secs: 20}
"""
# The default pool: 1 worker x 2 slots; big: 1 worker x 1 slot.
CAPACITY = {"default": 2, "big": 1}


@pytest.fixture
async def replicas(tmp_path: Path) -> AsyncIterator[Replicas]:
    r = Replicas(StackConfig(priority_yaml=PRIORITY, workers=1, max_running_requests=2,
                             service_time=0.1, pools={"big": (1, 1)},
                             envoy_extra_pools=("ghost",)),
                 workdir=tmp_path, ttl_secs=2.0)
    await r.start()
    try:
        yield r
    finally:
        await r.stop()


async def test_each_pool_stays_within_its_own_capacity_across_the_fleet(
        replicas: Replicas) -> None:
    a, b = replicas.stacks
    paths = {"default": "/v1/chat/completions", "big": "/big/v1/chat/completions"}
    n = 10  # per pool and replica
    results = await asyncio.gather(*(
        request(stack.listen_port, paths[pool], headers={"x-smg-priority": "bulk"},
                timeout=30)
        for pool in paths for stack in (a, b) for _ in range(n)))
    assert [r.status for r in results] == [200] * (2 * n * len(paths))
    fleets = {"default": replicas.fleet, **replicas.pool_fleets}
    for pool, fleet in fleets.items():
        records = [rec for w in fleet.workers for rec in w.records]  # type: ignore[union-attr]
        assert len(records) == 2 * n, pool  # every request reached its own pool's workers
        # Both replicas together never ran more than the pool's own capacity, and the
        # other pool's load took none of it.
        assert fleet.tally.peak == CAPACITY[pool], pool  # type: ignore[union-attr]

    # A route naming a pool the sidecars lack: the documented 429, counted.
    r = await request(a.listen_port, "/ghost/v1/chat/completions",
                      headers={"x-smg-priority": "bulk"})
    assert_denied(r, 429, "scheduler_queue_full", "2")
    ms = [await settle(s) for s in (a, b)]
    assert ms[0]['smg_sidecar_unknown_pool_total{class="bulk"}'] == 1
    for pool, cap in CAPACITY.items():
        admitted = sum(m[f'smg_scheduler_admit_total{{class="bulk",outcome="admitted",'
                         f'pool="{pool}"}}'] for m in ms)
        assert admitted == 2 * n, pool
        for m in ms:
            assert m[f'smg_sidecar_live_replicas{{pool="{pool}"}}'] == 2
            assert m[f'smg_sidecar_coordination_state{{pool="{pool}",state="ok"}}'] == 1
            assert m[f'smg_sidecar_capacity{{pool="{pool}"}}'] == cap
