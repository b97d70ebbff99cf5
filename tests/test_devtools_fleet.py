"""Tests for the fake LLM worker fleet (devtools/fleet.py), through real loopback sockets."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import re
import signal
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from devtools.fleet import FakeWorker, Fleet, wait_for
from devtools.httpclient import Response

TEST_TIMEOUT = 15.0
REPO_ROOT = Path(__file__).resolve().parent.parent


def bounded(fn: Callable[..., Awaitable[None]]) -> Callable[..., Awaitable[None]]:
    """Fail a test instead of hanging when something never completes."""

    @functools.wraps(fn)
    async def wrapper(*args: Any, **kwargs: Any) -> None:
        await asyncio.wait_for(fn(*args, **kwargs), TEST_TIMEOUT)

    return wrapper


class RawClient:
    """A deliberately tiny HTTP/1.1 client, so tests control the socket exactly."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    @classmethod
    async def connect(cls, worker: FakeWorker) -> RawClient:
        reader, writer = await asyncio.open_connection("127.0.0.1", worker.port)
        return cls(reader, writer)

    def write(
        self,
        method: str,
        path: str,
        body: Any = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        """Put a request in the socket's buffer without yielding to the loop."""
        data = b"" if body is None else json.dumps(body).encode()
        lines = [f"{method} {path} HTTP/1.1", "host: test"]
        lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
        if body is not None:
            lines += ["content-type: application/json", f"content-length: {len(data)}"]
        self.writer.write(("\r\n".join(lines) + "\r\n\r\n").encode() + data)

    async def send(
        self,
        method: str,
        path: str,
        body: Any = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        self.write(method, path, body, headers)
        await self.writer.drain()

    async def read_head(self) -> tuple[int, dict[str, str]]:
        head = (await self.reader.readuntil(b"\r\n\r\n")).decode("latin-1")
        status_line, *header_lines = head.rstrip("\r\n").split("\r\n")
        headers = {}
        for line in header_lines:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        return int(status_line.split(" ")[1]), headers

    async def read_chunk(self) -> bytes:
        size = int((await self.reader.readuntil(b"\r\n")).strip(), 16)
        data = await self.reader.readexactly(size)
        assert await self.reader.readexactly(2) == b"\r\n"
        return data

    async def read_response(self) -> Response:
        status, headers = await self.read_head()
        if headers.get("transfer-encoding") == "chunked":
            body = b""
            while chunk := await self.read_chunk():
                body += chunk
        else:
            body = await self.reader.readexactly(int(headers["content-length"]))
        return Response(status, headers, body)

    async def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        headers: dict[str, str] | None = None,
    ) -> Response:
        await self.send(method, path, body, headers)
        return await self.read_response()

    async def close(self) -> None:
        self.writer.close()
        await self.writer.wait_closed()


async def request(
    worker: FakeWorker,
    method: str,
    path: str,
    body: Any = None,
    headers: dict[str, str] | None = None,
) -> Response:
    """One request on a fresh connection."""
    client = await RawClient.connect(worker)
    try:
        return await client.request(method, path, body, headers)
    finally:
        await client.close()


def sse_events(body: bytes) -> list[str]:
    return [line[len("data: "):] for line in body.decode().split("\n\n") if line]


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
STREAM_CHAT = {**CHAT, "stream": True}


@pytest.mark.asyncio
@bounded
async def test_health_toggles_at_runtime() -> None:
    async with FakeWorker() as worker:
        ok = await request(worker, "GET", "/health")
        assert (ok.status, ok.json()) == (200, {"status": "ok"})
        assert ok.headers["server"] == "fake-llm-worker"
        worker.healthy = False
        bad = await request(worker, "GET", "/health")
        assert (bad.status, bad.json()) == (503, {"status": "unhealthy"})


@pytest.mark.asyncio
@bounded
async def test_server_info_with_and_without_max_running_requests() -> None:
    async with FakeWorker(max_running_requests=7, name="alpha") as worker:
        info = await request(worker, "GET", "/server_info")
        assert info.status == 200
        assert info.json() == {"name": "alpha", "max_running_requests": 7}
        worker.max_running_requests = None
        info = await request(worker, "GET", "/server_info")
        assert info.json() == {"name": "alpha"}


@pytest.mark.asyncio
@bounded
async def test_non_streaming_completion_is_recorded_finished() -> None:
    async with FakeWorker(name="w", tokens=3) as worker:
        headers = {
            "x-request-id": "req-1",
            "X-SMG-Admission-Id": "adm-42",
            "x-smg-effective-class": "interactive",
        }
        resp = await request(worker, "POST", "/v1/chat/completions", CHAT, headers)
        assert resp.status == 200
        assert resp.headers["content-type"] == "application/json"
        assert int(resp.headers["content-length"]) == len(resp.body)
        body = resp.json()
        assert body["object"] == "chat.completion"
        assert body["worker"] == "w"
        choice = body["choices"][0]
        assert choice["index"] == 0
        assert choice["finish_reason"] == "stop"
        assert choice["message"]["role"] == "assistant"
        assert choice["message"]["content"] == "tok0 tok1 tok2 "

        await wait_for(lambda: worker.finished == 1, 2)
        (record,) = worker.records
        assert record.request_id == "req-1"
        assert record.admission_id == "adm-42"
        assert record.priority_class == "interactive"
        assert record.headers["x-smg-admission-id"] == "adm-42"
        assert record.stream is False
        assert record.outcome == "finished"
        assert record.ended_at is not None and record.ended_at >= record.started_at
        assert (worker.started, worker.cancelled, worker.running) == (1, 0, 0)


@pytest.mark.asyncio
@bounded
async def test_missing_admission_headers_are_none() -> None:
    async with FakeWorker() as worker:
        await request(worker, "POST", "/v1/chat/completions", CHAT)
        (record,) = worker.records
        assert (record.request_id, record.admission_id, record.priority_class) == (None,) * 3


@pytest.mark.asyncio
@bounded
async def test_streaming_completion_sends_all_chunks_and_done() -> None:
    async with FakeWorker(tokens=4, stream_interval=0.005) as worker:
        resp = await request(worker, "POST", "/v1/chat/completions", STREAM_CHAT)
        assert resp.status == 200
        assert resp.headers["content-type"] == "text/event-stream"
        assert resp.headers["transfer-encoding"] == "chunked"
        assert "content-length" not in resp.headers
        events = sse_events(resp.body)
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert [c["choices"][0]["delta"]["content"] for c in chunks] == [
            "tok0 ", "tok1 ", "tok2 ", "tok3 "
        ]
        assert all(c["object"] == "chat.completion.chunk" for c in chunks)
        await wait_for(lambda: worker.finished == 1, 2)
        assert worker.records[0].stream is True


@pytest.mark.asyncio
@bounded
async def test_streaming_waits_service_time_before_first_byte() -> None:
    async with FakeWorker(service_time=0.3, tokens=2) as worker:
        client = await RawClient.connect(worker)
        t0 = time.monotonic()
        await client.send("POST", "/v1/chat/completions", STREAM_CHAT)
        status, _ = await client.read_head()
        assert status == 200
        assert time.monotonic() - t0 >= 0.25
        await client.close()


@pytest.mark.asyncio
@bounded
async def test_keep_alive_serves_several_requests_per_connection() -> None:
    async with FakeWorker(service_time=0.01) as worker:
        client = await RawClient.connect(worker)
        first = await client.request("POST", "/v1/chat/completions", CHAT)
        second = await client.request("POST", "/v1/chat/completions", STREAM_CHAT)
        third = await client.request("GET", "/health")
        assert [first.status, second.status, third.status] == [200, 200, 200]
        # HTTP/1.1 is persistent unless a side says otherwise: no header needed
        assert first.headers.get("connection", "keep-alive") == "keep-alive"
        assert sse_events(second.body)[-1] == "[DONE]"
        await wait_for(lambda: worker.finished == 2, 2)

        closing = await client.request("GET", "/health", headers={"connection": "close"})
        assert closing.status == 200
        assert closing.headers["connection"] == "close"
        assert await client.reader.read() == b""  # server closed its side
        await client.close()


@pytest.mark.asyncio
@bounded
async def test_http_1_0_closes_by_default() -> None:
    async with FakeWorker() as worker:
        reader, writer = await asyncio.open_connection("127.0.0.1", worker.port)
        writer.write(b"GET /health HTTP/1.0\r\n\r\n")
        data = await reader.read()  # returns once the server closes
        assert re.match(rb"HTTP/1\.[01] 200 OK\r\n", data)
        assert data.endswith(b'{"status": "ok"}')
        writer.close()


@pytest.mark.asyncio
@bounded
async def test_disconnect_mid_stream_is_recorded_cancelled() -> None:
    async with FakeWorker(tokens=100, stream_interval=0.05, service_time=0) as worker:
        client = await RawClient.connect(worker)
        await client.send("POST", "/v1/chat/completions", STREAM_CHAT, {"x-request-id": "s"})
        status, _ = await client.read_head()
        assert status == 200
        assert (await client.read_chunk()).startswith(b"data: {")
        assert worker.running == 1
        await client.close()
        await wait_for(lambda: worker.cancelled == 1, 2)
        record = worker.records[0]
        assert record.outcome == "cancelled"
        assert record.duration is not None and record.duration < 2
        assert (worker.running, worker.finished) == (0, 0)


@pytest.mark.asyncio
@bounded
async def test_disconnect_during_service_time_is_recorded_cancelled() -> None:
    async with FakeWorker() as worker:
        client = await RawClient.connect(worker)
        await client.send("POST", "/v1/chat/completions", CHAT, {"x-fake-service-time": "30"})
        await wait_for(lambda: worker.running == 1, 2)
        t0 = time.monotonic()
        await client.close()
        await wait_for(lambda: worker.cancelled == 1, 2)
        assert time.monotonic() - t0 < 2
        assert worker.running == 0
        assert worker.records[0].outcome == "cancelled"


@pytest.mark.asyncio
@bounded
async def test_connection_reset_is_recorded_cancelled() -> None:
    async with FakeWorker() as worker:
        client = await RawClient.connect(worker)
        await client.send("POST", "/v1/chat/completions", CHAT, {"x-fake-service-time": "30"})
        await wait_for(lambda: worker.running == 1, 2)
        client.writer.transport.abort()  # RST rather than FIN
        await wait_for(lambda: worker.cancelled == 1, 2)


@pytest.mark.asyncio
@bounded
async def test_service_time_header_overrides_default() -> None:
    async with FakeWorker(service_time=0.01) as worker:
        t0 = time.monotonic()
        slow = await request(
            worker, "POST", "/v1/chat/completions", CHAT, {"x-fake-service-time": "0.3"}
        )
        assert slow.status == 200
        assert time.monotonic() - t0 >= 0.28

        worker.service_time = 60
        t0 = time.monotonic()
        fast = await request(
            worker, "POST", "/v1/chat/completions", CHAT, {"x-fake-service-time": "0"}
        )
        assert fast.status == 200
        assert time.monotonic() - t0 < 5

        bad = await request(
            worker, "POST", "/v1/chat/completions", CHAT, {"x-fake-service-time": "soon"}
        )
        assert bad.status == 400


@pytest.mark.asyncio
@bounded
async def test_peak_running_counts_concurrent_requests() -> None:
    async with FakeWorker(service_time=0.2) as worker:
        results = await asyncio.gather(
            *(request(worker, "POST", "/v1/chat/completions", CHAT) for _ in range(3))
        )
        assert [r.status for r in results] == [200] * 3
        assert worker.peak_running == 3
        assert worker.finished == 3


@pytest.mark.asyncio
@bounded
async def test_unhealthy_worker_still_serves_completions() -> None:
    async with FakeWorker() as worker:
        worker.healthy = False
        resp = await request(worker, "POST", "/v1/chat/completions", CHAT)
        assert resp.status == 200


@pytest.mark.asyncio
@bounded
async def test_admin_endpoints() -> None:
    async with FakeWorker(name="adm") as worker:
        await request(worker, "POST", "/v1/chat/completions", CHAT, {"x-request-id": "r1"})
        stats = (await request(worker, "GET", "/admin/stats")).json()
        assert (stats["started"], stats["finished"], stats["cancelled"], stats["running"]) == (
            1, 1, 0, 0
        )
        (entry,) = stats["requests"]
        assert entry["request_id"] == "r1"
        assert entry["outcome"] == "finished"
        assert "headers" not in entry

        resp = await request(worker, "POST", "/admin/health", {"healthy": False})
        assert resp.status == 200
        assert worker.healthy is False
        assert (await request(worker, "GET", "/health")).status == 503
        resp = await request(worker, "POST", "/admin/health", {"healthy": True})
        assert worker.healthy is True
        resp = await request(worker, "POST", "/admin/health", {"healthy": "no"})
        assert resp.status == 400

        assert (await request(worker, "POST", "/admin/reset")).status == 200
        stats = (await request(worker, "GET", "/admin/stats")).json()
        assert stats["started"] == 0 and stats["requests"] == []
        assert worker.records == []


@pytest.mark.asyncio
@bounded
async def test_unknown_routes_are_404_json() -> None:
    async with FakeWorker() as worker:
        for method, path in [("GET", "/nope"), ("GET", "/v1/chat/completions")]:
            resp = await request(worker, method, path)
            assert resp.status == 404
            assert "error" in resp.json()


@pytest.mark.asyncio
@bounded
async def test_bad_requests_get_400() -> None:
    async with FakeWorker() as worker:
        client = await RawClient.connect(worker)
        client.writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: t\r\ncontent-length: 5\r\n\r\nnope!"
        )
        resp = await client.read_response()
        assert resp.status == 400
        assert "invalid JSON body" in resp.json()["error"]
        await client.close()

        reader, writer = await asyncio.open_connection("127.0.0.1", worker.port)
        writer.write(b"garbage\r\n\r\n")
        assert re.match(rb"HTTP/1\.[01] 400 ", await reader.read())
        writer.close()
        assert worker.records == []


