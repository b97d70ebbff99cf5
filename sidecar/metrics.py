"""Prometheus metrics, names and labels exactly as the contract lists them.

Metrics are fed by one route, the verbs below; nothing else touches a counter or
gauge. Two kinds of verb, each defined once:

* the **process's** (:class:`Recorder`, :class:`Metrics`): Checks, the access log,
  Envoy, configuration, the admin server;
* a **pool's** (:class:`PoolRecorder`, :class:`PoolMetrics`, one per pool from
  :meth:`Metrics.pool`): admission, capacity, the fleet ledger, edge shedding and
  shadow mode of that pool. A sidecar without named pools has one pool, ``default``,
  and its series are exactly the contract's. With named pools (``--worker-urls
  POOL=URL``) the series marked *(pool)* below carry a leading ``pool`` label, taken
  from the pool whose verb wrote them; the others are the process's sum.

The process's verbs:

==========================  =====================  ================================================
verb                        caller                 metrics
==========================  =====================  ================================================
``completion_unmatched``    pools (by id)          ``smg_sidecar_completion_unmatched_total``
``overloaded``              authz (Check)          ``smg_sidecar_overload_shed_total``
``unknown_pool``            authz (Check)          ``smg_sidecar_unknown_pool_total``
``tenant_rejected``         authz (Check)          ``smg_sidecar_tenant_rejected_total``
``adoption_refused``        completion (ALS)       ``smg_sidecar_adoption_refused_total``
``admin_dropped``           admin HTTP server      ``smg_sidecar_admin_connections_dropped_total``
``classified``              authz (Check)          ``smg_scheduler_clamp_total``,
                                                   ``smg_scheduler_unknown_priority_value_total``
``ext_proc_stream``         completion (ext_proc)  ``smg_sidecar_ext_proc_streams_total``
``started``                 app (build)            ``smg_sidecar_config_generation``,
                                                   ``smg_sidecar_config_info``
``config_reloaded``         app (config reload)    ``smg_sidecar_config_generation``,
                                                   ``smg_sidecar_config_info``,
                                                   ``smg_sidecar_config_reload_total{ok}``
``config_reload_failed``    app (config reload)    ``smg_sidecar_config_reload_total{error}``
``server_checked``          app (start-up)         ``smg_sidecar_coordination_server_check``
``library_checked``         app (library watch)    ``smg_sidecar_coordination_library_state``,
                                                   ``smg_sidecar_coordination_library_mismatch_total``
``envoy_feature``           envoy_features         ``smg_sidecar_envoy_feature``
``envoy_streams``           liveness (ALS)         ``smg_sidecar_envoy_access_log_streams``,
                                                   ``smg_sidecar_envoy_owners_alive``
``owner_lost``              liveness (timer)       ``smg_sidecar_envoy_owner_lost_total``,
                                                   ``smg_sidecar_envoy_owner_released_total``
``owner_blip``              liveness (admin)       ``smg_sidecar_envoy_owner_blips_total``
==========================  =====================  ================================================

A pool's verbs:

==========================  =================  ===================================================
verb                        caller             metrics
==========================  =================  ===================================================
``on_events``               the pool's         ``smg_scheduler_admit_total`` (pool),
                            admission          ``smg_scheduler_queue_wait_seconds`` (pool),
                            controller         ``smg_scheduler_starvation_promotion_total`` (pool),
                                               ``smg_scheduler_preemption_total`` (pool),
                                               ``smg_sidecar_released_total``,
                                               ``smg_sidecar_lease_expired_total``,
                                               ``smg_sidecar_adopted_total``,
                                               ``smg_sidecar_tenant_admitted_total``,
                                               ``smg_sidecar_wait_prediction_error_seconds`` (pool),
                                               ``smg_sidecar_wait_underpredicted_total`` (pool),
                                               ``smg_sidecar_over_target_total`` (pool)
``completed``               completion (ALS)   ``smg_sidecar_ttft_seconds`` (pool),
                                               ``smg_sidecar_engine_ttfb_seconds`` (pool)
``rate_limit``              the pool's         ``smg_http_rate_limit_total``
                            admission
                            controller
``preemption_undelivered``  ext_proc, fleet    ``smg_sidecar_preemption_delivery_failed_total``
``capacity_read``           pool (monitor)     ``smg_sidecar_capacity_source`` (pool),
                                               ``smg_sidecar_healthy_workers`` (pool),
                                               ``smg_sidecar_worker_capacity``,
                                               ``smg_sidecar_worker_probe_refused``,
                                               ``smg_sidecar_engine_excess`` (pool),
                                               ``smg_sidecar_kv_capacity_tokens`` (pool),
                                               ``smg_sidecar_kv_unreported_workers`` (pool)
``admission_started``       app (build)        ``smg_sidecar_admission_mode`` (pool),
                                               ``smg_sidecar_admission_fallback`` (pool),
                                               the snapshot gauges (below)
``preemption_suspended``    pool (monitor)     ``smg_sidecar_preemption_suspended`` (pool)
``adaptive_limit``          pool (tuning)      ``smg_sidecar_adaptive_limit`` (pool),
                                               ``smg_sidecar_adaptive_limit_changes_total`` (pool)
``fleet_seen``              fleet controller   ``smg_sidecar_fleet_inflight`` (pool),
                            (heartbeat)        ``smg_sidecar_live_replicas`` (pool)
``coordination_changed``    fleet controller   ``smg_sidecar_coordination_state`` (pool)
``coordination_fault``      fleet controller   ``smg_sidecar_coordination_faults_total`` (pool)
``fleet_collision``         app (fleet watch)  ``smg_sidecar_fleet_collision_total`` (pool)
``edge_shed``               edge (access log)  ``smg_scheduler_admit_total`` (pool),
                                               ``smg_sidecar_edge_shed_total`` (pool)
``edge_share``              edge (control)     ``smg_sidecar_edge_shed_share`` (pool)
``shadow_admit``            shadow (--shadow)  ``smg_sidecar_shadow_admit_total`` (pool)
``shadow_started``          app (build)        ``smg_sidecar_shadow_inflight`` (pool),
                                               ``smg_sidecar_shadow_queue_depth`` (pool)
``tokens_reserved``         pool (Check)       ``smg_sidecar_tokens_reserved`` (pool)
``tokens_settled``          pool (ALS, sweep)  ``smg_sidecar_tokens_settled`` (pool),
                                               ``smg_sidecar_token_estimate_ratio`` (pool)
``token_fallback``          pool (Check, ALS)  ``smg_sidecar_token_fallback_total`` (pool)
``token_budget_refused``    pool (Check)       ``smg_sidecar_token_budget_refused_total`` (pool)
``token_context_refused``   pool (Check)       ``smg_sidecar_token_context_refused_total`` (pool)
``kv_admission``            pool (build,       ``smg_sidecar_kv_admission`` (pool)
                            monitor, reload)
``kv_refused``              pool (Check)       ``smg_sidecar_kv_refused_total`` (pool)
``tokens_started``          pool (build)       ``smg_sidecar_token_budget_remaining`` (pool),
                                               ``smg_sidecar_token_budget_exhausted`` (pool)
==========================  =================  ===================================================

The snapshot gauges, registered by ``admission_started``, are computed when scraped
from each pool's snapshot, so they are never stale: ``smg_scheduler_inflight``,
``smg_scheduler_queue_depth``, ``smg_scheduler_queue_size_limit``,
``smg_scheduler_class_capacity_pressure``, ``smg_scheduler_utilization``,
``smg_sidecar_reserved_slots``, ``smg_sidecar_capacity``,
``smg_sidecar_tenant_queue_depth``, ``smg_sidecar_kv_tokens_held`` (all (pool)).

tests/test_metrics.py checks these tables against what each verb really changes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Protocol, TypeVar

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
from sidecar.scheduler import (
    Admitted,
    Event,
    Outcome,
    OverTarget,
    Preempted,
    Rejected,
    Released,
    ReleaseReason,
    Snapshot,
)
from sidecar.scheduler.interface import capacity_pressure
from sidecar.tokens import Remaining

# Only the contract's series: no *_created timestamp per counter child.
disable_created_metrics()  # type: ignore[no-untyped-call]

COORDINATION_STATES = ("ok", "degraded")
ADMISSION_MODES = ("scheduler", "legacy")
FALLBACK_MODES = ("legacy", "legacy_uncapped")
FALLBACK_REASONS = ("reservations_exceed_capacity",)
SERVER_CHECKS = ("eviction", "persistence")
SERVER_CHECK_RESULTS = ("ok", "risk", "unknown")
LIBRARY_STATES = ("ok", "missing", "mismatch", "unchecked")
CAPACITY_SOURCES = ("workers", "fallback", "override")
KV_ADMISSION_STATES = ("off", "gated", "ungated")

QUEUE_WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30,
                      60, 120, 300)
TOKEN_BUCKETS = (16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576)
# settled / estimated: 1 is a perfect estimate; above 1.1 the estimate was short, which is
# what lets a budget overshoot (docs/operations.md, PriorityGateTokenEstimateLow).
TOKEN_RATIO_BUCKETS = (0.1, 0.25, 0.5, 0.8, 0.9, 1.0, 1.1, 1.25, 2.0, 4.0, 10.0)



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
    """The process's verbs. :class:`Metrics` is the implementation; :class:`NullRecorder`
    records nothing (tests and benchmarks that drive one part alone)."""

    def completion_unmatched(self, reason: str) -> None:
        """A release for an unknown or already-released admission (``ReleaseResult``)."""

    def overloaded(self, cls: PriorityClass) -> None:
        """A Check shed before admission because too many Checks are open at once."""

    def unknown_pool(self, cls: PriorityClass) -> None:
        """A Check whose route names a pool this sidecar does not have (429)."""

    def tenant_rejected(self, cls: PriorityClass, tenant: str, outcome: str) -> None:
        """A Check refused (what the ``rejections`` log line counts), by class, tenant
        (label capped) and outcome: ``rejected_queue_full``, ``rejected_queue_timeout``,
        ``rate_limited``, ``client_cancelled`` or ``unknown_pool``."""

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

    def started(self, config_digest: str) -> None:
        """The sidecar is built: the start-up config is generation 1."""

    def config_reloaded(self, generation: int, digest: str) -> None:
        """A new config is in force."""

    def config_reload_failed(self) -> None:
        """A changed config file was refused; the old config stays."""

    def server_checked(self, check: str, result: str) -> None:
        """A coordination server setting was checked at start-up: ``check`` (eviction,
        persistence) is ``ok``, a ``risk`` or ``unknown`` (could not be read)."""

    def library_checked(self, state: str) -> None:
        """The server's ledger library was compared with this version's code."""

    def envoy_feature(self, feature: str, state: str) -> None:
        """What the sidecar inferred about an Envoy setting it relies on
        (``sidecar.envoy_features``): unknown, present or absent."""

    def envoy_streams(self, open_streams: int, alive_owners: int) -> None:
        """Access-log streams open now, and the Envoys (owners) they come from."""

    def owner_lost(self, released: int) -> None:
        """An Envoy's streams stayed closed past the grace: ``released`` admissions freed."""

    def owner_blip(self) -> None:
        """An Envoy's streams closed, but its admin says the same process runs."""


