"""The admission core: pure state machines, no I/O, no asyncio, a clock passed in.

One concept per module:

* :mod:`~sidecar.scheduler.settings` — :class:`ClassSettings`, the per-class
  knobs the core takes (built by ``sidecar.priority_yaml``, which the core never imports).
* :mod:`~sidecar.scheduler.lifecycle` — the life of one admission as a
  state/transition table, its records and the events that report each move.
* :mod:`~sidecar.scheduler.reservations` — how many slots each class holds back.
* :mod:`~sidecar.scheduler.queues` — the class queues (FIFO, or weighted fair
  queuing between tenants) and their timeouts.
* :mod:`~sidecar.scheduler.leases` — reclaiming slots whose completion was lost.
* :mod:`~sidecar.scheduler.priority` — :class:`Scheduler`, the contract's
  priority scheduler.
* :mod:`~sidecar.scheduler.legacy` — :class:`LegacyAdmission`, the legacy
  concurrency limit.
* :mod:`~sidecar.scheduler.interface` — :class:`AdmissionCore`, the interface
  both cores share, and the :class:`Snapshot` the metrics read.

Every state change is reported as an event (:class:`Admitted`,
:class:`Rejected`, :class:`Preempted`, :class:`Released`) collected until the
caller takes them with ``take_events()``. The asyncio adapter resolves waiting
requests from those events and the metrics count them, so both see exactly one
story. Every operation is O(1) in queue length (O(log tenants) in a class with
fair queuing).
"""

from sidecar.scheduler.interface import (
    AdmissionCore,
    ClassSnapshot,
    Clock,
    Snapshot,
    capacity_pressure,
)
from sidecar.scheduler.leases import Leases
from sidecar.scheduler.legacy import LegacyAdmission
from sidecar.scheduler.lifecycle import (
    LEASE_EXPIRED,
    TRANSITIONS,
    Admission,
    Admitted,
    Decision,
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
from sidecar.scheduler.priority import Scheduler
from sidecar.scheduler.reservations import (
    CLASSES_ABOVE,
    desired_reservations,
    reservations_fit,
    scaled_reservations,
)
from sidecar.scheduler.settings import (
    BUILTIN_CLASSES,
    ClassSettings,
    preemptible_classes,
    without_preemption,
)

__all__ = [
    "BUILTIN_CLASSES",
    "CLASSES_ABOVE",
    "LEASE_EXPIRED",
    "TRANSITIONS",
    "Admission",
    "AdmissionCore",
    "Admitted",
    "ClassSettings",
    "ClassSnapshot",
    "Clock",
    "Decision",
    "Event",
    "Leases",
    "LegacyAdmission",
    "Outcome",
    "OverTarget",
    "Preempted",
    "Queued",
    "Rejected",
    "ReleaseReason",
    "ReleaseResult",
    "Released",
    "Scheduler",
    "Snapshot",
    "State",
    "Waiter",
    "capacity_pressure",
    "desired_reservations",
    "preemptible_classes",
    "reservations_fit",
    "scaled_reservations",
    "without_preemption",
]
