"""Two replicas, one admission controller, end to end through the real stacks.

Two Envoys and two sidecars in front of ONE fleet of fake workers, the sidecars sharing
ONE real valkey-server (devtools.stack.Replicas). The fleet's ``tally`` counts what the
workers really run at once, whichever replica admitted it: the ground truth every test
compares with the fleet's capacity. Requests are held at the workers with gates, not
sleeps; every wait is bounded.

The soak runs the issue's 10,000 requests (about 20 s here); ``SOAK_REQUESTS`` and
``SOAK_ABORTS`` (the share of clients that leave early) change it.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import redis.asyncio as redis

from devtools.fleet import RequestRecord, wait_for
from devtools.httpclient import Exchange, Response, chat_body, request
from devtools.stack import Replicas, Stack, StackConfig
from sidecar.coordination.ledger import FleetLedger, prefix
from tests.conftest import Metrics, assert_denied, assert_preempted, settle
from tests.conftest import until as until_metrics

pytestmark = pytest.mark.e2e

CAPACITY = 4  # two workers reporting two slots each
TTL = 2.0  # --replica-ttl-secs: short, so the fault tests are quick
STARVATION = 1.5  # interactive starvation threshold in FLEET below

# No reservations: whoever asks first may use every slot, so "all of the capacity is
# used" is a fair expectation. Queues deep and long enough that a flood only waits.
FLEET = f"""
classes:
  system: {{reserved_floor: 0, reserved_per_slot: 0.0, queue_size: 64, queue_timeout_secs: 20,
           can_preempt: false}}
  interactive: {{reserved_floor: 0, reserved_per_slot: 0.0, queue_size: 64,
                queue_timeout_secs: 20, starvation_threshold_secs: {STARVATION},
                can_preempt: false}}
  default: {{reserved_floor: 0, reserved_per_slot: 0.0, queue_size: 64, queue_timeout_secs: 20}}
  bulk: {{reserved_floor: 0, reserved_per_slot: 0.0, queue_size: 256, queue_timeout_secs: 20,
         starvation_threshold_secs: 30}}
