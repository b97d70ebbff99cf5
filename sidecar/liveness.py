"""Which Envoy runs each admission, and whether that Envoy is still there.

A slot held by a request Envoy still runs must never be reclaimed by a timer alone.
Envoy sends no heartbeat, but it keeps its gRPC access-log (ALS) stream open while idle
(measured, envoy/NOTES.md): opened lazily at a worker thread's first entry, closed only
when the connection or the process goes. So:

* **Owner.** Each admission records the Envoy that asked: the peer host (IP, no port) of
  its Check call. Envoy reaches the sidecar over several connections (per worker thread,
  and per cluster where ext_authz, ext_proc and the ALS use different ones), so the port
  names a connection, not an Envoy; the host is what all of
  one Envoy's connections share, and what meshes give without any configuration (a
  sidecar per pod sees loopback, a shared authz service sees each Envoy's pod IP). Two
  Envoys behind one IP count as one owner (see :class:`OwnerTable`).
* **Alive.** An owner is *watched* once one of its ALS streams opened, and *alive* while at
  least one is open. When its last stream closes it is *lost*; still lost ``grace`` seconds
  later it is *dead*: every admission it asked for before it was lost is released. Envoy
  killed (even SIGKILL) closes its sockets, so that is prompt; a host that vanished
  without a FIN is bounded by the gRPC server keepalive (``sidecar.authz``).
* **Acknowledged.** An admission Envoy showed it runs (its ext_proc stream opened, a
  periodic entry named it) while its owner is alive needs no per-request timer: it ends
  by its final access-log entry, a preemption, or its owner's death. The lease keeps only
  "Check answered, no sign from Envoy yet" and an owner never watched (no ALS stream
  ever: today's behaviour).
* **A gap.** An owner that comes back within the grace (its last stream closed, then one
  opened again) may be a new Envoy process behind the same IP, or the same one after a
  connection blip: the admissions acknowledged before the gap go back under the lease
  (periodic entries, if any, keep them), so a restart does not leak them. Envoy reopens a
  closed ALS stream only at its next entry, so a blip followed by no request ending
  within the grace reads as a death (docs/design.md, "Leases and Envoy liveness").
* **Which process.** Those two limits go for the pod's own Envoy when its admin is known
  (``--envoy-admin-url``; a loopback, ``unix`` or admin-host owner): its process start
  (``/server_info``) says whether a lost owner is the same process (a blip: nothing
  released, asked again every grace) or a new one (what was admitted before its start is
  released), and at a first stream or a reopen which admissions are a dead predecessor's
  (released) and which are this process's (no lease). Owners without an admin keep the
  time-only rules.

The owner's state
=================

Each owner is in exactly one :class:`State`; a :class:`Trigger` moves it by
:data:`TRANSITIONS`, and every pair not listed raises :class:`IllegalTransition` (a driver
bug: a stream closed that never opened, a periodic entry with no stream). *Identified*
owners are those whose Envoy's admin can be asked (``identifiable``); the others are
decided on time alone and only ever are UNWATCHED, ALIVE or LOST. An owner the table does
not keep (never seen, or forgotten with nothing left to track) is UNWATCHED. "Ack" says
what an acknowledgement does there: the lease stays, or it is held without one.

===========  =====  ===============================  =======================================
state        ack    carries                          leaves by: trigger → next state
===========  =====  ===============================  =======================================
UNWATCHED    lease  nothing                          ``opened`` → ALIVE; ``opened_ask``
                                                     (identified) → IDENTIFYING
ALIVE        none   :class:`Open`: streams (≥ 1),    ``opened_more``, ``closed_more``,
                    its last periodic entry          ``periodic`` → ALIVE; ``closed_last``
                                                     → LOST
IDENTIFYING  none   :class:`Open` with the question  ``opened_more``, ``closed_more``,
                    asked at its first stream, and   ``periodic`` → IDENTIFYING;
                    whether the loss it ended was    ``identified`` (the answer, or none)
                    a confirmed blip                 → ALIVE; ``closed_last`` → LOST (the
                                                     answer will be stale)
LOST         lease  :class:`Loss`: since when, and   ``opened`` → ALIVE; ``opened_ask`` →
                    the grace's end                  IDENTIFYING; ``grace_passed`` (time
                                                     only) → UNWATCHED [dead]; ``check_due``
                                                     (identified) → ASKING
ASKING       lease  :class:`Loss` with the question  ``opened_ask`` → IDENTIFYING;
                    to its admin                     ``checked_blip`` → BLIP;
                                                     ``checked_restarted`` → UNWATCHED
                                                     [restarted]; ``checked_dead`` →
                                                     UNWATCHED [dead]
BLIP         none   :class:`Loss`: since when, and   ``opened_ask`` → IDENTIFYING;
                    the next check                   ``check_due`` → BLIP_ASKING
BLIP_ASKING  none   :class:`Loss` with the question  ``opened_ask`` → IDENTIFYING;
                    to its admin                     ``checked_blip`` → BLIP;
                                                     ``checked_restarted`` → UNWATCHED
                                                     [restarted]; ``checked_dead`` →
                                                     UNWATCHED [dead, and what was
                                                     acknowledged since the blip]
===========  =====  ===============================  =======================================

What moves with them: [dead] releases every admission the owner asked for before the loss
and Envoy has not shown since; [restarted], every one asked for before the new process
started. The first stream after none (``opened``, ``opened_ask``) puts what was
acknowledged before the loss back under the lease (a relapse) and takes the lease off
what was acknowledged since, or ever, from UNWATCHED; ``identified`` releases what was
asked for before the running process started and takes the lease off a relapsed one
asked for after it (not when that process sends periodic entries: their next one does).
An acknowledgement where "ack" says lease puts even one held without a lease back under
it (a sign after the loss spares it the loss's release), and UNWATCHED holds nothing
without a lease (entering it, what is left goes back under one): so an admission held
without a lease always has a way out, its owner's death.
An admin's answer counts only while its owner's state still waits for that question (its
token): any other answer is stale and changes nothing.

:class:`OwnerTable` is the pure part: the caller passes the time in and releases what
its methods return; unleasing and relapsing go straight to the lease home it is given
(the admission service's lease table, the one place that keeps them).
:class:`EnvoyLiveness` wires it to the admission service, the gRPC hooks and a timer.
"""

