"""One replica of the fleet as pure state: its mode, written down once as a table.

No I/O, no asyncio, no wall clock: the driver
(:class:`~sidecar.coordination.controller.FleetController`) owns the connections, loops
and futures, tells this core what happened (a trigger with what the ledger answered, a
notification, a service's call) and does what the core answers: a new mode, and a list
of effects (:data:`Effect`: ``Send`` a ledger op through the ordered outbox, ``Grant`` or
``Expire`` a waiter, ``Stop`` a preempted request, ``Count``/``Fault`` metric verbs, and
``LocalRelease``/``LocalCarry``/``LocalAdopt`` for the local core while a local mode
lasts), to be done in order. Time comes from an injected clock, so every move can be
tested exactly (``tests/test_replica.py``).

The mode
========

==========  ===================================  =============================================
mode        who admits                           leaves by: trigger → next mode
==========  ===================================  =============================================
STARTING    nobody yet (connect's ``register``)  ``registered`` → OK; ``fleet_settling`` (the
                                                 fleet re-registers after a loss) → SETTLING
                                                 with no slot to reuse; ``ledger_lost`` (the
                                                 server did not answer, or the register
                                                 found a loss) → DEGRADED with no view, so
                                                 no share; then ``fleet_settling`` (that
                                                 same register's answer) → SETTLING.
OK          the ledger                           ``ledger_lost`` (a call failed or timed out,
                                                 found this replica unknown, or found that
                                                 the ledger lost writes) → DEGRADED.
DEGRADED    the local core, within the degraded  ``resync_sent`` (the heartbeat found the
            limit of the last view               server again) → RESYNCING.
RESYNCING   the local core, with the limit of    ``resync_failed`` → DEGRADED (the outage rule
            the mode it left: L from DEGRADED    again); ``resync_held`` → SETTLING (also when
            (the resync may hang), nothing new   it admitted after its list was fixed: a
            from SETTLING                        resync again at once); ``resync_back`` → OK.
SETTLING    the local core, reusing only the     ``resync_sent`` (the next heartbeat) →
            slots freed since the resync         RESYNCING.
            (recycle-only)
==========  ===================================  =============================================

``ledger_lost`` in DEGRADED, RESYNCING or SETTLING changes nothing: the ledger is
already not deciding, and only the recovery resync's own answer moves the mode on (a
late reply of a call made while OK lands there). Every other (mode, trigger) pair is a
bug in the driver and raises :class:`IllegalTransition`. What a resync answer means is
decided here (:meth:`Replica.resync_answered`): back to OK only once the ledger knew this
replica, the fleet has settled, and the server has answered for at least one heartbeat
interval since the outage (see below for why each is needed).

Away from the ledger: the limits, and why they hold
===================================================

A ledger call that fails or takes longer than ``call_timeout`` switches the replica to
a local :class:`~sidecar.scheduler.Scheduler` seeded with what the replica holds (they
count: nothing new is admitted while they reach the limit), whose capacity is the
*degraded limit*

    L_i = max(0, min(floor(C / N), h_i + floor((C − H) / N)))

from the replica's last view of the ledger: C the fleet capacity (or our own, if smaller),
N the live replicas, H the fleet's admissions in flight and h_i ours, all four from ONE
atomic script run (every heartbeat and resync answers them). Requests beyond it follow
the class rules locally (queue, time out, 429); requests that were waiting in the ledger
are re-queued locally (and back) keeping their first queue deadline.

*Why Σ ≤ C.* While degraded a replica holds at most max(h_i, L_i): what it held, draining,
or at most L_i once below it. For views taken from one state (H = Σ h_i ≤ C):
Σ_i max(h_i, L_i) ≤ Σ_i (h_i + max(0, floor((C − H)/N))) ≤ H + (C − H) = C, since L_i ≤
h_i + floor((C − H)/N). Each replica's new local admissions come out of its N-th of the
slots free in that state; a replica that held more than floor(C/N) (legal: no stranded
capacity) drains to its share and is not joined by the others' full shares. If H > C (a
capacity shrink) nobody admits anything new and Σ ≤ H drains.

*The remaining window.* Each replica's view is from its own last heartbeat, at most one
heartbeat interval (ttl/3) plus one call timeout before the outage, and views from
different moments may count different N (the fleet simulation found 6 + 3 + 2 = 11 of 6:
three replicas started one after the other, each with its own N = 1, 2, 3, and the server
hung before the first one's next heartbeat). So the share s_i = floor(C/N_i) takes N_i
as the largest live count of the view and of every reply since it (every ledger reply
carries the live count, an arrive's too): it grows with the replies and shrinks only with
the next view (a ledger that lost its data counts fewer until the fleet has re-registered:
taking the newest reply's count alone, a replica back from a pause that had read 3 fell
back to its view's 2 on the first reply of a server restarted empty, while the replica
that joined kept its share of C/3: 3 + 2 + 2 of 6), and
is 0 while another replica may not have read a reply that counts it (each status says how
many: ``FleetStatus.unheard``; the ledger keeps when each replica registered and the
newest generation each has read, from the ``seen`` its heartbeats carry, and counts a
replica whose registration lapsed within a ttl as not having heard: alive, it may still
divide by a count from before; a status answered while the fleet settles never gives a
share, only takes one away: after a loss the replicas alive are registered again one by
one, and those not back yet are in no count, so a replica alone in a ledger restarted
empty was told none had not heard, and took its share of C/3 beside two that had never
counted it, 3 + 4 + 4 of 9). L_i ≤ s_i. *Why Σ s_i ≤ C:* take S, the replicas with a
share; each i in S has its share only because every other replica then registered, or
lapsed within a ttl, had read a reply made after i registered, and that reply counts i;
N_j is at least that count until j takes a new view, which (a settled ledger that knows j)
counts i too while i stays registered; so every N_j (j in S) counts all of S, and
Σ_S floor(C/N_j) ≤ |S|·floor(C/|S|) ≤ C. No clock is involved in the counting; the ttl
only bounds how long a lapsed replica keeps the others' shares at 0 (one that stays
unreachable longer is the partition case, with its own bound). Comparing registration
order instead (only the replicas registered before i) failed when a registration lapsed in
a server pause and was made again by a call whose reply never arrived: the deterministic
simulation found 7 + 3 of 7. Two bounds then hold for the in flight the fleet can reach after an
outage at t*: Σ ≤ C + Σ_i max(0, h_i(t*) − s_i) (what was held beyond the shares:
proved, since Σ_i max(h_i, L_i) ≤ Σ_i s_i + Σ_i max(0, h_i − s_i)), and Σ ≤ C + the
admissions the ledger made after the oldest of the views (an admission raises the
reachable total by at most one and a release never does; with view refreshes in between
this one is checked over random interleavings by ``tests/test_degraded.py``, not
proved). So the excess needs admissions in the last heartbeat interval before the outage
that pushed a replica past its share, and it lasts only until those drain. Closing it
entirely would mean holding back a replica's admissions past its share until every other
replica has heard of them (one heartbeat each time: stranded capacity), so it is bounded,
not closed. The cost of the share rule: a replica that joins a running fleet has no share
of its own (it queues by the class rules in an outage, as one that never reached the
server) until the others' next heartbeat and then its own, one or two heartbeat
intervals, and the others have none until its second heartbeat; the first replica of a
fleet has its share at once. A replica whose registration lapsed and was made again (a
partition, a lost record) is new again, and while a lapsed one has not registered again,
for at most a ttl, nobody else has a share. Not
covered: the shares of a replica cut off on its own (its registration lapses while it
admits: *Partition* below).

*Partition* (only this replica loses the server; the others still use the ledger). Until
its registration lapses (0.9 ttl after its last heartbeat) the ledger still counts what
it held (its releases no longer arrive), so reusing those slots is safe and only its new
headroom is uncounted: excess ≤ max(0, L_i − h_i). Once the registration lapses the
ledger releases its admissions and the others may fill them while this replica still runs
what it holds: at most max(h_i, L_i) (what it held, draining, or at most L_i once below
it), so excess ≤ max(h_i, L_i), which is ≤ floor(C/N) unless it held past its share when
it was cut off (found by the fleet simulation: 10 of 6 with h_i = 4, floor(C/N) = 2,
until those drain), for as long as the partition lasts. Admitting
nothing new once the registration may have lapsed would drain it instead, but a replica
cannot tell a partition from an outage of the server itself, so the whole fleet would
stop admitting ~0.6 ttl into every server outage; the share is kept, and this bound is
documented (docs/reference.md, "Failure modes").

The heartbeat keeps trying; each success is a ``resync`` that makes the ledger's view of
this replica exactly what it holds (adds back local admissions, drops what ended
meanwhile). After it, while the replica still waits to return to ``ok``, it only reuses
slots freed from then on (the ledger counts what it holds again, and replicas already
back admit against that). The replica returns
to ``ok`` once a resync finds its registration still known, at least one heartbeat
interval has passed since the server answered again, and the fleet has settled: the first
resync the ledger answers for a replica it does not know (data loss, or every registration
lapsed) starts a settling window on the server's clock, ``2 × interval + call_timeout``,
longer than any live replica's gap between two heartbeat attempts, so every replica alive
has re-registered its holdings before anyone admits against them (one interval from each
replica's own first answer is not enough: a replica whose previous attempt was still
timing out when the server came back re-registers up to a call timeout later than that).
Waiters queued locally then re-arrive at the ledger. A replica that starts while the fleet
settles admits nothing until it has. A replica that has never reached the server (start-up
during an outage) has no view: it queues by the class rules until the server answers.

*A resync in flight.* The heartbeat's recovery resync lists what the replica holds when it
is sent; the answer comes a round trip later, or never (a hung server: the call times out
after ``call_timeout``, one heartbeat interval after another). Pausing local admission for
the flight, as this core once did, made a degraded replica refuse requests its limit
allows for a call timeout out of every interval while the server hung (two sidecars of a
capacity-4 fleet, each holding 1 of its share of 2, answered a bulk Check 429 with the
server SIGSTOPped; the deterministic simulation's liveness check found it at once). So a
resync sent from DEGRADED keeps the limit L: until it is answered the replica is as away
as before, and what it admits meanwhile is within L, covered by the outage bound exactly
like its other local admissions. The cost is on the answer: an admission made after the
list was fixed (and still held) is not in the ledger, whose count of this replica is the
list's. Such an answer is never a return, even a whole interval later: the replica goes to
SETTLING holding at most what the ledger counts for it (the list's ids it kept: it reuses
a listed slot that ended, never more), and resyncs again at once; that resync lists them,
and from SETTLING nothing new is admitted while it flies, so its answer lists everything
held and the ordinary rule applies (two round trips instead of one). Until the second
answer the ledger undercounts this replica by what it admitted during the first flight
and kept, as it undercounts a replica whose first resync has not arrived yet: the others
return to ``ok`` only after an interval of answers, and this replica's first answer came
within an interval of the server's return, the second one round trip later. A resync sent
from SETTLING admits nothing new while it flies (``recycle`` 0): its list is what the
ledger will count, and a slot reused meanwhile would be in neither; if the server hangs
then, the call fails within a call timeout and the outage rule (L) applies again. An id the
answer says the ledger had ended is released locally without its slot being reused (the
ledger gave it to another request: ``LocalRelease(reuse=False)``). A resync given up on
(failed or timed out here) may still run later: a paused server, resumed, runs what a
connection dropped meanwhile had sent, possibly after the next resync. The ledger applies
only the newest resync of a process (``ledger.lua``, ``stale_resync()``), so a late one
never puts back an older list (it once dropped two running streams that the newer one
had re-added).

One held admission
==================

Each admission this replica holds (:class:`Held`, the local mirror) has two states, each
from its own table, because the two change independently: its **stage**, what the
ledger may do to it, and its **acknowledgement**, whether Envoy showed it runs it.

============  =======================================  ====================================
stage         meaning                                  leaves by → next stage
============  =======================================  ====================================
ADMITTED      holds a slot; no stop channel            the stop channel opens →
                                                       PREEMPTIBLE; first byte (or an
                                                       adoption) → STREAMING
PREEMPTIBLE   a stop channel is open; the ledger was   the deferred mark leaves, or the
              not told (its mark waits out the delay,  replica returns to OK (the mark is
              or the replica is away from the ledger)  sent then) → MARKED; first byte →
              so it is a candidate only locally        STREAMING (the ledger never saw it
                                                       as a candidate: nothing to send)
MARKED        the ledger may hold it as a candidate:   its first byte is sent: → CONFIRMING
              its first byte must reach the ledger     when the response waits for the
              before the response may start            answer (``confirm_first_byte``),
                                                       else → STREAMING
CONFIRMING    first byte sent, the response waits      answered 1 (or no answer: away from
              for the ledger's answer                  the ledger) → STREAMING; answered 0
                                                       (the ledger preempted it first) →
                                                       STOPPED
STOPPED       the ledger preempted it before its       its preempt notification → RELEASED
              first byte arrived: its caller answers   (delivered: the 503 went out)
              503 instead of starting the response
STREAMING     past its first byte: never a victim      released
RELEASED      ended (completed, cancelled, preempted,  final (the id is remembered in
              expired): no longer held                 ``EndedIds``)
============  =======================================  ====================================

Every stage also leaves for RELEASED; opening the stop channel again keeps PREEMPTIBLE or
MARKED. A resync or adoption lists an admission as a candidate only when MARKED, so the
ledger never holds a candidate whose first byte the driver would not send. While the
replica is away from the ledger a first byte cannot be sent (and one in the outbox or in
a failed call may be lost), so on the return to OK the driver sends the first byte of
every STREAMING admission again (idempotent in the ledger): a candidate the ledger still
has would otherwise be picked as a victim after its response started, and run on
uncounted beside its preemptor.

An acknowledgement is UNACKNOWLEDGED (the ack timeout runs from ``unacked_since``) until
Envoy shows it runs the admission (ext_proc stream, first byte, periodic entry; with
:mod:`sidecar.liveness` wired, only the liveness tracker decides) → ACKNOWLEDGED, kept for
as long as the replica lives; an Envoy that may have been replaced makes it UNACKNOWLEDGED
again, its timeout running from then (:data:`ACKS`).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from sidecar.classes import PriorityClass
from sidecar.coordination.ledger import (
    Arrival,
    ArriveStatus,
    FleetStatus,
    Holding,
    degraded_limit,
)
from sidecar.coordination.ledger import Event as Notification
from sidecar.coordination.outbox import Adopt, MarkFirstByte, MarkPreemptible, Op, Release
from sidecar.scheduler.lifecycle import (
    Admission,
    Admitted,
    EndedIds,
    Outcome,
    Preempted,
    Rejected,
    Released,
    ReleaseReason,
    ReleaseResult,
)
from sidecar.scheduler.lifecycle import Event as LifecycleEvent


class Mode(enum.StrEnum):
    """Who decides admission for this replica now (see the module table)."""

    STARTING = "starting"
    OK = "ok"
    DEGRADED = "degraded"
    RESYNCING = "resyncing"
    SETTLING = "settling"


class Trigger(enum.StrEnum):
    """What happened, as far as the mode is concerned."""

    REGISTERED = "registered"  # start-up register answered, the fleet settled
    FLEET_SETTLING = "fleet_settling"  # start-up register answered while the fleet settles
    LEDGER_LOST = "ledger_lost"  # a call failed, timed out, found us unknown or lost writes
    RESYNC_SENT = "resync_sent"  # a recovery resync left (its list is fixed from here)
    RESYNC_FAILED = "resync_failed"  # it failed or timed out
    RESYNC_HELD = "resync_held"  # answered, but not safe to return yet
    RESYNC_BACK = "resync_back"  # answered, safe: the ledger decides again


M, T = Mode, Trigger
TRANSITIONS: Mapping[tuple[Mode, Trigger], Mode] = {
    (M.STARTING, T.REGISTERED): M.OK,
    (M.STARTING, T.FLEET_SETTLING): M.SETTLING,
    (M.STARTING, T.LEDGER_LOST): M.DEGRADED,
    # The start-up register itself found a loss (its reply is read after the loss is
    # reported): already local, it settles like any other starting replica.
    (M.DEGRADED, T.FLEET_SETTLING): M.SETTLING,
    (M.OK, T.LEDGER_LOST): M.DEGRADED,
    (M.DEGRADED, T.LEDGER_LOST): M.DEGRADED,
    (M.RESYNCING, T.LEDGER_LOST): M.RESYNCING,
    (M.SETTLING, T.LEDGER_LOST): M.SETTLING,
    (M.DEGRADED, T.RESYNC_SENT): M.RESYNCING,
    (M.SETTLING, T.RESYNC_SENT): M.RESYNCING,
    (M.RESYNCING, T.RESYNC_FAILED): M.DEGRADED,
    (M.RESYNCING, T.RESYNC_HELD): M.SETTLING,
    (M.RESYNCING, T.RESYNC_BACK): M.OK,
}
"""(mode, trigger) → next mode; a pair not listed is illegal."""
del M, T

# The modes in which the local core admits (the driver keeps one exactly then).
LOCAL = frozenset({Mode.DEGRADED, Mode.RESYNCING, Mode.SETTLING})


class IllegalTransition(RuntimeError):
    """A trigger the table does not allow in the current mode: a driver bug."""

    def __init__(self, mode: Mode, trigger: Trigger) -> None:
        super().__init__(f"{trigger.value} is not allowed in mode {mode.value}")
        self.mode = mode
        self.trigger = trigger


def next_mode(mode: Mode, trigger: Trigger) -> Mode:
    """The table, as a function: the next mode, or :class:`IllegalTransition`."""
    try:
        return TRANSITIONS[mode, trigger]
    except KeyError:
        raise IllegalTransition(mode, trigger) from None


@dataclass(frozen=True, slots=True)
class View:
    """The last consistent view of the fleet (one atomic script run), taken while OK:
    what the degraded limit is computed from. ``live_replicas`` 0: never saw the fleet."""

    capacity: int = 0
    live_replicas: int = 0
    inflight: int = 0  # H: the fleet's admissions in flight
    held: int = 0  # h_i: ours, as the ledger counted them


NO_VIEW = View()


# ------------------------------------------------------------------ one held admission


class Stage(enum.StrEnum):
    """What the ledger may still do to one held admission (see the module table)."""

    ADMITTED = "admitted"
    PREEMPTIBLE = "preemptible"
    MARKED = "marked"
    CONFIRMING = "confirming"
    STOPPED = "stopped"
    STREAMING = "streaming"
    RELEASED = "released"


S = Stage
STAGES: Mapping[Stage, frozenset[Stage]] = {
    S.ADMITTED: frozenset({S.PREEMPTIBLE, S.STREAMING, S.RELEASED}),
    S.PREEMPTIBLE: frozenset({S.PREEMPTIBLE, S.MARKED, S.STREAMING, S.RELEASED}),
    S.MARKED: frozenset({S.MARKED, S.CONFIRMING, S.STREAMING, S.RELEASED}),
    S.CONFIRMING: frozenset({S.STREAMING, S.STOPPED, S.RELEASED}),
    S.STOPPED: frozenset({S.RELEASED}),
    S.STREAMING: frozenset({S.RELEASED}),
    S.RELEASED: frozenset(),
}
"""Allowed moves of a stage: ``new in STAGES[old]``."""
del S


class Ack(enum.StrEnum):
    """Whether Envoy showed it runs the admission."""

    UNACKNOWLEDGED = "unacknowledged"
    ACKNOWLEDGED = "acknowledged"


ACKS: Mapping[Ack, frozenset[Ack]] = {
    # Unacknowledged → unacknowledged: its timeout restarted (a sign from an Envoy that
    # the liveness tracker does not vouch for).
    Ack.UNACKNOWLEDGED: frozenset({Ack.UNACKNOWLEDGED, Ack.ACKNOWLEDGED}),
    # Acknowledged → acknowledged: another sign; → unacknowledged: its Envoy may be gone.
    Ack.ACKNOWLEDGED: frozenset({Ack.ACKNOWLEDGED, Ack.UNACKNOWLEDGED}),
}
"""Allowed moves of an acknowledgement."""


_PAST_FIRST_BYTE = frozenset({Stage.CONFIRMING, Stage.STOPPED, Stage.STREAMING})


class IllegalStage(RuntimeError):
    """A move of a held admission the tables do not allow: a driver bug."""


class Held:
    """An admission this replica holds (the local mirror): its stage and acknowledgement,
    each moved only through its table."""

    __slots__ = ("_ack", "_stage", "admitted_at", "cls", "tenant", "unacked_since")

    def __init__(self, cls: PriorityClass, tenant: str, admitted_at: float, *,
                 stage: Stage = Stage.ADMITTED, ack: Ack = Ack.UNACKNOWLEDGED,
                 unacked_since: float | None = None) -> None:
        self.cls = cls
        self.tenant = tenant
        self.admitted_at = admitted_at
        self._stage = stage
        self._ack = ack
        # When the ack timeout started: admission, or the last sign that restarted it.
        self.unacked_since = admitted_at if unacked_since is None else unacked_since

    def __repr__(self) -> str:
        return (f"Held({self.cls.label}, {self.tenant!r}, {self.admitted_at}, "
                f"{self._stage.value}, {self._ack.value})")

    @property
    def stage(self) -> Stage:
        return self._stage

    @property
    def ack(self) -> Ack:
        return self._ack

    @property
    def first_byte(self) -> bool:
        """Its first byte was seen (the response started, is about to, or was refused)."""
        return self._stage in _PAST_FIRST_BYTE

    @property
    def preemptible(self) -> bool:
        """A candidate (its stop channel open, before its first byte)."""
        return self._stage in (Stage.PREEMPTIBLE, Stage.MARKED)

    @property
    def mark_sent(self) -> bool:
        """The ledger may hold it as a candidate: its first byte must reach the ledger."""
        return self._stage is Stage.MARKED

    @property
    def acknowledged(self) -> bool:
        return self._ack is Ack.ACKNOWLEDGED

    def move(self, to: Stage) -> None:
        if to not in STAGES[self._stage]:
            raise IllegalStage(f"{self._stage.value} → {to.value}")
        self._stage = to

    def _ack_to(self, to: Ack) -> None:
        if to not in ACKS[self._ack]:
            raise IllegalStage(f"{self._ack.value} → {to.value}")
        self._ack = to

    def acknowledge(self) -> None:
        """Envoy runs it: kept until its end or the death of its Envoy or this replica."""
        self._ack_to(Ack.ACKNOWLEDGED)

    def unacknowledge(self, now: float) -> None:
        """Its Envoy may have been replaced: the ack timeout runs again from ``now``."""
        self._ack_to(Ack.UNACKNOWLEDGED)
        self.unacked_since = now

    def renew(self, now: float) -> None:
        """A sign not vouched for: an unacknowledged admission's timeout restarts."""
        if self._ack is Ack.UNACKNOWLEDGED:
            self._ack_to(Ack.UNACKNOWLEDGED)
            self.unacked_since = now

    def ack_expired(self, cutoff: float) -> bool:
        """Unacknowledged since ``cutoff`` or earlier."""
        return self._ack is Ack.UNACKNOWLEDGED and self.unacked_since <= cutoff

    def holding(self, id: str) -> Holding:
        """As a resync or adoption lists it: a candidate only once MARKED (the stage whose
        first byte the driver sends to the ledger)."""
        return Holding(id, self.cls, self.tenant, self.first_byte, self.mark_sent)


