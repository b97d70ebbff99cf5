"""A fleet of fake LLM workers for the sidecar's tests and demo.

Each ``FakeWorker`` is a small HTTP/1.1 server written directly on
``asyncio.start_server`` rather than ``http.server``: we need to notice a
client that hangs up *while* a request is still being "computed", which is
exactly what Envoy does when the sidecar (or the end user) gives up on a
request. The worker records what it really saw (headers, outcome, timing) so
tests can assert on admission behaviour from the upstream's point of view.

Run ``python -m sidecar.devtools.fleet --help`` for the CLI.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import logging
import signal
import socket
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass
from http import HTTPStatus
from typing import Any, Literal

log = logging.getLogger(__name__)

Outcome = Literal["running", "finished", "cancelled"]
JSONObject = dict[str, Any]

SERVER_HEADER = "fake-llm-worker"
SERVICE_TIME_HEADER = "x-fake-service-time"
_HEAD_LIMIT = 1 << 20  # generous: Envoy and the sidecar may add many headers


class _BadRequest(Exception):
    """Malformed HTTP request; answered with 400 and the connection is closed."""


@dataclass
class RequestRecord:
    """What one completion request looked like when it reached the worker."""

    request_id: str | None
    admission_id: str | None
    priority_class: str | None
    headers: dict[str, str]
    stream: bool
    started_at: float
    ended_at: float | None = None
    outcome: Outcome = "running"

    @property
    def duration(self) -> float | None:
        """Seconds between arrival and completion/cancellation (None while running)."""
        return None if self.ended_at is None else self.ended_at - self.started_at

    def to_json(self) -> JSONObject:
        """The record as served by /admin/stats (headers left out to keep it short)."""
        data = asdict(self)
        del data["headers"]
        data["duration"] = self.duration
        return data


@dataclass
class _Request:
    method: str
    path: str
    version: str
    headers: dict[str, str]
    body: bytes

    @property
    def keep_alive(self) -> bool:
        """HTTP/1.1 defaults to persistent connections, HTTP/1.0 to closing."""
        tokens = {t.strip().lower() for t in self.headers.get("connection", "").split(",")}
        if self.version == "HTTP/1.0":
            return "keep-alive" in tokens
        return "close" not in tokens


def _parse_head(head: bytes) -> tuple[str, str, str, dict[str, str]]:
    """Split a request head into method, path (query dropped), version, headers."""
    lines = head.decode("latin-1").lstrip("\r\n").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise _BadRequest(f"bad request line {lines[0]!r}")
    method, target, version = parts
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if not line:
            continue
        name, sep, value = line.partition(":")
        key = name.strip().lower()
        if not sep or not key:
            raise _BadRequest(f"bad header line {line!r}")
        value = value.strip()
        headers[key] = f"{headers[key]}, {value}" if key in headers else value
    return method.upper(), target.split("?", 1)[0], version, headers


def _response_head(status: int, headers: Sequence[tuple[str, str]]) -> bytes:
    lines = [f"HTTP/1.1 {status} {HTTPStatus(status).phrase}", f"server: {SERVER_HEADER}"]
    lines.extend(f"{name}: {value}" for name, value in headers)
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def _chunk(data: bytes) -> bytes:
    """One HTTP/1.1 chunked-transfer-encoding frame."""
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


def _json_object(body: bytes) -> JSONObject:
    """Parse a request body that must be a JSON object; an empty body counts as {}."""
    if not body.strip():
        return {}
    try:
        value = json.loads(body)
    except ValueError as exc:
        raise ValueError(f"invalid JSON body: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError("JSON body must be an object")
    return value


class _Connection:
    """One accepted TCP connection: HTTP/1.1 framing plus disconnect probing."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self._pushback = b""  # bytes a disconnect probe read ahead of the next request

    async def read_request(self) -> _Request | None:
        """Read the next request, or return None when the peer closed the connection."""
        try:
            head = self._pushback + await self.reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            return None
        except asyncio.LimitOverrunError:
            raise _BadRequest("request head too large") from None
        self._pushback = b""
        method, path, version, headers = _parse_head(head)
        body = await self._read_body(headers)
        return _Request(method, path, version, headers, body)

    async def _read_body(self, headers: dict[str, str]) -> bytes:
        if "chunked" in headers.get("transfer-encoding", "").lower():
            return await self._read_chunked_body()
        raw = headers.get("content-length")
        if raw is None:
            return b""
        try:
            length = int(raw)
        except ValueError:
            raise _BadRequest(f"bad content-length {raw!r}") from None
        if length < 0:
            raise _BadRequest(f"bad content-length {raw!r}")
        return await self.reader.readexactly(length)

    async def _read_chunked_body(self) -> bytes:
        """Envoy may re-frame bodies as chunked (e.g. from HTTP/2 clients)."""
        body = bytearray()
        while True:
            size_line = await self.reader.readuntil(b"\r\n")
            try:
                size = int(size_line.split(b";", 1)[0].strip(), 16)
            except ValueError:
                raise _BadRequest("bad chunk size") from None
            if size == 0:
                while await self.reader.readuntil(b"\r\n") != b"\r\n":
                    pass  # discard trailers
                return bytes(body)
            body += await self.reader.readexactly(size)
            await self.reader.readexactly(2)

    async def pause(self, delay: float) -> bool:
        """Sleep ``delay`` seconds; return False as soon as the peer disconnects.

        asyncio only notices a closed peer when somebody reads from the socket,
        so the sleep is raced against a one-byte read. If a byte does arrive
        (a pipelined request, not expected from Envoy) it is kept for the next
        ``read_request`` and the rest of the delay is slept without probing.
        """
        if self._pushback:
            await asyncio.sleep(delay)
            return True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + delay
        probe = asyncio.create_task(self._probe())
        try:
            await asyncio.wait({probe}, timeout=max(0.0, delay))
        finally:
            probe.cancel()  # no-op when already done
            await asyncio.wait({probe})  # the reader allows only one waiter at a time
        if probe.cancelled():
            return True
        data = probe.result()
        if not data:
            return False
        self._pushback = data
        await asyncio.sleep(max(0.0, deadline - loop.time()))
        return True

    async def _probe(self) -> bytes:
        try:
            return await self.reader.read(1)
        except OSError:  # connection reset and friends
            return b""

    async def send(self, data: bytes) -> None:
        """Write and flush; raises ConnectionError if the peer went away."""
        self.writer.write(data)
        await self.writer.drain()

    async def send_json(
        self,
        status: int,
        payload: JSONObject,
        keep_alive: bool,
        extra: Sequence[tuple[str, str]] = (),
    ) -> bool:
        """Send a complete JSON response; returns whether the connection stays open."""
        body = json.dumps(payload).encode()
        headers = [
            ("content-type", "application/json"),
            ("content-length", str(len(body))),
            ("connection", "keep-alive" if keep_alive else "close"),
            *extra,
        ]
        await self.send(_response_head(status, headers) + body)
        return keep_alive

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(OSError):
            await self.writer.wait_closed()