class PoolRecorder(Protocol):
    """One pool's verbs. :class:`PoolMetrics` is the implementation (from
    :meth:`Metrics.pool`); :class:`NullPoolRecorder` records nothing."""

    def on_events(self, events: Iterable[Event]) -> None:
        """The core's events: admit outcomes, queue waits, starvation, preemptions,
        releases (lease expiry included) and adoptions."""

    def completed(self, cls: PriorityClass, ttft: float | None,
                  engine_ttfb: float | None) -> None:
        """A request of ``cls`` ended; where Envoy measured them, its client's time to first
        byte and its engine's."""

    def rate_limit(self, allowed: bool) -> None:
        """One request-rate check before admission."""

    def preemption_undelivered(self) -> None:
        """A preemption whose 503 could not be written to Envoy."""

    def capacity_read(self, reading: CapacityReading) -> None:
        """A changed capacity reading: where capacity comes from, workers counted
        healthy, and what each healthy worker counts for."""

    def admission_started(self, *, legacy: bool, snapshot: Callable[[], Snapshot],
                          fallback: tuple[str, str] | None = None) -> None:
        """The pool's admission is built: its mode and the scrape-time gauges over
        ``snapshot``. ``fallback`` (mode, reason): the scheduler was enabled, yet legacy
        admission serves."""

    def preemption_suspended(self, suspended: bool) -> None:
        """No class preempts (a counted worker's engine cannot cancel), or they may again."""

    def adaptive_limit(self, limit: int, reason: str, changed: bool) -> None:
        """--adaptive-capacity: the pool's limit after a tuning step, and why it moved."""

    def fleet_seen(self, inflight: Mapping[PriorityClass, int], live_replicas: int) -> None:
        """A heartbeat's answer: fleet-wide in-flight counts and live replicas."""

    def coordination_changed(self, state: str) -> None:
        """The fleet controller's state is now ``ok`` or ``degraded``."""

    def coordination_fault(self, kind: str) -> None:
        """The ledger lost writes (``server_changed``, ``stale_copy``, ``admissions_lost``),
        repaired a key from its records (``counters_lost``, ``owners_lost``), this process
        took over its predecessor's admissions (``taken_over``), or an id it
        runs had ended in the ledger (``ended_but_running_readded`` / ``_stopped``)."""

    def fleet_collision(self, kind: str) -> None:
        """A second class config (``config``) or capacity source (``capacity_source``)
        appeared among the live replicas of this fleet id."""

    def edge_shed(self, cls: PriorityClass, n: int) -> None:
        """Envoy answered ``n`` requests of ``cls`` with the queue-full 429 itself (edge
        shedding): counted as the contract counts them, and as edge sheds."""

    def edge_share(self, cls: PriorityClass, share: float) -> None:
        """The share of ``cls``'s requests Envoy is told to answer itself."""

    def shadow_admit(self, cls: PriorityClass, outcome: Outcome) -> None:
        """--shadow: a decision enforcement would have made (nothing was refused)."""

    def shadow_started(self, snapshot: Callable[[], Snapshot]) -> None:
        """--shadow: scrape-time gauges of the would-be in-flight and queued requests."""

    def tokens_reserved(self, cls: PriorityClass, tokens: int) -> None:
        """An admitted request's token estimate, reserved against its tenant's budgets."""

    def tokens_settled(self, cls: PriorityClass, tokens: int, estimate: int | None) -> None:
        """A request's tokens as settled (its usage, or a fallback), and the estimate it
        was reserved at (None: not an estimate to judge, e.g. charged as estimated)."""

    def token_fallback(self, reason: str) -> None:
        """An estimate or settlement input that could not be used (sidecar.tokens
        FALLBACKS): what was used instead is documented per reason."""

    def token_budget_refused(self, cls: PriorityClass, window: str, enforced: bool) -> None:
        """A request over its tenant's budget in ``window``: refused, or only counted
        (``budget_mode: shadow``, ``--shadow``)."""

    def token_context_refused(self, cls: PriorityClass, enforced: bool) -> None:
        """A request whose input fits no worker slot's context (``refuse_past_context``):
        refused, or only counted (``--shadow``)."""

    def kv_admission(self, state: str) -> None:
        """Admission by KV capacity (``tokens.admit_by_kv``) is ``off``, ``gated`` by the
        workers' KV capacity, or on but ``ungated`` (nothing to gate against)."""

    def kv_refused(self, cls: PriorityClass, enforced: bool) -> None:
        """A request whose estimate alone exceeds the pool's whole KV capacity: refused,
        or only counted (``--shadow``)."""

    def tokens_started(self, remaining: Callable[[], Iterable[Remaining]]) -> None:
        """Token budgets are on: scrape-time gauges over the pool's budget windows."""


