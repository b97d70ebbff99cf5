"""Check throughput and latency over gRPC: the sidecar vs. a no-op grpc.aio server.

Setup (2 cores, loopback): the server under test runs in its own process; the load
client runs in another process (grpc.aio, identity serialisers, one pre-serialised
CheckRequest with 10 headers). Per allowed response the client reads the admission
id from dynamic_metadata and sends the ALS DownstreamEnd entry on a long-lived
StreamAccessLogs stream (fed by an asyncio.Queue), so the sidecar releases every
slot through its real completion path. The no-op server gets the same calls and
the same ALS entries (it drains them), so the client's work is identical and the
ratio compares server cost. CPU of client and server over each window is printed:
a server near 100 % of a core is the bottleneck.

  (a) no-op: ``python -m bench.noop`` (pre-serialised OK, no decode)
  (b) sidecar: ``python -m sidecar --priority-scheduler-enabled
      --worker-capacity-override 1000000 ...`` (scheduler on, built-in classes)

    python -m bench.check_throughput [--seconds 3] [--quick]

``--tracing-only``: the cost of admission traces (``--otlp-endpoint``) on the Check path,
same-run ratios against a sidecar with tracing off: saturation and sidecar CPU per Check
at 1 % (requests without a ``traceparent``, and with an unsampled one: the propagator's
parse on every Check) and at 100 %, exporting to ``devtools.otlp`` (counting only) in a
process of its own. Writes bench/out/tracing.txt.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
from envoy.data.accesslog.v3 import accesslog_pb2
from envoy.service.accesslog.v3 import als_pb2
from envoy.service.auth.v3 import external_auth_pb2
from google.rpc import code_pb2

from bench._util import (
    cpu_seconds,
    free_port,
    loadavg,
    out_path,
    pct,
    run_client,
    spawn,
    terminate,
    wait_tcp,
)
from bench.codec import check_request_bytes
from devtools.httpclient import get as http_get
from sidecar import codec
from sidecar.tracing import SCHEDULE_DELAY_MS

CHECK = "/envoy.service.auth.v3.Authorization/Check"
ALS = "/envoy.service.accesslog.v3.AccessLogService/StreamAccessLogs"
CHANNEL_OPTIONS = [("grpc.max_concurrent_streams", 10_000)]


# ---------------------------------------------------------------------- client side


def als_bytes(aid: str) -> bytes:
    msg = als_pb2.StreamAccessLogsMessage()
    msg.identifier.log_name = "smg_completion"
    e = msg.http_logs.log_entry.add()
    cp = e.common_properties
    cp.access_log_type = accesslog_pb2.DownstreamEnd
    cp.metadata.filter_metadata[codec.AUTHZ_NAMESPACE].fields[
        codec.ADMISSION_ID_KEY].string_value = aid
    e.response.response_code.value = 200
    out: bytes = msg.SerializeToString()
    return out


def admission_id(data: bytes) -> str | None:
    resp = external_auth_pb2.CheckResponse.FromString(data)
    if resp.status.code != code_pb2.OK:
        return None
    return str(resp.dynamic_metadata.fields[codec.ADMISSION_ID_KEY].string_value)


class Releaser:
    """One long-lived StreamAccessLogs stream fed by a queue."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.queue: asyncio.Queue[bytes | None] = asyncio.Queue()
        als: grpc.aio.StreamUnaryMultiCallable[bytes, bytes] = channel.stream_unary(ALS)
        self.call: grpc.aio.StreamUnaryCall[bytes, bytes] = als(self._gen())

    async def _gen(self) -> AsyncIterator[bytes]:
        while True:
            item = await self.queue.get()
            if item is None:
                return
            yield item

    async def close(self) -> None:
        self.queue.put_nowait(None)
        await self.call


