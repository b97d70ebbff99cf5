"""A cheaper open-loop HTTP/1.1 load client: asyncio protocols and pre-encoded requests.

Same spec and result as :mod:`bench.httpload`'s open-loop mode (streams, records,
CPU of the pids while sending), without aiohttp: each keep-alive connection is an
``asyncio.Protocol`` that writes a request prepared once per stream and reads just
the status line, ``Content-Length`` (or a chunked body's end) and
``X-SMG-Error-Code``. No task per request. A stream may name its ``path`` (default
``/v1/chat/completions``); with ``concurrency`` N > 0 the load is a closed loop instead:
N connections, connection i sends stream i mod len(streams) back to back. On the
shared 2-core box the flood benchmarks run on, aiohttp at 1,600 req/s took 45-70 %
of a core, CPU that Envoy and the sidecar then lacked (bench/out/edge.txt); this one
takes a fraction of it.

    python -m bench.rawload --client JSON   (started by :func:`bench.httpload.through_envoy`)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections import deque
from typing import Any

from bench._util import CpuMeter
from bench.httpload import BODY, request_headers

Record = tuple[str, float, float, int, str]


PATH = "/v1/chat/completions"


def encode(port: int, headers: dict[str, str], path: str = PATH) -> bytes:
    head = "".join(f"{k}: {v}\r\n" for k, v in request_headers(headers).items())
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n{head}"
            f"Content-Length: {len(BODY)}\r\n\r\n").encode() + BODY


class Conn(asyncio.Protocol):
    """One keep-alive connection, one request at a time."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.current: tuple[str, float] | None = None  # (stream, sent at)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.client.ready(self)

    def send(self, name: str, data: bytes) -> None:
        assert self.transport is not None
        self.current = (name, time.perf_counter())
        self.transport.write(data)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        end = self.buf.find(b"\r\n\r\n")
        if end < 0:
            return
        head = bytes(self.buf[:end]).lower()
        at = head.find(b"\r\ncontent-length:")
        if at >= 0:
            stop = head.find(b"\r\n", at + 2)
            n = int(head[at + 17:stop if stop > 0 else None])
            if len(self.buf) < end + 4 + n:
                return
            del self.buf[:end + 4 + n]
        elif b"\r\ntransfer-encoding: chunked" in head:
            done = self.buf.find(b"\r\n0\r\n\r\n", end)
            if done < 0:
                return
            del self.buf[:done + 7]
        else:
            del self.buf[:end + 4]
        code = ""
        at = head.find(b"\r\nx-smg-error-code:")
        if at >= 0:
            stop = head.find(b"\r\n", at + 2)
            code = head[at + 19:stop if stop > 0 else None].strip().decode()
        cur, self.current = self.current, None
        # Envoy closes the connection after a local reply sent before the request's body
        # was read (the edge route's 429): not reused, a new one is opened instead.
        close = b"\r\nconnection: close" in head
        if close and self.transport is not None:
            self.transport.close()
        if cur is not None:
            self.client.answered(self, cur, int(head[9:12]), code, reuse=not close)

    def connection_lost(self, exc: Exception | None) -> None:
        self.client.lost(self)


