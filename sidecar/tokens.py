"""Tokens, not requests: what a request costs, and each tenant's token budgets.

Pure (no I/O, no asyncio, the clock passed in), in three parts (docs/design.md, "Token
budgets"):

* **The estimate at admission** (:func:`estimate`). Input tokens from the request's
  length (the body Envoy sent with the Check, or its ``content-length``) divided by
  ``bytes_per_token``; output tokens from ``max_completion_tokens`` or ``max_tokens``
  (the body's, or what Envoy's ``json_to_metadata`` filter read from it), the pool's
  ``default_max_tokens`` when absent. Every input that cannot be used as it stands is a
  counted fallback (:data:`FALLBACKS`), never an error: the request is admitted or
  refused on the estimate it gets.
* **The settlement at completion** (:func:`settle_amount`). The response's own
  ``usage`` (read by Envoy's Lua filter into the access log), checked; where it is
  missing or cannot be believed (negative, not an integer, more than
  :data:`ABSURD_FACTOR` times the estimate), an estimate from the bytes the access log
  reports, never more output than was reserved.
* **The budgets** (:class:`TokenBook`). Per tenant, any number of fixed windows
  (:class:`Window`: a minute to a calendar month, in UTC), each a token amount. A request
  is *reserved* at its Check: it is refused when, in any window, what was settled in the
  window so far plus what every running request of the tenant reserved plus its own
  estimate would pass the amount. At completion its reservation is replaced by what it
  really used. So concurrent requests cannot overshoot a budget by more than their
  estimates' error (the bound: docs/design.md).

Each reservation lives through the table :data:`TRANSITIONS` (states :class:`Stage`):

==========  =================================================================================
stage       leaves by: call (what triggers it) → next stage
==========  =================================================================================
*(new)*     ``reserve`` (the Check) → PENDING, or refused (nothing is kept)
PENDING     ``bind`` (admitted: the admission id is known) → HELD;
            ``cancel`` (queue full, timed out, client left) → CANCELLED
HELD        ``settle`` (its final access-log entry) → SETTLED;
            ``ended`` (the pool no longer holds it and no final entry came) → ENDED
ENDED       ``settle`` (the entry came after all: preempted, late) → SETTLED;
            ``charge`` (still none a sweep later) → CHARGED: its estimate counts as used
==========  =================================================================================

SETTLED, CANCELLED and CHARGED are final: the reservation is forgotten and a second
``settle`` of the same id changes nothing (:data:`UNKNOWN`). Every reservation ends in
exactly one of them, so a token is never lost and never counted twice.

``accounting: settle_only`` (a test switch, never for production) skips the
reservation: a Check sees only what was already settled, which is how post-hoc quota
schemes work and why a burst overshoots them (tests/test_tokens_e2e.py shows both).
"""

from __future__ import annotations

import calendar
import datetime
import enum
import json
import math
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

# ------------------------------------------------------------------------ settings

ACCOUNTING_MODES = ("reserve", "settle_only")
BUDGET_MODES = ("enforce", "shadow")
ABSURD_FACTOR = 1000
"""A usage above this many times the request's estimate is not believed."""
MAX_TOKENS_LIMIT = 10**9
"""Largest ``max_output_tokens`` and budget amount a file may set (far above any model)."""
MAX_BUDGETS = 8
"""Most windows per tenant: every Check of a budgeted tenant checks each."""


@dataclass(frozen=True, slots=True)
class TokenSettings:
    """A pool's estimator and accounting settings (``tokens:``, ``pools.<p>.tokens:``)."""

    default_max_tokens: int = 256
    """Output tokens charged when a request names no (usable) ``max_tokens``."""
    max_output_tokens: int = 32768
    """A larger ``max_tokens`` is charged as this (counted ``max_tokens_clamped``)."""
    bytes_per_token: float = 4.0
    """Request and response bytes per token, for the estimates from lengths."""
    accounting: str = "reserve"
    """``reserve`` (reserve at the Check, settle at completion) or ``settle_only``."""
    budget_mode: str = "enforce"
    """``enforce`` refuses over budget; ``shadow`` only counts what it would refuse."""
    refuse_past_context: bool = False
    """Refuse (413) a request whose input estimate exceeds the context of every slot the
    workers report (llama.cpp's ``n_ctx`` per slot), instead of letting it take a slot."""
    admit_by_kv: bool = False
    """Admit by KV capacity in tokens beside slots: each admitted request holds its
    estimate against the KV capacity its pool's workers report, and waits in its class
    queue while it does not fit (docs/design.md, "Admission by KV capacity")."""


