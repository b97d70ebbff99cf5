"""Deadlines: predicted queue waits against time-to-first-token targets, in the core.

The scheduler predicts the wait of an arrival that would queue from its position and the
class's measured drain interval (sidecar.scheduler.drain); a wait budget refuses
(``enforce``) or only counts (shadow) one predicted past it. What must hold, whatever the
traffic: an arrival that finds a free slot is never refused by a prediction (an idle pool
refuses nothing), nor one with no estimate yet; a refusal happens only where the
prediction exceeded the budget (so a refuse-everything core fails these tests); and on a
steady drain the prediction is close to the wait that follows.
"""

from __future__ import annotations

import statistics

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.classes import PriorityClass
from sidecar.deadlines import Deadlines
from sidecar.priority_yaml import ConfigError, parse_priority_config
from sidecar.scheduler import (
    Admitted,
    ClassSettings,
    Outcome,
    OverTarget,
    Queued,
    Rejected,
    Scheduler,
)
from sidecar.scheduler.drain import DrainRates
from tests.clock import FakeClock

S, I, D, B = (PriorityClass.SYSTEM, PriorityClass.INTERACTIVE, PriorityClass.DEFAULT,
              PriorityClass.BULK)
# No reservations, deep queues, long timeouts: only the prediction decides.
CFG = {c: ClassSettings(0, 0.0, 1000, 1e6, 1e6, False) for c in PriorityClass}


def run_steady(service: float, capacity: int, arrivals: int, every: float,
               budget: float | None = None, enforce: bool = False
               ) -> tuple[Scheduler, list[tuple[float | None, float]], list[Rejected]]:
    """Bulk arrivals every ``every`` s, each served for ``service`` s once admitted.
    Returns the core, (predicted, actual wait) per queued admission, and refusals."""
    clock = FakeClock(0.0)
    s = Scheduler(CFG, capacity, clock)
    ends: dict[str, float] = {}
    pairs: list[tuple[float | None, float]] = []
    refused: list[Rejected] = []
    t_next, n = 0.0, 0
    while n < arrivals or ends:
        due = min([*ends.values(), t_next if n < arrivals else float("inf")])
        clock.now = due
        for aid in [a for a, t in ends.items() if t <= clock.now]:
            del ends[aid]
            s.release(aid)
        if n < arrivals and t_next <= clock.now:
            d = s.arrive(f"r{n}", B, "t", wait_budget=budget, enforce=enforce)
            if isinstance(d, Rejected):
                refused.append(d)
            n += 1
            t_next += every
        for e in s.take_events():
            if isinstance(e, Admitted):
                ends[e.admission.id] = clock.now + service
                if e.queued:
                    pairs.append((e.predicted, e.waited))
    return s, pairs, refused


def test_on_a_steady_drain_the_prediction_follows_the_wait() -> None:
    # Two slots, 1 s each, an arrival every 0.4 s: the queue grows by one each second.
    _, pairs, _ = run_steady(service=1.0, capacity=2, arrivals=60, every=0.4)
    known = [(p, w) for p, w in pairs if p is not None]
    assert len(known) >= 40
    late = known[10:]  # once the drain interval is learnt
    errors = [abs(w - p) for p, w in late]
    # Within one and a half dispatch intervals (0.5 s each) of the real wait on every one
    # of them, and within half of one on average.
    assert max(errors) <= 0.75, errors
    assert sum(errors) / len(errors) < 0.25


def test_without_an_estimate_nothing_is_refused_and_a_free_slot_always_admits() -> None:
    clock = FakeClock(0.0)
    s = Scheduler(CFG, 1, clock)
    # Nothing was ever served or released: no estimate, so even a zero budget queues.
    assert isinstance(s.arrive("a", B, "t", wait_budget=0.0, enforce=True), Admitted)
    d = s.arrive("b", B, "t", wait_budget=0.0, enforce=True)
    assert isinstance(d, Queued) and d.waiter.predicted is None
    assert s.predicted_wait(B) is None
    clock.advance(2.0)
    s.release("a")  # b is served: an interval and a release are known now
    assert any(isinstance(e, Admitted) and e.admission.id == "b" for e in s.take_events())
    s.release("b")
    assert s.predicted_wait(B) == 0.0  # a free slot: nothing to wait for
    # However small the budget, an arrival that finds a free slot is admitted.
    assert isinstance(s.arrive("c", B, "t", wait_budget=-5.0, enforce=True), Admitted)


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["arrive", "release", "time"]),
                              st.sampled_from(list(PriorityClass)),
                              st.floats(0.0, 3.0)), max_size=80),
       capacity=st.integers(1, 4), budget=st.floats(-1.0, 5.0), enforce=st.booleans())
