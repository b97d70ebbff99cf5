"""The deterministic fleet simulation (tests/fleet_dsim.py): the shipped FleetController
on a virtual clock, one seed, one trace; safety and liveness after every step.

CI profile: ``CI_SEEDS`` seeds of ``CI_STEPS`` steps each, at least 100,000 steps in all,
steps, rate and wall time printed. ``SIM_SEED`` runs one seed and ``SIM_STEPS`` sizes it;
``SIM_SEEDS`` (a count) makes the long profile (``make sim-long``), one test per seed;
``SIM_VARY=1`` lets each seed draw the fleet too (2 to 4 replicas, capacity 4 to 9).
A finding already reported (``KNOWN_FINDINGS``) is counted and the run goes on, unless
``SIM_STRICT=1``; each has a strict-xfail regression test here.
A failure names its seed; ``SIM_TRACE_DIR=DIR`` writes the whole trace of the failing run
(``DIR/dsim-SEED.trace``), the same on every run of that seed.

Besides the random runs: the harness is shown to have teeth (the core and the controller
broken on purpose, a controller that refuses everything: each run must fail), scripted
cases on the same harness (what the real-time simulation found: an outage right after the
fleet grew, the shares as replicas join, a partition past the share; a carried-over
candidate preempted locally; a resync given up on that runs after a newer one; a process
back during the drain; a reload whose registration was lost), and two cases it found as
plain tests on a real server.
"""

from __future__ import annotations

import asyncio
import gc
import os
import subprocess
import sys
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as redis

from devtools.valkey import ValkeyServer
from sidecar.admission import Denied
from sidecar.classes import PriorityClass
from sidecar.coordination.controller import FleetController
from sidecar.coordination.ledger import FleetLedger, encode_class
from sidecar.coordination.outbox import Outbox, Release
from sidecar.coordination.replica import Effect, IllegalTransition, Mode, Replica, Stop
from sidecar.scheduler import Outcome, ReleaseResult
from sidecar.tokens import Budget, OverBudget
from tests import fleet_dsim
from tests.fleet_dsim import (
    BULK,
    DEF,
    DSIM_FAULTS,
    FLEET,
    SYS,
    TOKEN_FAULTS,
    CountingRecorder,
    DSim,
    DSimConfig,
    DStream,
    Req,
    SimViolation,
    classes,
    simulate,
    stats_line,
)
from tests.ledger_faults import copy_keyspace, restore_keyspace

# (seed, vary): two runs of the 3-replica, capacity-6 fleet, two whose seed also draws
# the fleet (2 to 4 replicas, capacity 4 to 9). 20261204 is also a regression: at step
# ~24,600 a server pause outlasts r0's registration and, on resume, a recovery resync r0
# had given up on runs after its newer one (7 of 6 before ledger.lua's stale_resync()).
CI_SEEDS = [(20261204, False), (1, False), (2, True), (3, True)]
CI_STEPS = 27_000  # per seed: 108,000 in all
STEPS = int(os.environ.get("SIM_STEPS", "200000"))
LONG = bool(os.environ.get("SIM_SEED") or os.environ.get("SIM_SEEDS"))

Script = Callable[[DSim], Coroutine[Any, Any, None]]


def _seeds() -> list[int]:
    if os.environ.get("SIM_SEED"):
        return [int(os.environ["SIM_SEED"])]
    count = os.environ.get("SIM_SEEDS")
    return [1000 + i for i in range(int(count))] if count else []


# ------------------------------------------------------------------------ random runs


@pytest.mark.skipif(LONG, reason="SIM_SEED / SIM_SEEDS: the long profile runs instead")
def test_the_fleet_keeps_its_promises_under_faults_for_100k_steps(tmp_path: Path) -> None:
    t0 = time.monotonic()
    total = 0
    drawn: set[str] = set()
    checked = 0
    for i, (seed, vary) in enumerate(CI_SEEDS):
        t = time.monotonic()
        # Each seed starts its fault rotation elsewhere: together they draw every kind.
        offset = i * len(DSIM_FAULTS) // len(CI_SEEDS)
        sim = simulate(DSimConfig(seed=seed, steps=CI_STEPS, vary=vary, fault_offset=offset),
                       tmp_path / str(seed))
        print(stats_line(sim, time.monotonic() - t))
        assert sim.stats["admitted"] > 0
        total += sim.stats["steps"]
        drawn |= {k[6:] for k in sim.stats if k.startswith("fault_")}
        checked += sim.stats["instants_fleet_idle_checked"]
    secs = time.monotonic() - t0
    print(f"deterministic fleet simulation, CI profile: {total:,} steps ({len(CI_SEEDS)} "
          f"seeds) in {secs:.1f} s ({total / secs:,.0f} steps/s)")
    assert total >= 100_000
    assert drawn == set(DSIM_FAULTS), f"never drawn: {set(DSIM_FAULTS) - drawn}"
    assert checked > 1000, "the fleet-wide idle check hardly ever ran"


