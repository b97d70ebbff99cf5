"""Envoy liveness's owner state machine: the table as data, then random sequences of
triggers through the shipped code.

The drive: what Envoy processes do at two owners (the pod's own Envoy, identified by its
admin, and a remote one decided on time alone): start, open and close access-log
streams, lose them all in a blip, die, ask for admissions, acknowledge them (ext_proc,
periodic entries), end them; the admin answering at once or late; and time passing. It
runs :class:`EnvoyLiveness` over a real :class:`AdmissionController` (its real lease
table is the lease home) on a virtual clock: the asyncio loop's own time is that clock,
so both adapters' timers fire at their virtual due time as the test moves the clock from
one due timer to the next. The ground truth (which process runs, its open streams, who
acknowledged what and when, what ended) is the test's own, outside the code under test;
releases are counted from the controller's events.

Invariants, after every step: an owner is alive iff its streams > 0, in a state whose
data fits it; no admission is released twice; none acknowledged while its owner was
alive is released as ``lease_expired`` (by the lease timer or a liveness timer) while
that owner has had a stream open ever since. Their liveness twins: a lost owner's
admissions (asked for before the loss and not shown since) are released within the
grace of the loss (identified owners: once the process is dead, within grace + the
admin's bound); a dead process's admissions whose last sign came while its owner was
watched are released within grace + admin bound + lease of its death; and once every
process is dead, everything is released exactly once and the table is empty.
"""

from __future__ import annotations

import asyncio
import itertools
import re
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from contextvars import Context
from dataclasses import dataclass, field
from typing import Any, TypeVarTuple, Unpack

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import sidecar.liveness as liveness_module
from sidecar.admission import AdmissionController
from sidecar.classes import PriorityClass
from sidecar.liveness import (
    ADMIN_ATTEMPTS,
    ADMIN_RETRY_SECS,
    ADMIN_TIMEOUT_SECS,
    OPEN,
    STALE,
    TRANSITIONS,
    Checked,
    EnvoyLiveness,
    IllegalTransition,
    Loss,
    OwnerTable,
    ProcessStart,
    State,
    Trigger,
    fits,
    local_owners,
    next_state,
)
from sidecar.metrics import NullRecorder
from sidecar.scheduler import ClassSettings, Event, Released, ReleaseReason, Scheduler
from tests.clock import FakeClock
from tests.lease_home import AllHeld

GRACE = 2.0
LEASE = 10.0
# AdminProcessStart gives up by then: its attempts' timeouts and the pauses between.
ADMIN_BOUND = ADMIN_ATTEMPTS * ADMIN_TIMEOUT_SECS + (ADMIN_ATTEMPTS - 1) * ADMIN_RETRY_SECS
LOCAL, REMOTE = "127.0.0.1", "10.0.0.1"  # identified by the pod's admin; time only
OWNERS = (LOCAL, REMOTE)
D = PriorityClass.DEFAULT
CFG = {c: ClassSettings(0, 0.0, 2, 5.0, 100.0, False) for c in PriorityClass}


# ----------------------------------------------------------------------------- the table


def test_every_pair_not_listed_is_illegal() -> None:
    for state in State:
        for trigger in Trigger:
            if (state, trigger) in TRANSITIONS:
                assert next_state(state, trigger) is TRANSITIONS[state, trigger]
            else:
                with pytest.raises(IllegalTransition):
                    next_state(state, trigger)


def test_the_module_table_lists_exactly_the_transitions() -> None:
    """The docstring's table (what a reader sees) against TRANSITIONS (what runs): each
    row's triggers, each with the state its arrow names."""
    doc = liveness_module.__doc__ or ""
    table = doc.split("The owner's state")[1].split("\n\n")[2]
    lines = table.splitlines()
    last = lines[0].rindex("  ") + 2  # where the last column starts
    rows: dict[State, str] = {}
    current: State | None = None
    for line in lines[3:-1]:  # between the header's rule and the closing one
        head = line[:last].split("  ")[0].strip()
        if head:
            current = State[head]
            rows[current] = ""
        assert current is not None
        rows[current] += " " + line[last:]
    assert set(rows) == set(State)
    listed: set[tuple[State, Trigger, State]] = set()
    for state, text in rows.items():
        pending: list[Trigger] = []
        for m in re.finditer(r"``(\w+)``|→\s*([A-Z_]+)", text):
            if m.group(1):
                pending.append(Trigger(m.group(1)))
            else:
                listed |= {(state, t, State[m.group(2)]) for t in pending}
                pending = []
        assert not pending, f"{state}: {pending} without an arrow"
    assert listed == {(s, t, n) for (s, t), n in TRANSITIONS.items()}


