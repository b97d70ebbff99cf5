"""Prometheus metrics, names and labels exactly as the contract lists them.

Metrics are fed by one route, the :class:`Recorder` verbs; nothing else
touches a counter or gauge. Who calls which verb:

==========================  =====================  ================================================
verb                        caller                 metrics
==========================  =====================  ================================================
``on_events``               admission controller   ``smg_scheduler_admit_total``,
                                                   ``smg_scheduler_queue_wait_seconds``,
                                                   ``smg_scheduler_starvation_promotion_total``,
                                                   ``smg_scheduler_preemption_total``,
                                                   ``smg_sidecar_released_total``,
                                                   ``smg_sidecar_lease_expired_total``,
                                                   ``smg_sidecar_adopted_total``,
                                                   ``smg_sidecar_tenant_admitted_total``
``rate_limit``              admission controller   ``smg_http_rate_limit_total``
``completion_unmatched``    admission controller   ``smg_sidecar_completion_unmatched_total``
``overloaded``              authz (Check)          ``smg_sidecar_overload_shed_total``
``unknown_pool``            authz (Check)          ``smg_sidecar_unknown_pool_total``
``pool_events``             a pool's controller    the metrics of on_events, the scheduler ones
                                                   with a ``pool`` label:
                                                   ``smg_scheduler_admit_total``,
                                                   ``smg_scheduler_queue_wait_seconds``,
                                                   ``smg_scheduler_starvation_promotion_total``,
                                                   ``smg_scheduler_preemption_total``,
                                                   ``smg_sidecar_released_total``,
                                                   ``smg_sidecar_lease_expired_total``,
                                                   ``smg_sidecar_adopted_total``,
                                                   ``smg_sidecar_tenant_admitted_total``
``pool_capacity_read``      app (a pool's monitor) the metrics of capacity_read, with a ``pool``
                                                   label but for the per-worker ones:
                                                   ``smg_sidecar_capacity_source``,
                                                   ``smg_sidecar_healthy_workers``,
                                                   ``smg_sidecar_worker_capacity``,
                                                   ``smg_sidecar_worker_probe_refused``,
                                                   ``smg_sidecar_engine_excess``
``pools_started``           app (build, pools)     with pools, the snapshot gauges (below) per
                                                   pool, with a ``pool`` label (registered
                                                   instead of started's)
``adoption_refused``        completion (ALS)       ``smg_sidecar_adoption_refused_total``
``admin_dropped``           admin HTTP server      ``smg_sidecar_admin_connections_dropped_total``
``classified``              authz (Check)          ``smg_scheduler_clamp_total``,
                                                   ``smg_scheduler_unknown_priority_value_total``
``ext_proc_stream``         completion (ext_proc)  ``smg_sidecar_ext_proc_streams_total``
``preemption_undelivered``  completion (ext_proc)  ``smg_sidecar_preemption_delivery_failed_total``
``capacity_read``           app (health monitor)   ``smg_sidecar_capacity_source``,
                                                   ``smg_sidecar_healthy_workers``,
                                                   ``smg_sidecar_worker_capacity``,
                                                   ``smg_sidecar_worker_probe_refused``,
                                                   ``smg_sidecar_engine_excess``
``started``                 app (build)            ``smg_sidecar_admission_mode``,
                                                   ``smg_sidecar_admission_fallback``,
                                                   ``smg_sidecar_config_generation``,
                                                   ``smg_sidecar_config_info``,
                                                   the snapshot gauges
``config_reloaded``         app (config reload)    ``smg_sidecar_config_generation``,
                                                   ``smg_sidecar_config_info``,
                                                   ``smg_sidecar_config_reload_total{ok}``
``config_reload_failed``    app (config reload)    ``smg_sidecar_config_reload_total{error}``
``fleet_seen``              fleet controller       ``smg_sidecar_fleet_inflight``,
                            (heartbeat)            ``smg_sidecar_live_replicas``
``preemption_suspended``    app (health monitor)   ``smg_sidecar_preemption_suspended``
``coordination_changed``    fleet controller       ``smg_sidecar_coordination_state``
``coordination_fault``      fleet controller       ``smg_sidecar_coordination_faults_total``
``server_checked``          app (start-up)         ``smg_sidecar_coordination_server_check``
``library_checked``         app (library watch)    ``smg_sidecar_coordination_library_state``,
                                                   ``smg_sidecar_coordination_library_mismatch_total``
``fleet_collision``         app (fleet watch)      ``smg_sidecar_fleet_collision_total``
``envoy_feature``           envoy_features         ``smg_sidecar_envoy_feature``
``envoy_streams``           liveness (ALS)         ``smg_sidecar_envoy_access_log_streams``,
                                                   ``smg_sidecar_envoy_owners_alive``
``owner_lost``              liveness (timer)       ``smg_sidecar_envoy_owner_lost_total``,
                                                   ``smg_sidecar_envoy_owner_released_total``
``owner_blip``              liveness (admin)       ``smg_sidecar_envoy_owner_blips_total``
``edge_shed``               edge (shed access log) ``smg_scheduler_admit_total``,
                                                   ``smg_sidecar_edge_shed_total``
``edge_share``              edge (control loop)    ``smg_sidecar_edge_shed_share``
``shadow_admit``            shadow (--shadow)      ``smg_sidecar_shadow_admit_total`` (with
                                                   pools: a pool's shadow, ``pool`` label)
``shadow_started``          app (build, --shadow)  ``smg_sidecar_shadow_inflight``,
                                                   ``smg_sidecar_shadow_queue_depth`` (with
                                                   pools: per pool, ``pool`` label)
==========================  =====================  ================================================

The snapshot gauges, registered by ``started``, are computed when scraped
from the core's snapshot, so they are never stale: ``smg_scheduler_inflight``,
``smg_scheduler_queue_depth``, ``smg_scheduler_queue_size_limit``,
``smg_scheduler_class_capacity_pressure``, ``smg_scheduler_utilization``,
``smg_sidecar_reserved_slots``, ``smg_sidecar_capacity``,
``smg_sidecar_tenant_queue_depth``.

tests/test_metrics.py checks this table against what each verb really changes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Protocol

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from sidecar.capacity import CapacityReading, per_worker, worker_problems
from sidecar.classes import HIGH_TO_LOW, PriorityClass
from sidecar.config import DEFAULT_POOL
from sidecar.scheduler import (
    Admitted,
    Event,
    Outcome,
    Preempted,
    Rejected,
    Released,
    ReleaseReason,
    Snapshot,
)
from sidecar.scheduler.interface import capacity_pressure

# Only the contract's series: no *_created timestamp per counter child.
disable_created_metrics()  # type: ignore[no-untyped-call]

COORDINATION_STATES = ("ok", "degraded")
FALLBACK_MODES = ("legacy", "legacy_uncapped")
FALLBACK_REASONS = ("reservations_exceed_capacity",)
SERVER_CHECKS = ("eviction", "persistence")
SERVER_CHECK_RESULTS = ("ok", "risk", "unknown")
LIBRARY_STATES = ("ok", "missing", "mismatch", "unchecked")

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


class Recorder(Protocol):
    """The named verbs: the only way anything in the sidecar feeds a metric.

    :class:`Metrics` is the implementation; :class:`NullRecorder` records nothing
    (tests and benchmarks that drive one part alone).
    """

    def on_events(self, events: Iterable[Event]) -> None:
        """The core's events: admit outcomes, queue waits, starvation, preemptions,
        releases (lease expiry included) and adoptions."""

    def rate_limit(self, allowed: bool) -> None:
        """One request-rate check before admission."""

    def completion_unmatched(self, reason: str) -> None:
        """A release for an unknown or already-released admission (``ReleaseResult``)."""

    def overloaded(self, cls: PriorityClass) -> None:
        """A Check shed before admission because too many Checks are open at once."""

    def unknown_pool(self, cls: PriorityClass) -> None:
        """A Check whose route names a pool this sidecar does not have (429)."""

    def pool_events(self, pool: str, events: Iterable[Event]) -> None:
        """A pool's admission events (``Metrics(pools=True)``: series with ``pool``)."""

    def pool_capacity_read(self, pool: str, reading: CapacityReading) -> None:
        """A pool's capacity reading."""

    def pools_started(self, snapshots: Callable[[], Mapping[str, Snapshot]]) -> None:
        """The scrape-time gauges of every pool (only with ``Metrics(pools=True)``)."""

    def adoption_refused(self, cls: PriorityClass) -> None:
        """A periodic entry not adopted: as many admissions as the capacity are in flight."""

    def admin_dropped(self, reason: str) -> None:
        """An admin HTTP connection closed by its bounds: ``over_cap`` (evicted or
        refused at the connection cap), ``deadline`` (no complete request in time) or
        ``exhausted`` (closed to free a descriptor after an accept failed with EMFILE)."""

    def classified(self, tenant: str, requested: PriorityClass, effective: PriorityClass,
                   unknown: bool) -> None:
        """A Check whose header value was unknown or whose class was clamped."""

    def ext_proc_stream(self, admitted: bool) -> None:
        """An ext_proc stream Envoy opened: for an admitted request, or for anything
        else (a local reply, a message without an admission id)."""

    def preemption_undelivered(self) -> None:
        """A preemption whose 503 could not be written to Envoy."""

    def capacity_read(self, reading: CapacityReading) -> None:
        """A changed capacity reading: where capacity comes from, workers counted
        healthy, and what each healthy worker counts for."""

    def started(self, *, legacy: bool, snapshot: Callable[[], Snapshot],
                config_digest: str, fallback: tuple[str, str] | None = None) -> None:
        """Admission is built: its mode, the scrape-time gauges over ``snapshot``,
        and the start-up config (generation 1). ``fallback`` (mode, reason): the
        scheduler was enabled, yet legacy admission serves."""

    def config_reloaded(self, generation: int, digest: str) -> None:
        """A new config is in force."""

    def config_reload_failed(self) -> None:
        """A changed config file was refused; the old config stays."""

    def fleet_seen(self, inflight: Mapping[PriorityClass, int], live_replicas: int,
                   pool: str | None = None) -> None:
        """A heartbeat's answer: fleet-wide in-flight counts and live replicas (of
        ``pool``'s ledger: pools in a fleet, ``Metrics(pools=True)``; the same for the
        three verbs below)."""

    def preemption_suspended(self, suspended: bool) -> None:
        """No class preempts (a counted worker's engine cannot cancel), or they may again."""

    def coordination_changed(self, state: str, pool: str | None = None) -> None:
        """The fleet controller's state is now ``ok`` or ``degraded``."""

    def coordination_fault(self, kind: str, pool: str | None = None) -> None:
        """The ledger lost writes (``server_changed``, ``stale_copy``, ``admissions_lost``),
        repaired a key from its records (``counters_lost``, ``owners_lost``), this process
        took over its predecessor's admissions (``taken_over``), or an id it
        runs had ended in the ledger (``ended_but_running_readded`` / ``_stopped``)."""

    def server_checked(self, check: str, result: str) -> None:
        """A coordination server setting was checked at start-up: ``check`` (eviction,
        persistence) is ``ok``, a ``risk`` or ``unknown`` (could not be read)."""

    def library_checked(self, state: str) -> None:
        """The server's ledger library was compared with this version's code."""

    def fleet_collision(self, kind: str, pool: str | None = None) -> None:
        """A second class config (``config``) or capacity source (``capacity_source``)
        appeared among the live replicas of this fleet id."""
    def envoy_feature(self, feature: str, state: str) -> None:
        """What the sidecar inferred about an Envoy setting it relies on
        (``sidecar.envoy_features``): unknown, present or absent."""

    def envoy_streams(self, open_streams: int, alive_owners: int) -> None:
        """Access-log streams open now, and the Envoys (owners) they come from."""

    def owner_lost(self, released: int) -> None:
        """An Envoy's streams stayed closed past the grace: ``released`` admissions freed."""

    def owner_blip(self) -> None:
        """An Envoy's streams closed, but its admin says the same process runs."""

    def edge_shed(self, cls: PriorityClass, n: int, pool: str | None = None) -> None:
        """Envoy answered ``n`` requests of ``cls`` with the queue-full 429 itself (edge
        shedding): counted as the contract counts them, and as edge sheds (with pools,
        on ``pool``'s route: ``Metrics(pools=True)``, series with ``pool``)."""

    def shadow_admit(self, cls: PriorityClass, outcome: Outcome,
                     pool: str | None = None) -> None:
        """--shadow: a decision enforcement would have made (nothing was refused); with
        pools, ``pool``'s shadow made it (``Metrics(pools=True)``: series with ``pool``)."""

    def shadow_started(self, snapshot: Callable[[], Snapshot],
                       pools: Callable[[], Mapping[str, Snapshot]] | None = None) -> None:
        """--shadow: scrape-time gauges of the would-be in-flight and queued requests
        (``pools``: every pool's shadow, with ``Metrics(pools=True)``)."""

    def edge_share(self, cls: PriorityClass, share: float, pool: str | None = None) -> None:
        """The share of ``cls``'s requests (on ``pool``'s route) Envoy is told to answer
        itself."""