"""
# System may preempt (the builtin lets interactive preempt too; here only system does).
PREEMPT = FLEET.replace("can_preempt: false}\n  interactive",
                        "can_preempt: true}\n  interactive", 1)
assert PREEMPT != FLEET
# Anonymous clients may ask for any class (no JWT needed to say "system").
OPEN_CEILING = ["--priority-scheduler-default-max-class", "system"]

ReplicasFactory = Callable[..., Awaitable[Replicas]]


@pytest.fixture
async def make_replicas(tmp_path: Path) -> AsyncIterator[ReplicasFactory]:
    started: list[Replicas] = []

    async def factory(**kw: Any) -> Replicas:
        kw.setdefault("priority_yaml", FLEET)
        kw.setdefault("workers", 2)
        kw.setdefault("max_running_requests", 2)
        kw.setdefault("sidecar_args", OPEN_CEILING)
        ttl = kw.pop("ttl", TTL)
        r = Replicas(StackConfig(**kw), workdir=tmp_path, ttl_secs=ttl)
        started.append(r)
        await r.start()
        return r

    yield factory
    try:
        for r in started:
            if r.server.proc is None:
                continue
            for stack in r.stacks:
                if stack.sidecar is not None:
                    await settle(stack, timeout=15)
            # nothing left in the ledger either
            await until_ledger(r, lambda s: s.total_inflight == 0
                               and sum(s.queue_depth.values()) == 0)
    finally:
        for r in started:
            await r.stop()


# ------------------------------------------------------------------------ helpers


async def ledger_snapshot(r: Replicas) -> Any:
    client = redis.Redis(port=r.server.port, decode_responses=True)
    try:
        return await FleetLedger(client, r.fleet_id, "test-observer", ttl=TTL).snapshot()
    finally:
        await client.aclose()


async def until_ledger(r: Replicas, cond: Callable[[Any], bool], timeout: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        snap = await ledger_snapshot(r)
        if cond(snap):
            return snap
        if time.monotonic() > deadline:
            raise AssertionError(f"ledger: timed out; last snapshot {snap}")
        await asyncio.sleep(0.05)


async def until_heard(r: Replicas, timeout: float = 10.0) -> None:
    """Until every replica has read a ledger reply that counts each one registered after
    it (ledger.lua unheard_by): a replica's next status from then on gives it its
    degraded share (one that just joined has none before)."""
    client = redis.Redis(port=r.server.port, decode_responses=True)
    deadline = time.monotonic() + timeout
    try:
        while True:
            reg = {k: int(v) for k, v in (await client.hgetall(f"pg:{{{r.fleet_id}}}:reg")).items()}
            heard = {k: int(v) for k, v in
                     (await client.hgetall(f"pg:{{{r.fleet_id}}}:heard")).items()}
            if len(reg) == len(r.stacks) and all(
                    heard.get(o, 0) >= g for x, g in reg.items() for o, go in reg.items()
                    if o != x and go <= g):
                return
            assert time.monotonic() < deadline, f"not heard: reg {reg}, heard {heard}"
            await asyncio.sleep(0.05)
    finally:
        await client.aclose()


async def until_preemptible(r: Replicas, n: int, timeout: float = 10.0) -> None:
    """Until the ledger lists ``n`` bulk preemption candidates. A replica marks an admission
    preemptible in the ledger from its outbox, a few ms after the ext_proc stream opened
    and off the request's path: a worker may run a request before the ledger may choose
    it as a victim, and a preemptor sent in between takes an older candidate."""
    client = redis.Redis(port=r.server.port, decode_responses=True)
    key = f"{prefix(r.fleet_id)}:pre:{int(_cls('bulk'))}"
    deadline = time.monotonic() + timeout
    try:
        while (marked := await client.zcard(key)) != n:
            assert time.monotonic() < deadline, \
                f"ledger: {marked} bulk preemption candidates after {timeout} s, not {n}"
            await asyncio.sleep(0.02)
    finally:
        await client.aclose()


async def until(stack: Stack, cond: Callable[[Metrics], bool], timeout: float = 10.0) -> Metrics:
    # Two stacks and a server on the box: a longer default bound than the one-stack tests.
    return await until_metrics(stack, cond, timeout)


def state_is(state: str) -> Callable[[Metrics], bool]:
    return lambda m: m.get(f'smg_sidecar_coordination_state{{state="{state}"}}') == 1


def admitted(m: Metrics) -> float:
    return sum(v for k, v in m.items()
               if k.startswith("smg_scheduler_admit_total{") and 'outcome="admitted"' in k)


def inflight(m: Metrics) -> float:
    return sum(v for k, v in m.items() if k.startswith("smg_scheduler_inflight{"))


def fleet_inflight(m: Metrics) -> float:
    """The fleet's in flight as this replica's last view of the ledger saw it."""
    return sum(v for k, v in m.items() if k.startswith("smg_sidecar_fleet_inflight{"))


def total(ms: list[Metrics], prefix: str) -> float:
    return sum(v for m in ms for k, v in m.items() if k.startswith(prefix))


async def send(stack: Stack, cls: str, **headers: str) -> Response:
    return await request(stack.listen_port, headers={"x-smg-priority": cls, **headers},
                         timeout=30)


async def held(stack: Stack, cls: str, gate: str, stream: bool = False) -> Exchange:
    """A request the workers hold until ``gate`` opens (streams: after their first token)."""
    header = "x-fake-stream-gate" if stream else "x-fake-gate"
    return await Exchange.send(stack.listen_port, body=chat_body(stream=stream),
                               headers={"x-smg-priority": cls, header: gate})


async def hold_bulk(r: Replicas, stack: Stack,
                    n: int) -> tuple[list[Exchange], list[RequestRecord]]:
    """``n`` bulk requests through ``stack``, each held at a worker before any byte (its
    ext_proc stream open: preemption candidates); their exchanges and the workers' records."""
    victims: list[Exchange] = []
    for _ in range(n):
        victims.append(await held(stack, "bulk", "never"))
        await wait_for(lambda: r.fleet.tally.running == len(victims), 5)
    return victims, [rec for w in r.fleet.workers for rec in w.records]


