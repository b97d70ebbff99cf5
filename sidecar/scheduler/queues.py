"""The class queues: one FIFO per class, plus queue timeouts by deadline.

All operations are O(1) in queue length (the deadline heap, amortised
O(log n) on push). A class queue is an OrderedDict (a linked list under the
hood), so the FIFO head, appends and cancels are O(1). A plain dict would not
do: popping from its front leaves deleted slots that every later "first item"
lookup scans past, which grows with queue churn.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Sequence

from sidecar.classes import PriorityClass
from sidecar.scheduler.lifecycle import Waiter

_NOTHING: tuple[Waiter, ...] = ()


def first(queue: OrderedDict[str, Waiter]) -> Waiter | None:
    """The head of a FIFO, or None when it is empty."""
    return next(iter(queue.values()), None)


class ClassQueues:
    """Every QUEUED request: by class in arrival order, by id, and by deadline.

    ``fifo``, ``waiting`` and ``deadlines`` are read directly by the scheduler
    (its hot path: a method call per dispatch is measurable); change them only
    through the methods here, which keep the three views in step. Each is the
    same object for the life of the queues.
    """

    def __init__(self) -> None:
        self.fifo: dict[PriorityClass, OrderedDict[str, Waiter]] = {
            c: OrderedDict() for c in PriorityClass
        }
        self.waiting: dict[str, Waiter] = {}
        # Queue timeouts by deadline (a heap with lazy deletion): after a reload
        # shortens a timeout, a newer waiter can be due before an older head.
        self.deadlines: list[tuple[float, int, str]] = []
        self._seq = itertools.count()

    def push(self, waiter: Waiter) -> None:
        """Append at the tail of its class queue."""
        self.fifo[waiter.cls][waiter.id] = waiter
        self.waiting[waiter.id] = waiter
        heapq.heappush(self.deadlines, (waiter.deadline, next(self._seq), waiter.id))
        if len(self.deadlines) > 2 * len(self.waiting) + 64:
            # Admitted and cancelled waiters leave entries behind; rebuild now and
            # then so the heap stays proportional to the queues (amortised O(1)).
            self.deadlines[:] = [(w.deadline, next(self._seq), w.id)
                                 for w in self.waiting.values()]
            heapq.heapify(self.deadlines)

    def pop_head(self, cls: PriorityClass) -> Waiter:
        """Take the head of ``cls``'s queue (FIFO: always the head)."""
        _, waiter = self.fifo[cls].popitem(last=False)
        del self.waiting[waiter.id]
        return waiter

    def remove(self, id: str) -> Waiter | None:
        """Take ``id`` out wherever it stands; None if it is not queued."""
        waiter = self.waiting.pop(id, None)
        if waiter is not None:
            del self.fifo[waiter.cls][id]
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
            del self.fifo[waiter.cls][id]
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