async def _checks(spec: dict[str, object]) -> dict[str, object]:
    port = int(str(spec["port"]))
    seconds = float(str(spec["seconds"]))
    server_pid = int(str(spec["server_pid"]))
    rate = float(str(spec.get("rate", 0)))
    concurrency = int(str(spec.get("concurrency", 64)))
    release = bool(spec.get("release", True))
    headers = spec.get("headers")
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS)
    check: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(CHECK)
    req = check_request_bytes(headers if isinstance(headers, dict) else None)
    rel = Releaser(channel) if release else None
    lat: list[float] = []
    errors = 0
    denied = 0

    async def one() -> None:
        nonlocal errors, denied
        t = time.perf_counter()
        try:
            data = await check(req, timeout=10)
        except grpc.aio.AioRpcError:
            errors += 1
            return
        lat.append(time.perf_counter() - t)
        aid = admission_id(data)
        if aid is None:
            denied += 1
        elif rel is not None:
            rel.queue.put_nowait(als_bytes(aid))

    for _ in range(50):  # warm-up: connection, server code paths
        await one()
    lat.clear()
    cpu0, scpu0 = time.process_time(), cpu_seconds(server_pid)
    tasks: set[asyncio.Task[None]] = set()
    t0 = time.perf_counter()
    end = t0 + seconds
    if rate <= 0:  # closed loop: `concurrency` callers back to back
        async def caller() -> None:
            while time.perf_counter() < end:
                await one()
        await asyncio.gather(*(caller() for _ in range(concurrency)))
    else:  # open loop: launch on schedule, whatever is outstanding
        sent = 0
        while (now := time.perf_counter()) < end:
            due = int((now - t0) * rate) - sent
            for _ in range(due):
                task = asyncio.create_task(one())
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            sent += due
            await asyncio.sleep(0.0005)
    # Rates and CPU over the sending window; stragglers are drained afterwards and
    # count in the latency percentiles only.
    wall = time.perf_counter() - t0
    cpu, scpu = time.process_time() - cpu0, cpu_seconds(server_pid) - scpu0
    in_window = len(lat)
    if rate > 0 and tasks:
        await asyncio.wait(tasks, timeout=10)
    if rel is not None:
        await rel.close()
    await channel.close()
    return {"n": len(lat), "rps": in_window / wall, "p50": pct(lat, 0.5), "p99": pct(lat, 0.99),
            "errors": errors, "denied": denied, "client_cpu": cpu / wall,
            "server_cpu": scpu / wall}


async def _als(spec: dict[str, object]) -> dict[str, object]:
    """Admit up to `count` requests (no release), then blast their ALS entries on
    `streams` streams and time until the server has consumed them all."""
    port = int(str(spec["port"]))
    server_pid = int(str(spec["server_pid"]))
    count = int(str(spec["count"]))
    streams = int(str(spec.get("streams", 4)))
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS)
    check: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(CHECK)
    als: grpc.aio.StreamUnaryMultiCallable[bytes, bytes] = channel.stream_unary(ALS)
    req = check_request_bytes()
    msgs: list[bytes] = []
    end = time.perf_counter() + float(str(spec["admit_seconds"]))

    async def admitter() -> None:
        while len(msgs) < count and time.perf_counter() < end:
            aid = admission_id(await check(req, timeout=10))
            if aid is not None:
                msgs.append(als_bytes(aid))
    await asyncio.gather(*(admitter() for _ in range(64)))
    await als(iter(msgs[:10]))  # warm-up stream (releases 10)
    msgs = msgs[10:]

    def part(i: int) -> Iterator[bytes]:
        return iter(msgs[i::streams])

    cpu0, scpu0 = time.process_time(), cpu_seconds(server_pid)
    t0 = time.perf_counter()
    await asyncio.gather(*(als(part(i), timeout=60) for i in range(streams)))
    wall = time.perf_counter() - t0
    cpu, scpu = time.process_time() - cpu0, cpu_seconds(server_pid) - scpu0
    await channel.close()
    return {"n": len(msgs), "eps": len(msgs) / wall, "client_cpu": cpu / wall,
            "server_cpu": scpu / wall}


def client(spec: dict[str, object]) -> dict[str, object]:
    if spec["kind"] == "als":
        return asyncio.run(_als(spec))
    return asyncio.run(_checks(spec))


# ------------------------------------------------------------------------ servers


@dataclass
class Server:
    name: str
    port: int
    proc: object
    http_port: int = 0

    @property
    def pid(self) -> int:
        return int(self.proc.pid)  # type: ignore[attr-defined]


