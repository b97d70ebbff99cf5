"""Priority isolation under overload, with the real stack (Envoy + sidecar + workers).

Fleet: 2 fake workers x 4 slots (capacity 8), 50 ms service time -> 160 req/s.
Open-loop load (own process, keep-alive HTTP/1.1) at 3x and 10x capacity:
a bulk flood (anonymous, x-smg-priority: bulk), a steady interactive stream at 25 %
of capacity from JWT tenant auth:acme (ceiling interactive), and a trickle of system
from JWT tenant auth:internal-cron (ceiling system). Queue wait = end-to-end latency
of a 200 minus the 50 ms service time (client side), cross-checked with the sidecar's
smg_scheduler_queue_wait_seconds histogram. The baseline for the ratios is the
same class's unloaded latency, measured first in this run.

The load client is ``bench.rawload`` (asyncio protocols, pre-encoded requests): aiohttp
(``--client httpload``, what this part used before) took 45-70 % of one of the box's
two cores at 1,600 req/s, CPU that Envoy and the sidecar then lacked.

    python -m bench.isolation [--seconds 8] [--quick] [--client rawload|httpload]
"""

from __future__ import annotations

import argparse
import asyncio
from collections import Counter
from pathlib import Path
from typing import Any

from bench import slots
from bench._util import loadavg, out_path, pct
from bench.httpload import through_envoy
from devtools.demo import make_token
from devtools.httpclient import get as http_get
from devtools.stack import Stack, StackConfig
from sidecar.config import parse_priority_config
from sidecar.scheduler.reservations import desired_reservations
from sidecar.slottrace import ENV as SLOT_TRACE_ENV

SECRET = "bench-secret"
SERVICE = 0.05
WORKERS, SLOTS = 2, 4
CAPACITY_RPS = WORKERS * SLOTS / SERVICE
INTERACTIVE_STARVATION = 1.0
PRIORITY = f"""
# Sized for capacity 8 (built-in reservations need >= 256 slots).
classes:
  system: {{reserved_floor: 1, queue_size: 8, queue_timeout_secs: 5}}
  interactive: {{reserved_floor: 2, reserved_per_slot: 0.25, queue_size: 32,
                 queue_timeout_secs: 5, starvation_threshold_secs: {INTERACTIVE_STARVATION}}}
  default: {{reserved_floor: 0, reserved_per_slot: 0.0, queue_size: 8, queue_timeout_secs: 2}}
  # bulk: starvation promotion off (threshold > queue timeout): pure priority order;
  # bulk progresses on what interactive and system leave (75 % of capacity).
  bulk: {{queue_size: 32, queue_timeout_secs: 2, starvation_threshold_secs: 5}}
tenant_policies:
  "auth:acme": {{max_class: interactive}}
  "auth:internal-cron": {{max_class: system}}
"""
# --no-reservations: the same table with system's and interactive's reservations
# at 0, to see what the admission loop itself leaves idle once the contract's reservation
# rule (available(c) keeps higher classes' unused reservations free) holds nothing back.
PRIORITY_NO_RESERVATIONS = (PRIORITY
                            .replace("system: {reserved_floor: 1,", "system: {reserved_floor: 0,")
                            .replace("reserved_floor: 2, reserved_per_slot: 0.25",
                                     "reserved_floor: 0, reserved_per_slot: 0.0"))
CLASSES = ("system", "interactive", "bulk")


def reserved_of(priority_yaml: str) -> dict[str, int]:
    return {c.label: n for c, n in desired_reservations(
        parse_priority_config(priority_yaml).classes, WORKERS * SLOTS).items()}


def streams(multiple: float) -> list[dict[str, object]]:
    system_rps, interactive_rps = 4.0, 0.25 * CAPACITY_RPS
    bulk_rps = multiple * CAPACITY_RPS - system_rps - interactive_rps
    return [
        {"name": "system", "rate": system_rps, "headers": {
            "x-smg-priority": "system",
            "authorization": f"Bearer {make_token('auth:internal-cron', SECRET)}"}},
        {"name": "interactive", "rate": interactive_rps, "headers": {
            "x-smg-priority": "interactive",
            "authorization": f"Bearer {make_token('auth:acme', SECRET)}"}},
        {"name": "bulk", "rate": bulk_rps, "headers": {"x-smg-priority": "bulk"}},
    ]