from __future__ import annotations

import asyncio
import enum
import ipaddress
import itertools
import json
import math
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Protocol
from urllib.parse import unquote, urlsplit

import aiohttp

from sidecar import logs
from sidecar.health import PROBE_ERRORS, http_get
from sidecar.metrics import NullRecorder, Recorder
from sidecar.scheduler import LEASE_EXPIRED, ReleaseResult

if TYPE_CHECKING:
    from sidecar.admission import AdmissionsById

log = logs.get("sidecar.liveness")

UNIX_OWNER = "unix"
# The table forgets ended admissions it was not told about (a preemption, a lease
# expiry) once it holds this many more than are in flight.
PRUNE_SLACK = 1024


# GET /server_info: ~120 KiB measured (Envoy 1.40 lists every extension in its node);
# a mesh adds node metadata.
SERVER_INFO_LIMIT = 4 << 20
ADMIN_TIMEOUT_SECS = 1.0  # per attempt
ADMIN_ATTEMPTS = 3  # a timeout or error status is asked again; a refused connection is not
ADMIN_RETRY_SECS = 0.25
StartSource = Callable[[], Awaitable["ProcessStart | None"]]


def owner_of(peer: str) -> str:
    """The owner key of a gRPC peer string: its host, without the port.

    ``ipv4:10.0.0.7:41234`` → ``10.0.0.7``; ``ipv6:[::1]:41234`` (or ``%5B::1%5D``) → ``::1``;
    any ``unix:`` peer → ``unix`` (one host: the sidecar's socket is only reachable locally).
    """
    scheme, _, rest = peer.partition(":")
    if scheme == "unix" or scheme == "unix-abstract":
        return UNIX_OWNER
    if scheme not in ("ipv4", "ipv6"):
        return peer
    host = unquote(rest).rpartition(":")[0] or unquote(rest)
    return host.strip("[]")


class State(enum.StrEnum):
    """Where one owner is (see the module table)."""

    UNWATCHED = "unwatched"
    ALIVE = "alive"
    IDENTIFYING = "identifying"
    LOST = "lost"
    ASKING = "asking"
    BLIP = "blip"
    BLIP_ASKING = "blip_asking"


class Trigger(enum.StrEnum):
    """What happened, as far as an owner's state is concerned."""

    OPENED = "opened"  # its first stream after none (decided on time alone)
    OPENED_ASK = "opened_ask"  # the same, for an identified owner: its admin is asked
    OPENED_MORE = "opened_more"  # another stream, one already open
    CLOSED_MORE = "closed_more"  # a stream closed, another still open
    CLOSED_LAST = "closed_last"  # its last open stream closed
    PERIODIC = "periodic"  # a periodic access-log entry on one of its streams
    GRACE_PASSED = "grace_passed"  # lost for the grace, decided on time alone: dead
    CHECK_DUE = "check_due"  # identified, lost for the grace (or a grace since a blip)
    IDENTIFIED = "identified"  # its admin answered the question of its first stream
    CHECKED_BLIP = "checked_blip"  # its admin: the process that was lost still runs
    CHECKED_RESTARTED = "checked_restarted"  # its admin: a new process started after it
    CHECKED_DEAD = "checked_dead"  # no answer, or one that cannot tell: dead