_Handler = Callable[[_Connection, _Request], Awaitable[bool]]


def _url(host: str, port: int) -> str:
    """A URL clients can actually connect to, even for wildcard binds."""
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}"


class FakeWorker:
    """A fake OpenAI-compatible LLM worker that records every completion it serves.

    ``healthy``, ``service_time``, ``stream_interval``, ``tokens`` and
    ``max_running_requests`` may be changed at any time; they are read per request.
    The worker never enforces ``max_running_requests`` itself: it only reports it
    via /server_info (as SGLang does) so tests can check the sidecar respects it,
    e.g. with ``peak_running``.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        max_running_requests: int | None = 4,
        service_time: float = 0.05,
        tokens: int = 5,
        stream_interval: float = 0.01,
        name: str | None = None,
    ) -> None:
        self.host = host
        self.port = port
        self.max_running_requests = max_running_requests
        self.service_time = service_time
        self.tokens = tokens
        self.stream_interval = stream_interval
        self.healthy = True
        self.records: list[RequestRecord] = []
        self._name = name
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[Any]] = set()
        self._running = 0
        self._peak_running = 0
        self._ids = itertools.count(1)
        self._routes: dict[tuple[str, str], _Handler] = {
            ("GET", "/health"): self._health,
            ("GET", "/server_info"): self._server_info,
            ("POST", "/v1/chat/completions"): self._chat_completions,
            ("GET", "/admin/stats"): self._admin_stats,
            ("POST", "/admin/health"): self._admin_health,
            ("POST", "/admin/reset"): self._admin_reset,
        }

    # -- lifecycle ---------------------------------------------------------

    async def start(self) -> None:
        """Bind and start serving; ``port`` holds the real port afterwards."""
        if self._server is not None:
            raise RuntimeError(f"worker {self.name} already started")
        self._server = await asyncio.start_server(
            self._on_connection, self.host, self.port, limit=_HEAD_LIMIT
        )
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        """Stop listening and abort open connections (in-flight requests become cancelled).

        Python 3.11's ``Server.wait_closed`` does not wait for connection
        handlers, so they are tracked and cancelled here explicitly.
        """
        if self._server is None:
            return
        server, self._server = self._server, None
        server.close()
        for task in list(self._connections):
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)
        await server.wait_closed()

    async def __aenter__(self) -> FakeWorker:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    # -- observation -------------------------------------------------------

    @property
    def name(self) -> str:
        return self._name if self._name is not None else f"worker-{self.port}"

    @property
    def url(self) -> str:
        return _url(self.host, self.port)

    @property
    def started(self) -> int:
        return len(self.records)

    @property
    def finished(self) -> int:
        return sum(1 for r in self.records if r.outcome == "finished")

    @property
    def cancelled(self) -> int:
        return sum(1 for r in self.records if r.outcome == "cancelled")

    @property
    def running(self) -> int:
        """Completions in progress right now (not affected by ``reset``)."""
        return self._running

    @property
    def peak_running(self) -> int:
        """Highest ``running`` seen since start or the last ``reset``."""
        return self._peak_running

    def stats(self) -> JSONObject:
        return {
            "name": self.name,
            "started": self.started,
            "finished": self.finished,
            "cancelled": self.cancelled,
            "running": self.running,
            "peak_running": self.peak_running,
            "requests": [r.to_json() for r in self.records],
        }

    def reset(self) -> None:
        """Forget past requests (those still running keep running, unrecorded)."""
        self.records = []
        self._peak_running = self._running

    # -- connection handling -----------------------------------------------

    async def _on_connection(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._connections.add(task)
        sock = writer.get_extra_info("socket")
        if sock is not None:  # Nagle would add ~40 ms to small responses
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn = _Connection(reader, writer)
        try:
            await self._serve_connection(conn)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # peer vanished mid-request; nothing left to answer
        except asyncio.CancelledError:
            # stop() (or loop shutdown) aborts us. This is a root task, so end it
            # normally: asyncio's stream callback logs an error for cancelled ones.
            pass
        except Exception:
            log.exception("worker %s: connection handler failed", self.name)
        finally:
            if task is not None:
                self._connections.discard(task)
            await conn.close()

    async def _serve_connection(self, conn: _Connection) -> None:
        """Serve requests until the peer closes, asks to close, or disconnects."""
        while True:
            try:
                request = await conn.read_request()
            except _BadRequest as exc:
                await conn.send_json(400, {"error": str(exc)}, keep_alive=False)
                return
            if request is None:
                return
            handler = self._routes.get((request.method, request.path), self._not_found)
            if not await handler(conn, request):
                return

    # -- endpoints (each returns whether the connection may be reused) -----

    async def _health(self, conn: _Connection, request: _Request) -> bool:
        if self.healthy:
            return await conn.send_json(200, {"status": "ok"}, request.keep_alive)
        return await conn.send_json(503, {"status": "unhealthy"}, request.keep_alive)

    async def _server_info(self, conn: _Connection, request: _Request) -> bool:
        info: JSONObject = {"name": self.name}
        if self.max_running_requests is not None:
            info["max_running_requests"] = self.max_running_requests
        return await conn.send_json(200, info, request.keep_alive)

    async def _admin_stats(self, conn: _Connection, request: _Request) -> bool:
        return await conn.send_json(200, self.stats(), request.keep_alive)

    async def _admin_health(self, conn: _Connection, request: _Request) -> bool:
        try:
            healthy = _json_object(request.body).get("healthy")
        except ValueError as exc:
            return await conn.send_json(400, {"error": str(exc)}, request.keep_alive)
        if not isinstance(healthy, bool):
            error = {"error": 'body must be {"healthy": true|false}'}
            return await conn.send_json(400, error, request.keep_alive)
        self.healthy = healthy
        return await conn.send_json(200, {"healthy": healthy}, request.keep_alive)

    async def _admin_reset(self, conn: _Connection, request: _Request) -> bool:
        self.reset()
        return await conn.send_json(200, {"status": "reset"}, request.keep_alive)

    async def _not_found(self, conn: _Connection, request: _Request) -> bool:
        error = {"error": f"no route for {request.method} {request.path}"}
        return await conn.send_json(404, error, request.keep_alive)

    async def _chat_completions(self, conn: _Connection, request: _Request) -> bool:
        try:
            payload = _json_object(request.body)
            service_time = self._service_time_for(request)
        except ValueError as exc:
            return await conn.send_json(400, {"error": str(exc)}, request.keep_alive)
        stream = payload.get("stream") is True
        record = RequestRecord(
            request_id=request.headers.get("x-request-id"),
            admission_id=request.headers.get("x-smg-admission-id"),
            priority_class=request.headers.get("x-smg-effective-class"),
            headers=dict(request.headers),
            stream=stream,
            started_at=time.time(),
        )
        self.records.append(record)
        self._running += 1
        self._peak_running = max(self._peak_running, self._running)
        outcome: Outcome = "cancelled"  # unless we get to the last byte
        try:
            completion_id = f"chatcmpl-{self.name}-{next(self._ids)}"
            model = str(payload.get("model", "fake-model"))
            serve = self._serve_stream if stream else self._serve_whole
            if not await serve(conn, request, completion_id, model, service_time):
                return False
            outcome = "finished"
            return request.keep_alive
        except ConnectionError:
            return False
        finally:
            self._running -= 1
            record.outcome = outcome
            record.ended_at = time.time()

    def _service_time_for(self, request: _Request) -> float:
        raw = request.headers.get(SERVICE_TIME_HEADER)
        if raw is None:
            return self.service_time
        try:
            value = float(raw)
        except ValueError:
            raise ValueError(f"bad {SERVICE_TIME_HEADER} {raw!r}") from None
        if not value >= 0:  # also rejects NaN
            raise ValueError(f"bad {SERVICE_TIME_HEADER} {raw!r}")
        return value

    async def _serve_whole(
        self, conn: _Connection, request: _Request, completion_id: str, model: str, delay: float
    ) -> bool:
        """Non-streaming completion: think for ``delay`` s, then answer in one go."""
        if not await conn.pause(delay):
            return False
        body = {
            "id": completion_id,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "".join(self._words())},
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": 0, "completion_tokens": self.tokens,
                      "total_tokens": self.tokens},
            "worker": self.name,
        }
        await conn.send_json(200, body, request.keep_alive, [("x-fake-worker", self.name)])
        return True

    async def _serve_stream(
        self, conn: _Connection, request: _Request, completion_id: str, model: str, delay: float
    ) -> bool:
        """SSE completion: headers and first token after ``delay`` s (time to first
        byte), then one token every ``stream_interval`` s, then ``[DONE]``."""
        if not await conn.pause(delay):
            return False
        head = _response_head(200, [
            ("content-type", "text/event-stream"),
            ("cache-control", "no-cache"),
            ("transfer-encoding", "chunked"),
            ("connection", "keep-alive" if request.keep_alive else "close"),
            ("x-fake-worker", self.name),
        ])
        words = self._words()
        for i, word in enumerate(words):
            if i > 0 and not await conn.pause(self.stream_interval):
                return False
            chunk = {
                "id": completion_id,
                "object": "chat.completion.chunk",
                "created": int(time.time()),
                "model": model,
                "choices": [{
                    "index": 0,
                    "delta": {"content": word},
                    "finish_reason": "stop" if i == len(words) - 1 else None,
                }],
                "worker": self.name,
            }
            event = _chunk(f"data: {json.dumps(chunk)}\n\n".encode())
            await conn.send(head + event if i == 0 else event)
        await conn.send((b"" if words else head) + _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        return True

    def _words(self) -> list[str]:
        return [f"tok{i} " for i in range(self.tokens)]


async def wait_for(predicate: Callable[[], bool], timeout: float) -> None:
    """Poll ``predicate`` every 10 ms until true; raise TimeoutError after ``timeout`` s."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() >= deadline:
            raise TimeoutError(f"condition not met within {timeout} s")
        await asyncio.sleep(0.01)