class Client:
    """The connection pool and the records."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.loop = asyncio.get_running_loop()
        self.idle: list[Conn] = []
        self.waiting: deque[tuple[str, bytes]] = deque()
        self.records: list[Record] = []
        self.t0 = 0.0
        self.errors = 0
        self.opened = 0
        self.outstanding = 0
        self.all_done = asyncio.Event()
        # Closed loop: each answer sends its stream's request again until ``end``.
        self.again: dict[str, bytes] = {}
        self.end = 0.0

    def submit(self, name: str, data: bytes) -> None:
        self.outstanding += 1
        self.all_done.clear()
        if self.idle:
            self.idle.pop().send(name, data)
            return
        self.waiting.append((name, data))
        self._connect()

    def _connect(self) -> None:
        self.opened += 1
        task = self.loop.create_task(self._open())
        task.add_done_callback(_ignore)

    async def _open(self) -> None:
        try:
            await self.loop.create_connection(lambda: Conn(self), "127.0.0.1", self.port)
        except OSError:
            if self.waiting:
                self.waiting.popleft()
                self._finish()
                self.errors += 1

    def ready(self, conn: Conn) -> None:
        if self.waiting:
            conn.send(*self.waiting.popleft())
        else:
            self.idle.append(conn)

    def answered(self, conn: Conn, cur: tuple[str, float], status: int, code: str,
                 reuse: bool) -> None:
        now = time.perf_counter()
        self.records.append((cur[0], cur[1] - self.t0, now - cur[1], status, code))
        if reuse:
            self.ready(conn)
        if self.again and now < self.end:  # after ready(): the next one reuses conn
            self.submit(cur[0], self.again[cur[0]])
        self._finish()

    def lost(self, conn: Conn) -> None:
        if conn in self.idle:
            self.idle.remove(conn)
        if conn.current is not None:
            conn.current = None
            self.errors += 1
            self._finish()

    def _finish(self) -> None:
        self.outstanding -= 1
        if self.outstanding == 0:
            self.all_done.set()

    async def drain(self, timeout: float) -> None:
        """Wait for every request sent to end; those still out after ``timeout`` are errors."""
        try:
            await asyncio.wait_for(self.all_done.wait(), timeout)
        except TimeoutError:
            self.errors += self.outstanding

    def close(self) -> None:
        for c in self.idle:
            if c.transport is not None:
                c.transport.close()


def _ignore(task: asyncio.Task[None]) -> None:
    if not task.cancelled():
        task.exception()


async def run(spec: dict[str, Any]) -> dict[str, Any]:
    port = int(spec["port"])
    seconds = float(spec["seconds"])
    timeout = float(spec.get("timeout", 30))
    pids = [int(p) for p in spec.get("pids", [])]
    client = Client(port)
    warm = encode(port, spec.get("warmup_headers", {}))
    for _ in range(int(spec.get("warmup", 20))):
        client.submit("warmup", warm)
        await asyncio.wait_for(client.all_done.wait(), timeout)
    client.records.clear()
    streams = spec["streams"]
    data = [encode(port, s.get("headers", {}), s.get("path", PATH)) for s in streams]
    rates = [float(s.get("rate", 0.0)) for s in streams]
    names = [str(s["name"]) for s in streams]
    sent = [0] * len(streams)
    meter = CpuMeter(pids)
    t0 = client.t0 = time.perf_counter()
    send_start = time.time()
    end = client.end = t0 + seconds
    concurrency = int(spec.get("concurrency") or 0)
    if concurrency:
        client.again = dict(zip(names, data, strict=True))
        for i in range(concurrency):
            client.submit(names[i % len(names)], data[i % len(names)])
        rates = [0.0] * len(streams)
    # A stream with "poisson": exponential gaps (seeded), else evenly paced.
    rng = random.Random(spec.get("seed", 0))
    poisson = [bool(s.get("poisson")) for s in streams]
    next_at = [t0 + rng.expovariate(r) if p and r > 0 else end for p, r in zip(
        poisson, rates, strict=True)]
    while (now := time.perf_counter()) < end:
        if concurrency:  # the answers send the next requests
            await asyncio.sleep(end - now)
            continue
        for i, rate in enumerate(rates):
            if poisson[i]:
                while next_at[i] <= now:
                    client.submit(names[i], data[i])
                    next_at[i] += rng.expovariate(rate)
                continue
            due = int((now - t0) * rate) - sent[i]
            for _ in range(due):
                client.submit(names[i], data[i])
            sent[i] += due
        await asyncio.sleep(0.001)
    send_wall = time.perf_counter() - t0
    cpu, pcpu = meter.per_second(send_wall)
    await client.drain(timeout + 5)
    wall = time.perf_counter() - t0
    client.close()
    return {"wall": wall, "send_wall": send_wall, "send_start": send_start,
            "records": client.records, "errors": client.errors, "client_cpu": cpu,
            "cpu": pcpu, "connections": client.opened}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--client", required=True)
    args = p.parse_args(argv)
    print(json.dumps(asyncio.run(run(json.loads(args.client)))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
