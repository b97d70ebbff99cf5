"""Model pools (sidecar.pools): configuration, routing by admission id, and independence.

The property: a pool's decisions depend on its own traffic only. The same random
sequence run on pool A alone and interleaved with a random sequence on pool B gives
pool A the same decisions, step by step.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from devtools import pooled as pool_support
from devtools.fleet import wait_for
from devtools.httpclient import Exchange, request
from devtools.stack import load_renderer
from sidecar import codec, edge
from sidecar.admission import AdmissionController, Denied
from sidecar.app import build_runtime
from sidecar.classes import HIGH_TO_LOW, PriorityClass
from sidecar.config import (
    ConfigError,
    build_parser,
    check_pools,
    parse_priority_config,
    parse_settings,
    settings_from_args,
    split_worker_urls,
)
from sidecar.pools import DEFAULT_POOL, Pools, id_factory, pool_of
from sidecar.scheduler import BUILTIN_CLASSES, ReleaseResult, Scheduler
from tests.clock import FakeClock
from tests.conftest import StackFactory, assert_denied, assert_preempted, settle, until

S, I, D, B = (PriorityClass.SYSTEM, PriorityClass.INTERACTIVE, PriorityClass.DEFAULT,
              PriorityClass.BULK)

# ----------------------------------------------------------------------------- config


def test_pools_override_classes_field_wise_over_the_top_level() -> None:
    cfg = parse_priority_config("""
classes: {bulk: {queue_size: 7}}
pools:
  big: {classes: {bulk: {queue_timeout_secs: 9}, system: {reserved_floor: 1}}}
  small:
""", "p.yaml")
    big = cfg.classes_for("big")
    assert big[B].queue_size == 7 and big[B].queue_timeout_secs == 9
    assert big[S].reserved_floor == 1 and cfg.classes[S].reserved_floor == 32
    assert cfg.classes_for("small") == cfg.classes
    assert cfg.classes_for("unnamed") is cfg.classes
    assert cfg.max_queue_timeout() == max(300.0, 9.0)


@pytest.mark.parametrize(("text", "key", "reason"), [
    ("pools: {Big: {}}", "pools.Big", "pool name must be"),
    ("pools: [a]", "pools", "mapping of pool name"),
    ("pools: {a: {queues: 1}}", "pools.a.queues", "unknown key (expected: classes)"),
    ("pools: {a: {classes: {urgent: {}}}}", "pools.a.classes.urgent", "unknown class"),
    ("pools: {a: {classes: {bulk: {nope: 1}}}}", "pools.a.classes.bulk.nope", "unknown key"),
    ("pools: {a: {classes: {bulk: {queue_size: -1}}}}", "pools.a.classes.bulk.queue_size",
     ">= 0"),
    ("pools: {a: {classes: {bulk: {queue_timeout_secs: 0}}}}",
     "pools.a.classes.bulk.queue_timeout_secs", "> 0"),
])
def test_bad_pool_sections_stop_start_up_naming_the_key_path(text: str, key: str,
                                                            reason: str) -> None:
    with pytest.raises(ConfigError) as exc:
        parse_priority_config(text, "p.yaml")
    assert exc.value.file == "p.yaml" and exc.value.key == key
    assert reason in exc.value.reason


def test_worker_urls_name_pools_and_bare_urls_are_the_default_pool() -> None:
    default, pools = split_worker_urls(
        ["http://a:1", "big=http://b:1", "default=http://c:1", "big=http://d:1",
         "http://e:1/?x=y"])
    assert default == ("http://a:1", "http://c:1", "http://e:1/?x=y")
    assert pools == {"big": ("http://b:1", "http://d:1")}
    with pytest.raises(ConfigError, match="pool name"):
        split_worker_urls(["Big=http://b:1"])
    with pytest.raises(ConfigError, match="must start with http"):
        split_worker_urls(["big=ftp://b:1"])


def test_a_file_pool_without_workers_is_refused() -> None:
    cfg = parse_priority_config("pools: {big: {}}", "p.yaml")
    check_pools(cfg, {"big": ("http://b:1",)})
    with pytest.raises(ConfigError) as exc:
        check_pools(cfg, {"other": ("http://b:1",)})
    assert exc.value.key == "pools.big" and "--worker-urls big=URL" in exc.value.reason
    with pytest.raises(ConfigError, match="pools are off"):
        check_pools(parse_priority_config("pools: {default: {}}", "p.yaml"), {})


def _settings(*argv: str) -> Any:
    ns: argparse.Namespace = build_parser().parse_args(
        ["--priority-scheduler-enabled", *argv])
    return settings_from_args(ns, isatty=False)


def test_settings_with_and_without_pools() -> None:
    s = _settings("--worker-urls", "http://a:1", "big=http://b:1")
    assert s.worker_urls == ("http://a:1",) and s.pool_workers == {"big": ("http://b:1",)}
    plain = _settings("--worker-urls", "http://a:1")
    assert plain.pool_workers == {}


def test_pools_combine_with_a_fleet_shadow_and_edge_shed() -> None:
    # --coordination-url: each pool has its own ledger (test_fleet); --shadow: its
    # own shadow (test_shadow); --edge-shed: its own switches (test_edge).
    assert _settings("--worker-urls", "big=http://b:1", "--coordination-url",
                     "redis://127.0.0.1:6379/0").pool_workers == {"big": ("http://b:1",)}
    assert _settings("--worker-urls", "big=http://b:1", "--shadow").shadow
    assert _settings("--worker-urls", "big=http://b:1", "--edge-shed").scheduler.edge_shed
    with pytest.raises(ConfigError, match="--shadow cannot be combined with --coordination-url"):
        _settings("--worker-urls", "big=http://b:1", "--shadow", "--coordination-url",
                  "redis://127.0.0.1:6379/0")


# ----------------------------------------------------------------------- ids and codec


def test_ids_carry_the_pool_and_the_default_pools_look_as_without_pools() -> None:
    plain = id_factory(DEFAULT_POOL)()
    assert len(plain) == 32 and pool_of(plain) == DEFAULT_POOL
    big = id_factory("big-70b")()
    assert big.startswith("big-70b.") and pool_of(big) == "big-70b"
    longest = id_factory("p" * 31)()
    assert len(longest) <= codec.MAX_ADMISSION_ID_LEN


@pytest.mark.parametrize("pool", [DEFAULT_POOL, "big", "p" * 31])
def test_allow_template_matches_the_field_by_field_message_for_pool_ids(pool: str) -> None:
    for _ in range(2):  # the second call uses the cached template
        aid = id_factory(pool)()
        assert codec.encode_allow(aid, "bulk", "t1", False) == codec.build_allow(
            aid, "bulk", "t1", False)


def test_check_view_carries_the_routes_pool() -> None:
    from envoy.service.auth.v3 import external_auth_pb2
    req = external_auth_pb2.CheckRequest()
    assert codec.decode_check(req.SerializeToString()).pool is None
    req.attributes.context_extensions["smg-pool"] = "big"
    assert codec.decode_check(req.SerializeToString()).pool == "big"


# ------------------------------------------------------------------- pooled admission

SMALL = {c: dataclasses.replace(k, reserved_floor=0, reserved_per_slot=0.0, queue_size=2)
         for c, k in BUILTIN_CLASSES.items()}


def pooled(clock: FakeClock, capacities: dict[str, int],
           metrics: Any = None) -> Pools:
    return pool_support.pools({
        name: AdmissionController(Scheduler(SMALL, cap, clock), lease_secs=60.0, clock=clock,
                                  id_factory=id_factory(name))
        for name, cap in capacities.items()}, metrics)


def close(p: Pools) -> None:
    for q in p:
        q.controller.close()


async def test_calls_by_id_reach_the_pool_the_id_names() -> None:
    from sidecar.metrics import Metrics
    clock = FakeClock()
    metrics = Metrics(tenant_top_n=4, pools=True)
    p = pooled(clock, {DEFAULT_POOL: 1, "big": 1}, metrics)
    big, default = p["big"].controller, p[DEFAULT_POOL].controller
    a = await big.admit(B, "t")
    d = await default.admit(B, "t")
    assert pool_of(a.admission.id) == "big" and pool_of(d.admission.id) == DEFAULT_POOL
    assert p.holds(a.admission.id) and p.holds(d.admission.id)
    assert p.lease_count == 2
    assert p.release(a.admission.id) is ReleaseResult.RELEASED
    assert big.snapshot().inflight == 0 and default.snapshot().inflight == 1
    # Unknown ids and second releases are counted once, by the router.
    assert p.release("ghost." + "0" * 32) is ReleaseResult.UNKNOWN
    assert p.release(a.admission.id) is ReleaseResult.ALREADY_RELEASED
    for reason in ("unknown", "already_released"):
        assert metrics.registry.get_sample_value(
            "smg_sidecar_completion_unmatched_total", {"reason": reason}) == 1
    # Adoption after a restart: the id alone finds the pool.
    assert p.renew_or_adopt("big." + "1" * 32, B, "t")
    assert big.snapshot().inflight == 1
    assert not p.renew_or_adopt("ghost." + "1" * 32, B, "t")
    close(p)


def test_a_route_names_its_pool_and_a_sidecar_with_one_pool_takes_every_route() -> None:
    clock = FakeClock()
    two = pooled(clock, {DEFAULT_POOL: 1, "big": 1})
    assert two.for_route("big") is two["big"] and two.for_route("") is two[DEFAULT_POOL]
    assert two.for_route(DEFAULT_POOL) is two[DEFAULT_POOL]
    assert two.for_route("ghost") is None
    one = pooled(clock, {DEFAULT_POOL: 1})
    # The Envoy side of a pools roll-out may land first: its routes' pools are ignored.
    assert one.for_route("big") is one[DEFAULT_POOL] is one.for_route("")
    with pytest.raises(ValueError, match="default pool"):
        Pools({}, pool_support.NullRecorder())
    close(two)
    close(one)


async def test_made_up_periodic_entries_naming_a_pool_stop_at_that_pools_capacity() -> None:
    # The adoption bound is the named pool's capacity, not the sum over pools: otherwise
    # made-up ids naming a 1-slot pool fill it to the sum (8 + 1 here) and block it.
    from sidecar.completion import CompletionService
    from sidecar.metrics import Metrics

    clock = FakeClock()
    metrics = Metrics(tenant_top_n=4, pools=True)
    p = pooled(clock, {DEFAULT_POOL: 8, "small": 1}, metrics)
    svc = CompletionService(p, metrics)
    small = p["small"].controller

    def periodic(aid: str) -> codec.LogEntry:
        return codec.LogEntry(admission_id=aid, final=False, cls="default", tenant="t",
                              response_code=200)

    adopted = [svc._renew_or_adopt(periodic(f"small.{i:032x}")) for i in range(20)]
    assert adopted.count(True) == 1 and small.snapshot().inflight == 1
    assert metrics.registry.get_sample_value(
        "smg_sidecar_adoption_refused_total", {"class": "default"}) == 19
    # The other pool's room is its own: a made-up id naming it is still adopted.
    assert svc._renew_or_adopt(periodic(f"{DEFAULT_POOL}.{1:032x}"))
    # An id naming no pool of ours is neither adopted nor counted as refused.
    assert not svc._renew_or_adopt(periodic(f"ghost.{2:032x}"))
    assert metrics.registry.get_sample_value(
        "smg_sidecar_adoption_refused_total", {"class": "default"}) == 19
    close(p)


async def test_a_full_pool_does_not_block_another() -> None:
    clock = FakeClock()
    p = pooled(clock, {DEFAULT_POOL: 1, "big": 1})
    big, small = p["big"].controller, p[DEFAULT_POOL].controller
    await big.admit(B, "t")
    waiting = asyncio.ensure_future(big.admit(B, "t"))
    await asyncio.sleep(0)
    assert not waiting.done()  # big is full: queued
    await small.admit(B, "t")  # the default pool still has its slot
    waiting.cancel()
    close(p)


# --------------------------------------------------------------- independence property

OPS_A = st.lists(st.one_of(
    st.tuples(st.just("arrive"), st.sampled_from(HIGH_TO_LOW)),
    st.tuples(st.just("release"), st.integers(0, 20)),
    st.tuples(st.just("open"), st.integers(0, 20)),
    st.tuples(st.just("first_byte"), st.integers(0, 20)),
    st.tuples(st.just("cancel"), st.integers(0, 20)),
    st.tuples(st.just("capacity"), st.integers(0, 4)),
    st.tuples(st.just("time"), st.sampled_from([0.5, 3.0, 6.0, 40.0])),
), max_size=40)
OPS_B = st.lists(st.one_of(
    st.tuples(st.just("arrive"), st.sampled_from(HIGH_TO_LOW)),
    st.tuples(st.just("release"), st.integers(0, 20)),
    st.tuples(st.just("open"), st.integers(0, 20)),
    st.tuples(st.just("cancel"), st.integers(0, 20)),
    st.tuples(st.just("capacity"), st.integers(0, 4)),
), max_size=40)


class Driver:
    """Runs one pool's ops and records what that pool decided."""

    def __init__(self, p: Pools, pool: str) -> None:
        self.p = p
        self.pool = pool
        self.ctl = p[pool].controller
        self.tasks: list[asyncio.Task[Any]] = []
        self.stops: dict[int, asyncio.Future[None] | None] = {}

    def status(self, i: int) -> str:
        t = self.tasks[i]
        if not t.done():
            return "queued"
        if t.cancelled():
            return "cancelled"
        exc = t.exception()
        if isinstance(exc, Denied):
            return exc.outcome.value
        stop = self.stops.get(i)
        return "preempted" if stop is not None and stop.done() else "admitted"

    def admitted_id(self, k: int) -> str | None:
        done = [t for t in self.tasks if t.done() and not t.cancelled() and not t.exception()]
        if not done:
            return None
        aid: str = done[k % len(done)].result().admission.id
        return aid

    async def step(self, op: tuple[str, Any]) -> None:
        kind, arg = op
        if kind == "arrive":
            self.tasks.append(asyncio.ensure_future(self.ctl.admit(arg, "t")))
        elif kind == "release":
            aid = self.admitted_id(arg)
            if aid is not None:
                self.p.release(aid)
        elif kind == "open":
            aid = self.admitted_id(arg)
            if aid is not None:
                i = next(j for j, t in enumerate(self.tasks) if t.done() and not t.cancelled()
                         and not t.exception() and t.result().admission.id == aid)
                self.stops.setdefault(i, self.p.open_stop_channel(aid))
        elif kind == "first_byte":
            aid = self.admitted_id(arg)
            if aid is not None:
                self.p.mark_first_byte(aid)
        elif kind == "cancel":
            waiting = [t for t in self.tasks if not t.done()]
            if waiting:
                waiting[arg % len(waiting)].cancel()
        elif kind == "capacity":
            self.ctl.set_capacity(arg)
        for _ in range(3):
            await asyncio.sleep(0)

    def trace(self) -> tuple[Any, ...]:
        snap = self.ctl.snapshot()
        return (tuple(self.status(i) for i in range(len(self.tasks))), snap.capacity,
                tuple((c.inflight, c.queue_depth) for c in snap.classes.values()))