def test_only_a_prediction_past_the_budget_refuses_and_never_with_a_free_slot(
        ops: list[tuple[str, PriorityClass, float]], capacity: int, budget: float,
        enforce: bool) -> None:
    clock = FakeClock(0.0)
    s = Scheduler(CFG, capacity, clock)
    held: list[str] = []
    for i, (op, cls, x) in enumerate(ops):
        if op == "time":
            clock.advance(x)
            s.tick()
        elif op == "release" and held:
            s.release(held.pop(int(x * 10) % len(held)))
        elif op == "arrive":
            free = s.available(cls) >= 1 and s.queue_depth(cls) == 0
            predicted = s.predicted_wait(cls)
            d = s.arrive(f"r{i}", cls, "t", wait_budget=budget, enforce=enforce)
            over = [e for e in s.take_events() if isinstance(e, OverTarget)]
            if free:
                assert isinstance(d, Admitted) and not over  # never on a free slot
            if over:
                # Counted only where the prediction exceeded the budget...
                assert predicted is not None and predicted > budget
                assert over[0].predicted == predicted and over[0].enforced == enforce
                # ...and refused only when enforced.
                assert isinstance(d, Rejected) == enforce
            if isinstance(d, Rejected):
                assert d.outcome is Outcome.REJECTED_OVER_TARGET and over
            elif isinstance(d, Queued):
                assert d.waiter.predicted == predicted
        for e in s.take_events():
            if isinstance(e, Admitted):
                held.append(e.admission.id)


def test_enforced_targets_refuse_at_intake_what_would_wait_too_long_and_admit_the_rest() -> None:
    # Two 1 s slots and an arrival every 0.2 s: a standing queue that grows fast. With a
    # 3 s budget, arrivals are refused exactly while the predicted wait is past it, and
    # the ones admitted wait about what was predicted (so within the budget).
    _, pairs, refused = run_steady(service=1.0, capacity=2, arrivals=80, every=0.2,
                                   budget=3.0, enforce=True)
    assert refused and all(r.predicted is not None and r.predicted > 3.0 for r in refused)
    assert all(r.outcome is Outcome.REJECTED_OVER_TARGET for r in refused)
    waits = [w for _, w in pairs]
    # Within the budget plus one service while the drain is being learnt, and the budget
    # itself as a rule.
    assert max(waits) <= 3.0 + 1.0 and statistics.median(waits) <= 3.0
    admitted = 80 - len(refused)
    assert admitted >= 0.3 * 80  # not a refuse-everything core: the drain's share is served
    # The same traffic counted only (shadow): nothing refused, and the waits grow past it.
    _, shadow_pairs, shadow_refused = run_steady(service=1.0, capacity=2, arrivals=80,
                                                 every=0.2, budget=3.0, enforce=False)
    assert not shadow_refused and max(w for _, w in shadow_pairs) > 10.0


def test_the_wait_is_fitted_from_served_waiters_and_floored_by_the_oldest() -> None:
    d = DrainRates()
    d.served(B, 2.0, ahead=1)  # one point: no slope yet, 1 s per position
    assert d.predict(B, 3) == pytest.approx(4.0)
    for k in range(8):  # waits of 0.3 + 0.5·k: the fit finds both parts
        d.served(B, 0.3 + 0.5 * k, ahead=k)
    for _ in range(30):
        for k in (2, 5):
            d.served(B, 0.3 + 0.5 * k, ahead=k)
    assert d.predict(B, 10) == pytest.approx(5.3, rel=0.02)
    assert d.predict(B, 0) == pytest.approx(0.3, abs=0.05)
    assert d.predict(B, 10, floor=2.0) == pytest.approx(22.0)  # a stalled queue, at once
    # A class never served falls back to the pool's release interval; none: no estimate.
    assert d.predict(S, 3) is None and not d.known(S)
    d.released(0.0)
    d.released(0.5)
    assert d.predict(S, 3) == pytest.approx(2.0)


