"""Shadow mode (--shadow): everything admitted at once, the would-be decisions recorded.

The core on a fake clock first (sidecar.shadow), then the Check over gRPC, then a
burst through a real Envoy.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections import Counter
from pathlib import Path

import pytest
from envoy.service.auth.v3 import external_auth_pb2
from envoy_data_plane.envoy.service.auth.v3 import CheckResponse as EdpCheckResponse

from devtools.fleet import wait_for
from devtools.httpclient import Exchange, request
from sidecar import authz, codec
from sidecar.app import build_runtime
from sidecar.classes import PriorityClass
from sidecar.config import DEFAULT_POOL, ConfigError, parse_settings
from sidecar.metrics import Metrics, NullPoolRecorder
from sidecar.pools import pool_of
from sidecar.ratelimit import TokenBucket
from sidecar.scheduler import (
    Admitted,
    ClassSettings,
    LegacyAdmission,
    Outcome,
    Rejected,
    Released,
    ReleaseReason,
    ReleaseResult,
    Scheduler,
)
from sidecar.shadow import ShadowCore
from tests.clock import FakeClock
from tests.conftest import StackFactory, settle, until
from tests.grpc_client import EnvoyStandIn, admission_id, check_request, headers_of
from tests.test_authz import PRIORITY as GRPC_PRIORITY
from tests.test_authz import start
from tests.test_pools import RELOAD_A

S, I, D, B = (PriorityClass.SYSTEM, PriorityClass.INTERACTIVE, PriorityClass.DEFAULT,
              PriorityClass.BULK)
# No reservations; queues of 2, 10 s timeouts; system and interactive preempt.
CFG = {c: ClassSettings(0, 0.0, 2, 10.0, 1000.0, c in (S, I)) for c in PriorityClass}


class Verdicts(NullPoolRecorder):
    def __init__(self) -> None:
        self.seen: Counter[tuple[str, str]] = Counter()

    def shadow_admit(self, cls: PriorityClass, outcome: Outcome) -> None:
        self.seen[(cls.label, outcome.value)] += 1


def make(capacity: int = 2, bucket: TokenBucket | None = None
         ) -> tuple[ShadowCore, FakeClock, Verdicts]:
    clock = FakeClock()
    rec = Verdicts()
    return ShadowCore(Scheduler(CFG, capacity, clock), clock, rec, bucket=bucket), clock, rec


def burst(core: ShadowCore, n: int, cls: PriorityClass = B) -> list[str]:
    ids = [f"r{i}" for i in range(n)]
    for aid in ids:
        assert isinstance(core.arrive(aid, cls, "t"), Admitted)  # really: always admitted
    return ids


def test_a_burst_is_admitted_and_the_would_be_answers_are_the_enforcing_ones() -> None:
    core, _, rec = make()
    ids = burst(core, 6)
    answers = [core.take_verdict(aid) for aid in ids]
    assert [a.outcome if a else None for a in answers] == [
        "admitted", "admitted", "queued", "queued", "rejected_queue_full", "rejected_queue_full"]
    assert answers[4] is not None and (answers[4].code, answers[4].status) == (
        "scheduler_queue_full", 429)
    assert answers[0] is not None and answers[0].code == "" and answers[0].status == 0
    assert core.take_verdict(ids[0]) is None  # taken once
    # Decided so far: 2 admitted and 2 refused; the queued two are not decided yet.
    assert rec.seen == {("bulk", "admitted"): 2, ("bulk", "rejected_queue_full"): 2}
    # The real side admitted all six and queues nothing: what the contract's gauges show.
    events = core.take_events()
    assert len(events) == 6 and all(isinstance(e, Admitted) for e in events)
    snap = core.snapshot()
    assert snap.inflight == 6 and snap.capacity == 2
    assert snap.classes[B].inflight == 6 and snap.classes[B].queue_depth == 0
    shadow = core.shadow_snapshot()
    assert shadow.inflight == 2 and shadow.classes[B].queue_depth == 2


def test_a_would_be_queued_request_times_out_at_its_queue_timeout() -> None:
    core, clock, rec = make(capacity=1)
    burst(core, 2)
    assert core.next_deadline() == clock.now + 10.0
    clock.advance(10.0)
    core.tick()
    assert rec.seen[("bulk", "rejected_queue_timeout")] == 1
    # Its real request ends later: nothing to give back in the shadow.
    assert core.release("r1") is ReleaseResult.RELEASED
    assert core.shadow_snapshot().inflight == 1


def test_a_would_be_queued_request_holds_its_slot_until_its_wait_after_its_real_end() -> None:
    core, clock, rec = make(capacity=1)
    burst(core, 3)  # r0 admitted, r1 and r2 queued
    clock.advance(2.0)
    core.release("r0")  # r1 would have started now, 2 s late
    assert rec.seen[("bulk", "admitted")] == 2
    clock.advance(1.0)
    core.release("r1")  # really ran 3 s; under enforcement it would end 2 s from now
    assert core.shadow_snapshot().classes[B].inflight == 1
    assert core.next_deadline() == clock.now + 2.0
    clock.advance(1.999)
    core.tick()
    assert rec.seen[("bulk", "admitted")] == 2  # r2 still waits
    clock.advance(0.001)
    core.tick()
    assert rec.seen[("bulk", "admitted")] == 3  # r1's would-be end freed the slot for r2


def test_a_request_that_ended_while_would_be_queued_runs_its_length_once_admitted() -> None:
    core, clock, rec = make(capacity=1)
    burst(core, 3)
    clock.advance(1.0)
    core.release("r1")  # ran 1 s for real while it would have waited
    clock.advance(3.0)
    core.release("r0")  # r1 would have started now, 4 s late, and run 1 s
    assert core.shadow_snapshot().classes[B].inflight == 1
    assert core.next_deadline() == clock.now + 1.0
    clock.advance(1.0)
    core.tick()
    assert rec.seen[("bulk", "admitted")] == 3  # r2 in its place


def test_shadow_preemption_picks_the_enforcing_victim_and_stops_nothing() -> None:
    core, _, rec = make(capacity=1)
    core.arrive("bulk", B, "t")
    core.mark_preemptible("bulk")  # its ext_proc stream opened, no first byte yet
    core.arrive("sys", S, "t")
    verdict = core.take_verdict("sys")
    assert verdict is not None and verdict.outcome == "admitted"
    assert rec.seen == {("bulk", "admitted"): 1, ("system", "admitted"): 1,
                        ("bulk", "preempted"): 1}
    assert core.is_admitted("bulk")  # really still running
    assert not [e for e in core.take_events() if isinstance(e, Released)]
    assert core.release("bulk") is ReleaseResult.RELEASED
    assert core.shadow_snapshot().classes[S].inflight == 1  # the system one's slot stays


def test_no_victim_past_its_first_byte() -> None:
    core, _, rec = make(capacity=1)
    core.arrive("bulk", B, "t")
    core.mark_preemptible("bulk")
    core.mark_first_byte("bulk")
    core.arrive("sys", S, "t")
    verdict = core.take_verdict("sys")
    assert verdict is not None and verdict.outcome == "queued"
    assert ("bulk", "preempted") not in rec.seen


def test_the_token_bucket_sheds_in_the_shadow_only() -> None:
    clock = FakeClock()
    rec = Verdicts()
    core = ShadowCore(Scheduler(CFG, 10, clock), clock, rec,
                      bucket=TokenBucket(1, 0.001, clock))
    burst(core, 2)
    shed = core.take_verdict("r1")
    assert shed is not None and (shed.outcome, shed.code, shed.status) == (
        "rejected_queue_full", "scheduler_queue_full", 429)
    assert rec.seen == {("bulk", "admitted"): 1, ("bulk", "rejected_queue_full"): 1}
    assert core.shadow_snapshot().inflight == 1 and core.snapshot().inflight == 2


def test_legacy_admission_in_the_shadow_answers_with_its_codes() -> None:
    clock = FakeClock()
    rec = Verdicts()
    core = ShadowCore(LegacyAdmission(limit=1, queue_size=0, queue_timeout_secs=5.0,
                                      clock=clock), clock, rec)
    assert core.legacy
    burst(core, 2)
    shed = core.take_verdict("r1")
    assert shed is not None and shed.code == "admission_queue_full"


def test_releases_balance_and_a_second_release_is_told_apart() -> None:
    core, clock, _ = make(capacity=1)
    burst(core, 3)
    for aid in ("r0", "r1", "r2"):
        clock.advance(0.5)
        assert core.release(aid, ReleaseReason.COMPLETED) is ReleaseResult.RELEASED
        clock.advance(5.0)
        core.tick()
    assert core.release("r0") is ReleaseResult.ALREADY_RELEASED
    assert core.release("nope") is ReleaseResult.UNKNOWN
    assert core.snapshot().inflight == 0
    assert core.shadow_snapshot().inflight == 0 and core.next_deadline() is None


def test_an_adopted_stream_holds_a_shadow_slot_but_is_no_decision() -> None:
    core, _, rec = make(capacity=1)
    assert core.adopt("old", B, "t")
    assert not core.adopt("old", B, "t")
    core.arrive("new", B, "t")
    verdict = core.take_verdict("new")
    assert verdict is not None and verdict.outcome == "queued"
    assert rec.seen == {}


# ------------------------------------------------------------------ against enforcement


def _enforce(trace: list[tuple[float, PriorityClass, float]], cfg: dict[PriorityClass,
             ClassSettings], capacity: int) -> Counter[tuple[str, str]]:
    """The real scheduler on the trace: a request runs its service time from its admission."""
    clock = FakeClock(0.0)
    core = Scheduler(cfg, capacity, clock)
    ends: dict[str, float] = {}
    seen: Counter[tuple[str, str]] = Counter()
    service = {f"r{i}": svc for i, (_, _, svc) in enumerate(trace)}
    pending = sorted((t, f"r{i}", cls) for i, (t, cls, _) in enumerate(trace))

    def drain() -> None:
        for e in core.take_events():
            if isinstance(e, Admitted):
                seen[(e.admission.cls.label, "admitted")] += 1
                ends[e.admission.id] = clock.now + service[e.admission.id]
            elif isinstance(e, Rejected):
                seen[(e.cls.label, e.outcome.value)] += 1

    while pending or ends or core.next_deadline() is not None:
        due = [x for x in (pending[0][0] if pending else None,
                           min(ends.values()) if ends else None, core.next_deadline())
               if x is not None]
        clock.now = max(clock.now, min(due))
        for aid in [a for a, t in ends.items() if t <= clock.now]:
            del ends[aid]
            core.release(aid)
        core.tick()
        while pending and pending[0][0] <= clock.now:
            _, aid, cls = pending.pop(0)
            core.arrive(aid, cls, "t")
        drain()
    return seen


def _shadow(trace: list[tuple[float, PriorityClass, float]], cfg: dict[PriorityClass,
            ClassSettings], capacity: int) -> Counter[tuple[str, str]]:
    """Shadow mode on the same trace: everything runs its service time from its arrival."""
    clock = FakeClock(0.0)
    rec = Verdicts()
    core = ShadowCore(Scheduler(cfg, capacity, clock), clock, rec)
    ends = {f"r{i}": t + svc for i, (t, _, svc) in enumerate(trace)}
    pending = sorted((t, f"r{i}", cls) for i, (t, cls, _) in enumerate(trace))
    while pending or ends or core.next_deadline() is not None:
        due = [x for x in (pending[0][0] if pending else None,
                           min(ends.values()) if ends else None, core.next_deadline())
               if x is not None]
        clock.now = max(clock.now, min(due))
        for aid in [a for a, t in ends.items() if t <= clock.now]:
            del ends[aid]
            core.release(aid)
        core.tick()
        while pending and pending[0][0] <= clock.now:
            _, aid, cls = pending.pop(0)
            core.arrive(aid, cls, "t")
    assert core.snapshot().inflight == 0 and core.shadow_snapshot().inflight == 0
    return rec.seen


@pytest.mark.parametrize("seed", range(20))
def test_with_the_same_service_times_the_shadow_counts_what_enforcement_does(seed: int) -> None:
    # The design claim: a would-be queued request holds its shadow slot for its real
    # service time, shifted by its would-be wait, so with service times that do not depend
    # on the load the shadow's decisions are enforcement's (no preemption: that needs
    # ext_proc's first-byte signal, which a trace does not have).
    rnd = random.Random(seed)
    cfg = {c: ClassSettings(rnd.randint(0, 1), 0.0, rnd.randint(0, 3), rnd.uniform(0.5, 3.0),
                            rnd.uniform(0.5, 5.0), False) for c in PriorityClass}
    capacity = rnd.randint(2, 4)
    t = 0.0
    trace = []
    for _ in range(60):
        t += rnd.expovariate(4.0)
        trace.append((t, rnd.choice(list(PriorityClass)), rnd.uniform(0.05, 2.0)))
    enforced = _enforce(trace, cfg, capacity)
    assert sum(enforced.values()) == len(trace)
    assert {o for _, o in enforced} - {"admitted"}  # the trace does overload
    assert _shadow(trace, cfg, capacity) == enforced


# ------------------------------------------------------------------ flags


def test_shadow_flag_and_its_refusals() -> None:
    assert parse_settings(["--shadow"]).shadow
    assert not parse_settings([]).shadow
    with pytest.raises(ConfigError, match="--shadow"):
        parse_settings(["--shadow", "--priority-scheduler-enabled",
                        "--coordination-url", "redis://127.0.0.1:1"])
    with pytest.raises(ConfigError, match="--shadow"):
        parse_settings(["--shadow", "--edge-shed"])
    # With pools each pool has its own shadow (below).
    s = parse_settings(["--shadow", "--worker-urls", "http://w0", "big=http://w1"])
    assert s.shadow and s.pool_workers == {"big": ("http://w1",)}


# ------------------------------------------------------------------ codec


def test_the_shadow_suffix_merges_into_the_allow() -> None:
    allow = codec.encode_allow("a" * 32, "bulk", "t", False) + codec.shadow_suffix(
        "rejected_queue_full", "scheduler_queue_full")
    resp = external_auth_pb2.CheckResponse.FromString(allow)
    md = resp.dynamic_metadata.fields
    assert md["admission_id"].string_value == "a" * 32
    assert md["preemptible"].bool_value is False
    assert md["shadow_outcome"].string_value == "rejected_queue_full"
    assert md["shadow_code"].string_value == "scheduler_queue_full"
    assert headers_of(resp.ok_response.headers) == {
        "x-smg-admission-id": "a" * 32, "x-smg-effective-class": "bulk",
        "x-smg-shadow-outcome": "rejected_queue_full"}
    edp = EdpCheckResponse.FromString(allow)  # the reference decoder agrees
    assert edp.dynamic_metadata.fields["shadow_outcome"].string_value == "rejected_queue_full"
    plain = external_auth_pb2.CheckResponse.FromString(
        codec.encode_allow("a" * 32, "bulk", "t") + codec.shadow_suffix("admitted"))
    assert "shadow_code" not in plain.dynamic_metadata.fields


# ------------------------------------------------------------------ over gRPC


async def test_over_grpc_every_check_is_allowed_with_the_would_be_answer(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Even the open-Check bound sheds nothing in shadow mode.
    monkeypatch.setattr(authz, "MAX_OPEN_CHECKS", 0)
    h = await start(tmp_path, "--shadow")  # capacity 1, bulk queue 2, timeout 0.3 s
    try:
        resps = [await asyncio.wait_for(h.envoy.check({"x-smg-priority": "bulk"}), 2)
                 for _ in range(4)]
        assert all(r.status.code == 0 for r in resps)
        outcomes = [r.dynamic_metadata.fields["shadow_outcome"].string_value for r in resps]
        assert outcomes == ["admitted", "queued", "queued", "rejected_queue_full"]
        assert resps[3].dynamic_metadata.fields["shadow_code"].string_value == (
            "scheduler_queue_full")
        assert h.sample("smg_scheduler_admit_total", **{"class": "bulk",
                                                        "outcome": "admitted"}) == 4
        assert h.sample("smg_scheduler_admit_total", **{
            "class": "bulk", "outcome": "rejected_queue_full"}) == 0
        assert h.sample("smg_sidecar_overload_shed_total", **{"class": "bulk"}) == 0
        await asyncio.sleep(0.5)  # the two would-be queued ones time out (0.3 s)
        assert h.sample("smg_sidecar_shadow_admit_total", **{
            "class": "bulk", "outcome": "rejected_queue_timeout"}) == 2
        assert h.sample("smg_sidecar_shadow_admit_total", **{
            "class": "bulk", "outcome": "admitted"}) == 1
        for r in resps:
            await h.envoy.log((admission_id(r), "end"))
        assert h.inflight == 0
    finally:
        await h.envoy.close()
        await h.app.stop()


async def test_the_rate_check_sheds_nothing_in_shadow_mode(tmp_path: Path) -> None:
    h = await start(tmp_path, "--shadow", "--max-concurrent-requests", "1",
                    "--rate-limit-tokens-per-second", "0.001")  # one token, never refilled
    try:
        first = await h.envoy.check({"x-smg-priority": "bulk"})
        second = await h.envoy.check({"x-smg-priority": "bulk"})
        assert first.status.code == 0 and second.status.code == 0
        md = second.dynamic_metadata.fields
        assert md["shadow_outcome"].string_value == "rejected_queue_full"
        assert md["shadow_code"].string_value == "scheduler_queue_full"
        assert h.sample("smg_http_rate_limit_total", result="rejected") == 0
        for r in (first, second):
            await h.envoy.log((admission_id(r), "end"))
        assert h.inflight == 0
    finally:
        await h.envoy.close()
        await h.app.stop()


# ------------------------------------------------------------------ through Envoy

E2E_PRIORITY = """
classes:
  system: {reserved_floor: 0}
  interactive: {reserved_floor: 0, reserved_per_slot: 0.0}
  default: {reserved_per_slot: 0.0}
  bulk: {queue_size: 2, queue_timeout_secs: 5}