S, T = State, Trigger
TRANSITIONS: Mapping[tuple[State, Trigger], State] = {
    (S.UNWATCHED, T.OPENED): S.ALIVE,
    (S.UNWATCHED, T.OPENED_ASK): S.IDENTIFYING,
    (S.ALIVE, T.OPENED_MORE): S.ALIVE,
    (S.ALIVE, T.CLOSED_MORE): S.ALIVE,
    (S.ALIVE, T.PERIODIC): S.ALIVE,
    (S.ALIVE, T.CLOSED_LAST): S.LOST,
    (S.IDENTIFYING, T.OPENED_MORE): S.IDENTIFYING,
    (S.IDENTIFYING, T.CLOSED_MORE): S.IDENTIFYING,
    (S.IDENTIFYING, T.PERIODIC): S.IDENTIFYING,
    (S.IDENTIFYING, T.IDENTIFIED): S.ALIVE,
    (S.IDENTIFYING, T.CLOSED_LAST): S.LOST,
    (S.LOST, T.OPENED): S.ALIVE,
    (S.LOST, T.OPENED_ASK): S.IDENTIFYING,
    (S.LOST, T.GRACE_PASSED): S.UNWATCHED,
    (S.LOST, T.CHECK_DUE): S.ASKING,
    (S.ASKING, T.OPENED_ASK): S.IDENTIFYING,
    (S.ASKING, T.CHECKED_BLIP): S.BLIP,
    (S.ASKING, T.CHECKED_RESTARTED): S.UNWATCHED,
    (S.ASKING, T.CHECKED_DEAD): S.UNWATCHED,
    (S.BLIP, T.OPENED_ASK): S.IDENTIFYING,
    (S.BLIP, T.CHECK_DUE): S.BLIP_ASKING,
    (S.BLIP_ASKING, T.OPENED_ASK): S.IDENTIFYING,
    (S.BLIP_ASKING, T.CHECKED_BLIP): S.BLIP,
    (S.BLIP_ASKING, T.CHECKED_RESTARTED): S.UNWATCHED,
    (S.BLIP_ASKING, T.CHECKED_DEAD): S.UNWATCHED,
}
"""(state, trigger) → next state; a pair not listed is illegal."""
del S, T

# A stream is open exactly in these (alive).
OPEN = frozenset({State.ALIVE, State.IDENTIFYING})
# An acknowledgement needs no lease in these: its owner is alive, or its admin said the
# same process runs.
VOUCHED = frozenset({State.ALIVE, State.IDENTIFYING, State.BLIP, State.BLIP_ASKING})
# Its admin's answer is awaited in these (the question's token is the state's ``ask``).
ASKED = frozenset({State.IDENTIFYING, State.ASKING, State.BLIP_ASKING})


class IllegalTransition(RuntimeError):
    """A trigger the table does not allow in an owner's state: a driver bug."""

    def __init__(self, state: State, trigger: Trigger) -> None:
        super().__init__(f"{trigger.value} is not allowed in state {state.value}")
        self.state = state
        self.trigger = trigger


def next_state(state: State, trigger: Trigger) -> State:
    """The table, as a function: the next state, or :class:`IllegalTransition`."""
    try:
        return TRANSITIONS[state, trigger]
    except KeyError:
        raise IllegalTransition(state, trigger) from None


@dataclass(frozen=True, slots=True)
class Open:
    """ALIVE, IDENTIFYING: ``streams`` (≥ 1) are open."""

    streams: int
    periodic_at: float | None
    """This process's last periodic access-log entry (None: none seen). Such entries
    acknowledge its requests, so an allow may let it skip ext_proc (sidecar.authz), and
    after a blip its earlier admissions can wait for their next one under the lease."""
    ask: int | None = None
    """IDENTIFYING: the token of the question asked at its first stream."""
    after_blip: bool = False
    """IDENTIFYING: the loss this stream ended was a confirmed blip (counted already)."""


@dataclass(frozen=True, slots=True)
class Loss:
    """LOST, ASKING, BLIP, BLIP_ASKING: its last stream closed at ``at``."""

    at: float
    periodic_at: float | None  # as :attr:`Open.periodic_at`: the same process, maybe
    due: float | None = None
    """LOST, BLIP: when the grace passes (dead, or its admin is asked)."""
    ask: int | None = None
    """ASKING, BLIP_ASKING: the token of the pending question."""


Phase = Open | Loss | None


def fits(state: State, phase: Phase) -> bool:
    """``phase`` is the data ``state`` carries, and nothing else (UNWATCHED: none)."""
    if state is State.UNWATCHED:
        return phase is None
    if state in OPEN:
        return (isinstance(phase, Open) and phase.streams >= 1
                and (phase.ask is not None) == (state is State.IDENTIFYING)
                and (state is State.IDENTIFYING or not phase.after_blip))
    return (isinstance(phase, Loss) and (phase.ask is not None) == (state in ASKED)
            and (phase.due is not None) == (state in (State.LOST, State.BLIP)))


@dataclass(slots=True)
class _Owner:
    state: State = State.UNWATCHED
    phase: Phase = None
    ids: dict[str, None] = field(default_factory=dict)  # insertion-ordered set


@dataclass(slots=True)
class _Tracked:
    owner: str
    admitted_at: float
    acked_at: float | None = None  # last time Envoy showed it runs it
    relapsed: bool = False  # held without a lease, then back under it at a gap


class LeaseHome(Protocol):
    """Where "held without a lease" is kept: the admission service's lease table. The
    owner table asks it and tells it, and keeps no copy."""

    def unleased(self, aid: str) -> bool: ...
    def hold_without_lease(self, aid: str) -> bool: ...
    def lease_again(self, aid: str) -> bool: ...


@dataclass(frozen=True, slots=True)
class ProcessStart:
    """When the Envoy process answering an owner's admin started, on the table's clock.

    Envoy reports its uptime in whole seconds, so the start lies in
    ``[earliest, latest]`` (about a second wide); times within that window, give or take
    :data:`START_MARGIN`, cannot be told before or after it.
    """

    earliest: float
    latest: float

    def before(self, t: float) -> bool:
        """``t`` was surely before this process started."""
        return t < self.earliest - START_MARGIN

    def after(self, t: float) -> bool:
        """``t`` was surely after this process started."""
        return t > self.latest + START_MARGIN


