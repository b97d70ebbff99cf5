"""Prometheus metrics, names and labels exactly as the contract lists them.

Counters are fed from core events; gauges are computed when scraped (a
collector reads the core's snapshot), so they are never stale.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from sidecar.classes import HIGH_TO_LOW, PriorityClass
from sidecar.scheduler import Admitted, Event, Outcome, Preempted, Rejected, Released, Snapshot
from sidecar.scheduler.interface import capacity_pressure

# Only the contract's series: no *_created timestamp per counter child.
disable_created_metrics()  # type: ignore[no-untyped-call]

QUEUE_WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30,
                      60, 120, 300)


class TenantLabels:
    """Caps tenant label values: the first ``top_n`` tenants seen keep their name.

    Later tenants are reported as ``other``; first-come keeps each series stable
    for its lifetime, which a volume ranking would not.
    """

    OTHER = "other"

    def __init__(self, top_n: int) -> None:
        self._top_n = top_n
        self._known: set[str] = set()

    def __call__(self, tenant: str) -> str:
        if tenant in self._known:
            return tenant
        if len(self._known) < self._top_n and tenant != self.OTHER:
            self._known.add(tenant)
            return tenant
        return self.OTHER


class Metrics:
    """All metrics of one sidecar, on its own registry."""

    def __init__(self, *, tenant_top_n: int, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.tenant = TenantLabels(tenant_top_n)
        self.admit = Counter("smg_scheduler_admit", "Admission decisions by class and outcome",
                             ["class", "outcome"], registry=r)
        self.queue_wait = Histogram("smg_scheduler_queue_wait_seconds",
                                    "Time admitted requests waited in their class queue",
                                    ["class"], buckets=QUEUE_WAIT_BUCKETS, registry=r)
        self.preemption = Counter("smg_scheduler_preemption", "Preemptions",
                                  ["victim_class", "by_class"], registry=r)
        self.clamp = Counter("smg_scheduler_clamp", "Requests clamped to their tenant ceiling",
                             ["tenant", "requested_class", "effective_class"], registry=r)
        self.unknown_priority = Counter("smg_scheduler_unknown_priority_value",
                                        "Unrecognised x-smg-priority values", ["tenant"],
                                        registry=r)
        self.starvation = Counter("smg_scheduler_starvation_promotion",
                                  "Queue heads admitted by the starvation rule", ["class"],
                                  registry=r)
        self.rate_limit_total = Counter("smg_http_rate_limit", "Request-rate check results",
                                        ["result"], registry=r)
        self.lease_expired_total = Counter("smg_sidecar_lease_expired",
                                           "Admissions reclaimed because their lease expired",
                                           ["class"], registry=r)
        self.unmatched = Counter("smg_sidecar_completion_unmatched",
                                 "Completions for unknown or already-released admissions",
                                 ["reason"], registry=r)
        self.adopted_total = Counter("smg_sidecar_adopted",
                                     "Streams admitted by an earlier sidecar process, found "
                                     "still running via periodic access-log entries",
                                     ["class"], registry=r)
        self.released = Counter("smg_sidecar_released", "Admissions ended, by reason",
                                ["class", "reason"], registry=r)
        self.preemption_delivery_failed = Counter(
            "smg_sidecar_preemption_delivery_failed",
            "Preemptions whose 503 could not be written to Envoy (the victim may run on)",
            registry=r)
        self.reload = Counter("smg_sidecar_config_reload", "Config reloads", ["result"],
                              registry=r)
        self.config_generation = Gauge("smg_sidecar_config_generation",
                                       "Generation of the config in force (1 = startup)",
                                       registry=r)
        self.config_info = Gauge("smg_sidecar_config_info", "Config in force (hash label)",
                                 ["sha256"], registry=r)
        self.capacity_source = Gauge("smg_sidecar_capacity_source",
                                     "Where capacity comes from (1 = in force)", ["source"],
                                     registry=r)
        self.healthy_workers = Gauge("smg_sidecar_healthy_workers", "Workers counted healthy",
                                     registry=r)
        self.mode = Gauge("smg_sidecar_admission_mode",
                          "Admission path in force (1 = active)", ["mode"], registry=r)
        self._worker_capacity: Mapping[tuple[str, str], int] = {}
        r.register(_WorkerCapacityCollector(lambda: self._worker_capacity))
        # Label children resolved once: labels() costs a lock and a tuple per call,
        # and these run on every admission.
        self._admit_child = {(cls, outcome): self.admit.labels(cls.label, outcome.value)
                             for cls in HIGH_TO_LOW for outcome in Outcome}
        self._wait_child = {cls: self.queue_wait.labels(cls.label) for cls in HIGH_TO_LOW}
        self._released_child: dict[tuple[PriorityClass, str], Counter] = {}
        for result in ("allowed", "rejected"):
            self.rate_limit_total.labels(result)
        for result in ("ok", "error"):
            self.reload.labels(result)

    # -- counters fed by the controller and the gRPC layer

    def on_events(self, events: Iterable[Event]) -> None:
        for e in events:
            if isinstance(e, Released):
                key = (e.admission.cls, e.reason)
                child = self._released_child.get(key)
                if child is None:
                    child = self._released_child[key] = self.released.labels(
                        e.admission.cls.label, e.reason)
                child.inc()
            elif isinstance(e, Admitted):
                cls = e.admission.cls
                if e.adopted:
                    continue  # counted by adopted(); this process made no decision
                self._admit_child[(cls, Outcome.ADMITTED)].inc()
                self._wait_child[cls].observe(e.waited)
                if e.starvation:
                    self.starvation.labels(cls.label).inc()
            elif isinstance(e, Rejected):
                self._admit_child[(e.cls, e.outcome)].inc()
            elif isinstance(e, Preempted):
                self._admit_child[(e.victim.cls, Outcome.PREEMPTED)].inc()
                self.preemption.labels(e.victim.cls.label, e.by_class.label).inc()

    def classified(self, tenant: str, requested: PriorityClass, effective: PriorityClass,
                   unknown: bool) -> None:
        if unknown:
            self.unknown_priority.labels(self.tenant(tenant)).inc()
        if effective < requested:
            self.clamp.labels(self.tenant(tenant), requested.label, effective.label).inc()

    def rate_limit(self, allowed: bool) -> None:
        self.rate_limit_total.labels("allowed" if allowed else "rejected").inc()

    def lease_expired(self, cls: PriorityClass) -> None:
        self.lease_expired_total.labels(cls.label).inc()

    def completion_unmatched(self, reason: str) -> None:
        self.unmatched.labels(reason).inc()

    def adopted(self, cls: PriorityClass) -> None:
        self.adopted_total.labels(cls.label).inc()

    def set_capacity_source(self, source: str) -> None:
        for s in ("workers", "fallback", "override"):
            self.capacity_source.labels(s).set(1 if s == source else 0)

    def worker_capacity(self, per_worker: Mapping[tuple[str, str], int]) -> None:
        """Per healthy worker, ``{(worker, engine): capacity counted}``; replaces the last set
        (a worker gone or unhealthy loses its series)."""
        self._worker_capacity = dict(per_worker)

    def set_mode(self, legacy: bool) -> None:
        self.mode.labels("scheduler").set(0 if legacy else 1)
        self.mode.labels("legacy").set(1 if legacy else 0)

    def watch(self, snapshot: Callable[[], Snapshot]) -> None:
        """Register the scrape-time gauges over ``snapshot``."""
        self.registry.register(_SnapshotCollector(snapshot))


class _WorkerCapacityCollector(Collector):
    """Read at scrape time, so a scrape never sees a half-replaced worker set."""

    def __init__(self, current: Callable[[], Mapping[tuple[str, str], int]]) -> None:
        self._current = current

    def collect(self) -> Iterator[GaugeMetricFamily]:
        fam = GaugeMetricFamily("smg_sidecar_worker_capacity",
                                "Capacity each healthy worker counts for (after the "
                                "saturation guard)", labels=["worker", "engine"])
        for (worker, engine), cap in sorted(self._current().items()):
            fam.add_metric([worker, engine], cap)
        yield fam


class _SnapshotCollector(Collector):
    def __init__(self, snapshot: Callable[[], Snapshot]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[GaugeMetricFamily]:
        snap = self._snapshot()
        inflight = GaugeMetricFamily("smg_scheduler_inflight", "Admitted requests in flight",
                                     labels=["class"])
        depth = GaugeMetricFamily("smg_scheduler_queue_depth", "Requests queued",
                                  labels=["class"])
        limit = GaugeMetricFamily("smg_scheduler_queue_size_limit", "Queue size limit",
                                  labels=["class"])
        pressure = GaugeMetricFamily(
            "smg_scheduler_class_capacity_pressure",
            "0..1: queue fill or use beyond reservation, whichever is higher", labels=["class"])
        reserved = GaugeMetricFamily("smg_sidecar_reserved_slots",
                                     "Slots reserved for the class at current capacity",
                                     labels=["class"])
        for cls in HIGH_TO_LOW:
            c = snap.classes[cls]
            inflight.add_metric([cls.label], c.inflight)
            depth.add_metric([cls.label], c.queue_depth)
            limit.add_metric([cls.label], c.queue_limit)
            reserved.add_metric([cls.label], c.reserved)
            pressure.add_metric([cls.label], capacity_pressure(snap, cls))
        util = GaugeMetricFamily("smg_scheduler_utilization", "Sum of in-flight / capacity")
        util.add_metric([], snap.inflight / snap.capacity if snap.capacity else 0.0)
        cap = GaugeMetricFamily("smg_sidecar_capacity", "Live capacity (slots)")
        cap.add_metric([], snap.capacity)
        yield from (inflight, depth, limit, pressure, reserved, util, cap)