class Fleet:
    """``n`` fake workers named w1..wn; extra kwargs go to every ``FakeWorker``.

    With ``base_port`` set, worker i listens on ``base_port + i``; otherwise
    each gets an ephemeral port.
    """

    def __init__(
        self, n: int = 2, *, host: str = "127.0.0.1", base_port: int = 0, **worker_kwargs: Any
    ) -> None:
        self.workers = [
            FakeWorker(host, base_port + i if base_port else 0, name=f"w{i + 1}", **worker_kwargs)
            for i in range(n)
        ]

    async def start(self) -> None:
        """Start all workers; if one fails to bind, stop the others and re-raise."""
        try:
            for worker in self.workers:
                await worker.start()
        except BaseException:
            await self.stop()
            raise

    async def stop(self) -> None:
        await asyncio.gather(*(w.stop() for w in self.workers))

    async def __aenter__(self) -> Fleet:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    @property
    def urls(self) -> list[str]:
        return [w.url for w in self.workers]

    @property
    def addresses(self) -> list[tuple[str, int]]:
        return [(w.host, w.port) for w in self.workers]


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m sidecar.devtools.fleet", description="Run a fleet of fake LLM workers."
    )
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--base-port", type=int, default=8081,
                        help="first worker's port (0: ephemeral ports)")
    parser.add_argument("--max-running-requests", type=int, default=4,
                        help="reported in /server_info; <= 0 omits the field")
    parser.add_argument("--service-time", type=float, default=0.05,
                        help="seconds before the response (time to first byte)")
    parser.add_argument("--tokens", type=int, default=5)
    parser.add_argument("--stream-interval", type=float, default=0.01)
    return parser.parse_args(argv)


async def _serve(args: argparse.Namespace) -> int:
    max_running = args.max_running_requests if args.max_running_requests > 0 else None
    fleet = Fleet(
        args.workers,
        host=args.host,
        base_port=args.base_port,
        max_running_requests=max_running,
        service_time=args.service_time,
        tokens=args.tokens,
        stream_interval=args.stream_interval,
    )
    try:
        await fleet.start()
    except OSError as exc:
        print(f"error: cannot start fleet: {exc}", file=sys.stderr)
        return 1
    for worker in fleet.workers:
        print(f"worker {worker.name} listening on {worker.url}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    signals = (signal.SIGINT, signal.SIGTERM)
    for sig in signals:
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)
        await fleet.stop()
    return 0


def main(argv: list[str] | None = None) -> int:
    """CLI entry point: serve until SIGINT/SIGTERM; returns the exit status."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    return asyncio.run(_serve(_parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
