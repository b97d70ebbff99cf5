"""The asyncio face of the admission core.

:class:`AdmissionController` turns the pure core into an awaitable ``admit()``
that a gRPC handler can hold open while its request is queued, and that undoes
itself when the call is cancelled (the client went away). It owns the two
things that keep slot accounting exact whatever fails:

* **Leases** (:class:`~sidecar.scheduler.leases.Leases`). Every admission has a
  lease; completion entries renew it and the final one releases it. A lease that
  is not renewed in time is reclaimed, so a lost completion cannot leak a slot
  forever. An admission Envoy acknowledged while its access-log stream was open
  is held without one (``hold_without_lease``): :mod:`sidecar.liveness` releases
  it if that Envoy dies, so no timer alone reclaims a request Envoy still runs.
  Which of the two an admission is in is kept by the lease table alone; liveness
  asks (``unleased``).
* **Idempotent release by admission id.** The core ignores a second release
  and counts it; nothing here keeps a second copy of "who is in flight".

One timer covers queue timeouts, starvation aging and lease expiry: it is armed
for the earliest deadline after every state change.

The calls here are the arrows of the admission's state table
(:mod:`sidecar.scheduler.lifecycle`): ``admit`` (arrive, cancel), ``release``,
``renew_or_adopt``, ``open_stop_channel`` (→ PREEMPTIBLE), ``mark_first_byte``
and ``close_stop_channel`` (→ STREAMING), and ``tick`` (timeouts, lease expiry).
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Callable, Mapping
from typing import Protocol

from sidecar import logs
from sidecar.classes import PriorityClass
from sidecar.metrics import NullPoolRecorder, PoolRecorder
from sidecar.ratelimit import TokenBucket
from sidecar.scheduler import (
    LEASE_EXPIRED,
    AdmissionCore,
    Admitted,
    ClassSettings,
    Event,
    Outcome,
    Preempted,
    Queued,
    Rejected,
    Released,
    ReleaseReason,
    ReleaseResult,
    Snapshot,
)
from sidecar.scheduler.leases import Leases
from sidecar.slottrace import SlotTrace


class Denied(Exception):
    """Admission refused; ``outcome`` says why, ``legacy`` which path refused."""

    def __init__(self, outcome: Outcome, *, legacy: bool, waited: float = 0.0,
                 rate_limited: bool = False, predicted: float | None = None) -> None:
        super().__init__(outcome.value)
        self.outcome = outcome
        self.legacy = legacy
        self.waited = waited
        self.rate_limited = rate_limited
        # The wait the core predicted for it (None: no estimate): computed Retry-After.
        self.predicted = predicted


log = logs.get("sidecar.admission")


def new_admission_id() -> str:
    """128 random bits, hex: unguessable, so nobody can release someone else's slot."""
    return secrets.token_hex(16)


class AdmissionsById(Protocol):
    """The calls keyed by an admission id (the access log, ext_proc, Envoy liveness):
    one pool's admission service, or :class:`sidecar.pools.Pools`, which routes each to
    the pool the id names."""

    @property
    def lease_count(self) -> int: ...
    def release(self, aid: str,
                reason: ReleaseReason = ReleaseReason.COMPLETED) -> ReleaseResult: ...
    def renew_or_adopt(self, aid: str, cls: PriorityClass | None = None,
                       tenant: str = "") -> bool: ...
    def open_stop_channel(self, aid: str) -> asyncio.Future[None] | None: ...
    def holds(self, aid: str) -> bool: ...
    def hold_without_lease(self, aid: str) -> bool: ...
    def lease_again(self, aid: str) -> bool: ...
    def unleased(self, aid: str) -> bool: ...
    def mark_first_byte(self, aid: str) -> bool: ...
    async def confirm_first_byte(self, aid: str) -> bool: ...
    def close_stop_channel(self, aid: str) -> None: ...


class AdmissionService(AdmissionsById, Protocol):
    """One pool's admission: :class:`AdmissionController` in process,
    :class:`sidecar.coordination.controller.FleetController` across a fleet."""

    @property
    def legacy(self) -> bool: ...
    async def admit(self, cls: PriorityClass, tenant: str, *,
                    wait_budget: float | None = None, enforce: bool = False,
                    cost: float = 1.0) -> Admitted: ...
    def set_capacity(self, capacity: int) -> None: ...
    def update_config(self, classes: Mapping[PriorityClass, ClassSettings]) -> None: ...
    def snapshot(self) -> Snapshot: ...
    def predicted_wait(self, cls: PriorityClass) -> float | None: ...
    def close(self) -> None: ...