async def run(ops_a: list[tuple[str, Any]], ops_b: list[tuple[str, Any]],
              order: list[bool]) -> list[tuple[Any, ...]]:
    clock = FakeClock()
    p = pooled(clock, {"a": 2, DEFAULT_POOL: 2})
    a, b = Driver(p, "a"), Driver(p, DEFAULT_POOL)
    out: list[tuple[Any, ...]] = []
    ia = ib = 0
    for pick_b in order + [False] * len(ops_a):
        if pick_b and ib < len(ops_b):
            await b.step(ops_b[ib])
            ib += 1
            continue
        if ia == len(ops_a):
            break
        op = ops_a[ia]
        ia += 1
        if op[0] == "time":  # the clock is shared: both pools see time pass
            clock.advance(op[1])
            for q in p:
                ctl = q.controller
                assert isinstance(ctl, AdmissionController)
                ctl.tick()
            for _ in range(3):
                await asyncio.sleep(0)
        else:
            await a.step(op)
        out.append(a.trace())
    for t in a.tasks + b.tasks:
        t.cancel()
    await asyncio.gather(*a.tasks, *b.tasks, return_exceptions=True)
    close(p)
    return out


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops_a=OPS_A, ops_b=OPS_B, order=st.lists(st.booleans(), max_size=80))
def test_a_pools_decisions_do_not_depend_on_another_pools_traffic(
        ops_a: list[tuple[str, Any]], ops_b: list[tuple[str, Any]], order: list[bool]) -> None:
    alone = asyncio.run(run(ops_a, [], []))
    together = asyncio.run(run(ops_a, ops_b, order))
    assert together == alone