async def assert_newest_preempted(victims: list[Exchange], records: list[RequestRecord]) -> None:
    """The most recently admitted bulk request is the victim, and only it: its client gets
    the 503, its worker sees the cancel."""
    newest = max(records, key=lambda rec: rec.started_at)
    await assert_preempted(victims[-1])
    await wait_for(lambda: newest.outcome == "cancelled", 5)
    assert [rec.outcome for rec in records].count("cancelled") == 1


def peak_through_a_preemption(r: Replicas) -> int:
    """The most completions the workers ran at once, from their records, the preempted
    victim counted as ended when its preemptor started. A preemption frees the victim's
    slot at once (docs/design.md, Preemption): the preemptor's request and Envoy's reset
    of the victim's travel on different connections, and the worker may see either
    first. That overlap, and only that one, is the design's; any other counts."""
    records = [rec for w in r.fleet.workers for rec in w.records]
    [victim] = [rec for rec in records if rec.outcome == "cancelled"]
    [preemptor] = [rec for rec in records if rec.priority_class == "system"]
    assert preemptor.service_started_at is not None and victim.ended_at is not None
    events: list[tuple[float, int]] = []
    for rec in records:
        start = rec.service_started_at if rec.service_started_at is not None else rec.started_at
        end = rec.ended_at if rec.ended_at is not None else float("inf")
        if rec is victim:
            end = min(end, preemptor.service_started_at)
        events += [(start, 1), (end, -1)]
    running = peak = 0
    for _, step in sorted(events):  # at equal times an end (-1) sorts before a start
        running += step
        peak = max(peak, running)
    return peak


async def b_full_a_queued(r: Replicas) -> tuple[list[Exchange], list[asyncio.Future[Response]]]:
    """B's streams hold every slot of the fleet (past their first byte); A queues as many
    default requests, which the workers hold at gate ``a-done`` once admitted."""
    a, b = r.stacks
    streams = [await held(b, "bulk", "never", stream=True) for _ in range(CAPACITY)]
    for ex in streams:
        await ex.read_head()
    await wait_for(lambda: r.fleet.tally.running == CAPACITY, 5)
    waiting = [asyncio.ensure_future(send(a, "default", **{"x-fake-gate": "a-done"}))
               for _ in range(CAPACITY)]
    await until(a, lambda m: m.get('smg_scheduler_queue_depth{class="default"}') == CAPACITY)
    return streams, waiting


async def a_runs_in_bs_place(r: Replicas, waiting: list[asyncio.Future[Response]]) -> None:
    """A's waiters hold every slot B's streams had, never more; then they finish."""
    await wait_for(lambda: r.fleet.tally.running == CAPACITY, 5)
    assert r.fleet.tally.peak == CAPACITY
    r.fleet.gates.open("a-done")
    assert [x.status for x in await asyncio.gather(*waiting)] == [200] * CAPACITY


# -------------------------------------------------------------------------- tests


async def test_mixed_flood_on_both_uses_all_capacity_never_more(
        make_replicas: ReplicasFactory) -> None:
    r = await make_replicas(service_time=0.03)
    a, b = r.stacks
    await until(a, lambda m: m.get("smg_sidecar_live_replicas") == 2)
    classes = ["system", "interactive", "default", "bulk"]
    jobs = [send(stack, classes[i % 4]) for i in range(40) for stack in (a, b)]
    results = await asyncio.gather(*jobs)
    assert [x.status for x in results] == [200] * len(jobs), \
        [x.body for x in results if x.status != 200][:3]
    # the workers never ran more than the fleet's slots at once, and did run that many
    assert r.fleet.tally.peak == CAPACITY
    assert sum(w.finished for w in r.fleet.workers) == len(jobs)
    # each replica counts what came through its door (Prometheus sums the replicas)
    for s in (a, b):
        assert admitted(await settle(s)) == len(jobs) // 2


