"""A restarted Envoy told from a connection blip by its process start.

With ``--envoy-admin-url``, a loopback owner is the pod's own Envoy, and its admin says when
the running process started. The table takes that start as an input (pure, fake clock);
:class:`EnvoyLiveness` is driven over a real :class:`AdmissionController` with an injected
start source, so "released" and "held" are the controller's real answers.
"""

from __future__ import annotations

import asyncio
import itertools
import math
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web
from hypothesis import example, given, settings
from hypothesis import strategies as st

from devtools.stack import free_port
from sidecar.admission import AdmissionController
from sidecar.classes import PriorityClass
from sidecar.liveness import (
    BLIP,
    DEAD,
    RESTARTED,
    STALE,
    UNIX_OWNER,
    AdminProcessStart,
    EnvoyLiveness,
    OwnerTable,
    ProcessStart,
    local_owners,
    process_start,
)
from sidecar.metrics import NullRecorder
from sidecar.scheduler import ClassSettings, ReleaseResult, Scheduler
from tests.clock import FakeClock
from tests.conftest import serve_on_loopback
from tests.lease_home import AllHeld

GRACE = 5.0
LEASE = 10.0
D = PriorityClass.DEFAULT
CFG = {c: ClassSettings(0, 0.0, 2, 5.0, 100.0, False) for c in PriorityClass}
LOCAL = "ipv4:127.0.0.1:40001"


def started(at: float) -> ProcessStart:
    """A start known as Envoy reports it: within a one-second window."""
    return ProcessStart(at - 0.5, at + 0.5)


def table() -> OwnerTable:
    return OwnerTable(GRACE, lambda owner: owner != "remote", leases=AllHeld())


# ----------------------------------------------------------------------------- parsing


@pytest.mark.parametrize(("admin", "owner", "local"), [
    ("http://127.0.0.1:9901", "127.0.0.1", True), ("http://127.0.0.1:9901", "127.0.0.6", True),
    ("http://localhost:9901", "::1", True), ("http://[::1]:9901", UNIX_OWNER, True),
    ("http://127.0.0.1:9901", "10.0.0.8", False), ("http://127.0.0.1:9901", "router~x", False),
    ("http://10.0.0.9:9901", "10.0.0.9", True),  # the admin URL's own host: that Envoy
    # An admin elsewhere says nothing about who calls over loopback or the socket.
    ("http://10.0.0.9:9901", "127.0.0.1", False), ("http://10.0.0.9:9901", "127.0.0.6", False),
    ("http://10.0.0.9:9901", UNIX_OWNER, False), ("http://10.0.0.9:9901", "fe80::1%eth0", False),
])
def test_local_owners_are_loopback_unix_and_the_admin_host(admin: str, owner: str,
                                                           local: bool) -> None:
    assert local_owners(admin)(owner) is local


def test_a_localhost_admin_url_still_names_loopback_owners() -> None:
    assert local_owners("http://localhost:9901/")("127.0.0.1")
    assert not local_owners("http://localhost:9901/")("10.0.0.1")


def test_the_start_window_follows_envoys_whole_second_uptime() -> None:
    # Envoy: uptime = time(now) - time(start). Asked at wall 1000.3 (mono 50.3),
    # answered at wall 1000.4 (mono 50.4), uptime 7 s: the start was in wall
    # [993, 994), i.e. mono [42.99..., 44.0...) with each reading's own offset.
    s = process_start({"uptime_current_epoch": "7s", "uptime_all_epochs": "7s"},
                      (50.3, 1000.3), (50.4, 1000.4))
    assert s is not None
    assert math.isclose(s.earliest, 43.0) and math.isclose(s.latest, 44.0)
    assert s.before(42.8) and not s.before(42.95)
    assert s.after(44.2) and not s.after(44.05)


@pytest.mark.parametrize("info", [
    {"uptime_current_epoch": "7s", "uptime_all_epochs": "90s"},  # hot restarted
    {"uptime_current_epoch": "7", "uptime_all_epochs": "7"},
    {"uptime_current_epoch": "-1s", "uptime_all_epochs": "-1s"},
    {"uptime_current_epoch": "nans", "uptime_all_epochs": "nans"},
    {"uptime_all_epochs": "7s"},
    [],
])
def test_no_start_from_an_unreadable_or_hot_restarted_answer(info: object) -> None:
    assert process_start(info, (0.0, 0.0), (0.0, 0.0)) is None


