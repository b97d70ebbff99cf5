"""HTTP/1.1 load client for the Envoy benchmarks (aiohttp, run in its own process).

Keep-alive connections from a pool: a closed-loop mode (N connections back to back)
and an open-loop mode (several paced streams, each its own rate and headers; a
request takes an idle connection or opens one, so the schedule never waits for a
response). Records per request: stream, start offset, latency, status, error code.

    python -m bench.httpload --client JSON   (started by :func:`through_envoy`)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import TYPE_CHECKING, Any

import aiohttp

from bench._util import cpu_seconds, run_client_async

if TYPE_CHECKING:  # the client process itself needs no stack
    from devtools.stack import Stack

BODY = json.dumps({"model": "demo", "messages": [{"role": "user", "content": "hi"}]}).encode()
ERRORS = (aiohttp.ClientError, TimeoutError, OSError, ValueError)


class _CountingConnector(aiohttp.TCPConnector):
    """Counts the connections it opens (a TraceConfig would cost every request)."""

    opened = 0

    async def _create_connection(self, req: Any, traces: Any, timeout: Any) -> Any:
        self.opened += 1
        return await super()._create_connection(req, traces, timeout)


class Pool:
    """One aiohttp session: keep-alive connections, opened on demand, no limit.

    Trimmed for the hot path: no cookie jar, no decompression, no auto headers.
    """

    def __init__(self, port: int, timeout: float, body: bytes = BODY) -> None:
        self.url = f"http://127.0.0.1:{port}/v1/chat/completions"
        self.body = body
        self.connector = _CountingConnector(limit=0)
        self.session = aiohttp.ClientSession(
            connector=self.connector, trust_env=False, cookie_jar=aiohttp.DummyCookieJar(),
            auto_decompress=False, timeout=aiohttp.ClientTimeout(total=timeout),
            skip_auto_headers=["User-Agent", "Accept", "Accept-Encoding"])

    @property
    def opened(self) -> int:
        return self.connector.opened

    async def send(self, headers: dict[str, str]) -> tuple[int, str]:
        """One request within the session's timeout; returns (status, x-smg-error-code)."""
        async with self.session.post(self.url, data=self.body, headers=headers) as resp:
            await resp.read()
            return resp.status, resp.headers.get("x-smg-error-code", "")

    async def close(self) -> None:
        await self.session.close()


def request_headers(headers: dict[str, str]) -> dict[str, str]:
    return {"Content-Type": "application/json", **headers}


async def run(spec: dict[str, Any]) -> dict[str, Any]:
    port = int(spec["port"])
    seconds = float(spec["seconds"])
    timeout = float(spec.get("timeout", 30))
    pids = [int(p) for p in spec.get("pids", [])]
    # spec["body"]: the request body (text) instead of the small chat request.
    pool = Pool(port, timeout, str(spec["body"]).encode() if spec.get("body") else BODY)
    records: list[tuple[str, float, float, int, str]] = []
    errors = 0

    async def one(name: str, head: dict[str, str], t0: float) -> None:
        nonlocal errors
        t = time.perf_counter()
        try:
            status, code = await pool.send(head)
        except ERRORS:
            errors += 1
            return
        records.append((name, t - t0, time.perf_counter() - t, status, code))

    warm = request_headers(spec.get("warmup_headers", {}))
    for _ in range(int(spec.get("warmup", 20))):
        await one("warmup", warm, 0.0)
    records.clear()
    cpu0 = time.process_time()
    pcpu0 = [cpu_seconds(p) for p in pids]
    t0 = time.perf_counter()
    send_start = time.time()  # wall clock, to line up with the sidecar's slot trace
    end = t0 + seconds
    streams = spec["streams"]
    tasks: set[asyncio.Task[None]] = set()
    if spec.get("concurrency"):  # closed loop over the first stream's headers
        head = request_headers(streams[0].get("headers", {}))

        async def caller() -> None:
            while time.perf_counter() < end:
                await one(streams[0]["name"], head, t0)
        await asyncio.gather(*(caller() for _ in range(int(spec["concurrency"]))))
    else:
        heads = [request_headers(s.get("headers", {})) for s in streams]
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
    await pool.close()
    return {"wall": wall, "send_wall": send_wall, "send_start": send_start, "records": records,
            "errors": errors, "client_cpu": cpu, "cpu": pcpu, "connections": pool.opened}


async def through_envoy(stack: Stack, seconds: float, streams: list[dict[str, Any]], *,
                        concurrency: int = 0, timeout: float = 10, margin: float = 60,
                        client: str = "bench.httpload", **extra: object) -> dict[str, object]:
    """Run this client in its own process against ``stack``'s Envoy for ``seconds``: closed
    loop with ``concurrency`` connections, else the open-loop ``streams``; Envoy's and the
    sidecar's CPU are sampled. ``extra``: more spec keys (warmup, warmup_headers).
    ``client``: the client module (``bench.rawload``: the cheaper open-loop one)."""
    assert stack.envoy is not None and stack.sidecar is not None
    spec: dict[str, object] = {
        "port": stack.listen_port, "seconds": seconds, "concurrency": concurrency,
        "streams": streams, "pids": [stack.envoy.pid, stack.sidecar.pid], "timeout": timeout,
        **extra}
    return await run_client_async(client, spec, timeout=seconds + margin)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--client", required=True)
    args = p.parse_args(argv)
    print(json.dumps(asyncio.run(run(json.loads(args.client)))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