def test_closing_or_logging_on_a_stream_that_is_not_open_is_illegal() -> None:
    t = OwnerTable(GRACE, leases=AllHeld())
    with pytest.raises(IllegalTransition):
        t.stream_closed("e1", 0.0)
    with pytest.raises(IllegalTransition):
        t.periodic_entry("e1", 0.0)
    t.stream_opened("e1", 0.0)
    t.stream_closed("e1", 1.0)
    with pytest.raises(IllegalTransition):
        t.stream_closed("e1", 1.5)
    assert t.state("e1") is State.LOST and t.next_deadline() == 1.0 + GRACE


def test_from_every_lost_state_time_alone_reaches_unwatched() -> None:
    """No trap: without Envoy's help (no stream opening), the triggers that time and the
    admin produce lead every lost state to UNWATCHED (a death), except a blip confirmed
    again and again, which is a process that lives."""
    by_time = {Trigger.GRACE_PASSED, Trigger.CHECK_DUE, Trigger.CHECKED_DEAD,
               Trigger.CHECKED_RESTARTED}
    for start in (State.LOST, State.ASKING, State.BLIP, State.BLIP_ASKING):
        seen, frontier = {start}, [start]
        while frontier:
            s = frontier.pop()
            for (a, trig), b in TRANSITIONS.items():
                if a is s and trig in by_time and b not in seen:
                    seen.add(b)
                    frontier.append(b)
        assert State.UNWATCHED in seen, start


# ----------------------------------------------------------------------------- the drive


def started(at: float) -> ProcessStart:
    """A start as Envoy reports it: within a one-second window."""
    return ProcessStart(at - 0.5, at + 0.5)


_Ts = TypeVarTuple("_Ts")


class VirtualLoop(asyncio.SelectorEventLoop):
    """An event loop whose time is the test's clock: a timer fires once the clock has
    reached it, and :meth:`next_timer` says when the next one is due."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__()
        self.clock = clock
        self._timers: list[asyncio.TimerHandle] = []

    def time(self) -> float:
        return self.clock()

    def call_at(self, when: float, callback: Callable[[Unpack[_Ts]], object],
                *args: *_Ts, context: Context | None = None) -> asyncio.TimerHandle:
        cell: list[asyncio.TimerHandle] = []

        def fire() -> None:
            self._timers = [h for h in self._timers if h is not cell[0]]
            callback(*args)

        handle = super().call_at(when, fire, context=context)
        cell.append(handle)
        self._timers.append(handle)
        return handle

    def _live(self) -> list[asyncio.TimerHandle]:
        self._timers = [h for h in self._timers if not h.cancelled()]
        return self._timers

    def next_timer(self) -> float | None:
        return min((h.when() for h in self._live()), default=None)

    def timers_due(self) -> bool:
        return any(h.when() <= self.clock() for h in self._live())


@dataclass(eq=False)
class Question:
    asked: float
    fut: asyncio.Future[ProcessStart | None]
    answered: bool = False
    over: bool = False  # its asker has taken the answer (or was cancelled)


class Admin:
    """The pod's Envoy admin: each question is answered with the start of the process
    running at the moment of the answer (None: none runs), when the test says so, or
    ADMIN_BOUND after it was asked at the latest."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.questions: list[Question] = []

    async def __call__(self) -> ProcessStart | None:
        q = Question(self.world.clock(), asyncio.get_running_loop().create_future())
        self.questions.append(q)
        try:
            return await q.fut
        finally:
            q.over = True  # the asker applies the answer before anything else runs

    def answer(self, everything: bool) -> None:
        now = self.world.clock()
        p = self.world.owners[LOCAL].proc
        start = started(p.started) if p is not None and p.alive else None
        for q in self.questions:
            if not q.fut.done() and (everything or q.asked + ADMIN_BOUND <= now):
                q.fut.set_result(start)
                q.answered = True

    def next_due(self) -> float | None:
        return min((q.asked + ADMIN_BOUND for q in self.questions if not q.fut.done()),
                   default=None)