@pytest.mark.parametrize("seed", _seeds())
def test_the_fleet_keeps_its_promises_under_faults(tmp_path: Path, seed: int) -> None:
    # The long profile (make sim-long), or one seed (SIM_SEED) to reproduce a case.
    t = time.monotonic()
    sim = simulate(DSimConfig(seed=seed, steps=STEPS, vary=bool(os.environ.get("SIM_VARY")),
                              strict=os.environ.get("SIM_STRICT") == "1"), tmp_path)
    print(stats_line(sim, time.monotonic() - t))


# ------------------------------------------------------------------------ token budgets

# Every request reserves its tokens in the ledger before its admission, through the same
# simulated connections (every fault, lost reply and reorder), settles or cancels them in
# the background, as sidecar.pools does; t0's budget is spent early, t1's near the end.
TOKEN_SEEDS = [20261204, 1]
TOKEN_STEPS = 27_000


def _token_run(tmp_path: Path, seed: int, steps: int, **kw: Any) -> DSim:
    t = time.monotonic()
    sim = simulate(DSimConfig(seed=seed, steps=steps, tokens=True, faults=TOKEN_FAULTS, **kw),
                   tmp_path / f"tok{seed}")
    tok = {k: v for k, v in sorted(sim.stats.items()) if k.startswith("tok_")}
    print(stats_line(sim, time.monotonic() - t), tok)
    print("  served under reservations / budget: " + ", ".join(
        f"{t} {sim.tok_served[t]}/{sim.tok_amount(t)} (error {sim.tok_over[t]})"
        for t in ("t0", "t1", "t2")))
    return sim


@pytest.mark.skipif(LONG, reason="SIM_SEED / SIM_SEEDS: the long profile runs instead")
def test_token_budgets_keep_their_promises_under_faults(tmp_path: Path) -> None:
    # Safety, counted by the harness at every stream's end: a tenant's tokens served under
    # reservations stay within its budget plus the estimates' error. Liveness: every
    # refusal is held to what the ledger may count at most (a tenant under its budget is
    # admitted). After the drain: no reservation left, the use the settled requests'
    # (plus the estimates of those charged with a gone replica).
    drawn: set[str] = set()
    for seed in TOKEN_SEEDS:
        sim = _token_run(tmp_path, seed, TOKEN_STEPS)
        assert sim.stats["tok_reserved"] > 100 and sim.stats["tok_refused"] > 10
        assert sim.tok_served["t0"] > sim.tok_amount("t0") // 2, "t0 never neared its budget"
        drawn |= {k[6:] for k in sim.stats if k.startswith("fault_")}
    assert drawn == set(TOKEN_FAULTS), f"never drawn: {set(TOKEN_FAULTS) - drawn}"


@pytest.mark.parametrize("seed", _seeds())
def test_token_budgets_keep_their_promises_under_faults_long(tmp_path: Path, seed: int) -> None:
    _token_run(tmp_path, seed, STEPS)


def _broken_lua(monkeypatch: pytest.MonkeyPatch, old: str, new: str) -> None:
    import sidecar.coordination.ledger as ledger

    assert ledger.TEST_LUA.count(old) == 1, old
    monkeypatch.setattr(ledger, "TEST_LUA", ledger.TEST_LUA.replace(old, new))
    monkeypatch.setattr(fleet_dsim, "TEST_LUA", ledger.TEST_LUA)