@pytest.mark.asyncio
@bounded
async def test_chunked_request_body_is_accepted() -> None:
    async with FakeWorker() as worker:
        client = await RawClient.connect(worker)
        body = json.dumps(STREAM_CHAT).encode()
        client.writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: test\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
            + f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n"
        )
        resp = await client.read_response()
        assert resp.status == 200
        assert sse_events(resp.body)[-1] == "[DONE]"
        assert (await client.request("GET", "/health")).status == 200
        await client.close()


@pytest.mark.asyncio
@bounded
async def test_standard_library_client_interoperates() -> None:
    """urllib is a strict-enough HTTP client to catch framing mistakes."""
    async with FakeWorker(name="u") as worker:

        def fetch() -> tuple[int, dict[str, Any], int]:
            req = urllib.request.Request(
                f"{worker.url}/v1/chat/completions",
                data=json.dumps(CHAT).encode(),
                headers={"content-type": "application/json"},
            )
            with urllib.request.urlopen(req, timeout=5) as resp:
                payload = json.loads(resp.read())
                code = resp.status
            try:
                urllib.request.urlopen(f"{worker.url}/missing", timeout=5)
            except urllib.error.HTTPError as err:
                missing = err.code
            return code, payload, missing

        code, payload, missing = await asyncio.to_thread(fetch)
        assert (code, payload["worker"], missing) == (200, "u", 404)


