"""Command-line flags declared once: a flag is a field of a settings group.

Each group of :class:`sidecar.config.Settings` (listen, capacity, scheduler, ...) is a
frozen dataclass; a field declared with :func:`flag` carries everything about its flag
(name, default, how the value is checked, ``--help`` text, the reference's row). From
those fields come the argparse parser (one argument group per settings group, so
``--help`` groups flags as the settings do), the validated settings, and the flag tables
of ``docs/reference.md`` (``python -m devtools.flagdoc`` writes them; ``tests/test_docs.py``
checks them). A field declared without :func:`flag` is derived from other flags.

This module is the machinery only; the table itself is in :mod:`sidecar.config`.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

Check = Callable[[str, Any], Any]
"""``check(flag_name, parsed_value) -> settings value``; raises the caller's error type."""


class FlagGroup(Protocol):
    """A settings group: a dataclass with a title for ``--help`` and the reference."""

    TITLE: ClassVar[str]
    __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]


@dataclass(frozen=True, slots=True)
class Flag:
    """One command-line flag, as argparse, the settings and the reference need it."""

    name: str
    default: Any
    help: str
    doc: str
    """The reference row's meaning cell (Markdown)."""
    type: Callable[[str], Any] | None = None
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    switch: bool = False
    """``store_true``: present = on."""
    repeat: bool = False
    """``nargs="+"``: one or more values."""
    shown_default: str | None = None
    """The reference's default cell when the default alone would not say it."""
    check: Check | None = None
    """Validates the parsed value and returns what the settings hold (default: as parsed)."""
    field: str = ""
    """The settings field it fills (set from the dataclass field)."""

    @property
    def dest(self) -> str:
        """The argparse attribute: the name without dashes, as argparse derives it."""
        return self.name[2:].replace("-", "_")

    def add_to(self, group: argparse._ArgumentGroup) -> None:
        kwargs: dict[str, Any] = {"default": self.default, "help": self.help}
        if self.switch:
            kwargs["action"] = "store_true"
        if self.type is not None:
            kwargs["type"] = self.type
        if self.metavar is not None:
            kwargs["metavar"] = self.metavar
        if self.choices is not None:
            kwargs["choices"] = self.choices
        if self.repeat:
            kwargs["nargs"] = "+"
        group.add_argument(self.name, **kwargs)

    def usage(self) -> str:
        """The flag and its argument as the reference's first cell shows them."""
        if self.switch:
            return self.name
        arg = "{" + ",".join(self.choices) + "}" if self.choices else (
            self.metavar or self.dest.upper())
        return f"{self.name} {arg} [{arg} ...]" if self.repeat else f"{self.name} {arg}"

    def default_cell(self) -> str:
        if self.shown_default is not None:
            return self.shown_default
        if self.switch:
            return "on" if self.default else "off"
        if self.default is None:
            return "unset"
        return f"`{self.default}`"

    def row(self) -> str:
        return f"| `{self.usage()}` | {self.default_cell()} | {self.doc} |"


def flag(name: str, *, default: Any, help: str, doc: str, **more: Any) -> Any:
    """A settings field that is a command-line flag (see :class:`Flag` for ``more``)."""
    spec = Flag(name, default, help, doc, **more)
    return dataclasses.field(metadata={"flag": spec})


def derived(*, repr: bool = True) -> Any:
    """A settings field computed from other flags, not a flag itself."""
    return dataclasses.field(repr=repr)


def flags_of(group: type[FlagGroup]) -> Iterator[Flag]:
    """The group's flags in declaration order, each knowing its field."""
    for f in dataclasses.fields(group):
        spec = f.metadata.get("flag")
        if spec is not None:
            yield dataclasses.replace(spec, field=f.name)


def build_parser(groups: Sequence[type[FlagGroup]], **kwargs: Any) -> argparse.ArgumentParser:
    """The argparse parser: one argument group per settings group, flags in table order.

    The only place a flag is added to a parser (``tests/test_config_flags.py`` checks).
    """
    parser = argparse.ArgumentParser(formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                     **kwargs)
    for group in groups:
        section = parser.add_argument_group(group.TITLE)
        for spec in flags_of(group):
            spec.add_to(section)
    return parser


def checked_values(group: type[FlagGroup], ns: argparse.Namespace) -> dict[str, Any]:
    """The group's flag fields from parsed arguments, each through its check."""
    values: dict[str, Any] = {}
    for spec in flags_of(group):
        value = getattr(ns, spec.dest)
        values[spec.field] = value if spec.check is None else spec.check(spec.name, value)
    return values


def reference_tables(groups: Sequence[type[FlagGroup]]) -> str:
    """The reference's flag tables: a heading and a table per group."""
    parts = []
    for group in groups:
        rows = "\n".join(spec.row() for spec in flags_of(group))
        parts.append(f"### {group.TITLE[0].upper()}{group.TITLE[1:]}\n\n"
                     f"| flag | default | meaning |\n|---|---|---|\n{rows}\n")
    return "\n".join(parts)
