"""Fleet-wide admission: one replica's admission controller over the shared ledger.

:class:`FleetController` offers the gRPC services the same calls as the in-process
:class:`~sidecar.admission.AdmissionController` (``admit``, ``release``, ``renew_or_adopt``,
the stop channel), but decides through :class:`~sidecar.coordination.ledger.FleetLedger`:

* ``admit``: one ``arrive`` (admitted, queued, or 429). A queued request waits on a local
  future that the event consumer resolves from the ledger's ``grant`` (admitted) or
  ``expired`` (503 queue timeout). A client that leaves is cancelled in the ledger; if the
  grant won the race the slot is released at once.
* ``release`` (the final access-log entry), the stop channel (``mark_preemptible``) and
  the first byte (``mark_first_byte``) answer from the local mirror of what this replica
  holds, synchronously, and reach the ledger through one ordered outbox (one ``multi``
  call per flush). The preemptible mark waits ``MARK_DELAY_SECS`` and is dropped if the
  response starts (or the request ends) first; once it has left, the response's first
  byte waits for the ledger's answer (``confirm_first_byte``), so a victim the ledger chose
  never starts. The ledger releases each id once fleet-wide; duplicates change nothing.
* A ``preempt`` notification for one of this replica's admissions is delivered through its
  ext_proc stream exactly like a local preemption: the victim's owner delivers it.
* No per-request leases: the replica's heartbeat covers its admissions, so a long stream
  without periodic access-log entries keeps its slot while the replica lives. A replica
  that dies loses them after ``--replica-ttl-secs``; an Envoy that dies while the replica
  lives loses them after ``--envoy-owner-grace-secs`` (:mod:`sidecar.liveness` calls
  ``release``).

**Degraded mode.** A ledger call that fails or takes longer than ``call_timeout``
switches the replica to a local :class:`~sidecar.scheduler.Scheduler` seeded with what the
replica holds, whose capacity is the degraded limit; the heartbeat keeps trying, and each
answer is a resync that makes the ledger's view of this replica exactly what it holds.
When it may admit locally, how much, and when it returns to ``ok`` are decided by the
pure core, and argued there (:mod:`sidecar.coordination.replica`: the limit and why
Σ ≤ C, the remaining window, partitions, settling after a loss).

The mode (starting, ok, degraded, resyncing, settling) is one value in the pure
:class:`~sidecar.coordination.replica.Replica`, moved only through its transition table
(the table, and what a resync's answer means, are documented there). The core also holds
the admissions (each with a stage and an acknowledgement from their own tables) and
decides what a notification, a release, an adoption or a resync's answer means, as
effects (:data:`~sidecar.coordination.replica.Effect`: ledger ops to send, waiters to
answer, stops to deliver, metric verbs). This class owns the connections, loops and
futures, and the local core that exists exactly while the mode is a local one, and does
what the effects say (``_apply``).

Carried-over admissions stay as they are in the local core: one before its first byte
whose stop channel (ext_proc stream) is open remains a preemption candidate, so a class
that may preempt takes it locally, and this replica, its owner, delivers the 503.

**One driver, two loops.** Every timer here (heartbeats, ticks, deferred marks, call
timeouts, waiters' deadlines, and those of the local core it builds) is armed on the
running loop's clock, which is also the only clock it reads. So the deterministic fleet
simulation (``tests/fleet_dsim.py``) runs this class as it is, on an event loop whose
clock is virtual, over a :class:`FleetLedger` whose sockets are simulated
(:meth:`FleetController.open` takes a ready ledger and notification client): the code the
simulation checks is the code that ships. The ledger ops it sends are typed
(:mod:`sidecar.coordination.outbox`, which also decides what one flush sends), and
:meth:`_apply` handles every effect type of the core exhaustively.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar, assert_never

import redis.asyncio as redis

from sidecar import logs
from sidecar.admission import AdmissionController, Denied, new_admission_id
from sidecar.classes import HIGH_TO_LOW, PriorityClass
from sidecar.config import DEFAULT_POOL
from sidecar.coordination.ledger import (
    CancelResult,
    Event,
    FleetLedger,
    FleetStatus,
    Holding,
)
from sidecar.coordination.outbox import Flush, Op, Outbox, Register
from sidecar.coordination.replica import (
    Answered,
    Arrived,
    Count,
    Effect,
    Expire,
    Fault,
    GoLocal,
    Grant,
    Held,
    HoldLocal,
    LocalAdopt,
    LocalCarry,
    LocalFirstByte,
    LocalRelease,
    Mode,
    Registered,
    Replica,
    Return,
    Seen,
    Send,
    Stop,
)
from sidecar.metrics import NullPoolRecorder, PoolRecorder
from sidecar.ratelimit import TokenBucket
from sidecar.scheduler import (
    Admitted,
    ClassSettings,
    ClassSnapshot,
    Outcome,
    Preempted,
    Rejected,
    Released,
    ReleaseReason,
    ReleaseResult,
    Scheduler,
    Snapshot,
    scaled_reservations,
)
from sidecar.scheduler import (
    Event as CoreEvent,
)

log = logs.get("sidecar.coordination")

T = TypeVar("T")

OK = "ok"
DEGRADED = "degraded"

# The local core's leases never expire: the replica's liveness covers its admissions.
_NO_LEASE_SECS = 10.0 * 365 * 24 * 3600
# How long one blocking pop of notifications waits before looping.
_EVENT_BLOCK_SECS = 1.0
# How long a preemptible mark waits before it is sent: a request whose response starts (or
# that ends) sooner needs neither mark, so the common short request costs the ledger only
# arrive + release. A queued preemptor waits at most this long for the candidate.
MARK_DELAY_SECS = 0.005
# Set in the task of a local admit that is being moved back to the ledger: its
# cancellation is not a client's, so it is not counted as client_cancelled.
_MOVING: contextvars.ContextVar[list[bool] | None] = contextvars.ContextVar(
    "fleet_moving", default=None)


class _Moved(Exception):
    """The controller changed mode while a request waited: decide it again in the new mode."""


@dataclass(slots=True)
class _Waiter:
    fut: asyncio.Future[Admitted]
    cls: PriorityClass
    tenant: str


def call_timeout_for(ttl: float) -> float:
    """How long a ledger call may take before the replica degrades: ttl/5, within
    [0.05, 1] s (so several heartbeats fit in a ttl)."""
    return max(0.05, min(1.0, ttl / 5))


class FleetController:
    """Admission for one replica of a fleet sharing a :class:`FleetLedger`."""

    legacy = False

    def __init__(
        self,
        ledger: FleetLedger,
        events_client: redis.Redis,
        *,
        classes: Mapping[PriorityClass, ClassSettings],
        capacity: int,
        call_timeout: float,
        ack_timeout: float = 30.0,
        bucket: TokenBucket | None = None,
        metrics: PoolRecorder | None = None,
        id_factory: Callable[[], str] = new_admission_id,
        mark_delay: float = MARK_DELAY_SECS,
        pool: str | None = None,
    ) -> None:
        self.ledger = ledger
        # With model pools, every line this controller logs names its pool.
        self._log = log if pool is None else log.bind(pool=pool)
        self._events_client = events_client
        self._classes = dict(classes)
        self._capacity = capacity
        self._call_timeout = call_timeout
        self._ack_timeout = ack_timeout
        self._interval = ledger.ttl / 3
        # After a loss the fleet settles this long from the first replica's resync (ledger
        # ops.resync): longer than any live replica's gap between two heartbeat attempts
        # (an interval plus a call that times out), with one interval to spare.
        self._settle = 2 * self._interval + call_timeout
        self._reap_every = ledger.ttl / 20
        # Older than any call in flight (a call taking longer degrades the replica).
        self._orphan_age = 4 * call_timeout
        self._bucket = bucket
        self._metrics: PoolRecorder = metrics if metrics is not None else NullPoolRecorder()
        # ONE clock for everything: the running loop's, which every timer here (marks,
        # ticks, heartbeats, call timeouts, the local core's deadlines) is armed on, so a
        # loop with a virtual clock (tests/fleet_dsim.py) runs this driver as it is.
        self._clock = asyncio.get_running_loop().time
        self._new_id = id_factory
        # The mode (ok, degraded, resyncing, settling) and the last view of the fleet, as
        # one pure state machine (sidecar.coordination.replica).
        self._core = Replica(interval=self._interval, clock=self._clock,
                             replica=ledger.replica)
        self._waiting: dict[str, _Waiter] = {}
        self._stop_signals: dict[str, asyncio.Future[None]] = {}
        # The local core: exists exactly while the mode is a local one (Replica.local).
        self._local: AdmissionController | None = None
        self._changed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._config_dirty = False
        self._outbox = Outbox()
        self._mark_delay = mark_delay
        self._marks: deque[tuple[float, str]] = deque()  # (loop time due, id), in order
        self._marks_timer: asyncio.TimerHandle | None = None
        # First-byte marks whose reply a response is waiting for (confirm_first_byte).
        self._first_byte_waits: dict[str, asyncio.Future[bool]] = {}
        self._outbox_wake = asyncio.Event()
        self._heartbeat_wake = asyncio.Event()
        self._tick_wake = asyncio.Event()
        self._tick_at: float | None = None
        self._tasks: list[asyncio.Task[None]] = []
        # Ordered (a dict, not a set of tasks hashed by id): aclose cancels them in the
        # order they started, the same on every run.
        self._background: dict[asyncio.Task[Any], None] = {}
        # A call that finds the ledger lost writes opens this replica's settling window;
        # the ledger reports losses and a predecessor's admissions as its replies are read.
        ledger.settle = self._settle
        ledger.on_loss = self._on_loss
        ledger.on_takeover = self._on_takeover
        ledger.on_live = self._on_live  # every reply's live count: the share's N

    # ------------------------------------------------------------------ lifecycle

    @classmethod
    async def connect(
        cls,
        url: str,
        *,
        fleet: str,
        replica: str,
        ttl: float,
        classes: Mapping[PriorityClass, ClassSettings],
        capacity: int,
        ack_timeout: float = 30.0,
        bucket: TokenBucket | None = None,
        metrics: PoolRecorder | None = None,
        max_connections: int = 64,
        mark_delay: float = MARK_DELAY_SECS,
        pool: str | None = None,
        id_factory: Callable[[], str] = new_admission_id,
    ) -> FleetController:
        """Connect and register; an unreachable server means starting degraded, not failing.

        ``pool``: with model pools, the pool this controller admits for (``sidecar.pools``),
        whose admission ids ``id_factory`` makes: a named pool's ledger is its own in the
        fleet (``ledger.prefix``), the default pool's the fleet's own; None: no pools.
        """
        call_timeout = call_timeout_for(ttl)
        # Bounded: a burst waits for a connection instead of opening thousands.
        connections = redis.BlockingConnectionPool.from_url(
            url, decode_responses=True, socket_timeout=call_timeout,
            socket_connect_timeout=call_timeout, max_connections=max_connections,
            timeout=max(call_timeout, ttl / 3))
        client = redis.Redis(connection_pool=connections)
        # The blocking pop holds its connection for up to _EVENT_BLOCK_SECS.
        events_client = redis.from_url(
            url, decode_responses=True, socket_timeout=_EVENT_BLOCK_SECS + call_timeout,
            socket_connect_timeout=call_timeout)
        # Registered for 0.9 ttl, and reaped within ttl/20 of that by any replica with
        # waiters: a dead replica's slots are back within --replica-ttl-secs.
        ledger = FleetLedger(client, fleet, replica, ttl=0.9 * ttl, pipelined=True,
                             pool=None if pool == DEFAULT_POOL else pool)
        return await cls.open(ledger, events_client, fleet=fleet, classes=classes,
                              capacity=capacity, call_timeout=call_timeout, ack_timeout=ack_timeout,
                              bucket=bucket, metrics=metrics, mark_delay=mark_delay,
                              id_factory=id_factory, pool=pool)

    @classmethod
    async def open(
        cls,
        ledger: FleetLedger,
        events_client: redis.Redis,
        *,
        fleet: str,
        classes: Mapping[PriorityClass, ClassSettings],
        capacity: int,
        call_timeout: float,
        ack_timeout: float = 30.0,
        bucket: TokenBucket | None = None,
        metrics: PoolRecorder | None = None,
        mark_delay: float = MARK_DELAY_SECS,
        id_factory: Callable[[], str] = new_admission_id,
        pool: str | None = None,
    ) -> FleetController:
        """:meth:`connect` over a ready ledger and notification client (the deterministic
        simulation hands in simulated ones): build, then register (an unreachable server
        means starting degraded)."""
        self = cls(ledger, events_client, classes=classes, capacity=capacity,
                   call_timeout=call_timeout, ack_timeout=ack_timeout, bucket=bucket,
                   metrics=metrics, mark_delay=mark_delay, id_factory=id_factory, pool=pool)
        try:
            status = await self._call(ledger.register(self._classes, capacity))
        except Exception as exc:
            self._log.warning("coordination_unreachable_at_startup", error=_describe(exc),
                              hint="starting degraded: no share until the server answers")
            self._degrade(exc, announce=False)
        else:
            self._apply(self._core.started(status))
            if self._core.mode is Mode.SETTLING:
                self._log.info("coordination_settling", fleet=fleet, replica=ledger.replica,
                               settling_secs=round(status.settling, 3))
            else:
                self._log.info("coordination_registered", fleet=fleet, replica=ledger.replica,
                               fleet_capacity=status.capacity,
                               live_replicas=status.live_replicas)
        return self

    def start(self, *, heartbeat: bool = True, notifications: bool = True) -> None:
        """Start the outbox loop and, unless told not to, the heartbeat and timer loops
        (``heartbeat=False``: a test that counts what one request costs the ledger) and
        the notification reader (``notifications=False``: a test that reads them itself
        and hands them to :meth:`notified`, to order them against a reply)."""
        loops: list[Callable[[], Coroutine[Any, Any, None]]] = [self._outbox_loop]
        if heartbeat:
            loops += [self._heartbeat_loop, self._tick_loop]
        if notifications:
            loops.append(self._event_loop)
        for loop in loops:
            self._tasks.append(asyncio.create_task(loop()))

    def heartbeat_now(self) -> None:
        """Run the next heartbeat now rather than at the end of its interval."""
        self._heartbeat_wake.set()

    async def aclose(self) -> None:
        tasks = [*self._tasks, *self._background]
        while pending := [t for t in (*tasks, *self._background) if not t.done()]:
            # (self._background again: a task being cancelled may start another.)
            for t in pending:
                t.cancel()
            # Cancelled again until done: on Python 3.11 a cancel that races a timeout
            # inside the redis client (the notification reader's blocking pop) can be
            # lost, and the loop would then run on and this wait forever.
            await asyncio.wait(pending, timeout=0.5)
        for t in tasks:
            if not t.cancelled():
                t.exception()  # retrieved: a loop that failed is not reported at exit
        self._tasks.clear()
        if self._local is not None:
            self._local.close()
        await self._events_client.aclose()
        await self.ledger.aclose()
        await self.ledger.client.aclose(close_connection_pool=True)

    def close(self) -> None:
        """Sync part of stopping (the in-process controller's interface); see :meth:`aclose`."""
        if self._local is not None:
            self._local.close()

    # ------------------------------------------------------------------ state

    @property
    def liveness_decides(self) -> bool:
        """Set when an EnvoyLiveness is wired to this controller (sidecar.app): then only it
        drops an admission's ack timeout (hold_without_lease: acknowledged while its Envoy
        is watched and alive), as the in-process lease; a sign from an Envoy never watched
        only restarts the timeout, so an Envoy that dies before its first access-log
        stream cannot leave slots held until this replica dies."""
        return self._core.liveness_decides

    @liveness_decides.setter
    def liveness_decides(self, value: bool) -> None:
        self._core.liveness_decides = value

    @property
    def state(self) -> str:
        """``ok`` or ``degraded`` (any mode in which the local core decides)."""
        return DEGRADED if self._core.local else OK

    @property
    def call_timeout(self) -> float:
        """How long a ledger call may take before this replica stops waiting for it."""
        return self._call_timeout

    @property
    def mode(self) -> Mode:
        """The replica's mode (see :mod:`sidecar.coordination.replica`)."""
        return self._core.mode

    @property
    def core(self) -> Replica:
        """The pure state machine behind this controller (read it; the driver moves it)."""
        return self._core

    @property
    def classes(self) -> Mapping[PriorityClass, ClassSettings]:
        """The class settings in force (the last :meth:`update_config`)."""
        return self._classes

    @property
    def held(self) -> Mapping[str, Held]:
        return self._core.held

    @property
    def fleet_capacity(self) -> int:
        return self._core.view.capacity

    @property
    def live_replicas(self) -> int:
        """N for the degraded share: the largest live count of the last view and of every
        ledger reply since (Replica.live_replicas)."""
        return self._core.live_replicas

    @property
    def share(self) -> int:
        """floor(capacity / live replicas): the most the degraded limit can ever be (0 while
        a replica registered earlier may not count this one yet: Replica.share)."""
        return self._core.share(self._capacity)

    @property
    def degraded_limit(self) -> int:
        """What this replica may hold on its own while degraded (sidecar.coordination.replica)."""
        return self._core.degraded_limit(self._capacity)

    def _local_limit(self) -> int:
        """The local core's capacity in every local mode (Replica.degraded_limit)."""
        return self._core.degraded_limit(self._capacity)

    @property
    def lease_count(self) -> int:
        """Admissions this replica holds (the adoption bound counts them)."""
        return len(self._core.held)

    @property
    def waiting(self) -> int:
        return len(self._waiting) + (self._local.waiting if self._local is not None else 0)

    def predicted_wait(self, cls: PriorityClass) -> float | None:
        """The ledger predicts no waits (docs/design.md, "Deadlines")."""
        return None

    def snapshot(self) -> Snapshot:
        """This replica's own in-flight and queue counts (the contract gauges stay per replica)."""
        if self._local is not None:
            return self._local.core.snapshot()
        capacity = self._core.view.capacity or self._capacity
        reserved = scaled_reservations(self._classes, capacity)
        inflight = dict.fromkeys(HIGH_TO_LOW, 0)
        for h in self._core.held.values():
            inflight[h.cls] += 1
        depth = dict.fromkeys(HIGH_TO_LOW, 0)
        for w in self._waiting.values():
            depth[w.cls] += 1
        return Snapshot(capacity, sum(inflight.values()), {
            c: ClassSnapshot(inflight[c], depth[c], self._classes[c].queue_size, reserved[c])
            for c in HIGH_TO_LOW})

    # ------------------------------------------------------------------ admission

    async def admit(self, cls: PriorityClass, tenant: str, *,
                    wait_budget: float | None = None, enforce: bool = False,
                    cost: float = 1.0) -> Admitted:
        """Admit through the ledger (or locally while degraded), wait, or raise :class:`Denied`.

        The ledger predicts no waits: ``wait_budget`` and ``enforce`` are not used (a
        pool in a fleet has no deadline: docs/design.md, "Deadlines"). Its fair queuing
        counts requests: ``cost`` is not used either (``fair_queuing: tokens`` is per
        request in a fleet)."""
        if self._bucket is not None:
            allowed = self._bucket.try_take()
            self._metrics.rate_limit(allowed)
            if not allowed:
                raise Denied(Outcome.REJECTED_QUEUE_FULL, legacy=False, rate_limited=True)
        arrived = self._clock()
        # First try: the deciding queue's own timeout (the ledger's, on its clock), with
        # this replica's as a backstop one call timeout later: a waiter the ledger lost (a
        # restored older copy, a lost key) expires here instead of waiting for the client.
        deadline: float | None = (arrived + self._classes[cls].queue_timeout_secs
                                  + self._call_timeout)
        while True:
            try:
                local = self._local
                if local is None:
                    return await self._admit_fleet(cls, tenant, arrived, deadline)
                return await self._admit_local(local, cls, tenant, arrived, deadline)
            except _Moved:
                # Moved between the ledger and the local queue: it keeps its first
                # deadline, so Envoy's ext_authz timeout still outlasts every wait.
                deadline = arrived + self._classes[cls].queue_timeout_secs
                continue

    def _timed_out(self, aid: str, cls: PriorityClass, tenant: str, arrived: float) -> Denied:
        waited = self._clock() - arrived
        self._apply(self._core.timed_out(aid, cls, tenant, waited))
        return Denied(Outcome.REJECTED_QUEUE_TIMEOUT, legacy=False, waited=waited)

    def _remaining(self, deadline: float | None) -> float | None:
        return None if deadline is None else max(0.0, deadline - self._clock())

    async def _admit_fleet(self, cls: PriorityClass, tenant: str, arrived: float,
                           deadline: float | None) -> Admitted:
        aid = self._new_id()
        fut: asyncio.Future[Admitted] = asyncio.get_running_loop().create_future()
        # Registered before the call: the grant may be read before the reply is.
        self._waiting[aid] = _Waiter(fut, cls, tenant)
        self._core.waiter_arrived(aid, cls, tenant)
        changed = self._changed
        try:
            try:
                arrival = await self._call(self.ledger.arrive(aid, cls, tenant))
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._degrade(exc)
                self._background_task(self._forget(aid))
                raise _Moved from None
            verdict, admitted, effects = self._core.arrive_answered(aid, cls, tenant, arrival)
            self._apply(effects)
            if admitted is not None:
                return admitted
            if verdict is Arrived.REJECTED:
                raise Denied(Outcome.REJECTED_QUEUE_FULL, legacy=False)
            if verdict is Arrived.MOVED:
                raise _Moved
            self._schedule_tick(min(arrival.timeout or 0.0, self._reap_every,
                                    self._classes[cls].starvation_threshold_secs))
            if not fut.done():
                await asyncio.wait((fut, changed), timeout=self._remaining(deadline),
                                   return_when=asyncio.FIRST_COMPLETED)
            if fut.done():
                return fut.result()
            if not changed.done():  # its first deadline passed
                self._background_task(self._forget(aid))
                raise self._timed_out(aid, cls, tenant, arrived)
            # Degraded while queued in the ledger: queue again locally.
            raise _Moved
        except asyncio.CancelledError:
            if aid in self._core.held:
                self.release(aid, ReleaseReason.CANCELLED)
            else:
                self._apply(self._core.client_left(aid, cls, tenant, self._clock() - arrived))
                self._background_task(self._forget(aid))
            raise
        finally:
            self._waiting.pop(aid, None)
            self._core.waiter_gone(aid)

    async def _forget(self, aid: str) -> None:
        """Take back a ledger arrival whose requester is gone (cancelled, or moved locally)."""
        if self._local is not None:
            return  # the next resync drops it
        try:
            result = await self._call(self.ledger.cancel(aid))
            if result is CancelResult.ADMITTED:
                await self._call(self.ledger.release(aid, ReleaseReason.CANCELLED))
        except Exception as exc:
            self._degrade(exc)

    def _admitted_now(self, aid: str, cls: PriorityClass, tenant: str, *, waited: float,
                      queued: bool, starvation: bool = False,
                      preempted: bool = False) -> Admitted:
        event, effects = self._core.admitted(aid, cls, tenant, waited=waited, queued=queued,
                                             starvation=starvation, preempted=preempted)
        self._apply(effects)
        return event

    async def _admit_local(self, local: AdmissionController, cls: PriorityClass,
                           tenant: str, arrived: float, deadline: float | None) -> Admitted:
        moving = [False]
        token = _MOVING.set(moving)
        try:
            task = asyncio.ensure_future(local.admit(cls, tenant))
        finally:
            _MOVING.reset(token)
        changed = self._changed
        try:
            await asyncio.wait((task, changed), timeout=self._remaining(deadline),
                               return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Denied):
                await task
            raise
        if not task.done():
            # Back to ok while queued locally (arrive at the ledger instead), or its
            # first deadline passed. Either way not a client leaving: not counted as one.
            moving[0] = True
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Denied):
                await task
            if task.cancelled() or task.exception() is not None:
                if changed.done():
                    raise _Moved
                raise self._timed_out("", cls, tenant, arrived)
        return task.result()

    # --------------------------------------------------------- the services' calls

    def release(self, aid: str,
                reason: ReleaseReason = ReleaseReason.COMPLETED) -> ReleaseResult:
        """End an admission; a second or unknown release changes nothing (the caller
        counts it: :meth:`sidecar.pools.Pools.release`)."""
        result, effects = self._core.release(aid, reason)
        if result is not ReleaseResult.RELEASED:
            return result  # counted by the caller (sidecar.pools.Pools.release)
        self._stop_signals.pop(aid, None)
        self._apply(effects)  # (while local, the mirror follows the local core's events)
        return result

    def renew_or_adopt(self, aid: str, cls: PriorityClass | None = None,
                       tenant: str = "") -> bool:
        """A periodic access-log entry. Held: nothing to renew (no per-request leases).

        An id this replica does not hold but the entry names the class of (this process
        restarted while the stream ran) is adopted: counted here and added to the ledger.
        """
        held = self._core.held.get(aid)
        if held is not None:
            self._core.signed(held)
            return True
        if cls is None:
            return False
        effects = self._core.adopted(aid, cls, tenant)
        if effects is None:
            return False
        self._apply(effects)
        self._log.info("adopted", admission_tag=logs.id_tag(aid), cls=cls.label, tenant=tenant)
        return True

    def open_stop_channel(self, aid: str) -> asyncio.Future[None] | None:
        """ADMITTED → PREEMPTIBLE (see :meth:`AdmissionController.open_stop_channel`)."""
        if not self._core.stop_opened(aid):
            return None
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._stop_signals[aid] = fut
        if self._local is not None:
            self._chain_stop_signal(self._local, aid)
        else:
            self._defer_mark(aid)
        return fut

    def _defer_mark(self, aid: str) -> None:
        self._marks.append((self._clock() + self._mark_delay, aid))
        if self._marks_timer is None:
            self._marks_timer = asyncio.get_running_loop().call_at(self._marks[0][0],
                                                                   self._send_due_marks)

    def _send_due_marks(self) -> None:
        """Send the preemptible marks whose delay is over, for requests still before their
        first byte; they join whatever the outbox sends next (one multi call)."""
        self._marks_timer = None
        now = self._clock()
        while self._marks and self._marks[0][0] <= now:
            _, aid = self._marks.popleft()
            self._apply(self._core.mark_due(aid))
        if self._marks:
            self._marks_timer = asyncio.get_running_loop().call_at(self._marks[0][0],
                                                                   self._send_due_marks)

    def mark_first_byte(self, aid: str) -> bool:
        self._stop_signals.pop(aid, None)
        effects = self._core.first_byte(aid)
        if effects is None:
            return False
        self._apply(effects)
        return True

    async def confirm_first_byte(self, aid: str) -> bool:
        """The response is about to start. True once the ledger can no longer choose it as a
        victim (then it is marked as past its first byte); False if the ledger preempted it
        first: its stop channel stays open and the caller answers 503 instead, so a request
        counted as preempted never runs on.

        Waits for the ledger only when its preemptible mark was sent (the request waited
        longer than the mark delay); otherwise, and while degraded, it answers at once.
        """
        effects = self._core.confirming(aid)
        if effects is None:
            return True
        fut = self._first_byte_waits.get(aid)
        if fut is None:
            fut = self._first_byte_waits[aid] = asyncio.get_running_loop().create_future()
        self._apply(effects)
        try:
            # A switch to degraded mode drops the outbox: stop waiting then too.
            await asyncio.wait((fut, self._changed), timeout=2 * self._call_timeout,
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            self._first_byte_waits.pop(aid, None)
        # No answer: the ledger is away (degraded), and the local share counts it from here.
        ok = fut.result() if fut.done() else True
        if ok:
            self._stop_signals.pop(aid, None)
        self._core.confirmed(aid, ok)
        return ok

    def close_stop_channel(self, aid: str) -> None:
        self.mark_first_byte(aid)

    def set_capacity(self, capacity: int) -> None:
        """A new measured capacity: reported with the next heartbeat (sent at once)."""
        if capacity == self._capacity:
            return
        self._capacity = capacity
        if self._local is not None:
            self._local.set_capacity(self._local_limit())
        self._heartbeat_wake.set()

    def update_config(self, classes: Mapping[PriorityClass, ClassSettings]) -> None:
        """Hot reload: store the new class settings in the ledger (they become the fleet's).
        Its registration is sent again on the return to ``ok`` if the replica is away, goes
        away before it is sent, or its call fails (``_config_dirty``)."""
        self._classes = dict(classes)
        if self._local is not None:
            self._local.update_config(classes)
            self._config_dirty = True  # the outbox is not sent while degraded
        self._send(Register())

    # ------------------------------------------------------------------ notifications

    def notified(self, events: Iterable[Event]) -> None:
        """Notifications from the ledger (grants, expiries, preemptions), in order."""
        for e in events:
            self._on_event(e)

    def _on_event(self, e: Event) -> None:
        self._apply(self._core.notified(e))

    def _stop(self, aid: str, *, undelivered: bool) -> None:
        """Deliver a preemption to its request through its stop channel."""
        if not self._signal_preempted(aid) and undelivered:
            # Its response started without the ledger's word (confirm_first_byte gave up:
            # the server was away): it has no stop channel any more and runs on, uncounted.
            self._log.warning("preemption_delivery_failed", admission_tag=logs.id_tag(aid),
                        error="response already started")
            self._metrics.preemption_undelivered()

    def _apply(self, effects: Iterable[Effect]) -> None:
        """Do what the core decided, in its order. Exhaustive: a new effect type that is
        not handled here fails the type check (assert_never), never a silent branch."""
        for fx in effects:
            match fx:
                case Send(op):
                    self._send(op)
                case Count(events):
                    self._metrics.on_events(list(events))
                case Stop(aid, undelivered):
                    self._stop(aid, undelivered=undelivered)
                case Grant(aid, admitted):
                    w = self._waiting.get(aid)
                    if w is not None and not w.fut.done():
                        w.fut.set_result(admitted)
                case Expire(aid, waited):
                    w = self._waiting.get(aid)
                    if w is not None and not w.fut.done():
                        w.fut.set_exception(Denied(Outcome.REJECTED_QUEUE_TIMEOUT,
                                                   legacy=False, waited=waited))
                case GoLocal(error, announce):
                    self._go_local(error, announce=announce)
                case Seen(by_class, live_replicas):
                    self._metrics.fleet_seen(by_class, live_replicas)
                case HoldLocal(wake_in):
                    self._hold_local(wake_in)
                case Return():
                    self._return()
                case Registered():
                    self._metrics.coordination_changed(OK)
                case Answered(aid, ok):
                    fut = self._first_byte_waits.get(aid)
                    if fut is not None and not fut.done():
                        fut.set_result(ok)
                case Fault(kind, aid):
                    self._fault(kind, aid)
                # The local core's effects come only while a local mode lasts, when the
                # local core exists (the core emits them only then: Replica.local).
                case LocalRelease(aid, reason, reuse):
                    local = self._in_local(fx)
                    if not reuse:  # the ledger gave the slot away: not the local core's
                        local.set_capacity(max(0, local.core.snapshot().capacity - 1))
                    local.release(aid, reason)  # the mirror follows its events
                case LocalCarry(aid, cls, tenant, admitted_at, streaming):
                    core = self._in_local(fx).core
                    assert isinstance(core, Scheduler)  # _go_local builds it
                    core.carry(aid, cls, tenant, admitted_at, streaming=streaming)
                case LocalFirstByte(aid):
                    self._in_local(fx).mark_first_byte(aid)
                case LocalAdopt(aid, cls, tenant):
                    local = self._in_local(fx)
                    local.core.adopt(aid, cls, tenant)
                    local.core.take_events()  # counted by the core's own Count
                case _:
                    assert_never(fx)

    def _in_local(self, fx: Effect) -> AdmissionController:
        """The local core a local-core effect is for: it exists exactly while the mode is
        a local one, which is the only time the core emits such effects."""
        local = self._local
        if local is None:
            raise AssertionError(f"{fx!r} with no local core (mode {self._core.mode.value})")
        return local

    def _fault(self, kind: str, aid: str) -> None:
        self._metrics.coordination_fault(kind)
        if kind == "ended_but_running_stopped":
            self._log.warning("coordination_ended_but_running", admission_tag=logs.id_tag(aid),
                              action="stopped")
        elif kind == "ended_but_running_readded":
            self._log.warning("coordination_ended_but_running", admission_tag=logs.id_tag(aid),
                              action="readded", hint="the ledger had ended an admission "
                              "Envoy reports running: counted again")

    def _signal_preempted(self, aid: str) -> bool:
        fut = self._stop_signals.pop(aid, None)
        if fut is not None and not fut.done():
            fut.set_result(None)
            return True
        return False

    # ------------------------------------------------------------------ degraded mode

    def _degrade(self, exc: BaseException, *, announce: bool = True) -> None:
        """Server unreachable or slow: admit locally within the degraded share."""
        self._apply(self._core.lost(_describe(exc), announce=announce))

    def _go_local(self, error: str, *, announce: bool) -> None:
        """The mode just became a local one: build the local core from what is held."""
        assert self._local is None and self._core.local
        # The resync on return covers what it held; a reload's registration is sent again.
        if self._outbox.clear():
            self._config_dirty = True
        limit = self.degraded_limit
        core = Scheduler(self._classes, limit, self._clock)
        for aid, h in self._core.held.items():
            # Carried over as they stand (they count, even past the limit).
            core.carry(aid, h.cls, h.tenant, h.admitted_at, streaming=h.first_byte)
        local = self._local = AdmissionController(
            core, lease_secs=_NO_LEASE_SECS, metrics=_LocalRecorder(self), clock=self._clock,
            id_factory=self._new_id)
        # Carried-over admissions whose stop channel is open (ext_proc stream, no first
        # byte yet) stay preemption candidates locally, in the order they were admitted.
        for aid in sorted((a for a in self._stop_signals if a in self._core.held),
                          key=lambda a: self._core.held[a].admitted_at):
            self._chain_stop_signal(local, aid)
        self._metrics.coordination_changed(DEGRADED)
        if announce:
            view = self._core.view
            self._log.warning("coordination_degraded", error=error, share=limit,
                        fleet_capacity=view.capacity, live_replicas=view.live_replicas,
                        fleet_inflight=view.inflight, held=len(self._core.held),
                        queued_in_ledger=len(self._waiting))
        self._wake_movers()
        self._heartbeat_wake.set()

    def _chain_stop_signal(self, local: AdmissionController, aid: str) -> None:
        """Open ``aid``'s stop channel in the local core; its preemption stops the request."""
        inner = local.open_stop_channel(aid)
        if inner is not None:
            inner.add_done_callback(lambda _: self._signal_preempted(aid))

    def _wake_movers(self) -> None:
        changed, self._changed = self._changed, asyncio.get_running_loop().create_future()
        changed.set_result(None)

    async def _try_recover(self, listed: list[Holding]) -> None:
        """Degraded: resync with the ledger; back to ok once it is safe (see Replica)."""
        local = self._local
        assert local is not None
        # The limit while the resync is in flight (Replica.resync_sent: L from DEGRADED,
        # nothing reused from SETTLING): a resync that hangs until its call timeout must
        # not stop a degraded replica admitting within its limit.
        local.set_capacity(self._local_limit())
        try:
            if self._outbox.clear():
                self._config_dirty = True
            # Arrivals whose reply may still be on its way: an admission stays in the
            # ledger (the reply makes it held here; the next resync lists it), a waiter
            # goes (its requester moves to the local queue, nobody would collect a grant).
            status = await self._call(self.ledger.resync(listed, self._capacity,
                                                         settle=self._settle,
                                                         in_flight=list(self._waiting)))
        except BaseException:
            # Unreachable again: the outage rule, and a whole interval of answers again.
            self._core.resync_failed()
            local.set_capacity(self._local_limit())
            raise
        self._apply(self._core.recovery_answered(status, listed))

    def _return(self) -> None:
        """Back to ok (Replica.recovery_answered): the ledger decides again."""
        local = self._local
        assert local is not None and self._core.mode is Mode.OK
        self._local = None
        local.close()
        self._metrics.coordination_changed(OK)
        view = self._core.view
        self._log.info("coordination_ok", fleet_capacity=view.capacity,
                 live_replicas=view.live_replicas, held=len(self._core.held),
                 requeued=local.waiting)
        self._wake_movers()  # local waiters arrive at the ledger now
        if self._config_dirty:
            self._config_dirty = False
            self._send(Register())
        self._outbox_wake.set()

    def _can_stop(self, aid: str) -> bool:
        """Its stop channel is open (Replica.ended_but_held stops it rather than re-adding)."""
        stop = self._stop_signals.get(aid)
        return stop is not None and not stop.done()

    def _on_loss(self, cause: str, seen: int) -> None:
        """A call found that the ledger lost writes (ledger.lua lose(), reconcile())."""
        self._log.warning("coordination_data_loss", cause=cause, generation_seen=seen,
                    generation=self.ledger.generation, held=len(self._core.held))
        self._apply(self._core.data_loss(cause))

    def _on_takeover(self, holdings: list[Holding]) -> None:
        """This process took over its predecessor's admissions (same replica id)."""
        before = len(self._core.held)
        self._apply(self._core.taken_over(holdings))
        self._log.warning("coordination_took_over", replica=self.ledger.replica,
                    admissions=len(self._core.held) - before,
                    hint="a previous process with this replica id held them")

    def _on_live(self, n: int) -> None:
        """A reply counted ``n`` live replicas. More than before: a replica joined, and it
        takes no degraded share until we are known to count it (ledger.lua unheard_by):
        heartbeat now rather than up to an interval later, so the ledger hears it."""
        grew = n > self._core.live_replicas
        self._core.live_seen(n)
        if self._local is not None:
            # N moves the share: the local core follows at once (a reply read while away,
            # e.g. an arrive's that returned after the switch).
            self._local.set_capacity(self._local_limit())
        if grew:
            self._heartbeat_wake.set()

    def _hold_local(self, wake_in: float | None) -> None:
        """Settling, the server answering: reuse only the core's ``recycle`` slots locally,
        and ask again as soon as the fleet has settled rather than a whole interval later."""
        if self._local is not None:
            self._local.set_capacity(self._local_limit())
        if wake_in is not None:
            asyncio.get_running_loop().call_later(wake_in + 0.001, self._heartbeat_wake.set)

    # ------------------------------------------------------------------ loops

    async def _call(self, call: Awaitable[T]) -> T:
        # A timeout scope, not wait_for: no task per call (this is on every request's path).
        async with asyncio.timeout(self._call_timeout):
            return await call


    def holds(self, aid: str) -> bool:
        return aid in self._core.held

    def hold_without_lease(self, aid: str) -> bool:
        """Its Envoy ran it (sidecar.liveness): kept until its end, a preemption, or the
        death of that Envoy (released by the liveness tracker) or of this replica."""
        h = self._core.held.get(aid)
        if h is None:
            return False
        h.acknowledge()
        return True

    def lease_again(self, aid: str) -> bool:
        """Its Envoy may have been replaced: unacknowledged again, ack timeout from now."""
        h = self._core.held.get(aid)
        if h is None:
            return False
        h.unacknowledge(self._clock())
        return True

    def unleased(self, aid: str) -> bool:
        """Acknowledged (hold_without_lease): no ack timeout reclaims it."""
        h = self._core.held.get(aid)
        return h is not None and h.acknowledged

    def expire_unacknowledged(self) -> int:
        """Release admissions Envoy never showed it runs, ``ack_timeout`` after admission.

        The one case a replica's heartbeat cannot cover: the client left just as Check
        answered, so Envoy never learned the id and no access-log entry or ext_proc
        stream will ever name it (the in-process path's lease covers the same case).
        Anything Envoy acknowledged is kept for as long as the replica lives.
        """
        cutoff = self._clock() - self._ack_timeout
        stale = self._core.unacknowledged(cutoff)
        for aid in stale:
            self.release(aid, ReleaseReason.LEASE_EXPIRED)
        return len(stale)

    async def _heartbeat_loop(self) -> None:
        while True:
            self._heartbeat_wake.clear()
            self.expire_unacknowledged()
            try:
                call = self._core.heartbeat()
                if not call.recovery:
                    # A resync rather than a bare heartbeat: it also drops what a late-run
                    # call left in the ledger for us (e.g. an arrive that timed out here but
                    # ran when a paused server resumed).
                    status = await self._call(self.ledger.resync(
                        list(call.holdings), self._capacity, min_age=self._orphan_age,
                        waiting=list(self._waiting), settle=self._settle))
                    self._apply(self._core.heartbeat_answered(status, self._can_stop))
                else:
                    await self._try_recover(list(call.holdings))
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._degrade(exc)
            # Not yet known to be counted by every other replica (no share of our own): ask
            # again soon, once they have heard of us.
            wait = (self._interval / 4 if self._core.mode is Mode.OK and not self._core.heard
                    else self._interval)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._heartbeat_wake.wait(), wait)

    async def _event_loop(self) -> None:
        while True:
            try:
                events = await self.ledger.next_events(_EVENT_BLOCK_SECS,
                                                       client=self._events_client)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._log.debug("coordination_events_unreachable", error=_describe(exc))
                await asyncio.sleep(self._interval / 4)
                continue
            self.notified(events)

    def _schedule_tick(self, delay: float) -> None:
        at = self._clock() + max(0.0, delay) + 0.001
        if self._tick_at is None or at < self._tick_at:
            self._tick_at = at
            self._tick_wake.set()

    async def _tick_loop(self) -> None:
        while True:
            self._tick_wake.clear()
            due = self._tick_at
            if due is None:
                await self._tick_wake.wait()
                continue
            delay = due - self._clock()
            if delay > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._tick_wake.wait(), delay)
                continue
            self._tick_at = None
            if self._local is not None:
                continue
            try:
                nxt = await self._call(self.ledger.tick())
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._degrade(exc)
                continue
            if self._waiting:
                # Our waiters also wait for a dead replica's slots: the ledger reaps on
                # any call, so call often enough to hand them over within the TTL.
                nxt = self._reap_every if nxt is None else min(nxt, self._reap_every)
            if nxt is not None:
                self._schedule_tick(nxt)

    def _send(self, op: Op) -> None:
        self._outbox.push(op)
        self._outbox_wake.set()

    async def _outbox_loop(self) -> None:
        """One ordered channel for releases, marks, adoptions and config: each flush
        sends everything queued (what goes in which call: sidecar.coordination.outbox)."""
        while True:
            await self._outbox_wake.wait()
            self._outbox_wake.clear()
            while self._outbox and self._local is None:
                flush = self._outbox.take()
                if flush.empty:
                    continue
                try:
                    await self._call(self._flush(flush))
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    if flush.register:
                        # A reload's registration that may not have run: the only call that
                        # stores the class settings (a resync does not), so it is sent
                        # again on the return.
                        self._config_dirty = True
                    self._degrade(exc)

    async def _flush(self, flush: Flush) -> None:
        """Send one flush (its batch, adoptions and registration at once) and answer the
        first-byte marks it carried."""
        calls: list[Awaitable[Any]] = [self._adopt(h) for h in flush.adopt]
        if flush.register:
            calls.append(self.ledger.register(self._classes, self._capacity,
                                              settle=self._settle))
        if flush.batch:
            calls.append(self.ledger.batch(flush.batch))
        first_byte = list(flush.first_byte)
        try:
            replies = await asyncio.gather(*calls)
        except BaseException:
            self._apply(self._core.first_bytes_answered(first_byte, None))
            raise
        # An adoption or a reload may be the first call to find this replica unknown (data
        # loss, or its registration lapsed): it registered it, without the rest of its
        # holdings, and this flush's first-byte marks met a ledger without them.
        lost = any(isinstance(r, FleetStatus) and not r.known for r in replies)
        if lost or flush.batch:
            marks = flush.first_byte_answers(replies[-1]) if flush.batch and not lost else None
            self._apply(self._core.first_bytes_answered(first_byte, marks,
                                                        registration_lost=lost))

    async def _adopt(self, h: Holding) -> FleetStatus:
        """Add a running stream Envoy reported to the ledger, even one the ledger had ended
        (its slot is in use); such an id is counted and logged, never left uncounted."""
        status = await self.ledger.adopt([h], self._capacity, settle=self._settle)
        self._apply(self._core.adopt_answered(status))
        return status

    def _background_task(self, coro: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._background[task] = None
        task.add_done_callback(self._background_done)

    def _background_done(self, task: asyncio.Task[Any]) -> None:
        self._background.pop(task, None)


class _LocalRecorder(NullPoolRecorder):
    """The degraded-mode core's events: keep the mirror in step, then count them.

    Only what the local :class:`AdmissionController` reports is forwarded; every other
    verb is fed by its usual caller.
    """

    def __init__(self, owner: FleetController) -> None:
        self._o = owner

    def on_events(self, events: Iterable[CoreEvent]) -> None:
        o = self._o
        counted: list[CoreEvent] = []
        for e in events:
            if isinstance(e, Admitted):
                if e.adopted:
                    continue
                o._core.local_admitted(e.admission)
            elif isinstance(e, Released):
                o._core.local_released(e.admission.id, e.reason)
            elif isinstance(e, Preempted):
                # Its stop goes out in this very step, ahead of its preemptor's answer (the
                # chained channel's callback would take one more loop turn).
                o._signal_preempted(e.victim.id)
            elif isinstance(e, Rejected) and e.outcome is Outcome.CLIENT_CANCELLED:
                moving = _MOVING.get()
                if moving is not None and moving[0]:
                    continue  # moved to the ledger, not a client leaving
            counted.append(e)
        if counted:
            o._metrics.on_events(counted)

    def rate_limit(self, allowed: bool) -> None:
        self._o._metrics.rate_limit(allowed)


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
