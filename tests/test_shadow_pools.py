"""Shadow mode with model pools: each pool's shadow beside its own core and capacity.

The replay of tests/test_shadow.py per pool (a pool's would-be decisions are what that
pool's enforcing core makes on its own trace, whatever the other pool's traffic), the
Check over gRPC, then two pools through a real Envoy.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from pathlib import Path

import pytest
from envoy.service.auth.v3 import external_auth_pb2

from devtools.fleet import wait_for
from devtools.httpclient import Exchange, request
from sidecar.app import build_runtime
from sidecar.classes import PriorityClass
from sidecar.config import DEFAULT_POOL, parse_settings
from sidecar.metrics import Metrics
from sidecar.pools import PoolRecorder, pool_of
from sidecar.scheduler import ClassSettings, Scheduler
from sidecar.shadow import ShadowCore
from tests.clock import FakeClock
from tests.conftest import StackFactory, settle, until
from tests.grpc_client import EnvoyStandIn, admission_id, check_request
from tests.test_authz import PRIORITY as GRPC_PRIORITY
from tests.test_pools import RELOAD_A
from tests.test_shadow import _enforce, _shadow

BIG = "big"
Trace = list[tuple[float, PriorityClass, float]]


def _trace(rnd: random.Random, n: int, rate: float) -> Trace:
    t = 0.0
    out = []
    for _ in range(n):
        t += rnd.expovariate(rate)
        out.append((t, rnd.choice(list(PriorityClass)), rnd.uniform(0.05, 2.0)))
    return out


def _shadow_pools(traces: dict[str, Trace], cfgs: dict[str, dict[PriorityClass, ClassSettings]],
                  capacities: dict[str, int]) -> dict[str, Counter[tuple[str, str]]]:
    """Shadow mode as app.py wires it with pools: one ShadowCore per pool recording under
    its pool's label; the pools' traces interleaved on one clock, each call routed by the
    pool its id names. Returns each pool's would-be counts, read from the metrics."""
    clock = FakeClock(0.0)
    metrics = Metrics(tenant_top_n=10, pools=True)
    cores = {p: ShadowCore(Scheduler(cfgs[p], capacities[p], clock), clock,
                           PoolRecorder(metrics, p)) for p in traces}
    ends = {f"{p}.r{i}": t + svc for p, tr in traces.items() for i, (t, _, svc) in enumerate(tr)}
    pending = sorted((t, f"{p}.r{i}", cls) for p, tr in traces.items()
                     for i, (t, cls, _) in enumerate(tr))

    def next_deadline() -> float | None:
        due = [d for c in cores.values() if (d := c.next_deadline()) is not None]
        return min(due) if due else None

    while pending or ends or next_deadline() is not None:
        due = [x for x in (pending[0][0] if pending else None,
                           min(ends.values()) if ends else None, next_deadline())
               if x is not None]
        clock.now = max(clock.now, min(due))
        ending = [a for a, t in ends.items() if t <= clock.now]
        arriving = []
        while pending and pending[0][0] <= clock.now:
            arriving.append(pending.pop(0))
        # A pool's core is called only for its own events and deadlines, as each pool's
        # controller in the sidecar (tick() at another pool's event times would promote
        # starving requests at other moments than the pool alone).
        for p, c in cores.items():
            deadline = c.next_deadline()
            mine = [a for a in ending if pool_of(a) == p]
            came = [x for x in arriving if pool_of(x[1]) == p]
            if not (mine or came or (deadline is not None and deadline <= clock.now)):
                continue
            for aid in mine:
                del ends[aid]
                c.release(aid)
            c.tick()
            for _, aid, cls in came:
                c.arrive(aid, cls, "t")
    out: dict[str, Counter[tuple[str, str]]] = {p: Counter() for p in traces}
    for fam in metrics.registry.collect():
        if fam.name != "smg_sidecar_shadow_admit":
            continue
        for s in fam.samples:
            if s.name.endswith("_total") and s.value:
                out[s.labels["pool"]][(s.labels["class"], s.labels["outcome"])] += int(s.value)
    assert all(c.snapshot().inflight == 0 and c.shadow_snapshot().inflight == 0
               for c in cores.values())
    return out


