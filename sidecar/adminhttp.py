"""The admin HTTP endpoint: ``/metrics``, ``/healthz``, ``/readyz``.

A few lines on ``asyncio.start_server`` rather than a web framework: three
GET routes, loopback by default, one request per connection.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest


class AdminServer:
    def __init__(self, registry: CollectorRegistry, ready: Callable[[], bool]) -> None:
        self.registry = registry
        self.ready = ready
        self._server: asyncio.Server | None = None

    async def start(self, host: str, port: int) -> int:
        self._server = await asyncio.start_server(self._handle, host, port)
        sock = self._server.sockets[0]
        bound: int = sock.getsockname()[1]
        return bound

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    def route(self, path: str) -> tuple[int, str, bytes]:
        path = path.split("?", 1)[0]
        if path == "/metrics":
            return 200, CONTENT_TYPE_LATEST, generate_latest(self.registry)
        if path == "/healthz":
            return 200, "text/plain", b"ok\n"
        if path == "/readyz":
            if self.ready():
                return 200, "text/plain", b"ready\n"
            return 503, "text/plain", b"not ready\n"
        return 404, "text/plain", b"not found\n"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5.0)
            parts = head.split(b"\r\n", 1)[0].decode("latin-1").split()
            if len(parts) < 2 or parts[0] not in ("GET", "HEAD"):
                status, ctype, body = 405, "text/plain", b"method not allowed\n"
            else:
                status, ctype, body = self.route(parts[1])
            reason = {200: "OK", 404: "Not Found", 405: "Method Not Allowed",
                      503: "Service Unavailable"}[status]
            writer.write(f"HTTP/1.1 {status} {reason}\r\nContent-Type: {ctype}\r\n"
                         f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode())
            if parts and parts[0] != "HEAD":
                writer.write(body)
            await writer.drain()
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError):
            pass
        finally:
            writer.close()