class NullRecorder:
    """Records nothing."""

    def on_events(self, events: Iterable[Event]) -> None:
        pass

    def rate_limit(self, allowed: bool) -> None:
        pass

    def completion_unmatched(self, reason: str) -> None:
        pass

    def overloaded(self, cls: PriorityClass) -> None:
        pass

    def unknown_pool(self, cls: PriorityClass) -> None:
        pass

    def pool_events(self, pool: str, events: Iterable[Event]) -> None:
        pass

    def pool_capacity_read(self, pool: str, reading: CapacityReading) -> None:
        pass

    def pools_started(self, snapshots: Callable[[], Mapping[str, Snapshot]]) -> None:
        pass

    def adoption_refused(self, cls: PriorityClass) -> None:
        pass

    def admin_dropped(self, reason: str) -> None:
        pass

    def classified(self, tenant: str, requested: PriorityClass, effective: PriorityClass,
                   unknown: bool) -> None:
        pass

    def ext_proc_stream(self, admitted: bool) -> None:
        pass

    def preemption_undelivered(self) -> None:
        pass

    def capacity_read(self, reading: CapacityReading) -> None:
        pass

    def started(self, *, legacy: bool, snapshot: Callable[[], Snapshot],
                config_digest: str, fallback: tuple[str, str] | None = None) -> None:
        pass

    def config_reloaded(self, generation: int, digest: str) -> None:
        pass

    def config_reload_failed(self) -> None:
        pass

    def fleet_seen(self, inflight: Mapping[PriorityClass, int], live_replicas: int,
                   pool: str | None = None) -> None:
        pass

    def preemption_suspended(self, suspended: bool) -> None:
        pass

    def coordination_changed(self, state: str, pool: str | None = None) -> None:
        pass

    def coordination_fault(self, kind: str, pool: str | None = None) -> None:
        pass

    def server_checked(self, check: str, result: str) -> None:
        pass

    def library_checked(self, state: str) -> None:
        pass

    def fleet_collision(self, kind: str, pool: str | None = None) -> None:
        pass

    def envoy_feature(self, feature: str, state: str) -> None:
        pass

    def envoy_streams(self, open_streams: int, alive_owners: int) -> None:
        pass

    def owner_lost(self, released: int) -> None:
        pass

    def owner_blip(self) -> None:
        pass

    def edge_shed(self, cls: PriorityClass, n: int, pool: str | None = None) -> None:
        pass

    def shadow_admit(self, cls: PriorityClass, outcome: Outcome,
                     pool: str | None = None) -> None:
        pass

    def shadow_started(self, snapshot: Callable[[], Snapshot],
                       pools: Callable[[], Mapping[str, Snapshot]] | None = None) -> None:
        pass

    def edge_share(self, cls: PriorityClass, share: float, pool: str | None = None) -> None:
        pass


