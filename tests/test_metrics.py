"""metrics.py: the verb table in its docstring is what each verb really changes."""

from __future__ import annotations

import re
import time
from collections.abc import Callable

import pytest

from sidecar import metrics
from sidecar.capacity import CapacityReading, WorkerCapacity
from sidecar.classes import PriorityClass
from sidecar.config import DEFAULT_POOL
from sidecar.metrics import (
    Metrics,
    NullPoolRecorder,
    NullRecorder,
    PoolMetrics,
    PoolRecorder,
    Recorder,
)
from sidecar.scheduler import (
    BUILTIN_CLASSES,
    LEASE_EXPIRED,
    Admission,
    Admitted,
    Outcome,
    OverTarget,
    Preempted,
    Rejected,
    Released,
    ReleaseReason,
    Scheduler,
)
from sidecar.tokens import Remaining

S, I, D, B = (PriorityClass.SYSTEM, PriorityClass.INTERACTIVE, PriorityClass.DEFAULT,
              PriorityClass.BULK)


def _table(text: str) -> dict[str, dict[str, bool]]:
    """verb -> {metric name: carries the pool label} from one table of the docstring."""
    verbs: dict[str, dict[str, bool]] = {}
    verb = ""
    for line in text.splitlines():
        if m := re.match(r"``(\w+)``", line):
            verb = m.group(1)
            verbs[verb] = {}
        if verb:
            for name, pool in re.findall(r"``(smg_[a-z_]+)[^`]*``(\s*\(pool\))?", line):
                verbs[verb][name] = bool(pool)
    return verbs


def documented() -> tuple[dict[str, dict[str, bool]], dict[str, dict[str, bool]], set[str]]:
    """The process's verbs, a pool's verbs, and the snapshot gauges, from the docstring."""
    doc = metrics.__doc__ or ""
    _, _, rest = doc.partition("The process's verbs:")
    process, _, rest = rest.partition("A pool's verbs:")
    pool, _, after = rest.partition("The snapshot gauges")
    return _table(process), _table(pool), set(re.findall(r"``(smg_[a-z_]+)``", after))


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

READING = CapacityReading(
    96, "workers", healthy=2, total=3, excess=2,
    workers=(WorkerCapacity("http://w1", "sglang", 64, kv_tokens=20480),
             WorkerCapacity("http://w2", "vllm", 32, problems=(("/metrics", "unauthorized"),))))

PROCESS_CALLS: dict[str, Callable[[Recorder], None]] = {
    "completion_unmatched": lambda r: r.completion_unmatched("unknown"),
    "overloaded": lambda r: r.overloaded(B),
    "unknown_pool": lambda r: r.unknown_pool(B),
    "tenant_rejected": lambda r: r.tenant_rejected(S, "t", "rejected_queue_timeout"),
    "ext_proc_stream": lambda r: r.ext_proc_stream(False),
    "adoption_refused": lambda r: r.adoption_refused(D),
    "admin_dropped": lambda r: r.admin_dropped("deadline"),
    "classified": lambda r: r.classified("t", S, D, True),
    "started": lambda r: r.started(config_digest="abc"),
    "config_reloaded": lambda r: r.config_reloaded(2, "def"),
    "config_reload_failed": lambda r: r.config_reload_failed(),
    "server_checked": lambda r: r.server_checked("eviction", "risk"),
    "library_checked": lambda r: r.library_checked("mismatch"),
    "envoy_feature": lambda r: r.envoy_feature("ext_proc", "absent"),
    "envoy_streams": lambda r: r.envoy_streams(2, 1),
    "owner_lost": lambda r: r.owner_lost(3),
    "owner_blip": lambda r: r.owner_blip(),
}

