"""What capacity to count, given one round of worker probes and what came before.

Pure logic, no I/O: :mod:`sidecar.health` probes the workers and hands the
results here. The rules (docs/reference.md, "Capacity"):

- a healthy worker counts for the cap read this round; if it could not be read
  (timeout, error, malformed value), for the last cap read from it. A worker
  never read counts as the default (``--worker-max-running-requests``) only when
  its engine reports no cap; one whose capacity endpoint refused the probe
  (401/403/501) or failed counts for :data:`UNREAD_WORKER_CAPACITY` (an
  unreadable probe must never raise capacity);
- with the saturation guard on, a healthy worker that reports waiting requests
  counts for ``min(cap, running)``: what it showed it can really run; an engine
  that queues only once every slot is busy (llama.cpp) always runs its cap then,
  so it counts for ``running - waiting`` (at least 1) instead (a lower
  reading lowers the count by at most an eighth per round, since a batch turning
  over shows fewer running for an instant). Once its waiting count is back to 0
  it grows back towards its cap by an eighth (at least one slot) per round with
  nothing waiting, rather than jumping back: a jump refills the engine's FIFO
  queue at once and interactive requests wait behind bulk again (measured in
  bench/saturation.py);
- a probe that could not be completed because of the sidecar itself (a local
  timeout, EMFILE and the like) is *inconclusive*. When every probe of a round
  is inconclusive, the previous reading holds: the sidecar's own trouble says
  nothing about the workers. In a round where some probes do complete, an
  inconclusive one counts as unhealthy (the sidecar evidently can probe);
- with the saturation guard on and a count of what the sidecar holds given
  (``held``), the engines' own count is the ground truth: when every healthy
  worker reported running and waiting and their sum exceeds what the sidecar
  holds (requests it did not admit, or released while the engine still runs
  them), capacity is lowered by the difference until the engines show it gone;
- no healthy worker known (start-up, or workers really answering unhealthy or
  refusing connections) -> the fallback capacity, but never more than the last
  capacity read from workers once one was seen.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

# A healthy worker whose cap was never read because its endpoint refused or failed:
# one request at a time is all its 200 on /health proves it can run.
UNREAD_WORKER_CAPACITY = 1

# Engines that queue a request only once every slot is busy: while one waits, running
# is the cap, so min(cap, running) could never shrink them. llama.cpp defers a task
# only when no slot is free (llamacpp:requests_deferred).
QUEUES_ONLY_WHEN_FULL = frozenset({"llamacpp"})


# SMG keeps capacity as a 16-bit count and saturates the workers' sum there (its
# capacity.rs); so does the sidecar, so a fleet reads the same number in both.
MAX_CAPACITY = 65_535


class ProbeStatus(enum.Enum):
    HEALTHY = "healthy"
    UNHEALTHY = "unhealthy"  # the worker answered non-200, refused or reset the connection
    INCONCLUSIVE = "inconclusive"  # the probe could not complete for local reasons


@dataclass(frozen=True, slots=True)
class WorkerProbe:
    """One worker's probe result for one round."""

    url: str
    status: ProbeStatus
    engine: str = "generic"
    cap: int | None = None  # read this round; None = not readable
    running: int | None = None  # saturation signals (None = not read)
    waiting: int | None = None
    cap_failed: bool = False  # the cap endpoint refused or failed (not: reports no cap)
    problems: tuple[tuple[str, str], ...] = ()  # (endpoint, reason) refused this round
    context: int | None = None  # tokens one slot holds (llama.cpp n_ctx), as last read
    kv_tokens: int | None = None  # tokens its KV cache holds, all slots together (None: unknown)


@dataclass(frozen=True, slots=True)
class WorkerCapacity:
    url: str
    engine: str
    capacity: int  # what the worker counts for (after the saturation guard)
    saturated: bool = False
    problems: tuple[tuple[str, str], ...] = ()  # (endpoint, reason) refused this round
    context: int | None = None  # tokens one of its slots holds (llama.cpp), None: unknown
    kv_tokens: int | None = None  # tokens its KV cache holds, None: it reports none


@dataclass(frozen=True, slots=True)
class CapacityReading:
    capacity: int
    source: str  # "workers" | "fallback" | "override"
    healthy: int
    total: int
    workers: tuple[WorkerCapacity, ...] = ()
    held: bool = field(default=False, compare=False)  # a held reading equals the one it holds
    excess: int = 0  # the engines run or queue this many more than the sidecar holds

    @property
    def slot_context(self) -> int | None:
        """The most tokens any counted worker's slot holds, when every one says (a prompt
        past it fits no slot); None when any does not (nothing is refused on a guess)."""
        contexts = [w.context for w in self.workers]
        if not contexts or None in contexts:
            return None
        return max(c for c in contexts if c is not None)

    @property
    def kv_tokens(self) -> int | None:
        """The KV capacity in tokens of the counted workers that report one, summed; None
        when none does (``tokens.admit_by_kv`` then gates nothing). A worker that reports
        none adds slots but no tokens: the sum only ever understates what can run."""
        sizes = [w.kv_tokens for w in self.workers if w.kv_tokens is not None]
        return sum(sizes) if sizes else None

    @property
    def kv_unreported(self) -> int:
        """Counted workers that report no (usable) KV capacity."""
        return sum(1 for w in self.workers if w.kv_tokens is None)