class Metrics:
    """All metrics of one sidecar, on its own registry, fed only through the
    :class:`Recorder` verbs (the Prometheus objects are private)."""

    def __init__(self, *, tenant_top_n: int, registry: CollectorRegistry | None = None,
                 pools: bool = False) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self._tenant = TenantLabels(tenant_top_n)
        # Pools (sidecar.pools): the scheduler and capacity series gain a leading `pool`
        # label; without pools they are exactly the contract's.
        self._pooled = pools
        pl = ["pool"] if pools else []
        self._admit = Counter("smg_scheduler_admit", "Admission decisions by class and outcome",
                              [*pl, "class", "outcome"], registry=r)
        self._queue_wait = Histogram("smg_scheduler_queue_wait_seconds",
                                     "Time admitted requests waited in their class queue",
                                     [*pl, "class"], buckets=QUEUE_WAIT_BUCKETS, registry=r)
        self._preemption = Counter("smg_scheduler_preemption", "Preemptions",
                                   [*pl, "victim_class", "by_class"], registry=r)
        self._clamp = Counter("smg_scheduler_clamp", "Requests clamped to their tenant ceiling",
                              ["tenant", "requested_class", "effective_class"], registry=r)
        self._unknown_priority = Counter("smg_scheduler_unknown_priority_value",
                                         "Unrecognised x-smg-priority values", ["tenant"],
                                         registry=r)
        self._starvation = Counter("smg_scheduler_starvation_promotion",
                                   "Queue heads admitted by the starvation rule",
                                   [*pl, "class"], registry=r)
        self._rate_limit = Counter("smg_http_rate_limit", "Request-rate check results",
                                   ["result"], registry=r)
        self._overload = Counter("smg_sidecar_overload_shed",
                                 "Checks shed because too many were open at once "
                                 "(429 scheduler_queue_full)", ["class"], registry=r)
        # Labelled, so that without pools no series exists (nothing can count then).
        self._unknown_pool = Counter(
            "smg_sidecar_unknown_pool",
            "Checks whose route names a pool the sidecar does not have "
            "(429 scheduler_queue_full)", ["class"], registry=r)
        self._adoption_refused = Counter(
            "smg_sidecar_adoption_refused",
            "Periodic access-log entries not adopted because admissions in flight "
            "already reached the capacity", ["class"], registry=r)
        self._ext_proc_streams = Counter(
            "smg_sidecar_ext_proc_streams", "ext_proc streams Envoy opened, by whether they "
            "carried an admission id", ["admitted"], registry=r)
        self._admin_dropped = Counter("smg_sidecar_admin_connections_dropped",
                                      "Admin HTTP connections closed by the connection cap "
                                      "or the request deadline", ["reason"], registry=r)
        self._lease_expired = Counter("smg_sidecar_lease_expired",
                                      "Admissions reclaimed because their lease expired",
                                      ["class"], registry=r)
        self._unmatched = Counter("smg_sidecar_completion_unmatched",
                                  "Completions for unknown or already-released admissions",
                                  ["reason"], registry=r)
        self._adopted = Counter("smg_sidecar_adopted",
                                "Streams admitted by an earlier sidecar process, found "
                                "still running via periodic access-log entries",
                                ["class"], registry=r)
        self._released = Counter("smg_sidecar_released", "Admissions ended, by reason",
                                 ["class", "reason"], registry=r)
        self._tenant_admitted = Counter("smg_sidecar_tenant_admitted",
                                        "Admissions by class and tenant (tenant label capped)",
                                        ["class", "tenant"], registry=r)
        self._preemption_undelivered = Counter(
            "smg_sidecar_preemption_delivery_failed",
            "Preemptions whose 503 could not be written to Envoy (the victim may run on)",
            registry=r)
        self._reload = Counter("smg_sidecar_config_reload", "Config reloads", ["result"],
                               registry=r)
        self._config_generation = Gauge("smg_sidecar_config_generation",
                                        "Generation of the config in force (1 = startup)",
                                        registry=r)
        self._config_info = Gauge("smg_sidecar_config_info", "Config in force (hash label)",
                                  ["sha256"], registry=r)
        self._capacity_source = Gauge("smg_sidecar_capacity_source",
                                      "Where capacity comes from (1 = in force)",
                                      [*pl, "source"], registry=r)
        self._healthy_workers = Gauge("smg_sidecar_healthy_workers",
                                      "Workers counted healthy", pl, registry=r)
        self._envoy_feature = Gauge(
            "smg_sidecar_envoy_feature",
            "Envoy settings the sidecar relies on, as inferred from traffic (1 = current state)",
            ["feature", "state"], registry=self.registry)
        self._als_streams = Gauge("smg_sidecar_envoy_access_log_streams",
                                  "Access-log streams Envoy holds open to this sidecar",
                                  registry=r)
        self._owners_alive = Gauge("smg_sidecar_envoy_owners_alive",
                                   "Envoys (by peer host) with an access-log stream open",
                                   registry=r)
        self._owner_lost = Counter("smg_sidecar_envoy_owner_lost",
                                   "Envoys whose access-log streams stayed closed past "
                                   "--envoy-owner-grace-secs", registry=r)
        self._owner_released = Counter("smg_sidecar_envoy_owner_released",
                                       "Admissions released because the Envoy that asked "
                                       "for them died", registry=r)
        self._owner_blips = Counter("smg_sidecar_envoy_owner_blips",
                                    "Envoys whose access-log streams closed while their "
                                    "admin showed the same process running", registry=r)
        self._mode = Gauge("smg_sidecar_admission_mode",
                           "Admission path in force (1 = active)", ["mode"], registry=r)
        self._fallback = Gauge("smg_sidecar_admission_fallback",
                               "1 while the scheduler is enabled but legacy admission serves, "
                               "by mode (legacy_uncapped: no concurrency cap) and reason",
                               ["mode", "reason"], registry=r)
        self._fleet_inflight = Gauge("smg_sidecar_fleet_inflight",
                                     "Fleet-wide admissions in flight, as the ledger saw them "
                                     "at the last heartbeat", [*pl, "class"], registry=r)
        self._live_replicas = Gauge("smg_sidecar_live_replicas",
                                    "Live replicas of the fleet, this one included (0 without "
                                    "coordination)", pl, registry=r)
        self._preemption_suspended = Gauge(
            "smg_sidecar_preemption_suspended",
            "1 while no class preempts because a counted worker's engine cannot cancel a "
            "running request (llama.cpp)", registry=r)
        self._coordination = Gauge("smg_sidecar_coordination_state",
                                   "Fleet coordination state (1 = current)", [*pl, "state"],
                                   registry=r)
        self._coordination_faults = Counter(
            "smg_sidecar_coordination_faults",
            "Ledger faults this replica found or repaired, by kind", [*pl, "kind"],
            registry=r)
        self._server_check = Gauge(
            "smg_sidecar_coordination_server_check",
            "Coordination server settings checked at start-up (1 = current result): "
            "eviction (maxmemory-policy), persistence (RDB/AOF)", ["check", "result"],
            registry=r)
        self._library_state = Gauge(
            "smg_sidecar_coordination_library_state",
            "The server's ledger library compared with this version's code (1 = current)",
            ["state"], registry=r)
        self._library_mismatch = Counter(
            "smg_sidecar_coordination_library_mismatch",
            "Checks that found the ledger library replaced by other code", registry=r)
        self._fleet_collision = Counter(
            "smg_sidecar_fleet_collision",
            "A second class config or capacity source seen among the live replicas of this "
            "fleet id (another deployment with the same --fleet-id?)", [*pl, "kind"],
            registry=r)
        self._worker_capacity: Mapping[tuple[str, str], int] = {}
        r.register(_WorkerCapacityCollector(lambda: self._worker_capacity))
        self._worker_problems: Mapping[tuple[str, str, str], int] = {}
        self._engine_excess = Gauge("smg_sidecar_engine_excess",
                                    "Requests the engines run or queue beyond what the "
                                    "sidecar holds (--saturation-guard)", pl, registry=r)
        self._pool_workers: dict[str, tuple[dict[tuple[str, str], int],
                                            dict[tuple[str, str, str], int]]] = {}
        r.register(_WorkerProblemCollector(lambda: self._worker_problems))
        # Label children resolved once: labels() costs a lock and a tuple per call,
        # and these run on every admission.
        self._admit_child = {} if pools else {
            (cls, outcome): self._admit.labels(cls.label, outcome.value)
            for cls in HIGH_TO_LOW for outcome in Outcome}
        self._wait_child = {} if pools else {
            cls: self._queue_wait.labels(cls.label) for cls in HIGH_TO_LOW}
        # Per pool, the same children with the pool's label value first.
        self._pool_children: dict[str, tuple[dict[tuple[PriorityClass, Outcome], Counter],
                                             dict[PriorityClass, Histogram]]] = {}
        self._released_child: dict[tuple[PriorityClass, str], Counter] = {}
        # Keyed by the capped label, so they stay as small as the label sets. A flood of
        # clamped or mislabelled Checks reaches classified() on every one of them.
        self._tenant_child: dict[tuple[PriorityClass, str], Counter] = {}
        self._clamp_child: dict[tuple[str, PriorityClass, PriorityClass], Counter] = {}
        self._unknown_child: dict[str, Counter] = {}
        self._rate_child = {allowed: self._rate_limit.labels("allowed" if allowed else "rejected")
                            for allowed in (True, False)}
        self._overload_child = {cls: self._overload.labels(cls.label) for cls in HIGH_TO_LOW}
        self._edge_shed = Counter(
            "smg_sidecar_edge_shed",
            "Requests Envoy answered with the queue-full 429 itself (edge shedding), by class "
            "(also in smg_scheduler_admit_total{outcome=\"rejected_queue_full\"})",
            [*pl, "class"], registry=r)
        self._edge_share = Gauge(
            "smg_sidecar_edge_shed_share",
            "Share of the class's requests Envoy is told to answer itself (0 = off)",
            [*pl, "class"], registry=r)
        # Not smg_scheduler_admit_total: that one counts what really happened (all admitted).
        self._shadow_admit = Counter(
            "smg_sidecar_shadow_admit",
            "--shadow: decisions enforcement would have made, by class and outcome (the "
            "requests were all admitted; smg_scheduler_admit_total counts that)",
            [*pl, "class", "outcome"], registry=r)
        for cls in HIGH_TO_LOW:
            self._adoption_refused.labels(cls.label)
            if pools:  # at 0 from the start where pools exist (nothing counts without)
                self._unknown_pool.labels(cls.label)
        if pools:
            # Pools in a fleet: the coordination series are per pool's ledger, too
            # (sidecar.pools). Without coordination it reads 0, as without pools.
            self._live_replicas.labels(DEFAULT_POOL)
        for admitted in ("true", "false"):
            self._ext_proc_streams.labels(admitted)
        for reason in ("over_cap", "deadline", "exhausted"):
            self._admin_dropped.labels(reason)
        for result in ("ok", "error"):
            self._reload.labels(result)

    def on_events(self, events: Iterable[Event]) -> None:
        self._count(events, self._admit_child, self._wait_child, ())

    def pool_events(self, pool: str, events: Iterable[Event]) -> None:
        if not self._pooled:
            self.on_events(events)
            return
        children = self._pool_children.get(pool)
        if children is None:
            children = self._pool_children[pool] = (
                {(cls, o): self._admit.labels(pool, cls.label, o.value)
                 for cls in HIGH_TO_LOW for o in Outcome},
                {cls: self._queue_wait.labels(pool, cls.label) for cls in HIGH_TO_LOW})
        self._count(events, children[0], children[1], (pool,))

    def _count(self, events: Iterable[Event],
               admit_child: Mapping[tuple[PriorityClass, Outcome], Counter],
               wait_child: Mapping[PriorityClass, Histogram], pl: tuple[str, ...]) -> None:
        for e in events:
            if isinstance(e, Released):
                cls = e.admission.cls
                key = (cls, e.reason)
                child = self._released_child.get(key)
                if child is None:
                    child = self._released_child[key] = self._released.labels(
                        cls.label, e.reason)
                child.inc()
                if e.reason is ReleaseReason.LEASE_EXPIRED:
                    self._lease_expired.labels(cls.label).inc()
            elif isinstance(e, Admitted):
                cls = e.admission.cls
                if e.adopted:
                    # Admitted by an earlier process: not a decision of this one.
                    self._adopted.labels(cls.label).inc()
                    continue
                admit_child[(cls, Outcome.ADMITTED)].inc()
                wait_child[cls].observe(e.waited)
                tkey = (cls, self._tenant(e.admission.tenant))
                tchild = self._tenant_child.get(tkey)
                if tchild is None:
                    tchild = self._tenant_child[tkey] = self._tenant_admitted.labels(
                        cls.label, tkey[1])
                tchild.inc()
                if e.starvation:
                    self._starvation.labels(*pl, cls.label).inc()
            elif isinstance(e, Rejected):
                admit_child[(e.cls, e.outcome)].inc()
            elif isinstance(e, Preempted):
                admit_child[(e.victim.cls, Outcome.PREEMPTED)].inc()
                self._preemption.labels(*pl, e.victim.cls.label, e.by_class.label).inc()

    def rate_limit(self, allowed: bool) -> None:
        self._rate_child[allowed].inc()

    def completion_unmatched(self, reason: str) -> None:
        self._unmatched.labels(reason).inc()

    def overloaded(self, cls: PriorityClass) -> None:
        self._overload_child[cls].inc()

    def unknown_pool(self, cls: PriorityClass) -> None:
        self._unknown_pool.labels(cls.label).inc()

    def adoption_refused(self, cls: PriorityClass) -> None:
        self._adoption_refused.labels(cls.label).inc()

    def admin_dropped(self, reason: str) -> None:
        self._admin_dropped.labels(reason).inc()

    def classified(self, tenant: str, requested: PriorityClass, effective: PriorityClass,
                   unknown: bool) -> None:
        label = self._tenant(tenant)
        if unknown:
            child = self._unknown_child.get(label)
            if child is None:
                child = self._unknown_child[label] = self._unknown_priority.labels(label)
            child.inc()
        if effective < requested:
            key = (label, requested, effective)
            child = self._clamp_child.get(key)
            if child is None:
                child = self._clamp_child[key] = self._clamp.labels(
                    label, requested.label, effective.label)
            child.inc()

    def ext_proc_stream(self, admitted: bool) -> None:
        self._ext_proc_streams.labels("true" if admitted else "false").inc()

    def preemption_undelivered(self) -> None:
        self._preemption_undelivered.inc()

    def capacity_read(self, reading: CapacityReading) -> None:
        if self._pooled:  # before the runtime wires the pools: the default pool's monitor
            self.pool_capacity_read(DEFAULT_POOL, reading)
            return
        for s in ("workers", "fallback", "override"):
            self._capacity_source.labels(s).set(1 if s == reading.source else 0)
        self._healthy_workers.set(reading.healthy)
        # Replaced as a whole: a worker gone or unhealthy loses its series.
        self._worker_capacity = dict(per_worker(reading))
        self._worker_problems = dict(worker_problems(reading))
        self._engine_excess.set(reading.excess)

    def pool_capacity_read(self, pool: str, reading: CapacityReading) -> None:
        if not self._pooled:
            self.capacity_read(reading)
            return
        for s in ("workers", "fallback", "override"):
            self._capacity_source.labels(pool, s).set(1 if s == reading.source else 0)
        self._healthy_workers.labels(pool).set(reading.healthy)
        self._engine_excess.labels(pool).set(reading.excess)
        # Worker series are per worker already: all pools' workers, replaced as a whole.
        self._pool_workers[pool] = (dict(per_worker(reading)), dict(worker_problems(reading)))
        self._worker_capacity = {k: v for wc, _ in self._pool_workers.values()
                                 for k, v in wc.items()}
        self._worker_problems = {k: v for _, wp in self._pool_workers.values()
                                 for k, v in wp.items()}

    def pools_started(self, snapshots: Callable[[], Mapping[str, Snapshot]]) -> None:
        if self._pooled:
            self.registry.register(_SnapshotCollector(lambda: next(iter(snapshots().values())),
                                                      self._tenant, snapshots))

    def started(self, *, legacy: bool, snapshot: Callable[[], Snapshot],
                config_digest: str, fallback: tuple[str, str] | None = None) -> None:
        self._mode.labels("scheduler").set(0 if legacy else 1)
        self._mode.labels("legacy").set(1 if legacy else 0)
        for mode in FALLBACK_MODES:  # every series present: 0 is "no fallback"
            for reason in FALLBACK_REASONS:
                self._fallback.labels(mode, reason).set(1 if fallback == (mode, reason) else 0)
        if not self._pooled:  # with pools: pools_started, per pool
            self.registry.register(_SnapshotCollector(snapshot, self._tenant))
        self._config_generation.set(1)
        self._config_info.labels(config_digest).set(1)

    def config_reloaded(self, generation: int, digest: str) -> None:
        self._config_generation.set(generation)
        self._config_info.clear()
        self._config_info.labels(digest).set(1)
        self._reload.labels("ok").inc()

    def config_reload_failed(self) -> None:
        self._reload.labels("error").inc()

    def _pl(self, pool: str | None) -> tuple[str, ...]:
        """The pool label's value where the series have one (``pools=True``)."""
        return (pool or DEFAULT_POOL,) if self._pooled else ()

    def fleet_seen(self, inflight: Mapping[PriorityClass, int], live_replicas: int,
                   pool: str | None = None) -> None:
        pl = self._pl(pool)
        for cls in HIGH_TO_LOW:
            self._fleet_inflight.labels(*pl, cls.label).set(inflight.get(cls, 0))
        (self._live_replicas.labels(*pl) if pl else self._live_replicas).set(live_replicas)

    def preemption_suspended(self, suspended: bool) -> None:
        self._preemption_suspended.set(1 if suspended else 0)

    def coordination_changed(self, state: str, pool: str | None = None) -> None:
        pl = self._pl(pool)
        for s in COORDINATION_STATES:
            self._coordination.labels(*pl, s).set(1 if s == state else 0)

    def coordination_fault(self, kind: str, pool: str | None = None) -> None:
        self._coordination_faults.labels(*self._pl(pool), kind).inc()

    def server_checked(self, check: str, result: str) -> None:
        for r in SERVER_CHECK_RESULTS:
            self._server_check.labels(check, r).set(1 if r == result else 0)

    def library_checked(self, state: str) -> None:
        for st in LIBRARY_STATES:
            self._library_state.labels(st).set(1 if st == state else 0)
        if state == "mismatch":
            self._library_mismatch.inc()

    def fleet_collision(self, kind: str, pool: str | None = None) -> None:
        self._fleet_collision.labels(*self._pl(pool), kind).inc()
    def envoy_feature(self, feature: str, state: str) -> None:
        for st in ("unknown", "present", "absent"):
            self._envoy_feature.labels(feature, st).set(1 if st == state else 0)

    def envoy_streams(self, open_streams: int, alive_owners: int) -> None:
        self._als_streams.set(open_streams)
        self._owners_alive.set(alive_owners)

    def owner_lost(self, released: int) -> None:
        self._owner_lost.inc()
        self._owner_released.inc(released)

    def owner_blip(self) -> None:
        self._owner_blips.inc()

    def edge_shed(self, cls: PriorityClass, n: int, pool: str | None = None) -> None:
        if self._pooled:
            pl = self._pl(pool)
            self._admit.labels(*pl, cls.label, Outcome.REJECTED_QUEUE_FULL.value).inc(n)
            self._edge_shed.labels(*pl, cls.label).inc(n)
            return
        self._admit_child[(cls, Outcome.REJECTED_QUEUE_FULL)].inc(n)
        self._edge_shed.labels(cls.label).inc(n)

    def edge_share(self, cls: PriorityClass, share: float, pool: str | None = None) -> None:
        self._edge_share.labels(*self._pl(pool), cls.label).set(share)

    def shadow_admit(self, cls: PriorityClass, outcome: Outcome,
                     pool: str | None = None) -> None:
        self._shadow_admit.labels(*self._pl(pool), cls.label, outcome.value).inc()

    def shadow_started(self, snapshot: Callable[[], Snapshot],
                       pools: Callable[[], Mapping[str, Snapshot]] | None = None) -> None:
        if self._pooled:
            one = snapshot
            pools = pools if pools is not None else lambda: {DEFAULT_POOL: one()}
            self.registry.register(_ShadowCollector(snapshot, pools))
        else:
            self.registry.register(_ShadowCollector(snapshot))


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


