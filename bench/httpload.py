"""HTTP/1.1 load client for the Envoy benchmarks (run in its own process).

Keep-alive connections from a pool: a closed-loop mode (N connections back to back)
and an open-loop mode (several paced streams, each its own rate and headers; a
request takes an idle connection or opens one, so the schedule never waits for a
response). Records per request: stream, start offset, latency, status, error code.

    python -m bench.httpload --client JSON   (used by bench.e2e and bench.isolation)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import time
from typing import Any

from bench._util import cpu_seconds

BODY = json.dumps({"model": "demo", "messages": [{"role": "user", "content": "hi"}]}).encode()


class Conn:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    @classmethod
    async def open(cls, port: int) -> Conn:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return cls(reader, writer)

    async def request(self, head: bytes) -> tuple[int, str, bool]:
        """Send one request; returns (status, x-smg-error-code, keep-alive)."""
        self.writer.write(head)
        raw = await self.reader.readuntil(b"\r\n\r\n")
        lines = raw.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        length = -1
        code = ""
        chunked = False
        keep = True
        for line in lines[1:]:
            k, _, v = line.partition(":")
            k = k.strip().lower()
            if k == "content-length":
                length = int(v)
            elif k == "x-smg-error-code":
                code = v.strip()
            elif k == "transfer-encoding" and "chunked" in v.lower():
                chunked = True
            elif k == "connection" and "close" in v.lower():
                keep = False
        if chunked:
            while True:
                size = int((await self.reader.readuntil(b"\r\n")).split(b";")[0], 16)
                await self.reader.readexactly(size + 2)
                if size == 0:
                    break
        elif length > 0:
            await self.reader.readexactly(length)
        elif length < 0:
            await self.reader.read(-1)
            keep = False
        return status, code, keep

    def close(self) -> None:
        self.writer.close()


def request_head(port: int, headers: dict[str, str]) -> bytes:
    lines = ["POST /v1/chat/completions HTTP/1.1", f"Host: 127.0.0.1:{port}",
             f"Content-Length: {len(BODY)}", "Content-Type: application/json"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + BODY


class Pool:
    def __init__(self, port: int) -> None:
        self.port = port
        self.idle: list[Conn] = []
        self.opened = 0

    async def send(self, head: bytes, timeout: float) -> tuple[int, str]:
        conn = self.idle.pop() if self.idle else None
        if conn is None:
            conn = await Conn.open(self.port)
            self.opened += 1
        try:
            status, code, keep = await asyncio.wait_for(conn.request(head), timeout)
        except BaseException:
            conn.close()
            raise
        if keep:
            self.idle.append(conn)
        else:
            conn.close()
        return status, code

    def close(self) -> None:
        for c in self.idle:
            c.close()


async def run(spec: dict[str, Any]) -> dict[str, Any]:
    port = int(spec["port"])
    seconds = float(spec["seconds"])
    timeout = float(spec.get("timeout", 30))
    pids = [int(p) for p in spec.get("pids", [])]
    pool = Pool(port)
    records: list[tuple[str, float, float, int, str]] = []
    errors = 0

    async def one(name: str, head: bytes, t0: float) -> None:
        nonlocal errors
        t = time.perf_counter()
        try:
            status, code = await pool.send(head, timeout)
        except (TimeoutError, OSError, asyncio.IncompleteReadError, ValueError):
            errors += 1
            return
        records.append((name, t - t0, time.perf_counter() - t, status, code))

    warm = request_head(port, spec.get("warmup_headers", {}))
    for _ in range(int(spec.get("warmup", 20))):
        await one("warmup", warm, 0.0)
    records.clear()
    cpu0 = time.process_time()
    pcpu0 = [cpu_seconds(p) for p in pids]
    t0 = time.perf_counter()
    end = t0 + seconds
    streams = spec["streams"]
    tasks: set[asyncio.Task[None]] = set()
    if spec.get("concurrency"):  # closed loop over the first stream's headers
        head = request_head(port, streams[0].get("headers", {}))

        async def caller() -> None:
            while time.perf_counter() < end:
                await one(streams[0]["name"], head, t0)
        await asyncio.gather(*(caller() for _ in range(int(spec["concurrency"]))))
    else:
        heads = [request_head(port, s.get("headers", {})) for s in streams]
        sent = [0] * len(streams)
        while (now := time.perf_counter()) < end:
            for i, s in enumerate(streams):
                due = int((now - t0) * float(s["rate"])) - sent[i]
                for _ in range(due):
                    task = asyncio.create_task(one(s["name"], heads[i], t0))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                sent[i] += due
            await asyncio.sleep(0.001)
    # CPU over the sending window only (not the drain of queued requests).
    send_wall = time.perf_counter() - t0
    cpu = (time.process_time() - cpu0) / send_wall
    pcpu = [(cpu_seconds(p) - c) / send_wall for p, c in zip(pids, pcpu0, strict=True)]
    if not spec.get("concurrency") and tasks:
        await asyncio.wait(tasks, timeout=timeout + 5)
    wall = time.perf_counter() - t0
    pool.close()
    return {"wall": wall, "send_wall": send_wall, "records": records, "errors": errors,
            "client_cpu": cpu, "cpu": pcpu, "connections": pool.opened}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--client", required=True)
    args = p.parse_args(argv)
    print(json.dumps(asyncio.run(run(json.loads(args.client)))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
