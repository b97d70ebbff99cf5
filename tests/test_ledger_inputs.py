"""Every argument of a ledger call is checked by the library: a bad one is refused, with an
error naming it, before anything is read or written, and the fleet admits on.

What anyone with a fleet's runtime password (every sidecar pod has it) can send the
ledger directly with ``FCALL``: one call with ``settle=inf`` or ``seen=1e20`` used to
freeze the whole fleet for good (every later call failed until someone deleted keys by
hand). Each field of every op is sent with non-finite, absurd, negative and non-numeric
values (tests/ledger_support.py ``FIELDS``); each call must be refused with
``ERR ledger: <field> ...``, leave every key of the fleet byte for byte as it was (DUMP),
and the fleet must admit the next request. Against a real valkey-server, the production
library (the test build for the test-only clock).
"""

from __future__ import annotations

import pytest
import redis.asyncio as redis

from sidecar.classes import PriorityClass
from sidecar.coordination import ledger as ledger_module
from sidecar.coordination.ledger import ArriveStatus, FleetLedger
from sidecar.scheduler import ClassSettings, ReleaseReason
from tests.clock import FakeClock
from tests.ledger_support import FIELDS, bad_call, client, keyspace, valkey_server

__all__ = ["client", "valkey_server"]  # fixtures used by name

SYS, INT, DEF, BULK = (PriorityClass.SYSTEM, PriorityClass.INTERACTIVE, PriorityClass.DEFAULT,
                       PriorityClass.BULK)
PLAIN: dict[PriorityClass, ClassSettings] = {
    SYS: ClassSettings(0, 0.0, 4, 10.0, 5.0, True),
    INT: ClassSettings(0, 0.0, 4, 10.0, 5.0, True),
    DEF: ClassSettings(0, 0.0, 4, 10.0, 5.0, False),
    BULK: ClassSettings(0, 0.0, 4, 3.0, 5.0, False),
}
# The error each field's refusal names (the library's words).
NAMED = {"heartbeat settle": "settle", "capacity": "report", "reservation": "report",
         "tenant weight": "class tenant weight", "holding class": "class",
         "multi count": "multi count", "caller": "caller", "now": "now"}


@pytest.mark.parametrize("field", sorted(FIELDS))
async def test_a_bad_field_is_refused_changes_nothing_and_the_fleet_admits_on(
        client: redis.Redis, field: str) -> None:
    clock = FakeClock() if field == "now" else None  # a clock only the test build takes
    fn = ledger_module.TEST_FUNCTION if clock else ledger_module.FUNCTION
    a, b = (FleetLedger(client, "f", r, ttl=10.0, clock=clock) for r in ("a", "b"))
    for led in (a, b):
        led.settle = 1.0
        await led.register(PLAIN, 4)
    assert (await a.arrive("held", DEF, "t")).status is ArriveStatus.ADMITTED
    assert (await b.arrive("queued-later", BULK, "t")).status is ArriveStatus.ADMITTED
    before = await keyspace(client, "f")
    word = NAMED.get(field, field.split(" ")[-1])
    for value in FIELDS[field][1]:
        with pytest.raises(redis.ResponseError, match=r"^ledger: ") as refused:
            await client.fcall(fn, *bad_call(a, field, value))
        text = str(refused.value)
        assert word in text or (field == "now" and "caller clock is refused" in text), (
            field, value, text)
        assert len(text) < 400 and "\n" not in text  # one clear line, the value clipped
        assert await keyspace(client, "f") == before, (field, value, "state changed")
    # Admission goes on as if nothing had been sent: the next arrival, a release, a
    # heartbeat, and a generation that still counts up.
    gen = a.generation
    assert (await a.arrive("next", DEF, "t")).status is ArriveStatus.ADMITTED
    assert (await a.release("next", ReleaseReason.COMPLETED)).value == "released"
    st = await b.heartbeat()
    assert st.known and st.inflight == 2 and st.settling == 0
    assert b.generation > gen


async def test_the_values_that_froze_the_fleet_are_refused(client: redis.Redis) -> None:
    # The two calls of the finding, as raw FCALLs with the runtime password: before, each
    # left every later call failing (a frozen fleet) until keys were deleted by hand.
    (a,) = [FleetLedger(client, "f", "a")]
    await a.register(PLAIN, 4)
    for field, value in (("settle", "inf"), ("seen", "1e20"), ("settle", "1e999")):
        with pytest.raises(redis.ResponseError, match=f"ledger: {field} "):
            await client.fcall(ledger_module.FUNCTION, *bad_call(a, field, value))
    assert (await a.arrive("x", DEF, "t")).status is ArriveStatus.ADMITTED
    assert (await a.heartbeat()).settling == 0


def test_every_release_reason_the_sidecar_sends_is_one_the_ledger_takes() -> None:
    # ledger.lua's REASONS against sidecar.scheduler.ReleaseReason: a reason added there
    # without the library would make every release of it fail.
    text = ledger_module.LUA
    start = text.index("local REASONS = {")
    listed = text[start:text.index("}", start)]
    for reason in ReleaseReason:
        assert f"{reason.value} = true" in listed, reason


async def test_a_multi_call_with_a_bad_op_runs_none_of_its_ops(client: redis.Redis) -> None:
    (a,) = [FleetLedger(client, "f", "a")]
    await a.register(PLAIN, 4)
    await a.arrive("x", DEF, "t")
    before = await keyspace(client, "f")
    with pytest.raises(redis.ResponseError, match="ledger: class"):
        await a.batch([("release", ["x", "completed"]), ("arrive", ["a", "y", "9", "t"])])
    assert await keyspace(client, "f") == before
    assert (await a.snapshot()).total_inflight == 1
