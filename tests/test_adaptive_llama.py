"""--adaptive-capacity on a real llama.cpp server: the limit finds the engine's slots.

The engine has 4 slots (``--parallel 4``). Read as an engine that reports no cap
(``--worker-engine generic``: the default of 64 per worker), the limit starts wrong, at
64 or at 1, and must settle near 4 while a closed-loop load keeps more requests in flight
than the engine can run; then hold through a step of the load down and back up. Read as
llama.cpp (its cap of 4 reported), it never exceeds 4. Ground truth is the engine's own:
``/slots`` and its ``requests_deferred`` gauge (requests it holds without a slot).
"""

from __future__ import annotations

import asyncio
import time

import pytest

from devtools.httpclient import request
from devtools.stack import Stack
from tests.test_llama_real import LlamaStackFactory, completion
from tests.test_llama_real import llama_stack as llama_stack  # the fixture
from tests.test_llama_real import model as model  # the fixture

pytestmark = [pytest.mark.e2e, pytest.mark.llama]

SLOTS = 4
# Long enough that waiting for a slot (a part of a generation) stands out from running
# beside others in a batch (a few decode steps).
TOKENS = 48
# Room in the default class's queue for every client: the load is never refused.
QUEUES = """
classes:
  system: {reserved_floor: 0}
  interactive: {reserved_floor: 0, reserved_per_slot: 0.0}
  default: {reserved_per_slot: 0.0, queue_size: 64, queue_timeout_secs: 60}
"""


async def load(stack: Stack, concurrency: int, seconds: float) -> int:
    """``concurrency`` clients, each sending its next request when the last one ends."""
    done = 0
    stop = time.monotonic() + seconds

    async def client() -> None:
        nonlocal done
        while time.monotonic() < stop:
            r = await request(stack.listen_port, body=completion(TOKENS, stream=True),
                              headers={"x-smg-priority": "default"}, timeout=60)
            assert r.status == 200, (r.status, r.body[:200])
            done += 1

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return done


async def watch(stack: Stack, out: list[tuple[float, float, float | None]]) -> None:
    """Every 0.5 s until cancelled: (time, the limit, the engine's deferred requests; None
    when the busy engine did not answer its /metrics in time)."""
    engine = stack.fleet.workers[0]
    t0 = time.monotonic()
    while True:
        limit = await stack.metric("smg_sidecar_adaptive_limit")
        deferred: float | None
        try:
            deferred = await engine.metric("llamacpp:requests_deferred")  # type: ignore[attr-defined]
        except (TimeoutError, OSError):
            deferred = None
        out.append((time.monotonic() - t0, limit, deferred))
        await asyncio.sleep(0.5)


@pytest.mark.parametrize("start", [64, 1])
async def test_the_limit_settles_near_the_engines_slots_and_holds_a_step_in_load(
        llama_stack: LlamaStackFactory, start: int) -> None:
    stack = await llama_stack(parallel=SLOTS, engine="generic", priority_yaml=QUEUES,
                              sidecar_args=[
        "--adaptive-capacity", "--adaptive-capacity-start", str(start)])
    assert await stack.metric("smg_sidecar_capacity") == start  # 64 read: no cap reported
    seen: list[tuple[float, float, float | None]] = []
    watcher = asyncio.ensure_future(watch(stack, seen))
    try:
        await load(stack, 3 * SLOTS, 30.0)  # more than the engine runs
        await load(stack, 2, 8.0)  # a step down: below the limit
        await load(stack, 3 * SLOTS, 15.0)  # and back up
    finally:
        watcher.cancel()
        (failed,) = await asyncio.gather(watcher, return_exceptions=True)
    assert isinstance(failed, asyncio.CancelledError), failed  # it watched to the end
    limits = [(t, v) for t, v, _ in seen]
    print(f"from {start}: " + " ".join(f"{t:.0f}:{v:.0f}" for t, v in limits))
    settled = next((t for t, v in limits if SLOTS - 1 <= v <= SLOTS + 1), None)
    assert settled is not None and settled <= 20.0, f"not near {SLOTS} slots within 20 s"
    after = sorted(v for t, v in limits if t >= settled + 1.0)
    # It neither runs away nor collapses: from there on, through the step in load, within
    # two of the slots (a real engine's times are noisy, more so on a loaded machine), and
    # within one of them four times in five.
    assert all(SLOTS - 2 <= v <= SLOTS + 2 for v in after), after
    assert sum(SLOTS - 1 <= v <= SLOTS + 1 for v in after) >= 0.8 * len(after), after
    m = await stack.metrics()
    assert m.get('smg_sidecar_adaptive_limit_changes_total{reason="engine_queueing"}', 0) \
        + m.get('smg_sidecar_adaptive_limit_changes_total{reason="probe"}', 0) >= 1


async def test_a_reported_cap_is_never_exceeded(llama_stack: LlamaStackFactory) -> None:
    stack = await llama_stack(parallel=SLOTS, engine="llamacpp", priority_yaml=QUEUES,
                              sidecar_args=[
        "--adaptive-capacity", "--adaptive-capacity-start", "64"])
    assert await stack.metric("smg_sidecar_capacity") == SLOTS  # the engine's own cap
    seen: list[tuple[float, float, float | None]] = []
    watcher = asyncio.ensure_future(watch(stack, seen))
    try:
        await load(stack, 3 * SLOTS, 15.0)
    finally:
        watcher.cancel()
        (failed,) = await asyncio.gather(watcher, return_exceptions=True)
    assert isinstance(failed, asyncio.CancelledError), failed
    assert seen and max(v for _, v, _ in seen) <= SLOTS
    # The engine never held a request it had no slot for.
    deferred = [d for _, _, d in seen if d is not None]
    assert len(deferred) >= len(seen) // 2 and max(deferred) == 0
    r = await request(stack.listen_port, body=completion(2))
    assert r.status == 200
