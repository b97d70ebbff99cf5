"""A real valkey-server for the ledger's tests (no fake Redis), and helpers around it.

Import the fixtures into a test module: ``from tests.ledger_support import valkey_server``.
One server per test session; each test starts from an empty database (FLUSHALL).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest
import redis.asyncio as redis

from devtools.valkey import ValkeyServer


@pytest.fixture(scope="session")
def valkey_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ValkeyServer]:
    server = ValkeyServer(tmp_path_factory.mktemp("valkey"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


def connect(server: ValkeyServer) -> redis.Redis:
    return redis.Redis(port=server.port, decode_responses=True)


@pytest.fixture
async def client(valkey_server: ValkeyServer) -> AsyncIterator[redis.Redis]:
    c = connect(valkey_server)
    await c.flushall()
    try:
        yield c
    finally:
        await c.aclose()