# ----------------------------------------------------------------- reload and renderer

RELOAD_A = """
classes:
  system: {reserved_floor: 0}
  interactive: {reserved_floor: 0, reserved_per_slot: 0.0}
  default: {reserved_per_slot: 0.0}
  bulk: {queue_size: 5}
pools:
  big: {classes: {bulk: {queue_size: 3}}}
"""
RELOAD_B = RELOAD_A.replace("bulk: {queue_size: 5}", "bulk: {queue_size: 6}").replace(
    "queue_size: 3", "queue_size: 2")


async def test_reload_applies_each_pools_table_and_refuses_an_unknown_pool(
        tmp_path: Path) -> None:
    path = tmp_path / "priority.yaml"
    path.write_text(RELOAD_A)
    app = await build_runtime(parse_settings([
        "--priority-scheduler-enabled", "--priority-scheduler-config", str(path),
        "--worker-urls", "http://127.0.0.1:9", "big=http://127.0.0.1:9",
        "--worker-capacity-override", "4", "--grpc-listen", "127.0.0.1:0",
        "--http-listen", "127.0.0.1:0", "--log-format", "json"]))
    await app.serve()
    try:
        def limits() -> dict[str, int]:
            return {q.name: q.controller.snapshot().classes[B].queue_limit for q in app.pools}

        assert limits() == {DEFAULT_POOL: 5, "big": 3}
        path.write_text(RELOAD_B)
        assert await app.reload_now()
        assert limits() == {DEFAULT_POOL: 6, "big": 2}
        path.write_text(RELOAD_B + "  ghost: {}\n")
        assert not await app.reload_now()
        assert limits() == {DEFAULT_POOL: 6, "big": 2}
        assert app.metrics.registry.get_sample_value(
            "smg_sidecar_config_reload_total", {"result": "error"}) == 1
    finally:
        await app.stop()


