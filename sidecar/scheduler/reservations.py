"""Reservations: how many slots each class holds back at a given capacity.

Pure functions of the class settings and a capacity; the scheduler recomputes
them on every capacity change and reload.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from sidecar.classes import HIGH_TO_LOW, PriorityClass
from sidecar.scheduler.settings import ClassSettings

CLASSES_ABOVE: Mapping[PriorityClass, tuple[PriorityClass, ...]] = {
    c: tuple(h for h in HIGH_TO_LOW if h > c) for c in PriorityClass
}
"""The strictly higher classes of each class: whose reservations it must not eat."""


def desired_reservations(
    classes: Mapping[PriorityClass, ClassSettings], capacity: int
) -> dict[PriorityClass, int]:
    """``max(floor, ceil(share * capacity))``, each at most capacity.

    The product is rounded to 9 decimals before ``ceil`` so that 0.1 * 300 is
    30 as written, not 31 from binary floating point.
    """
    out: dict[PriorityClass, int] = {}
    for cls in HIGH_TO_LOW:
        c = classes[cls]
        product = c.reserved_per_slot * capacity
        # A share of 1 or more reserves everything (and a huge one would overflow).
        share = capacity if product >= capacity else math.ceil(round(product, 9))
        out[cls] = min(capacity, max(c.reserved_floor, share))
    return out


def reservations_fit(classes: Mapping[PriorityClass, ClassSettings], capacity: int) -> bool:
    """The startup check: do the reservations fit the capacity?"""
    return sum(desired_reservations(classes, capacity).values()) <= capacity


def scaled_reservations(
    classes: Mapping[PriorityClass, ClassSettings], capacity: int
) -> dict[PriorityClass, int]:
    """Reservations at ``capacity``, scaled down proportionally when they do not fit.

    Integer math (floor), so the sum never exceeds capacity; growth simply
    recomputes from the configured floors and shares, which restores them.
    """
    desired = desired_reservations(classes, capacity)
    total = sum(desired.values())
    if total <= capacity:
        return desired
    return {cls: desired[cls] * capacity // total for cls in desired}
