"""Priority classes, the ``x-smg-priority`` header and the tenant clamp.

Classification only: nothing here knows about queues or capacity (the split
Kubernetes API Priority and Fairness makes between classifying and queuing).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

PRIORITY_HEADER = "x-smg-priority"


class PriorityClass(enum.IntEnum):
    """The four classes; a larger value is a higher priority, so ``min`` clamps."""

    BULK = 0
    DEFAULT = 1
    INTERACTIVE = 2
    SYSTEM = 3

    @property
    def label(self) -> str:
        """The lowercase name used in headers, YAML and metric labels."""
        return self.name.lower()

    @classmethod
    def from_name(cls, name: str) -> PriorityClass | None:
        """Strict lookup for configuration: exact lowercase name or ``None``."""
        return _BY_NAME.get(name)


_BY_NAME: dict[str, PriorityClass] = {c.label: c for c in PriorityClass}

HIGH_TO_LOW: tuple[PriorityClass, ...] = (
    PriorityClass.SYSTEM,
    PriorityClass.INTERACTIVE,
    PriorityClass.DEFAULT,
    PriorityClass.BULK,
)
LOW_TO_HIGH: tuple[PriorityClass, ...] = tuple(reversed(HIGH_TO_LOW))


@dataclass(frozen=True, slots=True)
class HeaderPriority:
    """What the header asked for, and whether it was an unrecognised value."""

    requested: PriorityClass
    unknown: bool


_MISSING = HeaderPriority(PriorityClass.DEFAULT, unknown=False)
_UNKNOWN = HeaderPriority(PriorityClass.DEFAULT, unknown=True)
_HEADER_VALUES: dict[str, HeaderPriority] = {
    c.label: HeaderPriority(c, unknown=False) for c in PriorityClass
}


def parse_priority_header(value: str | None) -> HeaderPriority:
    """Parse ``x-smg-priority`` leniently, as the contract says.

    Trimmed, matched case-insensitively (ASCII only, so look-alike Unicode
    letters cannot sneak in via case folding). Missing, empty or whitespace
    means ``default`` and is not counted; any other value that is not a class
    name means ``default`` and is counted as unknown.
    """
    if value is None:
        return _MISSING
    trimmed = value.strip()
    if not trimmed:
        return _MISSING
    if len(trimmed) > 16 or not trimmed.isascii():
        # Longer than any class name: no need to lowercase a huge value.
        return _UNKNOWN
    return _HEADER_VALUES.get(trimmed.lower(), _UNKNOWN)


def parse_default_max_class(value: str) -> tuple[PriorityClass, bool]:
    """Parse ``--priority-scheduler-default-max-class``.

    Case-insensitive; an unknown value falls back to ``default`` (the contract),
    returned with ``False`` so the caller can warn about it.
    """
    found = PriorityClass.from_name(value.strip().lower())
    if found is None:
        return PriorityClass.DEFAULT, False
    return found, True


@dataclass(frozen=True, slots=True)
class Classification:
    """The result of classifying one request."""

    tenant: str
    requested: PriorityClass
    effective: PriorityClass
    unknown_value: bool

    @property
    def clamped(self) -> bool:
        return self.effective < self.requested


def clamp(requested: PriorityClass, ceiling: PriorityClass) -> PriorityClass:
    """``effective = min(requested, tenant_max_class)``: never promotes."""
    return requested if requested <= ceiling else ceiling


def classify(header_value: str | None, tenant: str, ceiling: PriorityClass) -> Classification:
    """Header → requested class → clamped effective class for ``tenant``."""
    parsed = parse_priority_header(header_value)
    return Classification(
        tenant=tenant,
        requested=parsed.requested,
        effective=clamp(parsed.requested, ceiling),
        unknown_value=parsed.unknown,
    )