# ------------------------------------------------------------------ effects


@dataclass(frozen=True, slots=True)
class Send:
    """Queue one ledger op on the driver's ordered outbox (:mod:`sidecar.coordination.outbox`
    decides what each flush sends)."""

    op: Op


@dataclass(frozen=True, slots=True)
class Count:
    """Metric verb: this core's own lifecycle moves (``Recorder.on_events``). A held
    admission follows the scheduler's lifecycle, so its moves are reported with the same
    event types, at the point this core makes them."""

    events: tuple[LifecycleEvent, ...]


@dataclass(frozen=True, slots=True)
class Fault:
    """Metric verb ``coordination_fault`` (and a warning): ``kind`` happened."""

    kind: str
    id: str = ""


@dataclass(frozen=True, slots=True)
class Grant:
    """Answer waiter ``id``: admitted."""

    id: str
    admitted: Admitted


@dataclass(frozen=True, slots=True)
class Expire:
    """Answer waiter ``id``: its queue timeout passed in the ledger (503)."""

    id: str
    waited: float


@dataclass(frozen=True, slots=True)
class Stop:
    """Deliver ``id``'s stop signal (it was preempted). ``undelivered``: count and log it
    if no stop channel is open any more (its response started without the ledger's word)."""

    id: str
    undelivered: bool = True


