"""A failed test's report ends with the tails of the logs of what it ran.

Every child process a test starts (the sidecar, Envoy, valkey-server, llama-server, a
sidecar from ``tests/sidecar_proc.py``) writes its stdout and stderr to a file given to
``subprocess.Popen``; tests/tiers.py calls :func:`record` after each Popen, so the
file's path is known without the harness saying where it put it. The fake workers run
in this process and write to :data:`devtools.fleet.JOURNAL`. For a failed test the
report gets one section per child it started (the tail of its log), the paths of the
logs of those started earlier that still run (a session's valkey-server), and the fake
workers' lines written while it ran.

``SMG_LOG_TAIL_LINES`` (default 40) sets how many lines each section keeps.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from devtools.fleet import JOURNAL
from tests.tiers import program_of

_TAIL_BYTES = 256 * 1024
_LINE_CHARS = 600


def tail_lines() -> int:
    return int(os.environ.get("SMG_LOG_TAIL_LINES", "40"))


@dataclass
class _Child:
    program: str
    log: Path
    proc: subprocess.Popen[Any]
    serial: int


_children: list[_Child] = []
_serial = 0
_test_start_serial = 0
_test_start_journal = 0


def record(proc: subprocess.Popen[Any], args: Any, kwargs: dict[str, Any]) -> None:
    """Remember where a child's output goes (a Popen hook: files only, not pipes)."""
    global _serial
    for stream in (kwargs.get("stdout"), kwargs.get("stderr")):
        name = getattr(stream, "name", None)
        if isinstance(name, str) and os.path.isabs(name):
            _serial += 1
            _children.append(_Child(program_of(args), Path(name), proc, _serial))
            return


def begin_test() -> None:
    """A test begins: forget the children that ended before it."""
    global _test_start_serial, _test_start_journal
    _children[:] = [c for c in _children if c.proc.returncode is None]
    _test_start_serial = _serial
    _test_start_journal = JOURNAL.count


def _tail(path: Path, n: int) -> str:
    try:
        with path.open("rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - _TAIL_BYTES))
            data = f.read()
    except OSError as exc:
        return f"(cannot read: {exc})"
    lines = data.decode(errors="replace").splitlines()[-n:]
    return "\n".join(ln if len(ln) <= _LINE_CHARS else ln[:_LINE_CHARS] + " ..." for ln in lines)


def sections() -> list[tuple[str, str]]:
    """(title, text) per log of the running test, for ``TestReport.sections``."""
    n = tail_lines()
    out: list[tuple[str, str]] = []
    older: list[str] = []
    seen: set[Path] = set()
    # newest first per file: a restarted sidecar appends to the same log
    for child in reversed(_children):
        if child.log in seen:
            continue
        seen.add(child.log)
        state = "running" if child.proc.returncode is None else f"exited {child.proc.returncode}"
        if child.serial > _test_start_serial:
            out.append((f"{child.program} log, last {n} lines ({state}; {child.log})",
                        _tail(child.log, n) or "(empty)"))
        elif child.proc.returncode is None:  # a longer-scoped fixture's: named, not shown
            older.append(f"{child.program}: {child.log}")
    out.reverse()
    if older:
        out.append(("started before this test and still running", "\n".join(reversed(older))))
    lines = JOURNAL.since(_test_start_journal)
    if lines:
        out.append((f"fake workers' journal, last {min(n, len(lines))} of {len(lines)} lines",
                    "\n".join(lines[-n:])))
    return out