"""


@pytest.mark.e2e
async def test_e2e_a_burst_gets_200_and_the_shadow_counts_what_enforcement_would_have(
        make_stack: StackFactory) -> None:
    stack = await make_stack(priority_yaml=E2E_PRIORITY, workers=1, max_running_requests=2,
                             sidecar_args=["--shadow"], log_level="debug",
                             edge_shed=False)  # the sidecar refuses --shadow with --edge-shed
    worker = stack.fleet.workers[0]
    held = [await Exchange.send(stack.listen_port, headers={"x-smg-priority": "bulk",
                                                            "x-fake-gate": "burst"})
            for _ in range(6)]
    try:
        # All six reach the worker at once: nothing queued, nothing refused.
        await wait_for(lambda: worker.running == 6, 10)
        m = await until(stack, lambda m: m.get(
            'smg_sidecar_shadow_admit_total{class="bulk",outcome="rejected_queue_full"}') == 2)
        assert m['smg_sidecar_shadow_admit_total{class="bulk",outcome="admitted"}'] == 2
        assert m['smg_scheduler_admit_total{class="bulk",outcome="admitted"}'] == 6
        assert m.get('smg_scheduler_admit_total{class="bulk",outcome="rejected_queue_full"}',
                     0) == 0
        assert m['smg_scheduler_inflight{class="bulk"}'] == 6
        assert m['smg_scheduler_queue_depth{class="bulk"}'] == 0
        # The shadow's own state: two would hold a slot, two would wait.
        assert m['smg_sidecar_shadow_inflight{class="bulk"}'] == 2
        assert m['smg_sidecar_shadow_queue_depth{class="bulk"}'] == 2
        stack.fleet.gates.open("burst")
        for ex in held:
            await asyncio.wait_for(ex.read_head(), 10)
            assert ex.status == 200
            await asyncio.wait_for(ex.read_body(), 10)
    finally:
        for ex in held:
            await ex.close()
    # The allow's answer reached the worker with each request...
    said = Counter(r.headers.get("x-smg-shadow-outcome") for r in worker.records)
    assert said == {"admitted": 2, "queued": 2, "rejected_queue_full": 2}
    # ...and Envoy's access log carried it back from the allow's metadata.
    m = await settle(stack)
    # The would-be queued two start as the would-be admitted ones end.
    m = await until(stack, lambda m: m.get(
        'smg_sidecar_shadow_admit_total{class="bulk",outcome="admitted"}') == 4)
    assert m.get('smg_sidecar_shadow_admit_total{class="bulk",outcome="rejected_queue_timeout"}',
                 0) == 0
    assert m['smg_sidecar_released_total{class="bulk",reason="completed"}'] == 6
    m = await until(stack, lambda m: m.get('smg_sidecar_shadow_inflight{class="bulk"}') == 0)
    assert m['smg_sidecar_shadow_queue_depth{class="bulk"}'] == 0

    def logged() -> Counter[str]:
        lines = stack.sidecar_log.read_text().splitlines()
        events = [json.loads(ln) for ln in lines if ln.startswith("{")]
        return Counter(e["shadow_outcome"] for e in events
                       if e.get("event") == "shadow_completed")

    await wait_for(lambda: sum(logged().values()) == 6, 5)
    assert logged() == {"admitted": 2, "queued": 2, "rejected_queue_full": 2}


# ============================================================================
# Shadow mode with model pools: each pool's shadow beside its own core and capacity.
# The replay of tests/test_shadow.py per pool (a pool's would-be decisions are what that
# pool's enforcing core makes on its own trace, whatever the other pool's traffic), the
# Check over gRPC, then two pools through a real Envoy.


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
                           metrics.pool(p)) for p in traces}
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
        assert sum(p.controller.snapshot().inflight for p in app.pools) == 5

        await asyncio.sleep(0.5)  # big's two would-be queued ones time out (0.3 s)
        assert sample("smg_sidecar_shadow_admit_total", pool=BIG, **{
            "class": "bulk", "outcome": "rejected_queue_timeout"}) == 2
        await envoy.log(*((admission_id(r), "end") for r in [*big, default]))
        assert sum(p.controller.snapshot().inflight for p in app.pools) == 0
        assert sample("smg_sidecar_shadow_inflight", pool=BIG, **{"class": "bulk"}) == 0
        assert sample("smg_sidecar_completion_unmatched_total", reason="unknown") == 0
    finally:
        await envoy.close()
        await app.stop()


E2E_POOLS_PRIORITY = """
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
    stack = await make_stack(priority_yaml=E2E_POOLS_PRIORITY, workers=1, max_running_requests=1,
                             pools={BIG: (1, 2)}, envoy_extra_pools=("ghost",),
                             sidecar_args=["--shadow"], edge_shed=False)
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
        shadows = {p.name: p.shadow for p in app.pools}
        assert all(isinstance(s, ShadowCore) and not s.legacy for s in shadows.values())

        def limits() -> dict[str, int]:
            return {n: s.shadow_snapshot().classes[PriorityClass.BULK].queue_limit
                    for n, s in shadows.items() if s is not None}

        assert limits() == {DEFAULT_POOL: 5, BIG: 3}
        path.write_text(RELOAD_A.replace("queue_size: 3", "queue_size: 2"))
        assert await app.reload_now()
        assert limits() == {DEFAULT_POOL: 5, BIG: 2}  # big's shadow only
        # A pool's capacity reading resizes that pool's shadow only.
        app.pools[BIG].controller.set_capacity(7)
        assert {n: s.shadow_snapshot().capacity for n, s in shadows.items() if s} == {
            DEFAULT_POOL: 4, BIG: 7}
    finally:
        await app.stop()