@pytest.mark.parametrize("seed", range(12))
def test_each_pools_shadow_counts_what_its_own_enforcing_core_does(seed: int) -> None:
    rnd = random.Random(seed)
    print("seed", seed)

    def cfg() -> dict[PriorityClass, ClassSettings]:
        # Starvation thresholds beyond any wait here: a promotion happens at a tick, and
        # the enforcing replay ticks at other moments (admissions end at other times)
        # than the shadow's, which is the replay's artefact, not a pool's.
        return {c: ClassSettings(rnd.randint(0, 1), 0.0, rnd.randint(0, 3),
                                 rnd.uniform(0.5, 3.0), 1000.0, False)
                for c in PriorityClass}

    cfgs = {DEFAULT_POOL: cfg(), BIG: cfg()}
    capacities = {DEFAULT_POOL: rnd.randint(2, 4), BIG: rnd.randint(1, 3)}
    a = _trace(rnd, 60, 4.0)
    enforced = _enforce(a, cfgs[BIG], capacities[BIG])
    assert {o for _, o in enforced} - {"admitted"}  # the trace does overload
    # Pool big's trace beside two different default-pool traces (one of them a flood):
    # big's would-be decisions are its own enforcing core's either way, and the default
    # pool's are its own.
    for other in (_trace(rnd, 40, 2.0), _trace(rnd, 150, 20.0)):
        got = _shadow_pools({DEFAULT_POOL: other, BIG: a}, cfgs, capacities)
        assert got[BIG] == enforced
        assert got[DEFAULT_POOL] == _enforce(other, cfgs[DEFAULT_POOL], capacities[DEFAULT_POOL])
        # And each pool's shadow counts exactly what a single-pool shadow on its trace does.
        assert got[DEFAULT_POOL] == _shadow(other, cfgs[DEFAULT_POOL], capacities[DEFAULT_POOL])


# ------------------------------------------------------------------ over gRPC