class NullRecorder:
    """Records nothing (the process's verbs)."""

    def completion_unmatched(self, reason: str) -> None:
        pass

    def overloaded(self, cls: PriorityClass) -> None:
        pass

    def unknown_pool(self, cls: PriorityClass) -> None:
        pass

    def tenant_rejected(self, cls: PriorityClass, tenant: str, outcome: str) -> None:
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

    def started(self, config_digest: str) -> None:
        pass

    def config_reloaded(self, generation: int, digest: str) -> None:
        pass

    def config_reload_failed(self) -> None:
        pass

    def server_checked(self, check: str, result: str) -> None:
        pass

    def library_checked(self, state: str) -> None:
        pass

    def envoy_feature(self, feature: str, state: str) -> None:
        pass

    def envoy_streams(self, open_streams: int, alive_owners: int) -> None:
        pass

    def owner_lost(self, released: int) -> None:
        pass

    def owner_blip(self) -> None:
        pass


class NullPoolRecorder:
    """Records nothing (a pool's verbs)."""

    def on_events(self, events: Iterable[Event]) -> None:
        pass

    def completed(self, cls: PriorityClass, ttft: float | None,
                  engine_ttfb: float | None) -> None:
        pass

    def rate_limit(self, allowed: bool) -> None:
        pass

    def preemption_undelivered(self) -> None:
        pass

    def capacity_read(self, reading: CapacityReading) -> None:
        pass

    def admission_started(self, *, legacy: bool, snapshot: Callable[[], Snapshot],
                          fallback: tuple[str, str] | None = None) -> None:
        pass

    def preemption_suspended(self, suspended: bool) -> None:
        pass

    def adaptive_limit(self, limit: int, reason: str, changed: bool) -> None:
        pass

    def fleet_seen(self, inflight: Mapping[PriorityClass, int], live_replicas: int) -> None:
        pass

    def coordination_changed(self, state: str) -> None:
        pass

    def coordination_fault(self, kind: str) -> None:
        pass

    def fleet_collision(self, kind: str) -> None:
        pass

    def edge_shed(self, cls: PriorityClass, n: int) -> None:
        pass

    def edge_share(self, cls: PriorityClass, share: float) -> None:
        pass

    def shadow_admit(self, cls: PriorityClass, outcome: Outcome) -> None:
        pass

    def shadow_started(self, snapshot: Callable[[], Snapshot]) -> None:
        pass

    def tokens_reserved(self, cls: PriorityClass, tokens: int) -> None:
        pass

    def tokens_settled(self, cls: PriorityClass, tokens: int, estimate: int | None) -> None:
        pass

    def token_fallback(self, reason: str) -> None:
        pass

    def token_budget_refused(self, cls: PriorityClass, window: str, enforced: bool) -> None:
        pass

    def token_context_refused(self, cls: PriorityClass, enforced: bool) -> None:
        pass

    def kv_admission(self, state: str) -> None:
        pass

    def kv_refused(self, cls: PriorityClass, enforced: bool) -> None:
        pass

    def tokens_started(self, remaining: Callable[[], Iterable[Remaining]]) -> None:
        pass


