"""Model pools: one admission core per pool, routed by the admission id.

A pool is a set of workers with a capacity of its own (several models behind one
gateway). Each pool gets an independent :class:`~sidecar.admission.AdmissionController`
over its own core, so its class queues, reservations, starvation aging, preemption
(only ever within the pool), tenant limits and leases never see another pool's
traffic. Envoy's route names the pool (ext_authz per-route ``context_extensions``,
key :data:`POOL_KEY`); a route that names none belongs to :data:`DEFAULT_POOL`.

Every later message about an admission (access-log entries, ext_proc, liveness)
carries only its id, so the id carries the pool: ``<pool>.<32 hex>`` for a named
pool, the plain 32 hex digits for the default pool (ids look as they do without
pools). :class:`PooledAdmission` routes each call to the pool the id names; an id
naming no pool here (a pool removed across a restart) is treated as unknown.

With ``--coordination-url`` each pool's controller is a
:class:`~sidecar.coordination.controller.FleetController` over that pool's own ledger
(``pg:{fleet}:pool:<pool>``; the default pool keeps the fleet's ``pg:{fleet}``), and the
same routing by id holds (docs/design.md, "Pools in a fleet").
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Mapping

from sidecar.admission import AdmissionService, new_admission_id
from sidecar.classes import PriorityClass
from sidecar.codec import POOL_KEY
from sidecar.config import DEFAULT_POOL
from sidecar.metrics import NullRecorder, Recorder
from sidecar.scheduler import (
    Admitted,
    ClassSettings,
    ClassSnapshot,
    Event,
    Outcome,
    ReleaseReason,
    ReleaseResult,
    Snapshot,
)

SEPARATOR = "."  # never in a pool name nor in the hex part of an id

__all__ = [
    "DEFAULT_POOL",
    "POOL_KEY",
    "PoolRecorder",
    "PooledAdmission",
    "id_factory",
    "merge_snapshots",
    "pool_of",
]


def id_factory(pool: str) -> Callable[[], str]:
    """New admission ids that name ``pool`` (the default pool's are unchanged)."""
    if pool == DEFAULT_POOL:
        return new_admission_id
    prefix = pool + SEPARATOR
    return lambda: prefix + new_admission_id()


def pool_of(aid: str) -> str:
    name, sep, _ = aid.partition(SEPARATOR)
    return name if sep else DEFAULT_POOL


def merge_snapshots(snaps: list[Snapshot]) -> Snapshot:
    """The pools summed: what one core over all of them would report."""
    classes: dict[PriorityClass, ClassSnapshot] = {}
    for cls in PriorityClass:
        parts = [s.classes[cls] for s in snaps if cls in s.classes]
        tenants: dict[str, int] = {}
        for p in parts:
            for t, n in p.tenant_depths.items():
                tenants[t] = tenants.get(t, 0) + n
        classes[cls] = ClassSnapshot(
            inflight=sum(p.inflight for p in parts),
            queue_depth=sum(p.queue_depth for p in parts),
            queue_limit=sum(p.queue_limit for p in parts),
            reserved=sum(p.reserved for p in parts),
            tenant_depths=tenants)
    return Snapshot(capacity=sum(s.capacity for s in snaps),
                    inflight=sum(s.inflight for s in snaps), classes=classes)


class PoolRecorder(NullRecorder):
    """What a pool's controller records: its events under its pool's label (a fleet
    controller's coordination series and a pool's shadow's would-be decisions too;
    docs/reference.md, Metrics)."""

    def __init__(self, metrics: Recorder, pool: str) -> None:
        self._metrics = metrics
        self.pool = pool

    def on_events(self, events: Iterable[Event]) -> None:
        self._metrics.pool_events(self.pool, events)

    def rate_limit(self, allowed: bool) -> None:
        self._metrics.rate_limit(allowed)

    def shadow_admit(self, cls: PriorityClass, outcome: Outcome,
                     pool: str | None = None) -> None:
        self._metrics.shadow_admit(cls, outcome, self.pool)  # --shadow: this pool's shadow

    def completion_unmatched(self, reason: str) -> None:
        self._metrics.completion_unmatched(reason)

    def preemption_undelivered(self) -> None:
        self._metrics.preemption_undelivered()

    def fleet_seen(self, inflight: Mapping[PriorityClass, int], live_replicas: int,
                   pool: str | None = None) -> None:
        self._metrics.fleet_seen(inflight, live_replicas, self.pool)

    def coordination_changed(self, state: str, pool: str | None = None) -> None:
        self._metrics.coordination_changed(state, self.pool)

    def coordination_fault(self, kind: str, pool: str | None = None) -> None:
        self._metrics.coordination_fault(kind, self.pool)

    def fleet_collision(self, kind: str, pool: str | None = None) -> None:
        self._metrics.fleet_collision(kind, self.pool)


class PooledAdmission:
    """An :class:`~sidecar.admission.AdmissionService` over one controller per pool.

    ``admit`` without a pool goes to the default pool; the Check handler picks the
    pool's controller itself (:meth:`get`). Everything keyed by an admission id is
    routed by the pool the id names.
    """

    def __init__(self, controllers: Mapping[str, AdmissionService],
                 metrics: Recorder | None = None) -> None:
        if DEFAULT_POOL not in controllers:
            raise ValueError("the default pool is missing")
        self.controllers = dict(controllers)
        self._metrics: Recorder = metrics if metrics is not None else NullRecorder()

    def get(self, pool: str) -> AdmissionService | None:
        return self.controllers.get(pool)

    def scope(self, aid: str) -> AdmissionService | None:
        """The controller an admission id's pool names (None: no such pool).

        Every call keyed by an id goes there; adoption's bound is that pool's capacity
        against that pool's leases (the sum over pools would let made-up ids naming a small
        pool fill it many times over).
        """
        return self.controllers.get(pool_of(aid))

    @property
    def legacy(self) -> bool:
        """Only when every pool fell back (a pool's own mode is its controller's)."""
        return all(c.legacy for c in self.controllers.values())

    @property
    def lease_count(self) -> int:
        return sum(c.lease_count for c in self.controllers.values())

    async def admit(self, cls: PriorityClass, tenant: str) -> Admitted:
        return await self.controllers[DEFAULT_POOL].admit(cls, tenant)

    def release(self, aid: str,
                reason: ReleaseReason = ReleaseReason.COMPLETED) -> ReleaseResult:
        c = self.scope(aid)
        if c is None:
            self._metrics.completion_unmatched(ReleaseResult.UNKNOWN.value)
            return ReleaseResult.UNKNOWN
        return c.release(aid, reason)

    def renew_or_adopt(self, aid: str, cls: PriorityClass | None = None,
                       tenant: str = "") -> bool:
        c = self.scope(aid)
        return c is not None and c.renew_or_adopt(aid, cls, tenant)

    def open_stop_channel(self, aid: str) -> asyncio.Future[None] | None:
        c = self.scope(aid)
        return None if c is None else c.open_stop_channel(aid)

    def holds(self, aid: str) -> bool:
        c = self.scope(aid)
        return c is not None and c.holds(aid)

    def hold_without_lease(self, aid: str) -> bool:
        c = self.scope(aid)
        return c is not None and c.hold_without_lease(aid)

    def lease_again(self, aid: str) -> bool:
        c = self.scope(aid)
        return c is not None and c.lease_again(aid)

    def unleased(self, aid: str) -> bool:
        c = self.scope(aid)
        return c is not None and c.unleased(aid)

    def mark_first_byte(self, aid: str) -> bool:
        c = self.scope(aid)
        return c is not None and c.mark_first_byte(aid)

    async def confirm_first_byte(self, aid: str) -> bool:
        # In process: True at once; a pool's fleet controller may wait for its ledger.
        c = self.scope(aid)
        return True if c is None else await c.confirm_first_byte(aid)

    def close_stop_channel(self, aid: str) -> None:
        c = self.scope(aid)
        if c is not None:
            c.close_stop_channel(aid)

    def set_capacity(self, capacity: int) -> None:
        """Only the default pool's: each pool's capacity comes from its own workers."""
        self.controllers[DEFAULT_POOL].set_capacity(capacity)

    def update_config(self, classes: Mapping[PriorityClass, ClassSettings]) -> None:
        for c in self.controllers.values():
            c.update_config(classes)

    def snapshot(self) -> Snapshot:
        return merge_snapshots([c.snapshot() for c in self.controllers.values()])

    def snapshots(self) -> dict[str, Snapshot]:
        return {name: c.snapshot() for name, c in self.controllers.items()}

    def close(self) -> None:
        for c in self.controllers.values():
            c.close()

