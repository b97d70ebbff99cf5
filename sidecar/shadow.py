"""Shadow mode (``--shadow``): admit everything, record what enforcement would have done.

:class:`ShadowCore` is an :class:`~sidecar.scheduler.AdmissionCore` that admits
every arrival at once and never queues, preempts or refuses. Alongside, it
feeds the same calls to the real core built from the same flags and YAML (the
*shadow*: a :class:`~sidecar.scheduler.Scheduler`, or legacy admission), and
reports each would-be decision through :meth:`PoolRecorder.shadow_admit`
(``smg_sidecar_shadow_admit_total``). The asyncio adapter, leases, liveness,
ext_proc and the access log work on the real side unchanged, so
``smg_scheduler_admit_total`` and the snapshot gauges say what really happened.

How the shadow stays close to enforcement under the same traffic
(docs/design.md, "Decisions where SMG's scheduler is silent", "Shadow mode"):

* A would-be admitted request holds a shadow slot until its real request ends
  (the final access-log entry), or until the shadow preempts it.
* A would-be queued request waits in the shadow queue: it expires at its
  queue timeout, or is shadow-admitted when a shadow slot frees after waiting
  ``W``. Enforcement would have started it ``W`` late and it would have run as
  long, so it holds its shadow slot until ``W`` after its real end (the real
  request may even have ended while it still waited).
* A would-be rejected request never holds a shadow slot.
* Preemption candidates are the same as under enforcement: the ext_proc stream
  opened and no first byte yet. A shadow victim keeps running for real; its
  shadow slot frees at once.
* The token bucket (``--rate-limit-tokens-per-second``) is taken in the shadow
  only: an empty bucket is a would-be ``rejected_queue_full``.

The would-be answer at Check time (:class:`Verdict`) goes into the allow's
dynamic metadata, so Envoy's access log carries it; a queued one's end
(admitted later, or timed out) is only in the metric.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass

from sidecar import responses
from sidecar.classes import HIGH_TO_LOW, PriorityClass
from sidecar.logs import ShadowSummary
from sidecar.metrics import PoolRecorder
from sidecar.ratelimit import TokenBucket
from sidecar.scheduler import (
    Admission,
    AdmissionCore,
    Admitted,
    ClassSettings,
    ClassSnapshot,
    Clock,
    Decision,
    Event,
    Outcome,
    Preempted,
    Queued,
    Rejected,
    Released,
    ReleaseReason,
    ReleaseResult,
    Snapshot,
    State,
)
from sidecar.scheduler.lifecycle import EndedIds

# Check-time answers (the ``shadow_outcome`` metadata value): the contract's outcome
# values, plus "queued" for a request enforcement would have held in its class queue.
QUEUED = "queued"
# Verdicts not taken by the Check that caused them (it cannot happen in the sidecar,
# which takes each at once) are forgotten past this many.
MAX_UNTAKEN_VERDICTS = 4096


@dataclass(frozen=True, slots=True)
class Verdict:
    """What enforcement would have answered this Check, at the time of the Check."""

    outcome: str
    """``admitted``, ``queued`` or ``rejected_queue_full``."""
    code: str = ""
    """The would-be ``X-SMG-Error-Code`` of a rejection ("" otherwise)."""
    status: int = 0
    """The would-be HTTP status of a rejection (0 otherwise)."""


ADMITTED = Verdict(Outcome.ADMITTED.value)
WOULD_QUEUE = Verdict(QUEUED)


def _rejected(outcome: Outcome, *, legacy: bool, rate_limited: bool = False) -> Verdict:
    r = responses.reply(responses.for_denial(outcome, legacy=legacy, rate_limited=rate_limited),
                        PriorityClass.DEFAULT)  # the class only words the message
    return Verdict(outcome.value, r.code, r.status)


class ShadowCore:
    """Admits every arrival; runs ``shadow`` on the same calls and reports its decisions."""

    def __init__(self, shadow: AdmissionCore, clock: Clock, metrics: PoolRecorder, *,
                 bucket: TokenBucket | None = None, remember_ended: int = 100_000,
                 summary: ShadowSummary | None = None) -> None:
        self.shadow = shadow
        # The verdict's log line and running totals (sidecar.logs), fed with each count.
        self.summary = summary
        self.legacy = shadow.legacy
        self._clock = clock
        self._metrics = metrics
        self._bucket = bucket
        # The real side: every admission in flight, and the ids that ended.
        self._held: dict[str, Admission] = {}
        self._inflight: dict[PriorityClass, int] = dict.fromkeys(PriorityClass, 0)
        self._ended = EndedIds(remember_ended)
        self._events: list[Event] = []
        # The shadow side's own bookkeeping (the shadow core holds the rest).
        self._shadow_queued: set[str] = set()
        self._ended_while_queued: dict[str, float] = {}  # id -> when its real request ended
        self._lag: dict[str, float] = {}  # shadow-admitted after waiting W, real still running
        self._due: list[tuple[float, str]] = []  # (when, id): shadow releases W after real end
        self._verdicts: OrderedDict[str, Verdict] = OrderedDict()
        self._rate_limited = _rejected(Outcome.REJECTED_QUEUE_FULL, legacy=self.legacy,
                                       rate_limited=True)
        self._full = _rejected(Outcome.REJECTED_QUEUE_FULL, legacy=self.legacy)

    # ------------------------------------------------------------------ shadow answers

    def take_verdict(self, id: str) -> Verdict | None:
        """The would-be answer to the Check that admitted ``id`` (once)."""
        return self._verdicts.pop(id, None)

    def shadow_snapshot(self) -> Snapshot:
        """The shadow's own state: would-be in flight and queued."""
        return self.shadow.snapshot()

    # ------------------------------------------------------------------ AdmissionCore

    def arrive(self, id: str, cls: PriorityClass, tenant: str, *,
               wait_budget: float | None = None, enforce: bool = False,
               cost: float = 1.0) -> Decision:
        now = self._clock()
        adm = Admission(id, cls, tenant, now)
        self._held[id] = adm
        self._inflight[cls] += 1
        admitted = Admitted(adm, waited=0.0, queued=False)
        self._events.append(admitted)
        self._remember(id, self._shadow_arrive(id, cls, tenant, wait_budget, enforce, cost))
        return admitted

    def _shadow_arrive(self, id: str, cls: PriorityClass, tenant: str,
                       wait_budget: float | None, enforce: bool, cost: float) -> Verdict:
        if self._bucket is not None and not self._bucket.try_take():
            self._decided(cls, tenant, Outcome.REJECTED_QUEUE_FULL)
            return self._rate_limited
        decision = self.shadow.arrive(id, cls, tenant, wait_budget=wait_budget,
                                      enforce=enforce, cost=cost)
        if isinstance(decision, Queued):
            self._shadow_queued.add(id)
        self._drain()  # counts an Admitted or Rejected decision from its event
        if isinstance(decision, Admitted):
            return ADMITTED
        if isinstance(decision, Queued):
            return WOULD_QUEUE
        if decision.outcome is Outcome.REJECTED_OVER_TARGET:
            return _rejected(decision.outcome, legacy=self.legacy)
        return self._full

    def _remember(self, id: str, verdict: Verdict) -> None:
        self._verdicts[id] = verdict
        if len(self._verdicts) > MAX_UNTAKEN_VERDICTS:
            self._verdicts.popitem(last=False)

    def cancel(self, id: str) -> bool:
        return False  # nothing really queues

    def release(self, id: str,
                reason: ReleaseReason = ReleaseReason.COMPLETED) -> ReleaseResult:
        adm = self._held.pop(id, None)
        if adm is None:
            return ReleaseResult.ALREADY_RELEASED if id in self._ended else ReleaseResult.UNKNOWN
        self._inflight[adm.cls] -= 1
        self._ended.add(id, reason)
        self._events.append(Released(adm, reason))
        now = self._clock()
        if id in self._shadow_queued:
            # Still waiting in the shadow: its service time is known now; see _drain.
            self._ended_while_queued[id] = now
        elif self.shadow.is_admitted(id):
            lag = self._lag.pop(id, 0.0)
            if lag > 0:
                heapq.heappush(self._due, (now + lag, id))
            else:
                self.shadow.release(id, reason)
        self._drain()
        return ReleaseResult.RELEASED

    def adopt(self, id: str, cls: PriorityClass, tenant: str) -> bool:
        if id in self._held or not self._ended.adoptable(id):
            return False
        adm = Admission(id, cls, tenant, self._clock(), State.STREAMING)
        self._held[id] = adm
        self._inflight[cls] += 1
        self._events.append(Admitted(adm, waited=0.0, queued=False, adopted=True))
        self.shadow.adopt(id, cls, tenant)  # it runs, so it holds a shadow slot too
        self._drain()
        return True

    def mark_preemptible(self, id: str) -> bool:
        adm = self._held.get(id)
        if adm is None:
            return False
        if adm.state is State.ADMITTED:
            adm.state = State.PREEMPTIBLE
        if self.shadow.is_admitted(id):
            self.shadow.mark_preemptible(id)  # a shadow victim candidate, as in enforcement
            self._drain()
        return True

    def mark_first_byte(self, id: str) -> bool:
        adm = self._held.get(id)
        if adm is None:
            return False
        adm.state = State.STREAMING
        if self.shadow.is_admitted(id):
            self.shadow.mark_first_byte(id)
            self._drain()
        return True

    def is_admitted(self, id: str) -> bool:
        return id in self._held

    def set_capacity(self, capacity: int) -> None:
        self.shadow.set_capacity(capacity)
        self._drain()

    def set_kv_capacity(self, tokens: int | None) -> None:
        """The shadow is gated by it; the real side admits everything, as ever."""
        self.shadow.set_kv_capacity(tokens)
        self._drain()

    def update_config(self, classes: Mapping[PriorityClass, ClassSettings]) -> None:
        self.shadow.update_config(classes)
        self._drain()

    def tick(self) -> None:
        now = self._clock()
        while self._due and self._due[0][0] <= now:
            _, id = heapq.heappop(self._due)
            if self.shadow.is_admitted(id):  # not preempted meanwhile
                self.shadow.release(id, ReleaseReason.COMPLETED)
        self.shadow.tick()
        self._drain()

    def predicted_wait(self, cls: PriorityClass) -> float | None:
        """What enforcement's queue would make an arrival wait (nothing waits here)."""
        return self.shadow.predicted_wait(cls)

    def next_deadline(self) -> float | None:
        due = self.shadow.next_deadline()
        if self._due and (due is None or self._due[0][0] < due):
            due = self._due[0][0]
        return due

    def snapshot(self) -> Snapshot:
        """What really is in flight (everything admitted, nothing queued), at the shadow's
        capacity and reservations: the contract's gauges describe the real traffic."""
        shadow = self.shadow.snapshot()
        return Snapshot(
            capacity=shadow.capacity,
            inflight=len(self._held),
            classes={c: ClassSnapshot(inflight=self._inflight[c], queue_depth=0,
                                      queue_limit=shadow.classes[c].queue_limit,
                                      reserved=shadow.classes[c].reserved)
                     for c in HIGH_TO_LOW},
        )

    def take_events(self) -> list[Event]:
        events, self._events = self._events, []
        return events

    # ------------------------------------------------------------------ internals

    def _decided(self, cls: PriorityClass, tenant: str, outcome: Outcome) -> None:
        self._metrics.shadow_admit(cls, outcome)
        if self.summary is not None:
            self.summary.add(cls.label, outcome.value, tenant)

    def _drain(self) -> None:
        """Count the shadow's decisions and keep its slot lifetimes like enforcement's."""
        for e in self.shadow.take_events():
            if isinstance(e, Admitted):
                id = e.admission.id
                if e.adopted:
                    continue  # not a decision of this process
                self._decided(e.admission.cls, e.admission.tenant, Outcome.ADMITTED)
                if id not in self._shadow_queued:
                    continue
                self._shadow_queued.discard(id)
                # Admitted after waiting W: enforcement would have run it W later, as long.
                ended = self._ended_while_queued.pop(id, None)
                if ended is not None:
                    heapq.heappush(self._due, (ended + e.waited, id))
                elif id in self._held:
                    self._lag[id] = e.waited
                else:  # unknown to the real side (cannot happen): hold nothing
                    heapq.heappush(self._due, (self._clock(), id))
            elif isinstance(e, Rejected):
                self._decided(e.cls, e.tenant, e.outcome)
                self._shadow_queued.discard(e.id)
                self._ended_while_queued.pop(e.id, None)
            elif isinstance(e, Preempted):
                self._decided(e.victim.cls, e.victim.tenant, Outcome.PREEMPTED)
                self._lag.pop(e.victim.id, None)