# ------------------------------------------------------------------------- windows

_UNITS = {"m": 60, "h": 3600, "d": 86400}
_NAMED = {"minute": 60, "hour": 3600, "day": 86400, "week": 7 * 86400}
_SPAN = re.compile(r"^([1-9][0-9]{0,4})([mhd])$")
MIN_WINDOW_SECS = 60
MAX_WINDOW_SECS = 31 * 86400
WINDOW_RULE = ("minute, hour, day, week, month (calendar, UTC), or N followed by m, h or d "
               "(fixed windows from the Unix epoch), between 1 minute and 31 days")
_EPOCH_MONDAY = 4 * 86400  # 1970-01-01 was a Thursday; weeks start on Monday


@dataclass(frozen=True, slots=True)
class Window:
    """A fixed window of the wall clock (UTC): ``month`` follows the calendar, the
    others are ``seconds`` long, aligned to the epoch (``week``: to a Monday)."""

    name: str
    seconds: int  # 0 for the calendar month

    @staticmethod
    def parse(text: object) -> Window | None:
        """The window a file names (None: not one of :data:`WINDOW_RULE`)."""
        if not isinstance(text, str):
            return None
        if text == "month":
            return Window("month", 0)
        if text in _NAMED:
            return Window(text, _NAMED[text])
        m = _SPAN.match(text)
        if m is None:
            return None
        secs = int(m.group(1)) * _UNITS[m.group(2)]
        if not MIN_WINDOW_SECS <= secs <= MAX_WINDOW_SECS:
            return None
        return Window(text, secs)

    def period(self, now: float) -> tuple[float, float]:
        """The (start, end) of the window's period that holds ``now`` (seconds since
        the epoch)."""
        if self.seconds == 0:
            day = datetime.datetime.fromtimestamp(now, datetime.UTC)
            start = datetime.datetime(day.year, day.month, 1, tzinfo=datetime.UTC)
            days = calendar.monthrange(day.year, day.month)[1]
            return start.timestamp(), start.timestamp() + days * 86400
        offset = _EPOCH_MONDAY if self.name == "week" else 0
        begin = math.floor((now - offset) / self.seconds) * self.seconds + offset
        return float(begin), float(begin + self.seconds)


@dataclass(frozen=True, slots=True)
class Budget:
    """``tokens`` per period of ``window``."""

    window: Window
    tokens: int


# ------------------------------------------------------------------------ estimate

FALLBACKS = ("not_json", "no_length", "max_tokens_missing", "max_tokens_invalid",
             "max_tokens_clamped", "usage_missing", "usage_invalid", "usage_absurd",
             "charged_estimate", "settle_late", "ledger_unavailable")
"""Every counted fallback (``smg_sidecar_token_fallback_total{reason}``): where an input
was missing or could not be used, and what was used instead (docs/reference.md)."""


@dataclass(frozen=True, slots=True)
class RequestFacts:
    """What the Check tells about a request's size, raw (judged by :func:`estimate`)."""

    length: int | None = None
    """Request body bytes: the body Envoy sent, else ``content-length`` (None: unknown)."""
    body: bytes | None = None
    """The body, when Envoy sent it whole with the Check (``with_request_body``)."""
    max_tokens: object = None
    """``max_completion_tokens``, else ``max_tokens``, as Envoy's ``json_to_metadata``
    read it (None: absent or not read)."""


@dataclass(frozen=True, slots=True)
class Estimate:
    input: int
    output: int
    fallbacks: tuple[str, ...] = ()

    @property
    def total(self) -> int:
        return self.input + self.output


def _tokens_of(nbytes: int, settings: TokenSettings) -> int:
    return math.ceil(max(0, nbytes) / settings.bytes_per_token)