@settings(max_examples=300, deadline=None)
@given(depth=st.integers(2, 300), lo=st.floats(0.01, 10.0), spread=st.floats(0.0, 0.5),
       served=st.lists(st.tuples(st.booleans(), st.floats(0.0, 1.0)), min_size=2,
                       max_size=100))
def test_a_queue_that_holds_its_length_is_predicted_the_waits_it_served(
        depth: int, lo: float, spread: float, served: list[tuple[bool, float]]) -> None:
    # A full queue (or one held at its budget by enforced targets): every waiter served
    # had depth - 1 or depth ahead of it and waited between lo and hi. The wait predicted
    # behind depth waiters stays within what was served there (at most one position's
    # worth more): the fit's slope is noise here, and a line that would start below zero
    # must not lift the prediction past every wait it learnt from.
    hi = lo * (1 + spread)
    d = DrainRates()
    for i, (deeper, x) in enumerate(served):
        d.served(B, lo + x * (hi - lo), ahead=depth if deeper else depth - 1)
        predicted = d.predict(B, depth)
        assert predicted is not None
        assert lo * (1 - 1e-9) <= predicted <= hi * depth / (depth - 1) * (1 + 1e-9), (
            i, predicted, lo, hi)


def test_deadlines_budget_is_the_target_less_the_engines_time_to_first_byte() -> None:
    cfg = parse_priority_config("""
deadline_mode: enforce
classes:
  bulk: {ttft_target_ms: 2000}
  interactive: {ttft_target_ms: 500}
  default: {ttft_target_ms: 1000, sheddable: false}
""")
    d = Deadlines(cfg.classes, cfg.deadline_mode)
    assert d.enforce and d.active
    assert d.budget(B) == pytest.approx(2.0)
    assert d.budget(I) is None  # not sheddable by default: never refused by a prediction
    assert d.budget(D) is None  # marked so
    assert d.budget(S) is None  # no target
    for _ in range(200):
        d.observed(B, 0.5)
    assert d.budget(B) == pytest.approx(1.5, abs=1e-3)
    d.observed(B, float("nan"))  # a lying entry changes nothing
    assert d.budget(B) == pytest.approx(1.5, abs=1e-3)
    d.configure(cfg.classes, "shadow")
    assert not d.enforce and d.budget(B) == pytest.approx(1.5, abs=1e-3)


@pytest.mark.parametrize(("text", "key"), [
    ("classes: {bulk: {ttft_target_ms: 0}}", "classes.bulk.ttft_target_ms"),
    ("classes: {bulk: {ttft_target_ms: -5}}", "classes.bulk.ttft_target_ms"),
    ("classes: {bulk: {ttft_target_ms: .inf}}", "classes.bulk.ttft_target_ms"),
    ("classes: {bulk: {ttft_target_ms: fast}}", "classes.bulk.ttft_target_ms"),
    ("classes: {bulk: {sheddable: 1}}", "classes.bulk.sheddable"),
    ("deadline_mode: strict", "deadline_mode"),
    ("pools: {big: {classes: {bulk: {ttft_target_ms: 0}}}}",
     "pools.big.classes.bulk.ttft_target_ms"),
])
def test_bad_targets_stop_start_up_naming_the_key(text: str, key: str) -> None:
    with pytest.raises(ConfigError) as exc:
        parse_priority_config(text, "p.yaml")
    assert exc.value.file == "p.yaml" and exc.value.key == key


def test_a_refuse_everything_core_fails_the_steady_drain_check(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The check above is not vacuous: a core that refuses whatever would queue fails it.
    original = Scheduler._enqueue

    def refuse_all(self: Scheduler, id: str, cls: PriorityClass, tenant: str, now: float,
                   wait_budget: float | None, enforce: bool, cost: float = 1.0) -> object:
        return original(self, id, cls, tenant, now, -1.0 if enforce else wait_budget,
                        enforce, cost)

    monkeypatch.setattr(Scheduler, "_enqueue", refuse_all)
    with pytest.raises(AssertionError):
        test_enforced_targets_refuse_at_intake_what_would_wait_too_long_and_admit_the_rest()