POOL_CALLS: dict[str, Callable[[PoolRecorder], None]] = {
    "on_events": lambda r: r.on_events([
        Admitted(admission(B), waited=0.7, queued=True, starvation=True, predicted=0.5),
        Admitted(admission(D, "old"), waited=0.0, queued=False, adopted=True),
        Rejected("r", D, "t", Outcome.REJECTED_QUEUE_FULL, 0.0),
        Preempted(admission(B), by_class=I),
        Released(admission(B), ReleaseReason.COMPLETED),
        Released(admission(D), LEASE_EXPIRED),
        OverTarget("o", B, "t", predicted=9.0, budget=2.0, enforced=False),
    ]),
    "completed": lambda r: r.completed(B, 1.5, 0.25),
    "rate_limit": lambda r: r.rate_limit(False),
    "preemption_undelivered": lambda r: r.preemption_undelivered(),
    "capacity_read": lambda r: r.capacity_read(READING),
    "admission_started": lambda r: r.admission_started(
        legacy=True, snapshot=SNAPSHOT, fallback=("legacy_uncapped",
                                                  "reservations_exceed_capacity")),
    "preemption_suspended": lambda r: r.preemption_suspended(True),
    "adaptive_limit": lambda r: r.adaptive_limit(4, "probe", True),
    "fleet_seen": lambda r: r.fleet_seen({S: 1, B: 3}, 2),
    "coordination_changed": lambda r: r.coordination_changed("degraded"),
    "coordination_fault": lambda r: r.coordination_fault("stale_copy"),
    "fleet_collision": lambda r: r.fleet_collision("config"),
    "edge_shed": lambda r: r.edge_shed(B, 3),
    "edge_share": lambda r: r.edge_share(B, 0.5),
    "shadow_admit": lambda r: r.shadow_admit(B, Outcome.REJECTED_QUEUE_TIMEOUT),
    "shadow_started": lambda r: r.shadow_started(SNAPSHOT),
    "tokens_reserved": lambda r: r.tokens_reserved(B, 300),
    "tokens_settled": lambda r: r.tokens_settled(B, 280, 300),
    "token_fallback": lambda r: r.token_fallback("usage_missing"),
    "token_budget_refused": lambda r: r.token_budget_refused(I, "minute", True),
    "token_context_refused": lambda r: r.token_context_refused(I, True),
    "kv_admission": lambda r: r.kv_admission("ungated"),
    "kv_refused": lambda r: r.kv_refused(B, True),
    "tokens_started": lambda r: r.tokens_started(lambda: [
        Remaining("acme", "minute", 1000, 900, 150), Remaining("beta", "month", 10, 2, 0)]),
}


def test_the_tables_list_every_verb_of_the_protocols() -> None:
    process, pool, gauges = documented()
    assert set(process) == {n for n in vars(Recorder) if not n.startswith("_")} \
        == set(PROCESS_CALLS)
    assert set(pool) == {n for n in vars(PoolRecorder) if not n.startswith("_")} \
        == set(POOL_CALLS)
    assert not set(process) & set(pool)  # each verb defined once
    assert len(gauges) == 9
    # The implementations and the null recorders answer every verb.
    assert set(process) <= set(dir(Metrics)) and set(process) <= set(dir(NullRecorder))
    assert set(pool) <= set(dir(PoolMetrics)) and set(pool) <= set(dir(NullPoolRecorder))


def _diff(m: Metrics, call: Callable[[], None]) -> set[tuple[str, tuple[tuple[str, str], ...]]]:
    before = samples(m)
    call()
    after = samples(m)
    return {key for key, v in after.items() if before.get(key) != v}


@pytest.mark.parametrize("verb", sorted(PROCESS_CALLS))
def test_each_process_verb_changes_exactly_the_metrics_its_row_lists(verb: str) -> None:
    process, _, _ = documented()
    m = Metrics(tenant_top_n=4)
    m.pool(DEFAULT_POOL).admission_started(legacy=False, snapshot=SNAPSHOT)
    changed = _diff(m, lambda: PROCESS_CALLS[verb](m))
    assert {name for name, _ in changed} == set(process[verb])


@pytest.mark.parametrize("named", [False, True], ids=["one_pool", "named_pools"])
@pytest.mark.parametrize("verb", sorted(POOL_CALLS))
def test_each_pool_verb_changes_exactly_its_rows_metrics_under_its_pools_label(
        verb: str, named: bool) -> None:
    _, pool, gauges = documented()
    m = Metrics(tenant_top_n=4, pools=named)
    under_test = "big" if named else DEFAULT_POOL
    if named:  # another pool's gauges stay out of the diff
        m.pool(DEFAULT_POOL).admission_started(legacy=False, snapshot=SNAPSHOT)
    p = m.pool(under_test)  # its series at 0 from the start
    if verb != "admission_started":
        p.admission_started(legacy=False, snapshot=SNAPSHOT)
    changed = _diff(m, lambda: POOL_CALLS[verb](p))
    expected = dict(pool[verb], **dict.fromkeys(gauges, True)
                    if verb == "admission_started" else {})
    assert {name for name, _ in changed} == set(expected)
    for name, labels in changed:
        # Where the sidecar has named pools, the (pool) series name the pool that wrote
        # them; every other series (and every series with one pool) has no pool label.
        pool_label = dict(labels).get("pool")
        assert pool_label == ("big" if named and expected[name] else None), (name, labels)


