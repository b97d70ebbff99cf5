"""The saturation guard, end to end: real Envoy, the sidecar process, a fake vLLM
worker whose real batch (1) is below what the sidecar was told (8).

Bulk is held at the worker by a gate; once the worker's own FIFO queue holds
bulk, more bulk and then one interactive request arrive. Without the guard the
sidecar admits them all into the worker's queue and the interactive request is
served after every bulk request admitted before it; with the guard the worker
counts for what it runs, the later bulk and the interactive request wait in the
sidecar's class queues, and interactive goes first there.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from devtools.demo import make_token
from devtools.fleet import wait_for
from devtools.httpclient import Exchange
from devtools.stack import Stack, StackConfig
from tests.conftest import settle

pytestmark = pytest.mark.e2e

SECRET = "guard-test-secret"
PRIORITY = """
classes:
  system: {reserved_floor: 0, queue_size: 4, queue_timeout_secs: 20}
  interactive: {reserved_floor: 1, reserved_per_slot: 0.0, queue_size: 4, queue_timeout_secs: 20}
  default: {reserved_per_slot: 0.0, queue_size: 4, queue_timeout_secs: 20}
  bulk: {queue_size: 8, queue_timeout_secs: 20}
tenant_policies:
  "auth:acme": {max_class: interactive}
"""


async def metric_until(stack: Stack, key: str, want: float, timeout: float = 8.0) -> None:
    deadline = time.monotonic() + timeout
    while (m := await stack.metrics()).get(key, 0.0) != want:
        if time.monotonic() > deadline:
            raise AssertionError(f"{key} never reached {want}: {m.get(key)}")
        await asyncio.sleep(0.05)


async def bulk_served_before_interactive(tmp_path: Path, guard: bool) -> int:
    tmp_path.mkdir()
    args = ["--worker-engine", "vllm", "--worker-max-running-requests", "8"]
    stack = Stack(StackConfig(workers=1, max_running_requests=None, service_time=0.01,
                              priority_yaml=PRIORITY, jwt_secret=SECRET, preemption=False,
                              health_interval_secs=0.05,
                              sidecar_args=[*args, "--saturation-guard"] if guard else args),
                  workdir=tmp_path)
    w = stack.fleet.workers[0]
    w.engine, w.batch_limit = "vllm", 1
    exchanges: list[Exchange] = []
    try:
        await stack.start()

        async def bulk() -> None:
            exchanges.append(await Exchange.send(
                stack.listen_port, headers={"x-smg-priority": "bulk", "x-fake-gate": "g"}))

        for _ in range(4):  # 1 running at the worker, 3 in its own queue
            await bulk()
        await wait_for(lambda: w.running == 1 and w.waiting == 3, 8)
        worker_key = f'smg_sidecar_worker_capacity{{engine="vllm",worker="{w.url}"}}'
        await metric_until(stack, worker_key, 1 if guard else 8)
        for _ in range(3):  # more bulk
            await bulk()
        if guard:  # held in the sidecar's bulk queue
            await metric_until(stack, 'smg_scheduler_queue_depth{class="bulk"}', 3)
        else:  # admitted into the worker's FIFO queue
            await wait_for(lambda: w.waiting == 6, 8)
        exchanges.append(await Exchange.send(stack.listen_port, headers={
            "x-smg-priority": "interactive",
            "authorization": f"Bearer {make_token('auth:acme', SECRET)}"}))
        if guard:
            await metric_until(stack, 'smg_scheduler_queue_depth{class="interactive"}', 1)
        else:
            await wait_for(lambda: w.waiting == 7, 8)
        stack.fleet.gates.open("g")
        for ex in exchanges:
            await ex.read_head()
            await ex.read_body()
            assert ex.status == 200, (ex.status, ex.headers, await ex.read_body())
        await settle(stack)
        order = sorted(w.records, key=lambda r: r.service_started_at or 0.0)
        classes = [r.priority_class for r in order]
        assert classes.count("interactive") == 1 and len(classes) == 8
        return classes.index("interactive")
    finally:
        for ex in exchanges:
            await ex.close()
        await stack.stop()


async def test_guard_keeps_interactive_out_of_the_engines_fifo(tmp_path: Path) -> None:
    without = await bulk_served_before_interactive(tmp_path / "off", guard=False)
    with_guard = await bulk_served_before_interactive(tmp_path / "on", guard=True)
    assert without == 7  # behind every bulk request admitted before it
    # With the guard, only the bulk already in the worker's queue goes first (4; 5 if
    # a later bulk request overtakes it between Envoy and the worker as both are admitted).
    assert with_guard in (4, 5)
