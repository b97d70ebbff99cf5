"""The Responses table: what the client gets when the sidecar says no.

Every rejection the sidecar sends is one member of :class:`Rejection`, and
:func:`reply` maps each member, exhaustively, to the contract's row:

========================  ======  ==========================  ============================
rejection                 status  ``X-SMG-Error-Code``        extra headers
========================  ======  ==========================  ============================
QUEUE_FULL                429     ``scheduler_queue_full``    ``Retry-After: 2``
RATE_LIMITED              429     ``scheduler_queue_full``    ``Retry-After: 2``
OVERLOADED                429     ``scheduler_queue_full``    ``Retry-After: 2``
QUEUE_TIMEOUT             503     ``scheduler_queue_timeout`` ``Retry-After: 2``
PREEMPTED                 503     ``scheduler_preempted``     ``Retry-After: 1``,
                                                              ``X-SMG-Preempted: true``
LEGACY_QUEUE_FULL         429     ``admission_queue_full``    ``Retry-After: 2``
LEGACY_QUEUE_TIMEOUT      503     ``admission_queue_timeout`` ``Retry-After: 2``
UNKNOWN_POOL              429     ``scheduler_queue_full``    ``Retry-After: 2``
OVER_TARGET               429     ``scheduler_over_target``   ``Retry-After: 2``
OVER_BUDGET               429     ``scheduler_token_budget_   ``Retry-After`` computed:
                                  exceeded``                  until the window frees
                                                              enough tokens
PAST_CONTEXT              413     ``scheduler_token_context_  none (retrying cannot help)
                                  exceeded``
========================  ======  ==========================  ============================

OVER_TARGET is an extension, sent only with ``deadline_mode: enforce`` and a class's
``ttft_target_ms`` (docs/reference.md, "Deadlines"): the request would have queued
past its target. OVER_BUDGET is an extension too, sent only to a tenant with token
budgets (``tenant_policies.<t>.budgets``, docs/reference.md "Token budgets") whose
request does not fit one of its windows: :func:`over_budget` words it with the window and
the ``Retry-After`` the budget computed. PAST_CONTEXT is one too, sent only with
``tokens.refuse_past_context``: the request's input estimate exceeds the context of every
slot the workers report (:func:`past_context` words it with both figures), or with
``tokens.admit_by_kv``: its whole estimate exceeds the pool's KV capacity. With
``--overload-hints`` a refusal's ``Retry-After`` comes from the predicted drain time
instead (:func:`with_hints`), and ``--busy-status`` changes the status of the refusals
that mean "busy" (:data:`BUSY`).

Every reply also carries ``X-SMG-Error-Code``, ``content-type:
application/json`` and the body
``{"error":{"type":"<reason phrase>","code":"<code>","message":"<text>","param":null}}``.
The class queue rows name the class in the message; nothing else depends on it.

The contract's sixth row, "client went away while queued: 499
``scheduler_client_cancelled``, no headers (client is gone; count it)", is
**counted, never sent**, so it is not a member here. The client leaving is
what ends a queued Check: Envoy cancels the gRPC call, the handler's await is
cancelled and the waiter removed, and ``smg_scheduler_admit_total{outcome=
"client_cancelled"}`` counts it from the core's event. A cancelled call has no
response to carry a 499. Envoy also cancels the call when its own ext_authz
timeout fires; the sidecar cannot tell that apart, counts it the same way, and
Envoy answers the client itself (``status_on_error``). That is why the
timeout must outlast every queue (``--envoy-authz-timeout`` checks it).

Senders: ``authz`` encodes :data:`REPLIES` as the Check's
``DeniedHttpResponse``; ``completion`` sends PREEMPTED as an ext_proc
``ImmediateResponse``. Both serialise through :mod:`sidecar.codec`, once at
start-up.
"""

from __future__ import annotations

import enum
import http
import json
import math
import random
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Final, assert_never

from sidecar.classes import HIGH_TO_LOW, PriorityClass
from sidecar.scheduler import Outcome


class Rejection(enum.Enum):
    """Every response the sidecar sends instead of letting a request through."""

    QUEUE_FULL = enum.auto()
    RATE_LIMITED = enum.auto()
    # The sidecar's own bound on Checks held open at once (authz.MAX_OPEN_CHECKS).
    OVERLOADED = enum.auto()
    QUEUE_TIMEOUT = enum.auto()
    PREEMPTED = enum.auto()
    LEGACY_QUEUE_FULL = enum.auto()
    LEGACY_QUEUE_TIMEOUT = enum.auto()
    # The route names a pool this sidecar does not have (sidecar.pools).
    UNKNOWN_POOL = enum.auto()
    # Predicted to wait past its class's time-to-first-token target (deadline_mode: enforce).
    OVER_TARGET = enum.auto()
    # The tenant's token budget has no room for the request (sidecar.tokens).
    OVER_BUDGET = enum.auto()
    # The request's input fits no worker slot's context (tokens.refuse_past_context).
    PAST_CONTEXT = enum.auto()


