"""Child processes that die with their parent, and a parent that stops cleanly.

The demo, the test harness and the benchmarks start the sidecar, Envoy and load
clients as child processes in sessions of their own (a shell's job control must
not signal them). Then nothing kills them when the parent dies, and they keep
ports 9001, 9090, 9901 and 10000. So every child asks the kernel for SIGKILL
when its parent goes (Linux ``PR_SET_PDEATHSIG``), whatever killed the parent,
SIGKILL included; and the demo turns SIGTERM, SIGHUP, a closed stdout and the
death of its own parent (``make``) into an ordinary, cleaning-up exit.
"""

from __future__ import annotations

import ctypes
import os
import resource
import signal
import sys
from collections.abc import Mapping, Sequence
from types import FrameType

_PR_SET_PDEATHSIG = 1
_LIMITS = {"nofile": resource.RLIMIT_NOFILE, "as": resource.RLIMIT_AS}


def die_with_parent(argv: Sequence[str], *, limits: Mapping[str, int] | None = None
                    ) -> list[str]:
    """``argv`` started through this file's launcher: it gets SIGKILL when this process dies.

    The launcher sets ``PR_SET_PDEATHSIG`` (and any ``limits``: ``nofile``, ``as``
    in bytes) and then execs ``argv``, so the child is the same process with the
    same parent. Not a ``preexec_fn``: Python code run between fork and exec in a
    process that has gRPC loaded runs gRPC's fork handlers, which now and then
    abort the child ("epoll_wait error: Bad file descriptor"). Without a
    ``preexec_fn`` Popen forks with no Python in between. The death signal
    follows the parent *thread*; all harness children start from the main
    thread. A child whose parent died before prctl exits at once (status 125).
    """
    cmd = [sys.executable, "-I", os.path.abspath(__file__), str(os.getpid())]
    for name, value in (limits or {}).items():
        if name not in _LIMITS:
            raise ValueError(f"unknown limit {name!r} (expected one of {sorted(_LIMITS)})")
        cmd.append(f"--{name}={value}")
    return [*cmd, "--", *argv]


def _launch(args: list[str]) -> None:
    """The launcher's side of :func:`die_with_parent`: prctl, limits, exec."""
    parent, rest = int(args[0]), args[1:]
    split = rest.index("--")
    options, argv = rest[:split], rest[split + 1:]
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            os._exit(125)
    if os.getppid() != parent:
        os._exit(125)
    for option in options:
        name, _, value = option.removeprefix("--").partition("=")
        resource.setrlimit(_LIMITS[name], (int(value), int(value)))
    os.execvp(argv[0], argv)


def exit_on_signals() -> None:
    """Turn SIGTERM and SIGHUP into ``SystemExit`` (so ``finally`` blocks and
    context managers run), make a closed stdout harmless, and have the parent's
    death sent as SIGTERM.

    Call first thing in a ``main``; an asyncio program may later replace these
    handlers with loop ones. SIGPIPE is already ignored by Python: writing to a
    closed stdout raises BrokenPipeError, which ``print_safely`` swallows. The
    parent is ``make`` (``make run`` execs the demo): a SIGTERM sent to ``make``
    alone ends it without a word to its child, which would serve on.
    """
    def handler(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, handler)
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def print_safely(*args: object) -> None:
    """``print`` that survives a reader gone away (``make run | tee log``, Ctrl-C):
    the output is lost, the program goes on to stop its children."""
    try:
        print(*args, flush=True)
    except BrokenPipeError:
        # Point stdout at /dev/null so the interpreter's final flush does not fail too.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


if __name__ == "__main__":
    _launch(sys.argv[1:])
