"""Pools through a real Envoy: each route's pool admits on its own workers' capacity.

Envoy routes /big/ and /small/ to the pools' clusters with ``smg-pool`` in ext_authz's
context extensions, every other path to the default pool's workers, and /ghost/ to a
pool the sidecar does not have.
"""

from __future__ import annotations

import asyncio

import pytest

from devtools.fleet import wait_for
from devtools.httpclient import Exchange, request
from tests.conftest import StackFactory, assert_denied, assert_preempted, settle, until

pytestmark = pytest.mark.e2e

PRIORITY = """
classes:
  system: {reserved_floor: 0}
  interactive: {reserved_floor: 0, reserved_per_slot: 0.0}
  default: {reserved_per_slot: 0.0}
  bulk: {queue_size: 64, queue_timeout_secs: 20}
"""
# Per worker: the default pool 2 x 1 = 2, big 1 x 1 = 1, small 2 x 3 = 6 slots.
POOLS = {"big": (1, 1), "small": (2, 3)}
CAPACITY = {"default": 2, "big": 1, "small": 6}
# Each pool on an engine of its own, its capacity read by that engine's rule.
ENGINES = {"default": "generic", "big": "sglang", "small": "vllm"}
POOL_WORKERS = {"big": {"engine": "sglang"}, "small": {"engine": "vllm", "dev_mode": True}}


async def test_each_pool_admits_on_its_own_capacity(make_stack: StackFactory) -> None:
    stack = await make_stack(priority_yaml=PRIORITY, max_running_requests=1, service_time=0.15,
                             pools=POOLS, pool_worker_kwargs=POOL_WORKERS,
                             envoy_extra_pools=("ghost",))
    fleets = {"default": stack.fleet, **stack.pool_fleets}
    paths = {"default": "/v1/chat/completions", "big": "/big/v1/chat/completions",
             "small": "/small/v1/chat/completions"}
    n = 14
    results = await asyncio.gather(*(
        request(stack.listen_port, paths[pool], headers={"x-smg-priority": "bulk"},
                timeout=30)
        for pool in paths for _ in range(n)))
    assert [r.status for r in results] == [200] * (n * len(paths))
    for pool, fleet in fleets.items():
        workers = fleet.workers  # type: ignore[union-attr]
        records = [rec for w in workers for rec in w.records]
        assert len(records) == n, pool  # every request reached its own pool's workers
        # Never above the pool's own capacity, and the other pools' load took none of it.
        # (Per worker it is Envoy's balancing that decides, so the pool's sum is checked.)
        assert fleet.tally.peak == CAPACITY[pool], pool  # type: ignore[union-attr]
        ids = {rec.admission_id for rec in records}
        assert all(i is not None and (i.startswith(f"{pool}.") if pool != "default"
                                      else len(i) == 32) for i in ids), ids

    # A route naming a pool the sidecar lacks: the documented 429, counted, no worker.
    before = sum(len(w.records) for w in stack.fleet.workers)
    r = await request(stack.listen_port, "/ghost/v1/chat/completions",
                      headers={"x-smg-priority": "bulk"})
    assert_denied(r, 429, "scheduler_queue_full", "2")
    assert "pool" in r.json()["error"]["message"]
    assert sum(len(w.records) for w in stack.fleet.workers) == before
    m = await settle(stack)
    assert m['smg_sidecar_unknown_pool_total{class="bulk"}'] == 1
    # Per pool, under the pool label (summed over pools: today's series).
    for pool, cap in CAPACITY.items():
        assert m[f'smg_scheduler_admit_total{{class="bulk",outcome="admitted",pool="{pool}"}}'] == n
        assert m[f'smg_sidecar_capacity{{pool="{pool}"}}'] == cap
        assert m[f'smg_sidecar_healthy_workers{{pool="{pool}"}}'] == len(fleets[pool].workers)
        for w in fleets[pool].workers:  # type: ignore[union-attr]
            assert m[f'smg_sidecar_worker_capacity{{engine="{ENGINES[pool]}",'
                     f'worker="{w.url}"}}'] == cap // len(fleets[pool].workers), pool
    assert all("pool=" in k for k in m if k.startswith("smg_scheduler_admit_total{"))


async def test_the_default_pool_may_take_its_workers_from_envoys_cluster(
        make_stack: StackFactory) -> None:
    # --envoy-admin-url: the default pool counts the `workers` cluster's hosts only, not
    # the pools' clusters, whose workers the named pools probe themselves.
    stack = await make_stack(priority_yaml=PRIORITY, max_running_requests=1, service_time=0.15,
                             pools={"big": (1, 3)}, capacity_from_envoy=True)
    m = await until(stack, lambda m: m.get('smg_sidecar_capacity{pool="default"}') == 2
                    and m.get('smg_sidecar_capacity{pool="big"}') == 3, timeout=10)
    assert m['smg_sidecar_healthy_workers{pool="default"}'] == 2
    results = await asyncio.gather(*(
        request(stack.listen_port, path, headers={"x-smg-priority": "bulk"}, timeout=30)
        for path in ("/v1/chat/completions", "/big/v1/chat/completions") for _ in range(8)))
    assert [r.status for r in results] == [200] * 16
    assert stack.fleet.tally.peak == 2  # type: ignore[union-attr]
    assert stack.pool_fleets["big"].tally.peak == 3
    await settle(stack)


async def test_preemption_through_envoy_stays_inside_the_pool(make_stack: StackFactory) -> None:
    # big: 1 slot; the default pool: 1 slot. A bulk request held before its first byte in
    # each; a system request on big's route preempts big's, never the default pool's.
    stack = await make_stack(priority_yaml=PRIORITY, workers=1, max_running_requests=1,
                             pools={"big": (1, 1)},  # anonymous may ask for system here:
                             sidecar_args=["--priority-scheduler-default-max-class", "system"])
    default_victim = await Exchange.send(
        stack.listen_port, headers={"x-smg-priority": "bulk", "x-fake-gate": "d"})
    big_victim = await Exchange.send(
        stack.listen_port, "/big/v1/chat/completions",
        headers={"x-smg-priority": "bulk", "x-fake-gate": "never"})
    big_worker = stack.pool_fleets["big"].workers[0]
    await wait_for(lambda: stack.fleet.workers[0].running == 1 and big_worker.running == 1, 5)
    try:
        r = await request(stack.listen_port, "/big/v1/chat/completions",
                          headers={"x-smg-priority": "system"})
        assert r.status == 200
        await assert_preempted(big_victim)
        assert stack.fleet.workers[0].running == 1  # the default pool's victim-to-be runs on
        stack.fleet.gates.open("d")
        await asyncio.wait_for(default_victim.read_head(), 10)
        assert default_victim.status == 200
        await asyncio.wait_for(default_victim.read_body(), 10)
    finally:
        await big_victim.close()
        await default_victim.close()
    m = await settle(stack)
    key = 'smg_scheduler_preemption_total{by_class="system",pool="big",victim_class="bulk"}'
    assert m[key] == 1
    assert not any("preemption_total" in k and 'pool="default"' in k for k in m)