class CapacityPolicy:
    """Turns probe rounds into capacity readings; remembers what it must."""

    def __init__(self, *, fallback: int, default_cap: int, saturation_guard: bool,
                 clock: Callable[[], float], held: Callable[[], int] | None = None) -> None:
        self.held = held  # requests the sidecar holds in flight (None: not compared)
        self.fallback = fallback
        self.default_cap = default_cap
        self.saturation_guard = saturation_guard
        self.clock = clock
        self.last_cap: dict[str, int] = {}  # url -> last cap read from it
        self.learned: dict[str, int] = {}  # url -> count found by the saturation guard
        self.last_good: int | None = None  # last capacity counted from workers
        self.last: CapacityReading | None = None
        self.held_since: float | None = None  # start of the current all-inconclusive spell
        self.last_hold_secs = 0.0  # length of the last hold, once it ended

    def worker_cap(self, probe: WorkerProbe) -> int:
        """The cap a healthy worker counts for (before the saturation guard)."""
        if probe.cap is not None:
            self.last_cap[probe.url] = probe.cap
            return probe.cap
        if probe.url in self.last_cap:
            return self.last_cap[probe.url]
        return UNREAD_WORKER_CAPACITY if probe.cap_failed else self.default_cap

    def guarded(self, p: WorkerProbe, cap: int) -> int | None:
        """The saturation guard's count for a healthy worker (None: not limited)."""
        if not self.saturation_guard or p.running is None or p.waiting is None:
            return self.learned.get(p.url)
        learned = self.learned.get(p.url)
        if p.waiting > 0:
            # What it runs while work waits is its real batch. A reading taken as a
            # batch turns over shows fewer running for an instant, so a lower reading
            # lowers the count by at most an eighth per round; a higher one counts at once.
            batch = p.running
            if p.engine in QUEUES_ONLY_WHEN_FULL:
                # Its batch is its cap; what waits was sent beyond it: hold that many back
                # until the engine shows its queue gone.
                batch = max(1, p.running - p.waiting)
            floor = 0 if learned is None else learned - _step(learned)
            self.learned[p.url] = min(cap, max(batch, floor))
            return self.learned[p.url]
        if learned is None:
            return None
        # Nothing waits: grow, whether or not it is busy (growing only while it runs at
        # the count would never let a class below a reservation of that size back in).
        learned += _step(learned)
        if learned >= cap:
            del self.learned[p.url]
            return None
        self.learned[p.url] = learned
        return learned

    def fallback_capacity(self) -> int:
        if self.last_good is None:
            return self.fallback
        return min(self.fallback, self.last_good)

    def held_for(self) -> float:
        """Seconds the current reading has been held (0 when not holding)."""
        return 0.0 if self.held_since is None else self.clock() - self.held_since

    def decide(self, probes: Sequence[WorkerProbe] | None) -> CapacityReading:
        """The reading for one round; ``None`` = the worker set itself is unknown
        this round for a local reason (e.g. Envoy's admin API could not be read)."""
        if probes is None or (probes and all(
                p.status is ProbeStatus.INCONCLUSIVE for p in probes)):
            if self.last is not None and self.last.source == "workers":
                if self.held_since is None:
                    self.held_since = self.clock()
                return CapacityReading(self.last.capacity, self.last.source, self.last.healthy,
                                       self.last.total, self.last.workers, held=True)
            return self._remember(self._fallback(0 if probes is None else len(probes)))
        if self.held_since is not None:
            self.last_hold_secs = self.clock() - self.held_since
            self.held_since = None
        counted: list[WorkerCapacity] = []
        caps = 0  # Σ caps before the guard
        for p in probes:
            if p.status is not ProbeStatus.HEALTHY:
                self.learned.pop(p.url, None)  # a restart may bring another batch size
                continue
            cap = self.worker_cap(p)
            caps += cap
            guarded = self.guarded(p, cap)
            counted.append(WorkerCapacity(p.url, p.engine, min(cap, guarded)
                                          if guarded is not None else cap, guarded is not None,
                                          p.problems, p.context, p.kv_tokens))
        if not counted:
            return self._remember(self._fallback(len(probes)))
        total = sum(w.capacity for w in counted)
        excess = self.excess([p for p in probes if p.status is ProbeStatus.HEALTHY])
        if excess:
            # The engines' count is the truth: what they run beyond what the sidecar holds
            # takes slots too. Not on top of the guard's own shrinking: at most the caps
            # less the excess.
            total = min(total, max(0, caps - excess))
        total = min(total, MAX_CAPACITY)
        self.last_good = total
        return self._remember(CapacityReading(total, "workers", len(counted), len(probes),
                                              tuple(counted), excess=excess))

    def excess(self, healthy: Sequence[WorkerProbe]) -> int:
        """How many more requests the engines report (running + waiting) than the sidecar
        holds; 0 unless every healthy worker reported both counts."""
        if not self.saturation_guard or self.held is None or not healthy:
            return 0
        counts = [(p.running, p.waiting) for p in healthy]
        if any(r is None or w is None for r, w in counts):
            return 0
        engines = sum((r or 0) + (w or 0) for r, w in counts)
        return max(0, engines - self.held())

    def _fallback(self, total: int) -> CapacityReading:
        return CapacityReading(self.fallback_capacity(), "fallback", 0, total)

    def _remember(self, reading: CapacityReading) -> CapacityReading:
        self.last = reading
        return reading


def _step(count: int) -> int:
    """How far the guard moves a count in one round: an eighth, at least one slot."""
    return max(1, count // 8)


def per_worker(reading: CapacityReading) -> Mapping[tuple[str, str], int]:
    """``{(worker, engine): capacity}`` for the per-worker gauge."""
    return {(w.url, w.engine): w.capacity for w in reading.workers}


def worker_problems(reading: CapacityReading) -> Mapping[tuple[str, str, str], int]:
    """``{(worker, endpoint, reason): 1}`` for the refused-probe gauge."""
    return {(w.url, endpoint, reason): 1 for w in reading.workers
            for endpoint, reason in w.problems}