@dataclass(frozen=True, slots=True)
class Reopened:
    """What an owner's stream opening did to the lease home (for logs), and asks of the
    caller."""

    unlease: list[str]
    """Acknowledged while the owner was not alive: the owner is alive now, lease dropped."""
    relapse: list[str]
    """Acknowledged before a gap: back under the lease (a new process may have replaced it)."""
    ask: int | None = None
    """An identified owner's first stream after none: ask its admin when its process
    started and pass this back to :meth:`OwnerTable.identified` with the answer."""


@dataclass(frozen=True, slots=True)
class Identified:
    """What an admin's answer at an owner's (re)opening asks of the caller (release), and
    did to the lease home (unlease)."""

    release: list[str]
    """Admitted before the current process started: its predecessor's, and it is dead."""
    unlease: list[str]
    """Put back under the lease at the gap, but this process's: no lease again."""
    blip_counted: bool = False
    """The loss this reopening ended was already counted as a blip."""


@dataclass(frozen=True, slots=True)
class Checked:
    """The verdict on a lost, identified owner once its admin answered (or did not)."""

    verdict: str
    """``blip`` (the same process lives), ``restarted`` (a new one started after the loss),
    ``dead`` (no answer, or no telling), ``stale`` (a stream opened or closed meanwhile)."""
    release: list[str]
    first_blip: bool = False
    """The first ``blip`` verdict of this loss (count and log it once)."""


BLIP, RESTARTED, DEAD, STALE = "blip", "restarted", "dead", "stale"
# Slack on top of the uptime's one-second resolution when comparing a time with a process
# start: the two clock readings that convert Envoy's wall-clock start to the monotonic clock.
START_MARGIN = 0.1


