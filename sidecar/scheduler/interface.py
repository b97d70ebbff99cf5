"""What the asyncio adapter and the metrics see of a core.

Both cores implement :class:`AdmissionCore`; the metrics read a
:class:`Snapshot` at scrape time and derive the contract's gauges from it with
the pure functions here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from sidecar.classes import PriorityClass
from sidecar.scheduler.lifecycle import Decision, Event, ReleaseReason, ReleaseResult
from sidecar.scheduler.reservations import CLASSES_ABOVE
from sidecar.scheduler.settings import ClassSettings

Clock = Callable[[], float]


@dataclass(frozen=True, slots=True)
class ClassSnapshot:
    inflight: int
    queue_depth: int
    queue_limit: int
    reserved: int
    tenant_depths: Mapping[str, int] = field(default_factory=dict)
    """Waiters per tenant (tenants with none are absent)."""
    oldest_wait: float = 0.0
    """Seconds the class's oldest waiter has waited (0: none waits; the status page)."""


@dataclass(frozen=True, slots=True)
class Snapshot:
    capacity: int
    inflight: int
    classes: Mapping[PriorityClass, ClassSnapshot]
    kv_capacity: int | None = None
    """The KV capacity in tokens admission is gated by (None: not gated)."""
    kv_held: int = 0
    """Σ token estimates of the admissions in flight (what they hold of ``kv_capacity``)."""


def capacity_pressure(snap: Snapshot, cls: PriorityClass) -> float:
    """``smg_scheduler_class_capacity_pressure{class}``, exactly as the contract writes it.

    ``min(1, max(depth/limit, max(0, inflight - reserved[cls])
    / max(1, capacity - Σ reserved[classes above cls])))``, with depth/limit = 0
    when limit is 0: how full the class's queue is, or how far it runs beyond its
    own reservation into the slots the classes above it leave over.
    """
    c = snap.classes[cls]
    fill = c.queue_depth / c.queue_limit if c.queue_limit else 0.0
    held_above = sum(snap.classes[h].reserved for h in CLASSES_ABOVE[cls])
    beyond = max(0, c.inflight - c.reserved) / max(1, snap.capacity - held_above)
    return min(1.0, max(fill, beyond))


class AdmissionCore(Protocol):
    """What the asyncio adapter needs from a core (calls named as in the lifecycle table)."""

    legacy: bool

    def arrive(self, id: str, cls: PriorityClass, tenant: str, *,
               wait_budget: float | None = None, enforce: bool = False,
               cost: float = 1.0) -> Decision: ...
    def cancel(self, id: str) -> bool: ...
    def release(self, id: str,
                reason: ReleaseReason = ReleaseReason.COMPLETED) -> ReleaseResult: ...
    def adopt(self, id: str, cls: PriorityClass, tenant: str) -> bool: ...
    def mark_preemptible(self, id: str) -> bool: ...
    def mark_first_byte(self, id: str) -> bool: ...
    def is_admitted(self, id: str) -> bool: ...
    def set_capacity(self, capacity: int) -> None: ...
    def set_kv_capacity(self, tokens: int | None) -> None: ...
    def update_config(self, classes: Mapping[PriorityClass, ClassSettings]) -> None: ...
    def tick(self) -> None: ...
    def next_deadline(self) -> float | None: ...
    def predicted_wait(self, cls: PriorityClass) -> float | None: ...
    def snapshot(self) -> Snapshot: ...
    def take_events(self) -> list[Event]: ...