@dataclass(eq=False)
class Proc:
    """One Envoy process at an owner's address."""

    owner: str
    started: float
    alive: bool = True
    died: float | None = None
    streams: int = 0  # its open access-log streams


@dataclass(eq=False)
class Adm:
    aid: str
    proc: Proc
    admitted: float
    acked: float | None = None  # its last sign from Envoy
    acked_unwatched: bool = False  # that sign came while its owner had no stream open
    protected: bool = False  # acknowledged while its owner had a stream open, none closed since
    completed: bool = False  # its final entry came


@dataclass
class OwnerModel:
    proc: Proc | None = None  # the process running there now (or the last one)
    lost_since: float | None = None  # its last stream closed then, and none opened since
    lost_proc: Proc | None = None  # the process whose streams those were
    procs: list[Proc] = field(default_factory=list)


class Releases(NullRecorder):
    def __init__(self, on_release: Callable[[str, ReleaseReason], None]) -> None:
        self.count: Counter[str] = Counter()
        self._on_release = on_release

    def on_events(self, events: Iterable[Event]) -> None:
        for e in events:
            if isinstance(e, Released):
                self.count[e.admission.id] += 1
                self._on_release(e.admission.id, e.reason)


class World:
    def __init__(self, clock: FakeClock, loop: VirtualLoop) -> None:
        self.clock = clock
        self.loop = loop
        self.violations: list[str] = []
        self.releases = Releases(self._released)
        ids = (f"id{i}" for i in itertools.count())
        self.ctl = AdmissionController(Scheduler(CFG, 1024, clock), lease_secs=LEASE,
                                       clock=clock, id_factory=lambda: next(ids),
                                       metrics=self.releases)
        self.admin = Admin(self)
        self.lv = EnvoyLiveness(self.ctl, grace=GRACE, clock=clock, start_of=self.admin,
                                identifiable=local_owners("http://127.0.0.1:9901"))
        self.owners = {o: OwnerModel() for o in OWNERS}
        self.adms: dict[str, Adm] = {}

    # ------------------------------------------------------------------ ground truth

    def _released(self, aid: str, reason: ReleaseReason) -> None:
        a = self.adms.get(aid)
        if self.releases.count[aid] > 1:
            self.violations.append(f"{aid} released twice (now {reason.value})")
        if a is not None and a.protected and reason is ReleaseReason.LEASE_EXPIRED:
            self.violations.append(
                f"{aid} released by a timer at {self.clock():.2f} while its owner "
                f"{a.proc.owner} kept a stream open since acknowledging it at {a.acked}")

    def _alive(self, owner: str) -> Proc | None:
        p = self.owners[owner].proc
        return p if p is not None and p.alive else None

    def _peer(self, owner: str) -> str:
        return f"ipv4:{owner}:40001"

    def _pick(self, k: int, cond: Callable[[Adm], bool]) -> Adm | None:
        live = [a for a in self.adms.values() if cond(a)]
        return live[k % len(live)] if live else None

    # ------------------------------------------------------------------ what Envoy does

    def start(self, owner: str) -> None:
        if self._alive(owner) is None:
            m = self.owners[owner]
            m.proc = Proc(owner, self.clock())
            m.procs.append(m.proc)

    def _close(self, owner: str, n: int) -> None:
        p = self.owners[owner].proc
        assert p is not None
        for _ in range(n):
            self.lv.stream_closed(owner)
            p.streams -= 1
        if n and p.streams == 0:
            m = self.owners[owner]
            m.lost_since, m.lost_proc = self.clock(), p
            for a in self.adms.values():  # a gap: no longer vouched for by an open stream
                if a.proc.owner == owner:
                    a.protected = False

    def kill(self, owner: str) -> None:
        p = self._alive(owner)
        if p is not None:
            self._close(owner, p.streams)  # a killed process's sockets close
            p.alive, p.died = False, self.clock()

    def blip(self, owner: str) -> None:
        p = self._alive(owner)
        if p is not None:
            self._close(owner, p.streams)

    def close(self, owner: str) -> None:
        p = self._alive(owner)
        if p is not None and p.streams:
            self._close(owner, 1)

    def open(self, owner: str) -> None:
        p = self._alive(owner)
        if p is not None:
            assert self.lv.stream_opened(self._peer(owner)) == owner
            p.streams += 1
            self.owners[owner].lost_since = None

    async def admit(self, owner: str) -> None:
        p = self._alive(owner)
        if p is not None:
            aid = (await self.ctl.admit(D, "t")).admission.id
            self.lv.admitted(aid, self._peer(owner))
            self.adms[aid] = Adm(aid, p, self.clock())

    def _signed(self, a: Adm) -> None:
        watched = a.proc.streams > 0
        a.acked, a.acked_unwatched = self.clock(), not watched
        a.protected = a.protected or watched

    def ack(self, k: int) -> None:
        """Its ext_proc stream opened (a request the sidecar still holds)."""
        a = self._pick(k, lambda a: a.proc.alive and not a.completed
                       and self.ctl.holds(a.aid))
        if a is not None:
            self.lv.acknowledged(a.aid)
            self._signed(a)

    def periodic(self, k: int) -> None:
        """A periodic entry names it, in the access-log service's order (an entry opens a
        stream first when none is: Envoy opens it lazily)."""
        a = self._pick(k, lambda a: a.proc.alive and not a.completed
                       and self.ctl.holds(a.aid))
        if a is None:
            return
        owner = a.proc.owner
        if a.proc.streams == 0:
            self.open(owner)
        self.lv.periodic_entry(owner)
        assert self.ctl.renew_or_adopt(a.aid)
        self.lv.acknowledged(a.aid, self._peer(owner))
        self._signed(a)

    def end(self, k: int) -> None:
        """Its final entry (on a stream, opened for it if none is)."""
        a = self._pick(k, lambda a: a.proc.alive and not a.completed)
        if a is None:
            return
        if a.proc.streams == 0:
            self.open(a.proc.owner)
        self.ctl.release(a.aid, ReleaseReason.COMPLETED)
        self.lv.ended(a.aid)
        a.completed = True

    # ------------------------------------------------------------------ time

    async def settle(self) -> None:
        """Let every timer due by now fire, every question asked reach the admin, and
        every answer given be applied."""
        for _ in range(10_000):
            self.admin.questions = [q for q in self.admin.questions if not q.over]
            asking = sum(1 for t in self.lv._asks if not t.done())
            if (not self.loop.timers_due() and asking == len(self.admin.questions)
                    and not any(q.answered for q in self.admin.questions)):
                return
            await asyncio.sleep(0)  # one turn of the loop: the condition is checked again
        raise AssertionError("timers, questions or answers not settled")

    async def wait(self, dt: float) -> None:
        """Move the clock on by ``dt``, stopping at every timer and admin deadline."""
        target = self.clock() + dt
        while True:
            steps = [t for t in (self.loop.next_timer(), self.admin.next_due())
                     if t is not None and self.clock() < t <= target]
            self.clock.now = min(steps, default=target)
            self.admin.answer(everything=False)
            await self.settle()
            self.check()
            if self.clock() >= target:
                return

    # ------------------------------------------------------------------ the checks

    def check(self) -> None:
        now, table = self.clock(), self.lv.table
        for owner in OWNERS:
            p = self._alive(owner)
            streams = p.streams if p is not None else 0
            state = table.state(owner)
            assert table.alive(owner) is (streams > 0) is (state in OPEN), \
                (owner, state, streams)
            if owner == REMOTE:
                assert state in (State.UNWATCHED, State.ALIVE, State.LOST), state
        assert table.open_streams == sum(p.streams for m in self.owners.values()
                                         for p in m.procs if p.alive)
        assert table.alive_owners == sum(1 for o in OWNERS if table.alive(o))
        for key, o in table._owners.items():
            assert fits(o.state, o.phase), (key, o.state, o.phase)
            # Held without a lease only with a way out: its owner's death releases it
            # (lost: asked for and shown before the loss), or the owner vouches for it.
            for aid in o.ids:
                if not self.ctl.unleased(aid):
                    continue
                t = table._ids[aid]
                assert o.state is not State.UNWATCHED, f"{aid}: no lease, owner unwatched"
                if o.state in (State.LOST, State.ASKING):
                    assert isinstance(o.phase, Loss)
                    at = o.phase.at
                    assert t.admitted_at <= at and (t.acked_at is None or t.acked_at <= at), \
                        f"{aid}: no lease, shown at {t.acked_at} after its owner's loss at {at}"
        assert not self.violations, self.violations
        # A lost owner: what it asked for before the loss and has not shown since goes
        # within the grace (identified: once its process is dead, + the admin's bound).
        for owner, m in self.owners.items():
            if m.lost_since is None or m.lost_proc is None:
                continue
            if owner == LOCAL:
                if m.lost_proc.alive:
                    continue  # a blip: its admin keeps what it runs
                assert m.lost_proc.died is not None
                due = max(m.lost_since, m.lost_proc.died) + GRACE + ADMIN_BOUND
            else:
                due = m.lost_since + GRACE
            if now < due:
                continue
            for a in self.adms.values():
                if (a.proc.owner == owner and not a.completed
                        and a.admitted <= m.lost_since
                        and (a.acked is None or a.acked <= m.lost_since)):
                    assert not self.ctl.holds(a.aid), (
                        f"{a.aid} of {owner}, lost at {m.lost_since}, still held at {now}")
        # A dead process: what it ran, last shown while its owner was watched (or never
        # shown), goes within grace + admin bound + lease of its death.
        for a in self.adms.values():
            died = a.proc.died
            if (died is not None and not a.completed and not a.acked_unwatched
                    and now >= died + GRACE + ADMIN_BOUND + LEASE):
                assert not self.ctl.holds(a.aid), (
                    f"{a.aid} of a process dead at {died} still held at {now}")

    def check_all_gone(self) -> None:
        """Every process dead and the bound passed: everything released exactly once."""
        for a in self.adms.values():
            assert not self.ctl.holds(a.aid), f"{a.aid} still held"
            assert self.releases.count[a.aid] == 1, (a.aid, self.releases.count[a.aid])
        assert self.ctl.lease_count == 0
        self.lv.table.prune(self.ctl.holds)
        assert len(self.lv.table) == 0 and not self.lv.table._owners

    # ------------------------------------------------------------------ a scenario

    async def play(self, ops: Sequence[tuple[str, Any]]) -> None:
        for op, arg in ops:
            if op == "wait":
                await self.wait(float(arg))
                continue
            if op == "answer":
                self.admin.answer(everything=True)
            elif op == "admit":
                await self.admit(str(arg))
            else:
                getattr(self, op)(arg)
            await self.settle()
            self.check()
        for owner in OWNERS:
            self.kill(owner)
        await self.settle()
        # Everything by the latest of: a check a grace after the death, its answer, and
        # the lease of what went back under one at a reopen or was never shown.
        await self.wait(max(GRACE + ADMIN_BOUND, LEASE))
        self.check_all_gone()


