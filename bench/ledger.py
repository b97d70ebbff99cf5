"""Fleet ledger cost against a real valkey-server on loopback.

1. Client round trip: a trivial EVALSHA with redis.asyncio + hiredis (sequential and
   pipelined), and valkey-glide when it is installed (not a dependency).
2. Server round trips per admitted request on the uncontended path, counted by the
   server (INFO commandstats): arrive + release; and what the sidecar's admission
   controller really sends for a request with an ext_proc stream (its marks included),
   one request at a time and 16 at once, for a response that starts at once and for one
   that starts after the mark delay.
3. µs per arrive+release pair with D bulk waiters queued in the fleet (the pair is an
   interactive request on its reserved slot; every release runs dispatch over the queues).
4. Pairs per second with 32 pairs in flight at once over one connection pool.

    python -m bench.ledger [--pairs 2000] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

import redis.asyncio as redis

from bench._util import loadavg, out_path
from devtools.valkey import ValkeyServer
from sidecar.classes import PriorityClass
from sidecar.coordination.controller import MARK_DELAY_SECS, FleetController
from sidecar.coordination.ledger import ArriveStatus, FleetLedger
from sidecar.scheduler import ClassSettings

BULK, INT = PriorityClass.BULK, PriorityClass.INTERACTIVE
# Interactive keeps 32 reserved slots (room for the 32 pairs in flight); bulk fills the
# rest and queues without timing out.
CLASSES = {
    PriorityClass.SYSTEM: ClassSettings(0, 0.0, 16, 30.0, 1e6, True),
    INT: ClassSettings(32, 0.0, 16, 30.0, 1e6, True),
    PriorityClass.DEFAULT: ClassSettings(0, 0.0, 16, 30.0, 1e6, False),
    BULK: ClassSettings(0, 0.0, 100_000, 1e6, 1e6, False),
}
CAPACITY = 64


async def evalsha_stats(c: redis.Redis) -> tuple[int, float]:
    """Ledger calls (FCALL) so far and server µs spent in them."""
    stats = (await c.info("commandstats")).get("cmdstat_fcall", {})
    return int(stats.get("calls", 0)), float(stats.get("usec", 0))


async def evalsha_calls(c: redis.Redis) -> int:
    return (await evalsha_stats(c))[0]


async def client_round_trip(port: int, n: int) -> list[str]:
    lines = []
    c = redis.Redis(port=port)
    sha = await c.script_load("return ARGV[1]")
    for _ in range(200):
        await c.evalsha(sha, 0, "x")
    t = time.perf_counter()
    for _ in range(n):
        await c.evalsha(sha, 0, "x")
    seq = (time.perf_counter() - t) / n * 1e6
    t = time.perf_counter()
    for _ in range(n // 100):
        pipe = c.pipeline(transaction=False)
        for _ in range(100):
            pipe.evalsha(sha, 0, "x")
        await pipe.execute()
    piped = (time.perf_counter() - t) / n * 1e6
    await c.aclose()
    lines.append(f"redis.asyncio+hiredis  EVALSHA sequential {seq:6.1f} µs/call, "
                 f"pipelined x100 {piped:5.1f} µs/call")
    try:
        from glide import GlideClient, GlideClientConfiguration, NodeAddress, Script
    except ImportError:
        lines.append("valkey-glide           not installed (pip install valkey-glide to compare)")
        return lines
    g = await GlideClient.create(GlideClientConfiguration([NodeAddress("127.0.0.1", port)]))
    script = Script("return ARGV[1]")
    for _ in range(200):
        await g.invoke_script(script, keys=[], args=["x"])
    t = time.perf_counter()
    for _ in range(n):
        await g.invoke_script(script, keys=[], args=["x"])
    seq = (time.perf_counter() - t) / n * 1e6
    t = time.perf_counter()
    for _ in range(n // 100):
        await asyncio.gather(*(g.invoke_script(script, keys=[], args=["x"]) for _ in range(100)))
    conc = (time.perf_counter() - t) / n * 1e6
    await g.close()
    lines.append(f"valkey-glide           invoke_script sequential {seq:6.1f} µs/call, "
                 f"100 in flight {conc:5.1f} µs/call")
    return lines


async def ledger_runs(port: int, pairs: int, depths: list[int]) -> list[str]:
    lines = []
    c = redis.Redis(port=port, decode_responses=True)
    await c.flushall()
    led = FleetLedger(c, "bench", "a")
    await led.register(CLASSES, CAPACITY)
    await led.arrive("warm", INT, "t")
    await led.release("warm")

    before = await evalsha_calls(c)
    for i in range(pairs):
        got = await led.arrive(f"u{i}", INT, "t")
        assert got.status is ArriveStatus.ADMITTED
        await led.release(f"u{i}")
    rt = (await evalsha_calls(c) - before) / pairs
    lines.append(f"round trips per admitted request, uncontended: {rt:.2f} (arrive + release)")

    for i in range(CAPACITY - 32):
        await led.arrive(f"b{i}", BULK, "t")
    queued = 0
    lines.append("bulk waiters queued | µs per arrive+release pair, sequential (of which in the "
                 "server's scripts) | pairs/s, 32 in flight")
    for depth in depths:
        while queued < depth:
            fill: list[tuple[str, list[str | int]]] = []
            for _ in range(min(500, depth - queued)):
                fill.append(("arrive", ["a", f"q{queued}", int(BULK), "t"]))
                queued += 1
            await led.batch(fill)  # one multi call: fills the queue fast
        snap = await led.snapshot()
        assert snap.queue_depth[BULK] == depth, snap
        _, usec0 = await evalsha_stats(c)
        t = time.perf_counter()
        for i in range(pairs):
            got = await led.arrive(f"d{depth}-{i}", INT, "t")
            assert got.status is ArriveStatus.ADMITTED, got
            await led.release(f"d{depth}-{i}")
        per_pair = (time.perf_counter() - t) / pairs * 1e6
        _, usec1 = await evalsha_stats(c)
        server = (usec1 - usec0) / pairs

        async def pair(k: int, depth: int = depth) -> None:
            got = await led.arrive(f"c{depth}-{k}", INT, "t")
            assert got.status is ArriveStatus.ADMITTED, got
            await led.release(f"c{depth}-{k}")

        t = time.perf_counter()
        for start in range(0, pairs, 32):
            await asyncio.gather(*(pair(k) for k in range(start, min(pairs, start + 32))))
        rate = pairs / (time.perf_counter() - t)
        lines.append(f"{depth:19d} | {per_pair:8.1f} ({server:5.1f}) | {rate:8.0f}")
    await c.aclose()
    return lines


async def controller_round_trips(url: str, port: int, n: int) -> list[str]:
    """What the sidecar's FleetController sends per admitted request with an ext_proc
    stream (admit, stream opens, first byte, release), counted by the server."""
    c = redis.Redis(port=port, decode_responses=True)
    await c.flushall()
    ctl = await FleetController.connect(url, fleet="rt", replica="a", ttl=10.0,
                                        classes=CLASSES, capacity=CAPACITY)
    ctl.start()
    lines = []

    async def request(first_byte_after: float) -> None:
        adm = await ctl.admit(INT, "t")
        aid = adm.admission.id
        ctl.open_stop_channel(aid)
        if first_byte_after:
            await asyncio.sleep(first_byte_after)
        assert await ctl.confirm_first_byte(aid)
        ctl.mark_first_byte(aid)
        ctl.release(aid)

    async def settled() -> None:
        while ctl.held or ctl._outbox:  # the last release reached the ledger
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.02)

    try:
        await request(0.0)
        await settled()
        slow = 2 * MARK_DELAY_SECS
        for label, after, conc in (("first byte at once", 0.0, 1),
                                   (f"first byte after {slow * 1e3:.0f} ms", slow, 1),
                                   ("first byte at once", 0.0, 16),
                                   (f"first byte after {slow * 1e3:.0f} ms", slow, 16)):
            count = n if after == 0.0 else n // 10
            before = await evalsha_calls(c)
            for start in range(0, count, conc):
                await asyncio.gather(*(request(after)
                                       for _ in range(min(conc, count - start))))
            await settled()
            rt = (await evalsha_calls(c) - before) / count
            lines.append(f"  sidecar, ext_proc stream, {label}, {conc:2d} at a time: "
                         f"{rt:.2f} ledger calls per admitted request (heartbeats aside)")
    finally:
        await ctl.aclose()
        await c.aclose()
    return lines


async def amain(pairs: int, depths: list[int]) -> list[str]:
    server = ValkeyServer(Path(tempfile.mkdtemp(prefix="bench-valkey-")))
    server.start()
    try:
        lines = [f"valkey-server on loopback; load average {loadavg()}"]
        lines += await client_round_trip(server.port, max(pairs, 2000))
        lines += await ledger_runs(server.port, pairs, depths)
        lines += await controller_round_trips(server.url, server.port, pairs // 2)
        return lines
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--pairs", type=int, default=2000)
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    pairs = 300 if args.quick else args.pairs
    depths = [0, 100, 1000] if args.quick else [0, 100, 1000, 10_000]
    lines = asyncio.run(amain(pairs, depths))
    text = "\n".join(lines)
    print(text)
    out_path("ledger.txt").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
