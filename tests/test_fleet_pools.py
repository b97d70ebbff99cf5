"""Model pools in a fleet: two sidecar runtimes, two pools, one real valkey-server.

Each runtime is a whole sidecar (``build_runtime`` + ``serve``) with ``--coordination-url``
and ``--worker-urls POOL=URL``; the pools' capacities come from their own fake workers
(default pool 2 slots, ``big`` 1). Envoy is played by the gRPC stand-in; the route's pool
reaches the Check as ext_authz's ``context_extensions`` (``smg-pool``), as Envoy sends it.
The ground truth is counted here, outside the code: which admissions this test holds and
has not ended, per pool, and each pool's ledger namespace in the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import redis.asyncio as redis
from envoy.service.auth.v3 import external_auth_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from redis.exceptions import NoPermissionError

from devtools.fleet import Fleet
from devtools.valkey import ValkeyServer
from sidecar.app import build_runtime
from sidecar.classes import PriorityClass
from sidecar.config import ConfigError, parse_priority_config, parse_settings
from sidecar.coordination import server
from sidecar.coordination.ledger import LUA, FleetLedger, config_digest
from sidecar.pools import DEFAULT_POOL, pool_of
from sidecar.scheduler import BUILTIN_CLASSES
from tests.grpc_client import admission_id, assert_preemption_message, check_request, headers_of
from tests.ledger_support import client, valkey_server
from tests.test_coordination_security import create_runtime_user
from tests.test_fleet import (
    FLEET,
    PRIORITY,
    Replica,
    deny_code,
    eventually,
    ok,
    own_server,
    request_headers,
)

__all__ = ["client", "own_server", "valkey_server"]  # fixtures used by name

BIG = "big"
CAPACITY = {DEFAULT_POOL: 2, BIG: 1}
NAMESPACE = {DEFAULT_POOL: f"pg:{{{FLEET}}}", BIG: f"pg:{{{FLEET}}}:pool:{BIG}"}


class PoolReplica(Replica):
    def __init__(self, app: object) -> None:
        super().__init__(app)  # type: ignore[arg-type]
        self._check_pool = self.envoy.channel.unary_unary(
            "/envoy.service.auth.v3.Authorization/Check",
            request_serializer=external_auth_pb2.CheckRequest.SerializeToString,
            response_deserializer=external_auth_pb2.CheckResponse.FromString)

    def check_in(self, pool: str | None, cls: str = "default") -> grpc.aio.UnaryUnaryCall:
        """A Check from a route naming ``pool`` (None: a route that names none)."""
        req = check_request({"x-smg-priority": cls, "x-smg-tenant": "t"})
        if pool is not None:
            req.attributes.context_extensions["smg-pool"] = pool
        return self._check_pool(req)


@contextlib.asynccontextmanager
async def pool_replicas(tmp_path: Path, url: str, priority: str = PRIORITY,
                        ttl: float = 10.0) -> AsyncIterator[tuple[PoolReplica,
                                                                         PoolReplica]]:
    # One worker each: the default pool's reports 2 slots, big's 1.
    fleets = {name: Fleet(1, max_running_requests=cap) for name, cap in CAPACITY.items()}
    for f in fleets.values():
        await f.start()
    cfg = tmp_path / "priority.yaml"
    cfg.write_text(priority)
    started: list[PoolReplica] = []
    try:
        for name in ("a", "b"):
            app = await build_runtime(parse_settings([
                "--priority-scheduler-enabled", "--priority-scheduler-config", str(cfg),
                "--grpc-listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0",
                "--worker-urls", *fleets[DEFAULT_POOL].urls,
                *(f"{BIG}={u}" for u in fleets[BIG].urls), "--log-format", "json",
                "--coordination-url", url, "--fleet-id", FLEET, "--replica-id", name,
                "--replica-ttl-secs", str(ttl)]))
            await app.serve()
            started.append(PoolReplica(app))
        a, b = started
        for r in started:
            for pool, cap in CAPACITY.items():
                f = r.app.fleets[pool]
                await eventually(lambda f=f, cap=cap: f.live_replicas == 2  # type: ignore[misc]
                                 and f.fleet_capacity == cap, what=f"{pool} sees the fleet")
        yield a, b
    finally:
        for r in started:
            await r.close()
        for f in fleets.values():
            await f.stop()


async def ledger_inflight(client: redis.Redis, pool: str) -> int:
    vals = await client.hvals(f"{NAMESPACE[pool]}:inflight")
    return sum(int(v) for v in vals)


async def _all_zero(client: redis.Redis) -> bool:
    return all([await ledger_inflight(client, p) == 0 for p in CAPACITY])


async def test_each_pool_holds_at_most_its_own_capacity_fleet_wide(
        tmp_path: Path, valkey_server: ValkeyServer, client: redis.Redis) -> None:
    async with pool_replicas(tmp_path, valkey_server.url) as (a, b):
        assert a.app.pools is not None and set(a.app.fleets) == set(CAPACITY)
        classes = ["bulk", "default", "interactive", "system"]
        n = 8  # per pool and replica
        calls = {}
        for i in range(n):
            for r in (a, b):
                for pool in CAPACITY:
                    call = r.check_in(pool, classes[i % 4])
                    calls[asyncio.ensure_future(ok(call))] = (r, pool)
        holding: dict[str, dict[str, PoolReplica]] = {p: {} for p in CAPACITY}
        admitted = dict.fromkeys(CAPACITY, 0)
        pending = dict(calls)
        while pending:
            done, _ = await asyncio.wait(pending, timeout=10,
                                         return_when=asyncio.FIRST_COMPLETED)
            assert done, "nobody admitted within 10 s"
            await asyncio.sleep(0.05)  # give any over-admission the chance to show
            for t in [t for t in pending if t.done()]:
                r, pool = pending.pop(t)
                aid = t.result()
                assert pool_of(aid) == pool
                holding[pool][aid] = r
            for pool, cap in CAPACITY.items():
                assert len(holding[pool]) <= cap, pool
                assert await ledger_inflight(client, pool) == len(holding[pool]), pool
            for pool in CAPACITY:
                for aid, r in list(holding[pool].items()):
                    await r.end(aid)  # the access log's final entry
                    del holding[pool][aid]
                    admitted[pool] += 1
        assert admitted == dict.fromkeys(CAPACITY, 2 * n)
        await eventually(lambda: _all_zero(client), what="every pool's ledger empty")
        # Per pool under the pool label; admitted = released per pool.
        for pool in CAPACITY:
            adm = sum(r.sample("smg_scheduler_admit_total", pool=pool,
                               **{"class": c, "outcome": "admitted"})
                      for r in (a, b) for c in classes)
            assert adm == 2 * n, pool
            assert a.sample("smg_sidecar_capacity", pool=pool) == CAPACITY[pool]
            assert a.sample("smg_sidecar_live_replicas", pool=pool) == 2
            assert a.sample("smg_sidecar_coordination_state", pool=pool, state="ok") == 1


async def test_a_flood_on_one_pool_takes_no_slot_of_the_other(
        tmp_path: Path, valkey_server: ValkeyServer, client: redis.Redis) -> None:
    async with pool_replicas(tmp_path, valkey_server.url) as (a, b):
        big_held = [await ok(a.check_in(BIG, "bulk"))]
        flood = [asyncio.ensure_future(r.check_in(BIG, "bulk")) for r in (a, b)
                 for _ in range(10)]
        await eventually(lambda: a.app.fleets[BIG].waiting + b.app.fleets[BIG].waiting == 20,
                         what="big's flood queued")
        # The default pool still has both its slots, on either replica, at once.
        d1 = await ok(a.check_in(DEFAULT_POOL, "interactive"), timeout=5)
        d2 = await ok(b.check_in(None, "bulk"), timeout=5)  # no pool: the default pool
        assert pool_of(d1) == pool_of(d2) == DEFAULT_POOL and len(d2) == 32
        third = asyncio.ensure_future(a.check_in(DEFAULT_POOL, "bulk"))
        await eventually(lambda: a.app.fleets[DEFAULT_POOL].waiting == 1,
                         what="the default pool's third request queued")
        assert await ledger_inflight(client, DEFAULT_POOL) == 2
        assert await ledger_inflight(client, BIG) == 1
        # A slot freed in the default pool goes to its own waiter, not to big's flood.
        await b.end(d2)
        d3 = await ok(third)
        assert pool_of(d3) == DEFAULT_POOL
        assert a.app.fleets[BIG].waiting + b.app.fleets[BIG].waiting == 20
        await a.end(d1, d3)
        # Drain big's flood one slot at a time.
        owner = {id(f): (a if i < 10 else b) for i, f in enumerate(flood)}
        await a.end(*big_held)
        for f in asyncio.as_completed(flood):
            resp = await asyncio.wait_for(f, 10)
            assert resp.status.code == 0
            aid = admission_id(resp)
            assert pool_of(aid) == BIG
            assert await ledger_inflight(client, BIG) == 1
            holder = a if aid in a.app.fleets[BIG].held else b
            await holder.end(aid)
        assert owner  # every flood request was admitted in turn
        await eventually(lambda: _all_zero(client), what="every pool's ledger empty")


async def test_a_system_request_preempts_only_within_its_own_pool(
        tmp_path: Path, valkey_server: ValkeyServer, client: redis.Redis) -> None:
    async with pool_replicas(tmp_path, valkey_server.url) as (a, b):
        # Both pools full of bulk admissions held by B, each before its first byte with
        # its stop channel (ext_proc stream) open: every one a preemption candidate.
        victims = {pool: [await ok(b.check_in(pool, "bulk")) for _ in range(cap)]
                   for pool, cap in CAPACITY.items()}
        outgoing: dict[str, asyncio.Queue[ep.ProcessingRequest | None]] = {}
        streams = {}
        for aids in victims.values():
            for aid in aids:
                q: asyncio.Queue[ep.ProcessingRequest | None] = asyncio.Queue()

                async def requests(q: asyncio.Queue[ep.ProcessingRequest | None] = q
                                   ) -> AsyncIterator[ep.ProcessingRequest]:
                    while (m := await q.get()) is not None:
                        yield m

                outgoing[aid] = q
                streams[aid] = b.ext_proc(requests())
                await q.put(request_headers(aid))
                first = await streams[aid].read()
                assert first.WhichOneof("response") == "request_headers"
        for pool, aids in victims.items():
            await eventually(lambda pool=pool, aids=aids: _marked(  # type: ignore[misc]
                client, pool, len(aids)), what=f"{pool}'s victims marked preemptible")
        winner = await ok(a.check_in(BIG, "system"), timeout=5)
        assert pool_of(winner) == BIG
        (big_victim,) = victims[BIG]
        msg = await asyncio.wait_for(streams[big_victim].read(), 5)
        assert_preemption_message(msg)
        # The default pool's victims are untouched: still held, in its ledger too.
        assert all(v in b.app.fleets[DEFAULT_POOL].held for v in victims[DEFAULT_POOL])
        assert await ledger_inflight(client, DEFAULT_POOL) == 2
        assert await ledger_inflight(client, BIG) == 1
        assert b.sample("smg_scheduler_preemption_total", pool=BIG, victim_class="bulk",
                        by_class="system") == 1
        assert b.sample("smg_scheduler_preemption_total", pool=DEFAULT_POOL,
                        victim_class="bulk", by_class="system") == 0
        # The default pool's victims start their responses (first byte, confirmed by their
        # pool's ledger): no longer candidates, so a system request there now waits.
        for v in victims[DEFAULT_POOL]:
            await outgoing[v].put(ep.ProcessingRequest(response_headers=ep.HttpHeaders()))
            assert await asyncio.wait_for(streams[v].read(), 5) is grpc.aio.EOF
        await eventually(lambda: _marked(client, DEFAULT_POOL, 0),
                         what="the default pool's candidates gone")
        late = asyncio.ensure_future(a.check_in(DEFAULT_POOL, "system"))
        await eventually(lambda: a.app.fleets[DEFAULT_POOL].waiting == 1,
                         what="system queued in the default pool")
        await b.end(victims[DEFAULT_POOL][0])
        late_id = await ok(late, timeout=5)
        for q in outgoing.values():
            await q.put(None)
        await b.end(*victims[DEFAULT_POOL][1:], big_victim)
        await a.end(winner, late_id)
        await eventually(lambda: _all_zero(client), what="every pool's ledger empty")


async def _marked(client: redis.Redis, pool: str, n: int) -> bool:
    return await client.zcard(f"{NAMESPACE[pool]}:pre:0") == n


async def test_unknown_pool_is_a_counted_429_and_ids_route_to_their_pools_ledger(
        tmp_path: Path, valkey_server: ValkeyServer, client: redis.Redis) -> None:
    async with pool_replicas(tmp_path, valkey_server.url) as (a, b):
        resp = await asyncio.wait_for(a.check_in("ghost", "bulk"), 5)
        assert deny_code(resp) == (429, "scheduler_queue_full")
        denied = resp.denied_response
        assert headers_of(denied.headers)["retry-after"] == "2"
        body = json.loads(denied.body)
        assert body["error"]["code"] == "scheduler_queue_full" and "pool" in \
            body["error"]["message"]
        assert a.sample("smg_sidecar_unknown_pool_total", **{"class": "bulk"}) == 1
        assert all([await ledger_inflight(client, p) == 0 for p in CAPACITY])

        # A stream admitted before this process started: the periodic entry names its id
        # (and so its pool) and class; it is adopted into big's ledger, not the default's.
        stray = f"{BIG}.{'ab' * 16}"
        await asyncio.wait_for(b.envoy.log((stray, "periodic"), cls="bulk"), 10)
        await eventually(lambda: _inflight_is(client, BIG, 1), what="adopted into big")
        assert await ledger_inflight(client, DEFAULT_POOL) == 0
        assert stray in b.app.fleets[BIG].held
        # Big is full fleet-wide now: a big Check queues, the default pool admits.
        waiting = asyncio.ensure_future(a.check_in(BIG, "bulk"))
        await eventually(lambda: a.app.fleets[BIG].waiting == 1, what="big queued")
        d = await ok(a.check_in(None, "bulk"), timeout=5)
        await b.end(stray)  # released in big's ledger: the waiter gets the slot
        got = await ok(waiting, timeout=5)
        assert pool_of(got) == BIG
        await a.end(got, d)
        await eventually(lambda: _all_zero(client), what="every pool's ledger empty")
        # An id naming no pool of this sidecar releases nothing, counted.
        await a.end(f"ghost.{'cd' * 16}")
        assert a.sample("smg_sidecar_completion_unmatched_total", reason="unknown") >= 1


async def _inflight_is(client: redis.Redis, pool: str, n: int) -> bool:
    return await ledger_inflight(client, pool) == n


RELOADED = PRIORITY.replace("bulk: {queue_size: 50,", "bulk: {queue_size: 40,") + """
pools:
  big: {classes: {bulk: {queue_size: 3}}}