_M = TypeVar("_M", Counter, Gauge, Histogram)


def _child(metric: _M, *values: str) -> _M:
    """The series of ``metric`` for ``values``: the metric itself when it has no labels."""
    return metric.labels(*values) if values else metric


class Metrics:
    """All metrics of one sidecar, on its own registry, fed only through the verbs (the
    Prometheus objects are private). ``pools``: the sidecar has named pools, so the
    series marked (pool) carry a leading ``pool`` label (module docstring)."""

    def __init__(self, *, tenant_top_n: int, registry: CollectorRegistry | None = None,
                 pools: bool = False) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.tenant = TenantLabels(tenant_top_n)
        self.tenant_top_n = tenant_top_n
        self.named_pools = pools
        self._pools: dict[str, PoolMetrics] = {}
        pl = ["pool"] if pools else []  # the label of a pool's series
        # ------------------------------------------------------------ a pool's series
        self.admit = Counter("smg_scheduler_admit", "Admission decisions by class and outcome",
                             [*pl, "class", "outcome"], registry=r)
        self.queue_wait = Histogram("smg_scheduler_queue_wait_seconds",
                                    "Time admitted requests waited in their class queue",
                                    [*pl, "class"], buckets=QUEUE_WAIT_BUCKETS, registry=r)
        self.preemption = Counter("smg_scheduler_preemption", "Preemptions",
                                  [*pl, "victim_class", "by_class"], registry=r)
        self.starvation = Counter("smg_scheduler_starvation_promotion",
                                  "Queue heads admitted by the starvation rule",
                                  [*pl, "class"], registry=r)
        self.capacity_source = Gauge("smg_sidecar_capacity_source",
                                     "Where capacity comes from (1 = in force)",
                                     [*pl, "source"], registry=r)
        self.healthy_workers = Gauge("smg_sidecar_healthy_workers",
                                     "Workers counted healthy", pl, registry=r)
        self.engine_excess = Gauge("smg_sidecar_engine_excess",
                                   "Requests the engines run or queue beyond what the "
                                   "sidecar holds (--saturation-guard)", pl, registry=r)
        self.mode = Gauge("smg_sidecar_admission_mode",
                          "Admission path in force (1 = active)", [*pl, "mode"], registry=r)
        self.fallback = Gauge("smg_sidecar_admission_fallback",
                              "1 while the scheduler is enabled but legacy admission serves, "
                              "by mode (legacy_uncapped: no concurrency cap) and reason",
                              [*pl, "mode", "reason"], registry=r)
        self.preemption_suspended = Gauge(
            "smg_sidecar_preemption_suspended",
            "1 while no class preempts because a counted worker's engine cannot cancel a "
            "running request (llama.cpp)", pl, registry=r)
        self.adaptive_limit = Gauge(
            "smg_sidecar_adaptive_limit",
            "--adaptive-capacity: the concurrency limit the pool tuned itself to", pl,
            registry=r)
        self.adaptive_changes = Counter(
            "smg_sidecar_adaptive_limit_changes",
            "--adaptive-capacity: moves of the limit, by reason (engine_queueing: the "
            "engines' time to first byte jumped; probe: used and kept up; ceiling: the "
            "workers' capacity changed)", [*pl, "reason"], registry=r)
        self.fleet_inflight = Gauge("smg_sidecar_fleet_inflight",
                                    "Fleet-wide admissions in flight, as the ledger saw them "
                                    "at the last heartbeat", [*pl, "class"], registry=r)
        self.live_replicas = Gauge("smg_sidecar_live_replicas",
                                   "Live replicas of the fleet, this one included (0 without "
                                   "coordination)", pl, registry=r)
        self.coordination = Gauge("smg_sidecar_coordination_state",
                                  "Fleet coordination state (1 = current)", [*pl, "state"],
                                  registry=r)
        self.coordination_faults = Counter(
            "smg_sidecar_coordination_faults",
            "Ledger faults this replica found or repaired, by kind", [*pl, "kind"],
            registry=r)
        self.fleet_collision = Counter(
            "smg_sidecar_fleet_collision",
            "A second class config or capacity source seen among the live replicas of this "
            "fleet id (another deployment with the same --fleet-id?)", [*pl, "kind"],
            registry=r)
        self.edge_shed = Counter(
            "smg_sidecar_edge_shed",
            "Requests Envoy answered with the queue-full 429 itself (edge shedding), by class "
            "(also in smg_scheduler_admit_total{outcome=\"rejected_queue_full\"})",
            [*pl, "class"], registry=r)
        self.edge_share = Gauge(
            "smg_sidecar_edge_shed_share",
            "Share of the class's requests Envoy is told to answer itself (0 = off)",
            [*pl, "class"], registry=r)
        self.ttft = Histogram("smg_sidecar_ttft_seconds",
                              "Time to first byte as the client saw it, from Envoy receiving "
                              "the request (queue wait included), by class",
                              [*pl, "class"], buckets=QUEUE_WAIT_BUCKETS, registry=r)
        self.engine_ttfb = Histogram("smg_sidecar_engine_ttfb_seconds",
                                     "The engine's time to first byte, from the request "
                                     "reaching the worker, by class",
                                     [*pl, "class"], buckets=QUEUE_WAIT_BUCKETS, registry=r)
        self.prediction_error = Histogram(
            "smg_sidecar_wait_prediction_error_seconds",
            "How far queued requests' actual wait was from the wait predicted when they "
            "queued (admitted or timed out), by class", [*pl, "class"],
            buckets=QUEUE_WAIT_BUCKETS, registry=r)
        self.underpredicted = Counter(
            "smg_sidecar_wait_underpredicted",
            "Queued requests that waited longer than predicted, by class", [*pl, "class"],
            registry=r)
        self.over_target = Counter(
            "smg_sidecar_over_target",
            "Arrivals predicted to wait past their class's time-to-first-token target: "
            "refused (deadline_mode: enforce) or counted only (shadow)",
            [*pl, "class", "action"], registry=r)
        # Not smg_scheduler_admit_total: that one counts what really happened (all admitted).
        self.shadow_admit = Counter(
            "smg_sidecar_shadow_admit",
            "--shadow: decisions enforcement would have made, by class and outcome (the "
            "requests were all admitted; smg_scheduler_admit_total counts that)",
            [*pl, "class", "outcome"], registry=r)
        self.tokens_reserved = Histogram(
            "smg_sidecar_tokens_reserved",
            "Token estimate of each admitted request, reserved against its tenant's "
            "budgets at the Check, by class", [*pl, "class"], buckets=TOKEN_BUCKETS,
            registry=r)
        self.tokens_settled = Histogram(
            "smg_sidecar_tokens_settled",
            "Tokens each request was charged when it ended (its usage, or a fallback), "
            "by class", [*pl, "class"], buckets=TOKEN_BUCKETS, registry=r)
        self.token_ratio = Histogram(
            "smg_sidecar_token_estimate_ratio",
            "Settled / estimated tokens per request (1 = exact; above 1 the estimate was "
            "short), by class", [*pl, "class"], buckets=TOKEN_RATIO_BUCKETS, registry=r)
        self.token_fallback = Counter(
            "smg_sidecar_token_fallback",
            "Token estimates and settlements that fell back, by reason (docs/reference.md)",
            [*pl, "reason"], registry=r)
        self.token_refused = Counter(
            "smg_sidecar_token_budget_refused",
            "Requests over their tenant's token budget, by class, window and action "
            "(refused, or counted: budget_mode shadow, --shadow)",
            [*pl, "class", "window", "action"], registry=r)
        self.token_context = Counter(
            "smg_sidecar_token_context_refused",
            "Requests whose input estimate fits no worker slot's context, by class and "
            "action (refused: 413, or counted: --shadow)", [*pl, "class", "action"],
            registry=r)
        self.kv_capacity = Gauge(
            "smg_sidecar_kv_capacity_tokens",
            "KV capacity in tokens of the counted workers that report one, summed (0: none "
            "does)", pl, registry=r)
        self.kv_unreported = Gauge(
            "smg_sidecar_kv_unreported_workers",
            "Counted workers that report no usable KV capacity in tokens", pl, registry=r)
        self.kv_admission = Gauge(
            "smg_sidecar_kv_admission",
            "Admission by KV capacity (tokens.admit_by_kv), 1 = current state: off, gated, "
            "or ungated (on, but no counted worker reports a KV capacity)", [*pl, "state"],
            registry=r)
        self.kv_refused = Counter(
            "smg_sidecar_kv_refused",
            "Requests whose token estimate alone exceeds the pool's whole KV capacity, by "
            "class and action (refused: 413, or counted: --shadow)", [*pl, "class", "action"],
            registry=r)
        # ------------------------------------ fed by a pool's verbs, summed over pools
        self.released = Counter("smg_sidecar_released", "Admissions ended, by reason",
                                ["class", "reason"], registry=r)
        self.lease_expired = Counter("smg_sidecar_lease_expired",
                                     "Admissions reclaimed because their lease expired",
                                     ["class"], registry=r)
        self.adopted = Counter("smg_sidecar_adopted",
                               "Streams admitted by an earlier sidecar process, found "
                               "still running via periodic access-log entries",
                               ["class"], registry=r)
        self.tenant_admitted = Counter("smg_sidecar_tenant_admitted",
                                       "Admissions by class and tenant (tenant label capped)",
                                       ["class", "tenant"], registry=r)
        rate_limit = Counter("smg_http_rate_limit", "Request-rate check results",
                             ["result"], registry=r)
        self.rate_child = {allowed: rate_limit.labels("allowed" if allowed else "rejected")
                           for allowed in (True, False)}
        self.preemption_undelivered = Counter(
            "smg_sidecar_preemption_delivery_failed",
            "Preemptions whose 503 could not be written to Envoy (the victim may run on)",
            registry=r)
        # Keyed by the capped label, so they stay as small as the label sets.
        self.released_child: dict[tuple[PriorityClass, str], Counter] = {}
        self.tenant_child: dict[tuple[PriorityClass, str], Counter] = {}
        # ------------------------------------------------------------ the process's
        self._clamp = Counter("smg_scheduler_clamp", "Requests clamped to their tenant ceiling",
                              ["tenant", "requested_class", "effective_class"], registry=r)
        self._unknown_priority = Counter("smg_scheduler_unknown_priority_value",
                                         "Unrecognised x-smg-priority values", ["tenant"],
                                         registry=r)
        self._overload = Counter("smg_sidecar_overload_shed",
                                 "Checks shed because too many were open at once "
                                 "(429 scheduler_queue_full)", ["class"], registry=r)
        # Labelled, so that without pools no series exists (nothing can count then).
        self._unknown_pool = Counter(
            "smg_sidecar_unknown_pool",
            "Checks whose route names a pool the sidecar does not have "
            "(429 scheduler_queue_full)", ["class"], registry=r)
        # Which tenant is refused: capped like every tenant label (first come keeps it).
        self._tenant_rejected = Counter(
            "smg_sidecar_tenant_rejected",
            "Checks refused by class, tenant (label capped) and outcome",
            ["class", "tenant", "outcome"], registry=r)
        self._tenant_rejected_child: dict[tuple[PriorityClass, str, str], Counter] = {}
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
        self._unmatched = Counter("smg_sidecar_completion_unmatched",
                                  "Completions for unknown or already-released admissions",
                                  ["reason"], registry=r)
        self._reload = Counter("smg_sidecar_config_reload", "Config reloads", ["result"],
                               registry=r)
        self._config_generation = Gauge("smg_sidecar_config_generation",
                                        "Generation of the config in force (1 = startup)",
                                        registry=r)
        self._config_info = Gauge("smg_sidecar_config_info", "Config in force (hash label)",
                                  ["sha256"], registry=r)
        self._envoy_feature = Gauge(
            "smg_sidecar_envoy_feature",
            "Envoy settings the sidecar relies on, as inferred from traffic (1 = current state)",
            ["feature", "state"], registry=r)
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
        # Scrape-time collectors over every pool.
        pools_now = self._pools.values
        r.register(_WorkerCapacityCollector(pools_now))
        r.register(_WorkerProblemCollector(pools_now))
        r.register(_SnapshotCollector(pools_now, self.tenant, pl))
        r.register(_ShadowCollector(pools_now, pl))
        r.register(_BudgetCollector(pools_now, pl, tenant_top_n))
        # Label children resolved once: labels() costs a lock and a tuple per call.
        self._clamp_child: dict[tuple[str, PriorityClass, PriorityClass], Counter] = {}
        self._unknown_child: dict[str, Counter] = {}
        self._overload_child = {cls: self._overload.labels(cls.label) for cls in HIGH_TO_LOW}
        for cls in HIGH_TO_LOW:
            self._adoption_refused.labels(cls.label)
            if pools:  # at 0 from the start where pools exist (nothing counts without)
                self._unknown_pool.labels(cls.label)
        for admitted in ("true", "false"):
            self._ext_proc_streams.labels(admitted)
        for reason in ("over_cap", "deadline", "exhausted"):
            self._admin_dropped.labels(reason)
        for result in ("ok", "error"):
            self._reload.labels(result)

    def pool(self, name: str) -> PoolMetrics:
        """The verbs of pool ``name`` (one object per pool, made on first use)."""
        p = self._pools.get(name)
        if p is None:
            if self._pools and not self.named_pools:
                # Unlabelled, a second pool's series would be the first one's.
                raise ValueError(f"pool {name!r}: a second pool needs Metrics(pools=True)")
            p = self._pools[name] = PoolMetrics(self, name)
        return p

    # ------------------------------------------------------------------ the process's

    def completion_unmatched(self, reason: str) -> None:
        self._unmatched.labels(reason).inc()

    def overloaded(self, cls: PriorityClass) -> None:
        self._overload_child[cls].inc()

    def unknown_pool(self, cls: PriorityClass) -> None:
        self._unknown_pool.labels(cls.label).inc()

    def tenant_rejected(self, cls: PriorityClass, tenant: str, outcome: str) -> None:
        key = (cls, self.tenant(tenant), outcome)
        child = self._tenant_rejected_child.get(key)
        if child is None:
            child = self._tenant_rejected_child[key] = self._tenant_rejected.labels(
                cls.label, key[1], outcome)
        child.inc()

    def adoption_refused(self, cls: PriorityClass) -> None:
        self._adoption_refused.labels(cls.label).inc()

    def admin_dropped(self, reason: str) -> None:
        self._admin_dropped.labels(reason).inc()

    def classified(self, tenant: str, requested: PriorityClass, effective: PriorityClass,
                   unknown: bool) -> None:
        label = self.tenant(tenant)
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

    def started(self, config_digest: str) -> None:
        self._config_generation.set(1)
        self._config_info.labels(config_digest).set(1)

    def config_reloaded(self, generation: int, digest: str) -> None:
        self._config_generation.set(generation)
        self._config_info.clear()
        self._config_info.labels(digest).set(1)
        self._reload.labels("ok").inc()

    def config_reload_failed(self) -> None:
        self._reload.labels("error").inc()

    def server_checked(self, check: str, result: str) -> None:
        for r in SERVER_CHECK_RESULTS:
            self._server_check.labels(check, r).set(1 if r == result else 0)

    def library_checked(self, state: str) -> None:
        for st in LIBRARY_STATES:
            self._library_state.labels(st).set(1 if st == state else 0)
        if state == "mismatch":
            self._library_mismatch.inc()

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