# ----------------------------------------------------------------------------- the table


def test_a_dead_envoys_acknowledged_slots_are_released_when_its_successor_is_watched() -> None:
    # Review finding #2: E1 acknowledged two streams, died before its first ALS stream;
    # E2 started at the same address at 20 and opened its stream at 30.
    t = table()
    for aid in ("x", "y"):
        t.admitted(aid, "127.0.0.1", 1.0)
        assert not t.acknowledge(aid, 1.5)
    t.admitted("z", "127.0.0.1", 25.0)  # E2's own, not acknowledged yet
    r = t.stream_opened("127.0.0.1", 30.0)
    assert sorted(r.unlease) == ["x", "y"]  # the time-only rule, until the admin answers
    assert r.ask is not None
    ident = t.identified("127.0.0.1", r.ask, started(20.0), 30.1)
    assert sorted(ident.release) == ["x", "y"] and ident.unlease == []
    assert t.owner("x") is None and t.owner("z") == "127.0.0.1"


def test_a_remote_owner_is_never_asked_and_keeps_the_time_only_rules() -> None:
    t = table()
    t.admitted("x", "remote", 1.0)
    assert t.stream_opened("remote", 2.0).ask is None
    t.acknowledge("x", 2.0)
    t.stream_closed("remote", 3.0)
    assert t.due_checks(100.0) == []
    assert t.pop_dead(3.0 + GRACE) == [("remote", ["x"])]


def test_a_blip_releases_nothing_and_is_checked_again_every_grace() -> None:
    t = table()
    t.stream_opened("127.0.0.1", 10.0)
    t.admitted("x", "127.0.0.1", 11.0)
    assert t.acknowledge("x", 11.0)
    t.stream_closed("127.0.0.1", 20.0)
    assert t.pop_dead(100.0) == []  # identified owners are never dead on time alone
    assert t.next_deadline() == 20.0 + GRACE
    assert t.due_checks(24.9) == []
    [(owner, ask)] = t.due_checks(25.0)
    assert t.next_deadline() is None  # pending: no second ask
    c = t.checked(owner, ask, started(5.0), 25.1)
    assert (c.verdict, c.release, c.first_blip) == (BLIP, [], True)
    assert t.unleased("x") and t.next_deadline() == pytest.approx(25.1 + GRACE)
    [(_, ask)] = t.due_checks(30.1)
    c = t.checked(owner, ask, started(5.0), 30.2)
    assert (c.verdict, c.first_blip) == (BLIP, False)  # counted once per loss
    # Then the process does die and a new one starts: what it held is released.
    [(_, ask)] = t.due_checks(35.2)
    c = t.checked(owner, ask, started(33.0), 35.3)
    assert (c.verdict, c.release) == (RESTARTED, ["x"])
    assert len(t) == 0 and t.next_deadline() is None


def test_no_admin_answer_is_a_death_as_without_an_admin() -> None:
    t = table()
    t.stream_opened("127.0.0.1", 10.0)
    t.admitted("x", "127.0.0.1", 11.0)
    t.acknowledge("x", 11.0)
    t.stream_closed("127.0.0.1", 20.0)
    t.admitted("later", "127.0.0.1", 21.0)  # asked for while lost: keeps its lease
    [(owner, ask)] = t.due_checks(25.0)
    c = t.checked(owner, ask, None, 26.0)
    assert (c.verdict, c.release) == (DEAD, ["x"])
    assert t.owner("later") == "127.0.0.1" and not t.watched("127.0.0.1")


