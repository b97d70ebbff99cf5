"""Edge shedding (--edge-shed) on and off in one run, under bench.isolation's 10x flood.

Same fleet, classes and open-loop streams as ``bench.isolation`` (2 workers x 4 slots,
50 ms service, capacity 160 req/s; a bulk flood, interactive at 25 % of capacity from a
JWT tenant, a trickle of system). Each round runs a fresh stack with the edge off,
then one with it on (``--edge-shed`` + ``envoy/render.py --edge-shed``), and reports:
Checks Envoy made (its ext_authz stats), requests Envoy answered itself
(``smg_sidecar_edge_shed_total``), the sidecar's and Envoy's CPU while sending,
admitted throughput as a share of capacity, and the end-to-end latency of the
interactive and system requests that still go through Check (item: do they wait
behind bulk in grpc-core's queue?). Ratios are within a round (same box, same minute).

    python -m bench.edge [--seconds 8] [--multiple 10] [--rounds 2]
    python -m bench.edge --bounds 5   # the two time bounds, measured 5 times each

``--bounds``: one slot, a 2-deep bulk queue, 0.5 s requests, 16 closed-loop bulk
clients until the edge sheds at least half. Then (a) the clients stop; from the moment
the queue has room, a bulk request every 50 ms: how long until one is admitted, and
when the last one was still answered by Envoy; (b) with the flood on, the sidecar is
SIGKILLed: how long until Envoy's runtime has the switch back at 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from bench._util import out_path, pct
from bench.isolation import (
    CAPACITY_RPS,
    PRIORITY,
    SECRET,
    SERVICE,
    SLOTS,
    WORKERS,
    hist_p,
    streams,
)
from bench.isolation import run_load as isolation_load
from devtools.httpclient import request
from devtools.stack import Stack, StackConfig, load_renderer


def edge_stack(on: bool) -> Stack:
    cfg = StackConfig(workers=WORKERS, max_running_requests=SLOTS, service_time=SERVICE,
                      priority_yaml=PRIORITY, jwt_secret=SECRET, log_level="warning",
                      flush_interval_secs=5.0, health_interval_secs=1.0,
                      sidecar_args=["--edge-shed"] if on else [])
    stack = Stack(cfg)
    if on:
        def write() -> None:
            c = stack.config
            stack.envoy_config.write_text(load_renderer().render(
                listen_port=stack.listen_port, admin_port=stack.admin_port,
                sidecar_host="127.0.0.1", sidecar_port=stack.grpc_port,
                workers=stack.fleet.addresses, authz_timeout_secs=stack.authz_timeout,
                flush_interval_secs=c.flush_interval_secs,
                health_interval_secs=c.health_interval_secs, preemption=c.preemption,
                jwt_hs256_secret=c.jwt_secret, edge_shed=True))
        stack.write_envoy_config = write  # type: ignore[method-assign]
    return stack


async def checks(stack: Stack) -> int:
    return sum([await stack.envoy_stat(f"http\\.ingress\\.ext_authz\\.{s}")
                for s in ("ok", "denied", "error")])


async def one(on: bool, seconds: float, multiple: float) -> dict[str, Any]:
    stack = edge_stack(on)
    try:
        await stack.start()
        # Unloaded first (10 req/s per class, 2 s): each class's own baseline latency.
        b = await isolation_load(stack, [dict(x, rate=10.0) for x in streams(1.0)], 2.0)
        base = {c: pct([x[2] for x in b["records"] if x[0] == c and x[3] == 200], 0.5)
                for c in ("system", "interactive", "bulk")}
        await asyncio.sleep(1.0)
        c0, m0 = await checks(stack), await stack.metrics()
        r = await isolation_load(stack, streams(multiple), seconds)
        await asyncio.sleep(1.0)
        c1, m1 = await checks(stack), await stack.metrics()
    finally:
        await stack.stop()
    recs = r["records"]
    sent = len(recs) + r["errors"]
    window = [x for x in recs if x[3] == 200 and x[1] < r["send_wall"]]
    out: dict[str, Any] = {
        "edge": on, "sent": sent, "sent_rps": sent / r["send_wall"],
        "checks": c1 - c0,
        "edge_shed": m1.get('smg_sidecar_edge_shed_total{class="bulk"}', 0.0)
        - m0.get('smg_sidecar_edge_shed_total{class="bulk"}', 0.0),
        "cpu_envoy": r["cpu"][0], "cpu_sidecar": r["cpu"][1],
        "admitted_share": len(window) / r["send_wall"] / CAPACITY_RPS,
        "classes": {}}
    for cls in ("system", "interactive", "bulk"):
        rows = [x for x in recs if x[0] == cls]
        ok = [x[2] for x in rows if x[3] == 200]
        out["classes"][cls] = {
            "sent": len(rows), "ok": len(ok), "statuses": dict(Counter(x[3] for x in rows)),
            "p50_ms": pct(ok, 0.5) * 1e3, "p99_ms": pct(ok, 0.99) * 1e3,
            "unloaded_p50_ms": base[cls] * 1e3,
            # The scheduler's own queue wait (bucket bound): the rest of the latency above
            # the unloaded one is intake (grpc-core, the event loop) and Envoy.
            "queue_wait_p99_le_ms": hist_p(m0, m1, cls, 0.99) * 1e3}
    return out


def show(res: dict[str, Any]) -> None:
    print(f"  edge {'on ' if res['edge'] else 'off'}: sent {res['sent_rps']:,.0f} req/s, "
          f"Checks {res['checks']:,} of {res['sent']:,} requests, Envoy answered "
          f"{res['edge_shed']:,.0f}; cpu sidecar {res['cpu_sidecar']:.0%} envoy "
          f"{res['cpu_envoy']:.0%}; admitted {res['admitted_share']:.0%} of capacity")
    for cls, c in res["classes"].items():
        print(f"    {cls:<12} sent {c['sent']:>6} 200 {c['ok']:>6}  p50 {c['p50_ms']:7.1f} ms"
              f"  p99 {c['p99_ms']:7.1f} ms (unloaded p50 {c['unloaded_p50_ms']:5.1f} ms; "
              f"scheduler queue wait p99 <= {c['queue_wait_p99_le_ms']:.0f} ms)  {c['statuses']}")


async def main_async(seconds: float, multiple: float, rounds: int) -> int:
    print(f"edge: {multiple:g}x capacity ({multiple * CAPACITY_RPS:,.0f} req/s offered), "
          f"{seconds:g} s per run, {rounds} round(s) of off/on")
    results = []
    for i in range(rounds):
        print(f" round {i + 1}")
        for on in (False, True):
            res = await one(on, seconds, multiple)
            show(res)
            results.append(res)
    out_path("edge.json").write_text(json.dumps(results, indent=1))
    print("  results: bench/out/edge.json")
    return 0


async def bounds(rounds: int) -> int:
    from tests.test_edge import Flood, edge_stack, wait_share

    room_rows: list[tuple[float, float, float]] = []
    kill_rows: list[float] = []
    for i in range(rounds):
        with tempfile.TemporaryDirectory() as tmp:
            async with edge_stack(Path(tmp)) as stack:
                flood = Flood(stack)
                await wait_share(stack, lambda s: s >= 0.5, timeout=15)
                await flood.stop()
                while (await stack.metric("smg_scheduler_queue_depth", **{"class": "bulk"})
                       ) >= 2:
                    await asyncio.sleep(0.01)
                room = time.monotonic()
                off_task = asyncio.create_task(wait_share(stack, lambda s: s == 0.0, 10))
                last_edge, admitted = room, None
                while admitted is None:
                    now = time.monotonic()  # when it was sent: an admitted one takes 0.5 s
                    r = await request(stack.listen_port, headers={"x-smg-priority": "bulk"},
                                      body=b"{}", timeout=30)
                    if r.status == 429:
                        last_edge = now
                    else:
                        admitted = now
                    await asyncio.sleep(0.05)
                room_rows.append((last_edge - room, admitted - room, await off_task - room))
                await asyncio.sleep(1.0)  # the admitted probe's slot comes back
                flood = Flood(stack)
                await wait_share(stack, lambda s: s >= 0.5, timeout=15)
                stack.kill_sidecar()
                killed = time.monotonic()
                off = await wait_share(stack, lambda s: s == 0.0, timeout=10)
                await flood.stop()
                kill_rows.append(off - killed)
        print(f"  round {i + 1}: room -> last edge 429 sent {room_rows[-1][0]:.3f} s, "
              f"first admitted sent {room_rows[-1][1]:.3f} s, switch 0 in Envoy "
              f"{room_rows[-1][2]:.3f} s; "
              f"SIGKILL -> switch off {kill_rows[-1]:.3f} s")
    print(f"  room -> switch 0 in Envoy: max {max(r[2] for r in room_rows):.3f} s; "
          f"admitted: max {max(r[1] for r in room_rows):.3f} s; last edge 429 max "
          f"{max(r[0] for r in room_rows):.3f} s (bound: 2 x 0.25 s + Envoy's reload); "
          f"SIGKILL -> off: {min(kill_rows):.3f}-{max(kill_rows):.3f} s (TTL 2 s)")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--multiple", type=float, default=10.0)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--bounds", type=int, default=0, metavar="N",
                   help="measure the room and fail-safe bounds N times instead")
    args = p.parse_args(argv)
    if args.bounds:
        return asyncio.run(bounds(args.bounds))
    return asyncio.run(main_async(args.seconds, args.multiple, args.rounds))


if __name__ == "__main__":
    raise SystemExit(main())