def _max_tokens(raw: object, settings: TokenSettings) -> tuple[int, str | None]:
    """The output tokens a request's ``max_tokens`` value reserves, and the fallback."""
    if raw is None:
        return settings.default_max_tokens, "max_tokens_missing"
    # A JSON number may reach here as a float (json_to_metadata keeps doubles): an
    # integral one is an integer. bool is an int subclass: not a count.
    if isinstance(raw, bool) or not isinstance(raw, int | float):
        return settings.default_max_tokens, "max_tokens_invalid"
    if isinstance(raw, float) and not (math.isfinite(raw) and raw.is_integer()):
        return settings.default_max_tokens, "max_tokens_invalid"
    value = int(raw)
    if value < 1:
        return settings.default_max_tokens, "max_tokens_invalid"
    if value > settings.max_output_tokens:
        return settings.max_output_tokens, "max_tokens_clamped"
    return value, None


def _from_body(body: bytes) -> tuple[object, bool]:
    """(``max_completion_tokens`` or ``max_tokens``, parsed) from a JSON body."""
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError):
        return None, False
    if not isinstance(doc, dict):
        return None, False
    raw = doc.get("max_completion_tokens")
    return (raw if raw is not None else doc.get("max_tokens")), True


def estimate(facts: RequestFacts, settings: TokenSettings) -> Estimate:
    """The tokens a request is expected to cost (module docstring)."""
    fallbacks: list[str] = []
    raw = facts.max_tokens
    if facts.body is not None:
        raw, parsed = _from_body(facts.body)
        if not parsed:
            fallbacks.append("not_json")
    if facts.length is None:
        fallbacks.append("no_length")
        input_tokens = 0
    else:
        input_tokens = _tokens_of(facts.length, settings)
    output, why = _max_tokens(raw, settings)
    if why is not None and "not_json" not in fallbacks:
        fallbacks.append(why)
    return Estimate(input_tokens, output, tuple(fallbacks))


# ---------------------------------------------------------------------- settlement

_COUNT = re.compile(r"^[0-9]{1,15}$")


@dataclass(frozen=True, slots=True)
class Usage:
    """What the access log carried of the response's ``usage`` block, raw text (each
    None: absent), and the body bytes Envoy counted."""

    prompt: str | None = None
    completion: str | None = None
    total: str | None = None
    request_bytes: int = 0
    response_bytes: int = 0


def _count(text: str | None) -> int | str | None:
    """A usage field: its count, None when absent, "invalid" when not a count."""
    if text is None:
        return None
    text = text.strip().strip('"')
    return int(text) if _COUNT.match(text) else "invalid"


def settle_amount(usage: Usage, est: Estimate, settings: TokenSettings
                  ) -> tuple[int, str | None]:
    """The tokens a completed request is charged, and the fallback taken (None: its own
    ``usage``). Without a believable usage: the bytes' estimate, input from the request
    body, output from the response body but never more than was reserved for it."""
    parts = [_count(usage.prompt), _count(usage.completion), _count(usage.total)]
    reason: str | None
    if all(p is None for p in parts):
        reason = "usage_missing"
    elif any(p == "invalid" for p in parts):
        reason = "usage_invalid"
    else:
        prompt, completion, total = (p if isinstance(p, int) else None for p in parts)
        if prompt is not None and completion is not None:
            used = prompt + completion
            if total is not None and total != used:
                reason = "usage_invalid"  # a block that contradicts itself
                used = -1
        elif total is not None:
            used = total
        else:
            used = -1
            reason = "usage_invalid"  # half a block: no total to trust
        if used >= 0:
            if used > ABSURD_FACTOR * max(1, est.total):
                reason = "usage_absurd"
            else:
                return used, None
    output = min(est.output, _tokens_of(usage.response_bytes, settings))
    return _tokens_of(usage.request_bytes, settings) + output, reason


# ------------------------------------------------------------------------ the book


class Stage(enum.Enum):
    """Where one reservation is (module table)."""

    PENDING = "pending"
    HELD = "held"
    ENDED = "ended"
    SETTLED = "settled"
    CANCELLED = "cancelled"
    CHARGED = "charged"


TRANSITIONS: Mapping[tuple[Stage, str], Stage] = {
    (Stage.PENDING, "bind"): Stage.HELD,
    (Stage.PENDING, "cancel"): Stage.CANCELLED,
    (Stage.HELD, "settle"): Stage.SETTLED,
    (Stage.HELD, "ended"): Stage.ENDED,
    (Stage.ENDED, "settle"): Stage.SETTLED,
    (Stage.ENDED, "charge"): Stage.CHARGED,
}
"""The module table as data: ``(stage, call) -> next stage``; any other pair raises."""
FINAL = frozenset({Stage.SETTLED, Stage.CANCELLED, Stage.CHARGED})
UNKNOWN = "unknown"