def test_a_restart_after_the_loss_releases_what_came_before_the_new_start() -> None:
    t = table()
    t.stream_opened("127.0.0.1", 10.0)
    t.admitted("x", "127.0.0.1", 11.0)
    t.stream_closed("127.0.0.1", 20.0)
    t.admitted("old", "127.0.0.1", 21.0)  # the old process, after its stream went
    t.admitted("new", "127.0.0.1", 24.0)  # the new one (started at 23)
    [(owner, ask)] = t.due_checks(25.0)
    c = t.checked(owner, ask, started(23.0), 25.1)
    assert (c.verdict, sorted(c.release)) == (RESTARTED, ["old", "x"])
    assert t.owner("new") == "127.0.0.1" and not t.unleased("new")


def test_a_start_within_the_resolution_of_the_loss_falls_back_to_the_time_only_rule() -> None:
    t = table()
    t.stream_opened("127.0.0.1", 10.0)
    t.admitted("x", "127.0.0.1", 11.0)
    t.stream_closed("127.0.0.1", 20.0)
    [(owner, ask)] = t.due_checks(25.0)
    c = t.checked(owner, ask, started(20.3), 25.1)  # before or after the loss? unknown
    assert (c.verdict, c.release) == (DEAD, ["x"])


def test_an_answer_overtaken_by_a_stream_is_dropped() -> None:
    t = table()
    t.stream_opened("127.0.0.1", 10.0)
    t.admitted("x", "127.0.0.1", 11.0)
    t.acknowledge("x", 11.0)
    t.stream_closed("127.0.0.1", 20.0)
    [(owner, ask)] = t.due_checks(25.0)
    r = t.stream_opened("127.0.0.1", 25.05)  # Envoy's next entry, while the admin is asked
    assert t.checked(owner, ask, None, 25.1).verdict == STALE
    assert t.owner("x") == "127.0.0.1"
    # And an identification asked at that open is dropped once it closed again.
    t.stream_closed("127.0.0.1", 25.2)
    assert r.ask is not None
    assert t.identified(owner, r.ask, started(30.0), 25.3).release == []
    assert t.owner("x") == "127.0.0.1"


def test_a_gap_of_the_same_process_unleases_what_it_put_back_under_the_lease() -> None:
    t = table()
    t.stream_opened("127.0.0.1", 10.0)
    t.admitted("x", "127.0.0.1", 11.0)
    t.acknowledge("x", 11.0)
    t.stream_closed("127.0.0.1", 20.0)
    r = t.stream_opened("127.0.0.1", 21.0)  # reopened within the grace
    assert r.relapse == ["x"] and not t.unleased("x")
    assert r.ask is not None
    ident = t.identified("127.0.0.1", r.ask, started(5.0), 21.1)
    assert ident.unlease == ["x"] and ident.release == []
    assert t.unleased("x")


def test_an_admission_within_the_resolution_of_the_start_is_left_as_decided() -> None:
    t = table()
    t.admitted("x", "127.0.0.1", 20.2)  # the start is 20 +- 0.5: whose is it?
    t.acknowledge("x", 20.3)
    r = t.stream_opened("127.0.0.1", 30.0)
    assert r.unlease == ["x"] and r.ask is not None
    ident = t.identified("127.0.0.1", r.ask, started(20.0), 30.1)
    assert ident.release == [] and t.unleased("x")  # the time-only rule's decision


# A scenario on one local owner, run against the real process history: each step
# moves time on by 3 s, more than the start's resolution, so every comparison is decidable.
STEPS = st.lists(st.sampled_from(
    ["admit", "ack", "end", "open", "close", "blip", "kill", "start", "wait"]), min_size=10,
    max_size=50)  # hypothesis favours short lists: most had < 10 steps