class OwnerTable:
    """Owners (by peer host), each one state of :data:`TRANSITIONS`, with the admissions
    they asked for.

    ``identifiable(owner)``: the caller can ask that owner's Envoy when its process started
    (its admin API: a loopback owner, the pod's own Envoy). For those owners a loss past the
    grace and a first stream after none are decided on the process's start
    (:meth:`due_checks`, :meth:`checked`, :meth:`identified`); for the others, on time alone.
    ``leases``: the admission service, which alone keeps whether an admission is held
    without a lease; the table unleases and relapses through it as it decides.
    """

    def __init__(self, grace: float,
                 identifiable: Callable[[str], bool] = lambda owner: False, *,
                 leases: LeaseHome) -> None:
        self.grace = grace
        self.identifiable = identifiable
        self.leases = leases
        # One sequence for every question to every owner: an answer matches only the
        # question its owner's state still waits for.
        self._tokens = itertools.count(1)
        self._owners: dict[str, _Owner] = {}
        self._ids: dict[str, _Tracked] = {}

    def _move(self, o: _Owner, trigger: Trigger, phase: Phase) -> State:
        new = next_state(o.state, trigger)
        assert fits(new, phase), (new, phase)
        o.state, o.phase = new, phase
        return new

    def state(self, owner: str) -> State:
        """``owner``'s state (an owner the table does not keep is UNWATCHED)."""
        o = self._owners.get(owner)
        return State.UNWATCHED if o is None else o.state

    # ------------------------------------------------------------------ admissions

    def admitted(self, aid: str, owner: str, now: float) -> None:
        """Check admitted ``aid`` for ``owner``."""
        self._ids[aid] = _Tracked(owner, now)
        self._owners.setdefault(owner, _Owner()).ids[aid] = None

    def acknowledge(self, aid: str, now: float) -> bool:
        """Envoy showed it runs ``aid``. True: held without a lease from now (its owner is
        alive, or its admin said the same process runs); else the lease stays (an owner
        not alive yet unleases it when its first stream opens)."""
        t = self._ids.get(aid)
        if t is None:
            return False
        t.acked_at = now
        if self._owners[t.owner].state not in VOUCHED:
            # Under the lease, also one held without it since before a loss: this sign,
            # after the loss, spares it the loss's release, so only a lease can end it.
            if self.leases.unleased(aid):
                self.leases.lease_again(aid)
            return False
        if not self.leases.hold_without_lease(aid):
            return False
        t.relapsed = False
        return True

    def ended(self, aid: str) -> None:
        t = self._ids.pop(aid, None)
        if t is not None:
            o = self._owners.get(t.owner)
            if o is not None:
                o.ids.pop(aid, None)
                # Nothing left to know about it (no admissions, no stream, no grace
                # running): forgotten, so churning peers cannot grow the table.
                if not o.ids and o.state is State.UNWATCHED:
                    del self._owners[t.owner]

    def prune(self, holds: Callable[[str], bool]) -> int:
        """Forget every admission ``holds`` says has ended; returns how many."""
        gone = [aid for aid in self._ids if not holds(aid)]
        for aid in gone:
            self.ended(aid)
        # Owners with nothing left to track (pods that came and went): forgotten.
        for key in [k for k, o in self._owners.items()
                    if not o.ids and o.state is State.UNWATCHED]:
            del self._owners[key]
        return len(gone)

    def owner(self, aid: str) -> str | None:
        t = self._ids.get(aid)
        return None if t is None else t.owner

    def unleased(self, aid: str) -> bool:
        """``aid`` is tracked here and held without a lease (asked of :attr:`leases`)."""
        return aid in self._ids and self.leases.unleased(aid)

    def periodic_entry(self, owner: str, now: float) -> None:
        """A periodic access-log entry arrived on one of ``owner``'s streams."""
        o = self._owners.get(owner) or _Owner()
        if not isinstance(o.phase, Open):
            raise IllegalTransition(o.state, Trigger.PERIODIC)  # no stream to carry it
        self._move(o, Trigger.PERIODIC, replace(o.phase, periodic_at=now))

    def sends_periodic(self, owner: str) -> bool:
        o = self._owners.get(owner)
        return o is not None and o.phase is not None and o.phase.periodic_at is not None

    # ------------------------------------------------------------------ streams

    def stream_opened(self, owner: str, now: float) -> Reopened:
        o = self._owners.setdefault(owner, _Owner())
        if isinstance(o.phase, Open):
            self._move(o, Trigger.OPENED_MORE, replace(o.phase, streams=o.phase.streams + 1))
            return Reopened([], [])
        loss = o.phase
        ask = next(self._tokens) if self.identifiable(owner) else None
        self._move(o, Trigger.OPENED if ask is None else Trigger.OPENED_ASK,
                   Open(1, None if loss is None else loss.periodic_at, ask,
                        ask is not None and o.state in (State.BLIP, State.BLIP_ASKING)))
        unlease: list[str] = []
        relapse: list[str] = []
        for aid in o.ids:
            t = self._ids[aid]
            if t.acked_at is None:
                continue
            if loss is not None and t.acked_at <= loss.at:
                t.acked_at = None  # only a new sign from Envoy unleases it again
                # Back under the lease, unless the admin says the same process lives.
                if self.leases.unleased(aid) and self.leases.lease_again(aid):
                    t.relapsed = True
                    relapse.append(aid)
            elif not self.leases.unleased(aid) and self.leases.hold_without_lease(aid):
                unlease.append(aid)  # acknowledged while not alive: alive now
        # Until the admin answers, the above holds (what is decided without it).
        return Reopened(unlease, relapse, ask)

    def identified(self, owner: str, ask: int, start: ProcessStart | None,
                   now: float) -> Identified:
        """The admin's answer to :attr:`Reopened.ask`: when the process now running started
        (None: no answer, or none to trust). Admissions surely asked for before that start
        are a dead process's; those surely after are this one's, and what a gap put back
        under the lease is unleased again. Within the start's resolution nothing changes
        (what :meth:`stream_opened` decided holds: the time-only rule)."""
        o = self._owners.get(owner)
        if o is None or o.state is not State.IDENTIFYING:
            return Identified([], [])  # stale: a later open asks again, a loss checks
        op = o.phase
        assert isinstance(op, Open)
        if op.ask != ask:
            return Identified([], [])
        if start is None:
            self._move(o, Trigger.IDENTIFIED, Open(op.streams, op.periodic_at))
            return Identified([], [])
        periodic_at = op.periodic_at
        if periodic_at is not None and start.before(periodic_at):
            periodic_at = None  # surely its predecessor's: this process's config is unknown
        self._move(o, Trigger.IDENTIFIED, Open(op.streams, periodic_at))
        release: list[str] = []
        unlease: list[str] = []
        for aid in o.ids:
            t = self._ids[aid]
            if start.before(t.admitted_at):
                release.append(aid)
            elif periodic_at is not None:
                # A final entry may have been lost with the connection: the live ones are
                # acknowledged again by their next periodic entry, the rest expire.
                continue
            elif (start.after(t.admitted_at) and t.relapsed
                    and not self.leases.unleased(aid) and self.leases.hold_without_lease(aid)):
                t.relapsed = False
                t.acked_at = now
                unlease.append(aid)
        for aid in release:
            self.ended(aid)
        return Identified(release, unlease, op.after_blip)

    def stream_closed(self, owner: str, now: float) -> None:
        o = self._owners.get(owner) or _Owner()
        op = o.phase
        if not isinstance(op, Open):
            raise IllegalTransition(o.state, Trigger.CLOSED_LAST)  # none open to close
        if op.streams > 1:
            self._move(o, Trigger.CLOSED_MORE, replace(op, streams=op.streams - 1))
        else:
            self._move(o, Trigger.CLOSED_LAST, Loss(now, op.periodic_at, now + self.grace))

    def alive(self, owner: str) -> bool:
        return self.state(owner) in OPEN

    def watched(self, owner: str) -> bool:
        return self.state(owner) is not State.UNWATCHED

    @property
    def open_streams(self) -> int:
        return sum(o.phase.streams for o in self._owners.values()
                   if isinstance(o.phase, Open))

    @property
    def alive_owners(self) -> int:
        return sum(1 for o in self._owners.values() if o.state in OPEN)

    def __len__(self) -> int:
        return len(self._ids)

    # ------------------------------------------------------------------ death

    @staticmethod
    def _is_before(t: _Tracked, lost_at: float) -> bool:
        """Asked for before its owner was lost, and no sign from Envoy since."""
        return t.admitted_at <= lost_at and (t.acked_at is None or t.acked_at <= lost_at)

    def next_deadline(self) -> float | None:
        due = [o.phase.due for o in self._owners.values()
               if isinstance(o.phase, Loss) and o.phase.due is not None]
        return min(due) if due else None

    def _bury(self, key: str, o: _Owner, trigger: Trigger, ids: list[str]) -> None:
        """``o``'s process is dead: forget ``ids`` (the caller releases them); what it
        asks for from now on is a new process's, not watched yet."""
        self._move(o, trigger, None)
        for aid in ids:
            self.ended(aid)
        for aid in o.ids:
            # Left, and held without a lease: a new process's, acknowledged while its
            # predecessor's blip was vouched for. Not watched: under the lease.
            if self.leases.unleased(aid):
                self.leases.lease_again(aid)
        if not o.ids and key in self._owners:
            del self._owners[key]

    def pop_dead(self, now: float) -> list[tuple[str, list[str]]]:
        """Owners lost for ``grace`` or longer, with the admissions they asked for before.

        Those admissions are forgotten here; the caller releases them. Admissions that
        arrived while the owner was lost (a new process behind the same host, not yet
        watched) stay, under their lease. Identified owners are not decided here but by
        their admin's answer (:meth:`due_checks`).
        """
        dead: list[tuple[str, list[str]]] = []
        for key, o in list(self._owners.items()):
            loss = o.phase
            if (o.state is not State.LOST or not isinstance(loss, Loss) or loss.due is None
                    or loss.due > now or self.identifiable(key)):
                continue
            ids = [aid for aid in o.ids if self._is_before(self._ids[aid], loss.at)]
            self._bury(key, o, Trigger.GRACE_PASSED, ids)
            dead.append((key, ids))
        return dead

    def due_checks(self, now: float) -> list[tuple[str, int]]:
        """Identified owners lost for ``grace`` (or since their last check) by ``now``:
        ask each one's admin and pass the answer with its token to :meth:`checked`."""
        due: list[tuple[str, int]] = []
        for key, o in self._owners.items():
            loss = o.phase
            if (o.state in (State.LOST, State.BLIP) and isinstance(loss, Loss)
                    and loss.due is not None and loss.due <= now and self.identifiable(key)):
                ask = next(self._tokens)
                self._move(o, Trigger.CHECK_DUE, Loss(loss.at, loss.periodic_at, ask=ask))
                due.append((key, ask))
        return due

    def checked(self, owner: str, ask: int, start: ProcessStart | None,
                now: float) -> Checked:
        """A lost owner's admin answered (``start``) or not (None)."""
        o = self._owners.get(owner)
        loss = None if o is None else o.phase
        if (o is None or o.state not in (State.ASKING, State.BLIP_ASKING)
                or not isinstance(loss, Loss) or loss.ask != ask):
            return Checked(STALE, [])  # a stream opened (or closed again) meanwhile
        blip = o.state is State.BLIP_ASKING
        if start is not None and start.after(loss.at):
            # The process that held the streams still runs: only its connection went.
            # Envoy reopens the stream at its next entry; until then nothing is released
            # and the admin is asked again every grace.
            self._move(o, Trigger.CHECKED_BLIP,
                       Loss(loss.at, loss.periodic_at, now + self.grace))
            return Checked(BLIP, [], not blip)
        if start is not None and start.before(loss.at):
            # A new process: whatever was asked for before it started is its
            # predecessor's, lost or not yet; what came after is its own, under the lease.
            ids = [aid for aid in o.ids if start.before(self._ids[aid].admitted_at)]
            self._bury(owner, o, Trigger.CHECKED_RESTARTED, ids)
            return Checked(RESTARTED, ids)
        # No answer: dead, as without an admin. A start within the uptime's resolution
        # of the loss cannot say which side it is on: the time-only rule (dead) too.
        # After a blip was confirmed, admissions acknowledged since the loss had no lease
        # (acknowledge): they die with the process too.
        ids = [aid for aid in o.ids if self._is_before(self._ids[aid], loss.at)
               or (blip and self.leases.unleased(aid))]
        self._bury(owner, o, Trigger.CHECKED_DEAD, ids)
        return Checked(DEAD, ids)


