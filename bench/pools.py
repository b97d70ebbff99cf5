"""Pools: the per-decision cost with 1, 10 and 100 pools (sidecar.pools), and two pools
against one through Envoy.

Two loops, each one admission decision plus one release per iteration, spread
round-robin over the pools:

* **core**: one :class:`~sidecar.scheduler.Scheduler` per pool, every pool full with
  a standing queue; an iteration routes a release by the admission id's pool
  (``pool_of``: what the access log's release does), which dispatches that pool's
  queue head, and a new arrival queues in the pool (what bench.core's "full fleet"
  loop does on one core). Baseline: the same loop on one core without routing.
* **controller**: :class:`~sidecar.pools.Pools` over one
  :class:`~sidecar.admission.AdmissionController` per pool with free slots: pick the
  route's pool, ``await admit()``, ``release(id)``, as Check and the access log do.
  Baseline: one controller called directly.
* **fleet** (``--fleet``): the controller loop in fleet mode, one
  :class:`~sidecar.coordination.controller.FleetController` per pool, each over its pool's
  own ledger in one real valkey-server (devtools.valkey): ``admit()`` is one ``FCALL`` on
  the pool's ledger, the release goes out through the pool's outbox. Baseline: one fleet
  controller without pools. Also the ledger round trips per pair (``FleetLedger.calls``):
  a decision costs one call on one pool's ledger whatever the number of pools.

* **envoy** (``--envoy``): throughput through a real Envoy, two pools against one in the
  same run. Two stacks (devtools.stack: Envoy rendered by envoy/render.py, the sidecar
  with ``--worker-urls``, fake workers in this process, preemption on), started once:
  *one* has no pools and capacity C; *two* has the default pool and pool ``b``
  (``--worker-urls b=URL``, Envoy's ``/b/`` route) with C/2 each. The same load goes to
  both, split evenly over ``/`` and ``/b/`` (*one*'s Envoy has the same ``/b/`` route,
  to its one cluster), from bench.rawload in its own process; the stacks take turns
  (one, two; then two, one; ...). Two regimes: *cpu*, workers with no service time and room for any
  concurrency (closed loop: what Envoy + sidecar can admit on this box's cores), and
  *fleet*, 50 ms service with C = 16 slots and bulk offered open loop at 2x capacity
  (what the fleet serves while every pool is backlogged). Reported: admitted (200)
  requests/s while sending, the ratio two/one per round, CPU per admitted request.

    python -m bench.pools [--seconds 3.0] [--quick]   (best of 3 runs of seconds/3 per point)
    python -m bench.pools --fleet [--seconds 3.0]
    python -m bench.pools --envoy [--seconds 3] [--rounds 6]   (bench/out/pools-envoy.txt)
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from devtools.pooled import pools as make_pools
from sidecar.admission import AdmissionController, AdmissionService
from sidecar.classes import PriorityClass
from sidecar.config import DEFAULT_POOL
from sidecar.pools import id_factory, pool_of
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
    pooled = make_pools(ctls)
    order = itertools.cycle(names)
    ops = 0
    start = time.perf_counter()
    deadline = start + seconds
    while time.perf_counter() < deadline:
        for _ in range(1000):
            n = next(order)
            if routed:
                pool = pooled.for_route(n)
                assert pool is not None
                a = await pool.controller.admit(CLASSES[ops % 3], "t")
                pooled.release(a.admission.id)
            else:
                c = ctls[DEFAULT_POOL]
                a = await c.admit(CLASSES[ops % 3], "t")
                c.release(a.admission.id)
            ops += 1
    rate = ops / (time.perf_counter() - start)
    for c in ctls.values():
        c.close()
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
    pooled = make_pools(ctls)
    calls0 = sum(c.ledger.calls for c in ctls.values())
    order = itertools.cycle(names)
    ops = 0
    start = time.perf_counter()
    deadline = start + seconds
    while time.perf_counter() < deadline:
        for _ in range(100):
            n = next(order)
            ctl: AdmissionService = pooled[n].controller if routed else ctls[DEFAULT_POOL]
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


ENVOY_PRIORITY = """
# Sized for 8-slot pools: nothing reserved (the built-in reservations need >= 256 slots).
classes:
  system: {reserved_floor: 0}
  interactive: {reserved_floor: 0, reserved_per_slot: 0.0}
  default: {reserved_per_slot: 0.0}
  bulk: {queue_size: 32, queue_timeout_secs: 2}
