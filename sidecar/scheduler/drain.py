"""How fast each class queue drains, and the wait it predicts for a new arrival.

Pure and clock-free (the caller passes the numbers): the scheduler tells it, for every
waiter it serves, how long that one waited and how many waiters were ahead of it when it
queued, and when any slot was released; it answers how long an arrival that finds
``ahead`` waiters in front of it would wait.

The model (docs/design.md, "Deadlines"): the wait of a waiter with ``k`` ahead of it is
``a + b·k``: ``a`` for the first slot to free (a fraction of one service, which depends
on how many slots the class can take) and ``b`` per waiter in front (the drain interval).
Both are learnt from the waiters the queue actually served, by a least-squares fit over
moving averages of ``k``, ``w``, ``k²`` and ``k·w`` (recent waiters count most), with
neither part below zero (a line that would start below zero gives way to the best line
through zero: a queue that holds one length fits its slope to noise). Learning
from waits rather than from dispatch intervals keeps everything that slows a queue down
inside the measurement (strict priority, the classes above taking slots, preemptions,
starvation aging, reservations, engines slower than usual), and on a bursty drain (two
slots freed together, then none) dispatch intervals average right but say nothing about
who waits behind whom. While the served waiters all had the same ``k`` (no slope to fit)
the wait per position is ``w / (k + 1)``.

A served waiter tells only after its wait, so the queue's oldest waiter, still waiting, is
evidence too: its wait so far, spread over the positions it needs (those in front and its
own), is a floor on the wait per position (a queue that stalls is seen at once, not one
wait later). A class never served from its queue yet falls back to the pool's interval
between any two releases per position; with neither there is no estimate (None), and a
caller must then not refuse anything on the prediction.
"""

from __future__ import annotations

from dataclasses import dataclass

from sidecar.classes import PriorityClass

ALPHA = 0.25
"""Weight of the newest served waiter in the moving averages (about the last eight)."""
_FLAT = 1e-6  # below this spread of k there is no slope to fit


def _ewma(old: float | None, sample: float) -> float:
    return sample if old is None else old + ALPHA * (sample - old)


@dataclass(slots=True)
class _Fit:
    """Moving averages of (k, w): what a least-squares line through them needs."""

    k: float
    w: float
    kk: float
    kw: float

    def add(self, k: float, w: float) -> None:
        self.k += ALPHA * (k - self.k)
        self.w += ALPHA * (w - self.w)
        self.kk += ALPHA * (k * k - self.kk)
        self.kw += ALPHA * (k * w - self.kw)

    def wait(self, ahead: int) -> float:
        spread = self.kk - self.k * self.k
        if spread > _FLAT:
            slope = (self.kw - self.k * self.w) / spread
            if slope <= 0.0:  # waits that do not grow with the position: their mean
                return self.w
            first = self.w - slope * self.k
            if first < 0.0:
                # The best line starts below zero (a slope fitted to noise, as when the
                # queue holds one length): the best line through zero instead. Raising
                # only its start would lift every prediction past the waits it fitted.
                return ahead * self.kw / self.kk
            return first + slope * ahead
        return (ahead + 1) * self.w / (self.k + 1)


class DrainRates:
    """Per class, what a queue position costs (module docstring)."""

    def __init__(self) -> None:
        self._fits: dict[PriorityClass, _Fit] = {}
        self._release_interval: float | None = None
        self._last_release: float | None = None

    def served(self, cls: PriorityClass, waited: float, ahead: int) -> None:
        """A waiter of ``cls`` was admitted from its queue after ``waited`` seconds, with
        ``ahead`` waiters in front of it when it queued."""
        k, w = float(max(0, ahead)), max(0.0, waited)
        fit = self._fits.get(cls)
        if fit is None:
            self._fits[cls] = _Fit(k, w, k * k, k * w)
        else:
            fit.add(k, w)

    def released(self, now: float) -> None:
        """A slot was given back (any class): the fallback interval."""
        if self._last_release is not None:
            self._release_interval = _ewma(self._release_interval,
                                           max(0.0, now - self._last_release))
        self._last_release = now

    def known(self, cls: PriorityClass) -> bool:
        return cls in self._fits or self._release_interval is not None

    def predict(self, cls: PriorityClass, ahead: int, floor: float = 0.0) -> float | None:
        """The wait of an arrival of ``cls`` with ``ahead`` waiters in front of it (None:
        no estimate yet); ``floor``: the oldest waiter's wait so far per position."""
        positions = max(0, ahead) + 1
        fit = self._fits.get(cls)
        if fit is not None:
            wait = fit.wait(max(0, ahead))
        elif self._release_interval is not None:
            wait = positions * self._release_interval
        else:
            return None
        return max(wait, positions * floor)