@settings(max_examples=300, deadline=None)
@given(STEPS)
@example(["start", "open", "admit", "ack", "kill", "start", "wait", "wait", "wait"])
@example(["start", "open", "admit", "ack", "blip", "wait", "wait", "wait", "open"])
@example(["start", "admit", "ack", "kill", "start", "admit", "open", "wait"])
def test_no_slot_is_released_while_its_process_lives_nor_kept_once_it_is_known_dead(
        steps: list[str]) -> None:
    t = table()
    now = 0.0
    proc = 0  # the running process (0: none), its start, and its open streams
    starts: dict[int, float] = {}
    alive: set[int] = set()
    streams = 0
    whose: dict[str, int] = {}  # admission -> process that asked for it
    ids = (f"id{i}" for i in itertools.count())
    asks: list[tuple[str, int, bool]] = []  # (kind, token, by then the process started)

    def admin() -> ProcessStart | None:
        return started(starts[proc]) if proc in alive else None

    def released(aids: list[str]) -> None:
        for aid in aids:
            assert whose[aid] not in alive, f"{aid} released while its process lives"
            del whose[aid]

    for i, step in enumerate(steps):
        now += 3.0
        if step == "start" and proc not in alive:
            proc += 1
            starts[proc] = now
            alive.add(proc)
        elif step == "kill" and proc in alive:
            alive.discard(proc)
            for _ in range(streams):
                t.stream_closed("127.0.0.1", now)
            streams = 0
        elif step == "blip" and streams:
            for _ in range(streams):
                t.stream_closed("127.0.0.1", now)
            streams = 0
        elif step == "open" and proc in alive:
            r = t.stream_opened("127.0.0.1", now)
            streams += 1
            if r.ask is not None:
                asks.append(("identify", r.ask, True))
        elif step == "close" and streams:
            t.stream_closed("127.0.0.1", now)
            streams -= 1
        elif step == "admit" and proc in alive:
            aid = next(ids)
            whose[aid] = proc
            t.admitted(aid, "127.0.0.1", now)
        elif step in ("ack", "end") and whose:
            aid = sorted(whose)[i % len(whose)]
            if whose[aid] in alive:
                if step == "ack":
                    t.acknowledge(aid, now)
                else:
                    t.ended(aid)
                    del whose[aid]
        for owner, ask in t.due_checks(now):
            assert owner == "127.0.0.1"
            asks.append(("check", ask, True))
        # Answers come back (all at once, after the step: any interleaving with a step
        # is one of these orders).
        for kind, ask, _ in asks:
            if kind == "identify":
                released(t.identified("127.0.0.1", ask, admin(), now + 0.01).release)
            else:
                released(t.checked("127.0.0.1", ask, admin(), now + 0.01).release)
        if asks and proc in alive:
            # The running process's admin answered: nothing of a dead one is left.
            assert all(whose[aid] in alive for aid in whose)
        asks.clear()
    # Known dead: a process that is not the running one, once the running one's stream
    # opened and its admin answered, leaves nothing behind.
    if proc not in alive:
        proc += 1
        starts[proc] = now + 3.0
        alive.add(proc)
    now += 6.0
    for _ in range(streams):
        t.stream_closed("127.0.0.1", now)
    r = t.stream_opened("127.0.0.1", now)
    assert r.ask is not None
    released(t.identified("127.0.0.1", r.ask, admin(), now + 0.01).release)
    assert all(whose[aid] in alive for aid in whose)


# ----------------------------------------------------------------- over a real controller


class Recorder(NullRecorder):
    def __init__(self) -> None:
        self.lost: list[int] = []
        self.blips = 0

    def owner_lost(self, released: int) -> None:
        self.lost.append(released)

    def owner_blip(self) -> None:
        self.blips += 1


class Admin:
    """The local Envoy's admin: the running process's start, or no answer."""

    def __init__(self) -> None:
        self.start: ProcessStart | None = None
        self.asked = 0

    async def __call__(self) -> ProcessStart | None:
        self.asked += 1
        return self.start


async def make() -> tuple[AdmissionController, EnvoyLiveness, FakeClock, Recorder, Admin]:
    clock = FakeClock()
    ids = (f"id{i}" for i in itertools.count())
    ctl = AdmissionController(Scheduler(CFG, 4, clock), lease_secs=LEASE, clock=clock,
                              id_factory=lambda: next(ids))
    rec, admin = Recorder(), Admin()
    lv = EnvoyLiveness(ctl, grace=GRACE, metrics=rec, clock=clock, start_of=admin,
                       identifiable=local_owners("http://127.0.0.1:9901"))
    return ctl, lv, clock, rec, admin


async def admit(ctl: AdmissionController, lv: EnvoyLiveness, peer: str = LOCAL) -> str:
    aid = (await ctl.admit(D, "t")).admission.id
    lv.admitted(aid, peer)
    return aid