def start_noop(log: Path | None = None) -> Server:
    port = free_port()
    proc = spawn([sys.executable, "-m", "bench.noop", "--port", str(port)], log)
    wait_tcp(port, proc=proc)
    return Server("no-op", port, proc)


# Every class without reservations and without a queue: at capacity 1 (and no release)
# every Check after the first is answered "queue full" at once.
SHED_ONLY = "classes:\n" + "".join(
    f"  {c}: {{reserved_floor: 0, reserved_per_slot: 0.0, queue_size: 0}}\n"
    for c in ("system", "interactive", "default", "bulk"))


def start_sidecar(log: Path | None = None, *, capacity: int = 1000000,
                  priority_yaml: str | None = None, log_level: str = "warning",
                  name: str = "sidecar", extra: Sequence[str] = ()) -> Server:
    port, http = free_port(), free_port()
    argv = [sys.executable, "-m", "sidecar", "--priority-scheduler-enabled",
            "--worker-capacity-override", str(capacity),
            "--grpc-listen", f"127.0.0.1:{port}", "--http-listen", f"127.0.0.1:{http}",
            "--log-format", "json", "--log-level", log_level, *extra]
    if priority_yaml is not None:
        path = Path(tempfile.mkdtemp(prefix="smg-check-")) / "priority.yaml"
        path.write_text(priority_yaml)
        argv += ["--priority-scheduler-config", str(path)]
    proc = spawn(argv, log)
    wait_tcp(port, proc=proc)
    wait_tcp(http, proc=proc)
    return Server(name, port, proc, http)


def shed_cost(seconds: float, rate: float, log_level: str, rounds: int = 3) -> None:
    """Sidecar CPU per Check answered "queue full" vs per admitted Check (+ its ALS release),
    and vs an admitted request with its ext_proc stream too (the shipped config's loop).

    Shapes alternate round by round and the medians are compared: on a shared box one
    window's figure moves by tens of microseconds. The stream's cost is measured as
    bench.ext_proc_cost does (closed loop, Check+ALS vs Check+stream+ALS on the admitting
    sidecar, with bench.ext_proc_cost's client; an open loop at ``rate`` with streams
    would saturate the 2-core box).
    """
    side = start_sidecar(log_level=log_level)
    shed = start_sidecar(capacity=1, priority_yaml=SHED_ONLY, log_level=log_level,
                         name="shedding")
    stream_secs = min(seconds, 2.0)
    try:
        print(f"  shed vs admitted (open loop {rate:,.0f} req/s, {seconds:g} s, --log-level "
              f"{log_level}, {rounds} alternating rounds; sidecar CPU per request = server "
              f"cpu / rate; ext_proc stream = closed-loop difference, 8 callers, "
              f"{stream_secs:g} s):")
        per: dict[str, list[float]] = {"admitted": [], "shed": [], "stream": []}
        for i in range(rounds):
            order = [(side, True), (shed, False)]
            for server, release in (order if i % 2 == 0 else order[::-1]):
                r = measure(server, seconds=seconds, rate=rate, release=release)
                us = num(r, "server_cpu") / max(1.0, num(r, "rps")) * 1e6
                per["admitted" if server is side else "shed"].append(us)
                print(f"    round {i} {server.name:<8} {fmt(r)}  -> {us:.0f} us cpu/request")
            pair = {}
            for with_stream in (False, True):
                r = run_client("bench.ext_proc_cost", {
                    "port": side.port, "server_pid": side.pid, "seconds": stream_secs,
                    "callers": 8, "stream": with_stream}, timeout=120)
                pair[with_stream] = num(r, "us")
            per["stream"].append(pair[True] - pair[False])
            print(f"    round {i} ext_proc stream: check+als {pair[False]:.0f} us, "
                  f"check+stream+als {pair[True]:.0f} us -> stream "
                  f"{pair[True] - pair[False]:+.0f} us  (load {loadavg()})")
        adm, sh, st = (statistics.median(per[k]) for k in ("admitted", "shed", "stream"))
        print(f"  medians: admitted {adm:.0f} us (Check + ALS entry), with its ext_proc stream "
              f"{adm + st:.0f} us; shed {sh:.0f} us")
        print(f"  a shed Check costs {sh / adm:.2f}x an admitted one (Check + ALS entry), "
              f"{sh / (adm + st):.2f}x an admitted one with its ext_proc stream")
    finally:
        terminate(side.proc)  # type: ignore[arg-type]
        terminate(shed.proc)  # type: ignore[arg-type]