class IllegalMove(Exception):
    """A call the reservation's stage does not allow (a bug in the caller)."""


@dataclass(slots=True)
class Reservation:
    tenant: str
    estimate: Estimate
    reserved: int  # what counts against the tenant's budgets while it runs (0: settle_only)
    cls: str
    stage: Stage = Stage.PENDING
    key: str = ""
    ledger_id: str = ""  # with --coordination-url: its reservation in the fleet's ledger


@dataclass(slots=True)
class _Period:
    start: float
    end: float
    used: int = 0


@dataclass(slots=True)
class _Tenant:
    budgets: tuple[Budget, ...]
    periods: list[_Period] = field(default_factory=list)
    reserved: int = 0


@dataclass(frozen=True, slots=True)
class Allowed:
    """The Check may go on (its reservation is PENDING)."""

    reservation: Reservation


@dataclass(frozen=True, slots=True)
class OverBudget:
    """Refused: in ``window`` the request does not fit.

    ``retry_after``: seconds until it could fit, from the windows that refuse it (the end
    of the period, when what was settled alone leaves no room; else at least 1 s, for the
    running requests' reservations to settle). ``never``: its estimate alone is more
    than the window's amount."""

    window: str
    retry_after: float
    limit: int
    used: int
    reserved: int
    never: bool = False
    # --shadow or budget_mode: shadow: the request goes on, reserved all the same.
    reservation: Reservation | None = None


@dataclass(frozen=True, slots=True)
class Remaining:
    """One tenant's window as the metrics and the status page show it."""

    tenant: str
    window: str
    limit: int
    used: int
    reserved: int

    @property
    def remaining(self) -> int:
        return self.limit - self.used - self.reserved