async def test_over_grpc_each_pools_shadow_answers_and_an_unknown_pool_is_allowed(
        tmp_path: Path) -> None:
    cfg = tmp_path / "priority.yaml"
    cfg.write_text(GRPC_PRIORITY)  # bulk: queue of 2, 0.3 s timeout
    app = await build_runtime(parse_settings([
        "--priority-scheduler-enabled", "--priority-scheduler-config", str(cfg),
        "--worker-urls", "http://127.0.0.1:9", f"{BIG}=http://127.0.0.1:9",
        "--worker-capacity-override", "1", "--shadow", "--grpc-listen", "127.0.0.1:0",
        "--http-listen", "127.0.0.1:0", "--log-format", "json"]))
    await app.serve()
    envoy = EnvoyStandIn(app.grpc_port)
    check = envoy.channel.unary_unary(
        "/envoy.service.auth.v3.Authorization/Check",
        request_serializer=external_auth_pb2.CheckRequest.SerializeToString,
        response_deserializer=external_auth_pb2.CheckResponse.FromString)

    async def check_in(pool: str | None) -> external_auth_pb2.CheckResponse:
        req = check_request({"x-smg-priority": "bulk"})
        if pool is not None:
            req.attributes.context_extensions["smg-pool"] = pool
        resp: external_auth_pb2.CheckResponse = await asyncio.wait_for(check(req), 5)
        assert resp.status.code == 0  # nothing is refused in shadow mode
        return resp

    def sample(name: str, **labels: str) -> float:
        v = app.metrics.registry.get_sample_value(name, labels)
        return 0.0 if v is None else v

    def said(r: external_auth_pb2.CheckResponse) -> tuple[str, str]:
        md = r.dynamic_metadata.fields
        return (md["shadow_outcome"].string_value,
                md["shadow_code"].string_value if "shadow_code" in md else "")

    try:
        # One slot per pool. Big gets a burst of four, the default pool one request.
        big = [await check_in(BIG) for _ in range(4)]
        default = await check_in(None)
        assert [said(r)[0] for r in big] == ["admitted", "queued", "queued",
                                            "rejected_queue_full"]
        assert said(big[3]) == ("rejected_queue_full", "scheduler_queue_full")
        assert said(default) == ("admitted", "")  # big's burst is not the default pool's
        assert all(pool_of(admission_id(r)) == BIG for r in big)
        assert pool_of(admission_id(default)) == DEFAULT_POOL
        for pool, n in ((BIG, 4), (DEFAULT_POOL, 1)):  # really: all admitted
            assert sample("smg_scheduler_admit_total", pool=pool, **{
                "class": "bulk", "outcome": "admitted"}) == n
        assert sample("smg_sidecar_shadow_admit_total", pool=BIG, **{
            "class": "bulk", "outcome": "rejected_queue_full"}) == 1
        assert sample("smg_sidecar_shadow_admit_total", pool=DEFAULT_POOL, **{
            "class": "bulk", "outcome": "admitted"}) == 1
        assert sample("smg_sidecar_shadow_inflight", pool=BIG, **{"class": "bulk"}) == 1
        assert sample("smg_sidecar_shadow_queue_depth", pool=BIG, **{"class": "bulk"}) == 2
        assert sample("smg_sidecar_shadow_queue_depth", pool=DEFAULT_POOL,
                      **{"class": "bulk"}) == 0

        # A route naming a pool the sidecar lacks: allowed, holding nothing, with the
        # would-be 429 in the metadata and counted as the 429 would be.
        ghost = await check_in("ghost")
        md = ghost.dynamic_metadata.fields
        assert "admission_id" not in md and md["preemptible"].bool_value is False
        assert said(ghost) == ("unknown_pool", "scheduler_queue_full")
        assert sample("smg_sidecar_unknown_pool_total", **{"class": "bulk"}) == 1
        assert app.controller.snapshot().inflight == 5

        await asyncio.sleep(0.5)  # big's two would-be queued ones time out (0.3 s)
        assert sample("smg_sidecar_shadow_admit_total", pool=BIG, **{
            "class": "bulk", "outcome": "rejected_queue_timeout"}) == 2
        await envoy.log(*((admission_id(r), "end") for r in [*big, default]))
        assert app.controller.snapshot().inflight == 0
        assert sample("smg_sidecar_shadow_inflight", pool=BIG, **{"class": "bulk"}) == 0
        assert sample("smg_sidecar_completion_unmatched_total", reason="unknown") == 0
    finally:
        await envoy.close()
        await app.stop()


# ------------------------------------------------------------------ through Envoy

E2E_PRIORITY = """
classes:
  system: {reserved_floor: 0}
  interactive: {reserved_floor: 0, reserved_per_slot: 0.0}
  default: {reserved_per_slot: 0.0}
  bulk: {queue_size: 1, queue_timeout_secs: 5}
pools:
  big: {classes: {bulk: {queue_size: 2}}}
"""