class PoolMetrics:
    """One pool's verbs over the process's :class:`Metrics` (made by
    :meth:`Metrics.pool`): its series carry ``label`` (the pool's name where the sidecar
    has named pools, else nothing)."""

    def __init__(self, metrics: Metrics, name: str) -> None:
        m = self._m = metrics
        self.name = name
        pl = self.label = (name,) if metrics.named_pools else ()
        self.snapshot: Callable[[], Snapshot] | None = None  # admission_started
        self.shadow_snapshot: Callable[[], Snapshot] | None = None  # shadow_started
        self.budgets: Callable[[], Iterable[Remaining]] | None = None  # tokens_started
        self.worker_capacity: Mapping[tuple[str, str], int] = {}
        self.worker_problems: Mapping[tuple[str, str, str], int] = {}
        # Label children resolved once: these run on every admission.
        # (rejected_over_target: only where a target refuses, so made on first use.)
        self._admit_child: dict[tuple[PriorityClass, Outcome], Counter] = {
            (cls, o): m.admit.labels(*pl, cls.label, o.value)
            for cls in HIGH_TO_LOW for o in Outcome if o is not Outcome.REJECTED_OVER_TARGET}
        self._wait_child = {cls: m.queue_wait.labels(*pl, cls.label) for cls in HIGH_TO_LOW}
        # A pool's coordination series read 0 without a fleet, as without pools.
        _child(m.live_replicas, *pl)

    def on_events(self, events: Iterable[Event]) -> None:
        m = self._m
        for e in events:
            if isinstance(e, Released):
                cls = e.admission.cls
                key = (cls, e.reason)
                child = m.released_child.get(key)
                if child is None:
                    child = m.released_child[key] = m.released.labels(cls.label, e.reason)
                child.inc()
                if e.reason is ReleaseReason.LEASE_EXPIRED:
                    m.lease_expired.labels(cls.label).inc()
            elif isinstance(e, Admitted):
                cls = e.admission.cls
                if e.adopted:
                    # Admitted by an earlier process: not a decision of this one.
                    m.adopted.labels(cls.label).inc()
                    continue
                self._admit_child[(cls, Outcome.ADMITTED)].inc()
                self._wait_child[cls].observe(e.waited)
                if e.predicted is not None:
                    self._prediction_met(cls, e.waited, e.predicted)
                tkey = (cls, m.tenant(e.admission.tenant))
                tchild = m.tenant_child.get(tkey)
                if tchild is None:
                    tchild = m.tenant_child[tkey] = m.tenant_admitted.labels(cls.label, tkey[1])
                tchild.inc()
                if e.starvation:
                    m.starvation.labels(*self.label, cls.label).inc()
            elif isinstance(e, Rejected):
                self._admit(e.cls, e.outcome).inc()
                if e.outcome is Outcome.REJECTED_QUEUE_TIMEOUT and e.predicted is not None:
                    self._prediction_met(e.cls, e.waited, e.predicted)
            elif isinstance(e, Preempted):
                self._admit_child[(e.victim.cls, Outcome.PREEMPTED)].inc()
                m.preemption.labels(*self.label, e.victim.cls.label, e.by_class.label).inc()
            elif isinstance(e, OverTarget):
                m.over_target.labels(*self.label, e.cls.label,
                                     "refused" if e.enforced else "counted").inc()

    def _prediction_met(self, cls: PriorityClass, waited: float, predicted: float) -> None:
        m = self._m
        m.prediction_error.labels(*self.label, cls.label).observe(abs(waited - predicted))
        if waited > predicted:
            m.underpredicted.labels(*self.label, cls.label).inc()

    def _admit(self, cls: PriorityClass, outcome: Outcome) -> Counter:
        child = self._admit_child.get((cls, outcome))
        if child is None:
            child = self._admit_child[(cls, outcome)] = self._m.admit.labels(
                *self.label, cls.label, outcome.value)
        return child

    def completed(self, cls: PriorityClass, ttft: float | None,
                  engine_ttfb: float | None) -> None:
        if ttft is not None:
            self._m.ttft.labels(*self.label, cls.label).observe(ttft)
        if engine_ttfb is not None:
            self._m.engine_ttfb.labels(*self.label, cls.label).observe(engine_ttfb)

    def rate_limit(self, allowed: bool) -> None:
        self._m.rate_child[allowed].inc()

    def preemption_undelivered(self) -> None:
        self._m.preemption_undelivered.inc()

    def capacity_read(self, reading: CapacityReading) -> None:
        m, pl = self._m, self.label
        for s in CAPACITY_SOURCES:
            m.capacity_source.labels(*pl, s).set(1 if s == reading.source else 0)
        _child(m.healthy_workers, *pl).set(reading.healthy)
        _child(m.engine_excess, *pl).set(reading.excess)
        _child(m.kv_capacity, *pl).set(reading.kv_tokens or 0)
        _child(m.kv_unreported, *pl).set(reading.kv_unreported)
        # Replaced as a whole: a worker gone or unhealthy loses its series.
        self.worker_capacity = dict(per_worker(reading))
        self.worker_problems = dict(worker_problems(reading))

    def admission_started(self, *, legacy: bool, snapshot: Callable[[], Snapshot],
                          fallback: tuple[str, str] | None = None) -> None:
        m, pl = self._m, self.label
        in_force = "legacy" if legacy else "scheduler"
        for mode in ADMISSION_MODES:
            m.mode.labels(*pl, mode).set(1 if mode == in_force else 0)
        for mode in FALLBACK_MODES:  # every series present: 0 is "no fallback"
            for reason in FALLBACK_REASONS:
                m.fallback.labels(*pl, mode, reason).set(1 if fallback == (mode, reason) else 0)
        self.snapshot = snapshot

    def preemption_suspended(self, suspended: bool) -> None:
        _child(self._m.preemption_suspended, *self.label).set(1 if suspended else 0)

    def adaptive_limit(self, limit: int, reason: str, changed: bool) -> None:
        _child(self._m.adaptive_limit, *self.label).set(limit)
        if changed:
            self._m.adaptive_changes.labels(*self.label, reason).inc()

    def fleet_seen(self, inflight: Mapping[PriorityClass, int], live_replicas: int) -> None:
        m, pl = self._m, self.label
        for cls in HIGH_TO_LOW:
            m.fleet_inflight.labels(*pl, cls.label).set(inflight.get(cls, 0))
        _child(m.live_replicas, *pl).set(live_replicas)

    def coordination_changed(self, state: str) -> None:
        for s in COORDINATION_STATES:
            self._m.coordination.labels(*self.label, s).set(1 if s == state else 0)

    def coordination_fault(self, kind: str) -> None:
        self._m.coordination_faults.labels(*self.label, kind).inc()

    def fleet_collision(self, kind: str) -> None:
        self._m.fleet_collision.labels(*self.label, kind).inc()

    def edge_shed(self, cls: PriorityClass, n: int) -> None:
        self._admit_child[(cls, Outcome.REJECTED_QUEUE_FULL)].inc(n)
        self._m.edge_shed.labels(*self.label, cls.label).inc(n)

    def edge_share(self, cls: PriorityClass, share: float) -> None:
        self._m.edge_share.labels(*self.label, cls.label).set(share)

    def shadow_admit(self, cls: PriorityClass, outcome: Outcome) -> None:
        self._m.shadow_admit.labels(*self.label, cls.label, outcome.value).inc()

    def shadow_started(self, snapshot: Callable[[], Snapshot]) -> None:
        self.shadow_snapshot = snapshot

    def tokens_reserved(self, cls: PriorityClass, tokens: int) -> None:
        self._m.tokens_reserved.labels(*self.label, cls.label).observe(tokens)

    def tokens_settled(self, cls: PriorityClass, tokens: int, estimate: int | None) -> None:
        self._m.tokens_settled.labels(*self.label, cls.label).observe(tokens)
        if estimate is not None:
            self._m.token_ratio.labels(*self.label, cls.label).observe(
                tokens / max(1, estimate))

    def token_fallback(self, reason: str) -> None:
        self._m.token_fallback.labels(*self.label, reason).inc()

    def token_budget_refused(self, cls: PriorityClass, window: str, enforced: bool) -> None:
        self._m.token_refused.labels(*self.label, cls.label, window,
                                     "refused" if enforced else "counted").inc()

    def token_context_refused(self, cls: PriorityClass, enforced: bool) -> None:
        self._m.token_context.labels(*self.label, cls.label,
                                     "refused" if enforced else "counted").inc()

    def kv_admission(self, state: str) -> None:
        for s in KV_ADMISSION_STATES:
            self._m.kv_admission.labels(*self.label, s).set(1 if s == state else 0)

    def kv_refused(self, cls: PriorityClass, enforced: bool) -> None:
        self._m.kv_refused.labels(*self.label, cls.label,
                                  "refused" if enforced else "counted").inc()

    def tokens_started(self, remaining: Callable[[], Iterable[Remaining]]) -> None:
        self.budgets = remaining