def test_the_simulation_catches_a_ledger_that_forgets_running_reservations(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # ledger.lua checking settled use only (charging after completion): concurrent
    # requests of t0 overshoot its budget.
    _broken_lua(monkeypatch, "local reserved = reserve and (tonumber(redis.call('HGET', "
                "k_tok(t), 'r')) or 0) or 0", "local reserved = 0")
    with pytest.raises(SimViolation, match="past its budget"):
        _token_run(tmp_path, TOKEN_SEEDS[0], TOKEN_STEPS)


def test_the_simulation_catches_a_ledger_that_leaks_a_settled_reservation(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # tok_settle charging the use but leaving (part of) the reservation held: the tenant
    # is refused before its budget is spent, or the drain finds tokens still reserved.
    _broken_lua(monkeypatch, "  local rec = tok_take(a[1])\n  if rec == nil then return "
                "'unknown' end\n  tok_charge(", "  local rec = tok_take(a[1])\n  if rec == "
                "nil then return 'unknown' end\n  redis.call('HINCRBY', k_tok(rec.tenant), "
                "'r', 1)\n  tok_charge(")
    with pytest.raises(SimViolation,
                       match=r"under its budget is refused|still reserved after the drain"):
        _token_run(tmp_path, TOKEN_SEEDS[0], 5_000)


def test_the_simulation_catches_a_ledger_that_refuses_every_budgeted_request(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Every budget's safety holds for a ledger that refuses everything; its liveness twin
    # does not.
    async def refuse(self: FleetLedger, id: str, tenant: str, tokens: int,
                     budgets: Sequence[Budget], **kw: Any) -> OverBudget:
        return OverBudget("day", 1.0, budgets[0].tokens, 0, 0)

    monkeypatch.setattr(FleetLedger, "tok_reserve", refuse)
    with pytest.raises(SimViolation, match="under its budget is refused"):
        _token_run(tmp_path, TOKEN_SEEDS[0], 5_000)
    # Without the liveness checks, the same run passes: they are what catches it.
    _token_run(tmp_path / "safety", TOKEN_SEEDS[0], 5_000, liveness=False)


def test_one_seed_gives_one_trace(tmp_path: Path) -> None:
    # The point of the harness: the same seed, the same trace, event for event (every
    # call, reply, notification, answer, metric and log line is in the digest), also in
    # another interpreter with another string-hash seed.
    seed = int(os.environ.get("SIM_SEED", "20261204"))
    steps = min(STEPS, 8000)
    a = simulate(DSimConfig(seed=seed, steps=steps), tmp_path / "a")
    b = simulate(DSimConfig(seed=seed, steps=steps), tmp_path / "b")
    assert a.digest.hexdigest() == b.digest.hexdigest(), f"seed {seed}: two traces"
    child = subprocess.run(
        [sys.executable, "-m", "tests.fleet_dsim", str(seed), str(steps)],
        cwd=Path(__file__).resolve().parent.parent, capture_output=True, text=True,
        timeout=300, env={**os.environ, "PYTHONHASHSEED": "12345"}, check=False)
    assert child.returncode == 0, child.stdout + child.stderr
    assert f"digest {a.digest.hexdigest()[:16]}" in child.stdout, child.stdout
    other = simulate(DSimConfig(seed=seed + 1, steps=steps), tmp_path / "c")
    assert other.digest.hexdigest() != a.digest.hexdigest()


def test_without_faults_nothing_runs_past_capacity_and_no_slot_idles(tmp_path: Path) -> None:
    # No fault, no slow or lost reply: no window ever opens, so every step checks
    # Σ running ≤ capacity exactly (plus a preemption's victim until its stop arrives:
    # the steps over capacity here), and every instant that no slot idles while a
    # request waits.
    sim = simulate(DSimConfig(seed=7, steps=20_000, faults=(), drop_reply=0.0,
                              slow_call=0.0), tmp_path)
    print(stats_line(sim, sim.stats["wall_ms"] / 1000))
    assert sim.stats["windows"] == 0
    assert sim.stats["admitted"] > 200
    assert sim.stats["instants_fleet_idle_checked"] > 5000


# ------------------------------------------------------------------ the checker itself


def test_the_checker_catches_a_fleet_past_capacity(tmp_path: Path) -> None:
    sim = DSim(DSimConfig(seed=1, steps=0), tmp_path)
    try:
        for i in range(sim.cfg.capacity + 1):
            sim.running[f"x{i}"] = DStream(f"x{i}", "r0", DEF, "t0", 0.0)
        sim.check()
        assert sim.failure is not None and "SIM_SEED=1" in str(sim.failure)
        assert "7 running > 6 allowed" in str(sim.failure)
    finally:
        sim.close()


def test_the_checker_catches_a_waiter_past_its_queue_timeout(tmp_path: Path) -> None:
    async def waits(sim: DSim) -> None:
        proc = await sim.process_up("r0")
        qt = classes()[DEF].queue_timeout_secs
        sim.reqs[99] = Req(99, proc, DEF, "t0", sim.now - qt - sim.cfg.call_timeout)
        sim.check()  # at the bound: still allowed
        assert sim.failure is None
        sim.reqs[99].arrived -= 0.001
        sim.check()
        assert sim.failure is not None and "still waits" in str(sim.failure)
        sim.reqs.pop(99)

    with pytest.raises(SimViolation, match="still waits"):
        simulate(_cfg(replicas=1), tmp_path, waits)


async def answer_on_its_way(sim: DSim) -> None:
    """r0 runs its share (2 of 6); then the ledger admits a third for it whose answer has
    not reached it: the outage bound's allowance before and after."""
    for s in sim.slots:
        await sim.process_up(s.name)
    await sim.until(lambda: all(c is not None and c.share == 2
                                for c in map(sim.ctrl, ("r0", "r1", "r2"))), 3.0, "shares 2")
    await _admit(sim, "r0", DEF, 2)
    before = sim.outage_allowance()
    r0 = sim.ctrl("r0")
    assert r0 is not None
    await r0.ledger.arrive("r0-answer-on-its-way", DEF, "t0")  # as a grant read later
    sim.result = (before, sim.outage_allowance())
    await r0.ledger.release("r0-answer-on-its-way")
    await _end_all(sim)


def test_the_outage_bound_counts_an_admission_whose_answer_is_on_its_way(
        tmp_path: Path) -> None:
    # Found by the long profile (seed 1011, 500,000 steps): a grant the ledger decided just
    # before a restart from a snapshot reached its replica just after, which then held one
    # past its share: within the reference's bound (what the replicas held beyond their
    # shares), but the harness counted only what the clients had been told runs, and
    # reported 7 running of 6 allowed.
    sim = simulate(_cfg(), tmp_path, answer_on_its_way)
    assert sim.result == (0, 1)


def _first_violation(tmp_path: Path, seeds: range, steps: int, **kw: Any) -> str | None:
    for seed in seeds:
        try:
            simulate(DSimConfig(seed=seed, steps=steps, **kw), tmp_path / str(seed))
        except SimViolation as exc:
            return str(exc)
    return None


# The core broken on purpose (sidecar/coordination/replica.py): each run must fail.


def test_the_simulation_catches_a_share_one_slot_too_large(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    limit = Replica.degraded_limit
    monkeypatch.setattr(Replica, "degraded_limit", lambda self, own: limit(self, own) + 1)
    found = _first_violation(tmp_path, range(1, 7), 20_000)
    assert found is not None and "allowed" in found, found


def test_the_simulation_catches_a_victim_that_is_never_stopped(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    preempted = Replica.preempted

    def without_stop(self: Replica, aid: str, by: PriorityClass) -> list[Effect]:
        return [fx for fx in preempted(self, aid, by) if not isinstance(fx, Stop)]

    monkeypatch.setattr(Replica, "preempted", without_stop)
    found = _first_violation(tmp_path, range(1, 7), 20_000)
    assert found is not None and ("allowed" in found or "uncounted" in found), found


def test_the_simulation_catches_a_share_taken_before_the_others_count_the_replica(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The rule behind the outage bound (the remaining window): a replica takes no share
    # while another may not count it. Without it the shares sum past capacity as the
    # fleet starts (6 + 3 + 0: the fleet simulation's first finding).
    monkeypatch.setattr(Replica, "_note", lambda self, status: setattr(self, "_heard", True))
    found = _first_violation(tmp_path, range(1, 3), 5_000)
    assert found is not None and "sum past capacity" in found, found


# The controller broken on purpose (sidecar/coordination/controller.py): each run must
# fail. The simulation runs the shipped driver, so a bug in it is a bug the run sees.


def test_the_simulation_catches_a_controller_that_refuses_everything(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Every safety property holds for a replica that admits nothing; the liveness
    # properties do not.
    async def refuse(self: FleetController, cls: PriorityClass, tenant: str) -> Any:
        raise Denied(Outcome.REJECTED_QUEUE_FULL, legacy=False)

    monkeypatch.setattr(FleetController, "admit", refuse)
    found = _first_violation(tmp_path, range(1, 2), 5_000)
    assert found is not None and "429 on its own" in found, found
    # Without the liveness checks, the same run passes: they are what catches it.
    assert _first_violation(tmp_path / "safety", range(1, 2), 5_000, liveness=False) is None


def test_the_simulation_catches_a_controller_that_queues_everything_locally(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Away from the ledger, a local core of capacity 0 instead of the degraded limit:
    # the fleet stays within capacity, and requests the share allows wait.
    monkeypatch.setattr(FleetController, "_local_limit", lambda self: 0)
    monkeypatch.setattr(FleetController, "degraded_limit", property(lambda self: 0))
    found = _first_violation(tmp_path, range(1, 7), 20_000)
    assert found is not None and "documented limit" in found, found


def test_the_simulation_catches_a_controller_that_goes_local_one_slot_too_large(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    limit = FleetController._local_limit
    shown = FleetController.degraded_limit.fget
    assert shown is not None
    monkeypatch.setattr(FleetController, "_local_limit", lambda self: limit(self) + 1)
    monkeypatch.setattr(FleetController, "degraded_limit",
                        property(lambda self: shown(self) + 1))
    found = _first_violation(tmp_path, range(1, 7), 20_000)
    assert found is not None and "allowed" in found, found


def test_the_simulation_catches_a_controller_that_drops_a_release(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The outbox loses the releases: the ledger counts slots nobody uses (until the next
    # heartbeat's resync), and requests wait beside them.
    push = Outbox.push

    def lossy(self: Outbox, op: Any) -> None:
        if not isinstance(op, Release):
            push(self, op)

    monkeypatch.setattr(Outbox, "push", lossy)
    found = _first_violation(tmp_path, range(1, 4), 20_000)
    assert found is not None and "idles" in found, found


def test_the_simulation_catches_a_controller_that_forgets_a_local_stop_channel(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Going local, the driver no longer chains the stop channels of what it carries over:
    # the local core has no candidate, and a system request waits instead of preempting.
    sim = simulate(_cfg(), tmp_path / "shipped", carried_candidate_preempted_locally)
    assert sim.result == "admitted"
    monkeypatch.setattr(FleetController, "_chain_stop_signal", lambda self, local, aid: None)
    with pytest.raises(SimViolation, match="may preempt"):
        simulate(_cfg(), tmp_path / "broken", carried_candidate_preempted_locally)


# ------------------------------------------------------------------------ scripted cases


def _cfg(**kw: Any) -> DSimConfig:
    """A scripted case: no random workload or faults, streams that run until ended."""
    base: dict[str, Any] = {"seed": 0, "steps": 10**9, "faults": (), "drop_reply": 0.0,
                            "slow_call": 0.0, "stream_life": 1000.0}
    return DSimConfig(**{**base, **kw})


async def _admit(sim: DSim, name: str, cls: PriorityClass, n: int) -> list[str]:
    proc = sim.slot(name).proc
    assert proc is not None
    out = []
    for _ in range(n):
        r = sim.request(proc, cls, "t0")
        assert await sim.answered(r, 1.0) == "admitted", r.outcome
        out.append(r.aid)
    return out


async def _end_all(sim: DSim) -> None:
    for aid in list(sim.running):
        st = sim.running.pop(aid)
        proc = sim.slot(st.replica).proc
        assert proc is not None and proc.ctrl is not None
        sim.ended_at[aid] = sim.now
        proc.ctrl.release(aid)


async def carried_candidate_preempted_locally(sim: DSim) -> None:
    """r0 holds its whole limit in bulk streams whose stop channels are open when the
    server hangs; a system request then arrives at r0: it preempts one of them locally."""
    for s in sim.slots:
        await sim.process_up(s.name)
    await sim.until(lambda: all(c.share == 2 for c in map(sim.ctrl, ("r0", "r1", "r2"))
                                if c is not None), 3.0, "every share 2")
    for aid in await _admit(sim, "r0", BULK, 2):
        sim.open_channel_of(sim.stream(aid))
    await asyncio.sleep(0.05)  # the candidate marks reach the ledger
    w = sim.pause_server()
    r0 = sim.slot("r0").proc
    assert r0 is not None and r0.ctrl is not None
    await sim.until(lambda: r0.ctrl is not None and r0.ctrl.state == "degraded", 2.0,
                    "r0 degraded")
    r = sim.request(r0, SYS, "t0")
    sim.result = await sim.answered(r, 2 * sim.cfg.call_timeout)
    sim.resume_server(w)
    await _end_all(sim)


async def outage_after_growth(sim: DSim) -> None:
    """Three replicas start one after the other and the server hangs before the first
    one's next heartbeat: how many each admits on its own, in total."""
    for s in sim.slots:
        await sim.process_up(s.name)
    w = sim.pause_server()
    admitted = 0
    for s in sim.slots:
        proc = s.proc
        assert proc is not None
        for _ in range(sim.cfg.capacity):
            r = sim.request(proc, DEF, "t0")
            if await sim.answered(r, 0.05 + 2 * sim.cfg.call_timeout) != "admitted":
                break
            admitted += 1
    sim.result = admitted
    sim.resume_server(w)
    await _end_all(sim)


async def shares_after_growth(sim: DSim) -> None:
    """Three replicas start one after the other: each one's degraded share as it starts,
    and the seconds until every share is floor(C ÷ 3)."""
    first = []
    for s in sim.slots:
        proc = await sim.process_up(s.name)
        assert proc.ctrl is not None
        first.append(proc.ctrl.share)
    t0 = sim.now
    want = sim.cfg.capacity // sim.cfg.replicas
    await sim.until(lambda: all(c is not None and c.share == want
                                for c in map(sim.ctrl, ("r0", "r1", "r2"))),
                    5 * sim.cfg.ttl, "every share floor(C / 3)")
    sim.result = {"first": first, "secs": sim.now - t0}


async def partition_past_share(sim: DSim) -> None:
    """r0 legally holds 4 of 6 (its share is 2) when only its path to the server is cut;
    its registration lapses and r1 takes the slots the ledger freed while r0's streams
    run on: how many run at once."""
    for s in sim.slots:
        await sim.process_up(s.name)
    await sim.until(lambda: all(c is not None and c.live_replicas == 3
                                for c in map(sim.ctrl, ("r0", "r1", "r2"))),
                    3.0, "every view N = 3")
    await _admit(sim, "r0", DEF, 4)
    w = sim.partition("r0")
    await asyncio.sleep(1.5 * sim.cfg.ttl)  # its registration lapses (0.9 ttl)
    r1 = sim.slot("r1").proc
    assert r1 is not None
    for _ in range(sim.cfg.capacity):
        r = sim.request(r1, DEF, "t0")
        if await sim.answered(r, 0.5) != "admitted":
            break
    sim.result = len(sim.running)
    await _end_all(sim)
    sim.heal_partition("r0", w)


def test_an_outage_right_after_the_fleet_grew_stays_within_the_stated_bound(
        tmp_path: Path) -> None:
    # Found by the real-time simulation (seeds 2, 120): r0 registers alone (N = 1 in its
    # view), r1 and r2 join; the server hangs before r0's next heartbeat. No admission
    # was made after any view (a = 0) and nobody holds anything (b = 0): the bound is C.
    # Each replica took floor(C / N) from its own view: 6 + 3 + 2 = 11 of 6. Now r1 and
    # r2 take no share until r0 has read a reply that counts them.
    sim = simulate(_cfg(), tmp_path, outage_after_growth)
    print(f"admitted {sim.result} of capacity {sim.cfg.capacity} during the outage")
    assert sim.result <= sim.cfg.capacity


def test_a_replica_that_joined_takes_its_share_once_the_others_count_it(
        tmp_path: Path) -> None:
    # The other side of that fix: the newcomers' shares come back within a heartbeat
    # interval or two (the earlier replicas' next heartbeat, then the newcomer's own).
    sim = simulate(_cfg(), tmp_path, shares_after_growth)
    out = sim.result
    print(f"shares as they start {out['first']}, all floor(C / 3) after {out['secs']:.2f} s")
    assert out["first"] == [sim.cfg.capacity, 0, 0]
    assert out["secs"] < 3 * sim.cfg.ttl


def test_a_partitioned_replica_holding_past_its_share_stays_within_the_partition_bound(
        tmp_path: Path) -> None:
    # Reference, partition: once the partitioned replica's registration lapsed and its
    # slots were given away, the fleet exceeds capacity by up to max(h, L): what it held
    # runs on, draining (found by the real-time simulation against the earlier statement,
    # floor(C ÷ N)).
    sim = simulate(_cfg(), tmp_path, partition_past_share)
    bound = sim.cfg.capacity + max(4, sim.cfg.capacity // 3)
    print(f"partition: {sim.result} running of {sim.cfg.capacity}, stated bound {bound}")
    assert sim.result <= bound
    assert sim.result > sim.cfg.capacity  # the window exists: r1 reused the freed slots


def test_the_shares_stay_within_capacity_through_pods_that_come_back_into_a_server_hang(
        tmp_path: Path) -> None:
    # Found by the first deterministic simulation (2 replicas, capacity 7): r1's pod died
    # and came back (r0 alone meanwhile: N = 1, share 7); r1 registered, and the server
    # hung before r0 read any reply that counts r1, longer than r0's registration; on
    # resume r1 took floor(7 / 2) = 3 while r0, degraded, still held its share of 7. Fixed
    # in the ledger (ledger.lua, unheard_by). Here that fault alone, often, on varied
    # fleets; the shares are checked after every step.
    for seed in (4, 410):
        sim = simulate(DSimConfig(seed=seed, steps=25_000, vary=True,
                                  faults=("join_then_pause",), fault_rate=0.01),
                       tmp_path / str(seed))
        assert sim.stats["fault_join_then_pause"] >= 3, sim.stats


# ------------------------------------------------- cases found, as plain tests (real time)


async def _replica(url: str, name: str, ttl: float,
                   recorder: CountingRecorder | None = None) -> FleetController:
    return await FleetController.connect(url, fleet=FLEET, replica=name, ttl=ttl,
                                         classes=classes(), capacity=4, ack_timeout=30.0,
                                         metrics=recorder)


async def _eventually(cond: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out: {what}"
        await asyncio.sleep(0.02)


async def test_a_replica_starting_as_the_ledger_finds_an_older_copy_starts_degraded(
        tmp_path: Path) -> None:
    # Found by the real-time simulation (seed 171): a replica killed and started again
    # just as the server came back from its RDB snapshot.
    server = ValkeyServer(tmp_path / "valkey")
    server.start()
    a = b = None
    try:
        # A registers (its loops not started: no call of its own comes first), then the
        # server restarts from a snapshot holding A's live registration.
        a = await _replica(server.url, "a", ttl=10.0)
        await a.admit(DEF, "t0")
        c = redis.Redis(port=server.port)
        await c.save()
        await c.aclose()
        server.restart()
        try:
            b = await _replica(server.url, "b", ttl=10.0)
        except IllegalTransition as exc:
            raise AssertionError(f"connect raised {exc!r}") from None
        assert b.state == "degraded"  # settling: nothing admitted until the fleet has
    finally:
        for ctrl in (a, b):
            if ctrl is not None:
                await ctrl.aclose()
        server.stop()


async def test_an_admission_released_after_a_takeover_is_not_taken_over_again(
        tmp_path: Path) -> None:
    # Found by the real-time simulation (seeds 151, 122): replica restart with the same
    # id, then a failover to a copy that lagged behind the restart.
    server = ValkeyServer(tmp_path / "valkey")
    server.start()
    old = new = None
    rec = CountingRecorder()
    try:
        old = await _replica(server.url, "a", ttl=3.0)
        x = (await old.admit(DEF, "t0")).admission.id
        copy = await copy_keyspace(server, FLEET)  # what the lagging copy holds
        await old.aclose()  # the container restarts; its stream runs on
        old = None
        new = await _replica(server.url, "a", ttl=3.0, recorder=rec)
        new.start()
        assert x in new.held  # taken over
        assert new.release(x) is ReleaseResult.RELEASED  # Envoy's final entry
        await _eventually(lambda: x not in new.held, 2.0, "released")
        await asyncio.sleep(0.3)  # the release reaches the ledger
        await restore_keyspace(server, FLEET, copy)
        # Its next heartbeats (every second) meet the older copy.
        await asyncio.sleep(2.5)
        assert x not in new.held
        assert rec.admitted[x] == 1
    finally:
        for ctrl in (old, new):
            if ctrl is not None:
                await ctrl.aclose()
        server.stop()


# ------------------------------------------------------------------ found and fixed


async def hung_server_within_the_share(sim: DSim) -> None:
    """Two replicas, capacity 4, each holding 1 (share 2: each may hold one more) when
    the server hangs (SIGSTOP); requests keep coming to r0 for 1.5 s, each one's stream
    ending at once: every one of them is within r0's limit."""
    for s in sim.slots:
        await sim.process_up(s.name)
    await sim.until(lambda: all(c is not None and c.share == 2
                                for c in map(sim.ctrl, ("r0", "r1"))), 3.0, "shares 2")
    await _admit(sim, "r0", DEF, 1)
    await _admit(sim, "r1", DEF, 1)
    w = sim.pause_server()
    r0 = sim.slot("r0").proc
    assert r0 is not None and r0.ctrl is not None
    await sim.until(lambda: r0.ctrl is not None and r0.ctrl.state == "degraded", 2.0,
                    "r0 degraded")
    outcomes = []
    end = sim.now + 1.5
    while sim.now < end:
        r = sim.request(r0, DEF, "t0")
        outcomes.append(await sim.answered(r, 0.5))
        if r.aid in sim.running:
            st = sim.running.pop(r.aid)
            sim.ended_at[st.aid] = sim.now
            r0.ctrl.release(st.aid)
        await asyncio.sleep(0.05)
    sim.result = outcomes
    sim.resume_server(w)
    await _end_all(sim)


def test_a_degraded_replica_admits_within_its_share_while_a_recovery_resync_hangs(
        tmp_path: Path) -> None:
    # Found from outside (two sidecars, the server SIGSTOPped: 429 for a Check the share
    # allows) and by this simulation's liveness check as soon as it had one. While the
    # heartbeat's recovery resync hung (up to a call timeout of every interval), the
    # local core's limit was 0. Fails on the code before (strict: the check is fatal).
    sim = simulate(_cfg(replicas=2, capacity=4, strict=True), tmp_path,
                   hung_server_within_the_share)
    assert set(sim.result) == {"admitted"}, sim.result


async def late_resync_after_a_pause(sim: DSim) -> None:
    """Two replicas, capacity 4, nothing held when the server hangs: r0's heartbeat resync
    and then its recovery resync, both listing nothing, wait on a connection r0 then gives
    up on. Meanwhile r0 admits two streams on its own (its share), past their first byte.
    The server resumes and runs r0's new resync, listing both, before what the old
    connection had sent (a server serves its connections in no set order). Back to ok,
    r1 asks for the whole capacity: how many it gets."""
    for s in sim.slots:
        await sim.process_up(s.name)
    await sim.until(lambda: all(c is not None and c.share == 2
                                for c in map(sim.ctrl, ("r0", "r1"))), 3.0, "shares 2")
    r0 = sim.slot("r0").proc
    assert r0 is not None and r0.ctrl is not None
    w = sim.pause_server()
    await sim.until(lambda: r0.ctrl is not None and r0.ctrl.state == "degraded", 2.0,
                    "r0 degraded")
    for aid in await _admit(sim, "r0", DEF, 2):
        sim.stream(aid).first_byte = True
        sim.signal("r0", aid)
        r0.ctrl.mark_first_byte(aid)
    await sim.until(lambda: any(c.closed and any(x.op == "resync" for x in c.pipe)
                                for c in r0.conns), 2.0,
                    "r0's old connection dropped, its resyncs not run")
    old = [c for c in r0.conns if c.closed and c.pipe]
    for c in old:
        r0.conns.remove(c)  # what it sent runs only after r0's next resync
    sim.resume_server(w)
    await sim.until(lambda: r0.ctrl is not None and r0.ctrl.mode in (Mode.SETTLING, Mode.OK),
                    2.0, "r0's new resync answered")
    r0.conns.extend(old)
    sim.release_held(r0)
    await sim.until(lambda: all(c is not None and c.mode is Mode.OK
                                for c in map(sim.ctrl, ("r0", "r1"))), 3 * sim.cfg.ttl,
                    "both ok")
    r1 = sim.slot("r1").proc
    assert r1 is not None
    admitted = 0
    for _ in range(sim.cfg.capacity):
        r = sim.request(r1, DEF, "t0")
        if await sim.answered(r, 2 * sim.cfg.call_timeout) == "admitted":
            admitted += 1
    sim.result = admitted
    await _end_all(sim)


def test_a_resync_given_up_on_that_runs_after_a_newer_one_changes_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Found by the CI profile's first seed (20261204) once both merged branches ran
    # together: the old connection's recovery resync (min_age 0, listing nothing) ran on
    # resume after r0's newer one and dropped its two running streams from the ledger;
    # r0's next resync found them ended and let them run on uncounted (a preemption it
    # could not deliver), and the others filled their slots: 7 of 6 there, 6 of 4 here.
    # Fixed in the ledger (ledger.lua, stale_resync()).
    monkeypatch.setattr(fleet_dsim, "LATE", 1.0)  # what a dropped connection sent runs
    sim = simulate(_cfg(replicas=2, capacity=4), tmp_path, late_resync_after_a_pause)
    assert sim.result == 2, f"r1 got {sim.result} of the 2 slots r0's streams leave"


async def reload_while_the_server_hangs(sim: DSim) -> None:
    """r0 is ok when the server hangs; a hot reload (bulk's queue size 8 → 3) sends its
    registration, whose call times out: r0 degrades, and drops the stalled connection,
    with the registration in it. The server resumes, r0 returns to ok: the class settings
    the ledger stores for bulk, a heartbeat interval later."""
    r0 = await sim.process_up("r0")
    assert r0.ctrl is not None
    w = sim.pause_server()
    r0.ctrl.update_config({**classes(), BULK: replace(classes()[BULK], queue_size=3)})

    def registering() -> bool:  # (a registration is a "heartbeat" call)
        return any(x.op == "heartbeat" for c in r0.conns for x in c.pipe)

    await sim.until(registering, 1.0, "the reload's registration sent")
    await sim.until(lambda: not registering(), 2.0, "its connection dropped")
    assert r0.ctrl.state == "degraded"
    sim.resume_server(w)
    await sim.until(lambda: r0.ctrl is not None and r0.ctrl.mode is Mode.OK,
                    3 * sim.cfg.ttl, "r0 ok")
    await asyncio.sleep(sim.cfg.interval)
    assert sim.server is not None
    sim.result = sim.server.c.hget(f"{fleet_dsim.PREFIX}:meta", "class0")


def test_a_reload_whose_registration_failed_reaches_the_ledger_on_the_return(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A reload's registration is the only call that stores the class settings (a resync
    # carries them but stores them only where none are): lost with its failed call, or
    # dropped from the outbox when the replica went local, the fleet kept the old settings
    # until the next reload.
    monkeypatch.setattr(fleet_dsim, "LATE", 0.0)  # what a dropped connection sent is lost
    sim = simulate(_cfg(replicas=1, strict=True), tmp_path, reload_while_the_server_hangs)
    assert sim.result == encode_class(replace(classes()[BULK], queue_size=3)), sim.result


async def restarts_into_the_drain(sim: DSim) -> None:
    """r0's process ends while a stream of its runs on (its pod's Envoy lives) and starts
    again after its registration lapsed, once the run's drain has begun, which then waits
    a second more for r1's process: only Envoy's next periodic entry tells r0's new process
    of the stream."""
    for s in sim.slots:
        await sim.process_up(s.name)
    await _admit(sim, "r0", DEF, 1)
    back = sim.now + 1.5 * sim.cfg.ttl
    for s, at in zip(sim.slots, (back, back + 1.0), strict=True):
        sim.stop_process(s)
        sim.at(at, s.name, "starts again", lambda s=s: sim.start_process(s))


def test_a_process_that_starts_again_during_the_drain_adopts_what_runs(
        tmp_path: Path) -> None:
    # Found by the long profile (SIM_VARY=1, seed 1006, the drain of a 200,000-step run):
    # the harness's Envoy stopped its periodic entries when the drain began, so a process
    # that came back during it never adopted its pod's running stream, and the run failed
    # on "runs uncounted". Envoy's entries go on while streams run.
    sim = simulate(_cfg(replicas=2, strict=True), tmp_path, restarts_into_the_drain)
    assert sim.stats["admitted"] >= 1


# ------------------------------------------------------------------ known findings


async def connects_while_cut_off(sim: DSim) -> None:
    """r0's path to the server is cut for two ttl: its pipelined connection stalls and
    is dropped, and each new connect hangs until its own connect timeout, after the call
    that started it gave up."""
    await sim.process_up("r0")
    w = sim.partition("r0")
    await asyncio.sleep(2 * sim.cfg.ttl)
    gc.collect()  # a task dropped with an exception is reported when collected
    sim.heal_partition("r0", w)
    await asyncio.sleep(sim.cfg.ttl)


def test_a_connect_given_up_on_leaves_no_exception_unretrieved(tmp_path: Path) -> None:
    simulate(_cfg(replicas=1, strict=True), tmp_path, connects_while_cut_off)
