"""Token-weighted fairness inside a class (``fair_queuing: tokens``): the core.

A turn costs the served request's tokens over its tenant's weight, so backlogged tenants
get equal *tokens* by weight. The bound (SCFQ for packets of different sizes, the shape
VTC proves for LLM serving): over any stretch in which tenants i and j both wait, the
tokens served to each satisfy |S_i/w_i − S_j/w_j| ≤ C_i/w_i + C_j/w_j, C_t the largest
request tenant t had served in that stretch. Checked on the live scheduler (hypothesis,
random arrivals of very different sizes, releases, cancels, timeouts, capacity changes),
beside its twin: fair queuing by requests, which the same traffic drives far past the
bound in tokens.
"""

from __future__ import annotations

import itertools
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sidecar.classes import PriorityClass
from sidecar.priority_yaml import ConfigError, parse_priority_config
from sidecar.scheduler import (
    BUILTIN_CLASSES,
    Admitted,
    ClassSettings,
    Queued,
    Rejected,
    Released,
    Scheduler,
)
from sidecar.scheduler.queues import TenantQueue, queue_for
from tests.clock import FakeClock

B = PriorityClass.BULK


def bulk(by: str, weights: dict[str, float] | None = None, capacity_timeout: float = 1e6
         ) -> dict[PriorityClass, ClassSettings]:
    out = {c: replace(v, reserved_floor=0, reserved_per_slot=0.0, queue_size=200,
                      queue_timeout_secs=capacity_timeout, starvation_threshold_secs=1e6)
           for c, v in BUILTIN_CLASSES.items()}
    out[B] = replace(out[B], fair_queuing=True, fair_cost=by, tenant_weights=weights or {})
    return out


def served_tenants(s: Scheduler, turns: int) -> list[str]:
    """The tenants of the next ``turns`` grants, each ending the one before ("blocker"
    first)."""
    s.take_events()
    order, holder = [], "blocker"
    for _ in range(turns):
        s.release(holder)
        (a,) = [e.admission for e in s.take_events() if isinstance(e, Admitted)]
        order.append(a.tenant)
        holder = a.id
    return order


def test_a_tenant_with_20x_longer_requests_gets_one_turn_per_20_of_the_others() -> None:
    s = Scheduler(bulk("tokens"), 1, FakeClock())
    assert isinstance(s.arrive("blocker", B, "x"), Admitted)
    for i in range(10):
        assert isinstance(s.arrive(f"long{i}", B, "long", cost=2000.0), Queued)
    for i in range(60):
        assert isinstance(s.arrive(f"short{i}", B, "short", cost=100.0), Queued)
    order = served_tenants(s, 40)
    # Tags: short 100, 200, ...; long 2,000 (first tagged: ties go to it). So the long
    # tenant's one request goes 20th, and in 40 turns it got 2,000 tokens to 3,900.
    assert order.index("long") == 19 and order.count("long") == 1, order
    # By requests, the same traffic alternates: 20 long requests, 40,000 tokens.
    r = Scheduler(bulk("requests"), 1, FakeClock())
    assert isinstance(r.arrive("blocker", B, "x"), Admitted)
    for i in range(30):
        r.arrive(f"long{i}", B, "long", cost=2000.0)
    for i in range(30):
        r.arrive(f"short{i}", B, "short", cost=100.0)
    order = served_tenants(r, 40)
    assert order.count("long") == 20


def test_the_yaml_key_and_what_it_turns_on() -> None:
    cfg = parse_priority_config("classes: {bulk: {fair_queuing: tokens}}")
    assert cfg.classes[B].fair_queuing and cfg.classes[B].fair_cost == "tokens"
    assert cfg.tokens_for("default") is not None  # token accounting is on for the costs
    plain = parse_priority_config("classes: {bulk: {fair_queuing: true}}")
    assert plain.classes[B].fair_cost == "requests" and plain.tokens_for("default") is None
    for bad in ("bytes", 2, "yes", None):
        with pytest.raises(ConfigError) as err:
            parse_priority_config(f"classes: {{bulk: {{fair_queuing: {bad!r}}}}}", "p.yaml")
        assert err.value.key == "classes.bulk.fair_queuing"
    tq = queue_for(cfg.classes[B])
    assert isinstance(tq, TenantQueue) and tq.tokens


weights_st = st.dictionaries(st.sampled_from(["a", "b", "c"]),
                             st.sampled_from([0.5, 1.0, 2.0, 3.0]), max_size=3)
ops_st = st.lists(st.one_of(
    st.tuples(st.just("arrive"), st.sampled_from(["a", "b", "c"]), st.integers(1, 4000)),
    st.tuples(st.just("burst"), st.sampled_from(["a", "b", "c"]), st.integers(1, 4000)),
    st.tuples(st.just("release"), st.integers(0, 10), st.just(0)),
    st.tuples(st.just("cancel"), st.integers(0, 50), st.just(0)),
    st.tuples(st.just("tick"), st.floats(0.0, 3.0), st.just(0)),
    st.tuples(st.just("capacity"), st.integers(0, 3), st.just(0)),
), min_size=1, max_size=160)


