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

    python -m bench.pools [--seconds 3.0] [--quick]   (best of 3 runs of seconds/3 per point)
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace

from sidecar.admission import AdmissionController
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


def best(fn: Callable[[int, float, bool], float], pools: int, seconds: float,
         routed: bool = True, runs: int = 3) -> float:
    """The best of ``runs`` (the least disturbed by whatever else the machine runs)."""
    return max(fn(pools, seconds / runs, routed) for _ in range(runs))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--quick", action="store_true", help="0.6 s per point")
    args = p.parse_args(argv)
    if args.quick:
        args.seconds = 0.6
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
