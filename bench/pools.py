"""Pools: the per-decision cost with 1, 10 and 100 pools (sidecar.pools).

Two loops, each one admission decision plus one release per iteration, spread
round-robin over the pools:

* **core**: one :class:`~sidecar.scheduler.Scheduler` per pool, every pool full with
  a standing queue; an iteration routes a release by the admission id's pool
  (``pool_of``: what the access log's release does), which dispatches that pool's
  queue head, and a new arrival queues in the pool (what bench.core's "full fleet"
  loop does on one core). Baseline: the same loop on one core without routing.
* **controller**: :class:`~sidecar.pools.PooledAdmission` over one
  :class:`~sidecar.admission.AdmissionController` per pool with free slots: pick the
  route's pool, ``await admit()``, ``release(id)``, as Check and the access log do.
  Baseline: one controller called directly.
* **fleet** (``--fleet``): the controller loop in fleet mode, one
  :class:`~sidecar.coordination.controller.FleetController` per pool, each over its pool's
  own ledger in one real valkey-server (devtools.valkey): ``admit()`` is one ``FCALL`` on
  the pool's ledger, the release goes out through the pool's outbox. Baseline: one fleet
  controller without pools. Also the ledger round trips per pair (``FleetLedger.calls``):
  a decision costs one call on one pool's ledger whatever the number of pools.

    python -m bench.pools [--seconds 3.0] [--quick]   (best of 3 runs of seconds/3 per point)
    python -m bench.pools --fleet [--seconds 3.0]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace

from sidecar.admission import AdmissionController, AdmissionService
from sidecar.classes import PriorityClass
from sidecar.config import DEFAULT_POOL
from sidecar.pools import PooledAdmission, id_factory, pool_of
from sidecar.scheduler import BUILTIN_CLASSES, Admitted, Scheduler

CAPACITY = 64  # per pool
DEPTH = 100  # waiters standing in each pool's queues
CLASSES = (PriorityClass.BULK, PriorityClass.DEFAULT, PriorityClass.INTERACTIVE)
CFG = {c: replace(v, reserved_floor=0, reserved_per_slot=0.0, queue_size=200_000,
                  queue_timeout_secs=1e9, starvation_threshold_secs=1e9)
       for c, v in BUILTIN_CLASSES.items()}


def _names(n: int) -> list[str]:
    return [DEFAULT_POOL] + [f"pool{i}" for i in range(1, n)]


def measure_core(pools: int, seconds: float, routed: bool = True) -> float:
    """Pairs per second: a routed release (dispatching a queue head) and an arrival."""
    names = _names(pools)
    cores = {n: Scheduler(CFG, CAPACITY, time.monotonic) for n in names}
    inflight = {n: deque[str]() for n in names}
    new_id = {n: id_factory(n) for n in names}
    for n in names:
        s = cores[n]
        for i in range(CAPACITY + DEPTH):
            rid = new_id[n]()
            if isinstance(s.arrive(rid, CLASSES[i % 3], "t"), Admitted):
                inflight[n].append(rid)
        s.take_events()
    # Which ids were admitted by dispatch: the core reports them as events.
    order = itertools.cycle(names)
    ops = 0
    start = time.perf_counter()
    deadline = start + seconds
    while time.perf_counter() < deadline:
        for _ in range(1000):
            n = next(order)
            rid = inflight[n].popleft()
            s = cores[pool_of(rid)] if routed else cores[n]
            s.release(rid)
            s.arrive(new_id[n](), CLASSES[ops % 3], "t")
            for e in s.take_events():
                if isinstance(e, Admitted):
                    inflight[n].append(e.admission.id)
            ops += 1
    return ops / (time.perf_counter() - start)


async def _controller_loop(pools: int, seconds: float, routed: bool) -> float:
    names = _names(pools)
    ctls = {n: AdmissionController(Scheduler(CFG, CAPACITY, time.monotonic), lease_secs=60.0,
                                   id_factory=id_factory(n)) for n in names}
    pooled = PooledAdmission(ctls)
    order = itertools.cycle(names)
    ops = 0
    start = time.perf_counter()
    deadline = start + seconds
    while time.perf_counter() < deadline:
        for _ in range(1000):
            n = next(order)
            if routed:
                ctl = pooled.get(n)
                assert ctl is not None
                a = await ctl.admit(CLASSES[ops % 3], "t")
                pooled.release(a.admission.id)
            else:
                c = ctls[DEFAULT_POOL]
                a = await c.admit(CLASSES[ops % 3], "t")
                c.release(a.admission.id)
            ops += 1
    rate = ops / (time.perf_counter() - start)
    pooled.close()
    return rate


def measure_controller(pools: int, seconds: float, routed: bool = True) -> float:
    return asyncio.run(_controller_loop(pools, seconds, routed))


async def _fleet_loop(pools: int, seconds: float, routed: bool, url: str
                      ) -> tuple[float, float]:
    import redis.asyncio as redis

    from sidecar.coordination.controller import FleetController

    flush = redis.from_url(url)
    await flush.flushall()  # every point on empty ledgers
    await flush.aclose()
    names = _names(pools) if routed else [DEFAULT_POOL]
    ctls = {n: await FleetController.connect(
        url, fleet="bench", replica="r1", ttl=30.0, classes=CFG, capacity=CAPACITY,
        pool=n if routed else None, id_factory=id_factory(n)) for n in names}
    for c in ctls.values():
        c.start(heartbeat=False)  # no heartbeat: only what the requests cost is counted
    pooled = PooledAdmission(ctls)
    calls0 = sum(c.ledger.calls for c in ctls.values())
    order = itertools.cycle(names)
    ops = 0
    start = time.perf_counter()
    deadline = start + seconds
    while time.perf_counter() < deadline:
        for _ in range(100):
            n = next(order)
            ctl: AdmissionService | None = pooled.get(n) if routed else ctls[DEFAULT_POOL]
            assert ctl is not None
            a = await ctl.admit(CLASSES[ops % 3], "t")
            (pooled if routed else ctl).release(a.admission.id)
            ops += 1
    rate = ops / (time.perf_counter() - start)
    for _ in range(1000):  # the last releases leave through the outboxes
        if all(c.lease_count == 0 and not c._outbox for c in ctls.values()):
            break
        await asyncio.sleep(0.001)
    calls = sum(c.ledger.calls for c in ctls.values()) - calls0
    for c in ctls.values():
        await c.aclose()
    return rate, calls / ops


def measure_fleet(pools: int, seconds: float, routed: bool = True,
                  url: str = "") -> tuple[float, float]:
    return asyncio.run(_fleet_loop(pools, seconds, routed, url))


def fleet_report(seconds: float) -> None:
    from pathlib import Path
    from tempfile import mkdtemp

    from devtools.valkey import ValkeyServer
    from sidecar import logs

    logs.configure("json", "warning")  # not a registration line per pool and point
    server = ValkeyServer(Path(mkdtemp(prefix="bench-pools-")))
    server.start()
    try:
        print("fleet: admit() + release(id) through the ledger (one real valkey-server on "
              "loopback), sequential, round-robin over the pools")
        points = [("no pools (one fleet controller)", 1, False), ("pools=1", 1, True),
                  ("pools=2", 2, True), ("pools=10", 10, True)]
        # The points take turns, 5 rounds (the machine's drift hits them all alike);
        # each point's best round counts.
        rounds = [[measure_fleet(n, seconds / 5, routed, server.url)
                   for _, n, routed in points] for _ in range(5)]
        base = 0.0
        for i, (title, _, _) in enumerate(points):
            rate, calls = max(r[i] for r in rounds)
            base = base or rate
            print(f"    {title:<33}{1e6 / rate:7.1f} us/pair  cost x{base / rate:.2f}  "
                  f"ledger calls/pair {calls:.2f}")
    finally:
        server.stop()


def best(fn: Callable[[int, float, bool], float], pools: int, seconds: float,
         routed: bool = True, runs: int = 3) -> float:
    """The best of ``runs`` (the least disturbed by whatever else the machine runs)."""
    return max(fn(pools, seconds / runs, routed) for _ in range(runs))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--quick", action="store_true", help="0.6 s per point")
    p.add_argument("--fleet", action="store_true",
                   help="the fleet-mode point only (starts a valkey-server)")
    args = p.parse_args(argv)
    if args.quick:
        args.seconds = 0.6
    if args.fleet:
        fleet_report(args.seconds)
        return 0
    print("pools: one decision + one release per iteration, round-robin over the pools, "
          "single-threaded")
    for title, fn in (("core (full pools, release dispatches a queue head, arrival queues)",
                       measure_core),
                      ("controller (free slots: admit() + release(id))", measure_controller)):
        base = best(fn, 1, args.seconds, False)
        print(f"  {title}")
        print(f"    no pools (one core, no routing)  {1e6 / base:6.2f} us/pair")
        for n in (1, 10, 100):
            ops = best(fn, n, args.seconds)
            print(f"    pools={n:<4}                        {1e6 / ops:6.2f} us/pair  "
                  f"cost x{base / ops:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