@pytest.mark.asyncio
@bounded
async def test_stop_cancels_in_flight_requests() -> None:
    worker = FakeWorker()
    await worker.start()
    client = await RawClient.connect(worker)
    await client.send("POST", "/v1/chat/completions", CHAT, {"x-fake-service-time": "30"})
    await wait_for(lambda: worker.running == 1, 2)
    await asyncio.wait_for(worker.stop(), 2)
    assert worker.records[0].outcome == "cancelled"
    assert await client.reader.read() == b""
    client.writer.close()


@pytest.mark.asyncio
@bounded
async def test_wait_for_times_out() -> None:
    with pytest.raises(TimeoutError):
        await wait_for(lambda: False, 0.05)
    await wait_for(lambda: True, 0)


@pytest.mark.asyncio
@bounded
async def test_fleet_starts_named_workers_on_distinct_ports() -> None:
    async with Fleet(3, max_running_requests=2, service_time=0.01) as fleet:
        ports = [port for _, port in fleet.addresses]
        assert len(set(ports)) == 3 and all(ports)
        assert fleet.urls == [f"http://127.0.0.1:{p}" for p in ports]
        for i, worker in enumerate(fleet.workers, start=1):
            info = (await request(worker, "GET", "/server_info")).json()
            assert info == {"name": f"w{i}", "max_running_requests": 2}