def local_owners(admin_url: str) -> Callable[[str], bool]:
    """Which owners are the Envoy behind ``admin_url``: a loopback peer (a sidecar per pod:
    the pod's own Envoy), the ``unix`` owner (only local processes reach a socket), or the
    admin URL's own host."""
    host = (urlsplit(admin_url).hostname or "").strip("[]")
    # Loopback and unix callers are this Envoy only when the admin is local too: an admin
    # elsewhere says nothing about the processes calling over loopback.
    admin_local = host == "localhost" or _loopback(host)

    def identifiable(owner: str) -> bool:
        if host and owner == host:
            return True
        return admin_local and (owner == UNIX_OWNER or _loopback(owner))

    return identifiable


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.partition("%")[0]).is_loopback
    except ValueError:
        return False


def _seconds(value: object) -> int | None:
    """A protobuf JSON Duration as Envoy writes its uptime (``"93s"``): whole seconds."""
    if not isinstance(value, str) or not value.endswith("s"):
        return None
    try:
        secs = float(value[:-1])
    except ValueError:
        return None
    return int(secs) if math.isfinite(secs) and secs >= 0 else None


def process_start(info: object, sent: tuple[float, float],
                  received: tuple[float, float]) -> ProcessStart | None:
    """When the Envoy that answered ``/server_info`` with ``info`` started, on the monotonic
    clock; ``sent``/``received``: (monotonic, wall) readings around the request.

    Envoy computes ``uptime_current_epoch`` as ``time(now) - time(start)``, both whole
    seconds (``time_t``), at some instant between the two readings: so the start lies in
    ``[floor(sent) - uptime, floor(received) - uptime + 1)`` in wall time, converted with
    each reading's own offset so the window never depends on wall-clock jumps between.
    None when unreadable, or after a hot restart (``uptime_all_epochs`` differs): the
    parent process may still be draining its requests, so a start says nothing about them.
    """
    if not isinstance(info, dict):
        return None
    uptime = _seconds(info.get("uptime_current_epoch"))
    if uptime is None or _seconds(info.get("uptime_all_epochs")) != uptime:
        return None
    (mono0, wall0), (mono1, wall1) = sent, received
    earliest = mono0 - (wall0 - math.floor(wall0)) - uptime
    latest = mono1 - (wall1 - math.floor(wall1)) - uptime + 1.0
    return ProcessStart(earliest, latest)


