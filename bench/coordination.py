"""One replica with fleet coordination vs. without, same run, same machine.

Two ``devtools.stack.Stack``s as in bench.e2e (Envoy --concurrency 1, two fake workers
in this process with ~0 s service time, preemption off, load client in its own process):
``local`` admits in-process (no ``--coordination-url``), ``fleet`` admits through a real
valkey-server on loopback (``devtools.valkey``). Reported:

* saturation throughput (closed loop) and the fleet/local ratio (issue goal >= 0.7);
* p50/p99 at the same open-loop rate (50 % of local's best) and what coordination adds;
* server round trips per admitted request, counted by the server: INFO commandstats over
  the run, less the commands the ledger script runs inside the server (those are no round
  trips), background heartbeats and notification pops included; and the server's own
  CPU: where the time goes.

    python -m bench.coordination [--seconds 3] [--quick]
"""

from __future__ import annotations

import asyncio
import re
import tempfile
from pathlib import Path
from typing import Any

import redis

from bench._util import cpu_seconds, out_path, pct, seconds_and_levels
from bench.e2e import DEFAULT_HEADERS, config
from bench.httpload import through_envoy
from devtools.stack import Stack
from devtools.valkey import ValkeyServer
from sidecar.coordination import ledger

# Commands the ledger script calls inside the server: counted by commandstats, but no
# round trip. (The replicas send only FCALL, BLMPOP/LPOP, one FUNCTION LOAD and connection set-up.)
IN_SCRIPT = {name.lower() for name in re.findall(
    r"redis\.call\('([A-Z]+)'", Path(ledger.__file__).with_suffix(".lua").read_text())}

# How a replica calls the ledger (FCALL of its function library; EVAL/EVALSHA in older
# versions, still counted so runs compare).
LEDGER_CALLS = ("fcall", "evalsha", "eval")


def commandstats(server: ValkeyServer) -> dict[str, int]:
    """Calls per command since start (the server counts each command once)."""
    c = redis.Redis(port=server.port)
    try:
        info: dict[str, Any] = c.info("commandstats")
    finally:
        c.close()
    return {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in info.items()}


async def admitted(stack: Stack) -> float:
    m = await stack.metrics()
    return sum(v for k, v in m.items()
               if k.startswith("smg_scheduler_admit_total{") and 'outcome="admitted"' in k)


async def point(stack: Stack, server: ValkeyServer | None, seconds: float, *,
                concurrency: int = 0, rate: float = 0.0) -> dict[str, Any]:
    before_cmds = commandstats(server) if server else {}
    before_adm = await admitted(stack)
    server_cpu0 = cpu_seconds(server.proc.pid) if server and server.proc else 0.0
    r = await through_envoy(stack, seconds, [{"name": "default", "rate": rate,
                                              "headers": DEFAULT_HEADERS}],
                            concurrency=concurrency)
    server_cpu = (cpu_seconds(server.proc.pid) if server and server.proc else 0.0) - server_cpu0
    adm = await admitted(stack) - before_adm
    recs = r["records"]
    assert isinstance(recs, list)
    ok = [x[2] for x in recs if x[3] == 200]
    wall = float(r["wall"])  # type: ignore[arg-type]
    cpu = r["cpu"]
    assert isinstance(cpu, list)
    out: dict[str, Any] = {"rps": len(ok) / wall, "p50": pct(ok, 0.5), "p99": pct(ok, 0.99),
           "non200": float(sum(1 for x in recs if x[3] != 200)), "admitted": adm,
           "envoy_cpu": float(cpu[0]), "sidecar_cpu": float(cpu[1]),
           "server_cpu": server_cpu / wall, "calls": 0.0, "evalsha": 0.0}
    if server:
        after = commandstats(server)
        calls = {k: after[k] - before_cmds.get(k, 0) for k in after}
        calls.pop("info", None)  # ours
        trips = {k: v for k, v in calls.items() if k not in IN_SCRIPT and v}
        out["calls"] = sum(trips.values()) / max(adm, 1)
        out["evalsha"] = sum(calls.get(k, 0) for k in LEDGER_CALLS) / max(adm, 1)
        out["inside"] = sum(v for k, v in calls.items() if k in IN_SCRIPT) / max(adm, 1)
        out["mix"] = trips
    return out


LINES: list[str] = []


def say(line: str) -> None:
    """Print, and keep for bench/out/coordination.txt."""
    print(line, flush=True)
    LINES.append(line)