@dataclass(frozen=True, slots=True)
class LocalRelease:
    """The local core releases ``id`` (its Released event then moves the mirror).
    ``reuse`` False: its slot is not the local core's to give again (the ledger gave it
    away): its capacity shrinks by one with it, until the next limit is set."""

    id: str
    reason: ReleaseReason
    reuse: bool = True


@dataclass(frozen=True, slots=True)
class LocalCarry:
    """The local core counts an admission the ledger made (as it stands)."""

    id: str
    cls: PriorityClass
    tenant: str
    admitted_at: float
    streaming: bool


@dataclass(frozen=True, slots=True)
class LocalAdopt:
    """The local core counts a running stream (already counted here: no event)."""

    id: str
    cls: PriorityClass
    tenant: str


@dataclass(frozen=True, slots=True)
class GoLocal:
    """The mode just became a local one: build the local core from what is held (its
    limit is :meth:`Replica.local_limit`), drop the outbox (the return's resync covers
    it), move waiting requests to it, and log ``error`` if ``announce``."""

    error: str
    announce: bool = True


@dataclass(frozen=True, slots=True)
class Seen:
    """Metric verb ``fleet_seen``: a consistent view's per-class counts."""

    by_class: Mapping[PriorityClass, int]
    live_replicas: int


@dataclass(frozen=True, slots=True)
class Resync:
    """The call a heartbeat makes: a resync listing ``holdings``. ``recovery``: the one
    that may return this replica to OK (the mode is RESYNCING from here until its answer
    or failure); else the steady-state one, which also drops what a late-run call left
    in the ledger for this replica."""

    holdings: tuple[Holding, ...]
    recovery: bool


