"""Token budgets in the fleet ledger, against a real valkey-server.

* Differential: ``sidecar/tokens.py``'s ``TokenBook`` is the specification; the ledger's
  ``tok_*`` operations are its port (one atomic call each, on the server's clock: the test
  build's, driven by the test). Random sequences of reservations (several tenants, several
  windows, the calendar month included, the clock crossing periods), settlements, cancels,
  duplicate and unknown ids, both accounting modes and shadow: after every step the two
  must have answered alike (fits, or refused in the same window with the same Retry-After)
  and hold the same settled and reserved tokens.
* A replica that dies (its registration lapses) or restarts under its id with a new
  process leaves reservations nobody will settle: their estimates are charged, once.
* Every argument of every new operation sent absurd is refused naming it, changing nothing.
"""

from __future__ import annotations

import asyncio
import calendar
import os
from typing import Any

import pytest
import redis.asyncio as redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis.exceptions import ResponseError

from devtools.valkey import ValkeyServer
from sidecar.coordination.ledger import FleetLedger, prefix
from sidecar.tokens import (
    Allowed,
    Budget,
    Estimate,
    OverBudget,
    TokenBook,
    TokenSettings,
    Window,
)
from tests.clock import FakeClock
from tests.ledger_support import client, connect, valkey_server
from tests.test_ledger import PLAIN

__all__ = ["client", "valkey_server"]

LONG = os.environ.get("HYPOTHESIS_PROFILE") == "long"
EXAMPLES = 1000 if LONG else 60

WINDOWS = [Window("minute", 60), Window("hour", 3600), Window("day", 86400),
           Window("week", 7 * 86400), Window("month", 0), Window("7m", 420)]
# Just before midnight on the last day of February 2028 (a leap year), off the second:
# months, weeks, days and minutes turn over within the first steps.
START = float(calendar.timegm((2028, 2, 29, 23, 59, 58))) + 0.75

budget_sets = st.lists(
    st.tuples(st.sampled_from(WINDOWS), st.integers(0, 3000)), min_size=1, max_size=3,
    unique_by=lambda x: x[0].name).map(lambda xs: tuple(Budget(w, n) for w, n in xs))
steps_st = st.lists(st.one_of(
    st.tuples(st.just("reserve"), st.sampled_from(["a", "b", "c d é"]),
              st.tuples(st.integers(0, 800), st.integers(0, 800))),
    st.tuples(st.just("settle"), st.integers(0, 40), st.integers(0, 2000)),
    st.tuples(st.just("cancel"), st.integers(0, 40), st.just(0)),
    st.tuples(st.just("time"), st.sampled_from([0.5, 7.0, 59.0, 61.0, 3599.0, 43200.0]),
              st.just(0)),
), min_size=1, max_size=60)


async def _run(server: ValkeyServer, budgets: dict[str, tuple[Budget, ...]], mode: str,
               enforce: bool, steps: list[tuple[str, Any, Any]]) -> None:
    clock = FakeClock(START)
    book = TokenBook(budgets, TokenSettings(accounting=mode))
    c = connect(server)
    await c.flushall()
    try:
        led = FleetLedger(c, "t", "only", ttl=86400.0, clock=clock)
        await led.register(PLAIN, 4)
        ids: list[str] = []
        tenant_of: dict[str, str] = {}
        for n, (op, a, b) in enumerate(steps):
            now = clock()
            if op == "reserve":
                rid = f"r{n}"
                est = Estimate(*b)
                want = book.reserve(a, est, "bulk", now, enforce=enforce)
                got = await led.tok_reserve(rid, a, est.total, budgets.get(a, ()),
                                            enforce=enforce, reserve=mode == "reserve")
                if isinstance(want, Allowed) or want.reservation is not None:
                    r = want.reservation
                    assert r is not None
                    book.bind(r, rid)
                    ids.append(rid)
                    tenant_of[rid] = a
                if isinstance(want, Allowed):
                    assert got is None, (n, got)
                else:
                    assert got is not None, (n, want)
                    assert (got.window, got.limit, got.used, got.reserved, got.never) == (
                        want.window, want.limit, want.used, want.reserved, want.never), n
                    assert got.retry_after == pytest.approx(want.retry_after, abs=1e-6)
            elif op in ("settle", "cancel") and ids:
                rid = ids[a % len(ids)]  # sometimes one already settled: unknown to both
                if op == "settle":
                    known = book.settle(rid, b, now) != "unknown"
                    assert await led.tok_settle(rid, b, budgets.get(tenant_of[rid], ())) \
                        == known, n
                else:
                    r = book.reservation(rid)
                    # (the book cancels only PENDING reservations; a bound one ends by a
                    # settle: the ledger's cancel of it gives the reservation back, as a
                    # settle of 0 does in the book)
                    if r is not None:
                        book.settle(rid, 0, now)
                    assert await led.tok_cancel(rid) == (r is not None), n
            elif op == "time":
                clock.advance(a)
                await led.heartbeat()  # (a lapsed replica's reservations are charged)
            # Same settled and reserved tokens, per tenant and window, after every step.
            want_rows = {(w.tenant, w.window): (w.used, w.reserved)
                         for w in book.remaining(clock())}
            view = await led.tok_view(*budgets)
            for tenant, bs in budgets.items():
                reserved, used = view[tenant]
                for bud in bs:
                    if (tenant, bud.window.name) in want_rows:
                        assert (used.get(bud.window.name, 0), reserved) == want_rows[
                            (tenant, bud.window.name)], (n, tenant, bud.window.name)
    finally:
        await c.aclose()