@pytest.mark.asyncio
@bounded
async def test_cli_serves_until_sigterm() -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "devtools.fleet",
        "--workers", "2", "--base-port", "0", "--max-running-requests", "3",
        stdout=asyncio.subprocess.PIPE, env=env, cwd=REPO_ROOT,
    )
    try:
        assert proc.stdout is not None
        lines = [(await proc.stdout.readline()).decode().strip() for _ in range(2)]
        assert [line.split()[1] for line in lines] == ["w1", "w2"]
        for line in lines:
            assert line.startswith("worker w") and " listening on http://127.0.0.1:" in line
            url = line.rsplit(" ", 1)[1]

            def fetch(url: str = url) -> Any:
                with urllib.request.urlopen(f"{url}/server_info", timeout=5) as resp:
                    return json.loads(resp.read())

            assert (await asyncio.to_thread(fetch))["max_running_requests"] == 3
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 5) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


@pytest.mark.asyncio
@bounded
async def test_gate_holds_a_request_until_the_test_opens_it() -> None:
    async with Fleet(2, service_time=0) as fleet:
        worker = fleet.workers[1]
        client = await RawClient.connect(worker)
        await client.send("POST", "/v1/chat/completions", CHAT, {"x-fake-gate": "g"})
        await wait_for(lambda: worker.running == 1, 2)
        held = asyncio.ensure_future(client.read_response())
        await asyncio.sleep(0.1)  # a response would arrive well within this
        assert not held.done() and worker.running == 1
        fleet.gates.open("g")  # the fleet's gates are every worker's
        assert (await held).status == 200
        assert worker.finished == 1
        # an open gate stays open: later requests on it pass at once
        resp = await client.request("POST", "/v1/chat/completions", CHAT, {"x-fake-gate": "g"})
        assert resp.status == 200
        await client.close()


