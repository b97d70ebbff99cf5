"""LLM-shaped utilization of the scheduler core, in process, on a simulated clock.

The flood and isolation benchmarks serve every request in a fixed time; LLM requests
are not like that. Here each request's first token comes after 50-500 ms (uniform),
then it streams for 1-20 s (bounded Pareto, alpha 1.1: most short, a heavy tail;
mean ~3 s). The fleet and classes are ``bench.isolation``'s (8 slots; system reserves
1, interactive 2); arrivals are Poisson: interactive at 25 % of capacity, system at 5 %,
bulk the rest of 3x / 10x capacity (capacity in req/s = slots / mean service time).
The real core (``sidecar.scheduler.Scheduler``) decides on an injected clock that a
discrete-event loop advances: no Envoy, no gRPC, no release latency, so this measures
the admission policy's own utilization, not the loop's (``bench.edge`` and
``bench.isolation`` measure that). A request is preemptible until its first token
(the contract), so a preemption wastes at most 0.5 s of a slot.

Reported per load: utilization of the capacity not kept free for a higher class's
unused reservation (slot-seconds serving requests that completed / slot-seconds minus
those idle for a reservation; goal >= 97 %), the raw utilization, the work wasted by
preemptions, idle a waiter could have taken, and each class's time-to-first-byte p99
against its p99 with no bulk at all (same seed).

    python -m bench.llm [--hours 2] [--seed N] [--multiples 3,10]
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import random
from collections import defaultdict
from dataclasses import dataclass, field

from bench._util import pct
from bench.isolation import PRIORITY, SLOTS, WORKERS
from sidecar.classes import PriorityClass
from sidecar.config import parse_priority_config
from sidecar.scheduler import Admitted, Preempted, Rejected, Scheduler, preemptible_classes

CAPACITY = WORKERS * SLOTS
TTFB = (0.05, 0.5)
STREAM = (1.0, 20.0)
ALPHA = 1.1
GOAL = 0.97
CLASSES = (PriorityClass.SYSTEM, PriorityClass.INTERACTIVE, PriorityClass.BULK)
TENANT = {PriorityClass.SYSTEM: "auth:internal-cron", PriorityClass.INTERACTIVE: "auth:acme",
          PriorityClass.BULK: "anonymous"}


def stream_secs(rng: random.Random) -> float:
    """Bounded Pareto on STREAM by inverse transform."""
    lo, hi = STREAM
    u = rng.random()
    return float((-(u * hi**ALPHA - u * lo**ALPHA - hi**ALPHA) / (hi**ALPHA * lo**ALPHA))
                 ** (-1.0 / ALPHA))


def mean_service(rng: random.Random, n: int = 200_000) -> float:
    return sum(rng.uniform(*TTFB) + stream_secs(rng) for _ in range(n)) / n


@dataclass
class Result:
    seconds: float
    useful: float = 0.0  # slot-seconds of requests that completed
    wasted: float = 0.0  # slot-seconds of requests later preempted
    idle_reserved: float = 0.0  # idle while requests waited, kept for a reservation
    idle_takeable: float = 0.0  # idle while a waiter could have taken it (a loop gap)
    idle: float = 0.0  # idle, nobody waiting
    ttfb: dict[PriorityClass, list[float]] = field(default_factory=lambda: defaultdict(list))
    outcomes: dict[tuple[PriorityClass, str], int] = field(
        default_factory=lambda: defaultdict(int))

    @property
    def slot_seconds(self) -> float:
        return self.seconds * CAPACITY

    @property
    def unreserved_utilization(self) -> float:
        return self.useful / (self.slot_seconds - self.idle_reserved)


def simulate(rates: dict[PriorityClass, float], seconds: float, seed: int) -> Result:
    cfg = parse_priority_config(PRIORITY).classes
    now = 0.0
    s = Scheduler(cfg, CAPACITY, lambda: now)
    preemptible = preemptible_classes(cfg)
    rng = random.Random(seed)
    ids = itertools.count()
    events: list[tuple[float, int, str, str]] = []  # (time, seq, kind, id)
    seq = itertools.count()
    req: dict[str, tuple[PriorityClass, float, float, float]] = {}  # cls, arrived, ttfb, len
    started: dict[str, float] = {}
    out = Result(seconds)
    for cls, rate in rates.items():
        if rate > 0:
            heapq.heappush(events, (rng.expovariate(rate), next(seq), "arrive", cls.label))

    def start(rid: str) -> None:
        cls, _, ttfb, length = req[rid]
        started[rid] = now
        if cls in preemptible:
            s.mark_preemptible(rid)
        heapq.heappush(events, (now + ttfb, next(seq), "first", rid))
        heapq.heappush(events, (now + ttfb + length, next(seq), "end", rid))

    def drain() -> None:
        for ev in s.take_events():
            if isinstance(ev, Admitted) and not ev.adopted and ev.admission.id not in started:
                start(ev.admission.id)
            elif isinstance(ev, Preempted):
                rid = ev.victim.id
                out.wasted += clip(started.pop(rid), now)
                out.outcomes[(ev.victim.cls, "preempted")] += 1
            elif isinstance(ev, Rejected):
                out.outcomes[(ev.cls, ev.outcome.value)] += 1

    def clip(a: float, b: float) -> float:
        return max(0.0, min(b, seconds) - min(a, seconds))

    last = 0.0
    deadline: float | None = None
    while events:
        t = events[0][0]
        if deadline is not None and deadline < t:
            t = deadline
        if t > seconds:
            break
        # Integrate the idle slots over [last, t] as they stood.
        span = t - last
        free = max(0, CAPACITY - s.inflight())
        if span > 0 and free:
            waiting = [c for c in PriorityClass if s.queue_depth(c)]
            if not waiting:
                out.idle += free * span
            else:
                takeable = min(free, max(max(0, s.available(c)) for c in waiting))
                out.idle_takeable += takeable * span
                out.idle_reserved += (free - takeable) * span
        now = last = t
        if deadline is not None and t == deadline:
            s.tick()
        else:
            _, _, kind, key = heapq.heappop(events)
            if kind == "arrive":
                arriving = PriorityClass.from_name(key)
                assert arriving is not None
                rid = f"r{next(ids)}"
                req[rid] = (arriving, now, rng.uniform(*TTFB), stream_secs(rng))
                heapq.heappush(events, (now + rng.expovariate(rates[arriving]), next(seq),
                                        "arrive", key))
                d = s.arrive(rid, arriving, TENANT[arriving])
                if isinstance(d, Admitted):
                    start(rid)
                elif isinstance(d, Rejected):
                    out.outcomes[(arriving, d.outcome.value)] += 1
            elif kind == "first" and key in started:
                s.mark_first_byte(key)
                cls, arrived, _, _ = req[key]
                out.ttfb[cls].append(now - arrived)
            elif kind == "end" and key in started:
                out.useful += clip(started.pop(key), now)
                out.outcomes[(req[key][0], "completed")] += 1
                s.release(key)
        drain()
        deadline = s.next_deadline()
    # Requests still running at the end: their slot time so far counts as served.
    for at in started.values():
        out.useful += clip(at, seconds)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--hours", type=float, default=2.0, help="simulated time per load")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--multiples", default="3,10")
    p.add_argument("--quick", action="store_true", help="0.25 h per load")
    args = p.parse_args(argv)
    if args.quick:
        args.hours = 0.25
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    seconds = args.hours * 3600
    service = mean_service(random.Random(seed))
    cap = CAPACITY / service
    print(f"llm: {CAPACITY} slots, first token after {TTFB[0]:g}-{TTFB[1]:g} s, then a "
          f"{STREAM[0]:g}-{STREAM[1]:g} s stream (bounded Pareto, alpha {ALPHA}); mean "
          f"service {service:.2f} s, capacity {cap:.2f} req/s; {args.hours:g} h simulated "
          f"per load; seed {seed}")
    high = {PriorityClass.SYSTEM: 0.05 * cap, PriorityClass.INTERACTIVE: 0.25 * cap}
    base = simulate({**high, PriorityClass.BULK: 0.0}, seconds, seed)
    ok = True
    for mult in [float(m) for m in args.multiples.split(",")]:
        bulk = mult * cap - sum(high.values())
        r = simulate({**high, PriorityClass.BULK: bulk}, seconds, seed)
        total = r.slot_seconds
        good = r.unreserved_utilization >= GOAL
        ok = ok and good
        print(f"  {mult:g}x capacity ({mult * cap:.2f} req/s offered): utilization of the "
              f"capacity not kept for a higher class's reservation "
              f"{r.unreserved_utilization:.1%} ({'PASS' if good else 'FAIL'}, goal "
              f">= {GOAL:.0%}); of all slot-seconds: completed work {r.useful / total:.1%}, "
              f"preempted work {r.wasted / total:.1%}, idle for a reservation "
              f"{r.idle_reserved / total:.1%}, idle a waiter could take "
              f"{r.idle_takeable / total:.1%}, idle none waiting {r.idle / total:.1%}")
        for cls in CLASSES:
            t = r.ttfb.get(cls, [])
            b = base.ttfb.get(cls, [])
            counts = {k[1]: v for k, v in sorted(r.outcomes.items()) if k[0] is cls}
            ratio = (f"{pct(t, 0.99) / pct(b, 0.99):.2f}x its p99 with no bulk "
                     f"({pct(b, 0.99) * 1e3:.0f} ms)" if b else "no baseline (bulk)")
            print(f"    {cls.label:<12} TTFB p50 {pct(t, 0.5) * 1e3:8.0f} ms  p99 "
                  f"{pct(t, 0.99) * 1e3:8.0f} ms = {ratio}; {counts}")
    print(f"  overall: {'PASS' if ok else 'FAIL'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