@dataclass(frozen=True, slots=True)
class Reply:
    """One rejection as HTTP: what Envoy sends to the client."""

    status: int
    code: str
    message: str
    retry_after: int | None  # None: no Retry-After (coming back cannot help)
    preempted: bool = False
    wait_hint_ms: int | None = None  # --overload-hints: the predicted wait

    @property
    def headers(self) -> tuple[tuple[str, str], ...]:
        extra = (("x-smg-preempted", "true"),) if self.preempted else ()
        hint = (() if self.wait_hint_ms is None
                else ((WAIT_HINT_HEADER, str(self.wait_hint_ms)),))
        retry = () if self.retry_after is None else (("retry-after", str(self.retry_after)),)
        return (("x-smg-error-code", self.code), ("content-type", "application/json"),
                *retry, *extra, *hint)

    @property
    def body(self) -> str:
        """The gateway's JSON error body, byte for byte."""
        return json.dumps(
            {"error": {"type": reason_phrase(self.status), "code": self.code,
                       "message": self.message, "param": None}},
            separators=(",", ":"))


WAIT_HINT_HEADER = "x-smg-queue-wait-ms"
# Refusals that mean "busy, come back later" (--busy-status): all but a preemption.
BUSY: Final = frozenset({"QUEUE_FULL", "RATE_LIMITED", "OVERLOADED", "QUEUE_TIMEOUT",
                         "LEGACY_QUEUE_FULL", "LEGACY_QUEUE_TIMEOUT", "UNKNOWN_POOL",
                         "OVER_TARGET"})
RETRY_AFTER_BOUNDS = (1, 60)  # seconds, for a computed Retry-After
RETRY_AFTER_JITTER = 0.2  # ± this share, so refused clients do not come back together
OVER_BUDGET_CODE = "scheduler_token_budget_exceeded"
PAST_CONTEXT_CODE = "scheduler_token_context_exceeded"


def reason_phrase(status: int) -> str:
    """The status's reason phrase (529, which the standard library lacks, is Dynamo's and
    Cloudflare's "Site is overloaded")."""
    return "Site is overloaded" if status == 529 else http.HTTPStatus(status).phrase


def busy(rep: Reply, status: int | None) -> Reply:
    """``rep`` answered with the busy status (``--busy-status``); unchanged when unset."""
    return rep if status is None else replace(rep, status=status)


def with_hints(rep: Reply, predicted: float | None, rng: random.Random) -> Reply:
    """``--overload-hints``: ``Retry-After`` from ``predicted`` (the class queue's drain
    time, bounded and jittered) and the wait hint; the contract's value without one."""
    if predicted is None or not math.isfinite(predicted):
        return rep
    low, high = RETRY_AFTER_BOUNDS
    seconds = min(max(predicted, low), high) * rng.uniform(1 - RETRY_AFTER_JITTER,
                                                             1 + RETRY_AFTER_JITTER)
    return replace(rep, retry_after=max(low, math.ceil(seconds)),
                   wait_hint_ms=round(max(0.0, predicted) * 1000))