class AdminProcessStart:
    """Asks the Envoy behind ``--envoy-admin-url`` when its process started
    (``GET /server_info``), over the capacity monitor's HTTP session."""

    def __init__(self, admin_url: str, session: Callable[[], aiohttp.ClientSession], *,
                 timeout: float = ADMIN_TIMEOUT_SECS,
                 clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time) -> None:
        self.url = admin_url.rstrip("/") + "/server_info"
        self._session = session
        self.timeout = timeout
        self._clock = clock
        self._wall = wall

    async def __call__(self) -> ProcessStart | None:
        # A refused connection is an answer (no Envoy listens: the process is gone); a
        # timeout or an error status may be a busy main thread (a big xDS push), so it is
        # asked again before the caller takes silence for a death.
        for attempt in range(ADMIN_ATTEMPTS):
            if attempt:
                await asyncio.sleep(ADMIN_RETRY_SECS)
            sent = (self._clock(), self._wall())
            try:
                status, body = await http_get(self._session(), self.url, self.timeout,
                                              SERVER_INFO_LIMIT)
            except aiohttp.ClientConnectorError as exc:
                log.info("envoy_admin_server_info_unreadable", url=self.url,
                         error=str(exc)[:200] or type(exc).__name__)
                return None
            except PROBE_ERRORS as exc:
                log.info("envoy_admin_server_info_unreadable", url=self.url,
                         error=str(exc)[:200] or type(exc).__name__, attempt=attempt + 1)
                continue
            received = (self._clock(), self._wall())
            if status != 200:
                log.info("envoy_admin_server_info_unreadable", url=self.url, status=status,
                         attempt=attempt + 1)
                continue
            try:
                info = json.loads(body)
            except (ValueError, RecursionError):
                return None  # not Envoy's server info: asking again will not change that
            return process_start(info, sent, received)
        return None


