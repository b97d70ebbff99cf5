"""A concurrency limit that tunes itself from the engine's time to first byte.

Pure (the caller passes the time and the numbers; docs/design.md, "Capacity that tunes
itself"). An engine that runs more requests than it has room for queues the rest inside
itself, and a request queued there gets its first byte only once a running one ends: its
time to first byte jumps from the prefill's to a good part of a generation's. That jump
is the signal. Every ``INTERVAL`` the limit looks at the engine's times to first byte of
the requests that completed meanwhile (Envoy's access log, ``sidecar.deadlines``' source):

* A request queued in the engine if its time is above the baseline (the lowest time
  seen, a request that found a free slot, drifting up by ``DRIFT`` per interval so that an
  engine that got slower for good is followed) by more than ``QUEUE_SHARE`` of its own
  generation (its time in the engine after the first byte): waiting for a slot adds a
  part of another request's generation before the first byte and leaves its own pace
  alone, while running beside more requests in a batch (or on a busier machine) slows
  its first byte and its generation alike, and arriving with others delays its first
  byte by their prompts' turn, a smaller part of a generation (``TOLERANCE`` × the baseline and
  ``SLACK_SECS`` are floors for requests too short to tell). By Little's law the engine
  held ``Lq`` = (their seconds above the baseline) / (the interval) requests queued on
  average: it had room for that many fewer than were in flight. When ``Lq`` is half a
  request or more the limit drops to the most requests in flight during the
  interval less ``Lq`` (at least by one, at most by half), and not
  again for ``SETTLE`` intervals (requests admitted under the old limit still come back
  queued meanwhile).
* Else, if the limit was used (requests waited in the sidecar's queues, or as many as
  the limit were in flight) for ``GROW_AFTER`` intervals in a row, no drop came in the
  last ``COOLDOWN``, and the samples taken since the limit last moved showed the engine
  all but idle of queued requests (``Lq`` below ``QUIET``), it grows by one: a probe.
  An engine one request short of the limit shows an ``Lq`` between the two thresholds:
  the limit then holds there rather than probing further.
* Else it holds (nothing to learn: demand below the limit, or fewer than
  ``MIN_SAMPLES`` completions yet: they are then kept for the next interval, and ``Lq``
  is taken over all the intervals they span).

Samples are streamed responses: a response sent in one piece has its first byte at its
end, so its time says nothing the rest of its generation does not (it is no sample).

It stays within ``[floor, ceiling]``, the ceiling being the capacity the workers report
(their own cap, or the default per worker for an engine that reports none), so it never
admits more than the workers say they can run. Its value and why it moved are what
``smg_sidecar_adaptive_limit`` and ``_changes_total{reason}`` show.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

INTERVAL = 1.0
TOLERANCE = 3.0
SLACK_SECS = 0.01  # differences below this are noise, whatever the ratio
# Requests that reach the engine together have their prompts taken in one batch and their
# first bytes delayed alike: measured on llama.cpp (4 slots, 48-token generations of
# 150-190 ms), a few milliseconds per prompt that came with it, up to a quarter of a
# generation for four at once. A slot wait is longer: most of another's generation.
QUEUE_SHARE = 0.3
QUIET = 0.25  # Lq below this: the engine had room
DRIFT = 0.01
GROW_AFTER = 2
COOLDOWN = 5
SETTLE = 2
MIN_SAMPLES = 3


class Reason(enum.StrEnum):
    """Why the limit moved (or did not) at a tick."""

    QUEUEING = "engine_queueing"  # shrank: the engine's time to first byte jumped
    PROBE = "probe"  # grew by one: the limit was used and the engine kept up
    CEILING = "ceiling"  # moved to stay within the workers' capacity
    HOLD = "hold"  # unchanged


@dataclass(frozen=True, slots=True)
class Tick:
    """What one interval decided."""

    limit: int
    reason: Reason
    changed: bool
    queued: float | None = None  # Lq, where the samples said (requests queued in the engine)
    samples: int = 0


class AdaptiveLimit:
    """The limit of one pool (module docstring)."""

    def __init__(self, *, start: int, floor: int, ceiling: int) -> None:
        self.floor = max(1, floor)
        self.ceiling = max(self.floor, ceiling)
        self._limit = float(min(self.ceiling, max(self.floor, start)))
        # (time to first byte, generation after it)
        self._samples: list[tuple[float, float]] = []
        self._span = 0  # intervals the samples kept so far span
        self._baseline: float | None = None
        self._used = 0  # intervals in a row in which the limit was used
        self._since_shrink = COOLDOWN
        self._quiet = False  # the samples since the limit last moved showed room

    @property
    def limit(self) -> int:
        return int(self._limit)

    def sample(self, engine_ttfb: float, engine_secs: float) -> None:
        """A completed request's engine time to first byte and whole time in the engine."""
        if not (math.isfinite(engine_ttfb) and math.isfinite(engine_secs)
                and 0 <= engine_ttfb <= engine_secs):
            return
        generation = engine_secs - engine_ttfb
        if generation < SLACK_SECS:
            return  # sent in one piece: no first byte of its own (module docstring)
        self._samples.append((engine_ttfb, generation))

    def set_ceiling(self, ceiling: int) -> Tick:
        """The workers' capacity changed: the limit stays within it."""
        before = self.limit
        self.ceiling = max(self.floor, ceiling)
        self._limit = min(self._limit, float(self.ceiling))
        return Tick(self.limit, Reason.CEILING if self.limit != before else Reason.HOLD,
                    self.limit != before)

    def tick(self, *, used: bool, inflight: int | None = None) -> Tick:
        """One interval passed; ``used``: requests waited in the sidecar, or as many as the
        limit were in flight; ``inflight``: the most that were in flight during it."""
        self._span += 1
        samples = self._samples
        if len(samples) >= MIN_SAMPLES:
            self._samples = []
            span, self._span = self._span, 0
        else:
            samples, span = [], 0  # too few to tell yet: kept for the next interval
        self._since_shrink += 1
        self._used = self._used + 1 if used else 0
        before = self.limit
        reason = Reason.HOLD
        queued: float | None = None
        if samples:
            low = min(t for t, _ in samples)
            base = low if self._baseline is None else min(self._baseline * (1 + DRIFT), low)
            self._baseline = base
            floor = max(TOLERANCE * base, base + SLACK_SECS)
            waited = [t - base for t, g in samples if t > max(floor, base + QUEUE_SHARE * g)]
            queued = sum(waited) / (span * INTERVAL)
            self._quiet = queued < QUIET
            if queued >= 0.5 and self._since_shrink > SETTLE:
                # Down by Lq from what was in flight (a limit above the demand taught
                # nothing), at least one and at most half: what comes back soon after a
                # big cut was admitted under the limit before it.
                held = self._limit if inflight is None else min(self._limit, float(inflight))
                lower = min(math.floor(self._limit) - 1.0,
                            max(held / 2, round(held - queued)))
                self._limit = max(float(self.floor), float(lower))
                self._since_shrink = 0
                self._used = 0
                reason = Reason.QUEUEING
        if (reason is Reason.HOLD and self._used >= GROW_AFTER and self._quiet
                and self._since_shrink >= COOLDOWN and self._limit < self.ceiling):
            self._limit = min(float(self.ceiling), math.floor(self._limit) + 1.0)
            self._used = 0
            reason = Reason.PROBE
        if self.limit != before:
            self._quiet = False  # what the new limit does is still to be seen
        return Tick(self.limit, reason, self.limit != before, queued, len(samples))
