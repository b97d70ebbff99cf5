"""Fairness between two tenants in one class, through the real stack.

Fleet: 2 fake workers x 4 slots (capacity 8), 50 ms service time -> 160 req/s.
Two JWT tenants send bulk, open loop, the heavy one at 10x the light one's rate:

* backlogged: light 0.6x capacity, heavy 6x (both always have requests waiting).
  Figure: the light tenant's share of bulk admissions (the sidecar's
  smg_sidecar_tenant_admitted_total over the sending window; fair share 50 %).
* under its share: light 0.15x capacity, heavy 1.5x (the fleet is overloaded
  by the heavy tenant alone). Figure: the light tenant's p99 end-to-end latency
  against its unloaded p99 (same class, measured first in this run).

Each with three bulk configurations, a fresh stack each: FIFO (the contract);
fair_queuing; fair_queuing + max_queued_per_tenant (half the queue), without
which the heavy tenant still fills the shared queue and the light one is shed
with 429 at the door, whatever the order inside.

    python -m bench.fairness [--seconds 6] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
from collections import Counter
from typing import Any

from bench._util import pct
from bench.isolation import delta, run_load
from devtools.demo import make_token
from devtools.stack import Stack, StackConfig

SECRET = "bench-secret"
SERVICE = 0.05
WORKERS, SLOTS = 2, 4
CAPACITY_RPS = WORKERS * SLOTS / SERVICE
HEAVY, LIGHT = "auth:heavy", "auth:light"
QUEUE = 64
CONFIGS = {
    "fifo": "fair_queuing: false",
    "fair": "fair_queuing: true",
    "fair+limit": f"fair_queuing: true, max_queued_per_tenant: {QUEUE // 2}",
}


def priority(bulk: str) -> str:
    return f"""
# Sized for capacity 8; bulk alone matters here (starvation off: threshold > timeout).
classes:
  system: {{reserved_floor: 0}}
  interactive: {{reserved_floor: 0, reserved_per_slot: 0.0}}
  default: {{reserved_per_slot: 0.0}}
  bulk: {{queue_size: {QUEUE}, queue_timeout_secs: 2, starvation_threshold_secs: 5, {bulk}}}
"""


def streams(light_share_of_capacity: float) -> list[dict[str, object]]:
    light = light_share_of_capacity * CAPACITY_RPS
    return [
        {"name": name, "rate": rate, "headers": {
            "x-smg-priority": "bulk",
            "authorization": f"Bearer {make_token(tenant, SECRET)}"}}
        for name, tenant, rate in (("light", LIGHT, light), ("heavy", HEAVY, 10 * light))
    ]


def admitted(m0: dict[str, float], m1: dict[str, float], tenant: str) -> float:
    return delta(m0, m1, f'smg_sidecar_tenant_admitted_total{{class="bulk",tenant="{tenant}"}}')


def summary(r: dict[str, Any], name: str) -> dict[str, float]:
    rows = [x for x in r["records"] if x[0] == name]
    ok = [x[2] for x in rows if x[3] == 200]
    statuses = Counter(x[3] for x in rows)
    return {"sent": len(rows), "ok": len(ok), "p99": pct(ok, 0.99), "429": statuses[429],
            "503": statuses[503]}


async def one_config(label: str, bulk: str, seconds: float) -> dict[str, dict[str, float]]:
    cfg = StackConfig(workers=WORKERS, max_running_requests=SLOTS, service_time=SERVICE,
                      priority_yaml=priority(bulk), jwt_secret=SECRET, log_level="warning",
                      flush_interval_secs=5.0, health_interval_secs=1.0,
                      edge_shed=False)  # the tenants' shares are the sidecar's queue's
    stack = Stack(cfg)
    out: dict[str, dict[str, float]] = {}
    try:
        await stack.start()
        r = await run_load(stack, [dict(s, rate=10.0) for s in streams(0.1)], 2.0)
        base = summary(r, "light")["p99"]
        for scenario, light_share in (("backlogged", 0.6), ("under its share", 0.15)):
            await asyncio.sleep(2.5)  # the previous run's queue drains (timeout 2 s)
            m0 = await stack.metrics()
            r = await run_load(stack, streams(light_share), seconds)
            await asyncio.sleep(1.0)
            m1 = await stack.metrics()
            light, heavy = summary(r, "light"), summary(r, "heavy")
            a_light, a_heavy = admitted(m0, m1, LIGHT), admitted(m0, m1, HEAVY)
            share = a_light / max(1.0, a_light + a_heavy)
            ratio = light["p99"] / base
            out[scenario] = {"share": share, "ratio": ratio}
            print(f"  {label:<11} {scenario:<16} light admitted {a_light:5.0f} of "
                  f"{light['sent']:5.0f} sent ({share:4.0%} of bulk admissions), "
                  f"429 {light['429']:4.0f}, 503 {light['503']:4.0f}; "
                  f"p99 {light['p99'] * 1e3:6.0f} ms = {ratio:5.1f}x unloaded "
                  f"({base * 1e3:.0f} ms) | heavy admitted {a_heavy:5.0f} of "
                  f"{heavy['sent']:5.0f}")
    finally:
        await stack.stop()
    return out


async def main_async(seconds: float) -> int:
    print(__doc__.split("\n\n")[1].replace("\n", "\n  ").join(["fairness: ", ""])
          .replace("fairness: Fleet", "fairness: fleet"))
    results = {label: await one_config(label, bulk, seconds) for label, bulk in CONFIGS.items()}
    best = results["fair+limit"]
    checks = {
        f"fair+limit, backlogged: light share {best['backlogged']['share']:.0%} >= 45 % "
        f"(fifo: {results['fifo']['backlogged']['share']:.0%})":
            best["backlogged"]["share"] >= 0.45,
        f"fair+limit, under its share: light p99 {best['under its share']['ratio']:.1f}x "
        f"unloaded <= 2x (fifo: {results['fifo']['under its share']['ratio']:.1f}x)":
            best["under its share"]["ratio"] <= 2.0,
    }
    for text, passed in checks.items():
        print(f"  {'PASS' if passed else 'FAIL'}  {text}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--seconds", type=float, default=6.0)
    p.add_argument("--quick", action="store_true", help="3 s per load level")
    args = p.parse_args(argv)
    return asyncio.run(main_async(3.0 if args.quick else args.seconds))


if __name__ == "__main__":
    raise SystemExit(main())