def play(ops: Sequence[tuple[str, Any]]) -> World:
    clock = FakeClock()
    loop = VirtualLoop(clock)

    async def main() -> World:
        world = World(clock, loop)
        try:
            await world.play(ops)
        finally:
            world.lv.close()
            world.ctl.close()
        return world

    with asyncio.Runner(loop_factory=lambda: loop) as runner:
        return runner.run(main())


WAITS = st.one_of(st.sampled_from([0.05, 0.5, 1.0, GRACE, 3.0, GRACE + ADMIN_BOUND, LEASE]),
                  st.floats(0.0, 12.0))
# Weighted so that a scenario lives: processes start, stream and admit more often than
# they die, and a list is long enough for several lives at both owners.
OPS = st.lists(st.one_of(
    st.tuples(st.sampled_from(["start", "start", "open", "open", "close", "blip", "kill",
                               "admit", "admit"]), st.sampled_from(OWNERS)),
    st.tuples(st.sampled_from(["ack", "ack", "periodic", "end"]), st.integers(0, 63)),
    st.tuples(st.just("answer"), st.just(0)),
    st.tuples(st.just("wait"), WAITS),
), min_size=20, max_size=100)

R, L = REMOTE, LOCAL
# A process of the pod's Envoy that started a second before its first stream (so a loss
# from then on is surely after its start), with one admission it acknowledged.
LOCAL_ACKED = [("start", L), ("wait", 1.0), ("open", L), ("answer", 0), ("admit", L),
               ("ack", 0)]