async def acked_then_lost(ctl: AdmissionController, lv: EnvoyLiveness,
                          peer: str = LOCAL) -> str:
    """An admission its Envoy acknowledged, then that Envoy's only access-log stream closes."""
    owner = lv.stream_opened(peer)
    aid = await admit(ctl, lv, peer)
    lv.acknowledged(aid)
    lv.stream_closed(owner)
    return aid


async def grace_passes(lv: EnvoyLiveness, clock: FakeClock) -> None:
    """One grace later: the timer's sweep has run and the admin's answers are applied."""
    clock.advance(GRACE)
    lv.sweep()
    await lv.settled()


async def test_a_restarted_envoy_frees_its_predecessors_slots_at_its_first_stream() -> None:
    ctl, lv, clock, rec, admin = await make()
    dead = [await admit(ctl, lv) for _ in range(2)]
    for aid in dead:
        lv.acknowledged(aid)  # ext_proc: E1 runs them, but never opened an ALS stream
    clock.advance(3.0)  # E1 is killed; E2 starts
    admin.start = started(clock())
    clock.advance(2.0)
    own = await admit(ctl, lv)
    lv.acknowledged(own)
    lv.stream_opened(LOCAL)  # E2's first entry
    await lv.settled()
    assert [ctl.holds(aid) for aid in dead] == [False, False]
    assert ctl.release(dead[0]) is ReleaseResult.ALREADY_RELEASED  # a late entry
    assert rec.lost == [2]
    clock.advance(10 * LEASE)
    ctl.tick()
    assert ctl.holds(own)  # E2's own: no lease
    ctl.close()


async def test_a_blip_keeps_a_long_stream_past_the_grace_and_the_lease() -> None:
    ctl, lv, clock, rec, admin = await make()
    admin.start = started(clock() - 100.0)
    aid = await acked_then_lost(ctl, lv)  # the connection reset; Envoy lives and streams
    for _ in range(4):  # checked every grace, for longer than the lease
        await grace_passes(lv, clock)
        ctl.tick()
        assert ctl.holds(aid)
    # 4 checks; the watch's question was still pending when the first check replaced it
    # (one question per owner in flight).
    assert rec.blips == 1 and rec.lost == [] and admin.asked == 4
    # Its next entry reopens the stream; then its final entry ends it.
    lv.stream_opened(LOCAL)
    await lv.settled()
    clock.advance(2 * LEASE)
    ctl.tick()
    assert ctl.holds(aid)
    assert ctl.release(aid) is ReleaseResult.RELEASED
    ctl.close()


async def test_without_an_admin_answer_a_lost_envoy_is_dead_after_the_grace() -> None:
    ctl, lv, clock, rec, _ = await make()
    aid = await acked_then_lost(ctl, lv)
    await grace_passes(lv, clock)
    assert not ctl.holds(aid) and rec.lost == [1]
    ctl.close()


async def test_a_remote_envoy_is_decided_on_time_alone() -> None:
    ctl, lv, clock, _, admin = await make()
    peer = "ipv4:10.0.0.1:40001"
    await acked_then_lost(ctl, lv, peer)
    clock.advance(GRACE)
    assert lv.sweep() == 1 and admin.asked == 0
    ctl.close()


async def test_closed_liveness_applies_no_answer() -> None:
    ctl, lv, clock, _, admin = await make()
    aid = await admit(ctl, lv)
    lv.acknowledged(aid)
    clock.advance(3.0)
    admin.start = started(clock())
    lv.stream_opened(LOCAL)
    lv.close()  # stopping: the answer must not release anything
    await lv.settled()
    assert ctl.holds(aid)
    ctl.release(aid)
    ctl.close()


async def test_a_failing_start_source_counts_as_no_answer() -> None:
    ctl, lv, clock, rec, _ = await make()

    async def broken() -> ProcessStart | None:
        raise RuntimeError("bug")

    lv._start_of = broken  # an answer must come, or the lost owner is never decided
    aid = await acked_then_lost(ctl, lv)
    await grace_passes(lv, clock)
    assert not ctl.holds(aid) and rec.lost == [1]
    ctl.close()