"""
# regime -> (service time, slots per worker with one pool (2 workers), load, headers);
# load: closed-loop connections (cpu) or offered req/s as a multiple of capacity (fleet).
REGIMES: dict[str, tuple[float, int, float, dict[str, str]]] = {
    "cpu": (0.0, 1000, 32, {"x-smg-tenant": "t1"}),
    "fleet": (0.05, 8, 2.0, {"x-smg-priority": "bulk"}),
}
ROUTES = {"a": "/v1/chat/completions", "b": "/b/v1/chat/completions"}
LINES: list[str] = []


def say(line: str) -> None:
    """Print, and keep for bench/out/pools-envoy.txt."""
    print(line, flush=True)
    LINES.append(line)


def envoy_stacks(regime: str) -> dict[str, Any]:
    from devtools.stack import Stack, StackConfig

    service, slots, _, _ = REGIMES[regime]
    common: dict[str, Any] = dict(workers=2, service_time=service, priority_yaml=ENVOY_PRIORITY,
                                  log_level="warning", flush_interval_secs=1.0,
                                  health_interval_secs=1.0, edge_shed=False)
    # one: Envoy routes /b/ as two's does (prefix rewrite, smg-pool: b), to its one
    # cluster; a sidecar without pools does not read smg-pool.
    return {"one": Stack(StackConfig(max_running_requests=slots, envoy_extra_pools=("b",),
                                     **common)),
            "two": Stack(StackConfig(max_running_requests=slots // 2,
                                     pools={"b": (2, slots // 2)}, **common))}


async def envoy_point(stack: Any, regime: str, seconds: float) -> dict[str, float]:
    from bench._util import pct
    from bench.httpload import through_envoy

    service, slots, load, headers = REGIMES[regime]
    closed = regime == "cpu"
    capacity = 2 * slots / service if service else 0.0
    streams = [{"name": name, "path": path, "headers": headers,
                "rate": 0.0 if closed else load * capacity / len(ROUTES)}
               for name, path in ROUTES.items()]
    r = await through_envoy(stack, seconds, streams, concurrency=int(load) if closed else 0,
                            timeout=20, client="bench.rawload")
    wall = r["send_wall"]
    ok = [x for x in r["records"] if x[3] == 200 and x[1] < wall]
    rps = len(ok) / wall
    out = {"rps": rps, "sent": (len(r["records"]) + r["errors"]) / wall,
           "errors": float(r["errors"]), "p50": pct([x[2] for x in ok], 0.5),
           "client": r["client_cpu"], "envoy": r["cpu"][0], "sidecar": r["cpu"][1],
           "share_b": sum(1 for x in ok if x[0] == "b") / max(1, len(ok))}
    out["sidecar_us"] = out["sidecar"] / max(rps, 1.0) * 1e6
    out["envoy_us"] = out["envoy"] / max(rps, 1.0) * 1e6
    return out


async def ready(stacks: dict[str, Any], slots: int, timeout: float = 20.0) -> None:
    """Until each sidecar counts its pools' capacity and Envoy's pool_b cluster is
    healthy (Stack.start waits for the default cluster only)."""
    want = {"one": {"smg_sidecar_capacity": 2 * slots},
            "two": {'smg_sidecar_capacity{pool="default"}': slots,
                    'smg_sidecar_capacity{pool="b"}': slots}}
    deadline = time.monotonic() + timeout
    while True:
        m = {name: await st.metrics() for name, st in stacks.items()}
        healthy = await stacks["two"].envoy_stat("cluster.pool_b.membership_healthy")
        if healthy == 2 and all(m[n].get(k) == v for n, w in want.items()
                                for k, v in w.items()):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"pools not ready: pool_b healthy {healthy}, "
                               f"{ {n: {k: m[n].get(k) for k in w} for n, w in want.items()} }")
        await asyncio.sleep(0.2)


async def envoy_report_async(seconds: float, rounds: int, regimes: list[str]) -> int:
    import statistics

    from bench._util import loadavg

    say("pools through Envoy: two stacks (Envoy + sidecar + fake workers, preemption on), "
        "one with no pools and capacity C,\n  one with the default pool and pool b (/b/) "
        "with C/2 each; the same load, half on / and half on /b/,\n  from bench.rawload; "
        f"the stacks take turns, {seconds:g} s per point, {rounds} rounds per regime; "
        f"load average {loadavg()}")
    for regime in regimes:
        service, slots, load, _ = REGIMES[regime]
        what = (f"closed loop, {load:g} connections" if regime == "cpu"
                else f"open loop at {load:g}x capacity = {load * 2 * slots / service:,.0f} req/s")
        say(f"  {regime}: capacity C = 2 workers x {slots} slots, service {service * 1e3:g} ms; "
            f"two = default 2 x {slots // 2} + b 2 x {slots // 2}; {what}, half to each route")
        stacks = envoy_stacks(regime)
        ratios: list[float] = []
        cost: dict[str, list[float]] = {"one": [], "two": []}
        total: dict[str, list[float]] = {"one": [], "two": []}
        try:
            for st in stacks.values():
                await st.start()
            await ready(stacks, slots)
            for st in stacks.values():  # a first short point on each, not counted
                await envoy_point(st, regime, 1.0)
            for i in range(rounds):
                order = ["one", "two"] if i % 2 == 0 else ["two", "one"]
                res = {name: await envoy_point(stacks[name], regime, seconds) for name in order}
                for name in order:
                    x = res[name]
                    say(f"    round {i + 1} {name}: admitted {x['rps']:7,.0f} req/s (sent "
                        f"{x['sent']:,.0f}/s, {x['share_b']:.0%} of 200s on /b/, "
                        f"{x['errors']:.0f} errors), p50 {x['p50'] * 1e3:.1f} ms; cpu sidecar "
                        f"{x['sidecar']:.0%} = {x['sidecar_us']:.0f} us/admitted, envoy "
                        f"{x['envoy']:.0%} = {x['envoy_us']:.0f} us, client {x['client']:.0%}; "
                        f"load {loadavg()}")
                for name in order:
                    cost[name].append(res[name]["sidecar_us"])
                    total[name].append(res[name]["rps"])
                ratio = res["two"]["rps"] / res["one"]["rps"]
                ratios.append(ratio)
                say(f"    round {i + 1} ratio two/one {ratio:.3f}")
            m0 = await stacks["two"].metrics()
            per_pool: dict[str, float] = {}
            for k, v in m0.items():
                if k.startswith("smg_scheduler_admit_total{") and 'outcome="admitted"' in k:
                    pool = k.split('pool="')[1].split('"')[0]
                    per_pool[pool] = per_pool.get(pool, 0.0) + v
            say("    two: admitted per pool (smg_scheduler_admit_total, whole run): "
                + ", ".join(f"{p} {v:,.0f}" for p, v in sorted(per_pool.items())))
        finally:
            for st in stacks.values():
                await st.stop()
        c1, c2 = statistics.median(cost["one"]), statistics.median(cost["two"])
        say(f"  {regime}: throughput two pools / one pool, median of {rounds} rounds "
            f"{statistics.median(ratios):.3f} (rounds {min(ratios):.3f}-{max(ratios):.3f}, "
            f"all rounds together {sum(total['two']) / sum(total['one']):.3f}); sidecar CPU "
            f"per admitted request, medians: one {c1:.0f} us, two {c2:.0f} us (x{c2 / c1:.2f})")
    return 0


def best(fn: Callable[[int, float, bool], float], pools: int, seconds: float,
         routed: bool = True, runs: int = 3) -> float:
    """The best of ``runs`` (the least disturbed by whatever else the machine runs)."""
    return max(fn(pools, seconds / runs, routed) for _ in range(runs))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--seconds", type=float, default=None,
                   help="3 s per point (--envoy: per point and stack)")
    p.add_argument("--quick", action="store_true", help="0.6 s per point")
    p.add_argument("--fleet", action="store_true",
                   help="the fleet-mode point only (starts a valkey-server)")
    p.add_argument("--envoy", action="store_true",
                   help="two pools vs one through a real Envoy (starts Envoy, sidecars)")
    p.add_argument("--rounds", type=int, default=6, help="--envoy: rounds per regime")
    p.add_argument("--regimes", default="cpu,fleet", help="--envoy: cpu,fleet")
    args = p.parse_args(argv)
    if args.envoy:
        seconds = 2.0 if args.quick else (args.seconds or 3.0)
        rounds = 1 if args.quick else args.rounds
        rc = asyncio.run(envoy_report_async(seconds, rounds, args.regimes.split(",")))
        if not args.quick:
            from bench._util import out_path

            out_path("pools-envoy.txt").write_text("\n".join(LINES) + "\n")
        return rc
    args.seconds = 0.6 if args.quick else (args.seconds or 3.0)
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
