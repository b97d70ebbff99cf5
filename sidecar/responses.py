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
========================  ======  ==========================  ============================

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
from collections.abc import Mapping
from dataclasses import dataclass
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


@dataclass(frozen=True, slots=True)
class Reply:
    """One rejection as HTTP: what Envoy sends to the client."""

    status: int
    code: str
    message: str
    retry_after: int
    preempted: bool = False

    @property
    def headers(self) -> tuple[tuple[str, str], ...]:
        extra = (("x-smg-preempted", "true"),) if self.preempted else ()
        return (("x-smg-error-code", self.code), ("content-type", "application/json"),
                ("retry-after", str(self.retry_after)), *extra)

    @property
    def body(self) -> str:
        """The gateway's JSON error body, byte for byte."""
        return json.dumps(
            {"error": {"type": http.HTTPStatus(self.status).phrase, "code": self.code,
                       "message": self.message, "param": None}},
            separators=(",", ":"))


def reply(rejection: Rejection, cls: PriorityClass | None = None) -> Reply:
    """The contract's row for ``rejection``.

    ``cls``, the request's effective class, only words the class queue rows'
    messages; those rows need it.
    """
    if cls is None and rejection in (Rejection.QUEUE_FULL, Rejection.QUEUE_TIMEOUT):
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
        case _:
            assert_never(rejection)


# Every reply the sidecar can send, by (rejection, effective class): the senders
# serialise these once at start-up.
REPLIES: Final[Mapping[tuple[Rejection, PriorityClass], Reply]] = {
    (r, cls): reply(r, cls) for r in Rejection for cls in HIGH_TO_LOW}


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
    # ADMITTED and PREEMPTED are not refusals of a Check; CLIENT_CANCELLED has nobody
    # to answer (module docstring).
    raise ValueError(f"no response for a {outcome.value} denial")
