"""Time-to-first-token targets under a 10x bulk flood: targets off vs on, same run.

Fleet: 2 fake workers x 4 slots; every request streams (the engine's time to first token
0.2 s, then 5 tokens 20 ms apart: ~0.28 s a slot, capacity ~29 req/s). Open loop through
Envoy + the sidecar (``devtools.stack``, edge shedding and preemption as shipped): anonymous
``bulk`` at 10x capacity plus a steady ``interactive`` stream (anonymous requests may take
interactive: ``--priority-scheduler-default-max-class interactive``; it reserves 2 slots,
about what it uses, so it seldom preempts). One priority.yaml, two ways: **off** (no
``ttft_target_ms``) and **on** (``deadline_mode: enforce``, interactive 500 ms, measured
only as interactive is not sheddable, bulk 1,500 ms); bulk's queue is 128 deep with a 3 s
timeout either way. Rounds alternate off/on, on/off, ..., each on a fresh stack.

Measured by the load client (``bench.rawload``'s keep-alive connections, in its own
process; each request tagged ``x-bench-id``): interactive TTFT (time to the response's
first byte), bulk goodput (bulk 200s completed within the sending window, per second), how
bulk was refused (at intake ``scheduler_over_target``, after waiting ``scheduler_queue_timeout``,
``scheduler_queue_full``, preempted) and bulk's wasted wait (seconds that requests later
refused spent waiting for that answer); the sidecar's counters are printed beside them.

One more run, targets on with ``--overload-hints``: each refusal's predicted wait
(``x-smg-queue-wait-ms``) and ``Retry-After`` against the wait it would really have had
at the queue's tail, from the workers' own clock: the first bulk dispatch after the
last bulk request queued at the refusal was dispatched (FIFO: the slot it would have had).
Their error is stated, not judged: a refusal is an arrival whose prediction exceeded the
budget, so the hints lean high by selection.

Goals (pooled over the rounds of each mode): interactive TTFT p99 on <= 1.1 x off (not
worse; 10 % for the noise of a p99 over ~50-100 samples on a shared box), bulk wasted wait
on <= 0.1 x off, bulk goodput on >= 0.9 x off.

    python -m bench.deadlines [--seconds 8] [--rounds 2] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import json
import time
from collections import Counter
from typing import Any

from bench import rawload
from bench._util import CpuMeter, loadavg, out_path, pct
from bench.httpload import through_envoy
from devtools.stack import Stack, StackConfig

WORKERS, SLOTS = 2, 4
SERVICE = 0.2  # the engine's time to first token
TOKENS, TOKEN_GAP = 5, 0.02
SLOT_TIME = SERVICE + (TOKENS - 1) * TOKEN_GAP
CAPACITY_RPS = WORKERS * SLOTS / SLOT_TIME
BULK_MULTIPLE = 10.0
INTERACTIVE_RPS = 6.0
INTERACTIVE_TARGET_MS, BULK_TARGET_MS = 500, 1500
BULK_QUEUE, BULK_TIMEOUT = 128, 3

PRIORITY = """{mode}classes:
  system: {{reserved_floor: 0}}
  interactive: {{reserved_floor: 2, reserved_per_slot: 0.0{inter}}}
  default: {{reserved_per_slot: 0.0}}
  bulk: {{queue_size: {queue}, queue_timeout_secs: {timeout}{bulk}}}
