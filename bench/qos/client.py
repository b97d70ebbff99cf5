"""The QoS benchmark's load client: open loop, streamed, cheap (asyncio protocols, no aiohttp).

Started by the driver in a process of its own (``python -m bench.qos.client SPEC.json``).
It sends each request of the spec at its instant on a connection of its own, reads the
response as it streams (HTTP/1.1, chunked, server-sent events) and keeps, per request,
when it was sent, its status and ``X-SMG-Error-Code``, when each token arrived and how it
ended. Nothing waits for a response before sending the next request.

A request ends as ``ok`` (the stream's ``[DONE]`` and its last chunk), ``refused`` (a
status other than 200: the 429/503 of a limiter or the sidecar), ``timeout`` (no end
within its class's timeout: the client hangs up), ``error`` (no status line: a reset or
a refused connection), ``cut`` (a 200 stream that ended without ``[DONE]``) or ``open``
(bulk still streaming when the window closed and every interactive request had ended).
After the window no request is sent; interactive requests run to their end or timeout,
so an interactive request stuck in a queue at the window's end still counts.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench._util import cpu_seconds
from bench.qos.workload import INTERACTIVE, Request, body

_TOKEN = b'"content":"'  # a delta with text; the first chunk's role delta has content null


@dataclass
class Record:
    cls: str
    at: float  # scheduled, seconds after the window opened
    expected: int  # tokens asked for
    sent: float = float("nan")
    status: int = 0
    code: str = ""
    tokens: list[float] = field(default_factory=list)
    end: float = float("nan")
    outcome: str = ""

    def row(self) -> dict[str, Any]:
        return {"cls": self.cls, "at": round(self.at, 4), "expected": self.expected,
                "sent": round(self.sent, 4), "status": self.status, "code": self.code,
                "tokens": [round(t, 4) for t in self.tokens], "end": round(self.end, 4),
                "outcome": self.outcome}


class Stream(asyncio.Protocol):
    """One request on its own connection: writes it, parses the streamed answer."""

    def __init__(self, clock: Callable[[], float], on_end: Callable[[Record], None],
                 rec: Record, data: bytes) -> None:
        self.clock = clock
        self.on_end = on_end
        self.rec = rec
        self.data = data
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.events = bytearray()
        self.head = True
        self.chunked = False
        self.left = 0  # body bytes still due: Content-Length's, or the current chunk's
        self.crlf = 0  # bytes of a chunk's trailing CRLF still to skip
        self.done_event = False
        self.timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        transport.write(self.data)

    def data_received(self, data: bytes) -> None:
        now = self.clock()
        self.buf += data
        if self.head:
            at = self.buf.find(b"\r\n\r\n")
            if at < 0:
                return
            lines = bytes(self.buf[:at]).decode("latin-1").split("\r\n")
            del self.buf[:at + 4]
            self.head = False
            self.rec.status = int(lines[0].split(" ", 2)[1])
            for line in lines[1:]:
                name, _, value = line.partition(":")
                name, value = name.strip().lower(), value.strip()
                if name == "x-smg-error-code":
                    self.rec.code = value
                elif name == "transfer-encoding" and "chunked" in value.lower():
                    self.chunked = True
                elif name == "content-length":
                    self.left = int(value)
        if self.chunked:
            self._chunks(now)
        else:
            take = min(self.left, len(self.buf))
            self.left -= take
            del self.buf[:take]
            if self.left == 0:
                self.finish(now, "ok")

    def _chunks(self, now: float) -> None:
        while True:
            if self.left:
                take = min(self.left, len(self.buf))
                self.events += self.buf[:take]
                del self.buf[:take]
                self.left -= take
                if self.left:
                    break
                self.crlf = 2
            if self.crlf:
                take = min(self.crlf, len(self.buf))
                del self.buf[:take]
                self.crlf -= take
                if self.crlf:
                    break
            eol = self.buf.find(b"\r\n")
            if eol < 0:
                break
            size = int(bytes(self.buf[:eol]).split(b";")[0], 16)
            del self.buf[:eol + 2]
            if size == 0:
                self._events(now)
                self.finish(now, "ok")
                return
            self.left = size
        self._events(now)

    def _events(self, now: float) -> None:
        while (at := self.events.find(b"\n\n")) >= 0:
            event = bytes(self.events[:at])
            del self.events[:at + 2]
            if event.startswith(b"data: [DONE]"):
                self.done_event = True
            elif _TOKEN in event:
                self.rec.tokens.append(now)

    def finish(self, now: float, outcome: str) -> None:
        """The request's end (once): ``ok`` is checked against the status and [DONE]."""
        if self.rec.outcome:
            return
        if outcome == "ok":
            outcome = ("refused" if self.rec.status != 200
                       else "ok" if self.done_event else "cut")
        self.rec.outcome = outcome
        self.rec.end = now
        if self.timer is not None:
            self.timer.cancel()
        if self.transport is not None:
            self.transport.close()
        self.on_end(self.rec)

    def connection_lost(self, exc: Exception | None) -> None:
        self.finish(self.clock(), "ok" if self.rec.status else "error")