ACKED_THEN_KILLED = [("start", R), ("open", R), ("admit", R), ("ack", 0), ("kill", R)]
LOCAL_BLIP_THEN_DEATH = [*LOCAL_ACKED, ("blip", L), ("wait", GRACE), ("answer", 0),
                         ("admit", L), ("ack", 1), ("wait", LEASE), ("kill", L),
                         ("wait", GRACE + ADMIN_BOUND)]
REPLACED_WITHIN_THE_GRACE = [("start", R), ("open", R), ("admit", R), ("ack", 0), ("kill", R),
                             ("start", R), ("open", R), ("wait", GRACE + ADMIN_BOUND + LEASE)]

# Scenarios that, between them, take every arrow of the table (checked below); each is
# also an explicit example of the random test, so every run checks them all.
COVERING: list[list[tuple[str, Any]]] = [
    # Time only: a second stream, one closing, a periodic entry, a gap, a death.
    [("start", R), ("open", R), ("admit", R), ("ack", 0), ("open", R), ("close", R),
     ("periodic", 0), ("close", R), ("wait", 0.5), ("open", R), ("close", R),
     ("wait", GRACE)],
    # Identified: the same while its admin is asked at its first stream; a gap.
    [("start", L), ("wait", 1.0), ("open", L), ("open", L), ("close", L), ("admit", L),
     ("periodic", 0), ("close", L), ("open", L), ("answer", 0)],
    # A stream opens while the admin is asked about the loss; later a death, no answer.
    [*LOCAL_ACKED, ("blip", L), ("wait", GRACE), ("open", L), ("answer", 0), ("kill", L)],
    # A confirmed blip, then its process reopens (unleased again: the same process).
    [*LOCAL_ACKED, ("blip", L), ("wait", GRACE), ("answer", 0), ("wait", 1.0),
     ("open", L), ("answer", 0), ("wait", LEASE)],
    # A blip confirmed twice, then a stream opens while the admin is asked again.
    [*LOCAL_ACKED, ("blip", L), ("wait", GRACE), ("answer", 0), ("wait", GRACE),
     ("answer", 0), ("wait", GRACE), ("open", L), ("answer", 0)],
    # A confirmed blip, then the process dies: no answer, dead.
    [*LOCAL_ACKED, ("blip", L), ("wait", GRACE), ("answer", 0), ("kill", L),
     ("wait", GRACE), ("answer", 0)],
    # A confirmed blip, then a restart: the check finds the new process.
    [*LOCAL_ACKED, ("blip", L), ("wait", GRACE), ("answer", 0), ("kill", L), ("wait", 1.0),
     ("start", L), ("wait", GRACE), ("answer", 0)],
    # A restart found by the loss's first check.
    [*LOCAL_ACKED, ("kill", L), ("wait", 1.0), ("start", L), ("admit", L), ("wait", 1.0),
     ("answer", 0), ("wait", LEASE)],
    # A restart found by the successor's first stream: the predecessor's slots released.
    [("start", L), ("admit", L), ("ack", 0), ("wait", 1.0), ("kill", L), ("wait", 1.0),
     ("start", L), ("wait", 1.0), ("open", L), ("answer", 0)],
]
# Found by this drive (both leaked a slot for good before): a second sign, while lost, of
# an admission held without a lease; a successor's admission acknowledged during its
# predecessor's confirmed blip, then the check finds the restart and it never streams.
FOUND = [
    [("start", R), ("admit", R), ("periodic", 0), ("close", R), ("wait", 0.05), ("ack", 0)],
    [*LOCAL_ACKED, ("blip", L), ("wait", GRACE), ("answer", 0), ("kill", L), ("wait", 1.0),
     ("start", L), ("admit", L), ("ack", 1), ("wait", GRACE), ("answer", 0)],
]


