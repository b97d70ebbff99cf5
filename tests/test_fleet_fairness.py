"""Fairness between tenants holds fleet-wide: two replicas on one real valkey-server.

Two :class:`FleetController` replicas (the ledger in a real valkey-server, the replicas'
own loops running) take a class with ``fair_queuing``, a per-tenant queue limit and a
tenant weight. Whichever replica a tenant's requests arrive at, the fleet answers as one
in-process :class:`Scheduler` fed the same arrivals would: the limit counts the tenant's
waiters on both replicas (one more is 429 ``rejected_queue_full``), and the waiters are
granted in the core's fair order, across the replicas.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace

import pytest

from devtools.valkey import ValkeyServer
from sidecar.admission import Denied
from sidecar.classes import PriorityClass
from sidecar.coordination.controller import FleetController
from sidecar.scheduler import (
    BUILTIN_CLASSES,
    Admitted,
    ClassSettings,
    Outcome,
    Queued,
    Rejected,
    Scheduler,
)
from sidecar.scheduler.lifecycle import Admission
from tests.clock import FakeClock
from tests.ledger_support import client, valkey_server

__all__ = ["client", "valkey_server"]  # fixtures used by name

B = PriorityClass.BULK
FAIR: dict[PriorityClass, ClassSettings] = {
    c: replace(v, reserved_floor=0, reserved_per_slot=0.0, queue_size=10,
               queue_timeout_secs=60.0, starvation_threshold_secs=60.0, fair_queuing=True,
               max_queued_per_tenant=3, tenant_weights={"H": 2.0})
    for c, v in BUILTIN_CLASSES.items()
}


@pytest.fixture
async def pair(valkey_server: ValkeyServer, client: object
               ) -> AsyncIterator[tuple[FleetController, FleetController]]:
    """Replicas a and b of one fleet (capacity 1), both registered and running."""
    a = await FleetController.connect(valkey_server.url, fleet="fair", replica="a", ttl=10.0,
                                      classes=FAIR, capacity=1)
    b = await FleetController.connect(valkey_server.url, fleet="fair", replica="b", ttl=10.0,
                                      classes=FAIR, capacity=1)
    a.start()
    b.start()
    try:
        assert a.state == b.state == "ok"
        yield a, b
    finally:
        await a.aclose()
        await b.aclose()


async def queued_in_ledger(ctl: FleetController, depth: int) -> None:
    """Wait (bounded) until the fleet's bulk queue holds ``depth`` waiters."""
    async with asyncio.timeout(5):
        while (await ctl.ledger.snapshot()).queue_depth[B] != depth:
            await asyncio.sleep(0.005)


async def arrive_in_turn(replicas: dict[str, FleetController],
                         arrivals: list[tuple[str, str, str]], depth0: int
                         ) -> dict[str, asyncio.Task[Admitted]]:
    """Each (name, replica, tenant) arrives once the one before it is queued in the ledger,
    so the ledger sees them in this order; its admit task by name."""
    tasks: dict[str, asyncio.Task[Admitted]] = {}
    for i, (name, replica, tenant) in enumerate(arrivals, start=1):
        tasks[name] = asyncio.create_task(replicas[replica].admit(B, tenant))
        await queued_in_ledger(replicas[replica], depth0 + i)
    return tasks


def core_order(arrivals: list[tuple[str, str]]) -> list[str]:
    """The in-process core's grant order for the same arrivals, served one by one."""
    s = Scheduler(FAIR, 1, FakeClock())
    assert isinstance(s.arrive("blocker", B, "x"), Admitted)
    for name, tenant in arrivals:
        assert isinstance(s.arrive(name, B, tenant), Queued)
    s.take_events()
    order: list[str] = []
    holder = "blocker"
    while True:
        s.release(holder)
        granted = [e.admission.id for e in s.take_events() if isinstance(e, Admitted)]
        if not granted:
            return order
        holder = granted[0]
        order.append(holder)


async def test_a_tenant_at_its_limit_across_both_replicas_is_shed_fleet_wide(
        pair: tuple[FleetController, FleetController]) -> None:
    a, b = pair
    replicas = {"a": a, "b": b}
    blocker = await a.admit(B, "x")  # the fleet's one slot
    # Tenant F's three places (its limit) are taken on both replicas.
    tasks = await arrive_in_turn(replicas, [("f0", "a", "F"), ("f1", "b", "F"),
                                            ("f2", "a", "F")], 0)
    for ctl in (a, b):
        with pytest.raises(Denied) as denied:
            await ctl.admit(B, "F")
        assert denied.value.outcome is Outcome.REJECTED_QUEUE_FULL  # 429, as in-process
    # The in-process core decides the same for the same arrivals.
    s = Scheduler(FAIR, 1, FakeClock())
    assert isinstance(s.arrive("blocker", B, "x"), Admitted)
    assert all(isinstance(s.arrive(f"f{i}", B, "F"), Queued) for i in range(3))
    d = s.arrive("f3", B, "F")
    assert isinstance(d, Rejected) and d.outcome is Outcome.REJECTED_QUEUE_FULL
    # Another tenant still queues, on either replica.
    tasks |= await arrive_in_turn(replicas, [("g0", "b", "G")], 3)
    # A grant frees a place in F's quota.
    a.release(blocker.admission.id)
    first = await asyncio.wait_for(tasks["f0"], 5)
    tasks |= await arrive_in_turn(replicas, [("f3", "b", "F")], 3)
    a.release(first.admission.id)
    for t in tasks.values():
        t.cancel()
    await asyncio.gather(*tasks.values(), return_exceptions=True)


async def test_waiters_on_both_replicas_are_granted_in_the_cores_fair_order(
        pair: tuple[FleetController, FleetController]) -> None:
    a, b = pair
    replicas = {"a": a, "b": b}
    blocker = await a.admit(B, "x")
    # The light tenant L queues three first, then the heavy H (weight 2) three, each on
    # both replicas: the in-process core serves H L H H L L, not first come first served.
    arrivals = [("l0", "a", "L"), ("l1", "a", "L"), ("l2", "b", "L"),
                ("h0", "b", "H"), ("h1", "b", "H"), ("h2", "a", "H")]
    tasks = await arrive_in_turn(replicas, arrivals, 0)
    order: list[str] = []
    holder: Admission = blocker.admission
    owner = a
    pending = dict(tasks)
    while pending:
        owner.release(holder.id)
        done, _ = await asyncio.wait(pending.values(), timeout=5,
                                     return_when=asyncio.FIRST_COMPLETED)
        assert len(done) == 1, f"one grant per release, got {len(done)} after {order}"
        name = next(n for n, t in pending.items() if t in done)
        del pending[name]
        holder = tasks[name].result().admission
        order.append(name)
        owner = replicas[next(r for n, r, _ in arrivals if n == name)]
    owner.release(holder.id)
    want = core_order([(n, t) for n, _, t in arrivals])
    assert order == want
    assert want == ["h0", "l0", "h1", "h2", "l1", "l2"]  # by weight, not by arrival
