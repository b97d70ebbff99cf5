"""structlog set-up: JSON lines in production, readable key=value in a terminal."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable

import structlog

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
           "error": logging.ERROR}


def configure(fmt: str, level: str = "info") -> None:
    _state["debug"] = level == "debug"
    renderer: structlog.typing.Processor
    if fmt == "json":
        renderer = structlog.processors.JSONRenderer()
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )


def get(name: str) -> structlog.typing.FilteringBoundLogger:
    logger: structlog.typing.FilteringBoundLogger = structlog.get_logger(name)
    return logger


def debug_enabled() -> bool:
    """Cheap check so the hot path builds debug events only when they are printed."""
    return _state["debug"]


_state = {"debug": False}


class Throttled:
    """One warning per ``interval`` for a repeated condition, with the count since the last.

    For events that come in storms (every refused accept, every shed Check): a line
    each would cost more than the event and bury everything else.
    """

    def __init__(self, logger: structlog.typing.FilteringBoundLogger, event: str, *,
                 interval: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._log = logger
        self._event = event
        self._interval = interval
        self._clock = clock
        self._next = float("-inf")
        self._suppressed = 0

    def event(self, **kw: object) -> bool:
        """Count one occurrence; log it if the interval has passed. True when logged."""
        now = self._clock()
        if now < self._next:
            self._suppressed += 1
            return False
        self._log.warning(self._event, suppressed_since_last=self._suppressed,
                          interval_secs=self._interval, **kw)
        self._suppressed = 0
        self._next = now + self._interval
        return True