class _WorkerProblemCollector(Collector):
    """Healthy workers whose probes are refused now (401/403/501, a router without a
    loaded model): a worker fixed or gone loses its series."""

    def __init__(self, current: Callable[[], Mapping[tuple[str, str, str], int]]) -> None:
        self._current = current

    def collect(self) -> Iterator[GaugeMetricFamily]:
        fam = GaugeMetricFamily("smg_sidecar_worker_probe_refused",
                                "1 per healthy worker and endpoint whose probe was refused "
                                "in the last reading", labels=["worker", "endpoint", "reason"])
        for labels, value in sorted(self._current().items()):
            fam.add_metric(list(labels), value)
        yield fam


class _ShadowCollector(Collector):
    """--shadow: the shadow core's state at scrape time (the contract's gauges show the
    real traffic, where nothing queues)."""

    def __init__(self, snapshot: Callable[[], Snapshot],
                 pools: Callable[[], Mapping[str, Snapshot]] | None = None) -> None:
        self._snapshot = snapshot
        self._pools = pools  # set: every pool's shadow, with the `pool` label first

    def collect(self) -> Iterator[GaugeMetricFamily]:
        pl = ["pool"] if self._pools is not None else []
        snaps = ([((p,), s) for p, s in self._pools().items()] if self._pools is not None
                 else [((), self._snapshot())])
        inflight = GaugeMetricFamily("smg_sidecar_shadow_inflight",
                                     "--shadow: requests that would hold a slot now",
                                     labels=[*pl, "class"])
        depth = GaugeMetricFamily("smg_sidecar_shadow_queue_depth",
                                  "--shadow: requests that would be queued now",
                                  labels=[*pl, "class"])
        for p, snap in snaps:
            for cls in HIGH_TO_LOW:
                inflight.add_metric([*p, cls.label], snap.classes[cls].inflight)
                depth.add_metric([*p, cls.label], snap.classes[cls].queue_depth)
        yield from (inflight, depth)