async def test_bulk_flood_on_a_does_not_starve_interactive_on_b(
        make_replicas: ReplicasFactory) -> None:
    r = await make_replicas(service_time=0.15)
    a, b = r.stacks
    await until(b, lambda m: m.get("smg_sidecar_live_replicas") == 2)
    # 60 bulk requests through A: 4 run, 56 wait in the fleet's bulk queue (~2.1 s of
    # work in FIFO order, longer than the interactive threshold).
    flood = [asyncio.ensure_future(send(a, "bulk")) for _ in range(60)]
    await until_ledger(r, lambda s: s.queue_depth[_cls("bulk")] >= 40)

    async def interactive() -> tuple[int, float]:
        t0 = time.monotonic()
        resp = await send(b, "interactive")
        return resp.status, time.monotonic() - t0 - 0.15  # minus the worker's service time

    waits: list[float] = []
    for _ in range(4):  # four rounds of four, each while the bulk queue is still deep
        done = await asyncio.gather(*(interactive() for _ in range(4)))
        assert [s for s, _ in done] == [200] * 4  # zero interactive timeouts
        waits += [w for _, w in done]
    waits.sort()
    p99 = waits[int(0.99 * (len(waits) - 1))]
    assert p99 < STARVATION, waits
    print(f"interactive on B behind a bulk flood on A: p99 wait {p99 * 1e3:.0f} ms")
    # the interactive requests went ahead of bulk requests queued before them
    assert (await ledger_snapshot(r)).queue_depth[_cls("bulk")] > 0
    assert [x.status for x in await asyncio.gather(*flood)] == [200] * 60
    assert r.fleet.tally.peak == CAPACITY


def _cls(name: str) -> Any:
    from sidecar.classes import PriorityClass

    cls = PriorityClass.from_name(name)
    assert cls is not None
    return cls


async def test_system_on_a_preempts_bulk_running_through_b(
        make_replicas: ReplicasFactory) -> None:
    r = await make_replicas(priority_yaml=PREEMPT)
    a, b = r.stacks
    await until(a, lambda m: m.get("smg_sidecar_live_replicas") == 2)
    victims, records = await hold_bulk(r, b, CAPACITY)  # B fills the fleet with bulk
    assert r.fleet.tally.peak == CAPACITY
    await until_preemptible(r, CAPACITY)
    resp = await send(a, "system")
    assert resp.status == 200
    # the most recently admitted bulk request is the victim: its client, on B, gets the 503
    await assert_newest_preempted(victims, records)
    assert peak_through_a_preemption(r) == CAPACITY
    for ex in victims:
        await ex.close()
    mb = await settle(b)
    assert mb['smg_scheduler_admit_total{class="bulk",outcome="preempted"}'] == 1
    ma = await settle(a)
    assert ma['smg_scheduler_admit_total{class="system",outcome="admitted"}'] == 1


async def test_replica_killed_its_slots_return_within_the_ttl(
        make_replicas: ReplicasFactory) -> None:
    r = await make_replicas()
    a, b = r.stacks
    await until(a, lambda m: m.get("smg_sidecar_live_replicas") == 2)
    streams, waiting = await b_full_a_queued(r)
    t0 = time.monotonic()
    b.kill()  # SIGKILL Envoy and sidecar: no goodbye to the ledger
    for ex in streams:
        await ex.abort()
    # B's streams die with its Envoy; the ledger frees their slots only when B's
    # registration expires, and then A's waiters fill all of them.
    await until(a, lambda m: m.get('smg_scheduler_inflight{class="default"}') == CAPACITY,
                timeout=TTL + 3)
    returned = time.monotonic() - t0
    assert returned <= TTL + 1.0, returned
    print(f"replica killed: its slots filled on A after {returned:.2f} s (TTL {TTL} s)")
    await until(a, lambda m: m.get("smg_sidecar_live_replicas") == 1)
    await a_runs_in_bs_place(r, waiting)