class TokenBook:
    """Every budgeted tenant's windows and every open reservation of one pool.

    ``now`` is wall-clock seconds since the epoch (the windows are calendar ones):
    :meth:`reserve` and :meth:`settle` take it from the caller.
    """

    def __init__(self, budgets: Mapping[str, tuple[Budget, ...]],
                 settings: TokenSettings = TokenSettings()) -> None:
        self.settings = settings
        self._tenants: dict[str, _Tenant] = {}
        self._open: dict[str, Reservation] = {}  # by admission id, once bound
        self.configure(budgets, settings)

    def configure(self, budgets: Mapping[str, tuple[Budget, ...]],
                  settings: TokenSettings) -> None:
        """A (re)loaded file: the tenants' budgets. A window a tenant keeps keeps what was
        used in its period; reservations of running requests stay."""
        self.settings = settings
        old = self._tenants
        self._tenants = {}
        for tenant, bs in budgets.items():
            t = _Tenant(tuple(bs))
            was = old.get(tenant)
            if was is not None:
                t.reserved = was.reserved
                by_window = {b.window: p for b, p in zip(was.budgets, was.periods,
                                                         strict=False)}
                t.periods = [by_window.get(b.window, _Period(0.0, 0.0)) for b in t.budgets]
            else:
                t.periods = [_Period(0.0, 0.0) for _ in t.budgets]
            self._tenants[tenant] = t
        # A tenant that lost its budgets keeps what its running requests reserved, so
        # their settle (or cancel) takes back exactly what they added.
        for tenant, was in old.items():
            if tenant not in self._tenants and was.reserved:
                self._tenants[tenant] = _Tenant((), [], was.reserved)

    @property
    def active(self) -> bool:
        """Some tenant has a budget."""
        return any(t.budgets for t in self._tenants.values())

    def budgeted(self, tenant: str) -> bool:
        t = self._tenants.get(tenant)
        return t is not None and bool(t.budgets)

    def _roll(self, t: _Tenant, now: float) -> None:
        for b, p in zip(t.budgets, t.periods, strict=True):
            if not p.start <= now < p.end:
                p.start, p.end = b.window.period(now)
                p.used = 0

    # ---------------------------------------------------------------- transitions

    @staticmethod
    def _move(r: Reservation, call: str) -> None:
        nxt = TRANSITIONS.get((r.stage, call))
        if nxt is None:
            raise IllegalMove(f"{call} from {r.stage.value}")
        r.stage = nxt

    def reserve(self, tenant: str, est: Estimate, cls: str, now: float, *,
                enforce: bool = True) -> Allowed | OverBudget:
        """The Check of a request estimated at ``est``: reserved (PENDING), or refused.
        ``enforce=False``: a refusal is reported but the request goes on, reserved."""
        t = self._tenants.get(tenant)
        reserve = self.settings.accounting == "reserve"
        amount = est.total
        refusal: OverBudget | None = None
        if t is not None and t.budgets:
            self._roll(t, now)
            for b, p in zip(t.budgets, t.periods, strict=True):
                pending = t.reserved if reserve else 0
                if p.used + pending + amount <= b.tokens:
                    continue
                if amount > b.tokens:
                    wait, never = p.end - now, True
                elif p.used + amount > b.tokens:
                    wait, never = p.end - now, False
                else:  # only the running requests' reservations are in the way
                    wait, never = 1.0, False
                if refusal is None or wait > refusal.retry_after:
                    refusal = OverBudget(b.window.name, max(1.0, wait), b.tokens, p.used,
                                         pending, never)
        if refusal is not None and enforce:
            return refusal
        r = Reservation(tenant, est, amount if reserve and t is not None else 0, cls)
        if t is not None:
            t.reserved += r.reserved
        if refusal is not None:
            return OverBudget(refusal.window, refusal.retry_after, refusal.limit,
                              refusal.used, refusal.reserved, refusal.never, r)
        return Allowed(r)

    def bind(self, r: Reservation, aid: str) -> None:
        """PENDING → HELD: admitted as ``aid``."""
        self._move(r, "bind")
        r.key = aid
        self._open[aid] = r

    def cancel(self, r: Reservation) -> None:
        """PENDING → CANCELLED: never ran; its reservation is given back."""
        self._move(r, "cancel")
        self._unreserve(r)

    def settle(self, aid: str, used: int, now: float) -> Reservation | str:
        """HELD or ENDED → SETTLED: ``used`` tokens replace the reservation in every
        window. :data:`UNKNOWN` for an id with no open reservation (never reserved,
        already settled or charged): nothing changes."""
        r = self._open.get(aid)
        if r is None:
            return UNKNOWN
        self._move(r, "settle")
        del self._open[aid]
        self._unreserve(r)
        self._charge(r.tenant, used, now)
        return r

    def ended(self, aid: str) -> None:
        """HELD → ENDED: its pool no longer holds it and no final entry came yet."""
        r = self._open.get(aid)
        if r is not None and r.stage is Stage.HELD:
            self._move(r, "ended")

    def charge(self, aid: str, now: float) -> Reservation | None:
        """ENDED → CHARGED: no final entry will come; its estimate counts as used."""
        r = self._open.get(aid)
        if r is None or r.stage is not Stage.ENDED:
            return None
        self._move(r, "charge")
        del self._open[aid]
        self._unreserve(r)
        self._charge(r.tenant, r.estimate.total, now)
        return r

    def _unreserve(self, r: Reservation) -> None:
        t = self._tenants.get(r.tenant)
        if t is not None:
            t.reserved -= r.reserved

    def _charge(self, tenant: str, used: int, now: float) -> None:
        t = self._tenants.get(tenant)
        if t is None or not t.budgets:
            return
        self._roll(t, now)
        for p in t.periods:
            p.used += used

    # -------------------------------------------------------------------- views

    def open_ids(self) -> list[tuple[str, Stage]]:
        """Every bound reservation's admission id and stage (the pool's sweep)."""
        return [(aid, r.stage) for aid, r in self._open.items()]

    def reservation(self, aid: str) -> Reservation | None:
        return self._open.get(aid)

    def remaining(self, now: float) -> Iterator[Remaining]:
        """Every budgeted tenant's windows, as of ``now``."""
        for name, t in self._tenants.items():
            if not t.budgets:
                continue
            self._roll(t, now)
            for b, p in zip(t.budgets, t.periods, strict=True):
                yield Remaining(name, b.window.name, b.tokens, p.used, t.reserved)

    def reserved_total(self) -> int:
        return sum(t.reserved for t in self._tenants.values())