def hist_p(m0: dict[str, float], m1: dict[str, float], cls: str, q: float) -> float:
    """Upper bucket bound holding the q-quantile of the queue-wait histogram delta."""
    rows = []
    for k, v in m1.items():
        if k.startswith("smg_scheduler_queue_wait_seconds_bucket{") and f'class="{cls}"' in k:
            bound = k.split('le="')[1].split('"')[0]
            rows.append((float(bound), v - m0.get(k, 0.0)))
    rows.sort()
    if not rows or rows[-1][1] <= 0:
        return float("nan")
    total = rows[-1][1]
    for le, n in rows:
        if n >= q * total:
            return le
    return float("inf")


def delta(m0: dict[str, float], m1: dict[str, float], prefix: str) -> float:
    return sum(v - m0.get(k, 0.0) for k, v in m1.items() if k.startswith(prefix))


async def run_load(stack: Stack, spec_streams: list[dict[str, object]], seconds: float,
                   client: str = "bench.rawload") -> dict[str, Any]:
    return await through_envoy(stack, seconds, spec_streams, timeout=20, warmup=5,
                               warmup_headers={"x-smg-priority": "system"}, client=client)


def report(label: str, r: dict[str, Any], m0: dict[str, float], m1: dict[str, float],
           base: dict[str, float], stack: Stack, reserved: dict[str, int]) -> dict[str, bool]:
    recs = r["records"]
    sent = (len(recs) + r["errors"]) / r["send_wall"]
    print(f"  {label}: sent {sent:,.0f} req/s, {r['errors']} client errors, "
          f"{r['connections']} connections; cpu while sending: client "
          f"{r['client_cpu']:.0%} envoy {r['cpu'][0]:.0%} sidecar {r['cpu'][1]:.0%}")
    print(f"    {'class':<12} {'sent':>6} {'200':>6} {'admit%':>7} {'of 200s':>8} "
          f"{'wait p50':>9} {'wait p99':>9} {'x unload':>9} {'hist p99<=':>10} {'503 tmo':>8} "
          f"{'429':>6} {'preempt':>8}")
    ok_total = sum(1 for x in recs if x[3] == 200)
    out: dict[str, dict[str, float]] = {}
    for cls in CLASSES:
        rows = [x for x in recs if x[0] == cls]
        ok = [max(0.0, x[2] - SERVICE) for x in rows if x[3] == 200]
        codes = Counter(x[4] for x in rows if x[3] != 200)
        statuses = Counter(x[3] for x in rows)
        p99 = pct(ok, 0.99)
        out[cls] = {"sent": len(rows), "ok": len(ok), "p99": p99,
                    "hist_p99": hist_p(m0, m1, cls, 0.99),
                    "timeouts": codes["scheduler_queue_timeout"], "r429": statuses[429],
                    "shed": len(rows) - len(ok)}
        preempted = codes["scheduler_preempted"]
        print(f"    {cls:<12} {len(rows):>6} {len(ok):>6} "
              f"{len(ok) / max(1, len(rows)):>7.0%} {len(ok) / max(1, ok_total):>8.0%} "
              f"{pct(ok, 0.5) * 1e3:>7.1f}ms {p99 * 1e3:>7.1f}ms "
              f"{(pct(ok, 0.99) + SERVICE) / (base[cls] + SERVICE):>8.1f}x "
              f"{hist_p(m0, m1, cls, 0.99) * 1e3:>8.0f}ms {codes['scheduler_queue_timeout']:>8} "
              f"{statuses[429]:>6} {preempted:>8}")
    window = [x for x in recs if x[3] == 200 and x[1] < r["send_wall"]]
    print(f"    admitted throughput while sending: {len(window) / r['send_wall']:,.0f} req/s = "
          f"{len(window) / r['send_wall'] / CAPACITY_RPS:.0%} of fleet capacity "
          f"{CAPACITY_RPS:.0f} req/s (below 100 %: the release -> dispatch cycle through "
          "Envoy + sidecar is slower than the 50 ms service time)")
    trace = slots.read_trace(Path(stack.config.extra_env[SLOT_TRACE_ENV]))
    records = [rec for w in stack.fleet.workers for rec in w.records]
    t0 = r["send_start"]
    breakdown = slots.account(trace, records, WORKERS * SLOTS, t0, t0 + r["send_wall"],
                              reserved=reserved)
    print("\n".join(breakdown.lines(CLASSES)))
    print(f"    sidecar counters: preemptions "
          f"{delta(m0, m1, 'smg_scheduler_preemption_total'):.0f}, starvation promotions "
          f"{delta(m0, m1, 'smg_scheduler_starvation_promotion_total'):.0f}, lease expiries "
          f"{delta(m0, m1, 'smg_sidecar_lease_expired_total'):.0f}; x unload = "
          "p99 latency / unloaded p99 of the class")
    i, s, b = out["interactive"], out["system"], out["bulk"]
    checks = {
        f"interactive p99 queue wait (scheduler histogram, bucket bound) <= "
        f"{i['hist_p99'] * 1e3:.0f} ms, end-to-end minus service {i['p99'] * 1e3:.0f} ms; "
        f"threshold {INTERACTIVE_STARVATION * 1e3:.0f} ms":
            i["hist_p99"] <= INTERACTIVE_STARVATION and i["p99"] < INTERACTIVE_STARVATION,
        f"zero interactive timeouts ({i['timeouts']:.0f}) while bulk is shed "
        f"({b['shed']:.0f})": i["timeouts"] == 0 and b["shed"] > 0,
        f"system always admitted ({s['ok']:.0f}/{s['sent']:.0f})":
            s["ok"] == s["sent"] and s["sent"] > 0,
        f"bulk still makes progress ({b['ok']:.0f} admitted)": b["ok"] > 0,
    }
    for text, passed in checks.items():
        print(f"    {'PASS' if passed else 'FAIL'}  {text}")
    return checks


