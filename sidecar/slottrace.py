"""An opt-in trace of every admission's life, for the benchmarks' slot-time accounting.

Set ``SMG_SIDECAR_SLOT_TRACE=/path/file`` and the controller appends one line per
state change, ``<unix time> <kind> <admission id> [<field>]``:

* ``Q <class>`` queued (arrived and waits), ``X`` left the queue without a slot
  (timeout, cancel), ``A <class>`` admitted (from the queue or at once),
  ``P`` chosen as a preemption victim, ``R <reason>`` released.

bench.isolation joins these with the fake workers' records (which carry the
admission id) to say where every slot-second went. Off by default and not a
contract surface: wall-clock time so the workers' records line up.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import TextIO

ENV = "SMG_SIDECAR_SLOT_TRACE"
_FLUSH_SECS = 0.25


class SlotTrace:
    """Buffered lines, flushed a quarter second after the first unflushed one."""

    def __init__(self, out: TextIO) -> None:
        self._out = out
        self._flush: asyncio.TimerHandle | None = None

    @classmethod
    def from_env(cls) -> SlotTrace | None:
        path = os.environ.get(ENV)
        return cls(open(path, "a", buffering=1 << 16)) if path else None

    def write(self, kind: str, aid: str, field: str = "") -> None:
        self._out.write(f"{time.time():.6f} {kind} {aid} {field}\n")
        if self._flush is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                self._out.flush()
                return
            self._flush = loop.call_later(_FLUSH_SECS, self._do_flush)

    def _do_flush(self) -> None:
        self._flush = None
        self._out.flush()
