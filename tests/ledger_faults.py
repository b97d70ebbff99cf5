"""Copies of a fleet's keyspace, for the tests of a ledger restored from an older copy.

An RDB snapshot restart, an AOF replay and a failover to a lagging replica all leave the
server with an older state of every key at once: DUMP every key of the fleet at time T,
then (later) delete them all and RESTORE the copy.
"""

from __future__ import annotations

import redis.asyncio as redis

from devtools.valkey import ValkeyServer


def raw_client(server: ValkeyServer) -> redis.Redis:
    return redis.Redis(port=server.port, decode_responses=False)  # DUMP payloads are bytes


async def copy_keyspace(server: ValkeyServer, fleet: str) -> dict[bytes, bytes]:
    c = raw_client(server)
    try:
        keys = await c.keys(f"pg:{{{fleet}}}:*")
        return {k: await c.dump(k) for k in keys}
    finally:
        await c.aclose()


async def restore_keyspace(server: ValkeyServer, fleet: str, copy: dict[bytes, bytes]) -> None:
    """Replace the fleet's keys by ``copy`` in one MULTI (nobody sees a half-restored state)."""
    c = raw_client(server)
    try:
        now = await c.keys(f"pg:{{{fleet}}}:*")
        async with c.pipeline(transaction=True) as p:
            if now:
                p.delete(*now)
            for k, v in copy.items():
                p.restore(k, 0, v, replace=True)
            await p.execute()
    finally:
        await c.aclose()