_Pools = Callable[[], Iterable[PoolMetrics]]


class _WorkerCapacityCollector(Collector):
    """Read at scrape time, so a scrape never sees a half-replaced worker set."""

    def __init__(self, pools: _Pools) -> None:
        self._pools = pools

    def collect(self) -> Iterator[GaugeMetricFamily]:
        fam = GaugeMetricFamily("smg_sidecar_worker_capacity",
                                "Capacity each healthy worker counts for (after the "
                                "saturation guard)", labels=["worker", "engine"])
        current = {k: v for p in self._pools() for k, v in p.worker_capacity.items()}
        for (worker, engine), cap in sorted(current.items()):
            fam.add_metric([worker, engine], cap)
        yield fam


class _WorkerProblemCollector(Collector):
    """Healthy workers whose probes are refused now (401/403/501, a router without a
    loaded model): a worker fixed or gone loses its series."""

    def __init__(self, pools: _Pools) -> None:
        self._pools = pools

    def collect(self) -> Iterator[GaugeMetricFamily]:
        fam = GaugeMetricFamily("smg_sidecar_worker_probe_refused",
                                "1 per healthy worker and endpoint whose probe was refused "
                                "in the last reading", labels=["worker", "endpoint", "reason"])
        current = {k: v for p in self._pools() for k, v in p.worker_problems.items()}
        for labels, value in sorted(current.items()):
            fam.add_metric(list(labels), value)
        yield fam