# ----------------------------------------------------------------- the admin, over HTTP


@pytest.fixture
async def admin_server() -> AsyncIterator[tuple[str, dict[str, object]]]:
    """A real HTTP server standing in for Envoy's admin ``/server_info``."""
    state: dict[str, object] = {"status": 200, "body": {}, "gate": asyncio.Event()}

    async def server_info(_: web.Request) -> web.Response:
        if state.get("hang"):
            gate = state["gate"]
            assert isinstance(gate, asyncio.Event)
            await gate.wait()  # never set: the client's timeout decides
        return web.json_response(state["body"], status=int(str(state["status"])))

    app = web.Application()
    app.router.add_get("/server_info", server_info)
    runner, url = await serve_on_loopback(app)
    yield f"{url}/", state
    gate = state["gate"]
    assert isinstance(gate, asyncio.Event)
    gate.set()  # a hung handler ends, so the server stops at once
    await runner.cleanup()


async def test_the_admin_start_is_read_from_server_info(
        admin_server: tuple[str, dict[str, object]]) -> None:
    url, state = admin_server
    state["body"] = {"state": "LIVE", "uptime_current_epoch": "7s", "uptime_all_epochs": "7s"}
    readings = iter([50.3, 50.4])
    walls = iter([1000.3, 1000.4])
    async with aiohttp.ClientSession() as session:
        src = AdminProcessStart(url, lambda: session, clock=lambda: next(readings),
                                wall=lambda: next(walls))
        s = await src()
    assert s is not None
    assert math.isclose(s.earliest, 43.0) and math.isclose(s.latest, 44.0)


@pytest.mark.parametrize("trouble", ["status", "hang", "garbage"])
async def test_no_admin_answer_is_none(admin_server: tuple[str, dict[str, object]],
                                       trouble: str) -> None:
    url, state = admin_server
    state["body"] = {"uptime_current_epoch": "7s", "uptime_all_epochs": "7s"}
    if trouble == "status":
        state["status"] = 503
    elif trouble == "hang":
        state["hang"] = True
    else:
        state["body"] = "not json server info"
    async with aiohttp.ClientSession() as session:
        assert await AdminProcessStart(url, lambda: session, timeout=0.3)() is None


# ------------------------------------------------------------ second review's findings


async def test_after_a_blip_with_periodic_entries_a_lost_final_entry_does_not_leak() -> None:
    """Y ended while the access-log connection was down (its final entry lost with it).
    The admin says the same process runs, but this Envoy sends periodic entries: what was
    acknowledged before the gap waits under the lease for its next periodic entry, so the
    live X is acknowledged again and the ended Y expires instead of being held forever."""
    ctl, lv, clock, _rec, admin = await make()
    admin.start = started(clock() - 100.0)
    owner = lv.stream_opened(LOCAL)
    await lv.settled()
    x, y = await admit(ctl, lv), await admit(ctl, lv)
    lv.acknowledged(x)
    lv.acknowledged(y)
    lv.periodic_entry(owner)
    lv.stream_closed(owner)  # the reset; Y's final entry is lost with it
    clock.advance(1.0)
    owner = lv.stream_opened(LOCAL)  # Envoy's next entry reopens it
    await lv.settled()
    clock.advance(LEASE / 2)
    lv.acknowledged(x)  # X's next periodic entry
    clock.advance(LEASE)
    ctl.tick()
    assert ctl.holds(x) and not ctl.holds(y)


async def test_without_periodic_entries_a_blip_keeps_what_ran_before_it() -> None:
    ctl, lv, clock, _rec, admin = await make()
    admin.start = started(clock() - 100.0)
    owner = lv.stream_opened(LOCAL)
    await lv.settled()
    x = await admit(ctl, lv)
    lv.acknowledged(x)
    lv.stream_closed(owner)
    clock.advance(1.0)
    lv.stream_opened(LOCAL)
    await lv.settled()
    clock.advance(3 * LEASE)
    ctl.tick()
    assert ctl.holds(x)  # the same process runs it: no timer takes it


