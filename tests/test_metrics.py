"""metrics.py: the verb table in its docstring is what each verb really changes."""

from __future__ import annotations

import re
import time
from collections.abc import Callable

import pytest

from sidecar import metrics
from sidecar.capacity import CapacityReading, WorkerCapacity
from sidecar.classes import PriorityClass
from sidecar.metrics import Metrics, NullRecorder, Recorder
from sidecar.pools import PoolRecorder
from sidecar.scheduler import (
    BUILTIN_CLASSES,
    LEASE_EXPIRED,
    Admission,
    Admitted,
    Outcome,
    Preempted,
    Rejected,
    Released,
    ReleaseReason,
    Scheduler,
)

S, I, D, B = (PriorityClass.SYSTEM, PriorityClass.INTERACTIVE, PriorityClass.DEFAULT,
              PriorityClass.BULK)


def documented() -> tuple[dict[str, set[str]], set[str]]:
    """verb -> metric names from the docstring's table, and the snapshot gauges."""
    doc = metrics.__doc__ or ""
    table, _, after = doc.partition("The snapshot gauges")
    verbs: dict[str, set[str]] = {}
    verb = ""
    for line in table.splitlines():
        if m := re.match(r"``(\w+)``", line):
            verb = m.group(1)
            verbs[verb] = set()
        if verb:
            verbs[verb].update(re.findall(r"``(smg_[a-z_]+)", line))
    return verbs, set(re.findall(r"``(smg_[a-z_]+)``", after))