def reply(rejection: Rejection, cls: PriorityClass | None = None) -> Reply:
    """The contract's row for ``rejection``.

    ``cls``, the request's effective class, only words the class queue rows'
    messages; those rows need it.
    """
    if cls is None and rejection in (Rejection.QUEUE_FULL, Rejection.QUEUE_TIMEOUT,
                                     Rejection.OVER_TARGET):
        raise ValueError(f"{rejection.name} names the class in its message")
    c = cls.label if cls is not None else ""
    match rejection:
        case Rejection.QUEUE_FULL:
            return Reply(429, "scheduler_queue_full",
                         f"The '{c}' priority queue is full; retry later", retry_after=2)
        case Rejection.RATE_LIMITED:
            return Reply(429, "scheduler_queue_full",
                         "Request rate limit exceeded; retry later", retry_after=2)
        case Rejection.OVERLOADED:
            # A shed like the rate check's: the contract's shed row, either path.
            return Reply(429, "scheduler_queue_full",
                         "The admission sidecar is overloaded; retry later", retry_after=2)
        case Rejection.QUEUE_TIMEOUT:
            return Reply(503, "scheduler_queue_timeout",
                         f"Timed out waiting in the '{c}' priority queue", retry_after=2)
        case Rejection.PREEMPTED:
            return Reply(503, "scheduler_preempted",
                         "Preempted by a higher-priority request before the first byte",
                         retry_after=1, preempted=True)
        case Rejection.LEGACY_QUEUE_FULL:
            return Reply(429, "admission_queue_full",
                         "Too many concurrent requests; queue is full", retry_after=2)
        case Rejection.LEGACY_QUEUE_TIMEOUT:
            return Reply(503, "admission_queue_timeout",
                         "Timed out waiting for a concurrency slot", retry_after=2)
        case Rejection.UNKNOWN_POOL:
            # No contract row fits exactly; a pool with no slot and no queue is the
            # contract's "queue_size 0, no free slot": 429 scheduler_queue_full.
            return Reply(429, "scheduler_queue_full",
                         "No admission pool is configured for this route; retry later",
                         retry_after=2)
        case Rejection.OVER_BUDGET:
            raise ValueError("OVER_BUDGET names its window and computes its Retry-After: "
                             "over_budget()")
        case Rejection.PAST_CONTEXT:
            raise ValueError("PAST_CONTEXT names the request's tokens: past_context()")
        case Rejection.OVER_TARGET:
            return Reply(429, "scheduler_over_target",
                         f"The '{c}' priority queue would not start this request within "
                         "its time-to-first-token target; retry later", retry_after=2)
        case _:
            assert_never(rejection)


def over_budget(window: str, retry_after: float, never: bool = False) -> Reply:
    """The OVER_BUDGET reply for a request that does not fit the tenant's ``window``:
    ``Retry-After`` is when the window frees enough tokens (whole seconds, at least 1);
    ``never``: the request alone is larger than the window's amount."""
    if never:
        message = (f"This request's estimated tokens exceed the tenant's whole '{window}' "
                   "token budget; it cannot be admitted in any window (lower max_tokens)")
    else:
        message = f"The tenant's '{window}' token budget has no room for this request"
    return Reply(429, OVER_BUDGET_CODE, message, retry_after=max(1, math.ceil(retry_after)))


def past_context(tokens: int, context: int, limit: str = "slot") -> Reply:
    """The PAST_CONTEXT reply: the request's input estimate (``tokens``) exceeds the most
    any worker slot holds (``context``); with ``limit="kv"`` (``tokens.admit_by_kv``) its
    whole estimate exceeds the pool's KV capacity (``context``). No Retry-After: the same
    request never fits."""
    if limit == "kv":
        message = (f"This request's estimated {tokens} tokens (prompt and output) exceed the "
                   f"{context}-token KV capacity of all workers together; shorten the prompt "
                   "or lower max_tokens")
    else:
        message = (f"This request's estimated {tokens} input tokens exceed the {context}-token "
                   "context of every worker slot; shorten the prompt")
    return Reply(413, PAST_CONTEXT_CODE, message, retry_after=None)


# Every reply the sidecar can send, by (rejection, effective class): the senders
# serialise these once at start-up.
# (OVER_BUDGET and PAST_CONTEXT are not: worded per refusal, by over_budget, past_context.)
REPLIES: Final[Mapping[tuple[Rejection, PriorityClass], Reply]] = {
    (r, cls): reply(r, cls) for r in Rejection
    if r not in (Rejection.OVER_BUDGET, Rejection.PAST_CONTEXT) for cls in HIGH_TO_LOW}


def for_denial(outcome: Outcome, *, legacy: bool, rate_limited: bool) -> Rejection:
    """The row for an admission the controller refused (``Denied``)."""
    if rate_limited:
        # The flag table: the request-rate check sheds with 429 scheduler_queue_full,
        # on either admission path.
        return Rejection.RATE_LIMITED
    if outcome is Outcome.REJECTED_QUEUE_FULL:
        return Rejection.LEGACY_QUEUE_FULL if legacy else Rejection.QUEUE_FULL
    if outcome is Outcome.REJECTED_QUEUE_TIMEOUT:
        return Rejection.LEGACY_QUEUE_TIMEOUT if legacy else Rejection.QUEUE_TIMEOUT
    if outcome is Outcome.REJECTED_OVER_TARGET:
        return Rejection.OVER_TARGET
    # ADMITTED and PREEMPTED are not refusals of a Check; CLIENT_CANCELLED has nobody
    # to answer (module docstring).
    raise ValueError(f"no response for a {outcome.value} denial")