class _ShadowCollector(Collector):
    """--shadow: each pool's shadow core at scrape time (the contract's gauges show the
    real traffic, where nothing queues)."""

    def __init__(self, pools: _Pools, pl: list[str]) -> None:
        self._pools = pools
        self._pl = pl

    def collect(self) -> Iterator[GaugeMetricFamily]:
        snaps = [(p.label, p.shadow_snapshot()) for p in self._pools()
                 if p.shadow_snapshot is not None]
        if not snaps:
            return
        inflight = GaugeMetricFamily("smg_sidecar_shadow_inflight",
                                     "--shadow: requests that would hold a slot now",
                                     labels=[*self._pl, "class"])
        depth = GaugeMetricFamily("smg_sidecar_shadow_queue_depth",
                                  "--shadow: requests that would be queued now",
                                  labels=[*self._pl, "class"])
        for pl, snap in snaps:
            for cls in HIGH_TO_LOW:
                inflight.add_metric([*pl, cls.label], snap.classes[cls].inflight)
                depth.add_metric([*pl, cls.label], snap.classes[cls].queue_depth)
        yield from (inflight, depth)


class _BudgetCollector(Collector):
    """Token budgets at scrape time: what is left in each tenant's windows (the ``top_n``
    tenants with the least left, by share of their amount, so the series stay bounded
    whatever the number of budgeted tenants), and how many tenants have nothing left."""

    def __init__(self, pools: _Pools, pl: list[str], top_n: int) -> None:
        self._pools = pools
        self._pl = pl
        self._top_n = top_n

    def collect(self) -> Iterator[GaugeMetricFamily]:
        views = [(p.label, list(p.budgets())) for p in self._pools() if p.budgets is not None]
        if not views:
            return
        left = GaugeMetricFamily(
            "smg_sidecar_token_budget_remaining",
            "Tokens left in a tenant's budget window (amount - settled - reserved by running "
            "requests); only the tenants with the least left, by share "
            "(--priority-scheduler-tenant-metric-top-n)", labels=[*self._pl, "tenant", "window"])
        spent = GaugeMetricFamily(
            "smg_sidecar_token_budget_exhausted",
            "Tenants with no tokens left in the window (every budgeted tenant counted)",
            labels=[*self._pl, "window"])
        for pl, rows in views:
            rows.sort(key=lambda w: (w.remaining / w.limit if w.limit else -1.0, w.tenant))
            shown: set[str] = set()
            for w in rows:
                if w.tenant in shown or len(shown) < self._top_n:
                    shown.add(w.tenant)
                    left.add_metric([*pl, w.tenant, w.window], w.remaining)
            counts: dict[str, int] = {}
            for w in rows:
                counts[w.window] = counts.get(w.window, 0) + (1 if w.remaining <= 0 else 0)
            for window, n in sorted(counts.items()):
                spent.add_metric([*pl, window], n)
        yield from (left, spent)


class _SnapshotCollector(Collector):
    """The contract's gauges, from each pool's snapshot at scrape time."""

    def __init__(self, pools: _Pools, tenant: Callable[[str], str], pl: list[str]) -> None:
        self._pools = pools
        self._tenant = tenant
        self._pl = pl

    def collect(self) -> Iterator[GaugeMetricFamily]:
        snaps = [(p.label, p.snapshot()) for p in self._pools() if p.snapshot is not None]
        if not snaps:
            return
        pl = self._pl
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
        kv_held = GaugeMetricFamily(
            "smg_sidecar_kv_tokens_held",
            "Token estimates of the requests in flight, held against the KV capacity "
            "(tokens.admit_by_kv; 0 while not gated)", labels=pl)
        for p, snap in snaps:
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
            util.add_metric(list(p), snap.inflight / snap.capacity if snap.capacity else 0.0)
            cap.add_metric(list(p), snap.capacity)
            kv_held.add_metric(list(p), snap.kv_held if snap.kv_capacity is not None else 0)
        yield from (inflight, depth, limit, pressure, reserved, util, cap, tenant_depth, kv_held)