async def test_envoy_killed_while_its_sidecar_lives_its_slots_return_within_the_grace(
        make_replicas: ReplicasFactory) -> None:
    """Envoy liveness on the fleet path: B's Envoy dies (SIGKILL), B's sidecar lives on and keeps
    heartbeating. B's acknowledged streams have no lease; they come back fleet-wide once
    B's sidecar has seen no access-log stream from that Envoy for the grace (not when the
    replica dies, which it does not)."""
    grace = 1.0
    r = await make_replicas(sidecar_args=[*OPEN_CEILING, "--envoy-owner-grace-secs",
                                          str(grace)])
    a, b = r.stacks
    await until(a, lambda m: m.get("smg_sidecar_live_replicas") == 2)
    assert (await send(b, "bulk")).status == 200  # B's Envoy opens its access-log stream
    await until(b, lambda m: m.get("smg_sidecar_envoy_access_log_streams") == 1)
    streams, waiting = await b_full_a_queued(r)
    t0 = time.monotonic()
    b.kill_envoy()  # only the Envoy: B's sidecar and its heartbeat live on
    for ex in streams:
        await ex.abort()
    await until(a, lambda m: m.get('smg_scheduler_inflight{class="default"}') == CAPACITY,
                timeout=grace + 3)
    returned = time.monotonic() - t0
    print(f"envoy killed: its slots filled on A after {returned:.2f} s (grace {grace} s)")
    m = await until(b, lambda m: m.get("smg_sidecar_envoy_owner_released_total") == CAPACITY)
    assert m.get("smg_sidecar_live_replicas") == 2  # the replica never died
    assert m['smg_sidecar_released_total{class="bulk",reason="lease_expired"}'] == CAPACITY
    await a_runs_in_bs_place(r, waiting)


async def test_server_paused_then_killed_degraded_share_then_recovery(
        make_replicas: ReplicasFactory) -> None:
    r = await make_replicas(service_time=0.05)
    a, b = r.stacks
    for s in (a, b):
        await until(s, lambda m: m.get("smg_sidecar_live_replicas") == 2)
    share = CAPACITY // 2
    stop = asyncio.Event()
    statuses: list[int] = []

    async def load(stack: Stack, cls: str) -> None:
        while not stop.is_set():
            statuses.append((await send(stack, cls)).status)

    loaders = [asyncio.ensure_future(load(s, c)) for s in (a, b)
               for c in ("interactive", "bulk", "bulk")]
    await wait_for(lambda: r.fleet.tally.running == CAPACITY, 5)

    # 1. The server stops answering (SIGSTOP): within the TTL both replicas degrade.
    r.server.pause()
    for s in (a, b):
        await until(s, state_is("degraded"), timeout=TTL + 3)
    r.fleet.tally.reset()
    peaks = {a: 0.0, b: 0.0}
    deadline = time.monotonic() + 1.5
    while time.monotonic() < deadline:  # degraded, still serving, each within its share
        for s in (a, b):
            peaks[s] = max(peaks[s], inflight(await s.metrics()))
        await asyncio.sleep(0.02)
    assert max(peaks.values()) == share, peaks
    assert r.fleet.tally.peak <= CAPACITY

    # 2. Killed while paused, back empty: replicas re-register what they hold and
    # return to ok within 2 x TTL, never exceeding capacity meanwhile.
    r.server.kill()
    r.server.start()
    t0 = time.monotonic()
    for s in (a, b):
        await until(s, state_is("ok"), timeout=2 * TTL + 2)
    recovered = time.monotonic() - t0
    assert recovered <= 2 * TTL + 1.0, recovered
    print(f"server back empty: both replicas ok after {recovered:.2f} s (2 x TTL {2 * TTL} s); "
          f"degraded peaks per replica {sorted(peaks.values())} (share {share})")
    r.fleet.tally.reset()
    await wait_for(lambda: r.fleet.tally.peak >= CAPACITY, 5)  # the whole fleet again
    stop.set()
    await asyncio.wait_for(asyncio.gather(*loaders), 30)
    assert set(statuses) <= {200, 429}, set(statuses)
    for s in (a, b):
        m = await s.metrics()
        assert m['smg_sidecar_coordination_state{state="degraded"}'] == 0
    # Never above capacity after the return either (a resync used to hand the slots of
    # what ended locally to a waiter before counting their replacements: 5 of 4).
    assert r.fleet.tally.peak == CAPACITY