def plot(results: list[tuple[str, dict[str, Any]]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 1, figsize=(10, 4 * len(results)), squeeze=False)
    colours = {"system": "tab:red", "interactive": "tab:blue", "bulk": "tab:gray"}
    for ax, (label, r) in zip(axes[:, 0], results, strict=True):
        for cls in ("bulk", "interactive", "system"):
            pts = [(x[1], max(0.5, (x[2] - SERVICE) * 1e3)) for x in r["records"]
                   if x[0] == cls and x[3] == 200]
            if pts:
                ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=4, alpha=0.5,
                           label=f"{cls} (200)", color=colours[cls])
        ax.axhline(INTERACTIVE_STARVATION * 1e3, color="tab:blue", ls="--", lw=0.8,
                   label="interactive starvation threshold")
        ax.set_yscale("log")
        ax.set_ylim(bottom=0.5)
        ax.set_xlabel("request sent at (s since start)")
        ax.set_ylabel("latency - 50 ms service (ms, floor 0.5)")
        ax.set_title(f"isolation, {label}")
        ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(out_path("isolation.png"), dpi=90)
    plt.close(fig)


# What an operator can put in front (envoy/NOTES.md, "Shedding a flood before Check"):
# Envoy's local rate limit on the bulk class, before ext_authz, at about twice what bulk
# can be served here (~120 req/s), so it cuts a flood but never ordinary overload.
FLOOD_FILTER = """          - name: envoy.filters.http.local_ratelimit
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.local_ratelimit.v3.LocalRateLimit
              stat_prefix: smg_flood
"""  # noqa: E501
FLOOD_ROUTE = """              - match:
                  prefix: "/"
                  headers: [{name: x-smg-priority, string_match: {exact: bulk}}]
                route: {cluster: workers, timeout: 0s}
                typed_per_filter_config:
                  envoy.filters.http.local_ratelimit:
                    "@type": type.googleapis.com/envoy.extensions.filters.http.local_ratelimit.v3.LocalRateLimit
                    stat_prefix: smg_flood_bulk
                    token_bucket: {max_tokens: 300, tokens_per_fill: 30, fill_interval: 0.1s}
                    filter_enabled: {default_value: {numerator: 100}, runtime_key: smg_flood_on}
                    filter_enforced: {default_value: {numerator: 100}, runtime_key: smg_flood_enf}
                    response_headers_to_add:
                    - header: {key: x-smg-error-code, value: scheduler_queue_full}
                    - header: {key: retry-after, value: "2"}
"""  # noqa: E501


