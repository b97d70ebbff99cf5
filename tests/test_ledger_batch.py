"""The ledger's ``multi`` call and the owner's deferred marks (round trips).

* Property: a random sequence of request-path operations sent in random ``multi`` batches
  decides exactly as the same operations sent one call each, at the same instant: same
  replies, same notifications, same ledger state (a real valkey-server, the test's clock).
* The controller defers a preemptible mark: a request whose first byte (or end) comes
  within the delay costs the ledger no mark at all; a longer one becomes a candidate.
* The first-byte race made sound: when the ledger preempted a candidate before its
  first-byte mark arrived, ``confirm_first_byte`` says so (the response must not start)
  and the later notification counts the preemption as delivered.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from devtools.valkey import ValkeyServer
from sidecar.classes import PriorityClass
from sidecar.coordination.controller import FleetController
from sidecar.coordination.ledger import ArriveStatus, FleetLedger
from sidecar.metrics import NullPoolRecorder
from sidecar.scheduler import ClassSettings
from tests.clock import FakeClock
from tests.ledger_support import client, connect, valkey_server
from tests.test_ledger_differential import configs

__all__ = ["client", "valkey_server"]  # fixtures used by name

EXAMPLES = 1000 if os.environ.get("HYPOTHESIS_PROFILE") == "long" else 80

classes = st.sampled_from(list(PriorityClass))
steps = st.lists(
    st.one_of(
        st.tuples(st.just("arrive"), classes, st.booleans()),
        st.tuples(st.just("arrive"), classes, st.booleans()),
        st.tuples(st.just("release"), st.integers(0, 60), st.booleans()),
        st.tuples(st.just("cancel"), st.integers(0, 60), st.booleans()),
        st.tuples(st.just("mark_preemptible"), st.integers(0, 60), st.booleans()),
        st.tuples(st.just("mark_first_byte"), st.integers(0, 60), st.booleans()),
        st.tuples(st.just("tick"), st.just(0), st.booleans()),
        st.tuples(st.just("advance"), st.sampled_from([0.3, 1.0, 3.0]), st.just(True)),
    ),
    min_size=5, max_size=60,
)


async def _state(c: redis.Redis, fleet: str) -> dict[str, Any]:
    """Everything the ledger holds for a fleet, the fleet's name taken out."""
    out: dict[str, Any] = {}
    p = f"pg:{{{fleet}}}"
    for key in await c.keys(f"{p}:*"):
        name = key.removeprefix(p)
        kind = await c.type(key)
        if kind == "hash":
            out[name] = await c.hgetall(key)
        elif kind == "zset":
            out[name] = await c.zrange(key, 0, -1, withscores=True)
        elif kind == "set":
            out[name] = sorted(await c.smembers(key))
        elif kind == "list":
            out[name] = await c.lrange(key, 0, -1)
        else:
            out[name] = await c.get(key)
    out.pop(":digests", None)
    # Bookkeeping that differs by construction: one generation per call, one incarnation
    # per process (the two ledgers are two FleetLedger objects).
    out.pop(":gen", None)
    out.pop(":inc", None)
    return out