def test_every_exported_metric_is_fed_by_some_verb() -> None:
    process, pool, gauges = documented()
    m = Metrics(tenant_top_n=4)
    p = m.pool(DEFAULT_POOL)
    p.admission_started(legacy=False, snapshot=SNAPSHOT)
    p.shadow_started(SNAPSHOT)  # registered only in shadow mode
    POOL_CALLS["tokens_started"](p)  # only where token accounting is on
    exported = {name for name, _ in samples(m)} | {
        f.name + ("_total" if f.type == "counter" else "") for f in m.registry.collect()}
    fed = set().union(*(set(v) for v in (*process.values(), *pool.values())))
    assert exported == fed | gauges


def test_with_named_pools_each_pools_series_carry_its_name() -> None:
    m = Metrics(tenant_top_n=4, pools=True)
    for name in ("big", DEFAULT_POOL):
        m.pool(name).admission_started(legacy=False, snapshot=SNAPSHOT)
    POOL_CALLS["on_events"](m.pool("big"))
    POOL_CALLS["capacity_read"](m.pool("big"))
    m.pool(DEFAULT_POOL).capacity_read(CapacityReading(8, "fallback", healthy=0, total=0))

    def get(name: str, **labels: str) -> float | None:
        return m.registry.get_sample_value(name, labels)

    assert get("smg_scheduler_admit_total", pool="big", **{"class": "bulk",
                                                            "outcome": "admitted"}) == 1
    assert get("smg_sidecar_healthy_workers", pool="big") == 2
    assert get("smg_sidecar_capacity_source", pool=DEFAULT_POOL, source="fallback") == 1
    assert get("smg_sidecar_worker_capacity", worker="http://w1", engine="sglang") == 64
    for pool in ("big", DEFAULT_POOL):
        assert get("smg_scheduler_queue_depth", pool=pool, **{"class": "default"}) == 1
        assert get("smg_sidecar_capacity", pool=pool) == 0
        assert get("smg_sidecar_live_replicas", pool=pool) == 0  # in process: 0, as ever
        assert get("smg_sidecar_admission_mode", pool=pool, mode="scheduler") == 1
    assert get("smg_scheduler_queue_depth", **{"class": "default"}) is None  # no unlabelled
    assert get("smg_sidecar_unknown_pool_total", **{"class": "system"}) == 0
    assert Metrics(tenant_top_n=4).registry.get_sample_value(
        "smg_sidecar_unknown_pool_total", {"class": "system"}) is None  # no pools: no series


def test_without_named_pools_there_is_one_pool() -> None:
    m = Metrics(tenant_top_n=4)
    assert m.pool(DEFAULT_POOL) is m.pool(DEFAULT_POOL)
    with pytest.raises(ValueError, match="pools=True"):
        m.pool("big")


def test_a_pools_fallback_to_legacy_admission_is_its_own_series() -> None:
    m = Metrics(tenant_top_n=4, pools=True)
    m.pool(DEFAULT_POOL).admission_started(legacy=False, snapshot=SNAPSHOT)
    m.pool("small").admission_started(legacy=True, snapshot=SNAPSHOT,
                                      fallback=("legacy_uncapped",
                                                "reservations_exceed_capacity"))

    def get(**labels: str) -> float | None:
        return m.registry.get_sample_value("smg_sidecar_admission_fallback",
                                           {"reason": "reservations_exceed_capacity", **labels})

    assert get(pool="small", mode="legacy_uncapped") == 1
    assert get(pool="small", mode="legacy") == 0
    assert get(pool=DEFAULT_POOL, mode="legacy_uncapped") == 0
    assert m.registry.get_sample_value("smg_sidecar_admission_mode",
                                       {"pool": "small", "mode": "legacy"}) == 1


def test_lease_expiry_and_adoption_are_counted_from_core_events() -> None:
    m = Metrics(tenant_top_n=4)
    m.pool(DEFAULT_POOL).on_events([Released(admission(B), LEASE_EXPIRED),
                 Admitted(admission(D, "old"), waited=0.0, queued=False, adopted=True)])

    def get(name: str, **labels: str) -> float | None:
        return m.registry.get_sample_value(name, labels)

    assert get("smg_sidecar_lease_expired_total", **{"class": "bulk"}) == 1
    assert get("smg_sidecar_released_total", **{"class": "bulk", "reason": "lease_expired"}) == 1
    assert get("smg_sidecar_adopted_total", **{"class": "default"}) == 1
    # an adoption is not a decision of this process
    assert get("smg_scheduler_admit_total", **{"class": "default", "outcome": "admitted"}) == 0
