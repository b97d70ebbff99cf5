"""A bulk flood against ``make run``'s demo: edge shedding as shipped vs opted out, same run.

The demo's own stack (``devtools.demo.demo_config``: 2 fake workers x 4 slots, 0.2 s
service time, so capacity 40 req/s; its ``priority.yaml``; Envoy trusting the demo
identity), once with edge shedding on both sides (as ``make run`` ships) and once with
``--no-edge-shed``, alternating per round. Per stack: tenant ``acme``'s ``interactive``
requests alone at ``--interactive`` req/s (their unloaded latency), then the same with
anonymous ``bulk`` at ``--rate`` req/s on top (open loop, ``bench.rawload``). Reported while
sending: the sidecar's and Envoy's CPU (share of one core), the Checks Envoy made (its
ext_authz stats), the requests Envoy answered itself (``smg_sidecar_edge_shed_total``), and
interactive's outcomes and p99 against its unloaded p99. Goals with the edge on: the
sidecar at most 30 % of a core, interactive untouched (every request 200 at its class).

    python -m bench.demo_flood [--rate 1500] [--seconds 10] [--rounds 2] [--interactive 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections import Counter
from typing import Any

from bench._util import loadavg, out_path, pct
from bench.httpload import through_envoy
from devtools import identity
from devtools.demo import demo_config
from devtools.stack import Stack

GOAL_SIDECAR_CPU = 0.30
INTERACTIVE = "smg_sidecar_tenant_admitted_total{class=\"interactive\",tenant=\"acme\"}"


def streams(rate: float, interactive: float) -> list[dict[str, object]]:
    acme = {"x-smg-priority": "interactive",
            "authorization": f"Bearer {identity.token('acme')}"}
    out: list[dict[str, object]] = [{"name": "interactive", "rate": interactive,
                                     "headers": acme}]
    if rate > 0:
        out.append({"name": "bulk", "rate": rate, "headers": {"x-smg-priority": "bulk"}})
    return out


async def checks(stack: Stack) -> int:
    return sum([await stack.envoy_stat(f"http\\.ingress\\.ext_authz\\.{s}")
                for s in ("ok", "denied", "error")])


async def one(edge: bool, rate: float, seconds: float, interactive: float) -> dict[str, Any]:
    stack = Stack(demo_config(free_ports=True, edge_shed=edge))
    stack.config.log_level = "warning"
    try:
        await stack.start()
        base: dict[str, Any] = await through_envoy(
            stack, min(seconds, 6.0), streams(0, interactive), client="bench.rawload",
            timeout=20, warmup=5, warmup_headers={"x-smg-priority": "default"})
        unloaded = pct([x[2] for x in base["records"] if x[3] == 200], 0.99)
        c0, m0, la0 = await checks(stack), await stack.metrics(), loadavg()
        r: dict[str, Any] = await through_envoy(stack, seconds, streams(rate, interactive),
                                                client="bench.rawload", timeout=20, warmup=0)
        la1 = loadavg()
        await asyncio.sleep(1.0)  # the shed log's last batch (0.25 s) and the releases
        c1, m1 = await checks(stack), await stack.metrics()
    finally:
        await stack.stop()
    recs: list[list[Any]] = r["records"]
    inter = [x for x in recs if x[0] == "interactive"]
    bulk = [x for x in recs if x[0] == "bulk"]
    shed = "smg_sidecar_edge_shed_total{class=\"bulk\"}"
    send_wall = float(r["send_wall"])
    cpu: list[float] = r["cpu"]
    res: dict[str, Any] = {
        "edge": edge, "rate": rate, "seconds": seconds, "loadavg": f"{la0} -> {la1}",
        "sent_rps": len(recs) / send_wall, "errors": r["errors"],
        "cpu_envoy": cpu[0], "cpu_sidecar": cpu[1], "cpu_client": r["client_cpu"],
        "checks": c1 - c0, "requests": len(recs),
        "edge_shed": m1.get(shed, 0.0) - m0.get(shed, 0.0),
        "bulk": dict(Counter(x[3] for x in bulk)),
        "interactive": {
            "sent": len(inter), "statuses": dict(Counter(x[3] for x in inter)),
            "admitted_as_interactive": m1.get(INTERACTIVE, 0.0) - m0.get(INTERACTIVE, 0.0),
            "p99_ms": pct([x[2] for x in inter if x[3] == 200], 0.99) * 1e3,
            "unloaded_p99_ms": unloaded * 1e3}}
    i = res["interactive"]
    res["goals"] = {
        f"sidecar CPU <= {GOAL_SIDECAR_CPU:.0%} of a core": res["cpu_sidecar"] <= GOAL_SIDECAR_CPU,
        "interactive untouched: every request 200, admitted as interactive":
            i["statuses"] == {200: i["sent"]} and i["admitted_as_interactive"] == i["sent"] > 0}
    return res


def show(res: dict[str, Any]) -> None:
    i = res["interactive"]
    print(f"  edge {'on ' if res['edge'] else 'off'}: sent {res['sent_rps']:,.0f} req/s "
          f"({res['errors']} client errors); Checks {res['checks']:,} of {res['requests']:,} "
          f"requests, Envoy answered {res['edge_shed']:,.0f} itself; cpu sidecar "
          f"{res['cpu_sidecar']:.0%} envoy {res['cpu_envoy']:.0%} client "
          f"{res['cpu_client']:.0%}; load average {res['loadavg']}")
    print(f"    bulk {res['bulk']}; interactive sent {i['sent']} statuses {i['statuses']} "
          f"as interactive {i['admitted_as_interactive']:.0f}, p99 {i['p99_ms']:.0f} ms "
          f"(unloaded {i['unloaded_p99_ms']:.0f} ms)")
    if res["edge"]:
        for text, ok in res["goals"].items():
            print(f"    {'PASS' if ok else 'FAIL'}  {text}")


async def main_async(rate: float, seconds: float, rounds: int, interactive: float) -> int:
    print(f"demo flood: make run's demo stack (2 fake workers x 4 slots, 0.2 s: 40 req/s), "
          f"bulk {rate:,.0f} req/s anonymous + interactive {interactive:g} req/s (tenant acme), "
          f"{seconds:g} s per run, {rounds} round(s) of off/on; load average {loadavg()}")
    results = []
    for n in range(rounds):
        print(f" round {n + 1}")
        for edge in ((False, True) if n % 2 == 0 else (True, False)):
            res = await one(edge, rate, seconds, interactive)
            show(res)
            results.append(res)
    out_path("demo_flood.json").write_text(json.dumps(results, indent=1))
    print("  results: bench/out/demo_flood.json")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rate", type=float, default=1500.0, help="bulk req/s")
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--interactive", type=float, default=4.0, help="interactive req/s")
    a = p.parse_args(argv)
    return asyncio.run(main_async(a.rate, a.seconds, a.rounds, a.interactive))


if __name__ == "__main__":
    raise SystemExit(main())
