"""The class queues: one per class, plus queue timeouts by deadline.

A class queue is one of two kinds, chosen per class from its settings:

* :class:`FifoQueue` — the contract's FIFO, for a class with neither
  ``fair_queuing`` nor a per-tenant limit in force (the built-in table). An
  OrderedDict (a linked list under the hood), so the head, appends and cancels
  are O(1). A plain dict would not do: popping from its front leaves deleted
  slots that every later "first item" lookup scans past.
* :class:`TenantQueue` — the class's waiters split into per-tenant FIFOs, for
  ``fair_queuing`` or ``max_queued_per_tenant``. Without fair queuing its head
  is still the oldest waiter (arrival order, as a FifoQueue); it only adds the
  per-tenant counts the limit needs.

Both answer the same questions: ``head()`` (the waiter the queue serves next:
what reservations, strict priority and preemption act on), ``oldest()`` (what
starvation ages by), ``len``, iteration in arrival order, and O(1) removal of
any waiter by id.

Fair queuing: self-clocked weighted fair queuing (SCFQ, Golestani 1994) at the
grain of one request. Each backlogged tenant holds one *turn* tagged with a
virtual finish time; a heap of those turns (one entry per tenant) gives the
next tenant in O(log tenants), and that tenant's oldest waiter is served. A
turn costs ``1 / weight``: serving a tenant moves its tag on by that much, and
the queue's virtual time to the tag served. A tenant that starts waiting joins
at ``virtual time + 1 / weight``, so it competes from now on and earns no
credit for having been idle. Chosen over the alternatives because:

* it interleaves: weights 2:1 serve A A B A A B ..., not runs of a tenant's
  whole quantum as deficit round robin does, and any real weight works (no
  integer quanta);
* it is O(log tenants) per operation; smooth weighted round robin (nginx)
  scans every tenant per pick, O(tenants), too slow at 10,000 tenants;
* the tag belongs to the tenant's turn, not to a request, so a cancelled or
  timed-out waiter needs no re-tagging (its tenant's next waiter inherits the
  turn) and a tenant's own requests stay FIFO.

**Token-weighted** (``fair_queuing: tokens``, the class's ``fair_cost``): a turn costs the
served waiter's tokens (its estimate at the Check, at least 1) over its tenant's weight,
so tenants are served equal *tokens* by weight, not equal requests: VTC's fairness (Sheng
et al., OSDI 2024: the least-served backlogged client goes next; a client that becomes
backlogged starts from the others' virtual time, so idleness earns no credit), with
SCFQ's bound for packets of different sizes: over any stretch in which tenants i and j
both wait, the tokens served to each satisfy |S_i/w_i − S_j/w_j| ≤ C_i/w_i + C_j/w_j,
C_t the largest request tenant t had served in it (tests/test_token_fairness.py). A
waiter's tag is set when it reaches the head of its tenant's FIFO, from its own cost.

Ties (equal tags) go to the turn tagged first, so equal-weight tenants
alternate in the order they started waiting. Tags restart from 0 whenever the
class queue empties, which keeps the floats small.

All operations are O(1) in queue length and at most O(log tenants) (the heaps
amortised: entries for tenants gone idle, admitted or cancelled waiters are
dropped lazily and rebuilt when they outnumber the live ones).
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter, OrderedDict
from collections.abc import Iterator, Mapping, Sequence

from sidecar.classes import PriorityClass
from sidecar.scheduler.lifecycle import Waiter
from sidecar.scheduler.settings import ClassSettings

_NOTHING: tuple[Waiter, ...] = ()


def first(queue: OrderedDict[str, Waiter]) -> Waiter | None:
    """The head of a FIFO, or None when it is empty."""
    return next(iter(queue.values()), None)


class FifoQueue(OrderedDict[str, Waiter]):
    """One FIFO by arrival: the contract's class queue."""

    __slots__ = ()

    def head(self) -> Waiter | None:
        return next(iter(self.values()), None)

    oldest = head

    def add(self, waiter: Waiter) -> None:
        self[waiter.id] = waiter

    def take_head(self) -> Waiter:
        return self.popitem(last=False)[1]

    def discard(self, waiter: Waiter) -> None:
        del self[waiter.id]

    def arrivals(self) -> Iterator[Waiter]:
        return iter(self.values())

    def depth_of(self, tenant: str) -> int:
        """O(queue length): never on the hot path, as a FIFO class has no per-tenant limit."""
        return sum(1 for w in self.values() if w.tenant == tenant)

    def tenant_depths(self) -> dict[str, int]:
        """Waiters per tenant (O(queue length): scrape time only)."""
        return dict(Counter(w.tenant for w in self.values()))