@dataclass(frozen=True, slots=True)
class HoldLocal:
    """SETTLING: set the local core to :meth:`Replica.local_limit` (reuse only the slots
    freed from now on); ask the ledger again in ``wake_in`` seconds if given (the fleet
    settles sooner than a heartbeat interval)."""

    wake_in: float | None = None


@dataclass(frozen=True, slots=True)
class Return:
    """Back to OK: close the local core (its waiters arrive at the ledger), count and log
    the change, re-register a class config changed meanwhile, and flush the outbox."""


@dataclass(frozen=True, slots=True)
class Registered:
    """Start-up: registered in a settled fleet; count and log it."""


@dataclass(frozen=True, slots=True)
class LocalFirstByte:
    """The local core marks ``id`` past its first byte (no longer a victim there)."""

    id: str


@dataclass(frozen=True, slots=True)
class Answered:
    """The response waiting on ``id``'s first-byte mark (``confirm_first_byte``) may
    start (``ok``), or must not: the ledger preempted it first (its caller answers 503)."""

    id: str
    ok: bool


Effect = (Send | Count | Fault | Grant | Expire | Stop | LocalRelease | LocalCarry
          | LocalAdopt | LocalFirstByte | GoLocal | Seen | HoldLocal | Return | Registered
          | Answered)