def test_renderer_routes_each_pool_with_its_context_extension() -> None:
    render = load_renderer().render
    base: dict[str, Any] = dict(listen_port=10000, admin_port=9901, sidecar_host="127.0.0.1",
                                sidecar_port=9001, workers=[("127.0.0.1", 8081)],
                                authz_timeout_secs=40, flush_interval_secs=1)
    doc = yaml.safe_load(render(**base, pools=[("big", "/big/", [("127.0.0.1", 8091)])]))
    listener = doc["static_resources"]["listeners"][0]
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    routes = hcm["route_config"]["virtual_hosts"][0]["routes"]
    big = next(r for r in routes if r.get("name") == "smg_pool_big")
    assert big["match"] == {"prefix": "/big/"} and big["route"]["cluster"] == "pool_big"
    per_route = big["typed_per_filter_config"]["envoy.filters.http.ext_authz"]
    assert per_route["check_settings"]["context_extensions"] == {"smg-pool": "big"}
    assert routes[-1]["match"] == {"prefix": "/"}  # the default pool's catch-all stays last
    clusters = {c["name"]: c for c in doc["static_resources"]["clusters"]}
    ep = clusters["pool_big"]["load_assignment"]["endpoints"][0]["lb_endpoints"][0]
    assert ep["endpoint"]["address"]["socket_address"]["port_value"] == 8091
    assert "workers" in clusters
    # Without pools the output is exactly today's.
    assert "smg-pool" not in render(**base)
    for bad in ([("big", "big", [("127.0.0.1", 1)])], [("Big", "/b/", [("127.0.0.1", 1)])],
                [("default", "/d/", [("127.0.0.1", 1)])], [("b", "/b/", [])]):
        with pytest.raises(ValueError):
            render(**base, pools=bad)

    # With the edge path each pool's edge route comes right before the pool's route, and
    # every pool's route before the default pool's edge route (which matches every path).
    doc = yaml.safe_load(render(**base, edge_shed=True,
                                pools=[("big", "/big/", [("127.0.0.1", 8091)]),
                                       ("small", "/small/", [("127.0.0.1", 8092)])]))
    hcm = doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0][
        "typed_config"]
    names = [r.get("name") for r in hcm["route_config"]["virtual_hosts"][0]["routes"]]
    assert names == ["smg_edge_shed_pool_big_bulk", "smg_pool_big",
                     "smg_edge_shed_pool_small_bulk", "smg_pool_small", "smg_edge_shed_bulk",
                     None]
    edge_route = hcm["route_config"]["virtual_hosts"][0]["routes"][0]
    assert edge_route["match"]["prefix"] == "/big/"
    assert edge_route["match"]["runtime_fraction"]["runtime_key"] == edge.runtime_key(B, "big")
    static = doc["layered_runtime"]["layers"][0]["static_layer"]
    assert static == {edge.runtime_key(B): 0, edge.runtime_key(B, "big"): 0,
                      edge.runtime_key(B, "small"): 0}
    marks = [lg["typed_config"]["common_config"]["grpc_service"]["initial_metadata"]
             for lg in hcm["access_log"][1:]]
    assert marks == [[{"key": edge.STREAM_MARK_KEY, "value": "bulk"}]] + [
        [{"key": edge.STREAM_MARK_KEY, "value": "bulk"},
         {"key": edge.POOL_MARK_KEY, "value": p}] for p in ("big", "small")]