class _Flow:
    """One tenant's waiters in a :class:`TenantQueue`, and its turn."""

    __slots__ = ("cost", "queue", "seq", "tag")

    def __init__(self, cost: float) -> None:
        self.queue: OrderedDict[str, Waiter] = OrderedDict()
        # 1 / weight: how far serving one request (by requests) or one token (by tokens)
        # moves the tag.
        self.cost = cost
        self.tag = 0.0  # virtual finish time of its next turn
        self.seq = 0  # identifies its live heap entry (older entries are stale)


class TenantQueue:
    """A class's waiters in per-tenant FIFOs, served by fair queuing or by arrival."""

    __slots__ = ("_all", "_flows", "_heap", "_seq", "_vtime", "fair", "tokens", "weights")

    def __init__(self, *, fair: bool, weights: Mapping[str, float],
                 tokens: bool = False) -> None:
        self.fair = fair
        self.weights = weights
        self.tokens = tokens  # a turn costs the waiter's tokens, not 1
        self._all: OrderedDict[str, Waiter] = OrderedDict()  # every waiter, by arrival
        self._flows: dict[str, _Flow] = {}  # tenants with a waiter
        # (tag, seq, tenant): one live entry per flow under fair queuing.
        self._heap: list[tuple[float, int, str]] = []
        self._seq = itertools.count(1)
        self._vtime = 0.0

    def __len__(self) -> int:
        return len(self._all)

    def __iter__(self) -> Iterator[str]:
        return iter(self._all)

    def arrivals(self) -> Iterator[Waiter]:
        return iter(self._all.values())

    def oldest(self) -> Waiter | None:
        return next(iter(self._all.values()), None)

    def head(self) -> Waiter | None:
        if not self.fair:
            return next(iter(self._all.values()), None)
        flow = self._top()
        return None if flow is None else next(iter(flow.queue.values()))

    def depth_of(self, tenant: str) -> int:
        flow = self._flows.get(tenant)
        return 0 if flow is None else len(flow.queue)

    def tenant_depths(self) -> dict[str, int]:
        return {t: len(f.queue) for t, f in self._flows.items()}

    def add(self, waiter: Waiter) -> None:
        self._all[waiter.id] = waiter
        flow = self._flows.get(waiter.tenant)
        if flow is None:
            flow = self._flows[waiter.tenant] = _Flow(1.0 / self.weights.get(waiter.tenant, 1.0))
            if self.fair:
                # Joins at the current virtual time: no credit for having been idle.
                flow.tag = self._vtime + self._step(flow, waiter)
                self._push(flow, waiter.tenant)
        flow.queue[waiter.id] = waiter

    def take_head(self) -> Waiter:
        if not self.fair:
            waiter = self._all.popitem(last=False)[1]
            self._drop(waiter)
            return waiter
        flow = self._top()
        assert flow is not None, "take_head on an empty queue"
        _, waiter = flow.queue.popitem(last=False)
        del self._all[waiter.id]
        self._vtime = flow.tag
        if flow.queue:
            flow.tag += self._step(flow, next(iter(flow.queue.values())))
            flow.seq = next(self._seq)
            heapq.heapreplace(self._heap, (flow.tag, flow.seq, waiter.tenant))
        else:
            heapq.heappop(self._heap)
            del self._flows[waiter.tenant]
            self._maybe_reset()
        return waiter

    def discard(self, waiter: Waiter) -> None:
        """Take out any waiter; its tenant's next waiter inherits the turn."""
        del self._all[waiter.id]
        self._drop(waiter)

    # ------------------------------------------------------------------ internals

    def _step(self, flow: _Flow, waiter: Waiter) -> float:
        """How far serving ``waiter`` moves its tenant's tag."""
        return flow.cost * max(1.0, waiter.cost) if self.tokens else flow.cost

    def _drop(self, waiter: Waiter) -> None:
        flow = self._flows[waiter.tenant]
        was_head = self.fair and self.tokens and next(iter(flow.queue)) == waiter.id
        del flow.queue[waiter.id]
        if not flow.queue:
            del self._flows[waiter.tenant]  # its heap entry goes stale
            self._maybe_reset()
        elif was_head:
            # The turn was tagged with the head's tokens: the next waiter takes it at its
            # own (by requests every waiter costs the same, so the tag stands).
            flow.tag += self._step(flow, next(iter(flow.queue.values()))) - self._step(
                flow, waiter)
            self._push(flow, waiter.tenant)

    def _maybe_reset(self) -> None:
        if not self._all:
            self._heap.clear()
            self._vtime = 0.0
        elif len(self._heap) > 2 * len(self._flows) + 64:
            self._heap[:] = [(f.tag, f.seq, t) for t, f in self._flows.items()]
            heapq.heapify(self._heap)

    def _push(self, flow: _Flow, tenant: str) -> None:
        flow.seq = next(self._seq)
        heapq.heappush(self._heap, (flow.tag, flow.seq, tenant))

    def _top(self) -> _Flow | None:
        """The flow whose turn is next, dropping stale heap entries on the way."""
        heap, flows = self._heap, self._flows
        while heap:
            _, seq, tenant = heap[0]
            flow = flows.get(tenant)
            if flow is not None and flow.seq == seq:
                return flow
            heapq.heappop(heap)
        return None


