"""Health probing (sidecar/health.py) against real fake workers over loopback."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest

from devtools.fleet import FakeWorker
from devtools.stack import free_port
from sidecar.health import (
    DEFAULT_WORKER_CAPACITY,
    BodyTooLarge,
    http_get,
    new_session,
    probe_worker,
)


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with new_session() as s:
        yield s


async def test_probe_reads_capacity_from_server_info(session: aiohttp.ClientSession) -> None:
    async with FakeWorker(max_running_requests=7) as worker:
        assert await probe_worker(session, worker.url, 2) == 7
        worker.max_running_requests = None  # not reported: the documented default
        assert await probe_worker(session, worker.url + "/", 2) == DEFAULT_WORKER_CAPACITY
        worker.healthy = False
        assert await probe_worker(session, worker.url, 2) is None


async def test_probe_of_an_absent_worker_is_unhealthy(session: aiohttp.ClientSession) -> None:
    assert await probe_worker(session, f"http://127.0.0.1:{free_port()}", 2) is None


async def test_http_get_bounds_the_body(session: aiohttp.ClientSession) -> None:
    async with FakeWorker(name="w" * 5000) as worker:
        # Over the limit: not read further, not parsed.
        with pytest.raises(BodyTooLarge):
            await http_get(session, f"{worker.url}/server_info", 2, limit=100)
        status, body = await http_get(session, f"{worker.url}/server_info", 2)
        assert status == 200 and body.startswith(b'{"name": "www') and len(body) > 5000