def test_the_pools_benchmark_runs() -> None:
    from bench import pools as bench_pools
    assert bench_pools.measure_core(3, 0.02) > 0
    assert bench_pools.measure_controller(3, 0.02) > 0


def test_check_config_prints_each_pools_table(capsys: pytest.CaptureFixture[str],
                                             tmp_path: Path) -> None:
    from sidecar.main import main
    path = tmp_path / "p.yaml"
    path.write_text("classes: {bulk: {queue_size: 7}}\n"
                    "pools: {big: {classes: {bulk: {queue_size: 3}}}}\n")
    assert main(["--check-config", str(path)]) == 0
    out = capsys.readouterr().out
    top, _, big = out.partition("pools.big:")
    assert [ln.split()[3] for ln in top.splitlines() if ln.startswith("bulk")] == ["7"]
    assert [ln.split()[3] for ln in big.splitlines() if ln.strip().startswith("bulk")] == ["3"]


async def test_preemption_takes_a_victim_only_in_the_preemptors_pool() -> None:
    clock = FakeClock()
    p = pooled(clock, {DEFAULT_POOL: 1, "big": 1})
    big, small = p["big"].controller, p[DEFAULT_POOL].controller
    victim = await small.admit(B, "t")  # the default pool's one slot, preemptible
    stop = p.open_stop_channel(victim.admission.id)
    assert stop is not None
    await big.admit(B, "t")  # big's one slot, not yet preemptible
    waiting = asyncio.ensure_future(big.admit(S, "t"))  # system may preempt, in big only
    await asyncio.sleep(0)
    assert not waiting.done() and not stop.done()  # nothing in big to take; small untouched
    assert small.holds(victim.admission.id)
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)
    await small.admit(S, "t")  # in its own pool the same arrival does preempt it
    assert stop.done() and not small.holds(victim.admission.id)
    close(p)