"""


async def test_reload_applies_per_pool_and_pools_never_look_like_a_collision(
        tmp_path: Path, valkey_server: ValkeyServer, client: redis.Redis) -> None:
    async with pool_replicas(tmp_path, valkey_server.url) as (a, b):
        # Each pool's ledger holds its own replicas, with one config and one capacity
        # source each: what the fleet-id collision check compares (server.watch_fleet).
        for pool in CAPACITY:
            f = a.app.fleets[pool]
            await eventually(lambda f=f: _one_of_each(f), what=f"{pool}: one fleet")  # type: ignore[misc]
        (tmp_path / "priority.yaml").write_text(RELOADED)
        for r in (a, b):
            assert await r.app.reload_now()
            assert r.app.fleets[DEFAULT_POOL].classes[PriorityClass.BULK].queue_size == 40
            assert r.app.fleets[BIG].classes[PriorityClass.BULK].queue_size == 3
        new = parse_priority_config(RELOADED, "p.yaml")
        assert new.classes_for(BIG) != new.classes
        for pool in CAPACITY:
            want = config_digest(new.classes_for(pool))
            f = a.app.fleets[pool]
            await eventually(lambda f=f, want=want: _digests_are(f, want),  # type: ignore[misc]
                             what=f"{pool}'s ledger holds its own new table")
        assert a.sample("smg_sidecar_fleet_collision_total", pool=BIG, kind="config") == 0


async def _one_of_each(f: object) -> bool:
    snap = await f.ledger.snapshot()  # type: ignore[attr-defined]
    kinds = server._split_digests(snap.digests)
    return len(snap.replicas) == 2 and all(len(v) == 1 for v in kinds.values()) \
        and bool(kinds["capacity_source"])


async def _digests_are(f: object, want: str) -> bool:
    snap = await f.ledger.snapshot()  # type: ignore[attr-defined]
    return {d.partition("@")[0] for d in snap.digests} == {want}


def test_pools_in_a_fleet_start_with_edge_shed_but_shadow_still_refuses() -> None:
    base = ["--priority-scheduler-enabled", "--worker-urls", "big=http://b:1",
            "--coordination-url", "redis://127.0.0.1:6379/0"]
    s = parse_settings(base)
    assert s.fleet.coordination_url is not None and s.capacity.pool_workers == {
        "big": ("http://b:1",)}
    assert parse_settings([*base, "--edge-shed"]).scheduler.edge_shed
    with pytest.raises(ConfigError, match="--shadow cannot be combined with"):
        parse_settings([*base, "--shadow"])


async def test_every_pools_ledger_runs_under_the_shipped_runtime_acl_user(
        valkey_server: ValkeyServer, client: redis.Redis) -> None:
    # k8s/base/valkey-acl.yaml's runtime user (key pattern ~pg:{priority-gate}*): each
    # pool's ledger is inside it, another fleet's is not.
    await create_runtime_user(client, "pools-runtime", "priority-gate", "pw")
    await client.function_load(LUA, replace=True)  # the admin's job
    rt = redis.Redis(port=valkey_server.port, username="pools-runtime", password="pw",
                     decode_responses=True)
    try:
        caps = {None: 5, "chat-70b": 3, "small-8b": 2}
        for pool, cap in caps.items():
            ledger = FleetLedger(rt, "priority-gate", "r1", pool=pool)
            status = await ledger.register(BUILTIN_CLASSES, cap)
            assert status.known is False and status.capacity == cap  # each its own capacity
        for pool, cap in caps.items():
            snap = await FleetLedger(rt, "priority-gate", "r1", pool=pool).snapshot()
            assert snap.capacity == cap and snap.replicas == ("r1",)
        with pytest.raises(NoPermissionError):
            await FleetLedger(rt, "other-fleet", "r1", pool="chat-70b").register(
                BUILTIN_CLASSES, 1)
    finally:
        await rt.aclose()
        await client.acl_deluser("pools-runtime")


def test_the_fleet_pools_benchmark_runs(valkey_server: ValkeyServer) -> None:
    from bench import pools as bench_pools
    rate, calls = bench_pools.measure_fleet(2, 0.05, True, valkey_server.url)
    assert rate > 0 and 1.0 <= calls <= 2.5


async def test_a_server_outage_gives_each_pool_its_own_degraded_share(
        tmp_path: Path, own_server: ValkeyServer) -> None:
    ttl = 2.0
    async with pool_replicas(tmp_path, own_server.url, ttl=ttl) as (a, _):
        own_server.pause()
        calls = {pool: [a.check_in(pool, "bulk") for _ in range(3)] for pool in CAPACITY}
        for pool in CAPACITY:
            f = a.app.fleets[pool]
            await eventually(lambda f=f: f.state == "degraded", timeout=2 * ttl,  # type: ignore[misc]
                             what=f"{pool} degraded")
            assert a.sample("smg_sidecar_coordination_state", pool=pool, state="degraded") == 1
        # floor(capacity / live replicas), each from its own pool's last view: 2 // 2, 1 // 2.
        assert a.app.fleets[DEFAULT_POOL].share == 1 and a.app.fleets[BIG].share == 0
        await eventually(lambda: sum(c.done() for c in calls[DEFAULT_POOL]) == 1,
                         what="one local admission in the default pool")
        await asyncio.sleep(0.3)  # the chance for any over-admission to show
        assert sum(c.done() for c in calls[DEFAULT_POOL]) == 1
        assert not any(c.done() for c in calls[BIG])  # big's share is 0
        own_server.resume()
        for pool in CAPACITY:
            f = a.app.fleets[pool]
            await eventually(lambda f=f: f.state == "ok", timeout=3 * ttl,  # type: ignore[misc]
                             what=f"{pool} back to ok")
        # Back on the ledgers: each pool fills exactly its own capacity.
        for pool, cap in CAPACITY.items():
            await eventually(lambda pool=pool, cap=cap: sum(  # type: ignore[misc]
                c.done() for c in calls[pool]) == cap, timeout=3 * ttl, what=f"{pool} filled")
        for pool in CAPACITY:
            done = [c for c in calls[pool] if c.done()]
            rest = [c for c in calls[pool] if not c.done()]
            await a.end(*[admission_id(await c) for c in done])
            for nxt in asyncio.as_completed(rest):  # one slot at a time in big
                await a.end(await ok(nxt))