def add_flood_guard(stack: Stack) -> None:
    """Render Envoy as usual, then add the bulk flood guard (bench-only variant)."""
    original = stack.write_envoy_config

    def write() -> None:
        original()
        text = stack.envoy_config.read_text()
        text = text.replace("          - name: envoy.filters.http.ext_authz\n",
                            FLOOD_FILTER + "          - name: envoy.filters.http.ext_authz\n", 1)
        text = text.replace("              - match: {prefix: \"/\"}\n",
                            FLOOD_ROUTE + "              - match: {prefix: \"/\"}\n", 1)
        stack.envoy_config.write_text(text)

    stack.write_envoy_config = write  # type: ignore[method-assign]


async def main_async(seconds: float, multiples: list[float], preemption: bool = True,
                     flood_guard: bool = False, reservations: bool = True,
                     client: str = "bench.rawload") -> int:
    priority = PRIORITY if reservations else PRIORITY_NO_RESERVATIONS
    cfg = StackConfig(workers=WORKERS, max_running_requests=SLOTS, service_time=SERVICE,
                      priority_yaml=priority, jwt_secret=SECRET, preemption=preemption,
                      log_level="warning", flush_interval_secs=5.0, health_interval_secs=1.0,
                      edge_shed=False)  # every 429 the sidecar's, as measured (bench.edge: on)
    stack = Stack(cfg)
    # The sidecar traces each admission's life; bench.slots accounts for the slot time.
    stack.config.extra_env[SLOT_TRACE_ENV] = str(stack.workdir / "slots.trace")
    if flood_guard:
        add_flood_guard(stack)
    print(__doc__.split("\n\n")[1].replace("\n", "\n  ").join(["isolation: ", ""])
          .replace("isolation: Fleet", "isolation: fleet"))
    print(f"  load client {client}; load average {loadavg()}")
    all_ok = True
    results: list[tuple[str, dict[str, Any]]] = []
    try:
        await stack.start()
        # Unloaded baseline: 10 req/s per class, 2 s.
        unl = [dict(s, rate=10.0) for s in streams(1.0)]
        r = await run_load(stack, unl, 2.0, client)
        base = {c: pct([max(0.0, x[2] - SERVICE) for x in r["records"]
                        if x[0] == c and x[3] == 200], 0.99) for c in CLASSES}
        print("  unloaded baseline (10 req/s per class): p99 queue wait " + ", ".join(
            f"{c} {base[c] * 1e3:.1f} ms" for c in CLASSES))
        for mult in multiples:
            await asyncio.sleep(2.5)  # let queues from the previous run drain
            m0 = await stack.metrics()
            r = await run_load(stack, streams(mult), seconds, client)
            await asyncio.sleep(1.0)
            m1 = await stack.metrics()
            if flood_guard:
                _, body = await http_get(f"http://127.0.0.1:{stack.admin_port}/stats"
                                         "?filter=http_local_rate_limit.rate_limited", 2.0)
                print("  flood guard (Envoy, cumulative): " + " ".join(body.decode().split()))
            label = f"{mult:g}x capacity ({mult * CAPACITY_RPS:,.0f} req/s offered, {seconds:g} s)"
            checks = report(label, r, m0, m1, base, stack, reserved_of(priority))
            all_ok = all_ok and all(checks.values())
            results.append((label, r))
        plot(results)
        print(f"  overall: {'PASS' if all_ok else 'FAIL'}; plot: bench/out/isolation.png")
    finally:
        await stack.stop()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--multiples", default="3,10")
    p.add_argument("--quick", action="store_true", help="3 s per load level")
    p.add_argument("--no-preemption", action="store_true",
                   help="Envoy without the ext_proc filter (to measure what it costs)")
    p.add_argument("--no-reservations", action="store_true",
                   help="system and interactive reserve nothing (what the loop itself costs)")
    p.add_argument("--client", choices=("rawload", "httpload"), default="rawload",
                   help="the load client (httpload: the aiohttp one this part used before)")
    p.add_argument("--flood-guard", action="store_true",
                   help="Envoy's local rate limit on bulk before ext_authz (operator option)")
    args = p.parse_args(argv)
    seconds = 3.0 if args.quick else args.seconds
    return asyncio.run(main_async(seconds, [float(m) for m in args.multiples.split(",")],
                                  preemption=not args.no_preemption,
                                  flood_guard=args.flood_guard,
                                  reservations=not args.no_reservations,
                                  client=f"bench.{args.client}"))


if __name__ == "__main__":
    raise SystemExit(main())
