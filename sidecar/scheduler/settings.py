"""Per-class settings, as the core takes them: a plain value, no YAML, no flags.

The field names are the YAML keys of ``classes.<class>``, except ``tenant_weights``
(from ``tenant_policies``).

``sidecar.priority_yaml`` builds these from ``priority.yaml`` (field-wise over
:data:`BUILTIN_CLASSES`); the core never imports the configuration module.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from sidecar.classes import HIGH_TO_LOW, PriorityClass


@dataclass(frozen=True, slots=True)
class ClassSettings:
    """One class's knobs (YAML ``classes.<name>``; the field names are the YAML keys)."""

    reserved_floor: int
    """Slots held back for the class whatever the capacity."""
    reserved_per_slot: float
    """Share of capacity held back: ``max(floor, ceil(share * capacity))``."""
    queue_size: int
    """Queued requests at most; one more is refused with 429 (0: never queue)."""
    queue_timeout_secs: float
    """Longest wait in the queue before 408."""
    starvation_threshold_secs: float
    """A queue head waiting this long is admitted ignoring reservations (not ``system``)."""
    can_preempt: bool
    """Whether an arrival of this class may stop a lower-class request before its first byte."""
    fair_queuing: bool = False
    """Serve the class's waiters across tenants by weighted fair queuing (False: one FIFO)."""
    max_queued_per_tenant: int | None = None
    """A tenant's waiters at most; one more is refused with 429 (None: no per-tenant limit)."""
    ttft_target_ms: float | None = None
    """The class's time-to-first-token target (None: none). A request predicted to wait
    so long that it would miss it is counted, and refused at intake where the class is
    ``sheddable`` and ``deadline_mode`` is ``enforce`` (docs/design.md, "Deadlines")."""
    sheddable: bool = False
    """Whether a prediction may refuse the class's requests (never: system, interactive)."""
    tenant_weights: Mapping[str, float] = field(default_factory=dict, hash=False)
    """Each tenant's share under fair queuing (absent: 1). Not a class key:
    ``sidecar.priority_yaml`` fills it from ``tenant_policies.<tenant>.weight``, the same
    map in every class."""

    @property
    def tenant_queue_limit(self) -> int | None:
        """The per-tenant limit in force: None when unset or not below ``queue_size``
        (the class queue fills first, so it could never bite)."""
        limit = self.max_queued_per_tenant
        return limit if limit is not None and limit < self.queue_size else None

    def weight(self, tenant: str) -> float:
        return self.tenant_weights.get(tenant, 1.0)


BUILTIN_CLASSES: Mapping[PriorityClass, ClassSettings] = {
    PriorityClass.SYSTEM: ClassSettings(
        reserved_floor=32, reserved_per_slot=0.0, queue_size=64, queue_timeout_secs=30.0,
        starvation_threshold_secs=5.0, can_preempt=True),
    PriorityClass.INTERACTIVE: ClassSettings(
        reserved_floor=128, reserved_per_slot=0.25, queue_size=256, queue_timeout_secs=30.0,
        starvation_threshold_secs=5.0, can_preempt=True),
    PriorityClass.DEFAULT: ClassSettings(
        reserved_floor=0, reserved_per_slot=0.10, queue_size=512, queue_timeout_secs=60.0,
        starvation_threshold_secs=30.0, can_preempt=False, sheddable=True),
    PriorityClass.BULK: ClassSettings(
        reserved_floor=0, reserved_per_slot=0.0, queue_size=1024, queue_timeout_secs=300.0,
        starvation_threshold_secs=120.0, can_preempt=False, sheddable=True),
}
"""The contract's built-in class table (what an empty ``priority.yaml`` means)."""


def preemptible_classes(classes: Mapping[PriorityClass, ClassSettings]
                        ) -> frozenset[PriorityClass]:
    """The classes a request can be preempted in: some strictly higher class ``can_preempt``.

    The others are admitted with ``preemptible: false`` in the metadata, so Envoy opens
    no ext_proc stream for them (the stream is most of the cost of an admitted request
    through Envoy): whatever the load, nothing could ever stop them.
    """
    out: set[PriorityClass] = set()
    preemptor_above = False
    for cls in HIGH_TO_LOW:
        if preemptor_above:
            out.add(cls)
        if classes[cls].can_preempt:
            preemptor_above = True
    return frozenset(out)


def without_preemption(classes: Mapping[PriorityClass, ClassSettings]
                       ) -> dict[PriorityClass, ClassSettings]:
    """``classes`` with ``can_preempt`` off everywhere (preemption suspended)."""
    return {c: replace(k, can_preempt=False) for c, k in classes.items()}