# ============================================================================
# Pools through a real Envoy: each route's pool admits on its own workers' capacity.
# Envoy routes /big/ and /small/ to the pools' clusters with ``smg-pool`` in ext_authz's
# context extensions, every other path to the default pool's workers, and /ghost/ to a
# pool the sidecar does not have.


pytestmark = pytest.mark.e2e


PRIORITY = """
classes:
  system: {reserved_floor: 0}
  interactive: {reserved_floor: 0, reserved_per_slot: 0.0}
  default: {reserved_per_slot: 0.0}
  bulk: {queue_size: 64, queue_timeout_secs: 20}
"""


# Per worker: the default pool 2 x 1 = 2, big 1 x 1 = 1, small 2 x 3 = 6 slots.
POOLS = {"big": (1, 1), "small": (2, 3)}


CAPACITY = {"default": 2, "big": 1, "small": 6}


# Each pool on an engine of its own, its capacity read by that engine's rule.
ENGINES = {"default": "generic", "big": "sglang", "small": "vllm"}


POOL_WORKERS = {"big": {"engine": "sglang"}, "small": {"engine": "vllm", "dev_mode": True}}


async def test_each_pool_admits_on_its_own_capacity(make_stack: StackFactory) -> None:
    stack = await make_stack(priority_yaml=PRIORITY, max_running_requests=1, service_time=0.15,
                             pools=POOLS, pool_worker_kwargs=POOL_WORKERS,
                             envoy_extra_pools=("ghost",))
    fleets = {"default": stack.fleet, **stack.pool_fleets}
    paths = {"default": "/v1/chat/completions", "big": "/big/v1/chat/completions",
             "small": "/small/v1/chat/completions"}
    n = 14
    results = await asyncio.gather(*(
        request(stack.listen_port, paths[pool], headers={"x-smg-priority": "bulk"},
                timeout=30)
        for pool in paths for _ in range(n)))
    assert [r.status for r in results] == [200] * (n * len(paths))
    for pool, fleet in fleets.items():
        workers = fleet.workers  # type: ignore[union-attr]
        records = [rec for w in workers for rec in w.records]
        assert len(records) == n, pool  # every request reached its own pool's workers
        # Never above the pool's own capacity, and the other pools' load took none of it.
        # (Per worker it is Envoy's balancing that decides, so the pool's sum is checked.)
        assert fleet.tally.peak == CAPACITY[pool], pool  # type: ignore[union-attr]
        ids = {rec.admission_id for rec in records}
        assert all(i is not None and (i.startswith(f"{pool}.") if pool != "default"
                                      else len(i) == 32) for i in ids), ids

    # A route naming a pool the sidecar lacks: the documented 429, counted, no worker.
    before = sum(len(w.records) for w in stack.fleet.workers)
    r = await request(stack.listen_port, "/ghost/v1/chat/completions",
                      headers={"x-smg-priority": "bulk"})
    assert_denied(r, 429, "scheduler_queue_full", "2")
    assert "pool" in r.json()["error"]["message"]
    assert sum(len(w.records) for w in stack.fleet.workers) == before
    m = await settle(stack)
    assert m['smg_sidecar_unknown_pool_total{class="bulk"}'] == 1
    # Per pool, under the pool label (summed over pools: today's series).
    for pool, cap in CAPACITY.items():
        assert m[f'smg_scheduler_admit_total{{class="bulk",outcome="admitted",pool="{pool}"}}'] == n
        assert m[f'smg_sidecar_capacity{{pool="{pool}"}}'] == cap
        assert m[f'smg_sidecar_healthy_workers{{pool="{pool}"}}'] == len(fleets[pool].workers)
        for w in fleets[pool].workers:  # type: ignore[union-attr]
            assert m[f'smg_sidecar_worker_capacity{{engine="{ENGINES[pool]}",'
                     f'worker="{w.url}"}}'] == cap // len(fleets[pool].workers), pool
    assert all("pool=" in k for k in m if k.startswith("smg_scheduler_admit_total{"))


