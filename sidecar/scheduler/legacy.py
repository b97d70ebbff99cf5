"""The legacy path: ``--max-concurrent-requests`` with one FIFO queue, no classes.

Serves when the scheduler is off, or when the reservations do not fit the
capacity at start-up. It never preempts, so an admission goes ADMITTED →
STREAMING → released (see :mod:`sidecar.scheduler.lifecycle`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field

from sidecar.classes import HIGH_TO_LOW, PriorityClass
from sidecar.scheduler.interface import ClassSnapshot, Clock, Snapshot
from sidecar.scheduler.lifecycle import (
    Admission,
    Admitted,
    Decision,
    EndedIds,
    Event,
    Outcome,
    Queued,
    Rejected,
    Released,
    ReleaseReason,
    ReleaseResult,
    State,
    Waiter,
)
from sidecar.scheduler.queues import first
from sidecar.scheduler.settings import ClassSettings


@dataclass(slots=True)
class LegacyAdmission:
    """The legacy concurrency limit: one FIFO queue, no classes in the decision.

    ``limit`` None means no concurrency cap (``--max-concurrent-requests`` <= 0).
    ``measured``: the workers' capacity, reported (never enforced) when there is no cap,
    so an uncapped pool's capacity series shows what its workers can run, not 0.
    """

    limit: int | None
    queue_size: int
    queue_timeout_secs: float
    clock: Clock
    measured: int = 0
    legacy: bool = True
    _admitted: dict[str, Admission] = field(default_factory=dict)
    _queue: OrderedDict[str, Waiter] = field(default_factory=OrderedDict)
    _ended: EndedIds = field(default_factory=EndedIds)
    _events: list[Event] = field(default_factory=list)

    def _has_slot(self) -> bool:
        return self.limit is None or len(self._admitted) < self.limit

    def arrive(self, id: str, cls: PriorityClass, tenant: str, *,
               wait_budget: float | None = None, enforce: bool = False,
               cost: float = 1.0) -> Decision:
        """Legacy admission predicts nothing: a wait budget never refuses here (one FIFO:
        a cost changes nothing)."""
        now = self.clock()
        self._dispatch(now)
        if not self._queue and self._has_slot():
            return self._admit(id, cls, tenant, now, 0.0, queued=False)
        if len(self._queue) >= self.queue_size:
            event = Rejected(id, cls, tenant, Outcome.REJECTED_QUEUE_FULL, 0.0, legacy=True)
            self._events.append(event)
            return event
        waiter = Waiter(id, cls, tenant, now, now + self.queue_timeout_secs)
        self._queue[id] = waiter
        return Queued(waiter)

    def cancel(self, id: str) -> bool:
        waiter = self._queue.pop(id, None)
        if waiter is None:
            return False
        now = self.clock()
        self._events.append(Rejected(id, waiter.cls, waiter.tenant, Outcome.CLIENT_CANCELLED,
                                     now - waiter.enqueued_at, legacy=True))
        return True

    def release(self, id: str,
                reason: ReleaseReason = ReleaseReason.COMPLETED) -> ReleaseResult:
        adm = self._admitted.pop(id, None)
        if adm is None:
            return ReleaseResult.ALREADY_RELEASED if id in self._ended else ReleaseResult.UNKNOWN
        self._ended.add(id, reason)
        self._events.append(Released(adm, reason))
        self._dispatch(self.clock())
        return ReleaseResult.RELEASED

    def adopt(self, id: str, cls: PriorityClass, tenant: str) -> bool:
        if id in self._admitted or id in self._queue or not self._ended.adoptable(id):
            return False
        adm = Admission(id, cls, tenant, self.clock(), State.STREAMING)
        self._admitted[id] = adm
        self._events.append(Admitted(adm, 0.0, queued=False, adopted=True))
        return True

    def mark_preemptible(self, id: str) -> bool:
        return False  # the legacy path never preempts

    def mark_first_byte(self, id: str) -> bool:
        adm = self._admitted.get(id)
        if adm is None or adm.state is State.STREAMING:
            return False
        adm.state = State.STREAMING
        return True

    def is_admitted(self, id: str) -> bool:
        return id in self._admitted

    def state_of(self, id: str) -> State | None:
        adm = self._admitted.get(id)
        if adm is not None:
            return adm.state
        return State.QUEUED if id in self._queue else None

    def set_capacity(self, capacity: int) -> None:
        """Legacy admission does not follow worker health (as in smg); the reading is
        only reported (``measured``)."""
        self.measured = capacity

    def set_kv_capacity(self, tokens: int | None) -> None:
        """Admission by KV capacity does not apply to the legacy path (the pool says so
        at start-up: ``kv_admission_ungated``)."""

    def update_config(self, classes: Mapping[PriorityClass, ClassSettings]) -> None:
        """Class knobs do not apply to the legacy path."""

    def tick(self) -> None:
        self._dispatch(self.clock())

    def predicted_wait(self, cls: PriorityClass) -> float | None:
        """Legacy admission predicts nothing."""
        return None

    def next_deadline(self) -> float | None:
        head = first(self._queue)
        return None if head is None else head.deadline

    def snapshot(self) -> Snapshot:
        per: dict[PriorityClass, list[int]] = {c: [0, 0] for c in PriorityClass}
        for adm in self._admitted.values():
            per[adm.cls][0] += 1
        now = self.clock()
        oldest: dict[PriorityClass, float] = {}
        for w in self._queue.values():  # in arrival order: the first of a class is its oldest
            per[w.cls][1] += 1
            oldest.setdefault(w.cls, now - w.enqueued_at)
        return Snapshot(
            capacity=self.limit if self.limit is not None else self.measured,
            inflight=len(self._admitted),
            classes={
                c: ClassSnapshot(per[c][0], per[c][1], self.queue_size, 0,
                                 oldest_wait=oldest.get(c, 0.0)) for c in HIGH_TO_LOW
            },
        )

    def take_events(self) -> list[Event]:
        events, self._events = self._events, []
        return events

    def _admit(self, id: str, cls: PriorityClass, tenant: str, now: float, waited: float,
               *, queued: bool) -> Admitted:
        adm = Admission(id, cls, tenant, now)
        self._admitted[id] = adm
        event = Admitted(adm, waited, queued)
        self._events.append(event)
        return event

    def _dispatch(self, now: float) -> None:
        while self._queue:
            head = first(self._queue)
            assert head is not None
            if now >= head.deadline:
                del self._queue[head.id]
                self._events.append(Rejected(head.id, head.cls, head.tenant,
                                             Outcome.REJECTED_QUEUE_TIMEOUT,
                                             now - head.enqueued_at, legacy=True))
                continue
            if not self._has_slot():
                return
            del self._queue[head.id]
            self._admit(head.id, head.cls, head.tenant, now, now - head.enqueued_at, queued=True)