async def test_server_paused_while_b_holds_the_whole_fleet_a_adds_nothing(
        make_replicas: ReplicasFactory) -> None:
    """The gap of floor(C/N) alone: B legally holds all 4 slots (no stranded capacity)
    when the server stops; A's share would be 2, so the workers would run 6. A's limit
    counts the fleet as its last view saw it: min(2, 0 + floor((4 - 4)/2)) = 0."""
    r = await make_replicas()
    a, b = r.stacks
    for s in (a, b):
        await until(s, lambda m: m.get("smg_sidecar_live_replicas") == 2)
    holders = [await held(b, "bulk", "b-done") for _ in range(CAPACITY)]
    await wait_for(lambda: r.fleet.tally.running == CAPACITY, 5)
    # A's heartbeat has seen the fleet full (the gauge comes from the same reply).
    await until(a, lambda m: fleet_inflight(m) == CAPACITY, timeout=TTL)
    r.server.pause()
    flood = [asyncio.ensure_future(send(a, "default")) for _ in range(6)]
    for s in (a, b):
        await until(s, state_is("degraded"), timeout=TTL + 3)
    # Degraded: the workers still run B's 4 only (the ground truth), A admits nothing
    # and its flood waits in its local queue.
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        assert r.fleet.tally.peak == CAPACITY
        assert inflight(await a.metrics()) == 0
        await asyncio.sleep(0.05)
    await until(a, lambda m: m.get('smg_scheduler_queue_depth{class="default"}') == 6)
    assert not any(f.done() for f in flood)
    # B's requests end while the server is still away: A's limit stays 0 (B may reuse
    # its own slots), so the fleet stays within capacity; A is served after recovery.
    r.fleet.gates.open("b-done")
    for ex in holders:
        await asyncio.wait_for(ex.read_head(), 10)
        assert ex.status == 200
    await until(b, lambda m: inflight(m) == 0)
    assert inflight(await a.metrics()) == 0
    r.server.resume()
    for s in (a, b):
        await until(s, state_is("ok"), timeout=2 * TTL + 2)
    assert [x.status for x in await asyncio.wait_for(asyncio.gather(*flood), 30)] == [200] * 6
    assert r.fleet.tally.peak == CAPACITY
    for ex in holders:
        await ex.close()