# A caller's trace its upstream chose not to sample: the sidecar parses it and follows.
UNSAMPLED_PARENT = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00"}


async def _handler_cost(endpoint: str, n: int, rounds: int,
                        say: Callable[[str], None]) -> None:
    """The Check handler alone, in this process (no gRPC): CPU per decision + release, the
    exporter's thread included (process time), tracing off / 1 % / 1 % with an unsampled
    parent / 100 %, shapes alternating, medians compared."""
    from sidecar import logs  # the sidecar in this process: only here
    from sidecar.app import build_runtime
    from sidecar.config import parse_settings

    class Call:
        """What the handler asks of its gRPC call: who asked (Envoy's address)."""

        def peer(self) -> str:
            return "ipv4:127.0.0.1:40000"

    logs.configure("json", "error")

    base = ["--priority-scheduler-enabled", "--worker-capacity-override", "1000000",
            "--grpc-listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0",
            "--log-format", "json", "--log-level", "warning"]
    otlp = ["--otlp-endpoint", endpoint, "--trace-sample-ratio"]
    apps = {"off": await build_runtime(parse_settings(base)),
            "1 %": await build_runtime(parse_settings([*base, *otlp, "0.01"])),
            "100 %": await build_runtime(parse_settings([*base, *otlp, "1"]))}
    shapes = [("off", "off", None), ("1 %", "1 %", None),
              ("1 %, unsampled parent", "1 %", UNSAMPLED_PARENT), ("100 %", "100 %", None)]
    per: dict[str, list[float]] = {name: [] for name, _, _ in shapes}
    call = Call()
    try:
        for i in range(rounds):
            for name, app_name, headers in (shapes if i % 2 == 0 else shapes[::-1]):
                app = apps[app_name]
                req = check_request_bytes(headers)
                handler = app.authz.handler
                t0 = time.process_time()
                for _ in range(n):
                    aid = admission_id(await handler(req, call))  # type: ignore[arg-type]
                    assert aid is not None
                    app.pools.release(aid)
                per[name].append((time.process_time() - t0) / n * 1e6)
                # The 100 % shape's spans exported before the next shape is timed.
                await asyncio.sleep(1.2 * SCHEDULE_DELAY_MS / 1000)
        base_us = statistics.median(per["off"])
        say(f"  the Check handler in process (decide + release, no gRPC; CPU of the process, "
            f"exporter thread included), {n:,} Checks per point, {rounds} alternating rounds:")
        for name, _, _ in shapes:
            med = statistics.median(per[name])
            say(f"    {name:<22} {med:6.1f} us cpu/Check ({min(per[name]):.1f}-"
                f"{max(per[name]):.1f}) = {med / base_us:.2f}x, {med - base_us:+.1f} us")
    finally:
        for app in apps.values():
            await app.stop()


