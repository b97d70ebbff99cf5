"""A small HTTP/1.1 client for tests, demo and benchmarks (asyncio streams).

It can do what the tests need and ordinary clients hide: hold a streaming
response open, read part of it, and hang up at a chosen moment.
"""

from __future__ import annotations

import asyncio
import json
import socket
from dataclasses import dataclass
from typing import Any


@dataclass
class Response:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def chat_body(stream: bool = False) -> bytes:
    return json.dumps({"model": "demo", "stream": stream,
                       "messages": [{"role": "user", "content": "hi"}]}).encode()


class Exchange:
    """One request on its own connection; the response is read on demand."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.status = 0
        self.headers: dict[str, str] = {}

    @classmethod
    async def send(cls, port: int, path: str = "/v1/chat/completions", *,
                   headers: dict[str, str] | None = None, body: bytes | None = None,
                   method: str = "POST", host: str = "127.0.0.1") -> Exchange:
        reader, writer = await asyncio.open_connection(host, port)
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        data = body if body is not None else (chat_body() if method == "POST" else b"")
        lines = [f"{method} {path} HTTP/1.1", f"Host: {host}:{port}", "Connection: close",
                 f"Content-Length: {len(data)}", "Content-Type: application/json"]
        lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + data)
        await writer.drain()
        return cls(reader, writer)

    async def read_head(self) -> None:
        head = await self.reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        self.status = int(lines[0].split()[1])
        for line in lines[1:]:
            if ":" in line:
                k, _, v = line.partition(":")
                self.headers[k.strip().lower()] = v.strip()

    async def read_chunk(self) -> bytes:
        """One chunk of a chunked body (b"" at the end)."""
        size_line = await self.reader.readuntil(b"\r\n")
        size = int(size_line.split(b";")[0].strip() or b"0", 16)
        if size == 0:
            await self.reader.readuntil(b"\r\n")
            return b""
        data = await self.reader.readexactly(size + 2)
        return data[:-2]

    async def read_body(self) -> bytes:
        if self.headers.get("transfer-encoding", "").lower() == "chunked":
            out = bytearray()
            while chunk := await self.read_chunk():
                out += chunk
            return bytes(out)
        length = self.headers.get("content-length")
        if length is not None:
            return await self.reader.readexactly(int(length))
        return await self.reader.read(-1)

    def close(self) -> None:
        """Hang up (possibly mid-response): the client going away."""
        self.writer.close()

    def abort(self) -> None:
        transport = self.writer.transport
        transport.abort()


async def request(port: int, path: str = "/v1/chat/completions", *,
                  headers: dict[str, str] | None = None, body: bytes | None = None,
                  method: str = "POST", timeout: float = 15.0) -> Response:
    async def go() -> Response:
        ex = await Exchange.send(port, path, headers=headers, body=body, method=method)
        try:
            await ex.read_head()
            data = await ex.read_body()
            return Response(ex.status, ex.headers, data)
        finally:
            ex.close()

    return await asyncio.wait_for(go(), timeout)