def samples(m: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample, keyed by its family's exported name (counters with ``_total``)."""
    out = {}
    for family in m.registry.collect():
        name = family.name + "_total" if family.type == "counter" else family.name
        for s in family.samples:
            out[(name, tuple(sorted({**s.labels, "__sample": s.name}.items())))] = s.value
    return out


def admission(cls: PriorityClass, aid: str = "a") -> Admission:
    return Admission(aid, cls, "t", 0.0)


def _one_queued() -> Scheduler:
    """Capacity 0 and one waiter, so the per-tenant depth gauge has a series too."""
    s = Scheduler(BUILTIN_CLASSES, 0, time.monotonic)
    s.arrive("w", D, "t")
    return s


SNAPSHOT = _one_queued().snapshot

CALLS: dict[str, Callable[[Recorder], None]] = {
    "on_events": lambda r: r.on_events([
        Admitted(admission(B), waited=0.2, queued=True, starvation=True),
        Admitted(admission(D, "old"), waited=0.0, queued=False, adopted=True),
        Rejected("r", D, "t", Outcome.REJECTED_QUEUE_FULL, 0.0),
        Preempted(admission(B), by_class=I),
        Released(admission(B), ReleaseReason.COMPLETED),
        Released(admission(D), LEASE_EXPIRED),
    ]),
    "rate_limit": lambda r: r.rate_limit(False),
    "completion_unmatched": lambda r: r.completion_unmatched("unknown"),
    "overloaded": lambda r: r.overloaded(B),
    "unknown_pool": lambda r: r.unknown_pool(B),
    "pool_events": lambda r: r.pool_events("big", [
        Admitted(admission(B), waited=0.2, queued=True, starvation=True),
        Admitted(admission(D, "old"), waited=0.0, queued=False, adopted=True),
        Rejected("r", D, "t", Outcome.REJECTED_QUEUE_FULL, 0.0),
        Preempted(admission(B), by_class=I),
        Released(admission(B), ReleaseReason.COMPLETED),
        Released(admission(D), LEASE_EXPIRED),
    ]),
    "pool_capacity_read": lambda r: r.pool_capacity_read("big", CapacityReading(
        96, "workers", healthy=2, total=3, excess=2,
        workers=(WorkerCapacity("http://w1", "sglang", 64),
                 WorkerCapacity("http://w2", "vllm", 32,
                                problems=(("/metrics", "unauthorized"),))))),
    "pools_started": lambda r: r.pools_started(lambda: {"big": SNAPSHOT()}),
    "ext_proc_stream": lambda r: r.ext_proc_stream(False),
    "adoption_refused": lambda r: r.adoption_refused(D),
    "admin_dropped": lambda r: r.admin_dropped("deadline"),
    "classified": lambda r: r.classified("t", S, D, True),
    "preemption_undelivered": lambda r: r.preemption_undelivered(),
    "capacity_read": lambda r: r.capacity_read(CapacityReading(
        96, "workers", healthy=2, total=3, excess=2,
        workers=(WorkerCapacity("http://w1", "sglang", 64),
                 WorkerCapacity("http://w2", "vllm", 32,
                                problems=(("/metrics", "unauthorized"),))))),
    "started": lambda r: r.started(legacy=False, snapshot=SNAPSHOT, config_digest="abc"),
    "config_reloaded": lambda r: r.config_reloaded(2, "def"),
    "config_reload_failed": lambda r: r.config_reload_failed(),
    "fleet_seen": lambda r: r.fleet_seen({S: 1, B: 3}, 2),
    "coordination_changed": lambda r: r.coordination_changed("degraded"),
    "preemption_suspended": lambda r: r.preemption_suspended(True),
    "coordination_fault": lambda r: r.coordination_fault("stale_copy"),
    "server_checked": lambda r: r.server_checked("eviction", "risk"),
    "library_checked": lambda r: r.library_checked("mismatch"),
    "fleet_collision": lambda r: r.fleet_collision("config"),
    "envoy_feature": lambda r: r.envoy_feature("ext_proc", "absent"),
    "envoy_streams": lambda r: r.envoy_streams(2, 1),
    "owner_lost": lambda r: r.owner_lost(3),
    "owner_blip": lambda r: r.owner_blip(),
    "edge_shed": lambda r: r.edge_shed(B, 3),
    "edge_share": lambda r: r.edge_share(B, 0.5),
    "shadow_admit": lambda r: r.shadow_admit(B, Outcome.REJECTED_QUEUE_TIMEOUT),
    "shadow_started": lambda r: r.shadow_started(SNAPSHOT),
}


def test_the_table_lists_every_verb_of_the_protocol() -> None:
    verbs, gauges = documented()
    protocol = {n for n in vars(Recorder) if not n.startswith("_")}
    assert set(verbs) == protocol == set(CALLS)
    assert len(gauges) == 8
    # NullRecorder and Metrics answer every verb.
    for impl in (NullRecorder, Metrics):
        assert protocol <= set(dir(impl)), impl


@pytest.mark.parametrize("verb", sorted(CALLS))
def test_each_verb_changes_exactly_the_metrics_the_table_lists(verb: str) -> None:
    verbs, gauges = documented()
    m = Metrics(tenant_top_n=4)
    if verb != "started":  # the snapshot gauges are there in production; keep them out of the diff
        m.started(legacy=False, snapshot=SNAPSHOT, config_digest="x")
    before = samples(m)
    CALLS[verb](m)
    after = samples(m)
    changed = {name for (name, labels), v in after.items() if before.get((name, labels)) != v}
    expected = verbs[verb] | (gauges if verb == "started" else set())
    assert changed == expected


def test_every_exported_metric_is_fed_by_some_verb() -> None:
    verbs, gauges = documented()
    m = Metrics(tenant_top_n=4)
    m.started(legacy=False, snapshot=SNAPSHOT, config_digest="x")
    m.shadow_started(SNAPSHOT)  # registered only in shadow mode
    exported = {name for name, _ in samples(m)} | {
        f.name + ("_total" if f.type == "counter" else "") for f in m.registry.collect()}
    assert exported == set().union(*verbs.values()) | gauges


def test_with_pools_the_scheduler_and_capacity_series_carry_the_pool() -> None:
    m = Metrics(tenant_top_n=4, pools=True)
    m.started(legacy=False, snapshot=SNAPSHOT, config_digest="x")
    m.pools_started(lambda: {"big": SNAPSHOT(), "default": SNAPSHOT()})
    CALLS["pool_events"](m)
    CALLS["pool_capacity_read"](m)
    m.capacity_read(CapacityReading(8, "fallback", healthy=0, total=0))  # the default pool's

    def get(name: str, **labels: str) -> float | None:
        return m.registry.get_sample_value(name, labels)

    assert get("smg_scheduler_admit_total", pool="big", **{"class": "bulk",
                                                            "outcome": "admitted"}) == 1
    assert get("smg_scheduler_preemption_total", pool="big", victim_class="bulk",
               by_class="interactive") == 1
    assert get("smg_scheduler_starvation_promotion_total", pool="big", **{"class": "bulk"}) == 1
    assert get("smg_scheduler_queue_wait_seconds_count", pool="big", **{"class": "bulk"}) == 1
    assert get("smg_sidecar_healthy_workers", pool="big") == 2
    assert get("smg_sidecar_capacity_source", pool="default", source="fallback") == 1
    assert get("smg_sidecar_engine_excess", pool="big") == 2
    assert get("smg_sidecar_worker_capacity", worker="http://w1", engine="sglang") == 64
    for pool in ("big", "default"):
        assert get("smg_scheduler_queue_depth", pool=pool, **{"class": "default"}) == 1
        assert get("smg_sidecar_capacity", pool=pool) == 0
    assert get("smg_scheduler_queue_depth", **{"class": "default"}) is None  # no unlabelled
    assert get("smg_sidecar_unknown_pool_total", **{"class": "system"}) == 0
    assert Metrics(tenant_top_n=4).registry.get_sample_value(
        "smg_sidecar_unknown_pool_total", {"class": "system"}) is None  # no pools: no series


def test_with_pools_the_coordination_series_carry_the_pool_of_their_ledger() -> None:
    m = Metrics(tenant_top_n=4, pools=True)

    def get(name: str, **labels: str) -> float | None:
        return m.registry.get_sample_value(name, labels)

    assert get("smg_sidecar_live_replicas", pool="default") == 0  # in process: 0, as ever
    big = PoolRecorder(m, "big")  # what a pool's fleet controller and fleet watch record
    big.fleet_seen({S: 1, B: 3}, 2)
    big.coordination_changed("degraded")
    big.coordination_fault("stale_copy")
    big.fleet_collision("config")
    m.coordination_changed("ok")  # no pool named: the default pool's
    assert get("smg_sidecar_fleet_inflight", pool="big", **{"class": "bulk"}) == 3
    assert get("smg_sidecar_live_replicas", pool="big") == 2
    assert get("smg_sidecar_coordination_state", pool="big", state="degraded") == 1
    assert get("smg_sidecar_coordination_state", pool="default", state="ok") == 1
    assert get("smg_sidecar_coordination_faults_total", pool="big", kind="stale_copy") == 1
    assert get("smg_sidecar_fleet_collision_total", pool="big", kind="config") == 1
    assert get("smg_sidecar_coordination_state", state="ok") is None  # no unlabelled


def test_lease_expiry_and_adoption_are_counted_from_core_events() -> None:
    m = Metrics(tenant_top_n=4)
    m.on_events([Released(admission(B), LEASE_EXPIRED),
                 Admitted(admission(D, "old"), waited=0.0, queued=False, adopted=True)])

    def get(name: str, **labels: str) -> float | None:
        return m.registry.get_sample_value(name, labels)

    assert get("smg_sidecar_lease_expired_total", **{"class": "bulk"}) == 1
    assert get("smg_sidecar_released_total", **{"class": "bulk", "reason": "lease_expired"}) == 1
    assert get("smg_sidecar_adopted_total", **{"class": "default"}) == 1
    # an adoption is not a decision of this process
    assert get("smg_scheduler_admit_total", **{"class": "default", "outcome": "admitted"}) == 0
