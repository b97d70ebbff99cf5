"""``tokens.admit_by_kv`` through a real Envoy, in front of a fake vLLM worker with a small
KV cache: 4,000 tokens (``vllm:cache_config_info``: 250 blocks of 16) and 8 slots.

Ground truth is counted by the worker itself, outside the sidecar: each request's
documented estimate (its body's bytes ÷ 4, rounded up, plus its ``max_tokens``) summed
over the completions it is running (``Tally.tokens``). Each request is held at the
worker for a random while, so many overlap.

* Safety: over a burst of requests of mixed sizes (small ones, and large ones of up to
  2,600 tokens), the worker never runs more than the KV capacity's worth at once.
* Liveness: every request is answered 200 within a bounded time, each is admitted as soon
  as there is room (a request arriving at an idle worker starts within a second), and
  small requests still fill all 8 slots (a gate that holds everything, or admits one at a
  time, fails).
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from devtools.fleet import Fleet, RequestRecord, wait_for
from devtools.httpclient import Exchange
from devtools.stack import Stack, StackConfig
from tests.conftest import settle, until

pytestmark = pytest.mark.e2e

KV = 4000
SLOTS = 8
BYTES_PER_TOKEN = 4
PRIORITY = """
tokens: {admit_by_kv: true, bytes_per_token: 4, default_max_tokens: 64}
classes:
  system: {reserved_floor: 0}
  interactive: {reserved_floor: 0, reserved_per_slot: 0.0}
  default: {reserved_per_slot: 0.0, queue_timeout_secs: 120}
"""


def estimate(r: RequestRecord) -> int:
    """The documented estimate, computed here from what the worker received."""
    return math.ceil(r.body_bytes / BYTES_PER_TOKEN) + (r.max_tokens or 64)


def body(tokens: int, max_tokens: int) -> bytes:
    """A chat body whose estimate is ``tokens``: its JSON padded to the bytes needed."""
    doc = {"model": "m", "max_tokens": max_tokens,
           "messages": [{"role": "user", "content": ""}]}
    empty = len(json.dumps(doc).encode())
    want = BYTES_PER_TOKEN * (tokens - max_tokens)
    doc["messages"][0]["content"] = "x" * max(0, want - empty)  # type: ignore[index]
    data = json.dumps(doc).encode()
    assert math.ceil(len(data) / BYTES_PER_TOKEN) + max_tokens == tokens, tokens
    return data


@pytest.fixture
async def stack(tmp_path: Path) -> AsyncIterator[Stack]:
    fleet = Fleet(1, max_running_requests=SLOTS, engine="vllm", service_time=0.0, tokens=1)
    fleet.workers[0].dev_mode = True  # its slots from /server_info, as vLLM's dev mode
    fleet.workers[0].kv_tokens = KV
    fleet.tally.weigh = estimate
    await fleet.start()
    s = Stack(StackConfig(priority_yaml=PRIORITY, workers=1, max_running_requests=SLOTS,
                          completion_tokens=1), workdir=tmp_path, fleet=fleet)
    await s.start()
    try:
        yield s
        await settle(s)
    finally:
        await s.stop()
        await fleet.stop()


async def send(stack: Stack, data: bytes, hold: float, gate: str = "") -> tuple[int, float]:
    """One request held ``hold`` s at the worker (and on ``gate``, if named): its status
    and how long it took."""
    t0 = time.monotonic()
    headers = {"x-fake-service-time": f"{hold:.3f}", "x-smg-tenant": "t"}
    if gate:
        headers["x-fake-gate"] = gate
    ex = await Exchange.send(stack.listen_port, headers=headers, body=data)
    try:
        await asyncio.wait_for(ex.read_head(), 120)
        await asyncio.wait_for(ex.read_body(), 30)
        return ex.status, time.monotonic() - t0
    finally:
        await ex.close()


async def test_the_worker_never_runs_more_than_its_kv_and_small_requests_fill_the_slots(
        stack: Stack) -> None:
    fleet = stack.fleet
    assert isinstance(fleet, Fleet)
    await until(stack, lambda m: m.get("smg_sidecar_kv_capacity_tokens") == KV)
    assert await stack.metric("smg_sidecar_kv_admission", state="gated") == 1

    # Liveness at an idle worker: admitted at once (the hold is 0.1 s; a gate that held
    # it would keep it 120 s, its queue timeout).
    status, took = await send(stack, body(2600, 100), 0.1)
    assert status == 200 and took < 5.0, took

    # Small requests fill every slot: 8 × 300 tokens fit 4,000; all 8 reach the worker
    # while none has ended (each held on a gate).
    small = [asyncio.ensure_future(send(stack, body(300, 50), 0.0, gate="fill"))
             for _ in range(SLOTS)]
    try:
        await wait_for(lambda: fleet.tally.running == SLOTS, 15)
    except TimeoutError:
        raise AssertionError(f"waited for {SLOTS} small requests running together at the "
                             f"worker; {fleet.tally.running} are") from None
    assert fleet.tally.tokens == SLOTS * 300
    fleet.gates.open("fill")
    assert all(s == 200 for s, _ in await asyncio.gather(*small))

    # The burst: mixed sizes at random, each held a random while.
    seed = random.randrange(2**32)
    print(f"seed {seed}")
    rnd = random.Random(seed)
    sizes = [rnd.choice((120, 200, 350, 500, 900, 1400, 2000, 2600)) for _ in range(48)]
    fleet.tally.reset()
    t0 = time.monotonic()
    results = await asyncio.gather(*(send(stack, body(n, rnd.randint(10, 100)),
                                          rnd.uniform(0.05, 0.3)) for n in sizes))
    elapsed = time.monotonic() - t0
    print(f"{len(sizes)} requests, {sum(sizes)} tokens in {elapsed:.1f} s; at the worker: "
          f"peak {fleet.tally.peak_tokens} tokens of {KV}, peak {fleet.tally.peak} running")
    assert all(s == 200 for s, _ in results), [s for s, _ in results]
    assert fleet.tally.peak_tokens <= KV, (fleet.tally.peak_tokens, seed)
    # It was full: more than one request at a time, and the cache near full at its peak
    # (a gate that admits one at a time stays far below it).
    assert fleet.tally.peak >= 3 and fleet.tally.peak_tokens > KV // 2, (
        fleet.tally.peak, fleet.tally.peak_tokens, seed)
    # Bounded: the work took its tokens' worth of passes through the cache, not more than
    # its serial time (every hold end to end) plus a generous margin.
    assert elapsed < 0.3 * len(sizes) + 10, elapsed
    # Every hold ends: the client has its last byte before Envoy's final access-log entry
    # reaches the sidecar, so the last releases may still be on their way.
    await until(stack, lambda m: m.get("smg_sidecar_kv_tokens_held") == 0)
