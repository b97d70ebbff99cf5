"""End to end through a real Envoy: Envoy + no-op authz vs. Envoy + the sidecar.

Both stacks are ``devtools.stack.Stack`` (same rendered Envoy config, same
fake workers in this process with ~0 service time, Envoy --concurrency 1); in the
baseline the authz/ALS cluster points at ``bench.noop`` instead of the sidecar.
The HTTP/1.1 load client (keep-alive, asyncio) runs in its own process. Preemption
(ext_proc) is off in both for the ratio; a third row shows the sidecar with
preemption on (one extra ext_proc stream per request, as the built-in classes let
system and interactive preempt the default class sent here), and a fourth the same
stack sent ``system`` requests, which nothing can preempt: admitted with
``preemptible: false``, so Envoy opens no stream for them.

    python -m bench.e2e [--seconds 3] [--quick]
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

from bench._util import pct, seconds_and_levels, wait_tcp
from bench.httpload import through_envoy
from devtools.fleet import SERVICE_TIME_HEADER
from devtools.httpclient import request
from devtools.stack import Stack, StackConfig


class NoopStack(Stack):
    """The same stack with bench.noop in the sidecar's place."""

    def sidecar_argv(self) -> list[str]:
        return [sys.executable, "-m", "bench.noop", "--port", str(self.grpc_port)]

    async def wait_sidecar_ready(self, timeout: float = 20.0) -> None:
        await asyncio.to_thread(wait_tcp, self.grpc_port, timeout, self.sidecar)


DEFAULT_HEADERS = {"x-smg-tenant": "t1"}
SYSTEM_HEADERS = {"x-smg-priority": "system"}


def config(preemption: bool, sidecar_args: tuple[str, ...] = ()) -> StackConfig:
    # flush 1 s: the warm-up below needs one periodic entry; requests here last ~1 ms, so
    # the interval adds no entries to the measured load.
    return StackConfig(workers=2, max_running_requests=1000, service_time=0.0,
                       preemption=preemption, log_level="warning", flush_interval_secs=1.0,
                       health_interval_secs=1.0, sidecar_args=sidecar_args,
                       edge_shed=False)  # the Check path measured, as before


def summary(r: dict[str, Any]) -> dict[str, float]:
    recs = r["records"]
    ok = [x[2] for x in recs if x[3] == 200]
    return {"rps": len(ok) / r["wall"], "p50": pct(ok, 0.5), "p99": pct(ok, 0.99),
            "non200": float(sum(1 for x in recs if x[3] != 200)), "errors": r["errors"],
            "client_cpu": r["client_cpu"], "envoy_cpu": r["cpu"][0], "authz_cpu": r["cpu"][1]}


def fmt(s: dict[str, float]) -> str:
    return (f"{s['rps']:>7,.0f} req/s  p50 {s['p50'] * 1e6:>6.0f} us  p99 "
            f"{s['p99'] * 1e6:>7.0f} us  cpu client {s['client_cpu']:.0%} envoy "
            f"{s['envoy_cpu']:.0%} authz {s['authz_cpu']:.0%}  non-200 {s['non200']:.0f} "
            f"err {s['errors']:.0f}")


async def point(stack: Stack, seconds: float, *, concurrency: int = 0,
                rate: float = 0.0, headers: dict[str, str] | None = None) -> dict[str, float]:
    streams = [{"name": "default", "rate": rate,
                "headers": headers if headers is not None else DEFAULT_HEADERS}]
    return summary(await through_envoy(stack, seconds, streams, concurrency=concurrency))


async def periodic_entries_seen(stack: Stack) -> None:
    """The sidecar lets Envoy skip ext_proc for a class nobody may preempt only once it has
    seen a periodic access-log entry from that Envoy (sidecar.liveness sends_periodic): hold
    one request past two flush intervals, as any long LLM stream in production would."""
    r = await request(stack.listen_port,
                      headers={**SYSTEM_HEADERS, SERVICE_TIME_HEADER: "3.5"})
    assert r.status == 200, r.status
    present = await stack.metric("smg_sidecar_envoy_feature",
                                 feature="periodic_access_log", state="present")
    assert present == 1, "no periodic access-log entry seen"


async def main_async(seconds: float, levels: list[int]) -> int:
    print("e2e: HTTP/1.1 through Envoy (concurrency 1) -> ext_authz -> 2 fake workers "
          "(0 s service time, in the bench process); load client in its own process "
          "(asyncio, keep-alive).")
    every_class = ("--priority-scheduler-default-max-class", "system")
    kinds: list[tuple[str, type[Stack], bool, tuple[str, ...], dict[str, str]]] = [
        ("no-op", NoopStack, False, (), DEFAULT_HEADERS),
        ("sidecar", Stack, False, (), DEFAULT_HEADERS),
        ("sidecar+ext_proc", Stack, True, (), DEFAULT_HEADERS),
        ("+ext_proc, system", Stack, True, every_class, SYSTEM_HEADERS)]
    stacks: dict[str, Stack] = {}
    heads: dict[str, dict[str, str]] = {}
    best: dict[str, dict[str, float]] = {}
    try:
        for name, cls, preempt, args, head in kinds:
            stack = stacks[name] = cls(config(preempt, args))
            heads[name] = head
            await stack.start()
            if head is SYSTEM_HEADERS:
                await periodic_entries_seen(stack)
        print(f"  saturation (closed loop, {seconds:g} s per point):")
        for name, stack in stacks.items():
            for c in levels:
                s = await point(stack, seconds, concurrency=c, headers=heads[name])
                print(f"    {name:<17} conns={c:<3} {fmt(s)}")
                if name not in best or s["rps"] > best[name]["rps"]:
                    best[name] = s
        a = best["no-op"]["rps"]
        for name in ("sidecar", "sidecar+ext_proc", "+ext_proc, system"):
            print(f"  max rate {name}/no-op: {best[name]['rps']:,.0f} / {a:,.0f} = "
                  f"{best[name]['rps'] / a:.2f}")
        rate = 0.5 * a
        print(f"  latency, open loop at 50% of no-op max = {rate:,.0f} req/s:")
        lat: dict[str, dict[str, float]] = {}
        for name, stack in stacks.items():
            lat[name] = s = await point(stack, seconds, rate=rate, headers=heads[name])
            print(f"    {name:<17} {fmt(s)}")
        for name in ("sidecar", "sidecar+ext_proc", "+ext_proc, system"):
            print(f"  added p99 {name}: {(lat[name]['p99'] - lat['no-op']['p99']) * 1e6:+.0f} us"
                  f" (p99 ratio x{lat[name]['p99'] / lat['no-op']['p99']:.2f}), added p50 "
                  f"{(lat[name]['p50'] - lat['no-op']['p50']) * 1e6:+.0f} us")
    finally:
        for stack in stacks.values():
            await stack.stop()
    return 0


def main(argv: list[str] | None = None) -> int:
    return asyncio.run(main_async(*seconds_and_levels(argv, __doc__)))


if __name__ == "__main__":
    raise SystemExit(main())