class _SnapshotCollector(Collector):
    def __init__(self, snapshot: Callable[[], Snapshot], tenant: Callable[[str], str],
                 pools: Callable[[], Mapping[str, Snapshot]] | None = None) -> None:
        self._snapshot = snapshot
        self._tenant = tenant
        self._pools = pools  # set: every series per pool, with the `pool` label first

    def collect(self) -> Iterator[GaugeMetricFamily]:
        pl = ["pool"] if self._pools is not None else []
        snaps = ([((p,), s) for p, s in self._pools().items()] if self._pools is not None
                 else [((), self._snapshot())])
        inflight = GaugeMetricFamily("smg_scheduler_inflight", "Admitted requests in flight",
                                     labels=[*pl, "class"])
        depth = GaugeMetricFamily("smg_scheduler_queue_depth", "Requests queued",
                                  labels=[*pl, "class"])
        limit = GaugeMetricFamily("smg_scheduler_queue_size_limit", "Queue size limit",
                                  labels=[*pl, "class"])
        pressure = GaugeMetricFamily(
            "smg_scheduler_class_capacity_pressure",
            "0..1: queue fill or use beyond reservation, whichever is higher",
            labels=[*pl, "class"])
        reserved = GaugeMetricFamily("smg_sidecar_reserved_slots",
                                     "Slots reserved for the class at current capacity",
                                     labels=[*pl, "class"])
        tenant_depth = GaugeMetricFamily(
            "smg_sidecar_tenant_queue_depth",
            "Requests queued by class and tenant (tenant label capped; none queued: no series)",
            labels=[*pl, "class", "tenant"])
        util = GaugeMetricFamily("smg_scheduler_utilization", "Sum of in-flight / capacity",
                                 labels=pl)
        cap = GaugeMetricFamily("smg_sidecar_capacity", "Live capacity (slots)", labels=pl)
        for p, snap in snaps:
            self._add(p, snap, inflight, depth, limit, pressure, reserved, tenant_depth)
            util.add_metric(list(p), snap.inflight / snap.capacity if snap.capacity else 0.0)
            cap.add_metric(list(p), snap.capacity)
        yield from (inflight, depth, limit, pressure, reserved, util, cap, tenant_depth)

    def _add(self, p: tuple[str, ...], snap: Snapshot, inflight: GaugeMetricFamily,
             depth: GaugeMetricFamily, limit: GaugeMetricFamily, pressure: GaugeMetricFamily,
             reserved: GaugeMetricFamily, tenant_depth: GaugeMetricFamily) -> None:
        for cls in HIGH_TO_LOW:
            c = snap.classes[cls]
            by_label: dict[str, int] = {}
            for t, n in c.tenant_depths.items():
                label = self._tenant(t)
                by_label[label] = by_label.get(label, 0) + n
            for label, n in sorted(by_label.items()):
                tenant_depth.add_metric([*p, cls.label, label], n)
            inflight.add_metric([*p, cls.label], c.inflight)
            depth.add_metric([*p, cls.label], c.queue_depth)
            limit.add_metric([*p, cls.label], c.queue_limit)
            reserved.add_metric([*p, cls.label], c.reserved)
            pressure.add_metric([*p, cls.label], capacity_pressure(snap, cls))