ClassQueue = FifoQueue | TenantQueue


def queue_for(settings: ClassSettings) -> ClassQueue:
    """The kind of queue ``settings`` ask for (empty)."""
    if settings.fair_queuing or settings.tenant_queue_limit is not None:
        return TenantQueue(fair=settings.fair_queuing, weights=settings.tenant_weights,
                           tokens=settings.fair_queuing and settings.fair_cost == "tokens")
    return FifoQueue()


def _same_kind(queue: ClassQueue, settings: ClassSettings) -> bool:
    if isinstance(queue, FifoQueue):
        return not settings.fair_queuing and settings.tenant_queue_limit is None
    if settings.fair_queuing:
        return (queue.fair and queue.weights == settings.tenant_weights
                and queue.tokens == (settings.fair_cost == "tokens"))
    return not queue.fair and settings.tenant_queue_limit is not None


class ClassQueues:
    """Every QUEUED request: by class, by id, and by deadline.

    ``by_class``, ``waiting`` and ``deadlines`` are read directly by the scheduler
    (its hot path: a method call per dispatch is measurable); change them only
    through the methods here, which keep the three views in step. Each is the
    same object for the life of the queues (``configure`` replaces a class's
    queue inside ``by_class``).
    """

    def __init__(self, classes: Mapping[PriorityClass, ClassSettings] | None = None) -> None:
        self.by_class: dict[PriorityClass, ClassQueue] = {
            c: FifoQueue() if classes is None else queue_for(classes[c]) for c in PriorityClass
        }
        self.waiting: dict[str, Waiter] = {}
        # Queue timeouts by deadline (a heap with lazy deletion): after a reload
        # shortens a timeout, a newer waiter can be due before an older head.
        self.deadlines: list[tuple[float, int, str]] = []
        self._seq = itertools.count()

    def configure(self, classes: Mapping[PriorityClass, ClassSettings]) -> None:
        """A reload: a class whose queue kind or weights changed is re-sorted.

        Every waiter moves to the new queue in arrival order (so per-tenant FIFOs
        by arrival, or one FIFO by arrival); none is lost or shed, and deadlines
        are untouched. O(waiters of that class), on reload only.
        """
        for cls, settings in classes.items():
            old = self.by_class[cls]
            if _same_kind(old, settings):
                continue
            new = queue_for(settings)
            for waiter in old.arrivals():
                new.add(waiter)
            self.by_class[cls] = new

    def push(self, waiter: Waiter) -> None:
        """Add to its class queue (at the tail of its tenant's FIFO)."""
        self.by_class[waiter.cls].add(waiter)
        self.waiting[waiter.id] = waiter
        heapq.heappush(self.deadlines, (waiter.deadline, next(self._seq), waiter.id))
        if len(self.deadlines) > 2 * len(self.waiting) + 64:
            # Admitted and cancelled waiters leave entries behind; rebuild now and
            # then so the heap stays proportional to the queues (amortised O(1)).
            self.deadlines[:] = [(w.deadline, next(self._seq), w.id)
                                 for w in self.waiting.values()]
            heapq.heapify(self.deadlines)

    def pop_head(self, cls: PriorityClass) -> Waiter:
        """Take the head of ``cls``'s queue (the waiter it serves next)."""
        waiter = self.by_class[cls].take_head()
        del self.waiting[waiter.id]
        return waiter

    def remove(self, id: str) -> Waiter | None:
        """Take ``id`` out wherever it stands; None if it is not queued."""
        waiter = self.waiting.pop(id, None)
        if waiter is not None:
            self.by_class[waiter.cls].discard(waiter)
        return waiter

    def pop_expired(self, now: float) -> Sequence[Waiter]:
        """Take out every waiter whose deadline is ``now`` or earlier, earliest first."""
        heap = self.deadlines
        if not heap or heap[0][0] > now:
            return _NOTHING
        expired: list[Waiter] = []
        while heap and heap[0][0] <= now:
            deadline, _, id = heapq.heappop(heap)
            waiter = self.waiting.get(id)
            if waiter is None or waiter.deadline != deadline:
                continue  # admitted or cancelled since
            del self.waiting[id]
            self.by_class[waiter.cls].discard(waiter)
            expired.append(waiter)
        return expired

    def next_timeout(self) -> float | None:
        """The earliest deadline of a waiter still queued."""
        heap = self.deadlines
        while heap:
            deadline, _, id = heap[0]
            waiter = self.waiting.get(id)
            if waiter is not None and waiter.deadline == deadline:
                return deadline
            heapq.heappop(heap)
        return None
