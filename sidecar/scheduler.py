"""The admission core: pure state machines, no I/O, no asyncio, a clock passed in.

Two cores share one interface (:class:`AdmissionCore`):

* :class:`Scheduler` — the priority scheduler of the contract: per-class
  reservations, FIFO queues with size and timeout, starvation aging and
  preemption.
* :class:`LegacyAdmission` — the legacy concurrency limit with one FIFO queue.

Every state change is reported as an event (:class:`Admitted`,
:class:`Rejected`, :class:`Preempted`, :class:`Released`) collected until the
caller drains them with ``take_events()``. The asyncio adapter resolves waiting
requests from those events and the metrics count them, so both see exactly one
story. All operations are O(1) in queue length: a class queue is an OrderedDict
(a linked list under the hood), so the FIFO head, appends and cancels are O(1).
A plain dict would not do: popping from its front leaves deleted slots that
every later "first item" lookup scans past, which grows with queue churn.
"""

from __future__ import annotations

import enum
import heapq
import itertools
import math
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from sidecar.classes import HIGH_TO_LOW, LOW_TO_HIGH, PriorityClass
from sidecar.config import ClassConfig

Clock = Callable[[], float]


class Outcome(enum.StrEnum):
    """The ``outcome`` label of ``smg_scheduler_admit_total``."""

    ADMITTED = "admitted"
    REJECTED_QUEUE_FULL = "rejected_queue_full"
    REJECTED_QUEUE_TIMEOUT = "rejected_queue_timeout"
    PREEMPTED = "preempted"
    CLIENT_CANCELLED = "client_cancelled"


class ReleaseResult(enum.StrEnum):
    RELEASED = "released"
    UNKNOWN = "unknown"
    ALREADY_RELEASED = "already_released"


@dataclass(slots=True, eq=False)
class Admission:
    """An in-flight request holding one slot."""

    id: str
    cls: PriorityClass
    tenant: str
    admitted_at: float
    first_byte: bool = False


@dataclass(slots=True, eq=False)
class Waiter:
    """A queued request."""

    id: str
    cls: PriorityClass
    tenant: str
    enqueued_at: float
    deadline: float


# ----------------------------------------------------------------------------- events


@dataclass(frozen=True, slots=True)
class Admitted:
    admission: Admission
    waited: float
    queued: bool
    starvation: bool = False
    preempted: bool = False  # admitted by preempting a lower-class request
    adopted: bool = False  # admitted by an earlier process, found still streaming


@dataclass(frozen=True, slots=True)
class Queued:
    waiter: Waiter


@dataclass(frozen=True, slots=True)
class Rejected:
    id: str
    cls: PriorityClass
    tenant: str
    outcome: Outcome
    waited: float
    legacy: bool = False


@dataclass(frozen=True, slots=True)
class Preempted:
    victim: Admission
    by_class: PriorityClass


@dataclass(frozen=True, slots=True)
class Released:
    admission: Admission
    reason: str


Event = Admitted | Rejected | Preempted | Released
Decision = Admitted | Queued | Rejected


@dataclass(frozen=True, slots=True)
class ClassSnapshot:
    inflight: int
    queue_depth: int
    queue_limit: int
    reserved: int


@dataclass(frozen=True, slots=True)
class Snapshot:
    capacity: int
    inflight: int
    classes: Mapping[PriorityClass, ClassSnapshot]


class AdmissionCore(Protocol):
    """What the asyncio adapter needs from a core."""

    legacy: bool

    def arrive(self, id: str, cls: PriorityClass, tenant: str) -> Decision: ...
    def cancel(self, id: str) -> bool: ...
    def release(self, id: str, reason: str = "completed") -> ReleaseResult: ...
    def adopt(self, id: str, cls: PriorityClass, tenant: str) -> bool: ...
    def mark_reachable(self, id: str) -> bool: ...
    def mark_first_byte(self, id: str) -> bool: ...
    def is_admitted(self, id: str) -> bool: ...
    def set_capacity(self, capacity: int) -> None: ...
    def update_config(self, classes: Mapping[PriorityClass, ClassConfig]) -> None: ...
    def tick(self) -> None: ...
    def next_deadline(self) -> float | None: ...
    def snapshot(self) -> Snapshot: ...
    def take_events(self) -> list[Event]: ...