class EnvoyLiveness:
    """The table wired to an admission service (its lease home, through which the table
    unleases and relapses), the gRPC hooks and a timer that releases.

    Hooks: ``admitted`` (Check, with its peer), ``acknowledged`` (ext_proc stream opened,
    periodic entry), ``ended`` (final entry), ``stream_opened``/``stream_closed`` (each
    ALS stream). A timer releases a dead owner's admissions as ``lease_expired``: the
    lease's one job is a slot with no owner left.
    """

    def __init__(self, controller: AdmissionsById, *, grace: float,
                 metrics: Recorder | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 start_of: StartSource | None = None,
                 identifiable: Callable[[str], bool] | None = None) -> None:
        """``start_of``: asks the local Envoy's admin when its process started (on
        ``clock``); ``identifiable``: the owners that Envoy is. Without them every owner
        is decided on time alone."""
        self.controller = controller
        self._start_of = start_of
        self.table = OwnerTable(grace, identifiable if start_of is not None and
                                identifiable is not None else lambda owner: False,
                                leases=controller)
        self._metrics: Recorder = metrics if metrics is not None else NullRecorder()
        self._clock = clock
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: float | None = None
        self._closed = False
        self._asks: set[asyncio.Task[None]] = set()
        self._asking: dict[str, asyncio.Task[None]] = {}

    def admitted(self, aid: str, peer: str) -> bool:
        """Check admitted ``aid`` for ``peer``. True: that Envoy sends periodic access-log
        entries, so they, not an ext_proc stream, can acknowledge the request."""
        owner = owner_of(peer)
        self.table.admitted(aid, owner, self._clock())
        if len(self.table) > 2 * self.controller.lease_count + PRUNE_SLACK:
            self.table.prune(self.controller.holds)
        return self.table.sends_periodic(owner)

    def periodic_entry(self, owner: str) -> None:
        """A periodic entry arrived on a stream of ``owner`` (from :meth:`stream_opened`)."""
        self.table.periodic_entry(owner, self._clock())

    def acknowledged(self, aid: str, peer: str | None = None) -> None:
        """Envoy runs ``aid``. ``peer``: the stream that said so, owner of an ``aid`` no
        Check here asked for (adopted after a sidecar restart)."""
        if peer is not None and self.table.owner(aid) is None:
            if not self.controller.holds(aid):
                return
            self.table.admitted(aid, owner_of(peer), self._clock())
        self.table.acknowledge(aid, self._clock())

    def ended(self, aid: str) -> None:
        self.table.ended(aid)

    def stream_opened(self, peer: str) -> str:
        """An ALS stream opened; returns its owner key (pass it to :meth:`stream_closed`)."""
        owner = owner_of(peer)
        first = not self.table.watched(owner)
        r = self.table.stream_opened(owner, self._clock())
        if first or r.relapse:
            log.info("envoy_owner_watched", owner=owner, unleased=len(r.unlease),
                     back_under_lease=len(r.relapse))
        if r.ask is not None and not self._closed:
            self._ask(owner, self._identify(owner, r.ask))
        self._report()
        return owner

    async def _start(self) -> ProcessStart | None:
        assert self._start_of is not None
        try:
            return await self._start_of()
        except Exception:  # an answer must come, or a lost owner is never decided
            log.exception("envoy_admin_server_info_unreadable")
            return None

    async def _identify(self, owner: str, ask: int) -> None:
        start = await self._start()
        if self._closed:
            return
        r = self.table.identified(owner, ask, start, self._clock())
        if r.unlease:
            log.info("envoy_owner_blip", owner=owner, unleased_again=len(r.unlease),
                     reason="its access-log stream reopened and its admin says the "
                            "same process runs")
            if not r.blip_counted:  # the loss's check may have counted it already
                self._metrics.owner_blip()
        if r.release:
            self._released(owner, r.release, "envoy_owner_restarted")

    async def _check(self, owner: str, ask: int) -> None:
        start = await self._start()
        if self._closed:
            return
        c = self.table.checked(owner, ask, start, self._clock())
        if c.verdict == BLIP:
            if c.first_blip:
                log.info("envoy_owner_blip", owner=owner, grace_secs=self.table.grace,
                         reason="no access-log stream for the grace, but its admin says "
                                "the same process runs: nothing released")
                self._metrics.owner_blip()
        elif c.verdict == RESTARTED:
            self._released(owner, c.release, "envoy_owner_restarted")
        elif c.verdict == DEAD:
            self._released(owner, c.release, "envoy_owner_lost")
        self._arm()

    def _ask(self, owner: str, coro: Awaitable[None]) -> None:
        # One question per owner in flight: a newer one makes the older answer stale
        # anyway (its token), so connection flaps cannot pile requests up on the admin.
        old = self._asking.get(owner)
        if old is not None:
            old.cancel()
        task: asyncio.Task[None] = asyncio.ensure_future(coro)
        self._asking[owner] = task
        self._asks.add(task)
        task.add_done_callback(self._asks.discard)
        task.add_done_callback(
            lambda t: self._asking.pop(owner, None) if self._asking.get(owner) is t else None)

    async def settled(self) -> None:
        """Wait for the admin answers asked for so far to be applied (tests)."""
        while self._asks:
            await asyncio.gather(*self._asks, return_exceptions=True)

    def stream_closed(self, owner: str) -> None:
        self.table.stream_closed(owner, self._clock())
        if not self.table.alive(owner):
            log.info("envoy_owner_streams_closed", owner=owner, grace_secs=self.table.grace)
        self._report()
        self._arm()

    def close(self) -> None:
        """Stopping: streams closed from now on release nothing."""
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for task in self._asks:
            task.cancel()

    def _report(self) -> None:
        self._metrics.envoy_streams(self.table.open_streams, self.table.alive_owners)

    def _arm(self) -> None:
        due = self.table.next_deadline()
        if self._closed or due is None or (self._timer_at is not None and self._timer_at <= due):
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = due
        self._timer = asyncio.get_running_loop().call_later(
            max(0.0, due - self._clock()), self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._timer_at = None
        self.sweep()
        self._arm()

    def sweep(self) -> int:
        """Release the admissions of every owner dead by now; returns how many. Owners
        whose admin can be asked are asked (decided when it answers)."""
        total = 0
        for owner, ids in self.table.pop_dead(self._clock()):
            total += self._released(owner, ids, "envoy_owner_lost")
        if self._closed:
            return total
        for owner, ask in self.table.due_checks(self._clock()):
            self._ask(owner, self._check(owner, ask))
        return total

    def _released(self, owner: str, ids: list[str], event: str) -> int:
        released = 0
        for aid in ids:
            if (self.controller.holds(aid)
                    and self.controller.release(aid, LEASE_EXPIRED)
                    is ReleaseResult.RELEASED):
                released += 1
        # A clean Envoy exit leaves nothing to release: not worth a warning.
        (log.warning if released else log.info)(
            event, owner=owner, released=released, grace_secs=self.table.grace)
        self._metrics.owner_lost(released)
        return released
