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
from devtools.httpclient import Exchange
from sidecar import authz, codec
from sidecar.classes import PriorityClass
from sidecar.config import ConfigError, parse_settings
from sidecar.metrics import NullRecorder
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
from tests.grpc_client import admission_id, headers_of
from tests.test_authz import start

S, I, D, B = (PriorityClass.SYSTEM, PriorityClass.INTERACTIVE, PriorityClass.DEFAULT,
              PriorityClass.BULK)
# No reservations; queues of 2, 10 s timeouts; system and interactive preempt.
CFG = {c: ClassSettings(0, 0.0, 2, 10.0, 1000.0, c in (S, I)) for c in PriorityClass}


class Verdicts(NullRecorder):
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
    # With pools each pool has its own shadow (tests/test_shadow_pools.py).
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
                             sidecar_args=["--shadow"], log_level="debug")
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