@pytest.mark.e2e
async def test_e2e_two_pools_every_request_passes_and_each_pools_shadow_names_it(
        make_stack: StackFactory) -> None:
    # Default pool: 1 worker x 1 slot, bulk queue 1; big: 1 worker x 2 slots, queue 2.
    stack = await make_stack(priority_yaml=E2E_PRIORITY, workers=1, max_running_requests=1,
                             pools={BIG: (1, 2)}, envoy_extra_pools=("ghost",),
                             sidecar_args=["--shadow"])
    big_fleet = stack.pool_fleets[BIG]
    worker, big_worker = stack.fleet.workers[0], big_fleet.workers[0]
    held = [await Exchange.send(stack.listen_port, headers={
        "x-smg-priority": "bulk", "x-fake-gate": "d"}) for _ in range(3)]
    held += [await Exchange.send(stack.listen_port, f"/{BIG}/v1/chat/completions", headers={
        "x-smg-priority": "bulk", "x-fake-gate": "b"}) for _ in range(6)]
    try:
        # Everything reaches its pool's workers at once, beyond each pool's capacity.
        await wait_for(lambda: worker.running == 3 and big_worker.running == 6, 10)
        m = await until(stack, lambda m: m.get(
            'smg_sidecar_shadow_admit_total{class="bulk",outcome="rejected_queue_full",'
            'pool="big"}') == 2 and m.get(
            'smg_sidecar_shadow_admit_total{class="bulk",outcome="rejected_queue_full",'
            'pool="default"}') == 1)
        assert m['smg_sidecar_shadow_admit_total{class="bulk",outcome="admitted",'
                 'pool="big"}'] == 2
        assert m['smg_sidecar_shadow_admit_total{class="bulk",outcome="admitted",'
                 'pool="default"}'] == 1
        assert m['smg_sidecar_shadow_inflight{class="bulk",pool="big"}'] == 2
        assert m['smg_sidecar_shadow_queue_depth{class="bulk",pool="big"}'] == 2
        assert m['smg_sidecar_shadow_queue_depth{class="bulk",pool="default"}'] == 1
        assert m['smg_scheduler_inflight{class="bulk",pool="big"}'] == 6
        assert m['smg_scheduler_inflight{class="bulk",pool="default"}'] == 3
        # A route naming a pool the sidecar lacks passes too, with its would-be answer.
        r = await request(stack.listen_port, "/ghost/v1/chat/completions",
                          headers={"x-smg-priority": "bulk"}, timeout=10)
        assert r.status == 200
        stack.fleet.gates.open("d")
        big_fleet.gates.open("b")
        for ex in held:
            await asyncio.wait_for(ex.read_head(), 10)
            assert ex.status == 200
            await asyncio.wait_for(ex.read_body(), 10)
    finally:
        for ex in held:
            await ex.close()
    # The allow's answer reached each pool's worker with its requests.
    assert Counter(r.headers.get("x-smg-shadow-outcome") for r in big_worker.records) == {
        "admitted": 2, "queued": 2, "rejected_queue_full": 2}
    said = Counter(r.headers.get("x-smg-shadow-outcome") for r in worker.records)
    assert said == {"admitted": 1, "queued": 1, "rejected_queue_full": 1, "unknown_pool": 1}
    m = await settle(stack)
    assert m['smg_sidecar_unknown_pool_total{class="bulk"}'] == 1
    assert m['smg_sidecar_released_total{class="bulk",reason="completed"}'] == 9
    assert m.get('smg_sidecar_completion_unmatched_total{reason="unknown"}', 0) == 0
    assert all("pool=" in k for k in m if k.startswith("smg_sidecar_shadow_"))
    m = await until(stack, lambda m: m.get(
        'smg_sidecar_shadow_inflight{class="bulk",pool="big"}') == 0
        and m.get('smg_sidecar_shadow_inflight{class="bulk",pool="default"}') == 0)


async def test_reload_and_capacity_reach_each_pools_shadow(tmp_path: Path) -> None:
    path = tmp_path / "priority.yaml"
    path.write_text(RELOAD_A)
    app = await build_runtime(parse_settings([
        "--priority-scheduler-enabled", "--priority-scheduler-config", str(path),
        "--worker-urls", "http://127.0.0.1:9", f"{BIG}=http://127.0.0.1:9",
        "--worker-capacity-override", "4", "--shadow", "--grpc-listen", "127.0.0.1:0",
        "--http-listen", "127.0.0.1:0", "--log-format", "json"]))
    await app.serve()
    try:
        assert app.pools is not None
        shadows = {n: c.core for n, c in app.pools.controllers.items()}  # type: ignore[attr-defined]
        assert all(isinstance(s, ShadowCore) and not s.legacy for s in shadows.values())

        def limits() -> dict[str, int]:
            return {n: s.shadow_snapshot().classes[PriorityClass.BULK].queue_limit
                    for n, s in shadows.items()}

        assert limits() == {DEFAULT_POOL: 5, BIG: 3}
        path.write_text(RELOAD_A.replace("queue_size: 3", "queue_size: 2"))
        assert await app.reload_now()
        assert limits() == {DEFAULT_POOL: 5, BIG: 2}  # big's shadow only
        # A pool's capacity reading resizes that pool's shadow only.
        app.pools.controllers[BIG].set_capacity(7)
        assert {n: s.shadow_snapshot().capacity for n, s in shadows.items()} == {
            DEFAULT_POOL: 4, BIG: 7}
    finally:
        await app.stop()
