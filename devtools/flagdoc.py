"""Write the flag tables of ``docs/reference.md`` from the flags' one declaration.

``python -m devtools.flagdoc`` rewrites what lies between :data:`BEGIN` and
:data:`END` with a table per settings group (``sidecar.config``); ``--check`` only
says whether the page is current (``tests/test_docs.py`` checks the same).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from sidecar import flags
from sidecar.config import FLAG_GROUPS

REFERENCE = Path(__file__).resolve().parent.parent / "docs" / "reference.md"
BEGIN = ("<!-- flag tables: written by `python -m devtools.flagdoc` from the flags' "
         "declaration in sidecar/config.py; edit them there -->")
END = "<!-- end of flag tables -->"


def tables() -> str:
    return flags.reference_tables(FLAG_GROUPS)


def current(text: str) -> str:
    """What the page holds between the markers."""
    start = text.index(BEGIN) + len(BEGIN)
    return text[start:text.index(END, start)].strip("\n")


def render(text: str) -> str:
    """The page with its flag tables regenerated."""
    start = text.index(BEGIN) + len(BEGIN)
    return f"{text[:start]}\n\n{tables().strip()}\n\n{text[text.index(END, start):]}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m devtools.flagdoc", description=__doc__)
    p.add_argument("--check", action="store_true", help="exit 1 if the page is not current")
    ns = p.parse_args(argv)
    text = REFERENCE.read_text(encoding="utf-8")
    if ns.check:
        ok = current(text) == tables().strip()
        print("docs/reference.md flag tables: " + ("current" if ok else "out of date"))
        return 0 if ok else 1
    REFERENCE.write_text(render(text), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
