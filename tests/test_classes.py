from __future__ import annotations

import pytest

from sidecar.classes import (
    PriorityClass,
    clamp,
    classify,
    parse_default_max_class,
    parse_priority_header,
)

S, I, D, B = (PriorityClass.SYSTEM, PriorityClass.INTERACTIVE, PriorityClass.DEFAULT,
              PriorityClass.BULK)


@pytest.mark.parametrize(
    ("value", "cls", "unknown"),
    [
        (None, D, False),
        ("", D, False),
        ("   ", D, False),
        ("\t\n", D, False),
        ("system", S, False),
        ("SYSTEM", S, False),
        ("  Interactive ", I, False),
        ("bulk", B, False),
        ("BuLk\t", B, False),
        ("default", D, False),
        ("DEFAULT", D, False),
        ("urgent", D, True),
        ("high", D, True),
        ("system2", D, True),
        ("sys tem", D, True),
        ("ſystem", D, True),  # U+017F folds to 's' in Unicode, not in ASCII matching
        ("interactivé", D, True),
        ("système", D, True),
        ("x" * 100_000, D, True),
        ("\x00system", D, True),
    ],
)
def test_header_table(value: str | None, cls: PriorityClass, unknown: bool) -> None:
    parsed = parse_priority_header(value)
    assert parsed.requested is cls
    assert parsed.unknown is unknown


def test_class_order_and_labels() -> None:
    assert S > I > D > B
    assert [c.label for c in PriorityClass] == ["bulk", "default", "interactive", "system"]
    assert PriorityClass.from_name("system") is S
    assert PriorityClass.from_name("System") is None  # YAML is strict and lowercase


@pytest.mark.parametrize(
    ("requested", "ceiling", "effective"),
    [(S, D, D), (I, D, D), (D, D, D), (B, D, B), (S, S, S), (B, S, B), (I, B, B), (S, I, I)],
)
def test_clamp_never_promotes(
    requested: PriorityClass, ceiling: PriorityClass, effective: PriorityClass
) -> None:
    assert clamp(requested, ceiling) is effective
    assert clamp(requested, ceiling) <= requested


def test_classify_reports_clamp() -> None:
    c = classify("system", "auth:acme", D)
    assert (c.requested, c.effective, c.clamped, c.unknown_value) == (S, D, True, False)
    c = classify("bulk", "auth:acme", D)
    assert (c.requested, c.effective, c.clamped) == (B, B, False)
    c = classify("urgent", "t", S)
    assert (c.requested, c.effective, c.clamped, c.unknown_value) == (D, D, False, True)


@pytest.mark.parametrize(
    ("value", "cls", "valid"),
    [("default", D, True), ("Interactive", I, True), (" SYSTEM ", S, True), ("bulk", B, True),
     ("nope", D, False), ("", D, False)],
)
def test_default_max_class(value: str, cls: PriorityClass, valid: bool) -> None:
    assert parse_default_max_class(value) == (cls, valid)
