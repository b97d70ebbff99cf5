"""HTTP client helpers for tests, demo and benchmarks (aiohttp).

Besides plain requests, an ``Exchange`` does what tests need and ordinary
calls hide: send a request without waiting for its answer, hold a streaming
response open, read part of it, and hang up at a chosen moment.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass
from typing import Any

import aiohttp

# What a helper call may raise when the peer is absent, slow or misbehaving.
HTTP_ERRORS = (aiohttp.ClientError, OSError, TimeoutError, ValueError)


@dataclass
class Response:
    status: int
    headers: dict[str, str]  # names lower-cased
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def chat_body(stream: bool = False) -> bytes:
    return json.dumps({"model": "demo", "stream": stream,
                       "messages": [{"role": "user", "content": "hi"}]}).encode()


def _session() -> aiohttp.ClientSession:
    # One connection per exchange: a test's hang-up must not touch another request.
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True),
                                 timeout=aiohttp.ClientTimeout(total=None), trust_env=False)


class Exchange:
    """One request on its own connection; the response is read on demand."""

    def __init__(self, session: aiohttp.ClientSession,
                 pending: asyncio.Task[aiohttp.ClientResponse]) -> None:
        self._session = session
        self._pending = pending
        self._response: aiohttp.ClientResponse | None = None
        self.status = 0
        self.headers: dict[str, str] = {}

    @classmethod
    async def send(cls, port: int, path: str = "/v1/chat/completions", *,
                   headers: dict[str, str] | None = None, body: bytes | None = None,
                   method: str = "POST", host: str = "127.0.0.1") -> Exchange:
        """Start the request; returns without waiting for the response head."""
        session = _session()
        data = body if body is not None else (chat_body() if method == "POST" else b"")
        all_headers = {"Content-Type": "application/json", **(headers or {})}
        pending = asyncio.ensure_future(session.request(
            method, f"http://{host}:{port}{path}", data=data, headers=all_headers))
        await asyncio.sleep(0)  # let it connect and write before the caller goes on
        return cls(session, pending)

    async def read_head(self) -> None:
        self._response = await self._pending
        self.status = self._response.status
        self.headers = {k.lower(): v for k, v in self._response.headers.items()}

    def _resp(self) -> aiohttp.ClientResponse:
        if self._response is None:
            raise RuntimeError("read_head() first")
        return self._response

    async def read_chunk(self) -> bytes:
        """Whatever body bytes arrive next (b"" at the end)."""
        return await self._resp().content.readany()

    async def read_body(self) -> bytes:
        """The rest of the body."""
        return await self._resp().read()

    async def close(self) -> None:
        """Hang up (possibly mid-response): the client going away."""
        self._pending.cancel()
        if self._response is not None:
            self._response.close()
        with contextlib.suppress(*HTTP_ERRORS, asyncio.CancelledError):
            await self._pending
        await self._session.close()

    async def abort(self) -> None:
        """Hang up with a TCP reset rather than a FIN."""
        conn = self._response.connection if self._response is not None else None
        if conn is not None and conn.transport is not None:
            conn.transport.abort()
        await self.close()


async def request(port: int, path: str = "/v1/chat/completions", *,
                  headers: dict[str, str] | None = None, body: bytes | None = None,
                  method: str = "POST", timeout: float = 15.0) -> Response:
    """One whole request through ``127.0.0.1:port``."""
    async def go() -> Response:
        ex = await Exchange.send(port, path, headers=headers, body=body, method=method)
        try:
            await ex.read_head()
            data = await ex.read_body()
            return Response(ex.status, ex.headers, data)
        finally:
            await ex.close()

    return await asyncio.wait_for(go(), timeout)


async def get(url: str, timeout: float,
              headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    """GET ``url`` on a fresh connection: (status, body). Raises one of HTTP_ERRORS."""
    async with _session() as session, asyncio.timeout(timeout), \
            session.get(url, headers=headers) as resp:
        return resp.status, await resp.read()