"""

GOAL_INTERACTIVE_P99 = 1.1  # on <= this x off
GOAL_WASTED = 0.1  # on <= this x off
GOAL_GOODPUT = 0.9  # on >= this x off
SLOW = 0.25  # interactive TTFT above this is counted (a bucket bound of the histogram)
INTER_TTFT, INTER = 'smg_sidecar_ttft_seconds_', '{class="interactive"}'
PRED_SUM = 'smg_sidecar_wait_prediction_error_seconds_sum{class="bulk"}'
PRED_COUNT = 'smg_sidecar_wait_prediction_error_seconds_count{class="bulk"}'

LINES: list[str] = []


def say(line: str = "") -> None:
    """Print, and keep for bench/out/deadlines.txt."""
    print(line, flush=True)
    LINES.append(line)


def priority_yaml(targets: bool) -> str:
    if not targets:
        return PRIORITY.format(mode="", inter="", bulk="", queue=BULK_QUEUE,
                               timeout=BULK_TIMEOUT)
    return PRIORITY.format(mode="deadline_mode: enforce\n",
                           inter=f", ttft_target_ms: {INTERACTIVE_TARGET_MS}",
                           bulk=f", ttft_target_ms: {BULK_TARGET_MS}",
                           queue=BULK_QUEUE, timeout=BULK_TIMEOUT)


# ------------------------------------------------------------------ the load client

BODY = json.dumps({"model": "bench", "stream": True,
                   "messages": [{"role": "user", "content": "hi"}]}).encode()


def encode(port: int, headers: dict[str, str], rid: str) -> bytes:
    """A streamed completion request tagged with its id (the workers record it)."""
    head = "".join(f"{k}: {v}\r\n" for k, v in {"Content-Type": "application/json",
                                                 **headers, "x-bench-id": rid}.items())
    return (f"POST {rawload.PATH} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n{head}"
            f"Content-Length: {len(BODY)}\r\n\r\n").encode() + BODY


def header(head: bytes, name: bytes) -> str:
    at = head.find(b"\r\n" + name + b":")
    if at < 0:
        return ""
    stop = head.find(b"\r\n", at + 2)
    return head[at + len(name) + 3:stop if stop > 0 else None].strip().decode()


class Conn(rawload.Conn):
    """rawload's connection, also noting when the response's first byte came and its head."""

    def __init__(self, client: rawload.Client) -> None:
        super().__init__(client)
        self.first = 0.0  # perf_counter of the current response's first byte
        self.head = b""  # its head, lower-cased

    def send(self, name: str, data: bytes) -> None:
        self.first = 0.0
        self.head = b""
        super().send(name, data)

    def data_received(self, data: bytes) -> None:
        if self.current is not None and not self.first:
            self.first = time.perf_counter()
        self.buf += data
        if not self.head and (end := self.buf.find(b"\r\n\r\n")) >= 0:
            self.head = bytes(self.buf[:end]).lower()
        super().data_received(b"")


class Client(rawload.Client):
    """rawload's pool with :class:`Conn`; per answer also the time to first byte,
    ``Retry-After`` and ``x-smg-queue-wait-ms`` (in ``extra``, beside ``records``)."""

    def __init__(self, port: int) -> None:
        super().__init__(port)
        self.extra: list[tuple[float, str, str]] = []

    async def _open(self) -> None:  # rawload's, with this module's Conn
        try:
            await self.loop.create_connection(lambda: Conn(self), "127.0.0.1", self.port)
        except OSError:
            if self.waiting:
                self.waiting.popleft()
                self._finish()
                self.errors += 1

    def answered(self, conn: rawload.Conn, cur: tuple[str, float], status: int, code: str,
                 reuse: bool) -> None:
        assert isinstance(conn, Conn)
        self.extra.append((conn.first - cur[1], header(conn.head, b"retry-after"),
                           header(conn.head, b"x-smg-queue-wait-ms")))
        super().answered(conn, cur, status, code, reuse)


async def run_client(spec: dict[str, Any]) -> dict[str, Any]:
    """Warm up (each stream's class in turn), then every stream evenly paced at its rate."""
    port, seconds = int(spec["port"]), float(spec["seconds"])
    timeout = float(spec.get("timeout", 30))
    pids = [int(p) for p in spec.get("pids", [])]
    streams = spec["streams"]
    client = Client(port)
    for i in range(int(spec.get("warmup", 0))):
        s = streams[i % len(streams)]
        client.submit(f"warmup#{i}", encode(port, s.get("headers", {}), f"w{i}"))
        await asyncio.wait_for(client.all_done.wait(), timeout)
    client.records.clear()
    client.extra.clear()
    sent = [0] * len(streams)
    meter = CpuMeter(pids)
    t0 = client.t0 = time.perf_counter()
    send_start = time.time()
    end = t0 + seconds
    while (now := time.perf_counter()) < end:
        for i, s in enumerate(streams):
            for _ in range(int((now - t0) * float(s["rate"])) - sent[i]):
                rid = f"{s['name']}#{sent[i]}"
                client.submit(rid, encode(port, s.get("headers", {}), rid))
                sent[i] += 1
        await asyncio.sleep(0.001)
    send_wall = time.perf_counter() - t0
    cpu, pcpu = meter.per_second(send_wall)
    await client.drain(timeout + 5)
    client.close()
    # (stream, id, sent offset, latency to the last byte, status, code, ttfb, retry-after,
    #  wait hint ms)
    records = [(name.split("#")[0], name, off, lat, status, code, *x)
               for (name, off, lat, status, code), x in zip(
                   client.records, client.extra, strict=True)]
    return {"send_wall": send_wall, "send_start": send_start, "records": records,
            "errors": client.errors, "client_cpu": cpu, "cpu": pcpu,
            "connections": client.opened}


# ------------------------------------------------------------------ one stack, one run

def streams() -> list[dict[str, object]]:
    return [{"name": "interactive", "rate": INTERACTIVE_RPS,
             "headers": {"x-smg-priority": "interactive"}},
            {"name": "bulk", "rate": BULK_MULTIPLE * CAPACITY_RPS - INTERACTIVE_RPS,
             "headers": {"x-smg-priority": "bulk"}}]


async def settle(stack: Stack, timeout: float = 15.0) -> dict[str, float]:
    """The sidecar's metrics once nothing is in flight or queued (said if not so within
    ``timeout``: the counters printed are then partial)."""
    deadline = time.monotonic() + timeout
    while True:
        m = await stack.metrics()
        busy = sum(v for k, v in m.items() if k.startswith(
            ("smg_scheduler_inflight{", "smg_scheduler_queue_depth{")))
        if busy == 0:
            return m
        if time.monotonic() > deadline:
            say(f"    (the sidecar still holds {busy:.0f} after {timeout:g} s: its counters "
                "below are partial)")
            return m
        await asyncio.sleep(0.1)


def delta(m0: dict[str, float], m1: dict[str, float], key: str) -> float:
    return m1.get(key, 0.0) - m0.get(key, 0.0)


async def one(mode: str, seconds: float) -> dict[str, Any]:
    """A fresh stack in ``mode`` (off, on, hints), loaded for ``seconds``."""
    args = ["--priority-scheduler-default-max-class", "interactive"]
    if mode == "hints":
        args.append("--overload-hints")
    cfg = StackConfig(workers=WORKERS, max_running_requests=SLOTS, service_time=SERVICE,
                      priority_yaml=priority_yaml(mode != "off"), sidecar_args=args,
                      log_level="warning", health_interval_secs=1.0)
    stack = Stack(cfg)
    try:
        await stack.start()
        for w in stack.fleet.workers:
            w.tokens, w.stream_interval = TOKENS, TOKEN_GAP
        la0 = loadavg()
        m0 = await stack.metrics()
        r: dict[str, Any] = await through_envoy(
            stack, seconds, streams(), client="bench.deadlines", timeout=BULK_TIMEOUT + 10,
            warmup=8)
        la1 = loadavg()
        m1 = await settle(stack)
        # The workers' clock: when each tagged request reached a worker (its dispatch).
        dispatched = {rec.headers["x-bench-id"]: rec.started_at
                      for w in stack.fleet.workers for rec in w.records  # type: ignore[union-attr]
                      if "x-bench-id" in rec.headers}
    finally:
        await stack.stop()
    return summarise(mode, seconds, r, m0, m1, dispatched, f"{la0} -> {la1}")


def summarise(mode: str, seconds: float, r: dict[str, Any], m0: dict[str, float],
              m1: dict[str, float], dispatched: dict[str, float], la: str) -> dict[str, Any]:
    recs = r["records"]
    window = float(r["send_wall"])
    inter = [x for x in recs if x[0] == "interactive"]
    bulk = [x for x in recs if x[0] == "bulk"]
    refused = [x for x in bulk if x[4] != 200]
    kinds = Counter(x[5] if x[5] else f"status {x[4]}" for x in refused)
    admit = 'smg_scheduler_admit_total{{class="bulk",outcome="{}"}}'
    res: dict[str, Any] = {
        "mode": mode, "seconds": seconds, "window": window, "loadavg": la,
        "errors": r["errors"], "cpu_sidecar": r["cpu"][1], "cpu_envoy": r["cpu"][0],
        "cpu_client": r["client_cpu"],
        "inter_sent": len(inter), "inter_statuses": dict(Counter(x[4] for x in inter)),
        "inter_ttfb": [x[6] for x in inter if x[4] == 200],
        "inter_slow": sum(1 for x in inter if x[4] == 200 and x[6] > SLOW),
        "inter_slow_envoy": delta(m0, m1, INTER_TTFT + "count" + INTER) - delta(
            m0, m1, f'{INTER_TTFT}bucket{{class="interactive",le="{SLOW}"}}'),
        "bulk_sent": len(bulk),
        "bulk_ok_in_window": sum(1 for x in bulk if x[4] == 200 and x[2] + x[3] <= window),
        "bulk_ok": sum(1 for x in bulk if x[4] == 200),
        "bulk_ttfb": [x[6] for x in bulk if x[4] == 200],
        "refused": dict(kinds), "wasted": sum(x[3] for x in refused),
        "wasted_by": {k: sum(x[3] for x in refused if (x[5] or f"status {x[4]}") == k)
                      for k in kinds},
        "counters": {o: delta(m0, m1, admit.format(o)) for o in (
            "rejected_over_target", "rejected_queue_timeout", "rejected_queue_full")},
        "edge_shed": delta(m0, m1, 'smg_sidecar_edge_shed_total{class="bulk"}'),
        "prediction_mae": delta(m0, m1, PRED_SUM) / max(1.0, delta(m0, m1, PRED_COUNT)),
        "predictions": delta(m0, m1, PRED_COUNT),
        "underpredicted": delta(m0, m1, 'smg_sidecar_wait_underpredicted_total{class="bulk"}'),
        "preemptions": sum(delta(m0, m1, k) for k in m1
                           if k.startswith("smg_scheduler_preemption_total")),
    }
    if mode == "hints":
        res["hints"] = hint_errors(r, dispatched)
    return res


def hint_errors(r: dict[str, Any], dispatched: dict[str, float]) -> dict[str, Any]:
    """Each refusal's hint vs the wait it would have had at the queue's tail (docstring)."""
    t0 = float(r["send_start"])
    bulk = [x for x in r["records"] if x[0] == "bulk"]
    # Dispatch times (workers' clock) of every bulk request, and of those that queued:
    # (sent, dispatched) for each tagged bulk request that reached a worker.
    sent_at = {x[1]: t0 + x[2] for x in bulk}
    pairs = sorted((sent_at[rid], d) for rid, d in dispatched.items() if rid in sent_at)
    starts = sorted(d for _, d in pairs)
    sent_sorted = [s for s, _ in pairs]
    rows = []
    skipped = 0
    for x in bulk:
        if x[4] == 200 or not x[8]:
            continue
        at = t0 + x[2] + x[3]  # when the refusal came back (the decision was just before)
        # The last of the requests sent before it and dispatched after it: the queue's tail.
        ahead = [d for _, d in pairs[:bisect.bisect_left(sent_sorted, t0 + x[2])] if d > at]
        tail = max(ahead, default=at)
        i = bisect.bisect_right(starts, tail)
        if i == len(starts):
            skipped += 1  # the run ended before a slot came free for it
            continue
        real = starts[i] - at
        rows.append((int(x[8]) / 1000, float(x[7]), real))
    err = [h - real for h, _, real in rows]
    ra = [a - real for _, a, real in rows]
    return {
        "n": len(rows), "skipped": skipped,
        "real_p50": pct([x[2] for x in rows], 0.5), "hint_p50": pct([x[0] for x in rows], 0.5),
        "retry_after": dict(sorted(Counter(int(x[1]) for x in rows).items())),
        "mean_error": sum(err) / len(err) if err else float("nan"),
        "mae": sum(abs(e) for e in err) / len(err) if err else float("nan"),
        "p90_abs": pct([abs(e) for e in err], 0.9),
        "ra_mean_error": sum(ra) / len(ra) if ra else float("nan"),
        "ra_mae": sum(abs(e) for e in ra) / len(ra) if ra else float("nan"),
    }


# ------------------------------------------------------------------ report

def ms(v: float) -> str:
    return f"{v * 1e3:,.0f} ms"


def show(res: dict[str, Any]) -> None:
    w = res["window"]
    ttfb = res["inter_ttfb"]
    bt = res["bulk_ttfb"]
    say(f"  targets {res['mode']:<5}: interactive {res['inter_sent']} sent "
        f"{res['inter_statuses']}, TTFT p50 {ms(pct(ttfb, 0.5))} p99 {ms(pct(ttfb, 0.99))} "
        f"(over {ms(SLOW)}: {res['inter_slow']}, by Envoy's clock {res['inter_slow_envoy']:.0f}); "
        f"bulk {res['bulk_sent']} sent, goodput {res['bulk_ok_in_window'] / w:.1f} req/s "
        f"({res['bulk_ok']} 200s, TTFT p50 {ms(pct(bt, 0.5))} p99 {ms(pct(bt, 0.99))})")
    c = res["counters"]
    kinds = ", ".join(f"{k} {n} ({res['wasted_by'][k]:.1f} s)"
                      for k, n in sorted(res["refused"].items()))
    say(f"    bulk refused (count, wait spent): {kinds}; wasted wait {res['wasted']:.1f} s, "
        f"{res['wasted'] / w:.2f} s per second")
    say(f"    sidecar: over_target {c['rejected_over_target']:.0f}, queue_timeout "
        f"{c['rejected_queue_timeout']:.0f}, queue_full {c['rejected_queue_full']:.0f} (Envoy "
        f"shed {res['edge_shed']:.0f} of them), preemptions {res['preemptions']:.0f}; its "
        f"predictions for bulk that queued: {res['predictions']:.0f}, mean |error| "
        f"{ms(res['prediction_mae'])}, {res['underpredicted']:.0f} waited longer; cpu sidecar "
        f"{res['cpu_sidecar']:.0%} envoy {res['cpu_envoy']:.0%} client "
        f"{res['cpu_client']:.0%}; {res['errors']} client errors; load average {res['loadavg']}")
    if "hints" in res:
        h = res["hints"]
        say(f"    overload hints: {h['n']} refusals with a hint ({h['skipped']} too late to "
            f"check); real tail wait p50 {ms(h['real_p50'])}, hint p50 {ms(h['hint_p50'])}; "
            f"hint - real: mean {ms(h['mean_error'])}, mean |error| {ms(h['mae'])}, p90 "
            f"|error| {ms(h['p90_abs'])}; Retry-After values {h['retry_after']} "
            f"(- real: mean {h['ra_mean_error']:+.2f} s, mean |error| {h['ra_mae']:.2f} s)")


def pooled(results: list[dict[str, Any]], mode: str) -> dict[str, float]:
    rs = [x for x in results if x["mode"] == mode]
    return {"inter_p99": pct([t for x in rs for t in x["inter_ttfb"]], 0.99),
            "inter_p50": pct([t for x in rs for t in x["inter_ttfb"]], 0.5),
            "wasted": sum(x["wasted"] for x in rs) / sum(x["window"] for x in rs),
            "goodput": sum(x["bulk_ok_in_window"] for x in rs) / sum(x["window"] for x in rs)}


def goals(results: list[dict[str, Any]]) -> bool:
    off, on = pooled(results, "off"), pooled(results, "on")
    say(f" pooled: interactive TTFT p50 off {ms(off['inter_p50'])} on {ms(on['inter_p50'])}, "
        f"p99 off {ms(off['inter_p99'])} on {ms(on['inter_p99'])}; bulk wasted wait off "
        f"{off['wasted']:.2f} on {on['wasted']:.2f} s per second of flood; bulk goodput off "
        f"{off['goodput']:.1f} on {on['goodput']:.1f} req/s")
    checks = {
        f"interactive TTFT p99 on <= {GOAL_INTERACTIVE_P99:g} x off "
        f"({on['inter_p99'] / off['inter_p99']:.2f} x)":
            on["inter_p99"] <= GOAL_INTERACTIVE_P99 * off["inter_p99"],
        f"bulk wasted wait on <= {GOAL_WASTED:g} x off "
        f"({on['wasted'] / off['wasted'] if off['wasted'] else float('inf'):.3f} x)":
            on["wasted"] <= GOAL_WASTED * off["wasted"],
        f"bulk goodput on >= {GOAL_GOODPUT:g} x off ({on['goodput'] / off['goodput']:.2f} x)":
            on["goodput"] >= GOAL_GOODPUT * off["goodput"],
    }
    for text, ok in checks.items():
        say(f"    {'PASS' if ok else 'FAIL'}  {text}")
    return all(checks.values())


async def main_async(seconds: float, rounds: int, command: str) -> int:
    say(f"$ {command}")
    say(f"deadlines: {WORKERS} fake workers x {SLOTS} slots, streamed (first byte "
        f"{ms(SERVICE)}, {TOKENS} tokens {ms(TOKEN_GAP)} apart: capacity "
        f"{CAPACITY_RPS:.1f} req/s); bulk {BULK_MULTIPLE:g}x capacity + interactive "
        f"{INTERACTIVE_RPS:g} req/s, {seconds:g} s per run, {rounds} round(s) alternating "
        f"off/on; bulk queue {BULK_QUEUE}, timeout {BULK_TIMEOUT} s; targets on: enforce, "
        f"interactive {INTERACTIVE_TARGET_MS} ms, bulk {BULK_TARGET_MS} ms; load average "
        f"{loadavg()}")
    results = []
    for n in range(rounds):
        say(f" round {n + 1}")
        for mode in (("off", "on") if n % 2 == 0 else ("on", "off")):
            res = await one(mode, seconds)
            show(res)
            results.append(res)
    say(" targets on, --overload-hints")
    res = await one("hints", seconds)
    show(res)
    results.append(res)
    out_path("deadlines.json").write_text(json.dumps(results))
    ok = goals(results)
    say(f" overall: {'PASS' if ok else 'FAIL'}")
    return 0  # the verdict is the text, as in bench.demo_flood and bench.isolation


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=8.0, help="flood seconds per run")
    p.add_argument("--rounds", type=int, default=2, help="rounds of off/on (alternating)")
    p.add_argument("--quick", action="store_true", help="one round of 5 s runs")
    p.add_argument("--client", help=argparse.SUPPRESS)  # the load client's own process
    a = p.parse_args(argv)
    if a.client:
        print(json.dumps(asyncio.run(run_client(json.loads(a.client)))))
        return 0
    seconds, rounds = (5.0, 1) if a.quick else (a.seconds, a.rounds)
    command = "python -m bench.deadlines" + (" --quick" if a.quick else
                                             f" --seconds {seconds:g} --rounds {rounds}")
    LINES.clear()
    rc = asyncio.run(main_async(seconds, rounds, command))
    out_path("deadlines.txt").write_text("\n".join(LINES) + "\n")
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