class Client:
    def __init__(self, spec: dict[str, Any]) -> None:
        self.host = str(spec.get("host", "127.0.0.1"))
        self.port = int(spec["port"])
        self.window = float(spec["window"])
        self.timeouts = {k: float(v) for k, v in spec["timeouts"].items()}
        self.requests = [Request(*r) for r in spec["requests"]]
        self.pids = [int(p) for p in spec.get("pids", [])]
        self.t0 = time.monotonic()
        self.records: list[Record] = []
        self.streams: dict[int, Stream] = {}
        self.interactive_left = 0
        self.all_interactive_done = asyncio.Event()

    def now(self) -> float:
        return time.monotonic() - self.t0

    def encode(self, req: Request) -> bytes:
        data = body(req)
        head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
                f"Content-Type: application/json\r\nx-smg-priority: {req.cls}\r\n"
                f"Connection: close\r\nContent-Length: {len(data)}\r\n\r\n")
        return head.encode() + data

    def ended(self, rec: Record) -> None:
        self.streams.pop(id(rec), None)
        if rec.cls == INTERACTIVE:
            self.interactive_left -= 1
            if self.interactive_left == 0:
                self.all_interactive_done.set()

    async def send(self, req: Request, data: bytes) -> None:
        loop = asyncio.get_running_loop()
        rec = Record(req.cls, req.at, req.tokens, sent=self.now())
        self.records.append(rec)
        stream = Stream(self.now, self.ended, rec, data)
        self.streams[id(rec)] = stream
        stream.timer = loop.call_later(self.timeouts[req.cls], self.expire, stream)
        try:
            await loop.create_connection(lambda: stream, self.host, self.port)
        except OSError:
            stream.finish(self.now(), "error")

    def expire(self, stream: Stream) -> None:
        stream.timer = None
        stream.finish(self.now(), "timeout")

    async def warmup(self, n: int) -> None:
        """``n`` short interactive requests one after another (connections, caches)."""
        loop = asyncio.get_running_loop()
        for i in range(n):
            req = Request(0.0, INTERACTIVE, 16, 4, i)
            ended: asyncio.Future[Record] = loop.create_future()
            stream = Stream(self.now, ended.set_result, Record(req.cls, 0.0, req.tokens),
                            self.encode(req))
            await loop.create_connection(lambda s=stream: s, self.host, self.port)  # type: ignore[misc]
            rec = await asyncio.wait_for(ended, 60)
            if rec.outcome != "ok":
                raise RuntimeError(f"warm-up request ended {rec.outcome} "
                                   f"(status {rec.status} {rec.code})")

    async def run(self, warmup: int) -> dict[str, Any]:
        await self.warmup(warmup)
        encoded = [self.encode(r) for r in self.requests]
        self.interactive_left = sum(1 for r in self.requests if r.cls == INTERACTIVE)
        if self.interactive_left == 0:
            self.all_interactive_done.set()
        cpu0 = time.process_time()
        pcpu0 = [cpu_seconds(p) for p in self.pids]
        self.t0, t0_wall = time.monotonic(), time.time()
        tasks = set()
        for req, data in zip(self.requests, encoded, strict=True):
            delay = req.at - self.now()
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.ensure_future(self.send(req, data))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if (rest := self.window - self.now()) > 0:
            await asyncio.sleep(rest)
        wall = self.now()
        cpu = (time.process_time() - cpu0) / wall
        pcpu = [(cpu_seconds(p) - c) / wall for p, c in zip(self.pids, pcpu0, strict=True)]
        await self.all_interactive_done.wait()  # each has its timeout, so this ends
        for stream in list(self.streams.values()):
            stream.finish(self.now(), "open")
        return {"t0": self.t0, "t0_wall": t0_wall, "window": self.window, "wall": wall,
                "client_cpu": cpu, "cpu": pcpu, "records": [r.row() for r in self.records]}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m bench.qos.client SPEC.json", file=sys.stderr)
        return 2
    spec = json.loads(Path(args[0]).read_text())
    result = asyncio.run(Client(spec).run(int(spec.get("warmup", 3))))
    Path(spec["out"]).write_text(json.dumps(result))
    print(json.dumps({k: v for k, v in result.items() if k != "records"}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
