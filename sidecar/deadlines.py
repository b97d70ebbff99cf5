"""A pool's time-to-first-token targets, as the wait budget each arrival may spend queued.

Pure (docs/design.md, "Deadlines"). A class's ``ttft_target_ms`` is what a client should
see from sending the request to its first byte: the wait in the class queue plus the
engine's own time to first byte. The engine's part is measured, per class, from every
completed request's access-log entry (Envoy's ``time_to_first_upstream_rx_byte`` less
``time_to_last_upstream_tx_byte``: from the request reaching the worker to the first byte
back), so the budget an arrival may wait is the target less that moving average. The
scheduler predicts the wait (:mod:`sidecar.scheduler.drain`) and compares; this module
only says what the budget is and whether exceeding it refuses (``enforce``) or is only
counted (``shadow``, the default: predictions are proven before they refuse anything).

Only a ``sheddable`` class gets a budget: system and interactive are never refused by a
prediction unless a file marks them so.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from sidecar.classes import PriorityClass
from sidecar.scheduler import ClassSettings

ALPHA = 0.1
"""Weight of one completed request in the engine time-to-first-byte average."""
ENFORCE = "enforce"


class Deadlines:
    """The targets in force for one pool and what the engine's part of them costs."""

    def __init__(self, classes: Mapping[PriorityClass, ClassSettings], mode: str) -> None:
        self._targets: dict[PriorityClass, float] = {}
        self.enforce = False
        self._engine: dict[PriorityClass, float] = {}
        self.configure(classes, mode)

    def configure(self, classes: Mapping[PriorityClass, ClassSettings], mode: str) -> None:
        """A (re)loaded table: the targets of the sheddable classes, and the mode."""
        self._targets = {c: k.ttft_target_ms / 1000.0 for c, k in classes.items()
                         if k.ttft_target_ms is not None and k.sheddable}
        self.enforce = mode == ENFORCE

    @property
    def active(self) -> bool:
        """Some class has a target a prediction is measured against."""
        return bool(self._targets)

    def observed(self, cls: PriorityClass, engine_ttfb: float) -> None:
        """A completed request of ``cls`` whose first byte took ``engine_ttfb`` seconds
        from reaching its worker."""
        if not (math.isfinite(engine_ttfb) and engine_ttfb >= 0):
            return
        old = self._engine.get(cls)
        self._engine[cls] = engine_ttfb if old is None else old + ALPHA * (engine_ttfb - old)

    def engine_ttfb(self, cls: PriorityClass) -> float | None:
        return self._engine.get(cls)

    def budget(self, cls: PriorityClass) -> float | None:
        """The longest an arrival of ``cls`` may wait queued and still meet its target
        (None: no target for it). May be 0 or less: the engine alone takes the target."""
        target = self._targets.get(cls)
        if target is None:
            return None
        return target - self._engine.get(cls, 0.0)