@settings(max_examples=EXAMPLES, deadline=None, print_blob=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(a=budget_sets, b=budget_sets, mode=st.sampled_from(["reserve", "settle_only"]),
       enforce=st.booleans(), steps=steps_st)
def test_the_ledger_keeps_budgets_as_the_book_does(
        valkey_server: ValkeyServer, a: tuple[Budget, ...], b: tuple[Budget, ...], mode: str,
        enforce: bool, steps: list[tuple[str, Any, Any]]) -> None:
    asyncio.run(_run(valkey_server, {"a": a, "c d é": b}, mode, enforce, steps))


async def test_a_dead_or_restarted_replicas_reservations_are_charged_once(
        client: redis.Redis) -> None:
    clock = FakeClock(START)
    budgets = (Budget(Window("day", 86400), 10_000),)
    a = FleetLedger(client, "t", "a", ttl=5.0, clock=clock)
    b = FleetLedger(client, "t", "b", ttl=5.0, clock=clock)
    for led in (a, b):
        await led.register(PLAIN, 4)
    assert await a.tok_reserve("a1", "acme", 700, budgets) is None
    assert await b.tok_reserve("b1", "acme", 300, budgets) is None
    assert (await b.tok_view("acme"))["acme"] == (1000, {"day": 0})
    # a dies: its registration lapses; the next call reaps it and charges its estimate.
    clock.advance(3.0)
    await b.heartbeat()
    clock.advance(3.0)
    await b.heartbeat()
    assert (await b.tok_view("acme"))["acme"] == (300, {"day": 700})
    # b restarts under its id (a new process): its predecessor's reservation is charged.
    b2 = FleetLedger(client, "t", "b", ttl=5.0, clock=clock)
    await b2.register(PLAIN, 4)
    assert (await b2.tok_view("acme"))["acme"] == (0, {"day": 1000})
    assert await b2.tok_settle("b1", 5, budgets) is False  # nobody settles it twice
    # The budget outlives both: what was charged still counts against the day.
    over = await b2.tok_reserve("b2", "acme", 9_500, budgets)
    assert isinstance(over, OverBudget) and over.used == 1000 and not over.never


async def test_a_reservation_that_comes_after_its_cancel_or_its_replica_holds_nothing(
        client: redis.Redis) -> None:
    """A Check that gave up on its reservation cancels it; the reservation's call may still
    run later (its connection dropped, sent again): it is refused ("gone"), as is one of a
    replica the ledger no longer has ("unregistered"): neither holds a token nobody would
    settle."""
    clock = FakeClock(START)
    budgets = (Budget(Window("day", 86400), 1000),)
    a = FleetLedger(client, "t", "a", ttl=5.0, clock=clock)
    b = FleetLedger(client, "t", "b", ttl=5.0, clock=clock)
    for led in (a, b):
        await led.register(PLAIN, 4)
    assert await a.tok_cancel("late") is False  # overtook its reservation
    with pytest.raises(ResponseError, match="gone"):
        await a.tok_reserve("late", "acme", 400, budgets)
    assert (await a.tok_view("acme"))["acme"] == (0, {})  # never touched
    # Forgotten after ten minutes: the id is a new request's again.
    clock.advance(601.0)
    await b.register(PLAIN, 4)
    assert await b.tok_reserve("late", "acme", 400, budgets) is None
    assert await b.tok_cancel("late") is True
    # a lapsed and was reaped: a call of its that runs late reserves nothing.
    with pytest.raises(ResponseError, match="unregistered"):
        await a.tok_reserve("a2", "acme", 400, budgets)
    assert (await b.tok_view("acme"))["acme"] == (0, {"day": 0})


BAD = {
    "tokens": ("tok_reserve", 3, ["-1", "1e13", "nan", "1.5", "x"]),
    "enforce": ("tok_reserve", 4, ["2", "", "yes"]),
    "windows": ("tok_reserve", 6, ["-1", "9", "2"]),
    "window name": ("tok_reserve", 7, ["", "a b", "x" * 17, "{t}"]),
    "window seconds": ("tok_reserve", 8, ["-60", "30", "1e9", "nan"]),
    "window tokens": ("tok_reserve", 9, ["-5", "1e13", "inf"]),
    "settle tokens": ("tok_settle", 1, ["-1", "nan", "1e13"]),
}


@pytest.mark.parametrize("field", sorted(BAD))
async def test_every_new_argument_sent_absurd_is_refused_and_changes_nothing(
        client: redis.Redis, field: str) -> None:
    clock = FakeClock(START)
    led = FleetLedger(client, "t", "a", clock=clock)
    await led.register(PLAIN, 4)
    budgets = (Budget(Window("day", 86400), 1000),)
    assert await led.tok_reserve("held", "acme", 100, budgets) is None
    keys = sorted(await client.keys(prefix("t") + "*"))
    before = {k: await client.dump(k) for k in keys if ":tok" in k}
    op, at, values = BAD[field]
    for value in values:
        if op == "tok_reserve":
            args: list[Any] = [led.replica, "x", "acme", "100", "1", "1", "1", "day", "86400",
                               "1000"]
        else:
            args = ["held", "5", "1", "day", "86400", "1000"]
        args[at] = value
        with pytest.raises(ResponseError, match="ledger:"):
            await led._call(op, *args)
    after = {k: await client.dump(k) for k in keys if ":tok" in k}
    assert after == before
    assert (await led.tok_view("acme"))["acme"] == (100, {"day": 0})


EDGES = [calendar.timegm(t) for t in (
    (2028, 2, 29, 23, 59, 59), (2028, 3, 1, 0, 0, 0), (2027, 12, 31, 23, 59, 59),
    (2028, 1, 1, 0, 0, 0), (2028, 3, 5, 23, 59, 59),  # a Sunday night: the week turns
    (2028, 3, 6, 0, 0, 0), (2100, 2, 28, 23, 59, 59),  # not a leap year
    (2000, 2, 29, 12, 0, 0), (1999, 12, 31, 23, 59, 59))]


@pytest.mark.parametrize("window", WINDOWS, ids=[w.name for w in WINDOWS])
async def test_periods_turn_over_where_the_book_says_at_calendar_edges(
        client: redis.Redis, window: Window) -> None:
    """Just before and at each edge (month ends, leap days, a Sunday night), a settle
    then a step of half a second: the ledger's period is the book's, to the half second."""
    budgets = (Budget(window, 10**9),)
    for n, edge in enumerate(EDGES):
        for offset in (-0.5, 0.0):
            clock = FakeClock(edge + offset)
            book = TokenBook({"t": budgets})
            led = FleetLedger(client, f"edge{n}{offset}", "a", clock=clock)
            await led.register(PLAIN, 4)
            v = book.reserve("t", Estimate(5, 5), "bulk", clock())
            assert isinstance(v, Allowed)
            book.bind(v.reservation, "x")
            assert await led.tok_reserve("x", "t", 10, budgets) is None
            book.settle("x", 7, clock())
            assert await led.tok_settle("x", 7, budgets)
            for _ in range(3):
                clock.advance(0.5)
                await led.heartbeat()
                (want,) = [w.used for w in book.remaining(clock())]
                assert (await led.tok_view("t"))["t"][1][window.name] == want, (edge, offset)