async def test_degraded_b_preempts_a_carried_over_bulk_locally(
        make_replicas: ReplicasFactory) -> None:
    """Admissions carried into degraded mode keep their stop channel: a system request on
    B, degraded and at its limit, preempts B's most recent bulk request locally."""
    r = await make_replicas(priority_yaml=PREEMPT)
    _, b = r.stacks
    await until(b, lambda m: m.get("smg_sidecar_live_replicas") == 2)
    await until_heard(r)  # B joined after A: its share once A is known to count it
    victims, records = await hold_bulk(r, b, 2)
    assert r.fleet.tally.peak == 2
    # B's view: H = 2, its own 2: limit min(2, 2 + floor(2/2)) = 2, all of it in use.
    await until(b, lambda m: fleet_inflight(m) == 2, timeout=TTL)
    r.server.pause()
    await until(b, state_is("degraded"), timeout=TTL + 3)
    resp = await send(b, "system")
    assert resp.status == 200
    await assert_newest_preempted(victims, records)  # B's own, cancelled locally
    mb = await b.metrics()
    assert mb['smg_scheduler_admit_total{class="bulk",outcome="preempted"}'] == 1
    assert mb['smg_scheduler_preemption_total{by_class="system",victim_class="bulk"}'] == 1
    assert mb['smg_scheduler_admit_total{class="system",outcome="admitted"}'] == 1
    assert mb['smg_sidecar_coordination_state{state="degraded"}'] == 1
    assert peak_through_a_preemption(r) == 2
    r.server.resume()
    await until(b, state_is("ok"), timeout=2 * TTL + 2)
    for ex in victims:
        await ex.close()


@pytest.mark.soak
async def test_soak_with_random_aborts_admitted_equals_released(
        make_replicas: ReplicasFactory) -> None:
    n = int(os.environ.get("SOAK_REQUESTS", 10_000))
    aborts = float(os.environ.get("SOAK_ABORTS", 0.1))
    # A short lease: an admission Envoy never learns of (the client left just as Check
    # answered) ends by expiry, as the failure table says, without keeping the test waiting.
    r = await make_replicas(service_time=0.002, max_running_requests=8, lease_secs=2.0)
    a, b = r.stacks
    rng = random.Random(11)
    classes = ["system", "interactive", "default", "bulk"]
    plan = [(rng.choice((a, b)), rng.choice(classes), rng.random() < aborts) for _ in range(n)]
    statuses: dict[int, int] = {}
    sem = asyncio.Semaphore(48)

    async def one(session: aiohttp.ClientSession, stack: Stack, cls: str, abort: bool) -> None:
        async with sem:
            url = f"http://127.0.0.1:{stack.listen_port}/v1/chat/completions"
            headers = {"x-smg-priority": cls, "content-type": "application/json"}
            try:
                if abort:  # the client leaves at a random moment: queued, admitted, or done
                    async with asyncio.timeout(rng.uniform(0.0, 0.01)):
                        async with session.post(url, data=chat_body(), headers=headers) as resp:
                            await resp.read()
                    statuses[resp.status] = statuses.get(resp.status, 0) + 1
                    return
                async with session.post(url, data=chat_body(), headers=headers) as resp:
                    await resp.read()
                    statuses[resp.status] = statuses.get(resp.status, 0) + 1
            except TimeoutError:
                statuses[-1] = statuses.get(-1, 0) + 1

    t0 = time.monotonic()
    # force_close: an aborted request takes its connection with it, as a real client's.
    # Bounded: a leaked slot per abort would otherwise stall the fleet for minutes.
    async with aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=64, force_close=True),
            timeout=aiohttp.ClientTimeout(total=15)) as session, asyncio.timeout(60):
        await asyncio.gather(*(one(session, s, c, ab) for s, c, ab in plan))
    elapsed = time.monotonic() - t0
    assert sum(statuses.values()) == n
    assert set(statuses) <= {200, 429, -1}, statuses
    assert r.fleet.tally.peak <= 2 * 8
    try:
        ms = [await settle(s, timeout=10) for s in (a, b)]
    except AssertionError as exc:
        detail = [{k: v for k, v in (await s.metrics()).items()
                   if "inflight" in k or "released" in k or 'outcome="admitted"' in k}
                  for s in (a, b)]
        client = redis.Redis(port=r.server.port, decode_responses=True)
        adm = await client.hgetall(f"pg:{{{r.fleet_id}}}:adm")
        await client.aclose()
        seen = {rec.admission_id: (rec.outcome, rec.priority_class)
                for w in r.fleet.workers for rec in w.records}
        raise AssertionError(f"{exc}; ledger {adm}; at workers "
                             f"{[seen.get(i) for i in adm]}; {detail}") from None
    admits = sum(admitted(m) for m in ms)
    released = total(ms, "smg_sidecar_released_total{")
    assert admits == released, (admits, released)
    assert admits >= statuses.get(200, 0)
    snap = await until_ledger(r, lambda s: s.total_inflight == 0)
    assert sum(snap.queue_depth.values()) == 0
    print(f"soak: {n} requests in {elapsed:.1f} s, {statuses}")