async def test_acknowledged_during_a_confirmed_blip_has_no_lease_and_dies_with_the_process(
        ) -> None:
    ctl, lv, clock, rec, admin = await make()
    admin.start = started(clock() - 100.0)
    owner = lv.stream_opened(LOCAL)
    await lv.settled()
    lv.stream_closed(owner)
    await grace_passes(lv, clock)
    assert rec.blips == 1
    new = await admit(ctl, lv)  # a new long stream of the same, live process
    lv.acknowledged(new)
    clock.advance(3 * LEASE)
    ctl.tick()
    assert ctl.holds(new)
    admin.start = None  # now the process is gone
    for _ in range(int(3 * LEASE / GRACE) + 1):
        await grace_passes(lv, clock)
        if not ctl.holds(new):
            break
    assert not ctl.holds(new) and rec.lost == [1]


async def test_periodic_entries_are_known_per_envoy_and_forgotten_with_its_process() -> None:
    ctl, lv, clock, _rec, admin = await make()
    other = "ipv4:10.0.0.8:40001"
    mine = lv.stream_opened(LOCAL)
    theirs = lv.stream_opened(other)
    lv.periodic_entry(mine)
    assert await admit_says_periodic(ctl, lv, LOCAL)
    assert not await admit_says_periodic(ctl, lv, other)  # that Envoy sends none
    lv.stream_closed(theirs)
    lv.stream_closed(mine)
    admin.start = None  # the pod's Envoy died
    await grace_passes(lv, clock)
    assert not await admit_says_periodic(ctl, lv, LOCAL)  # its successor: not known yet


async def admit_says_periodic(ctl: AdmissionController, lv: EnvoyLiveness, peer: str) -> bool:
    return lv.admitted((await ctl.admit(D, "t")).admission.id, peer)


async def test_a_closed_liveness_asks_the_admin_nothing() -> None:
    _ctl, lv, clock, _rec, admin = await make()
    lv.close()
    owner = lv.stream_opened(LOCAL)
    lv.stream_closed(owner)
    await grace_passes(lv, clock)
    assert admin.asked == 0


async def test_connection_flaps_keep_one_question_per_owner_in_flight() -> None:
    _ctl, lv, clock, _rec, _admin = await make()
    gate = asyncio.Event()
    in_flight = 0
    peak = 0

    async def slow() -> ProcessStart | None:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        try:
            await gate.wait()
            return started(clock() - 100.0)
        finally:
            in_flight -= 1

    lv._start_of = slow
    for _ in range(50):
        owner = lv.stream_opened(LOCAL)
        await asyncio.sleep(0)
        lv.stream_closed(owner)
        await asyncio.sleep(0)
    assert peak == 1
    gate.set()
    await lv.settled()


async def test_a_busy_admin_is_asked_again_a_gone_one_is_not(
        admin_server: tuple[str, dict[str, object]]) -> None:
    url, state = admin_server
    state["body"] = {"uptime_current_epoch": "7s", "uptime_all_epochs": "7s"}
    state["status"] = 503
    async with aiohttp.ClientSession() as session:
        src = AdminProcessStart(url, lambda: session, timeout=0.3)
        task = asyncio.ensure_future(src())
        await asyncio.sleep(0.1)  # the first attempt got its 503
        state["status"] = 200
        assert await task is not None  # the retry found it
        port = free_port()  # nothing listens there: refused, answered at once
        gone = AdminProcessStart(f"http://127.0.0.1:{port}", lambda: session, timeout=0.3)
        t0 = asyncio.get_running_loop().time()
        assert await gone() is None
        assert asyncio.get_running_loop().time() - t0 < 0.2


async def test_a_restarted_envoy_must_show_its_own_periodic_entries() -> None:
    ctl, lv, clock, _rec, admin = await make()
    owner = lv.stream_opened(LOCAL)
    lv.periodic_entry(owner)  # the first process sends them
    assert await admit_says_periodic(ctl, lv, LOCAL)
    lv.stream_closed(owner)
    clock.advance(1.0)
    admin.start = started(clock())  # replaced within the grace, maybe with another config
    clock.advance(1.0)
    lv.stream_opened(LOCAL)
    await lv.settled()
    assert not await admit_says_periodic(ctl, lv, LOCAL)
