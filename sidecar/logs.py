"""structlog set-up: JSON lines in production, readable key=value in a terminal."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import sys
import time
from collections.abc import Callable, MutableMapping
from typing import Any

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
            _redact_processor,  # after the traceback is text: it may quote a secret too
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


def id_tag(aid: str) -> str:
    """An admission id as info and warning lines show it: 12 hex digits of its hash.

    The same id always gives the same tag (so lines about one admission can be matched,
    and a debug line's full id to them), but the tag does not give the id back: a
    reader of the log cannot release or renew an admission by it. Full ids only at debug.
    """
    return hashlib.blake2s(aid.encode(errors="replace"), digest_size=6).hexdigest()


# ------------------------------------------------------------------- secrets
# A secret the process holds (the workers' API key) must never reach a log line, even
# when a worker echoes it back into a value the sidecar quotes. Every line passes
# through _redact_processor; code that builds lines from untrusted text may also call
# redact() itself (the structlog test helpers bypass the processors).

REDACTED = "[redacted]"
REDACT_WINDOW = 8
"""Any run of this many characters of a secret (or the whole of a shorter one) is cut:
a worker quoting part of the key (a value clipped to 40 characters) is caught too."""


class Redactor:
    """Finds any :data:`REDACT_WINDOW`-character piece of its secrets in a text."""

    def __init__(self) -> None:
        self._pieces: dict[int, set[str]] = {}  # window length -> pieces of that length

    def add(self, secret: str) -> None:
        if not secret:
            return
        w = min(REDACT_WINDOW, len(secret))
        pieces = self._pieces.setdefault(w, set())
        pieces.update(secret[i:i + w] for i in range(len(secret) - w + 1))

    def __bool__(self) -> bool:
        return bool(self._pieces)

    def scrub(self, text: str) -> str:
        """``text`` with every run covered by a piece of a secret replaced."""
        if not self._pieces:
            return text
        hit = bytearray(len(text))
        found = False
        for w, pieces in self._pieces.items():
            for i in range(len(text) - w + 1):
                if text[i:i + w] in pieces:
                    hit[i:i + w] = b"\x01" * w
                    found = True
        if not found:
            return text
        out: list[str] = []
        i = 0
        while i < len(text):
            if hit[i]:
                while i < len(text) and hit[i]:
                    i += 1
                out.append(REDACTED)
            else:
                j = i
                while j < len(text) and not hit[j]:
                    j += 1
                out.append(text[i:j])
                i = j
        return "".join(out)

    def scrub_value(self, value: object) -> object:
        """A log field with every string in it scrubbed (containers walked)."""
        if isinstance(value, str):
            return self.scrub(value)
        if value is None or isinstance(value, bool | int | float):
            return value
        if isinstance(value, dict):
            return {self.scrub_value(k): self.scrub_value(v) for k, v in value.items()}
        if isinstance(value, list | tuple | set | frozenset):
            return [self.scrub_value(v) for v in value]
        text = str(value)  # rendered as text anyway; only a changed one is replaced
        scrubbed = self.scrub(text)
        return value if scrubbed == text else scrubbed


_secrets = Redactor()


def register_secret(secret: str) -> None:
    """From now on no log line of this process shows ``secret`` or a piece of it."""
    _secrets.add(secret)


def redact(value: object) -> object:
    """``value`` as a log line may show it (every registered secret cut out)."""
    return _secrets.scrub_value(value) if _secrets else value


def _redact_processor(logger: Any, method: str,
                      event_dict: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    if not _secrets:
        return event_dict
    for key, value in event_dict.items():
        event_dict[key] = _secrets.scrub_value(value)
    return event_dict


class Throttled:
    """One line per ``interval`` for a repeated condition, with the count since the last.

    For events that come in storms (every refused accept, every shed Check, every
    malformed message a caller of the gRPC port sends): a line each would cost more than
    the event and bury everything else. ``level``: ``warning`` (the default) or ``info``.
    """

    def __init__(self, logger: structlog.typing.FilteringBoundLogger, event: str, *,
                 interval: float = 10.0, clock: Callable[[], float] = time.monotonic,
                 level: str = "warning") -> None:
        self._log = logger
        self._event = event
        self._interval = interval
        self._clock = clock
        self._next = float("-inf")
        self._suppressed = 0
        self._emit = logger.info if level == "info" else logger.warning

    def event(self, **kw: object) -> bool:
        """Count one occurrence; log it if the interval has passed. True when logged."""
        now = self._clock()
        if now < self._next:
            self._suppressed += 1
            return False
        self._emit(self._event, suppressed_since_last=self._suppressed,
                   interval_secs=self._interval, **kw)
        self._suppressed = 0
        self._next = now + self._interval
        return True


class RejectionSummary:
    """Rejections counted by class and outcome, logged as one ``rejections`` line at info
    at most once per ``interval`` (each rejection itself is a ``rejected`` line at debug).

    At 10x overload most Checks are shed: a JSON line each cost ~40 % of the
    handler's own time and ~1,400 lines/s bury everything else, while the metrics
    already count every rejection. The first rejection after a quiet interval is
    logged at once; the ones after it are summed and logged when the interval ends
    (``schedule`` arms that flush), so a burst always shows within ``interval``.
    """

    MAX_TENANTS = 1000  # distinct tenants counted per interval; the rest are "other"
    TOP_TENANTS = 5

    def __init__(self, logger: structlog.typing.FilteringBoundLogger, *,
                 interval: float = 10.0, clock: Callable[[], float] = time.monotonic,
                 schedule: Callable[[float, Callable[[], None]], object] | None = None
                 ) -> None:
        self._log = logger
        self._interval = interval
        self._clock = clock
        self._schedule = schedule
        self._next = float("-inf")
        self._armed = False
        self._counts: dict[tuple[str, str], int] = {}
        self._tenants: dict[str, int] = {}

    def add(self, cls: str, outcome: str, tenant: str) -> None:
        key = (cls, outcome)
        self._counts[key] = self._counts.get(key, 0) + 1
        tenants = self._tenants
        if tenant in tenants or len(tenants) < self.MAX_TENANTS:
            tenants[tenant] = tenants.get(tenant, 0) + 1
        else:
            tenants["other"] = tenants.get("other", 0) + 1
        if self._armed:
            return
        now = self._clock()
        if now >= self._next:
            self.flush()
            return
        self._armed = True
        schedule = self._schedule if self._schedule is not None else _call_later
        schedule(self._next - now, self.flush)

    def flush(self) -> None:
        """Log what was counted since the last line (nothing counted: no line)."""
        self._armed = False
        if not self._counts:
            return
        counts = {f"{c}/{o}": n for (c, o), n in sorted(self._counts.items())}
        top = sorted(self._tenants.items(), key=lambda kv: (-kv[1], kv[0]))[:self.TOP_TENANTS]
        self._log.info("rejections", total=sum(counts.values()), by_class_outcome=counts,
                       top_tenants=dict(top), interval_secs=self._interval)
        self._counts.clear()
        self._tenants.clear()
        self._next = self._clock() + self._interval


def _call_later(delay: float, fn: Callable[[], None]) -> object:
    return asyncio.get_running_loop().call_later(delay, fn)


# The outcomes a shadow counts as refusals: what enforcement would have answered 429/503.
SHADOW_REFUSALS = ("rejected_queue_full", "rejected_queue_timeout")


class ShadowSummary:
    """``--shadow``'s verdict: the decisions enforcement would have made, by class and
    outcome and the tenants it would have refused, as one ``shadow_verdicts`` line at info
    per ``interval`` while decisions are made, and as running totals (the status page).

    ``add`` is called once per would-be decision (exactly where
    ``smg_sidecar_shadow_admit_total`` counts one), so the totals are that counter's. The
    line gives, per class, the share of its decided requests enforcement would have
    refused (``would_refuse_pct``): the number docs/operations.md's rule for switching to
    enforcement reads.
    """

    MAX_TENANTS = 1000  # distinct tenants counted in the totals; the rest are "other"
    TOP_TENANTS = 5

    def __init__(self, logger: structlog.typing.FilteringBoundLogger, *,
                 interval: float = 60.0, clock: Callable[[], float] = time.monotonic,
                 schedule: Callable[[float, Callable[[], None]], object] | None = None
                 ) -> None:
        self._log = logger
        self.interval = interval
        self._clock = clock
        self._schedule = schedule
        self._armed = False
        self.since = clock()
        # Running totals (never reset): (class, outcome) -> n; (class, tenant) -> refusals.
        self.totals: dict[tuple[str, str], int] = {}
        self.refused_by_tenant: dict[tuple[str, str], int] = {}
        self._tenants: set[str] = set()
        # This interval's.
        self._counts: dict[tuple[str, str], int] = {}
        self._refused: dict[str, int] = {}

    def add(self, cls: str, outcome: str, tenant: str) -> None:
        key = (cls, outcome)
        self.totals[key] = self.totals.get(key, 0) + 1
        self._counts[key] = self._counts.get(key, 0) + 1
        if outcome in SHADOW_REFUSALS:
            if tenant not in self._tenants:
                if len(self._tenants) < self.MAX_TENANTS:
                    self._tenants.add(tenant)
                else:
                    tenant = "other"
            tkey = (cls, tenant)
            self.refused_by_tenant[tkey] = self.refused_by_tenant.get(tkey, 0) + 1
            self._refused[tenant] = self._refused.get(tenant, 0) + 1
        if not self._armed:
            self._armed = True
            schedule = self._schedule if self._schedule is not None else _call_later
            schedule(self.interval, self.flush)

    @staticmethod
    def refuse_pct(counts: dict[tuple[str, str], int], cls: str) -> float:
        """Of ``cls``'s decided requests, the share (in %) enforcement would have refused.
        A decided request ends ``admitted`` or refused once (a preemption comes after its
        admission and is not a second decision)."""
        refused = sum(counts.get((cls, o), 0) for o in SHADOW_REFUSALS)
        decided = refused + counts.get((cls, "admitted"), 0)
        return round(100.0 * refused / decided, 3) if decided else 0.0

    def flush(self) -> None:
        """Log what was decided since the last line (nothing decided: no line)."""
        self._armed = False
        if not self._counts:
            return
        counts = self._counts
        classes = sorted({c for c, _ in counts})
        top = sorted(self._refused.items(), key=lambda kv: (-kv[1], kv[0]))[:self.TOP_TENANTS]
        self._log.info(
            "shadow_verdicts", decided=sum(counts.values()),
            by_class_outcome={f"{c}/{o}": n for (c, o), n in sorted(counts.items())},
            would_refuse_pct={c: self.refuse_pct(counts, c) for c in classes},
            would_preempt={c: n for (c, o), n in sorted(counts.items()) if o == "preempted"},
            top_refused_tenants=dict(top), interval_secs=self.interval)
        self._counts = {}
        self._refused = {}