def _with_examples(test: Callable[..., None]) -> Callable[..., None]:
    for ops in reversed([*COVERING, *FOUND, [*ACKED_THEN_KILLED, ("wait", GRACE)],
                         LOCAL_BLIP_THEN_DEATH, REPLACED_WITHIN_THE_GRACE]):
        test = example(ops)(test)
    return test


def test_the_covering_scenarios_take_every_arrow_of_the_table(
        monkeypatch: pytest.MonkeyPatch) -> None:
    taken: set[tuple[State, Trigger]] = set()
    real = liveness_module.next_state

    def recording(state: State, trigger: Trigger) -> State:
        taken.add((state, trigger))
        return real(state, trigger)

    monkeypatch.setattr(liveness_module, "next_state", recording)
    for ops in COVERING:
        play(ops)
    assert set(TRANSITIONS) - taken == set()


@settings(max_examples=500, deadline=None)
@given(OPS)
@_with_examples
def test_random_triggers_keep_the_invariants_and_release_every_dead_owners_slots(
        ops: list[tuple[str, Any]]) -> None:
    play(ops)


# ---------------------------------------------------------- the drive catches broken rules


def _broken(monkeypatch: pytest.MonkeyPatch, rule: str) -> None:
    if rule == "acknowledged while lost needs no lease":
        monkeypatch.setattr(liveness_module, "VOUCHED",
                            liveness_module.VOUCHED | {State.LOST})
    elif rule == "a death releases nothing":
        monkeypatch.setattr(OwnerTable, "_is_before", staticmethod(lambda t, lost_at: False))
    elif rule == "a lost identified owner's admin answer is dropped":
        monkeypatch.setattr(OwnerTable, "checked",
                            lambda self, owner, ask, start, now: Checked(STALE, []))
    elif rule == "an acknowledgement never unleases":
        monkeypatch.setattr(liveness_module, "VOUCHED", frozenset())
    elif rule == "a gap puts nothing back under the lease":
        monkeypatch.setattr(AdmissionController, "lease_again", lambda self, aid: False)
    else:
        raise AssertionError(rule)


@pytest.mark.parametrize(("rule", "ops"), [
    ("acknowledged while lost needs no lease",
     [("start", REMOTE), ("open", REMOTE), ("admit", REMOTE), ("close", REMOTE),
      ("wait", 0.5), ("ack", 0), ("wait", GRACE)]),
    ("a death releases nothing", [*ACKED_THEN_KILLED, ("wait", GRACE)]),
    ("a lost identified owner's admin answer is dropped", LOCAL_BLIP_THEN_DEATH),
    ("an acknowledgement never unleases",
     [("start", REMOTE), ("open", REMOTE), ("admit", REMOTE), ("ack", 0), ("wait", LEASE)]),
    ("a gap puts nothing back under the lease", REPLACED_WITHIN_THE_GRACE),
])
def test_the_drive_fails_on_a_broken_rule(monkeypatch: pytest.MonkeyPatch, rule: str,
                                          ops: list[tuple[str, Any]]) -> None:
    play(ops)  # the shipped rules pass this very scenario
    _broken(monkeypatch, rule)
    with pytest.raises(AssertionError):
        play(ops)