class AdmissionController:
    """Awaitable admission over an :class:`AdmissionCore`, with leases."""

    def __init__(
        self,
        core: AdmissionCore,
        *,
        lease_secs: float,
        bucket: TokenBucket | None = None,
        metrics: PoolRecorder | None = None,
        clock: Callable[[], float] = time.monotonic,
        id_factory: Callable[[], str] = new_admission_id,
        trace: SlotTrace | None = None,
    ) -> None:
        self.core = core
        self._bucket = bucket
        self._metrics: PoolRecorder = metrics if metrics is not None else NullPoolRecorder()
        self._clock = clock
        self._new_id = id_factory
        self._waiters: dict[str, asyncio.Future[Admitted]] = {}
        # Under a lease, or held by its Envoy (no timer: sidecar.liveness).
        self._leases = Leases(lease_secs)
        # The stop signal of every admission with an open stop channel.
        self._stop_signals: dict[str, asyncio.Future[None]] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: float | None = None
        # Benchmarks only (bench.isolation's slot-time accounting); off unless the env says.
        self._trace = trace if trace is not None else SlotTrace.from_env()

    # ------------------------------------------------------------------ admission

    async def admit(self, cls: PriorityClass, tenant: str, *,
                    wait_budget: float | None = None, enforce: bool = False,
                    cost: float = 1.0) -> Admitted:
        """Admit now, wait in the class queue, or raise :class:`Denied`. ``wait_budget``
        and ``enforce``: the pool's deadline for this arrival (``Scheduler.arrive``);
        ``cost``: what it costs its tenant's fair turn (its tokens, ``fair_queuing:
        tokens``).

        Cancelling the awaiting task (Envoy cancels Check when the client leaves)
        removes the waiter, or gives back a slot granted in the same instant.
        """
        if self._bucket is not None:
            allowed = self._bucket.try_take()
            self._metrics.rate_limit(allowed)
            if not allowed:
                raise Denied(Outcome.REJECTED_QUEUE_FULL, legacy=self.core.legacy,
                             rate_limited=True)
        aid = self._new_id()
        decision = self.core.arrive(aid, cls, tenant, wait_budget=wait_budget, enforce=enforce,
                                    cost=cost)
        fut: asyncio.Future[Admitted] | None = None
        if isinstance(decision, Queued):
            fut = asyncio.get_running_loop().create_future()
            self._waiters[aid] = fut
            if self._trace is not None:
                self._trace.write("Q", aid, cls.label)
        self._apply_events()
        if isinstance(decision, Admitted):
            return decision
        if isinstance(decision, Rejected):
            raise Denied(decision.outcome, legacy=decision.legacy, waited=decision.waited,
                         predicted=decision.predicted)
        assert fut is not None
        try:
            return await fut
        except asyncio.CancelledError:
            if self.core.cancel(aid):
                self._apply_events()
            elif self.core.is_admitted(aid):
                # Admitted in the same loop iteration as the cancel: give it back.
                self.release(aid, ReleaseReason.CANCELLED)
            raise
        finally:
            self._waiters.pop(aid, None)

    def release(self, aid: str,
                reason: ReleaseReason = ReleaseReason.COMPLETED) -> ReleaseResult:
        """End an admission; a second or unknown release changes nothing (the caller
        counts it: :meth:`sidecar.pools.Pools.release`)."""
        result = self.core.release(aid, reason)
        if result is ReleaseResult.RELEASED:
            self._apply_events()
        return result

    def renew_or_adopt(self, aid: str, cls: PriorityClass | None = None,
                       tenant: str = "") -> bool:
        """A periodic completion entry: the request is still streaming; renew its lease.

        An id this process holds no lease for (it restarted while the stream
        ran, or reclaimed the lease while the stream kept running) is adopted
        when the entry names its class, so capacity in use is known again within
        one flush interval. False if it was neither renewed nor adopted.
        """
        if not self._leases.renew(aid, self._clock()):  # True too if held without one
            if cls is None or not self.core.adopt(aid, cls, tenant):
                return False
            self._apply_events()  # its Admitted event creates the lease
            log.info("adopted", admission_tag=logs.id_tag(aid), cls=cls.label, tenant=tenant)
        return True

    def open_stop_channel(self, aid: str) -> asyncio.Future[None] | None:
        """ADMITTED → PREEMPTIBLE: a channel to stop ``aid`` exists (its ext_proc stream).

        Returns the stop signal: a future resolved if the request is preempted,
        or ``None`` if the id is not in flight (unknown, finished, or already
        preempted). Only admissions with an open stop channel are candidates, so
        every victim has someone to tell.
        """
        if not self.core.is_admitted(aid):
            return None
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._stop_signals[aid] = fut
        self.core.mark_preemptible(aid)
        self._apply_events()  # a queued head may have preempted this very request
        return fut

    def holds(self, aid: str) -> bool:
        """``aid`` holds a slot here."""
        return self.core.is_admitted(aid)

    def hold_without_lease(self, aid: str) -> bool:
        """Its Envoy is watched and ran it: only its end or that Envoy's death frees it."""
        if not self.core.is_admitted(aid):
            return False
        self._leases.hold(aid)
        return True

    def lease_again(self, aid: str) -> bool:
        """Back under the lease from now (its Envoy may have been replaced)."""
        if not self._leases.lease_again(aid, self._clock()):
            return False
        self._arm_timer()
        return True

    def unleased(self, aid: str) -> bool:
        """Held without a lease (``hold_without_lease``): no timer reclaims it."""
        return self._leases.unleased(aid)

    def mark_first_byte(self, aid: str) -> bool:
        """→ STREAMING: the response started, so the request can no longer be preempted."""
        self._stop_signals.pop(aid, None)
        return self.core.mark_first_byte(aid)

    async def confirm_first_byte(self, aid: str) -> bool:
        """In process the core decides synchronously: a preemption has already fired the
        stop channel, so the response may always start (see the fleet's version)."""
        return True

    def close_stop_channel(self, aid: str) -> None:
        """→ STREAMING: the stop channel closed, so nothing could deliver a preemption."""
        self._stop_signals.pop(aid, None)
        self.core.mark_first_byte(aid)

    def set_capacity(self, capacity: int) -> None:
        self.core.set_capacity(capacity)
        self._apply_events()

    def set_kv_capacity(self, tokens: int | None) -> None:
        """``tokens.admit_by_kv``: the KV capacity in tokens admission is gated by (None:
        not gated)."""
        self.core.set_kv_capacity(tokens)
        self._apply_events()

    def update_config(self, classes: Mapping[PriorityClass, ClassSettings]) -> None:
        """Hot reload: new class knobs for new decisions (queued requests keep their place)."""
        self.core.update_config(classes)
        self._apply_events()

    @property
    def legacy(self) -> bool:
        return self.core.legacy

    def snapshot(self) -> Snapshot:
        return self.core.snapshot()

    def predicted_wait(self, cls: PriorityClass) -> float | None:
        """The wait an arrival of ``cls`` would have now (None: no estimate)."""
        return self.core.predicted_wait(cls)

    @property
    def lease_count(self) -> int:
        """Admissions in flight here: under a lease, or held without one."""
        return len(self._leases)

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    # ------------------------------------------------------------------ internals

    def _apply_events(self) -> None:
        """Apply the core's events: wake waiters, track leases, signal victims."""
        events = self.core.take_events()
        if events:
            now = self._clock()
            for e in events:
                if isinstance(e, Admitted):
                    aid = e.admission.id
                    self._leases.grant(aid, now)
                    fut = self._waiters.get(aid)
                    if fut is not None and not fut.done():
                        fut.set_result(e)
                elif isinstance(e, Rejected):
                    fut = self._waiters.get(e.id)
                    if fut is not None and not fut.done():
                        fut.set_exception(Denied(e.outcome, legacy=e.legacy, waited=e.waited,
                                                 predicted=e.predicted))
                elif isinstance(e, Released):
                    self._leases.drop(e.admission.id)
                elif isinstance(e, Preempted):
                    self._signal_preempted(e.victim.id)
            self._metrics.on_events(events)
            if self._trace is not None:
                self._trace_events(events)
        self._arm_timer()

    def _trace_events(self, events: list[Event]) -> None:
        assert self._trace is not None
        for e in events:
            if isinstance(e, Admitted):
                self._trace.write("A", e.admission.id, e.admission.cls.label)
            elif isinstance(e, Rejected):
                self._trace.write("X", e.id, e.outcome.value)
            elif isinstance(e, Released):
                self._trace.write("R", e.admission.id, e.reason.value)
            elif isinstance(e, Preempted):
                self._trace.write("P", e.victim.id, e.by_class.label)

    def _signal_preempted(self, aid: str) -> None:
        fut = self._stop_signals.pop(aid, None)
        if fut is not None and not fut.done():
            fut.set_result(None)

    def _arm_timer(self) -> None:
        due = self.core.next_deadline()
        lease_due = self._leases.next_expiry()
        if lease_due is not None:
            due = lease_due if due is None else min(due, lease_due)
        if due is None:
            return
        if self._timer is not None and self._timer_at is not None and self._timer_at <= due:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = due
        delay = max(0.0, due - self._clock())
        self._timer = asyncio.get_running_loop().call_later(delay, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._timer_at = None
        self.tick()

    def tick(self) -> None:
        """Time passed: queue timeouts, starvation promotions, lease expiry."""
        self.core.tick()
        for aid in self._leases.pop_expired(self._clock()):
            self.core.release(aid, LEASE_EXPIRED)  # counted from its Released event
        self._apply_events()