def tracing_cost(seconds: float, rate: float, rounds: int) -> list[str]:
    """Check throughput (closed loop, 64 callers) and sidecar CPU per Check (open loop at
    ``rate``) with admission traces at 1 % and 100 % vs off, shapes alternating round by
    round, medians compared; each allow released through the access log as above."""
    lines: list[str] = []

    def say(text: str) -> None:
        print(text)
        lines.append(text)

    rx_port = free_port()
    rx = spawn([sys.executable, "-m", "devtools.otlp", "--port", str(rx_port), "--quiet"])
    wait_tcp(rx_port, proc=rx)
    otlp = ["--otlp-endpoint", f"http://127.0.0.1:{rx_port}"]
    off = start_sidecar(name="off")
    one = start_sidecar(name="1 %", extra=[*otlp, "--trace-sample-ratio", "0.01"])
    every = start_sidecar(name="100 %", extra=[*otlp, "--trace-sample-ratio", "1"])
    shapes: list[tuple[str, Server, dict[str, str] | None]] = [
        ("off", off, None), ("1 %", one, None), ("1 %, unsampled parent", one, UNSAMPLED_PARENT),
        ("100 %", every, None)]
    try:
        asyncio.run(_handler_cost(f"http://127.0.0.1:{rx_port}", 2000 if seconds < 2 else 5000,
                                  rounds, say))
        say(f"  admission traces: saturation (closed loop, 64 callers, {seconds:g} s) and "
            f"sidecar CPU per Check (open loop {rate:,.0f} req/s, {seconds:g} s), {rounds} "
            f"alternating rounds; spans to devtools.otlp (counting) in its own process "
            f"(load {loadavg()})")
        rps: dict[str, list[float]] = {n: [] for n, _, _ in shapes}
        us: dict[str, list[float]] = {n: [] for n, _, _ in shapes}
        for i in range(rounds):
            order = shapes if i % 2 == 0 else shapes[::-1]
            for name, server, headers in order:
                r = measure(server, seconds=seconds, concurrency=64, headers=headers)
                rps[name].append(num(r, "rps"))
                say(f"    round {i} {name:<22} saturation {fmt(r)}")
            for name, server, headers in order:
                r = measure(server, seconds=seconds, rate=rate, headers=headers)
                per = num(r, "server_cpu") / max(1.0, num(r, "rps")) * 1e6
                us[name].append(per)
                say(f"    round {i} {name:<22} paced      {fmt(r)}  -> {per:.0f} us cpu/Check")
        base_rps, base_us = statistics.median(rps["off"]), statistics.median(us["off"])
        say(f"  medians (ranges over rounds); ratios vs tracing off, same run "
            f"(load {loadavg()}):")
        for name, _, _ in shapes:
            r_med, u_med = statistics.median(rps[name]), statistics.median(us[name])
            say(f"    {name:<22} {r_med:>7,.0f} req/s ({min(rps[name]):,.0f}-"
                f"{max(rps[name]):,.0f}) = {r_med / base_rps:.2f}x;  {u_med:.0f} us cpu/Check "
                f"({min(us[name]):.0f}-{max(us[name]):.0f}) = {u_med / base_us:.2f}x")
    finally:
        for server in (off, one, every):
            terminate(server.proc)  # type: ignore[arg-type]
        terminate(rx)
    return lines


async def released(server: Server) -> float:
    _, body = await http_get(f"http://127.0.0.1:{server.http_port}/metrics", 2.0)
    total = 0.0
    for line in body.decode().splitlines():
        if line.startswith("smg_sidecar_released_total{") and 'reason="completed"' in line:
            total += float(line.rpartition(" ")[2])
    return total


def measure(server: Server, **spec: object) -> dict[str, object]:
    spec = {"kind": "check", "port": server.port, "server_pid": server.pid, **spec}
    return run_client("bench.check_throughput", spec, timeout=120)


def num(r: dict[str, object], key: str) -> float:
    return float(str(r[key]))


