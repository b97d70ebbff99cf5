"""The self-tuning limit (sidecar.limiter) against a simulated engine.

The engine here has ``slots`` slots: a request beyond them waits in the engine's own FIFO,
so its time to first byte is the wait for a slot plus the prefill, as llama.cpp and vLLM
behave. The sidecar keeps as many requests in flight as the limit allows (demand always
above it, or a fixed demand below it). Ground truth is the simulated engine's, outside the
code under test.
"""

from __future__ import annotations

import heapq

import pytest

from sidecar.limiter import INTERVAL, AdaptiveLimit, Reason

PREFILL = 0.03
SERVICE = 0.6  # from start in a slot to the last byte


def simulate(limiter: AdaptiveLimit, slots: int, seconds: float,
             demand: int | None = None, batch_cost: float = 0.0,
             prefill: float = PREFILL) -> tuple[list[int], int]:
    """Run the loop for ``seconds``; returns the limit after every tick and the most the
    engine ever held at once (running + waiting). ``batch_cost``: requests that find a
    slot at the same instant have their prompts taken in one batch, each first byte
    delayed by this share of ``SERVICE`` per request in the batch (as llama.cpp does)."""
    now = 0.0
    running: list[float] = []  # end times of requests in an engine slot
    waiting: list[float] = []  # admission times of requests queued in the engine
    inflight = 0
    limits: list[int] = []
    peak = 0
    next_tick = INTERVAL
    while now < seconds:
        want = limiter.limit if demand is None else min(demand, limiter.limit)
        batch = 0
        while inflight < want:  # admit up to the limit (plenty of demand)
            inflight += 1
            if len(running) + batch < slots:
                batch += 1
            else:
                waiting.append(now)
        delay = batch_cost * SERVICE * batch
        for _ in range(batch):
            heapq.heappush(running, now + SERVICE + delay)
            limiter.sample(prefill + delay, SERVICE + delay)
        peak = max(peak, len(running) + len(waiting))
        end = running[0] if running else float("inf")
        if next_tick <= end:
            now = next_tick
            queued_here = demand is None or demand > limiter.limit
            t = limiter.tick(used=queued_here or inflight >= limiter.limit, inflight=inflight)
            assert limiter.floor <= t.limit <= limiter.ceiling
            limits.append(t.limit)
            next_tick += INTERVAL
            continue
        now = heapq.heappop(running)
        inflight -= 1
        if waiting:  # the engine starts its next queued request: its first byte now
            admitted, delay = waiting.pop(0), batch_cost * SERVICE
            heapq.heappush(running, now + SERVICE + delay)
            limiter.sample(now - admitted + prefill + delay, now - admitted + SERVICE + delay)
    return limits, peak


@pytest.mark.parametrize("start", [64, 1])
@pytest.mark.parametrize("slots", [4, 8])
def test_the_limit_converges_near_the_engines_slots_and_stays(start: int, slots: int) -> None:
    limiter = AdaptiveLimit(start=start, floor=1, ceiling=64)
    limits, _ = simulate(limiter, slots, seconds=120.0)
    settled = next(i for i, v in enumerate(limits) if slots <= v <= slots + 1)
    print(f"from {start} to {slots} slots: within [{slots}, {slots + 1}] after "
          f"{settled} s; then {sorted(set(limits[settled:]))}")
    assert settled <= 30  # converges within 30 intervals (seconds)
    tail = limits[settled:]
    # It does not oscillate: after converging it stays within one of the slot count, and
    # spends most of the time at the slot count itself (probes are single steps).
    assert all(slots - 1 <= v <= slots + 1 for v in tail), tail
    assert sum(v == slots for v in tail) >= 0.6 * len(tail)


def test_arrivals_batched_together_are_not_taken_for_queueing() -> None:
    # One client first (the lowest first byte is a request alone), then more than the
    # engine runs: four requests reach it at once, of equal length, so they end together
    # and the next four come together again. Each first byte waits for the others'
    # prompts, 0.07 of a generation per prompt (measured on llama.cpp: 20-45 ms of
    # 150-190 ms). That is no slot wait: the limit stays at the slots, not below.
    limiter = AdaptiveLimit(start=4, floor=1, ceiling=64)
    engine = {"batch_cost": 0.07, "prefill": 0.005}  # a cached prompt: 1 % of a generation
    simulate(limiter, 4, seconds=10.0, demand=1, **engine)
    limits, _ = simulate(limiter, 4, seconds=60.0, **engine)
    assert all(4 <= v <= 5 for v in limits), limits


def test_a_limit_far_above_the_demand_drops_from_what_is_in_flight() -> None:
    # 12 clients, a limit of 64: the drop starts from the 12 in flight, not from 64, so the
    # limit is at the slots within a few seconds.
    limits, _ = simulate(AdaptiveLimit(start=64, floor=1, ceiling=64), 4, 30.0, demand=12)
    assert limits[1] <= 12 and next(i for i, v in enumerate(limits) if v <= 5) <= 8, limits
    assert all(4 <= v <= 5 for v in limits[8:]), limits


def test_it_never_exceeds_the_workers_capacity_and_follows_it_down() -> None:
    limiter = AdaptiveLimit(start=64, floor=1, ceiling=6)
    assert limiter.limit == 6  # the start is clipped to the ceiling
    limits, peak = simulate(limiter, slots=16, seconds=30.0)  # an engine with more room
    assert max(limits) == 6 and peak <= 6
    t = limiter.set_ceiling(3)
    assert (t.limit, t.reason, t.changed) == (3, Reason.CEILING, True)
    limits, peak = simulate(limiter, slots=16, seconds=10.0)
    assert max(limits) <= 3 and peak <= 3


def test_demand_below_the_limit_holds_it() -> None:
    # Nothing to learn when the limit is not used: it neither grows nor shrinks.
    limiter = AdaptiveLimit(start=10, floor=1, ceiling=64)
    limits, _ = simulate(limiter, slots=32, seconds=20.0, demand=3)
    assert set(limits) == {10}


def test_the_floor_is_kept_whatever_the_engine_says() -> None:
    limiter = AdaptiveLimit(start=8, floor=4, ceiling=64)
    for _ in range(20):
        for _ in range(10):
            limiter.sample(0.01, 1.0)
        limiter.sample(5.0, 6.0)
        limiter.sample(5.0, 6.0)
        limiter.tick(used=True)
    assert limiter.limit == 4
    # A lying entry, or a response sent in one piece (first byte at its end), is no sample.
    limiter.sample(float("nan"), 1.0)
    for _ in range(10):
        limiter.sample(5.0, 5.0)
    assert limiter.tick(used=False).reason is Reason.HOLD