@settings(max_examples=800, deadline=None, print_blob=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(weights=weights_st, steps=ops_st, long_tenant=st.sampled_from(["a", "b", "c"]))
def test_token_service_stays_within_the_bound_while_both_wait(
        weights: dict[str, float], steps: list[tuple[str, Any, int]], long_tenant: str) -> None:
    """Ground truth kept here: per tenant, its FIFO of waiting ids with their tokens, the
    tokens served, and for each pair of waiting tenants the stretch since both waited.
    One tenant's requests are 20x longer. Every queued admission is checked."""
    clock = FakeClock()
    s = Scheduler(bulk("tokens", weights, capacity_timeout=5.0), 1, clock)
    ids = itertools.count()
    cost_of: dict[str, float] = {}
    queued: dict[str, list[str]] = {}
    served: dict[str, float] = {}
    since: dict[str, tuple[int, dict[str, float], int]] = {}  # stretch start per waiting tenant
    history: list[tuple[str, float]] = []  # every queued admission, in order
    largest: dict[str, float] = {}  # per tenant, its largest request
    stamp = itertools.count()
    running: list[str] = []

    def w(t: str) -> float:
        return weights.get(t, 1.0)

    def check() -> None:
        waiting = sorted(since)
        for i, x in enumerate(waiting):
            for y in waiting[i + 1:]:
                start = max(since[x], since[y], key=lambda v: v[0])
                _, base, _at = start
                sx = served.get(x, 0.0) - base.get(x, 0.0)
                sy = served.get(y, 0.0) - base.get(y, 0.0)
                # SCFQ's bound: each tenant's largest request (its L_max).
                bound = largest[x] / w(x) + largest[y] / w(y)
                assert abs(sx / w(x) - sy / w(y)) <= bound + 1e-6, (x, sx, y, sy, bound)

    def absorb() -> None:
        for e in s.take_events():
            if isinstance(e, Admitted):
                running.append(e.admission.id)
                if not e.queued:
                    continue
                a = e.admission
                fifo = queued[a.tenant]
                assert fifo[0] == a.id, "a tenant's own requests out of order"
                fifo.pop(0)
                served[a.tenant] = served.get(a.tenant, 0.0) + cost_of[a.id]
                history.append((a.tenant, cost_of[a.id]))
                check()
                if not fifo:
                    del queued[a.tenant], since[a.tenant]
            elif isinstance(e, Rejected) and e.id in queued.get(e.tenant, ()):
                queued[e.tenant].remove(e.id)
                if not queued[e.tenant]:
                    del queued[e.tenant], since[e.tenant]
            elif isinstance(e, Released):
                running.remove(e.admission.id)

    for op, arg, size in steps:
        if op in ("arrive", "burst"):
            tenant = arg
            for _ in range(6 if op == "burst" else 1):
                rid = f"r{next(ids)}"
                cost = float(size * (20 if tenant == long_tenant else 1))
                cost_of[rid] = cost
                largest[tenant] = max(largest.get(tenant, 0.0), cost)
                if isinstance(s.arrive(rid, B, tenant, cost=cost), Queued):
                    if tenant not in queued:
                        queued[tenant] = []
                        since[tenant] = (next(stamp), dict(served), len(history))
                    queued[tenant].append(rid)
        elif op == "release" and running:
            s.release(running[arg % len(running)])
        elif op == "cancel":
            waiting = [i for f in queued.values() for i in f]
            if waiting:
                s.cancel(waiting[arg % len(waiting)])
        elif op == "tick":
            clock.advance(arg)
            s.tick()
        elif op == "capacity":
            s.set_capacity(arg)
        absorb()


def test_a_cancelled_head_hands_its_turn_to_the_next_at_the_next_ones_own_tokens() -> None:
    s = Scheduler(bulk("tokens"), 1, FakeClock())
    assert isinstance(s.arrive("blocker", B, "z"), Admitted)
    s.arrive("x-big", B, "x", cost=4000.0)  # x's turn tagged at 4,000
    s.arrive("x-small", B, "x", cost=10.0)
    for i in range(5):
        s.arrive(f"y{i}", B, "y", cost=10.0)  # y's at 10, 20, ...
    s.take_events()
    assert s.cancel("x-big")  # x's turn now costs its next request's 10 tokens
    s.take_events()
    order, holder = [], "blocker"
    for _ in range(3):
        s.release(holder)
        (a,) = [e.admission for e in s.take_events() if isinstance(e, Admitted)]
        order.append(a.id)
        holder = a.id
    # x's turn at 10 ties y's first (re-tagged later: y goes first); without the re-tag
    # x would wait for its 4,000 behind all of y's.
    assert order == ["y0", "x-small", "y1"]
