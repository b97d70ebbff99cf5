"""Where the fleet's slot-seconds went: the sidecar's slot trace joined with the workers' records.

Every slot-second of a window (capacity x seconds) falls in exactly one bucket:

* ``to worker``    admitted, the request not yet at a worker (Check answer -> Envoy ->
                   worker accepts; also a victim stopped before it got there);
* ``served, done`` the worker computed a request that completed;
* ``served, preempted`` the worker computed a request later preempted (wasted work);
* ``held``         the worker had finished, the release had not arrived yet
                   (response -> Envoy -> access log entry -> sidecar);
* ``idle, waiting`` no admission held the slot while requests were queued, split into
                   slots a waiter could take (a loop gap) and slots kept free for a
                   higher class's unused reservation (policy: ``available()`` of the core);
* ``idle``         no admission held it and nobody waited (not a loss).

Intervals are clipped to the window. The sidecar writes the trace when
``SMG_SIDECAR_SLOT_TRACE`` is set (sidecar/slottrace.py); each worker record
carries the admission id (x-smg-admission-id) the sidecar gave the request.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

BUCKETS = ("to worker", "served, done", "served, preempted", "held")


@dataclass
class Life:
    cls: str = "?"
    admitted: float | None = None
    released: float | None = None
    reason: str = ""
    start: float | None = None
    end: float | None = None
    outcome: str = ""


@dataclass
class Breakdown:
    window: float
    capacity: int
    per_class: dict[str, dict[str, float]] = field(default_factory=dict)
    idle_waiting: float = 0.0
    idle_reserved: float = 0.0  # the part of idle_waiting no waiter was allowed to take
    idle: float = 0.0
    # Per admission in the window: seconds from admission to the worker, and from the
    # worker's end to the release (the two legs of the loop outside the worker).
    to_worker: list[float] = field(default_factory=list)
    held: list[float] = field(default_factory=list)

    @property
    def slot_seconds(self) -> float:
        return self.window * self.capacity

    def total(self, bucket: str) -> float:
        return sum(c.get(bucket, 0.0) for c in self.per_class.values())

    def lines(self, classes: Iterable[str]) -> list[str]:
        total = self.slot_seconds
        head = f"    {'slot time':<20}" + "".join(f"{b:>19}" for b in BUCKETS)
        out = [f"    slot-time breakdown ({self.capacity} slots x {self.window:.2f} s = "
               f"{total:.1f} slot-s; share of all slot-seconds):", head]
        for cls in [*classes, "total"]:
            row = (self.per_class.get(cls, {}) if cls != "total"
                   else {b: self.total(b) for b in BUCKETS})
            out.append(f"    {cls:<20}" + "".join(
                f"{row.get(b, 0.0):>10.2f} s {row.get(b, 0.0) / total:>5.1%}" for b in BUCKETS))
        gap = self.idle_waiting - self.idle_reserved
        out.append(f"    idle while requests waited: {self.idle_waiting:.2f} s "
                   f"{self.idle_waiting / total:.1%} = kept for a higher class's unused "
                   f"reservation {self.idle_reserved:.2f} s {self.idle_reserved / total:.1%} + "
                   f"takeable by a waiter {gap:.2f} s {gap / total:.1%}; idle, none waiting "
                   f"{self.idle:.2f} s {self.idle / total:.1%}")
        if self.to_worker and self.held:
            out.append("    per request: admission -> worker p50 "
                       f"{_pct(self.to_worker, 0.5) * 1e3:.1f} ms p90 "
                       f"{_pct(self.to_worker, 0.9) * 1e3:.1f} ms; worker end -> release p50 "
                       f"{_pct(self.held, 0.5) * 1e3:.1f} ms p90 "
                       f"{_pct(self.held, 0.9) * 1e3:.1f} ms")
        done = self.total("served, done")
        out.append(f"    fleet utilization (served, done / slot-seconds): {done / total:.1%}; "
                   f"with preempted work {(done + self.total('served, preempted')) / total:.1%}")
        return out


def _pct(xs: list[float], q: float) -> float:
    ys = sorted(xs)
    return ys[min(len(ys) - 1, int(q * len(ys)))]


def read_trace(path: Path) -> list[tuple[float, str, str, str]]:
    rows = []
    for line in path.read_text().splitlines():
        parts = line.split(" ")
        if len(parts) >= 3:
            t = float(parts[0])
            rows.append((t, parts[1], parts[2], parts[3] if len(parts) > 3 else ""))
    rows.sort()
    return rows


def account(trace: list[tuple[float, str, str, str]], records: Iterable[object],
            capacity: int, t0: float, t1: float,
            reserved: Mapping[str, int] | None = None,
            high_to_low: Sequence[str] = ("system", "interactive", "default", "bulk"),
            ) -> Breakdown:
    """The breakdown over [t0, t1]; ``records`` are devtools.fleet RequestRecords.

    ``reserved`` (class -> slots) splits idle-while-waiting as the core does: a
    waiter of class c may take ``free - sum over higher h of max(0, reserved[h] -
    inflight[h])`` slots.
    """
    reserved = reserved or {}
    lives: dict[str, Life] = defaultdict(Life)
    # Occupancy and queue depth over time, per class, from the trace (sorted by time).
    inflight: dict[str, int] = defaultdict(int)
    queued: dict[str, int] = defaultdict(int)
    in_queue: dict[str, str] = {}
    out = Breakdown(window=t1 - t0, capacity=capacity)
    last = t0

    def account_idle(span: float) -> None:
        free = max(0, capacity - sum(inflight.values()))
        if not any(queued.values()):
            out.idle += free * span
            return
        out.idle_waiting += free * span
        takeable = 0
        for i, cls in enumerate(high_to_low):
            if queued[cls]:
                held = sum(max(0, reserved.get(h, 0) - inflight[h]) for h in high_to_low[:i])
                takeable = max(takeable, min(free, free - held))
        out.idle_reserved += (free - max(0, takeable)) * span

    for t, kind, aid, extra in trace:
        if t > t0:
            span = min(t, t1) - max(last, t0)
            if span > 0:
                account_idle(span)
            last = t
        life = lives[aid]
        if kind == "Q":
            in_queue[aid] = extra
            queued[extra] += 1
        elif kind in ("A", "X"):
            if aid in in_queue:
                queued[in_queue.pop(aid)] -= 1
            if kind == "A":
                life.cls, life.admitted = extra, t
                inflight[extra] += 1
        elif kind == "R":
            life.released, life.reason = t, extra
            if life.admitted is not None:
                inflight[life.cls] -= 1
    if last < t1:
        account_idle(t1 - max(last, t0))
    for r in records:
        aid = getattr(r, "admission_id", None)
        if aid and aid in lives:
            life = lives[aid]
            life.start, life.end = r.started_at, r.ended_at  # type: ignore[attr-defined]
            life.outcome = r.outcome  # type: ignore[attr-defined]

    def clip(a: float, b: float) -> float:
        return max(0.0, min(b, t1) - max(a, t0))

    for life in lives.values():
        if life.admitted is None:
            continue
        a = life.admitted
        r = life.released if life.released is not None else t1
        row = out.per_class.setdefault(life.cls, dict.fromkeys(BUCKETS, 0.0))
        if life.start is None or life.start >= r:
            row["to worker"] += clip(a, r)
            continue
        s = max(a, life.start)
        e = min(r, life.end if life.end is not None else r)
        if t0 <= a < t1:
            out.to_worker.append(s - a)
            if life.outcome == "finished" and life.released is not None:
                out.held.append(r - e)
        row["to worker"] += clip(a, s)
        row["served, done" if life.outcome == "finished" else "served, preempted"] += clip(s, e)
        row["held"] += clip(e, r)
    return out