class Arrived(enum.Enum):
    """What an arrive's reply means for its request."""

    ADMITTED = "admitted"
    REJECTED = "rejected_queue_full"  # 429
    QUEUED = "queued"  # wait for a grant or an expiry
    MOVED = "moved"  # the ledger no longer decides for us: decide it locally


# What the ledger reports as lost writes (ledger.lua lose()): the fleet re-registers and
# settles. The other causes (counters_lost, owners_lost) were repaired from the records.
DATA_LOSS = frozenset({"server_changed", "stale_copy", "admissions_lost"})


class Replica:
    """The mode of one replica and the data each mode carries.

    ``back_at`` (RESYNCING, SETTLING): when the server first answered a recovery resync in
    this return; ``recycle`` (SETTLING): the most the local core may hold (what it held
    when the resync was answered, so only slots freed from then on are reused).
    """

    def __init__(self, *, interval: float, clock: Callable[[], float],
                 replica: str = "") -> None:
        self._interval = interval
        self._replica = replica
        # Set when a liveness tracker is wired (sidecar.liveness): then only it
        # acknowledges an admission; a sign from an Envoy it does not vouch for only
        # restarts the ack timeout (see FleetController.liveness_decides).
        self.liveness_decides = False
        self._clock = clock
        self._mode = Mode.STARTING
        self._back_at: float | None = None
        self._recycle: int | None = None
        self._view = NO_VIEW
        # N for the share: the largest live count of the ledger replies since the view was
        # taken (every reply carries one; a view resets it to its own: 0, none yet), and
        # whether every other replica is known to have read a reply that counts it (the
        # newest answered status's ``unheard`` is 0; before any status there is no view,
        # so no share either way). See "the remaining window" in the module docstring.
        self._live = 0
        self._heard = True
        # What this replica holds (the local mirror; moved here, and by the local core's
        # events while a local mode lasts), what it ended, and its waiters in the ledger.
        self.held: dict[str, Held] = {}
        self.ended = EndedIds()
        self._waiters: dict[str, tuple[PriorityClass, str]] = {}

    @property
    def mode(self) -> Mode:
        return self._mode

    @property
    def local(self) -> bool:
        """The local core decides (DEGRADED, RESYNCING, SETTLING)."""
        return self._mode in LOCAL

    @property
    def view(self) -> View:
        return self._view

    @property
    def recycle(self) -> int | None:
        return self._recycle

    @property
    def live_replicas(self) -> int:
        """N for the degraded share: the largest live count of the view and of every reply
        since it. It only grows between two views: a reply from a ledger that lost its
        data counts fewer until the fleet has re-registered (the newest reply's count
        alone fell from 3 to the view's 2 while the replica that joined kept its share of
        C/3: 3 + 2 + 2 of 6, the deterministic simulation found), and a shrink is taken
        with the next view."""
        return max(self._live, self._view.live_replicas)

    @property
    def heard(self) -> bool:
        """Every other replica has read a reply that counts it: only then does this
        replica take a degraded share of its own."""
        return self._heard

    def live_seen(self, n: int) -> None:
        """A ledger reply (any: arrive, release, heartbeat) counted ``n`` live replicas:
        N grows to it (:attr:`live_replicas`)."""
        self._live = max(self._live, n)

    def _take_view(self, view: View) -> None:
        """A consistent view of a ledger that knows us, settled: N is its count from here
        (a replica that left is no longer counted). No reply read after the view's own
        is lost by this: the driver hands the core a call's answer in the step its reply
        is read in (``FleetLedger._call`` reports the live count, the caller goes on
        without waiting in between), before any later reply's count."""
        self._view = view
        self._live = view.live_replicas

    def _note(self, status: FleetStatus) -> None:
        """An answered status: may the other replicas all count us? While the fleet
        settles, a status says so only for the replicas registered again so far: it takes
        the share away (someone has not heard), never gives it."""
        if status.unheard > 0:
            self._heard = False
        elif status.settling <= 0:
            self._heard = True

    def _move(self, trigger: Trigger) -> Mode:
        old = self._mode
        new = self._mode = next_mode(old, trigger)
        if new is Mode.DEGRADED:
            # The outage rule: no answer counts towards a return, no recycle-only cap.
            self._back_at = None
            self._recycle = None
        elif new is Mode.OK:
            self._back_at = None
            self._recycle = None
        return old

    # ------------------------------------------------------------------ triggers

    def registered(self, view: View) -> None:
        """Start-up: the ledger registered us and the fleet is settled."""
        self._move(Trigger.REGISTERED)
        self._take_view(view)

    def fleet_settling(self) -> None:
        """Start-up: registered while the fleet settles. Keep no view (an outage meanwhile
        must not give a share computed from a ledger that may lack admissions) and reuse
        nothing until the fleet has settled."""
        self._move(Trigger.FLEET_SETTLING)
        self._recycle = 0

    def ledger_lost(self) -> bool:
        """The ledger stopped deciding for us. True when this moved the mode (from OK or
        STARTING to DEGRADED): the driver then builds the local core."""
        old = self._move(Trigger.LEDGER_LOST)
        return old is not self._mode

    def seen(self, view: View) -> None:
        """A consistent view (every heartbeat while OK; one answered just after a switch
        to DEGRADED is newer than the one the switch used, and kept)."""
        self._take_view(view)

    def resync_sent(self) -> None:
        """A recovery resync left; its list is fixed from here. From DEGRADED the local core
        keeps its limit L (the server may not answer at all: see "A resync in flight"); from
        SETTLING reuse pauses until the answer (recycle 0: a slot reused now would be in
        neither the list nor the ledger's count of it)."""
        old = self._move(Trigger.RESYNC_SENT)
        if old is Mode.SETTLING:
            self._recycle = 0

    def resync_failed(self) -> None:
        """Unreachable again: the outage rule, and a whole interval of answers again."""
        self._move(Trigger.RESYNC_FAILED)

    def resync_answered(self, *, known: bool, settling: float, held: int,
                        view: View, unlisted: int = 0, counted: int = 0) -> Mode:
        """The recovery resync's answer (``held``: what this replica holds now). Back to
        OK (taking ``view``) once the ledger knew us, the fleet has settled and the server
        has answered for at least one interval; else SETTLING, reusing only slots freed
        from now on. ``unlisted``: admissions made after the list was fixed (while it hung,
        within L), which the ledger does not count yet: never a return; SETTLING holding
        at most what the ledger counts for us (``counted``: the list's ids it kept),
        until the next resync (sent at once) lists them."""
        now = self._clock()
        back_at = now if self._back_at is None else self._back_at
        if unlisted:
            self._move(Trigger.RESYNC_HELD)
            self._back_at = back_at
            self._recycle = counted
        elif not known or settling > 0 or now - back_at < self._interval * 0.99:
            self._move(Trigger.RESYNC_HELD)
            self._back_at = back_at
            self._recycle = held
        else:
            self._move(Trigger.RESYNC_BACK)
            self._take_view(view)
        return self._mode

    # ------------------------------------------------------------------ limits

    def degraded_limit(self, own_capacity: int) -> int:
        """What this replica may hold on its own while away from the ledger, the local
        core's capacity in every local mode: L_i of the module docstring (also while a
        recovery resync from DEGRADED is in flight), capped by ``recycle`` in SETTLING
        (0 while its resync is in flight); 0 while another replica may not count it yet
        (no share of its own)."""
        v = self._view
        limit = degraded_limit(min(v.capacity, own_capacity), self.live_replicas, v.inflight,
                               v.held)
        if self._recycle is not None:
            limit = min(limit, self._recycle)  # holds what the ledger counts: safe as is
        elif not self._heard:
            limit = 0
        return limit

    def share(self, own_capacity: int) -> int:
        """floor(C / N), the most the degraded limit can be: 0 before any view, and while
        another replica may not count it yet."""
        n = self.live_replicas
        if n < 1 or not self._heard:
            return 0
        return max(0, min(self._view.capacity, own_capacity)) // n

    # ------------------------------------------------------------------ holdings

    def waiter_arrived(self, aid: str, cls: PriorityClass, tenant: str) -> None:
        """An arrival this replica is about to send (registered before the call: the grant
        may be read before the reply)."""
        self._waiters[aid] = (cls, tenant)

    def waiter_gone(self, aid: str) -> None:
        """Its requester has its answer, left, or moved to the local queue."""
        self._waiters.pop(aid, None)

    def admitted(self, aid: str, cls: PriorityClass, tenant: str, *, waited: float,
                  queued: bool, starvation: bool = False,
                  preempted: bool = False) -> tuple[Admitted, list[Effect]]:
        """The ledger admitted ``aid`` (an arrive reply, or a grant)."""
        now = self._clock()
        self.held[aid] = Held(cls, tenant, now)
        self._waiters.pop(aid, None)
        event = Admitted(Admission(aid, cls, tenant, now), waited, queued, starvation, preempted)
        effects: list[Effect] = []
        if self.local:
            # Admitted by a call that returned after the switch: the local core counts it
            # (before its first byte: it may still get a stop channel and be a victim).
            effects.append(LocalCarry(aid, cls, tenant, now, streaming=False))
        effects.append(Count((event,)))
        return event, effects

    def notified(self, e: Notification) -> list[Effect]:
        """One notification from the ledger: a grant, an expiry or a preemption."""
        if e.kind == "grant":
            if e.id in self.held:
                # Already admitted here: a notification read twice (the list came back with an
                # older copy of the ledger). Releasing it would free a running slot.
                return []
            w = self._waiters.get(e.id)
            if w is None or self.local:
                # Its requester left, has its answer, or is being re-queued locally (the
                # resync drops the grant): give the slot back.
                return [Send(Release(e.id, ReleaseReason.CANCELLED))]
            event, effects = self.admitted(e.id, w[0], w[1], waited=e.waited, queued=True,
                                           starvation=e.starvation, preempted=e.preempted)
            return [*effects, Grant(e.id, event)]
        if e.kind == "expired":
            w = self._waiters.pop(e.id, None)
            if w is None:
                return []
            return [Count((Rejected(e.id, w[0], w[1], Outcome.REJECTED_QUEUE_TIMEOUT,
                                    e.waited),)), Expire(e.id, e.waited)]
        return self.preempted(e.id, e.by_class or PriorityClass.SYSTEM)

    def preempted(self, aid: str, by: PriorityClass) -> list[Effect]:
        """The ledger gave ``aid``'s slot to a higher class: stop it (this replica owns it)."""
        h = self.held.get(aid)
        if h is None:
            return []
        # Its caller already answered 503 on the first-byte mark's reply: delivered.
        by_reply = h.stage is Stage.STOPPED
        effects: list[Effect]
        if self.local:
            # A notification from before the outage: honour it locally too.
            effects = [LocalRelease(aid, ReleaseReason.PREEMPTED)]
        else:
            del self.held[aid]
            h.move(Stage.RELEASED)
            self.ended.add(aid, ReleaseReason.PREEMPTED)
            adm = Admission(aid, h.cls, h.tenant, h.admitted_at)
            effects = [Count((Preempted(adm, by), Released(adm, ReleaseReason.PREEMPTED)))]
        return [*effects, Stop(aid, undelivered=not by_reply)]

    def release(self, aid: str,
                 reason: ReleaseReason) -> tuple[ReleaseResult, list[Effect]]:
        """The service ends ``aid`` (its final access-log entry, a cancel, an expiry)."""
        h = self.held.get(aid)
        if h is None:
            return (ReleaseResult.ALREADY_RELEASED if aid in self.ended
                    else ReleaseResult.UNKNOWN), []
        if self.local:
            return ReleaseResult.RELEASED, [LocalRelease(aid, reason)]
        del self.held[aid]
        h.move(Stage.RELEASED)
        self.ended.add(aid, reason)
        return ReleaseResult.RELEASED, [
            Count((Released(Admission(aid, h.cls, h.tenant, h.admitted_at), reason),)),
            Send(Release(aid, reason))]

    def adopted(self, aid: str, cls: PriorityClass, tenant: str) -> list[Effect] | None:
        """A periodic entry for a stream this replica does not hold (this process restarted
        while it ran): held as streaming and acknowledged, counted, and added to the ledger.
        None: not adoptable (it ended here for a reason other than an expiry)."""
        if not self.ended.adoptable(aid):
            return None
        now = self._clock()
        h = self.held[aid] = Held(cls, tenant, now, stage=Stage.STREAMING, ack=Ack.ACKNOWLEDGED)
        effects: list[Effect] = [Count((Admitted(Admission(aid, cls, tenant, now), 0.0,
                                                 queued=False, adopted=True),))]
        effects.append(LocalAdopt(aid, cls, tenant) if self.local
                       else Send(Adopt(h.holding(aid))))
        return effects

    def taken_over(self, holdings: list[Holding]) -> list[Effect]:
        """This process took over its predecessor's admissions (same replica id): they still
        run in Envoy. Held unacknowledged until Envoy shows them (a periodic entry or their
        final one), so one that ended while no process ran still ends (ack timeout)."""
        now = self._clock()
        effects: list[Effect] = []
        for hd in holdings:
            if hd.id in self.held or not self.ended.adoptable(hd.id):
                # Held already, or ended here (this process took it over before and it
                # ended since: a restored older copy still shows the predecessor holding
                # it). Not held, it is dropped from the ledger by the next resync.
                continue
            self.held[hd.id] = Held(hd.cls, hd.tenant, now,
                                    stage=Stage.STREAMING if hd.first_byte else Stage.ADMITTED)
            if self.local:
                effects.append(LocalAdopt(hd.id, hd.cls, hd.tenant))
            effects.append(Count((Admitted(Admission(hd.id, hd.cls, hd.tenant, now), 0.0,
                                           queued=False, adopted=True),)))
        effects.append(Fault("taken_over"))
        return effects

    def ended_but_held(self, refused: Iterable[str],
                        can_stop: Callable[[str], bool]) -> list[Effect]:
        """Ids a resync listed as held here that the ledger had ended (preempted there, its
        notification lost). Never left running uncounted: one that can still be stopped
        (``can_stop``: its stop channel is open, before its first byte) is stopped as
        preempted (its slot is gone); one that cannot runs on, so it is counted in the ledger
        again (adopt: the ledger reports it, and the driver counts and logs that)."""
        effects: list[Effect] = []
        for aid in refused:
            h = self.held.get(aid)
            if h is None:
                continue
            if can_stop(aid):
                effects.append(Fault("ended_but_running_stopped", aid))
                effects += self.preempted(aid, PriorityClass.SYSTEM)
            else:
                effects.append(Send(Adopt(h.holding(aid))))
        return effects

    def started(self, status: FleetStatus) -> list[Effect]:
        """Start-up: the first register's answer. While the fleet re-registers after a loss
        (``settling``), replicas that held slots may not be in the ledger yet: admit
        nothing until it has settled, and keep no view from it (an outage meanwhile must
        not give a share computed from a ledger that lacks them: no view, no share)."""
        seen = Seen(status.by_class, status.live_replicas)
        self._note(status)
        was_local = self.local  # the register itself found a loss (lost() ran meanwhile)
        if status.settling > 0:
            self.fleet_settling()
            going = [] if was_local else [GoLocal("RuntimeError: fleet settling",
                                                  announce=False)]
            return [seen, *going, HoldLocal(self._wake_in(status.settling))]
        if was_local:
            # A loss with no settling window: stay degraded with no view; the heartbeat's
            # resync returns the replica as after any outage.
            return [seen]
        self.registered(_view(status))
        return [seen, Registered()]

    def _wake_in(self, settling: float) -> float | None:
        return settling if 0 < settling < self._interval else None

    def recovery_answered(self, status: FleetStatus, listed: list[Holding]) -> list[Effect]:
        """The recovery resync's answer (``listed``: what it listed as held). What the
        ledger ended meanwhile is released and stopped locally; then back to OK, or
        SETTLING (see :meth:`resync_answered`). On the return, the admissions that ended
        here while the resync was in flight are released in the ledger (it now holds them
        from the list, and nothing else would), and what it missed is sent
        (:meth:`returned`)."""
        effects: list[Effect] = []
        self._note(status)
        refused = set(status.refused)
        for aid in status.refused:  # ended in the ledger meanwhile (e.g. preempted)
            h = self.held.pop(aid, None)
            if h is not None:
                # The local core's Released event follows; its slot is not reused (the
                # ledger gave it away), whatever limit the answer sets below.
                h.move(Stage.RELEASED)
                self.ended.add(aid, ReleaseReason.PREEMPTED)
                # Stopped as a preempted request is; one past its first byte (its response
                # started without the ledger's word) runs on: counted and logged as a
                # preemption that could not be delivered, as preempted() does.
                effects += [LocalRelease(aid, ReleaseReason.PREEMPTED, reuse=False),
                            Stop(aid, undelivered=h.stage is not Stage.STOPPED)]
        late: list[Effect] = [Send(Release(hd.id, ReleaseReason.COMPLETED))
                              for hd in listed
                              if hd.id not in self.held and hd.id not in refused]
        seen = Seen(status.by_class, status.live_replicas)
        effects.append(seen)
        listed_ids = {hd.id for hd in listed}
        unlisted = sum(1 for aid in self.held if aid not in listed_ids)
        mode = self.resync_answered(known=status.known, settling=status.settling,
                                    held=len(self.held), view=_view(status),
                                    unlisted=unlisted,
                                    counted=len(listed_ids - refused))
        if unlisted:
            # Admitted while the resync was in flight (it hung, within L): the ledger has
            # the list, not these. Resync again at once; reuse only what it counts meanwhile.
            return [*effects, HoldLocal(0.0)]
        if mode is Mode.SETTLING:
            # The view stays the one from before the outage: after a data loss the ledger
            # knows only the replicas that have re-registered so far (the fleet settles
            # until every replica alive has). What this replica holds is in the ledger
            # again, but replicas that are back to ok admit against it without seeing
            # local admissions: only slots freed from now on are reused.
            return [*effects, HoldLocal(self._wake_in(status.settling))]
        return [*effects, seen, Return(), *late, *self.returned()]

    def arrive_answered(self, aid: str, cls: PriorityClass, tenant: str,
                        arrival: Arrival) -> tuple[Arrived, Admitted | None, list[Effect]]:
        """An arrive's reply: admitted (by preempting one of ours, maybe), 429, queued, or
        ``unregistered`` (our registration lapsed, or the server lost its data: decide
        locally until the heartbeat has re-registered what we hold)."""
        status = arrival.status
        if status is ArriveStatus.ADMITTED:
            effects: list[Effect] = []
            if arrival.victim is not None and arrival.victim_owner == self._replica:
                effects += self.preempted(arrival.victim, cls)
            event, more = self.admitted(aid, cls, tenant, waited=0.0, queued=False,
                                        preempted=arrival.victim is not None)
            return Arrived.ADMITTED, event, effects + more
        if status is ArriveStatus.REJECTED_QUEUE_FULL:
            self._waiters.pop(aid, None)
            return Arrived.REJECTED, None, [
                Count((Rejected(aid, cls, tenant, Outcome.REJECTED_QUEUE_FULL, 0.0),))]
        if status is ArriveStatus.QUEUED:
            return Arrived.QUEUED, None, []
        return Arrived.MOVED, None, self.lost(f"RuntimeError: arrive answered {status.value}")

    def timed_out(self, aid: str, cls: PriorityClass, tenant: str,
                  waited: float) -> list[Effect]:
        """A request's own queue deadline passed here (a waiter the ledger lost, or one
        queued locally): 503."""
        self._waiters.pop(aid, None)
        return [Count((Rejected(aid, cls, tenant, Outcome.REJECTED_QUEUE_TIMEOUT, waited),))]

    def client_left(self, aid: str, cls: PriorityClass, tenant: str,
                    waited: float) -> list[Effect]:
        """A waiting request's client left (its Check was cancelled) before it was
        admitted here (the driver releases one that was)."""
        self._waiters.pop(aid, None)
        return [Count((Rejected(aid, cls, tenant, Outcome.CLIENT_CANCELLED, waited),))]

    def data_loss(self, cause: str) -> list[Effect]:
        """A call found that the ledger lost writes (or repaired a key from its records:
        counted only). Lost writes are an outage and a return: resync and settle."""
        effects: list[Effect] = [Fault(cause)]
        if cause in DATA_LOSS:
            effects += self.lost(f"RuntimeError: ledger data loss: {cause}")
        return effects

    def signed(self, h: Held) -> None:
        """Envoy showed it runs the admission (ext_proc stream, first byte, periodic
        entry): acknowledged, or, when a liveness tracker decides, its timeout restarted."""
        if self.liveness_decides:
            h.renew(self._clock())  # like a lease renewed
        else:
            h.acknowledge()

    def stop_opened(self, aid: str) -> bool:
        """Its ext_proc stream opened (a channel to stop it): ADMITTED → PREEMPTIBLE. False:
        not held, or past its first byte (nothing to stop)."""
        h = self.held.get(aid)
        if h is None or h.first_byte:
            return False
        if h.stage is Stage.ADMITTED:
            h.move(Stage.PREEMPTIBLE)  # (opened again: it stays where it is)
        self.signed(h)
        return True

    def first_byte(self, aid: str) -> list[Effect] | None:
        """Its response started (or its stop channel closed): never a victim from here.
        None: not held, or already past it. The ledger hears of it only if it may hold
        it as a candidate (MARKED); a PREEMPTIBLE one's mark never left."""
        h = self.held.get(aid)
        if h is None or h.first_byte:
            return None
        marked = h.mark_sent
        h.move(Stage.STREAMING)
        self.signed(h)
        if self.local:
            return [LocalFirstByte(aid)]
        return [Send(MarkFirstByte(aid))] if marked else []

    def confirming(self, aid: str) -> list[Effect] | None:
        """The response is about to start: if the ledger may hold it as a candidate (its
        mark left) and decides now, its first byte is sent and the response waits for the
        answer (CONFIRMING). None: nothing to wait for."""
        h = self.held.get(aid)
        if h is None or h.first_byte or not h.mark_sent or self.local:
            return None
        h.move(Stage.CONFIRMING)
        self.signed(h)
        return [Send(MarkFirstByte(aid))]

    def confirmed(self, aid: str, ok: bool) -> None:
        """The first-byte mark's answer (no answer counts as ok: away from the ledger, the
        local share counts it): STREAMING, or STOPPED (preempted first: its caller
        answers 503, its notification follows)."""
        h = self.held.get(aid)
        if h is not None and h.stage is Stage.CONFIRMING:
            h.move(Stage.STREAMING if ok else Stage.STOPPED)

    def first_bytes_answered(self, ids: list[str], replies: Sequence[object] | None, *,
                             registration_lost: bool = False) -> list[Effect]:
        """The answer to a flush's first-byte marks (``ids``, in order): 1, still admitted
        (never a victim from now); 0, the ledger had already ended it (preempted: its
        notification is on the way). No answer (the call failed: the replica degrades),
        or one from a ledger that did not know this replica (an adoption or a reload in
        the same flush found it unknown: data loss, or a lapse): the responses go, the
        local share counts them. Trade-off: after a mere lapse a 0 may have been a real
        preemption, whose response then runs beside its preemptor until it ends (a lapse,
        a reload or adoption and a first byte in one flush); a false 503 after every data
        loss would be the common case instead."""
        if replies is None or registration_lost:
            effects: list[Effect] = [Answered(aid, True) for aid in ids]
            if registration_lost:
                # Registered again by that call: the others may not count us yet.
                self._heard = False
                # An outage and a return, as for the heartbeat.
                effects += self.lost("RuntimeError: registration lost")
            return effects
        return [Answered(aid, int(str(r)) > 0) for aid, r in zip(ids, replies, strict=True)]

    def adopt_answered(self, status: FleetStatus) -> list[Effect]:
        """An adoption's answer: ids the ledger had ended were counted again all the same
        (their streams run): each is a fault, never left uncounted."""
        self._note(status)
        return [Fault("ended_but_running_readded", aid) for aid in status.refused]

    def lost(self, error: str, *, announce: bool = True) -> list[Effect]:
        """A ledger call failed or timed out, found this replica unknown, or found that the
        ledger lost writes: the local core decides from now on (nothing if it already
        does)."""
        return [GoLocal(error, announce)] if self.ledger_lost() else []

    def heartbeat(self) -> Resync:
        """A heartbeat is due: the call to make (a recovery one moves the mode)."""
        holdings = tuple(h.holding(aid) for aid, h in self.held.items())
        if self.local:
            self.resync_sent()
            return Resync(holdings, recovery=True)
        return Resync(holdings, recovery=False)

    def heartbeat_answered(self, status: FleetStatus,
                           can_stop: Callable[[str], bool]) -> list[Effect]:
        """A steady-state resync's answer: what the ledger had ended is stopped or counted
        again; an unknown registration (it lapsed, or the server lost its data) is an
        outage and a return; else a new view."""
        effects = self.ended_but_held(status.refused, can_stop)
        self._note(status)
        if not status.known:
            return effects + self.lost("RuntimeError: registration lost")
        self.seen(_view(status))
        return [*effects, Seen(status.by_class, status.live_replicas)]

    def mark_due(self, aid: str) -> list[Effect]:
        """``aid``'s deferred preemptible mark is due: sent only for a request still
        before its first byte, with no mark sent yet, while the ledger decides."""
        h = self.held.get(aid)
        if h is None or h.stage is not Stage.PREEMPTIBLE or self.local:
            return []
        h.move(Stage.MARKED)
        return [Send(MarkPreemptible(aid))]

    def unacknowledged(self, cutoff: float) -> list[str]:
        """Admissions Envoy has not shown it runs since ``cutoff`` or earlier: to release
        (lease_expired). The one case a replica's heartbeat cannot cover: the client left
        just as Check answered, so no access-log entry or ext_proc stream will ever name it."""
        return [aid for aid, h in self.held.items() if h.ack_expired(cutoff)]

    def returned(self) -> list[Effect]:
        """Back to OK: what the ledger missed while this replica was away."""
        effects: list[Effect] = []
        for aid, h in self.held.items():
            if h.stage is Stage.PREEMPTIBLE:
                # Its stop channel opened while away: a candidate fleet-wide from now on.
                h.move(Stage.MARKED)
                effects.append(Send(MarkPreemptible(aid)))
            elif h.first_byte:
                # A first byte that came (or was dropped from the outbox) while away never
                # reached the ledger, which may still hold the admission as a candidate.
                effects.append(Send(MarkFirstByte(aid)))
        return effects

    def local_admitted(self, a: Admission) -> None:
        """The local core admitted ``a`` (a local mode): the mirror follows."""
        self.held[a.id] = Held(a.cls, a.tenant, a.admitted_at)

    def local_released(self, aid: str, reason: ReleaseReason) -> None:
        """The local core released ``aid``: the mirror follows."""
        gone = self.held.pop(aid, None)
        if gone is not None:
            gone.move(Stage.RELEASED)
        self.ended.add(aid, reason)


def _view(status: FleetStatus) -> View:
    return View(status.capacity, status.live_replicas, status.inflight, status.held)