@settings(max_examples=EXAMPLES, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(cfg=configs, capacity=st.integers(1, 6), plan=steps)
def test_a_multi_batch_decides_as_the_same_calls_one_by_one(
        valkey_server: ValkeyServer, cfg: dict[PriorityClass, ClassSettings], capacity: int,
        plan: list[tuple[str, Any, bool]]) -> None:
    async def run() -> None:
        c = connect(valkey_server)
        try:
            await c.flushall()
            clock = FakeClock(1000.0)
            one = FleetLedger(c, "one", "a", clock=clock)
            many = FleetLedger(c, "many", "a", clock=clock)
            for led in (one, many):
                await led.register(cfg, capacity)
            ids: list[str] = []
            batch: list[tuple[str, list[str | int]]] = []
            replies_one: list[Any] = []
            replies_many: list[Any] = []

            async def send() -> None:
                if batch:
                    replies_many.extend(await many.batch(batch))
                    batch.clear()

            for op, arg, cut in plan:
                if op == "advance":
                    await send()  # one instant per batch
                    clock.advance(arg)
                    continue
                if op == "arrive":
                    ids.append(f"r{len(ids)}")
                    args: list[str | int] = ["a", ids[-1], int(arg), "t"]
                elif op == "tick":
                    args = []
                elif not ids:
                    continue
                else:
                    args = [ids[arg % len(ids)]]
                    if op == "release":
                        args.append("completed")
                replies_one.append((await one.batch([(op, args)]))[0])
                batch.append((op, args))
                if cut:
                    await send()
            await send()
            assert replies_many == replies_one
            assert await _state(c, "many") == await _state(c, "one")
        finally:
            await c.aclose()

    asyncio.run(run())


# ------------------------------------------------------------------------ the owner's marks

BULK, SYSTEM = PriorityClass.BULK, PriorityClass.SYSTEM
PREEMPTING = {c: ClassSettings(0, 0.0, 4, 10.0, 1e6, c is SYSTEM) for c in PriorityClass}


class Undelivered(NullPoolRecorder):
    def __init__(self) -> None:
        self.undelivered = 0

    def preemption_undelivered(self) -> None:
        self.undelivered += 1


async def _controller(server: ValkeyServer, metrics: NullPoolRecorder, *, mark_delay: float,
                      events: bool) -> FleetController:
    ctl = await FleetController.connect(server.url, fleet="f", replica="b", ttl=10.0,
                                        classes=PREEMPTING, capacity=1, metrics=metrics,
                                        mark_delay=mark_delay)
    # No heartbeat (its calls would be counted); the notification reader only where the
    # test wants it (without it, a preemption decided in the ledger waits unread, as in
    # the race).
    ctl.start(heartbeat=False, notifications=events)
    return ctl


async def _eventually(check: Any, what: str) -> None:
    async with asyncio.timeout(5):
        while not await check():
            await asyncio.sleep(0.002)


async def test_a_request_whose_response_starts_within_the_delay_costs_no_mark(
        valkey_server: ValkeyServer, client: redis.Redis) -> None:
    ctl = await _controller(valkey_server, NullPoolRecorder(), mark_delay=0.2, events=True)
    try:
        calls0 = ctl.ledger.calls
        adm = await ctl.admit(BULK, "t")
        aid = adm.admission.id
        assert ctl.open_stop_channel(aid) is not None
        assert await ctl.confirm_first_byte(aid)  # no mark left: nothing to wait for
        assert ctl.mark_first_byte(aid)
        ctl.release(aid)
        await _eventually(lambda: _inflight(client, 0), "released in the ledger")
        await asyncio.sleep(0.25)  # past the delay: the dropped mark stays dropped
        assert ctl.ledger.calls - calls0 == 2  # arrive + release
        assert await client.zcard("pg:{f}:pre:0") == 0
    finally:
        await ctl.aclose()


async def test_a_longer_request_becomes_a_candidate_after_the_delay(
        valkey_server: ValkeyServer, client: redis.Redis) -> None:
    ctl = await _controller(valkey_server, NullPoolRecorder(), mark_delay=0.01, events=True)
    try:
        adm = await ctl.admit(BULK, "t")
        aid = adm.admission.id
        assert ctl.open_stop_channel(aid) is not None
        assert await client.zcard("pg:{f}:pre:0") == 0  # not yet
        await _eventually(lambda: _zcard(client, "pg:{f}:pre:0", 1), "marked")
        assert await ctl.confirm_first_byte(aid)  # the ledger answered: still admitted
        assert await client.zcard("pg:{f}:pre:0") == 0  # never a victim from here
        ctl.release(aid)
        await _eventually(lambda: _inflight(client, 0), "released in the ledger")
    finally:
        await ctl.aclose()


async def test_a_victim_preempted_before_its_first_byte_mark_arrived_does_not_start(
        valkey_server: ValkeyServer, client: redis.Redis) -> None:
    metrics = Undelivered()
    ctl = await _controller(valkey_server, metrics, mark_delay=0.0, events=False)
    other = FleetLedger(client, "f", "a")
    try:
        adm = await ctl.admit(BULK, "t")
        aid = adm.admission.id
        watch = ctl.open_stop_channel(aid)
        assert watch is not None
        await _eventually(lambda: _zcard(client, "pg:{f}:pre:0", 1), "marked")
        await other.register(PREEMPTING, 1)
        got = await other.arrive("sys", SYSTEM, "t")  # takes the fleet's one slot
        assert got.status is ArriveStatus.ADMITTED and got.victim == aid
        # The owner has not read the notification yet; its response is about to start.
        assert not await ctl.confirm_first_byte(aid)
        assert not watch.done()  # the caller stops it (503) instead of continuing
        ctl.notified(await ctl.ledger.take_events())  # now the notification comes
        assert aid not in ctl.held
        assert metrics.undelivered == 0  # delivered: the 503 went out on the reply
        ctl.release(aid)  # Envoy's access-log entry for the 503: released once only
        assert await other.release("sys") is not None
        await _eventually(lambda: _inflight(client, 0), "ledger empty")
    finally:
        await ctl.aclose()


async def _zcard(c: redis.Redis, key: str, n: int) -> bool:
    return int(await c.zcard(key)) == n


async def _inflight(c: redis.Redis, n: int) -> bool:
    counts = await c.hgetall("pg:{f}:inflight")
    return sum(int(v) for v in counts.values()) == n


# ------------------------------------------------------------ the pipelined connection

PLAIN = {c: ClassSettings(0, 0.0, 5, 30.0, 1e6, False) for c in PriorityClass}


async def test_pipelined_calls_are_answered_in_order_and_survive_a_dropped_connection(
        valkey_server: ValkeyServer, client: redis.Redis) -> None:
    own = connect(valkey_server)
    led = FleetLedger(own, "f", "a", pipelined=True)
    try:
        await led.register(PLAIN, 10)
        # 30 calls in one turn: one write; the server decides them in order, so exactly
        # the first 10 are admitted, the next 5 queued and the rest refused.
        got = await asyncio.gather(*(led.arrive(f"x{i}", BULK, "t") for i in range(30)))
        assert [g.status for g in got] == ([ArriveStatus.ADMITTED] * 10
                                           + [ArriveStatus.QUEUED] * 5
                                           + [ArriveStatus.REJECTED_QUEUE_FULL] * 15)
        # The server drops every client connection but ours: the next call reconnects
        # (at most one call may fail, if it was written before the loss was seen).
        killed = await client.client_kill_filter(_type="normal", skipme=True)
        assert killed >= 1
        failures = 0
        for aid in ("x0", "x1"):
            while True:
                try:
                    assert await led.release(aid) is not None
                    break
                except ConnectionError:
                    failures += 1
                    assert failures <= 1
        snap = await led.snapshot()
        assert snap.total_inflight == 10  # two released, two waiters granted
        assert snap.queue_depth[BULK] == 3
    finally:
        await led.aclose()
        await own.aclose()


@pytest.mark.parametrize("opened", ["before_the_outage", "while_degraded"])
async def test_a_first_byte_while_degraded_reaches_the_ledger_after_the_return(
        tmp_path: Path, opened: str) -> None:
    # A streaming request must not stay a preemption candidate in the ledger: the ledger
    # would pick it as a victim whose stop channel is gone (it runs on, uncounted, beside
    # its preemptor). Before the fix: a mark sent before an outage was never followed by
    # the first byte that came while degraded; and a stop channel opened while degraded was
    # listed to the ledger as a candidate by the return resync, and its first byte, after
    # the return, was never sent (its own mark had never left).
    server = ValkeyServer(tmp_path / "valkey")
    server.start()
    c = connect(server)
    ctl = await FleetController.connect(server.url, fleet="f", replica="b", ttl=2.0,
                                        classes=PREEMPTING, capacity=1, mark_delay=0.0)
    ctl.start()
    try:
        if opened == "before_the_outage":
            aid = (await ctl.admit(BULK, "t")).admission.id
            assert ctl.open_stop_channel(aid) is not None
            await _eventually(lambda: _zcard(c, "pg:{f}:pre:0", 1), "marked")
            server.pause()
            await _eventually(lambda: _true(ctl.state == "degraded"), "degraded")
        else:
            server.pause()
            await _eventually(lambda: _true(ctl.state == "degraded"), "degraded")
            aid = (await ctl.admit(BULK, "t")).admission.id  # locally, within its share
            assert ctl.open_stop_channel(aid) is not None
        if opened == "before_the_outage":
            assert ctl.mark_first_byte(aid)  # the response starts while degraded
        server.resume()
        await _eventually(lambda: _true(ctl.state == "ok"), "back to ok")
        if opened == "while_degraded":
            # Listed by the return resync while its stop channel was open; starts now.
            assert await ctl.confirm_first_byte(aid)
            ctl.mark_first_byte(aid)
        await _eventually(lambda: _inflight(c, 1), "counted in the ledger")
        await _eventually(lambda: _zcard(c, "pg:{f}:pre:0", 0), "no candidate in the ledger")
        other = FleetLedger(c, "f", "a")
        await other.register(PREEMPTING, 1)
        got = await other.arrive("sys", SYSTEM, "t")
        assert got.status is not ArriveStatus.ADMITTED  # the stream is not a victim
        assert aid in ctl.held
        ctl.release(aid)
    finally:
        server.resume()
        await ctl.aclose()
        await c.aclose()
        server.stop()


async def _true(v: bool) -> bool:
    return v
