"""The priority scheduler (docs/design.md, "The admission algorithm").

Per-class reservations, class queues with size and timeout (FIFO, or fair
across tenants: :mod:`sidecar.scheduler.queues`), starvation aging,
preemption and, given a wait budget, refusal at intake of an arrival predicted
to wait past it (:mod:`sidecar.scheduler.drain`), over an injected clock. A class
queue's ``head()`` is the waiter it serves next, which is what every rule below
acts on; starvation ages by its ``oldest()`` (the same waiter for a FIFO).
Nothing here awaits or does I/O: every state change (see
:mod:`sidecar.scheduler.lifecycle`) is reported as an event, collected until the
caller takes them with ``take_events()``.

**Admission by KV capacity** (``tokens.admit_by_kv``; off until :meth:`Scheduler.set_kv_capacity`
gives a capacity). Each admission holds its ``cost`` (the pool passes its token estimate)
until it is released, and none is admitted while the sum would pass the capacity. The
requests are served in the dispatch order the slots already follow (starved heads,
lowest class first; then each class's head, highest first; then preemption for a queued
head): the first head in that order that does not fit waits, and nothing behind it
goes first, neither in its class nor below it nor a new arrival. Otherwise a stream of
small requests would keep a large one waiting for ever, as the slot rule keeps a lower
class from taking a slot a higher class's head waits for (docs/design.md, "Admission by
KV capacity"). Preemption is for slots only: a head takes a victim only if, with the
victim's tokens freed, it fits.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Mapping

from sidecar.classes import HIGH_TO_LOW, LOW_TO_HIGH, PriorityClass
from sidecar.scheduler.drain import DrainRates
from sidecar.scheduler.interface import ClassSnapshot, Clock, Snapshot
from sidecar.scheduler.lifecycle import (
    Admission,
    Admitted,
    Decision,
    EndedIds,
    Event,
    Outcome,
    OverTarget,
    Preempted,
    Queued,
    Rejected,
    Released,
    ReleaseReason,
    ReleaseResult,
    State,
    Waiter,
)
from sidecar.scheduler.queues import ClassQueues
from sidecar.scheduler.reservations import CLASSES_ABOVE, scaled_reservations
from sidecar.scheduler.settings import ClassSettings

_COMPLETED = ReleaseReason.COMPLETED
_PREEMPTED = ReleaseReason.PREEMPTED


def _tokens(cost: float) -> int:
    """What an admission of ``cost`` holds of the KV capacity: its token estimate, which
    the pool passes as its cost (1 where token accounting is off: nothing is gated then)."""
    return max(0, int(cost))


class Scheduler:
    """The priority scheduler.

    An admission becomes a preemption candidate (PREEMPTIBLE) only once
    :meth:`mark_preemptible` says a channel to stop it exists, as in the
    sidecar. ``preemptible_on_admit=True`` makes every admission a candidate at
    once, for a caller that can always stop what it admitted.
    """

    legacy = False

    def __init__(
        self,
        classes: Mapping[PriorityClass, ClassSettings],
        capacity: int,
        clock: Clock,
        *,
        remember_ended: int = 100_000,
        preemptible_on_admit: bool = False,
    ) -> None:
        self._preemptible_on_admit = preemptible_on_admit
        self._cfg: dict[PriorityClass, ClassSettings] = dict(classes)
        self._clock = clock
        self._capacity = max(0, capacity)
        self._inflight: dict[PriorityClass, int] = dict.fromkeys(PriorityClass, 0)
        self._total = 0
        self._admitted: dict[str, Admission] = {}
        # Per class, in admission order, the PREEMPTIBLE admissions (the victims).
        self._preemptible: dict[PriorityClass, OrderedDict[str, Admission]] = {
            c: OrderedDict() for c in PriorityClass
        }
        self._queues = ClassQueues(self._cfg)
        self._queue = self._queues.by_class
        self._waiting = self._queues.waiting
        self._deadlines = self._queues.deadlines
        self._ended = EndedIds(remember_ended)
        self._events: list[Event] = []
        self._reserved: dict[PriorityClass, int] = scaled_reservations(self._cfg, self._capacity)
        self._drain = DrainRates()
        self._kv_cap: int | None = None  # None: admission is not gated by tokens
        self._kv_held = 0  # Σ tokens of the admissions in flight

    # ------------------------------------------------------------------ queries

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def reserved(self) -> Mapping[PriorityClass, int]:
        return self._reserved

    @property
    def config(self) -> Mapping[PriorityClass, ClassSettings]:
        return self._cfg

    def inflight(self, cls: PriorityClass | None = None) -> int:
        return self._total if cls is None else self._inflight[cls]

    def queue_depth(self, cls: PriorityClass) -> int:
        return len(self._queue[cls])

    def queued_ids(self, cls: PriorityClass) -> list[str]:
        """``cls``'s waiters in arrival order."""
        return list(self._queue[cls])

    def admissions(self) -> Iterator[Admission]:
        return iter(self._admitted.values())

    def is_admitted(self, id: str) -> bool:
        return id in self._admitted

    def state_of(self, id: str) -> State | None:
        """The live state of ``id`` (QUEUED or one holding a slot); None once it ended."""
        adm = self._admitted.get(id)
        if adm is not None:
            return adm.state
        return State.QUEUED if id in self._waiting else None

    def predicted_wait(self, cls: PriorityClass) -> float | None:
        """The wait an arrival of ``cls`` would have now if it queued (None: no estimate;
        0.0: a slot is free for it)."""
        if not self._queue[cls] and self.available(cls) >= 1:
            return 0.0
        return self._predict(cls, self._clock())

    def available(self, cls: PriorityClass) -> int:
        """Free slots ``cls`` may take without eating a higher class's unused reservation.

        ``capacity − Σinflight − Σ_{h>cls} max(0, reserved[h] − inflight[h])``.
        """
        held = 0
        for h in CLASSES_ABOVE[cls]:
            unused = self._reserved[h] - self._inflight[h]
            if unused > 0:
                held += unused
        return self._capacity - self._total - held

    def snapshot(self) -> Snapshot:
        now = self._clock()
        return Snapshot(
            capacity=self._capacity,
            inflight=self._total,
            classes={
                c: ClassSnapshot(
                    inflight=self._inflight[c],
                    queue_depth=len(self._queue[c]),
                    queue_limit=self._cfg[c].queue_size,
                    reserved=self._reserved[c],
                    tenant_depths=self._queue[c].tenant_depths() if self._queue[c] else {},
                    oldest_wait=now - w.enqueued_at if (w := self._queue[c].oldest()) else 0.0,
                )
                for c in HIGH_TO_LOW
            },
            kv_capacity=self._kv_cap,
            kv_held=self._kv_held,
        )

    def take_events(self) -> list[Event]:
        events, self._events = self._events, []
        return events

    def next_deadline(self) -> float | None:
        """When ``tick`` next has work: a queue timeout or a head turning starved."""
        best = self._queues.next_timeout()
        now = self._clock()
        for cls in LOW_TO_HIGH:
            if cls is PriorityClass.SYSTEM:
                break
            oldest = self._queue[cls].oldest()
            if oldest is None:
                continue
            starve_at = oldest.enqueued_at + self._cfg[cls].starvation_threshold_secs
            # An already-starved head waits for a release, not for a timer.
            if starve_at > now and (best is None or starve_at < best):
                best = starve_at
        return best

    # ---------------------------------------------------------------- mutations

    def arrive(self, id: str, cls: PriorityClass, tenant: str, *,
               wait_budget: float | None = None, enforce: bool = False,
               cost: float = 1.0) -> Decision:
        """new → ADMITTED, QUEUED, rejected_queue_full or (``wait_budget`` given and
        ``enforce``) rejected_over_target.

        ``wait_budget``: the longest this request may wait in its queue. Only an arrival
        that would queue is measured against it, so one that finds a free slot (an idle
        pool) is never refused by a prediction, and neither is one with no estimate yet.
        """
        now = self._clock()
        self._dispatch(now)
        queue = self._queue[cls]
        available = self.available(cls)
        tokens = _tokens(cost)
        if not queue and available >= 1 and self._kv_open(cls, tokens, now):
            return self._admit(id, cls, tenant, now, waited=0.0, queued=False, tokens=tokens)
        if not queue and self._cfg[cls].can_preempt and available == 0:
            # Preempting one victim frees exactly the one slot needed; when the
            # class is over its share (available < 0) it would not, so no victim.
            victim = self._pick_victim(cls)
            if victim is not None and self._kv_open(cls, tokens, now, freed=victim.tokens):
                self._preempt(victim, cls)
                admitted = self._admit(id, cls, tenant, now, waited=0.0, queued=False,
                                       preempted=True, tokens=tokens)
                # Filling its own unused reservation lowered the hold-back for the
                # classes below: a queued lower head may fit (or preempt) now.
                self._dispatch(now)
                return admitted
        # Earlier arrivals of this class keep FIFO order: this one queues behind
        # them (the dispatch above already preempted for their head if it could).
        decision = self._enqueue(id, cls, tenant, now, wait_budget, enforce, cost)
        if isinstance(decision, Queued) and self._cfg[cls].can_preempt:
            # Under fair queuing it may be its class's new head, and a head may take only
            # a victim admitted before it queued: queued later than the old head, this one
            # may take a victim the old head could not.
            self._dispatch(now)
        return decision

    def cancel(self, id: str) -> bool:
        """QUEUED → client_cancelled (the client went away). False if ``id`` is not queued."""
        waiter = self._queues.remove(id)
        if waiter is None:
            return False
        now = self._clock()
        self._events.append(
            Rejected(id, waiter.cls, waiter.tenant, Outcome.CLIENT_CANCELLED,
                     now - waiter.enqueued_at)
        )
        self._dispatch(now)
        return True

    def release(self, id: str, reason: ReleaseReason = _COMPLETED) -> ReleaseResult:
        """A slot-holding state → released. A second or unknown release changes nothing."""
        adm = self._admitted.get(id)
        if adm is None:
            return ReleaseResult.ALREADY_RELEASED if id in self._ended else ReleaseResult.UNKNOWN
        self._end(adm, reason)
        self._events.append(Released(adm, reason))
        now = self._clock()
        self._drain.released(now)
        self._dispatch(now)
        return ReleaseResult.RELEASED

    def adopt(self, id: str, cls: PriorityClass, tenant: str) -> bool:
        """new or lease_expired → STREAMING: a request admitted by an earlier sidecar process.

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
        adm = Admission(id, cls, tenant, self._clock(), State.STREAMING)
        self._admitted[id] = adm
        self._inflight[cls] += 1
        self._total += 1
        self._events.append(Admitted(adm, 0.0, queued=False, adopted=True))
        return True

    def carry(self, id: str, cls: PriorityClass, tenant: str, admitted_at: float, *,
              streaming: bool) -> bool:
        """new → ADMITTED (or STREAMING): an admission another authority made, as it stands.

        The fleet controller seeds its degraded-mode core with what its replica holds.
        Unlike :meth:`adopt`, the stop channel is still alive: one before its
        first byte keeps its admission time (the victim order) and becomes a candidate
        again through :meth:`mark_preemptible`. Counts as in flight, even past capacity.
        No event: it is not a new admission.
        """
        if id in self._admitted or id in self._waiting:
            return False
        state = State.STREAMING if streaming else State.ADMITTED
        self._admitted[id] = Admission(id, cls, tenant, admitted_at, state)
        self._inflight[cls] += 1
        self._total += 1
        return True

    def mark_preemptible(self, id: str) -> bool:
        """ADMITTED → PREEMPTIBLE: a channel to stop it exists, so it may be a victim.

        False if ``id`` holds no slot or its response already started.
        """
        adm = self._admitted.get(id)
        if adm is None or adm.state is State.STREAMING:
            return False
        adm.state = State.PREEMPTIBLE
        self._preemptible[adm.cls][id] = adm
        # A queued head of a class that may preempt can use this victim now.
        self._dispatch(self._clock())
        return True

    def mark_first_byte(self, id: str) -> bool:
        """ADMITTED/PREEMPTIBLE → STREAMING: it can no longer be preempted."""
        adm = self._admitted.get(id)
        if adm is None or adm.state is State.STREAMING:
            return False
        adm.state = State.STREAMING
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

    def set_kv_capacity(self, tokens: int | None) -> None:
        """The KV capacity in tokens admission is gated by (None: not gated): what is in
        flight keeps what it holds, even past a smaller capacity; dispatch follows."""
        if tokens == self._kv_cap:
            return
        self._kv_cap = tokens
        self._dispatch(self._clock())

    def update_config(self, classes: Mapping[PriorityClass, ClassSettings]) -> None:
        """Hot reload: new knobs for new decisions; queued requests keep their place.

        A class whose fair queuing or per-tenant limit was switched (or whose
        weights changed) has its waiters re-sorted by arrival; none is shed.
        """
        self._cfg = dict(classes)
        self._reserved = scaled_reservations(self._cfg, self._capacity)
        self._queues.configure(self._cfg)
        self._dispatch(self._clock())

    def tick(self) -> None:
        """Time passed: expire queue timeouts and admit starved heads."""
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
        predicted: float | None = None,
        tokens: int = 0,
    ) -> Admitted:
        adm = Admission(id, cls, tenant, now, tokens=tokens)
        self._admitted[id] = adm
        self._kv_held += tokens
        if self._preemptible_on_admit:
            adm.state = State.PREEMPTIBLE
            self._preemptible[cls][id] = adm
        self._inflight[cls] += 1
        self._total += 1
        event = Admitted(adm, waited, queued, starvation, preempted, predicted=predicted)
        self._events.append(event)
        return event

    def _end(self, adm: Admission, reason: ReleaseReason) -> None:
        """Give back its slot and remember why it ended (the Released event is the caller's)."""
        del self._admitted[adm.id]
        self._preemptible[adm.cls].pop(adm.id, None)
        self._inflight[adm.cls] -= 1
        self._total -= 1
        self._kv_held -= adm.tokens
        self._ended.add(adm.id, reason)

    def _enqueue(self, id: str, cls: PriorityClass, tenant: str, now: float,
                 wait_budget: float | None, enforce: bool, cost: float = 1.0) -> Decision:
        cfg = self._cfg[cls]
        queue = self._queue[cls]
        limit = cfg.tenant_queue_limit  # not None: the queue is a TenantQueue
        predicted = self._predict(cls, now)
        if len(queue) >= cfg.queue_size or (
                limit is not None and queue.depth_of(tenant) >= limit):
            event = Rejected(id, cls, tenant, Outcome.REJECTED_QUEUE_FULL, 0.0,
                             predicted=predicted)
            self._events.append(event)
            return event
        if wait_budget is not None and predicted is not None and predicted > wait_budget:
            self._events.append(OverTarget(id, cls, tenant, predicted, wait_budget, enforce))
            if enforce:
                event = Rejected(id, cls, tenant, Outcome.REJECTED_OVER_TARGET, 0.0,
                                 predicted=predicted)
                self._events.append(event)
                return event
        waiter = Waiter(id, cls, tenant, now, now + cfg.queue_timeout_secs, predicted,
                        ahead=len(queue), cost=cost)
        self._queues.push(waiter)
        return Queued(waiter)

    def _predict(self, cls: PriorityClass, now: float) -> float | None:
        """The wait of an arrival of ``cls`` now, behind the whole queue (drain.py)."""
        queue = self._queue[cls]
        oldest = queue.oldest()
        # Its wait so far, spread over every position it needs (its own included): a floor
        # that stays below the average while the queue drains as learnt.
        floor = 0.0 if oldest is None else (now - oldest.enqueued_at) / (oldest.ahead + 1)
        return self._drain.predict(cls, len(queue), floor)

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
        """PREEMPTIBLE → preempted."""
        self._end(victim, _PREEMPTED)
        self._events.append(Preempted(victim, by))
        self._events.append(Released(victim, _PREEMPTED))

    def _admit_head(self, cls: PriorityClass, now: float, *, starvation: bool = False,
                    preempted: bool = False) -> None:
        """QUEUED → ADMITTED for the head of ``cls``'s queue."""
        waiter = self._queues.pop_head(cls)
        self._drain.served(cls, now - waiter.enqueued_at, waiter.ahead)
        self._admit(waiter.id, cls, waiter.tenant, now, waited=now - waiter.enqueued_at,
                    queued=True, starvation=starvation, preempted=preempted,
                    predicted=waiter.predicted, tokens=_tokens(waiter.cost))

    def _dispatch(self, now: float) -> None:
        if not self._waiting:
            return  # the common case on an unloaded fleet: nothing to expire or admit
        self._expire(now)
        if not self._waiting:
            return
        # Each step admits one request (True), finds none to admit (False), or finds the
        # next one in order waiting for KV tokens (None): then nothing else goes first.
        while True:
            step = self._admit_starved(now)
            if step is None:
                return
            if step:
                continue
            step = self._admit_by_priority(now)
            if step is None:
                return
            if not step and not self._preempt_for_queued(now):
                return

    def _preempt_for_queued(self, now: float) -> bool:
        # A queued head of a class that may preempt takes a victim's slot directly
        # (not through dispatch, where a starved lower class could take it). Its
        # class has no free slot (available == 0), or dispatch would have admitted it.
        for cls in HIGH_TO_LOW:
            head = self._queue[cls].head()
            if head is None or not self._cfg[cls].can_preempt or self.available(cls) != 0:
                continue
            victim = self._pick_victim(cls, admitted_by=head.enqueued_at)
            if victim is None:
                continue
            if not self._kv_fits(head.cost, freed=victim.tokens):
                return False  # the head waits for tokens: nothing behind it goes first
            self._preempt(victim, cls)
            self._admit_head(cls, now, preempted=True)
            return True
        return False

    def _expire(self, now: float) -> None:
        """QUEUED → rejected_queue_timeout for every waiter past its deadline."""
        heap = self._deadlines
        if not heap or heap[0][0] > now:
            return  # checked here: a call per dispatch is measurable
        for waiter in self._queues.pop_expired(now):
            self._events.append(
                Rejected(waiter.id, waiter.cls, waiter.tenant, Outcome.REJECTED_QUEUE_TIMEOUT,
                         now - waiter.enqueued_at, predicted=waiter.predicted)
            )

    def _starved(self, cls: PriorityClass, now: float) -> bool:
        """``cls``'s queue is aged past its threshold (by its oldest waiter)."""
        if cls is PriorityClass.SYSTEM:
            return False
        oldest = self._queue[cls].oldest()
        return (oldest is not None
                and now - oldest.enqueued_at >= self._cfg[cls].starvation_threshold_secs)

    def _admit_starved(self, now: float) -> bool | None:
        # Starvation override: lowest class first, system excluded, ignoring
        # reservations but never past capacity (nor past the KV capacity: None).
        if self._total >= self._capacity:
            return False
        for cls in LOW_TO_HIGH:
            if self._starved(cls, now):
                # Aged by the oldest waiter; the head (who the queue serves next) goes.
                if self._head_waits_for_tokens(cls):
                    return None
                self._admit_head(cls, now, starvation=True)
                return True
        return False

    def _admit_by_priority(self, now: float) -> bool | None:
        # Strict priority: available() only shrinks going down the classes, so
        # the first head that does not fit means no lower head fits either. A head
        # that has a slot but not the KV tokens waits too, and so does everything
        # after it (None).
        for cls in HIGH_TO_LOW:
            if not self._queue[cls]:
                continue
            if self.available(cls) < 1:
                return False
            if self._head_waits_for_tokens(cls):
                return None
            self._admit_head(cls, now)
            return True
        return False

    # ------------------------------------------------------------- KV capacity

    def _head_waits_for_tokens(self, cls: PriorityClass) -> bool:
        """``cls``'s head (its queue is not empty) does not fit the KV capacity. Off the
        gate nothing waits for tokens, and the head is not looked up (the dispatch's
        hot path)."""
        if self._kv_cap is None:
            return False
        head = self._queue[cls].head()
        return head is not None and not self._kv_fits(head.cost)

    def _kv_fits(self, cost: float, freed: int = 0) -> bool:
        """A request of ``cost`` tokens fits the KV capacity (with ``freed`` given back)."""
        return self._kv_cap is None or self._kv_held - freed + _tokens(cost) <= self._kv_cap

    def _kv_open(self, cls: PriorityClass, tokens: int, now: float, freed: int = 0) -> bool:
        """An arrival of ``cls`` may take ``tokens`` at once: they fit, and no waiter the
        dispatch would serve before it (a higher class's, a starved one's) is waiting,
        which with the gate on means waiting for tokens. (Without it a higher class's
        waiter means no slot for this class either: the check is the gate's alone.)"""
        if self._kv_cap is None:
            return True
        if self._kv_held - freed + tokens > self._kv_cap:
            return False
        if any(self._queue[h] for h in CLASSES_ABOVE[cls]):
            return False
        return not any(self._starved(c, now) for c in LOW_TO_HIGH)
