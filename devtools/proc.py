"""Child processes that die with their parent, and a parent that stops cleanly.

The demo, the test harness and the benchmarks start the sidecar, Envoy and load
clients as child processes in sessions of their own (a shell's job control must
not signal them). Then nothing kills them when the parent dies, and they keep
ports 9001, 9090, 9901 and 10000. So every child asks the kernel for SIGKILL
when its parent goes (Linux ``PR_SET_PDEATHSIG``), whatever killed the parent,
SIGKILL included; and the demo turns SIGTERM, SIGHUP and a closed stdout into
an ordinary, cleaning-up exit.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Callable
from types import FrameType

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> Callable[[], None]:
    """A ``preexec_fn`` for Popen: the child gets SIGKILL when this process dies.

    The death signal follows the parent *thread*; all harness children are
    started from the main thread. If the parent already died between fork and
    prctl (the child was re-parented), the child exits at once.
    """
    parent = os.getpid()

    def preexec() -> None:
        if sys.platform.startswith("linux"):
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
                os._exit(125)
        if os.getppid() != parent:
            os._exit(125)

    return preexec


def exit_on_signals() -> None:
    """Turn SIGTERM and SIGHUP into ``SystemExit`` (so ``finally`` blocks and
    context managers run), and make a closed stdout harmless.

    Call first thing in a ``main``; an asyncio program may later replace these
    handlers with loop ones. SIGPIPE is already ignored by Python: writing to a
    closed stdout raises BrokenPipeError, which ``print_safely`` swallows.
    """
    def handler(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, handler)


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