# ----------------------------------------------------------------------- reservations


def desired_reservations(
    classes: Mapping[PriorityClass, ClassConfig], capacity: int
) -> dict[PriorityClass, int]:
    """``max(floor, ceil(share * capacity))``, each at most capacity.

    The product is rounded to 9 decimals before ``ceil`` so that 0.1 * 300 is
    30 as written, not 31 from binary floating point.
    """
    out: dict[PriorityClass, int] = {}
    for cls in HIGH_TO_LOW:
        c = classes[cls]
        product = c.reserved_per_slot * capacity
        # A share of 1 or more reserves everything (and a huge one would overflow).
        share = capacity if product >= capacity else math.ceil(round(product, 9))
        out[cls] = min(capacity, max(c.reserved_floor, share))
    return out


def reservations_fit(classes: Mapping[PriorityClass, ClassConfig], capacity: int) -> bool:
    """The startup check: do the reservations fit the capacity?"""
    return sum(desired_reservations(classes, capacity).values()) <= capacity


def scaled_reservations(
    classes: Mapping[PriorityClass, ClassConfig], capacity: int
) -> dict[PriorityClass, int]:
    """Reservations at ``capacity``, scaled down proportionally when they do not fit.

    Integer math (floor), so the sum never exceeds capacity; growth simply
    recomputes from the configured floors and shares, which restores them.
    """
    desired = desired_reservations(classes, capacity)
    total = sum(desired.values())
    if total <= capacity:
        return desired
    return {cls: desired[cls] * capacity // total for cls in desired}


LEASE_EXPIRED = "lease_expired"


class _RecentIds:
    """Bounded memory of ended admission ids and why they ended.

    Tells a duplicate completion from a stranger, and lets a stream whose lease
    was reclaimed (heartbeats lost, but it kept running) be adopted again.
    """

    def __init__(self, maxlen: int) -> None:
        self._ids: OrderedDict[str, str] = OrderedDict()
        self._maxlen = maxlen

    def add(self, id: str, reason: str) -> None:
        self._ids[id] = reason
        self._ids.move_to_end(id)  # re-ended (after a re-adoption): newest again
        if len(self._ids) > self._maxlen:
            self._ids.popitem(last=False)

    def __contains__(self, id: object) -> bool:
        return id in self._ids

    def adoptable(self, id: str) -> bool:
        """Never seen, or ended only because its lease expired."""
        return self._ids.get(id, LEASE_EXPIRED) == LEASE_EXPIRED


def _first(d: OrderedDict[str, Waiter]) -> Waiter | None:
    return next(iter(d.values()), None)


# -------------------------------------------------------------------------- scheduler


class Scheduler:
    """The priority scheduler (docs/reference.md, "The admission algorithm")."""

    legacy = False

    def __init__(
        self,
        classes: Mapping[PriorityClass, ClassConfig],
        capacity: int,
        clock: Clock,
        *,
        remember_ended: int = 100_000,
        preemptible_on_admit: bool = True,
    ) -> None:
        # With preemptible_on_admit False an admission becomes a preemption
        # candidate only once mark_reachable() says its victim path exists (the
        # sidecar can actually stop it); the pure rules otherwise stay the same.
        self._preemptible_on_admit = preemptible_on_admit
        self._cfg: dict[PriorityClass, ClassConfig] = dict(classes)
        self._clock = clock
        self._capacity = max(0, capacity)
        self._reserved: dict[PriorityClass, int] = {}
        self._inflight: dict[PriorityClass, int] = dict.fromkeys(PriorityClass, 0)
        self._total = 0
        self._admitted: dict[str, Admission] = {}
        # Per class, in admission order, the admissions that have not sent a byte.
        self._preemptible: dict[PriorityClass, OrderedDict[str, Admission]] = {
            c: OrderedDict() for c in PriorityClass
        }
        self._queues: dict[PriorityClass, OrderedDict[str, Waiter]] = {
            c: OrderedDict() for c in PriorityClass
        }
        self._waiting: dict[str, Waiter] = {}
        # Queue timeouts by deadline (a heap with lazy deletion): after a reload
        # shortens a timeout, a newer waiter can be due before an older head.
        self._deadlines: list[tuple[float, int, str]] = []
        self._seq = itertools.count()
        self._ended = _RecentIds(remember_ended)
        self._events: list[Event] = []
        # Classes above each class, for the reservation hold-back sum.
        self._higher: dict[PriorityClass, tuple[PriorityClass, ...]] = {
            c: tuple(h for h in HIGH_TO_LOW if h > c) for c in PriorityClass
        }
        self._reserved = scaled_reservations(self._cfg, self._capacity)

    # ------------------------------------------------------------------ queries

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def reserved(self) -> Mapping[PriorityClass, int]:
        return self._reserved

    @property
    def config(self) -> Mapping[PriorityClass, ClassConfig]:
        return self._cfg

    def inflight(self, cls: PriorityClass | None = None) -> int:
        return self._total if cls is None else self._inflight[cls]

    def queue_depth(self, cls: PriorityClass) -> int:
        return len(self._queues[cls])

    def queued_ids(self, cls: PriorityClass) -> list[str]:
        return list(self._queues[cls])

    def admissions(self) -> Iterator[Admission]:
        return iter(self._admitted.values())

    def is_admitted(self, id: str) -> bool:
        return id in self._admitted

    def available(self, cls: PriorityClass) -> int:
        """Free slots ``cls`` may take without eating a higher class's unused reservation."""
        held = 0
        for h in self._higher[cls]:
            unused = self._reserved[h] - self._inflight[h]
            if unused > 0:
                held += unused
        return self._capacity - self._total - held

    def snapshot(self) -> Snapshot:
        return Snapshot(
            capacity=self._capacity,
            inflight=self._total,
            classes={
                c: ClassSnapshot(
                    inflight=self._inflight[c],
                    queue_depth=len(self._queues[c]),
                    queue_limit=self._cfg[c].queue_size,
                    reserved=self._reserved[c],
                )
                for c in HIGH_TO_LOW
            },
        )

    def take_events(self) -> list[Event]:
        events, self._events = self._events, []
        return events

    def next_deadline(self) -> float | None:
        """When ``tick`` next has work: a queue timeout or a head turning starved."""
        self._drop_stale_deadlines()
        best: float | None = self._deadlines[0][0] if self._deadlines else None
        now = self._clock()
        for cls in LOW_TO_HIGH:
            if cls is PriorityClass.SYSTEM:
                break
            head = _first(self._queues[cls])
            if head is None:
                continue
            starve_at = head.enqueued_at + self._cfg[cls].starvation_threshold_secs
            # An already-starved head waits for a release, not for a timer.
            if starve_at > now and (best is None or starve_at < best):
                best = starve_at
        return best

    def _drop_stale_deadlines(self) -> None:
        heap = self._deadlines
        while heap:
            deadline, _, id = heap[0]
            waiter = self._waiting.get(id)
            if waiter is not None and waiter.deadline == deadline:
                return
            heapq.heappop(heap)

    # ---------------------------------------------------------------- mutations

    def arrive(self, id: str, cls: PriorityClass, tenant: str) -> Decision:
        """A new request of effective class ``cls``."""
        now = self._clock()
        self._dispatch(now)
        queue = self._queues[cls]
        available = self.available(cls)
        if not queue and available >= 1:
            return self._admit(id, cls, tenant, now, waited=0.0, queued=False)
        if not queue and self._cfg[cls].can_preempt and available == 0:
            # Preempting one victim frees exactly the one slot needed; when the
            # class is over its share (available < 0) it would not, so no victim.
            victim = self._pick_victim(cls)
            if victim is not None:
                self._preempt(victim, cls)
                admitted = self._admit(id, cls, tenant, now, waited=0.0, queued=False,
                                       preempted=True)
                # Filling its own unused reservation lowered the hold-back for the
                # classes below: a queued lower head may fit (or preempt) now.
                self._dispatch(now)
                return admitted
        # Earlier arrivals of this class keep FIFO order: this one queues behind
        # them (the dispatch above already preempted for their head if it could).
        return self._enqueue(id, cls, tenant, now)

    def cancel(self, id: str) -> bool:
        """The client went away while queued. False if ``id`` is not queued."""
        waiter = self._waiting.pop(id, None)
        if waiter is None:
            return False
        del self._queues[waiter.cls][id]
        now = self._clock()
        self._events.append(
            Rejected(id, waiter.cls, waiter.tenant, Outcome.CLIENT_CANCELLED,
                     now - waiter.enqueued_at)
        )
        self._dispatch(now)
        return True

    def release(self, id: str, reason: str = "completed") -> ReleaseResult:
        """End an admission. Idempotent: a second or unknown release changes nothing."""
        adm = self._admitted.get(id)
        if adm is None:
            return ReleaseResult.ALREADY_RELEASED if id in self._ended else ReleaseResult.UNKNOWN
        self._drop(adm, reason)
        self._events.append(Released(adm, reason))
        self._dispatch(self._clock())
        return ReleaseResult.RELEASED

    def adopt(self, id: str, cls: PriorityClass, tenant: str) -> bool:
        """Account for a request admitted by an earlier sidecar process.

        After a restart, Envoy's periodic access-log entries name streams that
        are still running. They hold real slots, so they count as in flight
        (even past capacity, like a shrink: nothing new is admitted until they
        drain). They cannot be preempted: their stop channel died with the old
        process. The same holds for a stream whose lease this process reclaimed
        while it kept running (its heartbeats were lost). Any other id this
        process has ended (completed, preempted) is never adopted again.
        """
        if id in self._admitted or id in self._waiting or not self._ended.adoptable(id):
            return False
        adm = Admission(id, cls, tenant, self._clock(), first_byte=True)
        self._admitted[id] = adm
        self._inflight[cls] += 1
        self._total += 1
        self._events.append(Admitted(adm, 0.0, queued=False, adopted=True))
        return True

    def mark_reachable(self, id: str) -> bool:
        """The admission can now be preempted (a channel to stop it exists)."""
        adm = self._admitted.get(id)
        if adm is None or adm.first_byte:
            return False
        self._preemptible[adm.cls][id] = adm
        # A queued head of a class that may preempt can use this victim now.
        self._dispatch(self._clock())
        return True

    def mark_first_byte(self, id: str) -> bool:
        """The response started: the admission can no longer be preempted."""
        adm = self._admitted.get(id)
        if adm is None or adm.first_byte:
            return False
        adm.first_byte = True
        self._preemptible[adm.cls].pop(id, None)
        return True

    def set_capacity(self, capacity: int) -> None:
        """Live capacity changed: rescale reservations and dispatch."""
        capacity = max(0, capacity)
        if capacity == self._capacity:
            return
        self._capacity = capacity
        self._reserved = scaled_reservations(self._cfg, capacity)
        self._dispatch(self._clock())

    def update_config(self, classes: Mapping[PriorityClass, ClassConfig]) -> None:
        """Hot reload: new knobs for new decisions; queued requests keep their place."""
        self._cfg = dict(classes)
        self._reserved = scaled_reservations(self._cfg, self._capacity)
        self._dispatch(self._clock())

    def tick(self) -> None:
        """Time passed: expire timeouts and admit starved heads."""
        self._dispatch(self._clock())

    # ---------------------------------------------------------------- internals

    def _admit(
        self,
        id: str,
        cls: PriorityClass,
        tenant: str,
        now: float,
        *,
        waited: float,
        queued: bool,
        starvation: bool = False,
        preempted: bool = False,
    ) -> Admitted:
        adm = Admission(id, cls, tenant, now)
        self._admitted[id] = adm
        if self._preemptible_on_admit:
            self._preemptible[cls][id] = adm
        self._inflight[cls] += 1
        self._total += 1
        event = Admitted(adm, waited, queued, starvation, preempted)
        self._events.append(event)
        return event

    def _drop(self, adm: Admission, reason: str) -> None:
        del self._admitted[adm.id]
        self._preemptible[adm.cls].pop(adm.id, None)
        self._inflight[adm.cls] -= 1
        self._total -= 1
        self._ended.add(adm.id, reason)

    def _enqueue(self, id: str, cls: PriorityClass, tenant: str, now: float) -> Decision:
        cfg = self._cfg[cls]
        queue = self._queues[cls]
        if len(queue) >= cfg.queue_size:
            event = Rejected(id, cls, tenant, Outcome.REJECTED_QUEUE_FULL, 0.0)
            self._events.append(event)
            return event
        waiter = Waiter(id, cls, tenant, now, now + cfg.queue_timeout_secs)
        queue[id] = waiter
        self._waiting[id] = waiter
        heapq.heappush(self._deadlines, (waiter.deadline, next(self._seq), id))
        if len(self._deadlines) > 2 * len(self._waiting) + 64:
            # Admitted and cancelled waiters leave entries behind; rebuild now and
            # then so the heap stays proportional to the queues (amortised O(1)).
            self._deadlines = [(w.deadline, next(self._seq), w.id)
                               for w in self._waiting.values()]
            heapq.heapify(self._deadlines)
        return Queued(waiter)

    def _pick_victim(self, by: PriorityClass,
                     admitted_by: float | None = None) -> Admission | None:
        # Lowest class first, then the most recently admitted (least work lost).
        # With admitted_by, only admissions made by then: a queued head may take
        # what it could have preempted on arrival had the victim been reachable,
        # but not a request admitted after it queued (e.g. a starvation promotion).
        # The scan is bounded by that class's in-flight count, not by queue length.
        for cls in LOW_TO_HIGH:
            if cls >= by:
                return None
            for adm in reversed(self._preemptible[cls].values()):
                if admitted_by is None or adm.admitted_at <= admitted_by:
                    return adm
        return None

    def _preempt(self, victim: Admission, by: PriorityClass) -> None:
        self._drop(victim, "preempted")
        self._events.append(Preempted(victim, by))
        self._events.append(Released(victim, "preempted"))

    def _admit_head(self, cls: PriorityClass, now: float, *, starvation: bool = False,
                    preempted: bool = False) -> None:
        """Admit the head of ``cls``'s queue (FIFO: always the head)."""
        _, waiter = self._queues[cls].popitem(last=False)
        del self._waiting[waiter.id]
        self._admit(waiter.id, cls, waiter.tenant, now, waited=now - waiter.enqueued_at,
                    queued=True, starvation=starvation, preempted=preempted)

    def _dispatch(self, now: float) -> None:
        self._expire(now)
        if not self._waiting:
            return  # the common case on an unloaded fleet: nothing to admit
        while (self._admit_starved(now) or self._admit_by_priority(now)
               or self._preempt_for_queued(now)):
            pass

    def _preempt_for_queued(self, now: float) -> bool:
        # A queued head of a class that may preempt takes a victim's slot directly
        # (not through dispatch, where a starved lower class could take it). Its
        # class has no free slot (available == 0), or dispatch would have admitted it.
        for cls in HIGH_TO_LOW:
            head = _first(self._queues[cls])
            if head is None or not self._cfg[cls].can_preempt or self.available(cls) != 0:
                continue
            victim = self._pick_victim(cls, admitted_by=head.enqueued_at)
            if victim is None:
                continue
            self._preempt(victim, cls)
            self._admit_head(cls, now, preempted=True)
            return True
        return False

    def _expire(self, now: float) -> None:
        heap = self._deadlines
        while heap and heap[0][0] <= now:
            deadline, _, id = heapq.heappop(heap)
            waiter = self._waiting.get(id)
            if waiter is None or waiter.deadline != deadline:
                continue  # admitted or cancelled since
            del self._waiting[id]
            del self._queues[waiter.cls][id]
            self._events.append(
                Rejected(id, waiter.cls, waiter.tenant, Outcome.REJECTED_QUEUE_TIMEOUT,
                         now - waiter.enqueued_at)
            )

    def _admit_starved(self, now: float) -> bool:
        # Starvation override: lowest class first, system excluded, ignoring
        # reservations but never past capacity.
        if self._total >= self._capacity:
            return False
        for cls in LOW_TO_HIGH:
            if cls is PriorityClass.SYSTEM:
                break
            head = _first(self._queues[cls])
            threshold = self._cfg[cls].starvation_threshold_secs
            if head is not None and now - head.enqueued_at >= threshold:
                self._admit_head(cls, now, starvation=True)
                return True
        return False

    def _admit_by_priority(self, now: float) -> bool:
        # Strict priority: available() only shrinks going down the classes, so
        # the first head that does not fit means no lower head fits either.
        for cls in HIGH_TO_LOW:
            head = _first(self._queues[cls])
            if head is None:
                continue
            if self.available(cls) < 1:
                return False
            self._admit_head(cls, now)
            return True
        return False


# ---------------------------------------------------------------------- legacy path


@dataclass(slots=True)
class LegacyAdmission:
    """The legacy concurrency limit: one FIFO queue, no classes in the decision.

    ``limit`` None means no concurrency cap (``--max-concurrent-requests`` <= 0).
    """

    limit: int | None
    queue_size: int
    queue_timeout_secs: float
    clock: Clock
    legacy: bool = True
    _admitted: dict[str, Admission] = field(default_factory=dict)
    _queue: OrderedDict[str, Waiter] = field(default_factory=OrderedDict)
    _ended: _RecentIds = field(default_factory=lambda: _RecentIds(100_000))
    _events: list[Event] = field(default_factory=list)

    def _has_slot(self) -> bool:
        return self.limit is None or len(self._admitted) < self.limit

    def arrive(self, id: str, cls: PriorityClass, tenant: str) -> Decision:
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

    def release(self, id: str, reason: str = "completed") -> ReleaseResult:
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
        adm = Admission(id, cls, tenant, self.clock(), first_byte=True)
        self._admitted[id] = adm
        self._events.append(Admitted(adm, 0.0, queued=False, adopted=True))
        return True

    def mark_reachable(self, id: str) -> bool:
        return False  # the legacy path never preempts

    def mark_first_byte(self, id: str) -> bool:
        adm = self._admitted.get(id)
        if adm is None or adm.first_byte:
            return False
        adm.first_byte = True
        return True

    def is_admitted(self, id: str) -> bool:
        return id in self._admitted

    def set_capacity(self, capacity: int) -> None:
        """Legacy admission does not follow worker health (as in smg)."""

    def update_config(self, classes: Mapping[PriorityClass, ClassConfig]) -> None:
        """Class knobs do not apply to the legacy path."""

    def tick(self) -> None:
        self._dispatch(self.clock())

    def next_deadline(self) -> float | None:
        head = _first(self._queue)
        return None if head is None else head.deadline

    def snapshot(self) -> Snapshot:
        per: dict[PriorityClass, list[int]] = {c: [0, 0] for c in PriorityClass}
        for adm in self._admitted.values():
            per[adm.cls][0] += 1
        for w in self._queue.values():
            per[w.cls][1] += 1
        return Snapshot(
            capacity=self.limit if self.limit is not None else 0,
            inflight=len(self._admitted),
            classes={
                c: ClassSnapshot(per[c][0], per[c][1], self.queue_size, 0) for c in HIGH_TO_LOW
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
            head = _first(self._queue)
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