# ============================================================================
# Model pools in a fleet through real Envoys: two replicas, two pools, one valkey-server.
# Two Envoys and two sidecars (``devtools.stack.Replicas``) in front of one set of fake
# workers per pool, shared by both replicas; the sidecars share one ledger server, a ledger
# namespace per pool. Each pool's ``tally`` counts what its workers really run at once,
# whichever replica admitted it: the ground truth compared with the pool's capacity.


PRIORITY = """
classes:
  system: {reserved_floor: 0}
  interactive: {reserved_floor: 0, reserved_per_slot: 0.0}
  default: {reserved_per_slot: 0.0}
  bulk: {queue_size: 64, queue_timeout_secs: 20}
"""


# The default pool: 1 worker x 2 slots; big: 1 worker x 1 slot.
POOL_CAPACITY = {"default": 2, "big": 1}


@pytest.fixture
async def replicas(tmp_path: Path) -> AsyncIterator[Replicas]:
    r = Replicas(StackConfig(priority_yaml=PRIORITY, workers=1, max_running_requests=2,
                             service_time=0.1, pools={"big": (1, 1)},
                             envoy_extra_pools=("ghost",)),
                 workdir=tmp_path, ttl_secs=2.0)
    await r.start()
    try:
        yield r
    finally:
        await r.stop()


async def test_each_pool_stays_within_its_own_capacity_across_the_fleet(
        replicas: Replicas) -> None:
    a, b = replicas.stacks
    paths = {"default": "/v1/chat/completions", "big": "/big/v1/chat/completions"}
    n = 10  # per pool and replica
    results = await asyncio.gather(*(
        request(stack.listen_port, paths[pool], headers={"x-smg-priority": "bulk"},
                timeout=30)
        for pool in paths for stack in (a, b) for _ in range(n)))
    assert [r.status for r in results] == [200] * (2 * n * len(paths))
    fleets = {"default": replicas.fleet, **replicas.pool_fleets}
    for pool, fleet in fleets.items():
        records = [rec for w in fleet.workers for rec in w.records]  # type: ignore[union-attr]
        assert len(records) == 2 * n, pool  # every request reached its own pool's workers
        # Both replicas together never ran more than the pool's own capacity, and the
        # other pool's load took none of it.
        assert fleet.tally.peak == POOL_CAPACITY[pool], pool  # type: ignore[union-attr]

    # A route naming a pool the sidecars lack: the documented 429, counted.
    r = await request(a.listen_port, "/ghost/v1/chat/completions",
                      headers={"x-smg-priority": "bulk"})
    assert_denied(r, 429, "scheduler_queue_full", "2")
    ms = [await settle(s) for s in (a, b)]
    assert ms[0]['smg_sidecar_unknown_pool_total{class="bulk"}'] == 1
    for pool, cap in POOL_CAPACITY.items():
        admitted = sum(m[f'smg_scheduler_admit_total{{class="bulk",outcome="admitted",'
                         f'pool="{pool}"}}'] for m in ms)
        assert admitted == 2 * n, pool
        for m in ms:
            assert m[f'smg_sidecar_live_replicas{{pool="{pool}"}}'] == 2
            assert m[f'smg_sidecar_coordination_state{{pool="{pool}",state="ok"}}'] == 1
            assert m[f'smg_sidecar_capacity{{pool="{pool}"}}'] == cap
