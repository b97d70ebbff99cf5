"""Edge shedding (--edge-shed) off and on in one run: the flood part of ``make bench``.

The fleet and load the issue's flood goals are stated for: 2 fake workers x 4 slots,
0.5 s service time (capacity 16 req/s), bulk open loop at 10x and 100x capacity
(anonymous, ``x-smg-priority: bulk``), interactive at 25 % of capacity from a JWT
tenant (ceiling interactive), system 1 req/s (JWT tenant, ceiling system), both at
exponential gaps (``--arrivals paced``: evenly). The classes are ``bench.isolation``'s
without standing reservations for system and interactive, which preempt bulk instead
(``--classes isolation``: with them; their idle reserved slots are capacity the contract
keeps free, so they count against admitted throughput). ``--service 0.05`` is
isolation's stress case (capacity
160 req/s, where every millisecond of the release -> dispatch loop costs 2 % of a slot).
Per load, a fresh stack with the edge off, then one with it on (``--edge-shed`` +
``envoy/render.py --edge-shed``); each first runs system + interactive alone (the
unloaded baseline of their latency), then adds the flood. Reported: Checks Envoy made
(its ext_authz stats), requests Envoy answered itself (``smg_sidecar_edge_shed_total``),
CPU of sidecar, Envoy and the load client while sending, admitted throughput as a share
of capacity (the slot-seconds the workers served within the window, from the sidecar's
slot trace: ``bench.slots``, which also says where the rest went), each class's
end-to-end p99 against its unloaded p99, and the goals. Ratios are within a run (same
box, same minute); the load average is printed with each run.

The load client is ``bench.rawload`` (asyncio protocols, no aiohttp): at 1,600 req/s
aiohttp took 45-70 % of a core of the 2-core box and starved Envoy and the sidecar
(``--client httpload`` runs it again for comparison).

    python -m bench.edge [--seconds 10] [--multiples 10,100] [--rounds 1] [--service 0.5]
                         [--classes preempt|isolation] [--arrivals poisson|paced]
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

from bench import slots
from bench._util import loadavg, out_path, pct
from bench.httpload import through_envoy
from bench.isolation import PRIORITY, SECRET, SLOTS, WORKERS, hist_p, reserved_of
from bench.isolation import streams as isolation_streams
from devtools.httpclient import request
from devtools.stack import Stack, StackConfig
from sidecar.slottrace import ENV as SLOT_TRACE_ENV

SERVICE = 0.5  # the issue's flood part; --service 0.05 is bench.isolation's stress case
SYSTEM_RPS = 1.0
CLASSES = ("system", "interactive", "bulk")
# The goals with the edge on, at both loads.
GOAL_ADMITTED = 0.90
GOAL_P99_RATIO = 1.5
GOAL_SIDECAR_CPU = 0.30


def capacity_rps(service: float) -> float:
    return WORKERS * SLOTS / service


def streams(multiple: float, service: float, poisson: bool = False
            ) -> list[dict[str, object]]:
    """isolation's three streams (same headers) at this fleet's rates; ``poisson``:
    system and interactive arrive at exponential gaps instead of evenly paced."""
    cap = capacity_rps(service)
    rates = {"system": SYSTEM_RPS, "interactive": 0.25 * cap,
             "bulk": max(0.0, multiple * cap - SYSTEM_RPS - 0.25 * cap)}
    return [dict(s, rate=rates[str(s["name"])], poisson=poisson and s["name"] != "bulk")
            for s in isolation_streams(1.0) if rates[str(s["name"])] > 0]


# --classes preempt: isolation's classes without standing reservations for system and
# interactive; they take a slot by preempting bulk (the fake workers answer at the end,
# so a victim has always not yet sent its first byte).
PREEMPT_PRIORITY = (PRIORITY.replace("system: {reserved_floor: 1,", "system: {reserved_floor: 0,")
                    .replace("interactive: {reserved_floor: 2, reserved_per_slot: 0.25,",
                             "interactive: {reserved_floor: 0, reserved_per_slot: 0.0,"))
if any(reserved_of(PREEMPT_PRIORITY).values()):  # isolation's text moved: say so, loudly
    raise RuntimeError("bench.edge: --classes preempt still reserves slots")
CLASS_SETS = {"isolation": PRIORITY, "preempt": PREEMPT_PRIORITY}


def edge_stack(on: bool, service: float = SERVICE, priority: str = PRIORITY) -> Stack:
    cfg = StackConfig(workers=WORKERS, max_running_requests=SLOTS, service_time=service,
                      priority_yaml=priority, jwt_secret=SECRET, log_level="warning",
                      flush_interval_secs=5.0, health_interval_secs=1.0, edge_shed=on)
    stack = Stack(cfg)
    stack.config.extra_env[SLOT_TRACE_ENV] = str(stack.workdir / "slots.trace")
    return stack


async def checks(stack: Stack) -> int:
    return sum([await stack.envoy_stat(f"http\\.ingress\\.ext_authz\\.{s}")
                for s in ("ok", "denied", "error")])


async def load(stack: Stack, spec: list[dict[str, object]], seconds: float, client: str
               ) -> dict[str, Any]:
    return await through_envoy(stack, seconds, spec, timeout=20, warmup=5,
                               warmup_headers={"x-smg-priority": "system"}, client=client)


async def one(on: bool, seconds: float, multiple: float, service: float, client: str,
              poisson: bool = False, classes: str = "isolation") -> dict[str, Any]:
    priority = CLASS_SETS[classes]
    stack = edge_stack(on, service, priority)
    try:
        await stack.start()
        # Unloaded: system + interactive alone, at their own rates: each one's baseline.
        b = await load(stack, streams(0.0, service, poisson), min(seconds, 6.0), client)
        base = {c: pct([x[2] for x in b["records"] if x[0] == c and x[3] == 200], 0.99)
                for c in ("system", "interactive")}
        await asyncio.sleep(2 * service + 0.5)
        c0, m0 = await checks(stack), await stack.metrics()
        la0 = loadavg()
        r = await load(stack, streams(multiple, service, poisson), seconds, client)
        la1 = loadavg()
        await asyncio.sleep(1.0)
        c1, m1 = await checks(stack), await stack.metrics()
        trace = slots.read_trace(Path(stack.config.extra_env[SLOT_TRACE_ENV]))
        records = [rec for w in stack.fleet.workers for rec in w.records]
    finally:
        await stack.stop()
    t0 = r["send_start"]
    # The first service time fills the slots from empty: not part of the steady state.
    breakdown = slots.account(trace, records, WORKERS * SLOTS, t0 + service,
                              t0 + r["send_wall"], reserved=reserved_of(priority))
    recs = r["records"]
    sent = len(recs) + r["errors"]
    window = [x for x in recs if x[3] == 200 and x[1] < r["send_wall"]]
    out: dict[str, Any] = {
        "edge": on, "multiple": multiple, "service": service, "class_set": classes,
        "sent": sent,
        "sent_rps": sent / r["send_wall"], "errors": r["errors"],
        "checks": c1 - c0, "loadavg": f"{la0} -> {la1}",
        "edge_shed": m1.get('smg_sidecar_edge_shed_total{class="bulk"}', 0.0)
        - m0.get('smg_sidecar_edge_shed_total{class="bulk"}', 0.0),
        "cpu_envoy": r["cpu"][0], "cpu_sidecar": r["cpu"][1], "cpu_client": r["client_cpu"],
        # 200s of requests sent in the window, per second: counts the queue drained after
        # it too (biased high by up to a queue's worth); kept in the JSON only.
        "admitted_share": len(window) / r["send_wall"] / capacity_rps(service),
        "served_share": breakdown.total("served, done") / breakdown.slot_seconds,
        "admitted_work_share": (breakdown.total("served, done")
                                + breakdown.total("served, preempted")) / breakdown.slot_seconds,
        "breakdown": breakdown.lines(CLASSES), "classes": {}}
    for cls in CLASSES:
        rows = [x for x in recs if x[0] == cls]
        ok = [x[2] for x in rows if x[3] == 200]
        out["classes"][cls] = {
            "sent": len(rows), "ok": len(ok), "statuses": dict(Counter(x[3] for x in rows)),
            "codes": dict(Counter(x[4] for x in rows if x[3] != 200)),
            "p50_ms": pct(ok, 0.5) * 1e3, "p99_ms": pct(ok, 0.99) * 1e3,
            "unloaded_p99_ms": base.get(cls, float("nan")) * 1e3,
            # The scheduler's own queue wait (bucket bound): the rest of the latency above
            # the unloaded one is intake (grpc-core, the event loop) and Envoy.
            "queue_wait_p99_le_ms": hist_p(m0, m1, cls, 0.99) * 1e3}
    i, s = out["classes"]["interactive"], out["classes"]["system"]
    out["goals"] = {
        f"admitted >= {GOAL_ADMITTED:.0%} of capacity (slot-seconds served to completion)":
            out["served_share"] >= GOAL_ADMITTED,
        "interactive 0 x 429/503": i["ok"] == i["sent"] > 0,
        f"interactive p99 <= {GOAL_P99_RATIO}x unloaded p99":
            i["p99_ms"] <= GOAL_P99_RATIO * i["unloaded_p99_ms"],
        "system 100 % admitted": s["ok"] == s["sent"] > 0,
        f"sidecar CPU <= {GOAL_SIDECAR_CPU:.0%}": out["cpu_sidecar"] <= GOAL_SIDECAR_CPU}
    return out


def show(res: dict[str, Any]) -> None:
    print(f"  edge {'on ' if res['edge'] else 'off'}: sent {res['sent_rps']:,.0f} req/s "
          f"({res['errors']} client errors), Checks {res['checks']:,} of {res['sent']:,} "
          f"requests, Envoy answered {res['edge_shed']:,.0f}; cpu sidecar "
          f"{res['cpu_sidecar']:.0%} envoy {res['cpu_envoy']:.0%} client "
          f"{res['cpu_client']:.0%}; load average {res['loadavg']}")
    print(f"    admitted throughput: {res['served_share']:.1%} of the slot-seconds served to "
          f"completion, {res['admitted_work_share']:.1%} with the work later preempted "
          "(the breakdown below says where the rest went)")
    for cls, c in res["classes"].items():
        ratio = c["p99_ms"] / c["unloaded_p99_ms"] if c["unloaded_p99_ms"] > 0 else float("nan")
        print(f"    {cls:<12} sent {c['sent']:>6} 200 {c['ok']:>6}  p50 {c['p50_ms']:7.1f} ms"
              f"  p99 {c['p99_ms']:7.1f} ms (unloaded p99 {c['unloaded_p99_ms']:6.1f} ms, "
              f"x{ratio:.2f}; queue wait p99 <= {c['queue_wait_p99_le_ms']:.0f} ms)  "
              f"{c['codes'] or ''}")
    for line in res["breakdown"]:
        print("  " + line)
    for text, ok in res["goals"].items():
        print(f"    {'PASS' if ok else 'FAIL'}  {text}")


async def main_async(seconds: float, multiples: list[float], rounds: int, service: float,
                     client: str, edges: tuple[bool, ...] = (False, True),
                     poisson: bool = False, classes: str = "isolation") -> int:
    cap = capacity_rps(service)
    print(f"edge: {WORKERS} workers x {SLOTS} slots, {service:g} s service (capacity "
          f"{cap:g} req/s); bulk at {', '.join(f'{m:g}x' for m in multiples)}, interactive "
          f"{0.25 * cap:g} req/s, system {SYSTEM_RPS:g} req/s "
          f"({'exponential gaps' if poisson else 'evenly paced'}); {seconds:g} s per run, "
          f"{rounds} round(s) of off/on; client {client}; classes {classes}; "
          f"load average {loadavg()}")
    results = []
    for i in range(rounds):
        for mult in multiples:
            print(f" round {i + 1}, {mult:g}x ({mult * cap:,.0f} req/s offered)")
            for on in edges:
                res = await one(on, seconds, mult, service, client, poisson, classes)
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
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--multiples", default="10,100")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--service", type=float, default=SERVICE)
    p.add_argument("--client", choices=("rawload", "httpload"), default="rawload")
    p.add_argument("--edge", choices=("both", "off", "on"), default="both")
    p.add_argument("--quick", action="store_true", help="5 s per run")
    p.add_argument("--arrivals", choices=("poisson", "paced"), default="poisson",
                   help="system and interactive at exponential gaps (independent clients), "
                        "or evenly paced (at exactly half the service time apart, interactive "
                        "arrives a few ms before the release that would have freed its slot)")
    p.add_argument("--classes", choices=tuple(CLASS_SETS), default="preempt",
                   help="preempt: system and interactive hold no reserved slots and take "
                        "one by preempting bulk; isolation: bench.isolation's classes (they "
                        "hold 1 + 2 of the 8 slots, idle when unused)")
    p.add_argument("--bounds", type=int, default=0, metavar="N",
                   help="measure the room and fail-safe bounds N times instead")
    args = p.parse_args(argv)
    if args.bounds:
        return asyncio.run(bounds(args.bounds))
    if args.quick:
        args.seconds = 5.0
    return asyncio.run(main_async(args.seconds, [float(m) for m in args.multiples.split(",")],
                                  args.rounds, args.service, f"bench.{args.client}",
                                  {"both": (False, True), "off": (False,),
                                   "on": (True,)}[args.edge], args.arrivals == "poisson",
                                  args.classes))


if __name__ == "__main__":
    raise SystemExit(main())