def fmt(r: dict[str, object]) -> str:
    return (f"{num(r, 'rps'):>9,.0f} req/s  p50 {num(r, 'p50') * 1e6:>7.0f} us  "
            f"p99 {num(r, 'p99') * 1e6:>7.0f} us  cpu client {num(r, 'client_cpu'):.0%}"
            f" server {num(r, 'server_cpu'):.0%}  err {r['errors']} denied {r['denied']}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--seconds", type=float, default=3.0, help="per point")
    p.add_argument("--concurrency", default="16,64,256", help="closed-loop caller counts")
    p.add_argument("--quick", action="store_true", help="1 s points, one concurrency")
    p.add_argument("--client", help=argparse.SUPPRESS)
    p.add_argument("--shed-only", action="store_true",
                   help="only the shed-vs-admitted cost part (--log-level for its sidecars)")
    p.add_argument("--log-level", default="info")
    p.add_argument("--tracing-only", action="store_true",
                   help="only the admission traces' cost (writes bench/out/tracing.txt)")
    p.add_argument("--rounds", type=int, default=3, help="--tracing-only: alternating rounds")
    args = p.parse_args(argv)
    if args.client:
        print(json.dumps(client(json.loads(args.client))))
        return 0
    if args.tracing_only:
        seconds = 1.0 if args.quick else args.seconds
        head = (f"bench.check_throughput --tracing-only: {time.strftime('%F %T')}, "
                f"{seconds:g} s per point, {args.rounds} rounds")
        print(head)
        lines = tracing_cost(seconds, 1000.0, args.rounds)
        out_path("tracing.txt").write_text("\n".join([head, *lines]) + "\n")
        return 0
    if args.shed_only:
        shed_cost(args.seconds, 2000.0, args.log_level, 2 if args.quick else 3)
        return 0
    seconds = 1.0 if args.quick else args.seconds
    levels = [64] if args.quick else [int(c) for c in args.concurrency.split(",")]
    print("check_throughput: gRPC Check, load client in its own process "
          "(grpc.aio, bytes in/out), server in another; each allowed Check is released by an "
          "ALS DownstreamEnd entry on a long-lived stream (no-op server: drained).")
    noop = start_noop()
    side = start_sidecar()
    try:
        best: dict[str, dict[str, object]] = {}
        print(f"  saturation (closed loop, {seconds:g} s per point):")
        for server in (noop, side):
            for c in levels:
                r = measure(server, seconds=seconds, concurrency=c)
                print(f"    {server.name:<8} callers={c:<4} {fmt(r)}")
                if server.name not in best or float(str(r["rps"])) > float(
                        str(best[server.name]["rps"])):
                    best[server.name] = r
        a, b = float(str(best["no-op"]["rps"])), float(str(best["sidecar"]["rps"]))
        ratio = b / a
        print(f"  max rate: no-op {a:,.0f} req/s, sidecar {b:,.0f} req/s -> ratio b/a "
              f"{ratio:.2f}  (target >= 0.5: {'PASS' if ratio >= 0.5 else 'FAIL'})")
        for share in (0.5, 0.25):
            rate = share * a
            print(f"  latency, open loop paced at {share:.0%} of no-op max = {rate:,.0f} req/s "
                  f"({seconds:g} s; latency from the moment each call is issued):")
            lat = {}
            for server in (noop, side):
                lat[server.name] = r = measure(server, seconds=seconds, rate=rate)
                print(f"    {server.name:<8} {fmt(r)}")
            added = (num(lat["sidecar"], "p99") - num(lat["no-op"], "p99")) * 1e6
            added50 = (num(lat["sidecar"], "p50") - num(lat["no-op"], "p50")) * 1e6
            target = f" (target <= 500 us: {'PASS' if added <= 500 else 'FAIL'})" \
                if share == 0.5 else ""
            print(f"  added by the sidecar at {share:.0%}: p50 {added50:+.0f} us, p99 "
                  f"{added:+.0f} us{target}; p99 ratio "
                  f"x{num(lat['sidecar'], 'p99') / num(lat['no-op'], 'p99'):.2f}")
        count = 3000 if args.quick else 15000
        print(f"  completion path: admit up to {count} (no release), then send their ALS "
              "entries on 4 streams, one entry per message (as Envoy with buffer 0):")
        eps = {}
        for server in (noop, side):
            before = asyncio.run(released(server)) if server is side else 0.0
            r = run_client("bench.check_throughput",
                           {"kind": "als", "port": server.port, "server_pid": server.pid,
                            "count": count, "admit_seconds": 2.0 if args.quick else 6.0},
                           timeout=120)
            eps[server.name] = float(str(r["eps"]))
            extra = ""
            if server is side:
                done = asyncio.run(released(server)) - before
                extra = f"  released by sidecar: {done:,.0f}/{int(str(r['n'])) + 10:,}"
            print(f"    {server.name:<8} {eps[server.name]:>9,.0f} entries/s  cpu client "
                  f"{float(str(r['client_cpu'])):.0%} server {float(str(r['server_cpu'])):.0%}"
                  f"{extra}")
        print(f"  ALS ratio sidecar/no-op {eps['sidecar'] / eps['no-op']:.2f}")
    finally:
        terminate(noop.proc)  # type: ignore[arg-type]
        terminate(side.proc)  # type: ignore[arg-type]
    shed_cost(seconds, 1000.0 if args.quick else 2000.0, "info", 2 if args.quick else 3)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
