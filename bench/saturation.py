"""The saturation guard: interactive queue wait while bulk floods a worker that was
over-reported (the real stack: Envoy + sidecar + a fake vLLM worker).

One fake vLLM worker (no dev mode, so it does not expose its cap) really runs at
most 4 requests at once (its batch; the rest wait in its own FIFO queue, as
vLLM's scheduler does), each for 200 ms. The sidecar was told 16
(``--worker-engine vllm --worker-max-running-requests 16``). Open-loop load:
bulk at 3x the worker's real throughput, interactive at 2 req/s (JWT tenant
with an interactive ceiling). Run twice in the same run, without and with
``--saturation-guard``. Interactive queue wait = end-to-end latency of a 200
minus the 200 ms service time (client side): time spent in the sidecar's class
queue plus time spent in the engine's queue.

    python -m bench.saturation [--seconds 10] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from bench._util import pct
from bench.httpload import through_envoy
from devtools.demo import make_token
from devtools.stack import Stack, StackConfig

SECRET = "bench-secret"
SERVICE = 0.2
REAL_SLOTS, TOLD = 4, 16
REAL_RPS = REAL_SLOTS / SERVICE
PRIORITY = """
# Small floors: with the guard, capacity is the worker's real 4, and every slot a floor
# reserves for an idle class is one bulk cannot use.
classes:
  system: {reserved_floor: 0, queue_size: 8, queue_timeout_secs: 20}
  interactive: {reserved_floor: 1, reserved_per_slot: 0.0, queue_size: 64,
                queue_timeout_secs: 20, starvation_threshold_secs: 10}
  default: {reserved_floor: 0, reserved_per_slot: 0.0, queue_size: 8, queue_timeout_secs: 20}
  bulk: {queue_size: 128, queue_timeout_secs: 20, starvation_threshold_secs: 30}
tenant_policies:
  "auth:acme": {max_class: interactive}
"""


def streams(bulk_multiple: float) -> list[dict[str, object]]:
    return [
        {"name": "interactive", "rate": 2.0, "headers": {
            "x-smg-priority": "interactive",
            "authorization": f"Bearer {make_token('auth:acme', SECRET)}"}},
        {"name": "bulk", "rate": bulk_multiple * REAL_RPS, "headers": {"x-smg-priority": "bulk"}},
    ]


async def run_mode(guard: bool, seconds: float) -> dict[str, Any]:
    args = ["--worker-engine", "vllm", "--worker-max-running-requests", str(TOLD)]
    if guard:
        args.append("--saturation-guard")
    cfg = StackConfig(workers=1, max_running_requests=None, service_time=SERVICE,
                      priority_yaml=PRIORITY, jwt_secret=SECRET, preemption=False,
                      log_level="warning", flush_interval_secs=5.0, health_interval_secs=0.1,
                      sidecar_args=args, edge_shed=False)  # the Check path measured
    stack = Stack(cfg)
    worker = stack.fleet.workers[0]
    worker.engine, worker.batch_limit = "vllm", REAL_SLOTS  # read per request
    try:
        await stack.start()
        r = await through_envoy(stack, seconds, streams(3.0), timeout=30, margin=90, warmup=2,
                                warmup_headers={"x-smg-priority": "system"})
        metrics = await stack.metrics()
    finally:
        await stack.stop()
    recs = r["records"]
    out: dict[str, Any] = {"peak_running": worker.peak_running,
                           "worker_finished": worker.finished}
    for cls in ("interactive", "bulk"):
        rows = [x for x in recs if x[0] == cls]
        # Only requests sent while bulk floods (the first second fills the queues).
        waits = [max(0.0, x[2] - SERVICE) for x in rows if x[3] == 200 and x[1] >= 1.0]
        out[cls] = {"sent": len(rows), "ok": sum(1 for x in rows if x[3] == 200),
                    "p50": pct(waits, 0.5), "p95": pct(waits, 0.95), "max": max(waits or [0])}
    out["worker_capacity"] = {k: v for k, v in metrics.items()
                              if k.startswith("smg_sidecar_worker_capacity")}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--quick", action="store_true", help="5 s per mode")
    args = p.parse_args(argv)
    seconds = 5.0 if args.quick else args.seconds
    print(__doc__.split("\n\n")[1].replace("\n", "\n  ").join(["saturation: ", ""]))
    results = {}
    for guard in (False, True):
        results[guard] = asyncio.run(run_mode(guard, seconds))
    print(f"  {'guard':<6} {'class':<12} {'sent':>5} {'200':>5} {'wait p50':>9} "
          f"{'wait p95':>9} {'wait max':>9}")
    for guard, res in results.items():
        for cls in ("interactive", "bulk"):
            c = res[cls]
            print(f"  {'on' if guard else 'off':<6} {cls:<12} {c['sent']:>5} {c['ok']:>5} "
                  f"{c['p50'] * 1e3:>7.0f}ms {c['p95'] * 1e3:>7.0f}ms {c['max'] * 1e3:>7.0f}ms")
    for guard, res in results.items():
        print(f"  guard {'on' if guard else 'off'}: the worker finished {res['worker_finished']} "
              f"requests, at most {res['peak_running']} at once (its real batch)")
    off, on = results[False]["interactive"], results[True]["interactive"]
    ok = on["p95"] < off["p95"] / 2
    print(f"  {'PASS' if ok else 'FAIL'}  interactive p95 queue wait with the guard "
          f"{on['p95'] * 1e3:.0f} ms < half of without {off['p95'] * 1e3:.0f} ms")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