def fmt(s: dict[str, Any]) -> str:
    line = (f"{s['rps']:>7,.0f} req/s  p50 {s['p50'] * 1e6:>6.0f} us  p99 "
            f"{s['p99'] * 1e6:>7.0f} us  cpu envoy {s['envoy_cpu']:.0%} sidecar "
            f"{s['sidecar_cpu']:.0%}")
    if s["calls"]:
        line += (f" valkey {s['server_cpu']:.0%}  round trips/admitted {s['calls']:.2f} "
                 f"(ledger calls {s['evalsha']:.2f}, {s['inside']:.0f} commands inside them)")
    return line + f"  non-200 {s['non200']:.0f}"


async def main_async(seconds: float, levels: list[int]) -> int:
    say("coordination: one replica, in-process admission (local) vs. through a "
          "valkey-server on loopback (fleet); Envoy --concurrency 1, 2 fake workers, "
          "0 s service time, preemption off; closed-loop saturation, then open loop.")
    server = ValkeyServer(Path(tempfile.mkdtemp(prefix="smg-bench-valkey-")))
    stacks: dict[str, Stack] = {}
    try:
        server.start()
        local = config(False)
        fleet = config(False)
        fleet.sidecar_args = ["--coordination-url", server.url, "--fleet-id", "bench",
                              "--replica-id", "bench-a"]
        for name, cfg in (("local", local), ("fleet", fleet)):
            stack = stacks[name] = Stack(cfg)
            await stack.start()
        best: dict[str, dict[str, Any]] = {}
        say(f"  saturation (closed loop, {seconds:g} s per point):")
        for c in levels:  # interleaved, so drift in the box's load hits both alike
            for name, stack in stacks.items():
                s = await point(stack, server if name == "fleet" else None, seconds,
                                concurrency=c)
                say(f"    {name:<6} conns={c:<3} {fmt(s)}")
                if name not in best or s["rps"] > best[name]["rps"]:
                    best[name] = s
        ratio = best["fleet"]["rps"] / best["local"]["rps"]
        say(f"  max rate fleet/local: {best['fleet']['rps']:,.0f} / "
              f"{best['local']['rps']:,.0f} = {ratio:.2f} (goal >= 0.70: "
              f"{'PASS' if ratio >= 0.7 else 'FAIL'})")
        # Two open-loop rates: half of local's best (the "same load"; near the
        # fleet stack's own limit when the ratio is low, so queueing shows), and half of
        # the fleet stack's best (neither saturated: the cost of the round trips alone).
        lat: dict[str, dict[str, Any]] = {}
        for label, rate in (("local's", 0.5 * best["local"]["rps"]),
                            ("fleet's", 0.5 * best["fleet"]["rps"])):
            say(f"  latency, open loop at 50% of {label} max = {rate:,.0f} req/s:")
            for name, stack in stacks.items():
                lat[name] = s = await point(stack, server if name == "fleet" else None,
                                            seconds, rate=rate)
                say(f"    {name:<6} {fmt(s)}")
            f, loc = lat["fleet"], lat["local"]
            say(f"    added by coordination: p50 {(f['p50'] - loc['p50']) * 1e6:+.0f} us, "
                  f"p99 {(f['p99'] - loc['p99']) * 1e6:+.0f} us")
        mix = ", ".join(f"{k} {v / max(f['admitted'], 1):.2f}"
                        for k, v in sorted(f["mix"].items(), key=lambda kv: -kv[1]) if v)
        # arrive + release; background loops come on top (rounded: a script load at
        # start-up or a cancel race may add a handful over thousands of requests)
        per_request = round(f["evalsha"], 2)
        say(f"  server round trips per admitted request (uncontended, open loop): "
              f"{per_request:.2f} on the request path (goal <= 2: "
              f"{'PASS' if per_request <= 2 else 'FAIL'}), {f['calls']:.2f} with the "
              f"replica's background heartbeats and notification pops; by command: {mix}")
        say(f"  where the time goes (open loop, CPU per request): sidecar local "
              f"{loc['sidecar_cpu'] / max(loc['rps'], 1) * 1e6:.0f} us vs fleet "
              f"{f['sidecar_cpu'] / max(f['rps'], 1) * 1e6:.0f} us, valkey "
              f"{f['server_cpu'] / max(f['rps'], 1) * 1e6:.0f} us (on this box valkey shares "
              f"the cores with Envoy, the sidecar, the workers and the load client)")
    finally:
        for stack in stacks.values():
            await stack.stop()
        server.stop()
    return 0


def main(argv: list[str] | None = None) -> int:
    rc = asyncio.run(main_async(*seconds_and_levels(argv, __doc__)))
    out_path("coordination.txt").write_text("\n".join(LINES) + "\n")
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