async def test_the_default_pool_may_take_its_workers_from_envoys_cluster(
        make_stack: StackFactory) -> None:
    # --envoy-admin-url: the default pool counts the `workers` cluster's hosts only, not
    # the pools' clusters, whose workers the named pools probe themselves.
    stack = await make_stack(priority_yaml=PRIORITY, max_running_requests=1, service_time=0.15,
                             pools={"big": (1, 3)}, capacity_from_envoy=True)
    m = await until(stack, lambda m: m.get('smg_sidecar_capacity{pool="default"}') == 2
                    and m.get('smg_sidecar_capacity{pool="big"}') == 3, timeout=10)
    assert m['smg_sidecar_healthy_workers{pool="default"}'] == 2
    results = await asyncio.gather(*(
        request(stack.listen_port, path, headers={"x-smg-priority": "bulk"}, timeout=30)
        for path in ("/v1/chat/completions", "/big/v1/chat/completions") for _ in range(8)))
    assert [r.status for r in results] == [200] * 16
    assert stack.fleet.tally.peak == 2  # type: ignore[union-attr]
    assert stack.pool_fleets["big"].tally.peak == 3
    await settle(stack)


async def test_preemption_through_envoy_stays_inside_the_pool(make_stack: StackFactory) -> None:
    # big: 1 slot; the default pool: 1 slot. A bulk request held before its first byte in
    # each; a system request on big's route preempts big's, never the default pool's.
    stack = await make_stack(priority_yaml=PRIORITY, workers=1, max_running_requests=1,
                             pools={"big": (1, 1)},  # anonymous may ask for system here:
                             sidecar_args=["--priority-scheduler-default-max-class", "system"])
    default_victim = await Exchange.send(
        stack.listen_port, headers={"x-smg-priority": "bulk", "x-fake-gate": "d"})
    big_victim = await Exchange.send(
        stack.listen_port, "/big/v1/chat/completions",
        headers={"x-smg-priority": "bulk", "x-fake-gate": "never"})
    big_worker = stack.pool_fleets["big"].workers[0]
    await wait_for(lambda: stack.fleet.workers[0].running == 1 and big_worker.running == 1, 5)
    try:
        r = await request(stack.listen_port, "/big/v1/chat/completions",
                          headers={"x-smg-priority": "system"})
        assert r.status == 200
        await assert_preempted(big_victim)
        assert stack.fleet.workers[0].running == 1  # the default pool's victim-to-be runs on
        stack.fleet.gates.open("d")
        await asyncio.wait_for(default_victim.read_head(), 10)
        assert default_victim.status == 200
        await asyncio.wait_for(default_victim.read_body(), 10)
    finally:
        await big_victim.close()
        await default_victim.close()
    m = await settle(stack)
    key = 'smg_scheduler_preemption_total{by_class="system",pool="big",victim_class="bulk"}'
    assert m[key] == 1
    assert not any("preemption_total" in k and 'pool="default"' in k for k in m)
