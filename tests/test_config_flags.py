"""Each flag is declared once: the settings groups' fields make the parser, --help's
sections, the settings and the reference's flag tables."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from sidecar import flags
from sidecar.config import (
    FLAG_GROUPS,
    SETTINGS_GROUPS,
    Settings,
    build_parser,
    parse_settings,
)

ROOT = Path(__file__).resolve().parent.parent
ALL_FLAGS = [(group, spec) for group in FLAG_GROUPS for spec in flags.flags_of(group)]


def help_sections() -> dict[str, list[str]]:
    """--help's sections: title -> the flags listed under it, in order."""
    sections: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in build_parser().format_help().splitlines():
        if line and not line.startswith(" ") and line.endswith(":"):
            current = sections.setdefault(line[:-1], [])
        elif current is not None and (m := re.match(r"  (--[a-z0-9-]+)", line)):
            current.append(m.group(1))
    return sections


def test_every_flag_is_in_its_groups_help_section_in_table_order() -> None:
    sections = help_sections()
    for group in FLAG_GROUPS:
        assert sections.get(group.TITLE) == [s.name for s in flags.flags_of(group)], group
    listed = [f for title, names in sections.items() if title != "options" for f in names]
    assert sorted(listed) == sorted(s.name for _, s in ALL_FLAGS)


def reference_sections() -> dict[str, list[str]]:
    """The reference's flag tables: heading -> the flags of its rows, in order."""
    sections: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in (ROOT / "docs" / "reference.md").read_text(encoding="utf-8").splitlines():
        if line.startswith("#"):
            current = sections.setdefault(line.lstrip("#").strip(), [])
        elif current is not None and (m := re.match(r"\| `(--[a-z0-9-]+)", line)):
            current.append(m.group(1))
    return sections


def test_every_flag_is_in_its_groups_reference_table_in_table_order() -> None:
    sections = reference_sections()
    for group in FLAG_GROUPS:
        heading = group.TITLE[0].upper() + group.TITLE[1:]
        assert sections.get(heading) == [s.name for s in flags.flags_of(group)], heading


def test_flag_names_are_unique_and_the_parser_has_nothing_else() -> None:
    names = [spec.name for _, spec in ALL_FLAGS]
    assert len(names) == len(set(names))
    parsed = {o for a in build_parser()._actions for o in a.option_strings} - {"-h", "--help"}
    assert parsed == set(names)


def test_no_flag_is_defined_outside_the_table() -> None:
    """argparse is fed in one place, sidecar.flags, from the groups' fields."""
    calls = ("add_argument(", "add_argument_group(", "ArgumentParser(", "add_parser(")
    found: dict[str, list[str]] = {}
    for path in sorted((ROOT / "sidecar").rglob("*.py")):
        for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for call in calls:
                if call in line:
                    found.setdefault(path.relative_to(ROOT).as_posix(), []).append(
                        f"{lineno}: {call}")
    # The ledger loader is another command (the admin's), with a parser of its own.
    found.pop("sidecar/coordination/server.py", None)
    assert set(found) == {"sidecar/flags.py"}, found
    # One parser, one section per group, one add_argument: the Flag's own.
    assert sorted(c.split(": ")[1] for c in found["sidecar/flags.py"]) == sorted(calls[:3])


def test_every_settings_field_is_a_flag_or_derived_and_reachable_flat() -> None:
    s = parse_settings([])
    seen = set()
    for member, group in zip(dataclasses.fields(Settings), SETTINGS_GROUPS, strict=True):
        assert isinstance(getattr(s, member.name), group)
        for f in dataclasses.fields(group):
            assert f.name not in seen, f"{f.name} is in two groups"
            seen.add(f.name)
            # The flat path older call sites use reaches the grouped value.
            assert getattr(s, f.name) is getattr(getattr(s, member.name), f.name)
    with pytest.raises(AttributeError):
        _ = s.no_such_setting


def test_secrets_stay_out_of_the_settings_repr(tmp_path: Path) -> None:
    key = tmp_path / "key"
    key.write_text("s3cret-key\n")
    pw = tmp_path / "pw"
    pw.write_text("s3cret-pw\n")
    s = parse_settings(["--priority-scheduler-enabled", "--worker-auth-file", str(key),
                        "--coordination-url", "redis://127.0.0.1:1",
                        "--coordination-password-file", str(pw)])
    assert s.capacity.worker_credential == {"Authorization": "Bearer s3cret-key"}
    assert s.fleet.coordination_password == "s3cret-pw"
    assert "s3cret" not in repr(s)


@pytest.mark.parametrize(("group", "spec"), ALL_FLAGS, ids=[s.name for _, s in ALL_FLAGS])
def test_the_table_default_is_what_the_parser_gives(group: type, spec: flags.Flag) -> None:
    ns = build_parser().parse_args([])
    assert getattr(ns, spec.dest) == spec.default
