"""Edge shedding with pools, through a real Envoy: each pool's route has a switch of its
own, steered by that pool's queue alone, and its edge sheds are counted for that pool.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from devtools.httpclient import request
from sidecar import edge, responses
from sidecar.classes import PriorityClass
from sidecar.metrics import Metrics
from tests.conftest import StackFactory
from tests.test_edge import PRIORITY, Flood, envoy_share, wait_share

B = PriorityClass.BULK
BULK_FULL = responses.reply(responses.Rejection.QUEUE_FULL, B)
# One slot and a two-deep bulk queue on the flooded pool; two slots on the calm one.
POOLS = {"flooded": (1, 1), "calm": (1, 2)}


@pytest.mark.e2e
async def test_a_flood_on_one_pool_switches_only_that_pools_edge(
        make_stack: StackFactory) -> None:
    stack = await make_stack(priority_yaml=PRIORITY, workers=1, max_running_requests=1,
                             service_time=0.5, pools=POOLS, edge_shed=True)
    flooded, calm = edge.runtime_key(B, "flooded"), edge.runtime_key(B, "calm")
    flood = Flood(stack, path="/flooded/v1/chat/completions")
    try:
        await wait_share(stack, lambda s: s >= 0.5, timeout=10, key=flooded)
        # The other routes' bulk requests still reach their own pools' queues.
        calm_results = await asyncio.gather(*(
            request(stack.listen_port, "/calm/v1/chat/completions",
                    headers={"x-smg-priority": "bulk"}, body=b"{}", timeout=30)
            for _ in range(4)))
        default_result = await request(stack.listen_port, headers={"x-smg-priority": "bulk"},
                                       body=b"{}", timeout=30)
        others = (await envoy_share(stack, calm), await envoy_share(stack, edge.runtime_key(B)))
        still_on = await envoy_share(stack, flooded)
    finally:
        await flood.stop()
    assert [r.status for r in calm_results] == [200] * 4
    assert default_result.status == 200
    assert others == (0.0, 0.0) and still_on >= 0.5
    rejected = [r for r in flood.responses if r[0] == 429]
    assert rejected
    for status, headers, body in rejected:  # Envoy's and the sidecar's alike
        assert status == BULK_FULL.status and body == BULK_FULL.body.encode()
        for k, v in BULK_FULL.headers:
            assert headers.get(k) == v, (k, headers)
    # Counted for the flooded pool only, as the contract counts (the edge's within a flush).
    denied_by_sidecar = await stack.envoy_stat("http\\.ingress\\.ext_authz\\.denied")
    full_key = 'smg_scheduler_admit_total{class="bulk",outcome="rejected_queue_full",pool="%s"}'
    shed_key = 'smg_sidecar_edge_shed_total{class="bulk",pool="%s"}'
    deadline = time.monotonic() + 2 * edge.SHED_LOG_FLUSH_SECS + 2
    while True:
        m = await stack.metrics()
        if m.get(full_key % "flooded") == len(rejected) or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.05)
    assert m[full_key % "flooded"] == len(rejected)
    assert m[shed_key % "flooded"] == len(rejected) - denied_by_sidecar > 0
    for pool in ("calm", "default"):
        assert m.get(full_key % pool, 0.0) == 0.0, pool
        assert m.get(shed_key % pool, 0.0) == 0.0, pool
        assert m[f'smg_sidecar_edge_shed_share{{class="bulk",pool="{pool}"}}'] == 0.0
    assert m['smg_sidecar_edge_shed_share{class="bulk",pool="flooded"}'] > 0.0


def test_a_shed_log_naming_no_pool_of_this_sidecar_is_not_counted() -> None:
    metrics = Metrics(tenant_top_n=4, pools=True)
    lines: list[tuple[str, str, str]] = []
    shed = edge.EdgeShed(metrics, lambda *a: lines.append(a), ("default", "big"))
    shed.shed_counted(B, 3, "big")
    shed.shed_counted(B, 5, "ghost")  # an Envoy rendered with a pool this sidecar lacks
    shed.shed_counted(B, 2)
    r = metrics.registry
    assert r.get_sample_value("smg_sidecar_edge_shed_total",
                              {"class": "bulk", "pool": "big"}) == 3
    assert r.get_sample_value("smg_sidecar_edge_shed_total",
                              {"class": "bulk", "pool": "default"}) == 2
    assert r.get_sample_value("smg_sidecar_edge_shed_total",
                              {"class": "bulk", "pool": "ghost"}) is None
    assert r.get_sample_value("smg_scheduler_admit_total", {
        "class": "bulk", "outcome": "rejected_queue_full", "pool": "big"}) == 3
    assert len(lines) == 5
    # Each pool's switch moves on its own pool's overflow only.
    for _ in range(10):
        shed.controllers["big"].arrived(B)
        shed.controllers["big"].overflowed(B)
    for c in shed.controllers.values():
        c.tick()
    assert shed.controllers["big"].shares()[B] > 0 == shed.controllers["default"].shares()[B]
    assert edge.runtime_key(B, "big") == "smg.edge.shed.pool.big.bulk"
    assert edge.runtime_key(B) == "smg.edge.shed.bulk"
