"""Three whole sidecars admit while the ledger's keys are deleted one after another.

The finding this answers, from outside (three replicas, a real valkey-server, capacity 9):
deleting the ledger's keys one after another, ``pg:{fleet}:adm`` first, ran 10 to 11
requests of 9 for up to 0.65 s. A lost key was a data loss: the ledger froze, every
replica admitted within its degraded share from views of different ages (whose sum may
exceed the capacity by what was admitted since the oldest), and deleting ``P:fleet`` next
ended the freeze early. Now each key comes back from the keys that hold the same facts and
no replica leaves the ledger (tests/test_ledger_keys.py goes through every order on a fake
clock; this is the real thing, in real time, with the real controller).

Three in-process runtimes (``build_runtime``) on one real valkey-server; Envoy is the gRPC
stand-in. Ground truth is counted here: what each replica's Check answered admitted, until
the test's access-log entry ended it. On the old code: 10 of 9 (seed 7), and a ledger that
never came back to what runs (seed 9). Between two deletions at least one ledger call runs
(the server's FCALL count moves). ``KEYS_SEED`` replays the order and the load.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import time
from pathlib import Path

import grpc
import redis.asyncio as redis

from devtools.valkey import ValkeyServer
from tests.grpc_client import admission_id
from tests.ledger_support import client, valkey_server
from tests.test_fleet import FLEET, Replica, eventually, start_replica

__all__ = ["client", "valkey_server"]  # fixtures used by name

CAPACITY = 9
TTL = 2.0
SETTLE = 2 * (0.9 * TTL / 3) + TTL / 5  # the controller's settling window
SEED = int(os.environ.get("KEYS_SEED", "7"))
CLASSES = ("bulk", "default", "interactive", "system")
# How long an admitted request runs, per replica: A's long, B's and C's short, so that the
# replicas' holdings drift from their last views (what the degraded shares of the old
# code's freeze were computed from: 10 of 9 with seed 7 there).
HOLDS = [(0.5, 1.5), (0.02, 0.2), (0.02, 0.2)]


class Truth:
    """What runs: admitted by a Check answer, not yet ended by the test."""

    def __init__(self) -> None:
        self.running: set[str] = set()
        self.peak = 0
        self.over_since: float | None = None
        self.over_longest = 0.0

    def admitted(self, aid: str) -> None:
        self.running.add(aid)
        self.peak = max(self.peak, len(self.running))
        if len(self.running) > CAPACITY and self.over_since is None:
            self.over_since = time.monotonic()

    def ended(self, aid: str) -> None:
        self.running.discard(aid)
        if len(self.running) <= CAPACITY and self.over_since is not None:
            self.over_longest = max(self.over_longest, time.monotonic() - self.over_since)
            self.over_since = None


async def load(rep: Replica, truth: Truth, rng: random.Random, stop: asyncio.Event,
               hold: tuple[float, float]) -> None:
    """Checks of random classes, each held a random short time once admitted; once
    ``stop`` is set, the waiting ones leave (their Checks cancelled) and the rest end."""
    async def one() -> None:
        call = rep.check(rng.choice(CLASSES))
        try:
            resp = await asyncio.wait_for(call, 30)
        except (TimeoutError, grpc.aio.AioRpcError):
            return
        except asyncio.CancelledError:
            call.cancel()
            raise
        if resp.status.code != 0:
            return  # 429 / 503: nothing runs
        aid = admission_id(resp)
        truth.admitted(aid)
        try:
            await asyncio.sleep(rng.uniform(*hold))
        finally:
            truth.ended(aid)
            await rep.end(aid)

    pending: set[asyncio.Task[None]] = set()
    while not stop.is_set():
        while len(pending) < 8:
            pending.add(asyncio.ensure_future(one()))
        _, pending = await asyncio.wait(pending, timeout=0.05,
                                        return_when=asyncio.FIRST_COMPLETED)
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)


async def fcalls(c: redis.Redis) -> int:
    return int((await c.info("commandstats")).get("cmdstat_fcall", {}).get("calls", 0))


async def test_keys_deleted_one_after_another_adm_first_never_past_capacity(
        tmp_path: Path, valkey_server: ValkeyServer, client: redis.Redis) -> None:
    rng = random.Random(SEED)
    reps = [await start_replica(tmp_path, valkey_server.url, name, capacity=CAPACITY, ttl=TTL)
            for name in ("a", "b", "c")]
    truth = Truth()
    stop = asyncio.Event()
    loads = [asyncio.ensure_future(load(r, truth, random.Random(SEED + i), stop, HOLDS[i]))
             for i, r in enumerate(reps)]
    try:
        await eventually(lambda: len(truth.running) == CAPACITY, timeout=10,
                         what="the fleet full")
        prefix = f"pg:{{{FLEET}}}:"
        keys = sorted(k.removeprefix(prefix) for k in await client.keys(prefix + "*"))
        rest = [k for k in keys if k != "adm"]
        rng.shuffle(rest)
        order = ["adm", *rest]
        print(f"seed {SEED} (KEYS_SEED): deleting {order}")
        for key in order:
            calls = await fcalls(client)
            await client.delete(prefix + key)
            await eventually(lambda calls=calls: fcalls_above(client, calls), timeout=5,
                             what="a ledger call after the deletion")
            await asyncio.sleep(rng.uniform(0.0, 0.15))
            assert truth.peak <= CAPACITY, (truth.peak, key)
        # Liveness: within a settling window and two heartbeat intervals, every replica is
        # ok and the ledger counts exactly what runs.
        t0 = time.monotonic()
        await eventually(lambda: all(r.fleet.state == "ok" for r in reps), timeout=SETTLE,
                         what="every replica ok")
        stop.set()
        await asyncio.gather(*loads)
        await eventually(lambda: ledger_counts(client, 0), timeout=SETTLE + 2 * TTL,
                         what="the ledger back to what runs (nothing)")
        print(f"peak {truth.peak}/{CAPACITY}, longest over {truth.over_longest:.2f} s; "
              f"ledger exact again {time.monotonic() - t0:.2f} s after the last deletion; "
              f"states {[r.fleet.state for r in reps]}")
        assert truth.peak <= CAPACITY
        # ... and it admits the whole capacity again at once.
        got = [await asyncio.wait_for(reps[i % 3].check("system"), 5) for i in range(CAPACITY)]
        assert [g.status.code for g in got] == [0] * CAPACITY
        for i, g in enumerate(got):
            await reps[i % 3].end(admission_id(g))
    finally:
        stop.set()
        for t in loads:
            t.cancel()
        with contextlib.suppress(BaseException):
            await asyncio.gather(*loads, return_exceptions=True)
        for r in reps:
            await r.close()


async def fcalls_above(c: redis.Redis, n: int) -> bool:
    return await fcalls(c) > n


async def ledger_counts(c: redis.Redis, n: int) -> bool:
    vals = await c.hvals(f"pg:{{{FLEET}}}:inflight")
    return sum(int(v) for v in vals) == n
