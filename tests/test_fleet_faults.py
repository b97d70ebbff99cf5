"""Whole sidecars on a ledger that lost writes, or restarted under the same replica id.

Real valkey-server, real runtimes (``build_runtime`` + ``serve``), Envoy played by the gRPC
stand-in, as in tests/test_fleet.py. Ground truth is counted by the test from the answers
the stand-in got: what ran = admitted answers minus the final entries it sent; no ledger
counter is trusted.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import redis.asyncio as redis
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

from devtools.valkey import ValkeyServer
from sidecar.coordination.ledger import FleetLedger
from sidecar.scheduler import ReleaseReason
from tests.grpc_client import admission_id
from tests.ledger_faults import copy_keyspace, restore_keyspace
from tests.ledger_support import client, valkey_server
from tests.test_fleet import (
    FLEET,
    PRIORITY,
    Replica,
    deny_code,
    eventually,
    inflight,
    ok,
    own_client,
    own_server,
    request_headers,
    start_replica,
)

__all__ = ["client", "own_client", "own_server", "valkey_server"]  # fixtures used by name

TIMEOUT = 1.5  # default class queue timeout in these tests
FAST_QUEUE = PRIORITY.replace("default: {reserved_per_slot: 0.0, queue_size: 50, "
                              "queue_timeout_secs: 20}",
                              f"default: {{reserved_per_slot: 0.0, queue_size: 50, "
                              f"queue_timeout_secs: {TIMEOUT}}}")


class Running:
    """Ground truth: the requests the stand-ins were admitted and have not ended."""

    def __init__(self) -> None:
        self.ids: set[str] = set()
        self.peak = 0

    def admitted(self, aid: str) -> None:
        self.ids.add(aid)
        self.peak = max(self.peak, len(self.ids))


async def answered_at(call: grpc.aio.UnaryUnaryCall) -> tuple[Any, float]:
    resp = await call
    return resp, time.monotonic()


async def watch(calls: list[grpc.aio.UnaryUnaryCall], truth: Running, secs: float) -> None:
    """Collect admitted answers as they come, for ``secs``."""
    t0 = time.monotonic()
    seen: set[int] = set()
    while time.monotonic() - t0 < secs:
        for i, c in enumerate(calls):
            if i not in seen and c.done():
                seen.add(i)
                resp = await c
                if resp.status.code == 0:
                    truth.admitted(admission_id(resp))
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("how", ["rdb_restart", "keys_restored"])
async def test_a_ledger_restored_from_an_older_copy_admits_nothing_past_capacity(
        tmp_path: Path, own_server: ValkeyServer, own_client: redis.Redis, how: str) -> None:
    # Capacity 4, A and B. A runs 2; the copy is taken (an RDB snapshot, or what an async
    # replica has when it is promoted); B runs 2 and queues W. The server comes back with
    # the copy: it knows only A's 2 and not W. Before: A and B admitted 2 more through it
    # (6 of 4), and W waited until the client's own deadline. rdb_restart: a real restart
    # from the RDB file (a failover is the same to the ledger: another server process with
    # an older state); keys_restored: DUMP/RESTORE of the keys on the same server.
    ttl = 2.0
    a = await start_replica(tmp_path, own_server.url, "a", capacity=4, ttl=ttl,
                            priority=FAST_QUEUE)
    b = await start_replica(tmp_path, own_server.url, "b", capacity=4, ttl=ttl,
                            priority=FAST_QUEUE)
    truth = Running()
    try:
        await eventually(lambda: a.fleet.live_replicas == 2, what="A sees both")
        for r in (a, a):
            truth.admitted(await ok(r.check()))
        if how == "rdb_restart":
            await own_client.save()
        else:
            copy = await copy_keyspace(own_server, FLEET)
        for r in (b, b):
            truth.admitted(await ok(r.check()))
        t_w = time.monotonic()
        w = asyncio.ensure_future(answered_at(b.check()))
        await eventually(lambda: b.fleet.waiting == 1, what="W queued in the ledger")
        if how == "rdb_restart":
            own_server.restart()
        else:
            # The generation finds the copy older on the first call of a replica that saw
            # a later state: make sure A has too (design, "Data loss the ledger notices").
            await a.fleet.ledger.heartbeat()
            await restore_keyspace(own_server, FLEET, copy)
        more = [r.check() for r in (a, b) for _ in range(2)]
        await watch(more, truth, 2 * ttl)
        assert truth.peak <= 4, f"{truth.peak} ran at once of capacity 4"
        resp, at = await asyncio.wait_for(w, 3 * TIMEOUT)
        waited = at - t_w
        print(f"stale restore: peak {truth.peak}/4; W answered after {waited:.2f} s "
              f"(queue timeout {TIMEOUT} s)")
        assert deny_code(resp) == (503, "scheduler_queue_timeout")
        assert waited <= TIMEOUT + 1.0
        cause = "server_changed" if how == "rdb_restart" else "stale_copy"
        assert a.sample("smg_sidecar_coordination_faults_total", kind=cause) + \
            b.sample("smg_sidecar_coordination_faults_total", kind=cause) == 1
        await eventually(lambda: a.fleet.state == "ok" and b.fleet.state == "ok",
                         timeout=3 * ttl, what="both back to ok")
        assert await inflight(own_client) == len(truth.ids) == 4
        for r in (a, b):
            await r.end(*(x for x in truth.ids if x in r.fleet.held))
        for c in more:
            c.cancel()
    finally:
        await a.close()
        await b.close()


async def test_a_waiter_the_ledger_lost_expires_on_its_own_queue_timeout(
        tmp_path: Path, valkey_server: ValkeyServer, client: redis.Redis) -> None:
    # The ledger's queue keys are lost (an operator's DEL, eviction) while W waits: no
    # grant or expiry will ever come from it. W is answered at its class's queue timeout
    # (one call timeout later at most), not at the client's deadline.
    a = await start_replica(tmp_path, valkey_server.url, "a", capacity=1, ttl=2.0,
                            priority=FAST_QUEUE)
    try:
        held = await ok(a.check())
        t0 = time.monotonic()
        w = a.check()
        await eventually(lambda: a.fleet.waiting == 1, what="W queued in the ledger")
        await client.delete(f"pg:{{{FLEET}}}:w", f"pg:{{{FLEET}}}:q:1", f"pg:{{{FLEET}}}:dl")
        resp = await asyncio.wait_for(w, 3 * TIMEOUT)
        took = time.monotonic() - t0
        print(f"lost waiter answered after {took:.2f} s (queue timeout {TIMEOUT} s)")
        assert deny_code(resp) == (503, "scheduler_queue_timeout")
        assert TIMEOUT - 0.05 <= took <= TIMEOUT + 0.6
        await a.end(held)
    finally:
        await a.close()


async def test_a_restarted_sidecar_with_the_same_replica_id_keeps_its_running_streams_counted(
        tmp_path: Path, valkey_server: ValkeyServer, client: redis.Redis) -> None:
    # Capacity 3. The sidecar container of replica A restarts (k8s keeps POD_NAME, so the
    # same --replica-id) while its 3 streams still run in Envoy. Before: the new process's
    # first resync dropped its predecessor's admissions, B admitted 3 more (6 of 3), and
    # the periodic entries' adoption was refused by the ledger, unnoticed.
    # ttl 10: a resync drops what it does not list once older than 4 call timeouts (4 s),
    # well inside the old registration's 9 s.
    ttl = 10.0
    old = await start_replica(tmp_path, valkey_server.url, "a", capacity=3, ttl=ttl)
    b = await start_replica(tmp_path, valkey_server.url, "b", capacity=3, ttl=ttl)
    new: Replica | None = None
    truth = Running()
    try:
        for _ in range(3):
            truth.admitted(await ok(old.check()))
        await old.fleet.ledger.heartbeat()  # its registration runs 9 s from here
        await old.close()  # the process ends; Envoy's streams run on
        await asyncio.sleep(4.2)  # older than any resync's min_age (4 x call timeout)
        new = await start_replica(tmp_path, valkey_server.url, "a", capacity=3, ttl=ttl)
        assert set(new.fleet.held) == truth.ids
        assert new.sample("smg_sidecar_coordination_faults_total", kind="taken_over") == 1
        on_b = [b.check() for _ in range(3)]
        await watch(on_b, truth, 4.0)  # past the first heartbeat (resync) of each
        print(f"restart with the same id: peak {truth.peak}/3, ledger "
              f"{await inflight(client)}")
        assert truth.peak <= 3
        assert await inflight(client) == 3
        await new.end(*list(truth.ids))
        truth.ids.clear()
        for c in on_b:
            truth.admitted(await ok(c))
        assert truth.peak <= 3
        await b.end(*list(truth.ids))
    finally:
        await b.close()
        if new is not None:
            await new.close()


async def test_a_running_stream_the_ledger_had_ended_is_counted_again_on_adoption(
        tmp_path: Path, valkey_server: ValkeyServer, client: redis.Redis) -> None:
    # X runs under replica A; the ledger ends X behind A's back (a resync that did not list
    # it, a preemption whose stop never reached the stream). A's process restarts (same
    # id: X is not taken over, the ledger no longer has it) and Envoy's periodic entry
    # names X: the adoption must count it again. Before: the ledger refused the re-add
    # and the refusal was ignored (X ran uncounted).
    old = await start_replica(tmp_path, valkey_server.url, "a", capacity=2, ttl=2.0)
    new: Replica | None = None
    try:
        x = await ok(old.check())
        observer = FleetLedger(client, FLEET, "observer")
        assert (await observer.release(x)).value == "released"
        await old.close()
        new = await start_replica(tmp_path, valkey_server.url, "a", capacity=2, ttl=2.0)
        assert x not in new.fleet.held
        await new.envoy.log((x, "periodic"), cls="default")
        assert x in new.fleet.held
        await eventually(lambda: _equals(client, 1), what="X counted again in the ledger")
        await eventually(lambda: new is not None and new.sample(
            "smg_sidecar_coordination_faults_total", kind="ended_but_running_readded") == 1,
            what="the re-add counted")
    finally:
        if new is not None:
            await new.close()


@pytest.mark.parametrize("stop_channel", [True, False])
async def test_an_admission_held_here_that_the_ledger_ended_is_not_ignored(
        tmp_path: Path, valkey_server: ValkeyServer, client: redis.Redis,
        stop_channel: bool) -> None:
    # The ledger ended X (as a preemption would) and its notification never came (lost
    # with an older copy): A's heartbeat resync lists X and the ledger refuses it. Before,
    # the refusal was ignored and X ran on uncounted. Now X is stopped as preempted if its
    # stop channel is open (its ext_proc stream, before the first byte); otherwise it runs
    # on and is counted in the ledger again.
    a = await start_replica(tmp_path, valkey_server.url, "a", capacity=2, ttl=2.0)
    outgoing: asyncio.Queue[ep.ProcessingRequest | None] = asyncio.Queue()

    async def requests() -> AsyncIterator[ep.ProcessingRequest]:
        while (m := await outgoing.get()) is not None:
            yield m

    try:
        x = await ok(a.check())
        if stop_channel:
            stream = a.ext_proc(requests())
            await outgoing.put(request_headers(x))
            assert (await stream.read()).WhichOneof("response") == "request_headers"
        observer = FleetLedger(client, FLEET, "observer")
        assert (await observer.release(x, ReleaseReason.PREEMPTED)).value == "released"
        if stop_channel:
            msg = await asyncio.wait_for(stream.read(), 3.0)  # the next heartbeat
            assert msg.immediate_response.status.code == 503
            assert x not in a.fleet.held and await inflight(client) == 0
            kind = "ended_but_running_stopped"
        else:
            await eventually(lambda: _equals(client, 1), timeout=3.0,
                             what="X counted again at the next heartbeat")
            assert x in a.fleet.held
            kind = "ended_but_running_readded"
        await eventually(lambda: a.sample("smg_sidecar_coordination_faults_total",
                                          kind=kind) == 1, what=f"{kind} counted")
    finally:
        await outgoing.put(None)
        await a.close()


async def _equals(client: redis.Redis, n: int) -> bool:
    return await inflight(client) == n