@pytest.mark.asyncio
@bounded
async def test_stream_gate_holds_after_the_first_token() -> None:
    async with FakeWorker(service_time=0, tokens=3, stream_interval=0) as worker:
        client = await RawClient.connect(worker)
        await client.send("POST", "/v1/chat/completions", STREAM_CHAT,
                          {"x-fake-stream-gate": "s"})
        status, _ = await client.read_head()
        assert status == 200
        assert b"tok0" in await client.read_chunk()
        second = asyncio.ensure_future(client.read_chunk())
        await asyncio.sleep(0.1)
        assert not second.done() and worker.running == 1
        opened = await request(worker, "POST", "/admin/gates", {"open": "s"})
        assert (opened.status, opened.json()) == (200, {"opened": "s"})
        assert b"tok1" in await second
        await wait_for(lambda: worker.finished == 1, 2)
        bad = await request(worker, "POST", "/admin/gates", {"open": 3})
        assert bad.status == 400
        await client.close()


@pytest.mark.asyncio
@bounded
async def test_client_gone_while_held_at_a_gate_is_recorded_cancelled() -> None:
    async with FakeWorker(service_time=0) as worker:
        client = await RawClient.connect(worker)
        await client.send("POST", "/v1/chat/completions", CHAT, {"x-fake-gate": "never"})
        await wait_for(lambda: worker.running == 1, 2)
        await client.close()
        await wait_for(lambda: worker.cancelled == 1, 2)
        assert worker.running == 0


@pytest.mark.asyncio
@bounded
async def test_the_tally_does_not_count_a_request_whose_connection_closed() -> None:
    """Envoy ends an aborted request by closing its connection; the worker cancels the
    handler a loop step or two later. A request arriving in between must not make the
    tally's peak count the abandoned one, while one still connected always counts."""
    async with FakeWorker() as worker:
        held = await RawClient.connect(worker)
        await held.send("POST", "/v1/chat/completions", CHAT, {"x-fake-service-time": "30"})
        await wait_for(lambda: worker.running == 1, 2)
        left = await RawClient.connect(worker)
        await left.send("POST", "/v1/chat/completions", CHAT, {"x-fake-service-time": "30"})
        await wait_for(lambda: worker.running == 2, 2)
        assert worker.tally.peak == 2  # both connected: both count
        arriving = await RawClient.connect(worker)
        # The close and the next request reach the worker in the same loop step.
        left.writer.transport.abort()
        arriving.write("POST", "/v1/chat/completions", CHAT, {"x-fake-service-time": "30"})
        await wait_for(lambda: worker.cancelled == 1 and worker.running == 2, 2)
        assert worker.tally.peak == 2, "the abandoned request was counted beside the new one"
        assert worker.tally.running == 2
        third = await RawClient.connect(worker)
        await third.send("POST", "/v1/chat/completions", CHAT, {"x-fake-service-time": "30"})
        await wait_for(lambda: worker.running == 3, 2)
        assert worker.tally.peak == 3  # a third connected request is counted
        for client in (held, arriving, third):
            client.writer.transport.abort()
