"""``envoy.service.auth.v3.Authorization/Check``: Envoy asks, the sidecar decides.

Per request: resolve the tenant from the one configured trusted source,
classify and clamp the priority, then await admission. A queued request holds
its Check call open; when Envoy cancels the call (client gone, Envoy timeout)
the waiter is removed and counted as ``client_cancelled``.

Wired on ``grpc.aio`` with generic handlers and bytes in/out: the codec
adapter decodes, and every denial is a row of :mod:`sidecar.responses`
serialised once at start-up.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, NoReturn

import grpc

from sidecar import codec, logs, responses
from sidecar.admission import Denied
from sidecar.classes import PRIORITY_HEADER, Classification, PriorityClass, classify
from sidecar.config import TenantSource
from sidecar.liveness import EnvoyLiveness
from sidecar.metrics import Recorder
from sidecar.pools import BudgetDenied, ContextDenied, Pool, Pools
from sidecar.scheduler import Outcome
from sidecar.tracing import AdmissionSpan, AdmissionTracer

ANONYMOUS = "anonymous"
# Anonymous requests clamped, with no tenant ever seen, before tenant_source_yields_no_tenant.
ANONYMOUS_CLAMPS_WARNED = 20
# Checks held open at once (queued, or being decided) before a new one is shed with
# the counted OVERLOADED reply: bounds the memory a burst can pin. Above any sane
# sum of class queue sizes, so in practice only a flood reaches it.
MAX_OPEN_CHECKS = 16384
# grpc-core keeps calls the event loop has not picked up yet in a pending queue and,
# by default, drops them at random above 1,000 and always above 3,000 (CANCELLED /
# RESOURCE_EXHAUSTED, never seen by the handler: Envoy turns that into a bare 503).
# With both limits above MAX_OPEN_CHECKS every Check reaches the handler, which then
# answers it with a decision. A call still waits there while the loop is busy; its
# own deadline (Envoy's authz timeout) is what ends a wait that is too long.
MAX_PENDING_CALLS = 2 * MAX_OPEN_CHECKS
# Keepalive pings on every connection, also with no call open (an idle Envoy's only
# call is its access-log stream): a host that vanished without closing its sockets
# loses its streams within KEEPALIVE_TIME + KEEPALIVE_TIMEOUT, and then its slots
# after --envoy-owner-grace-secs (sidecar.liveness). Measured with grpcio 1.85 and a
# SIGSTOPped Envoy: keepalive_timeout alone never closed the connection (an
# unanswered ping stayed pending until Envoy resumed); with ping_timeout_ms set too
# the slots were back 16.0–16.2 s after the stop (10 + 5 + a 1 s grace). BDP probing is
# off so no other ping is in flight when the keepalive one goes; the messages here
# are small, so flow-control tuning gains nothing.
KEEPALIVE_TIME_MS = 10_000
KEEPALIVE_TIMEOUT_MS = 5_000
GRPC_SERVER_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.so_reuseport", 0),
    ("grpc.server.max_pending_requests", MAX_PENDING_CALLS),
    ("grpc.server.max_pending_requests_hard_limit", MAX_PENDING_CALLS),
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.http2.bdp_probe", 0),
    ("grpc.http2.ping_timeout_ms", KEEPALIVE_TIMEOUT_MS),
)
# A tenant key longer than this is not an identity anyone configured: anonymous.
MAX_TENANT_LEN = codec.MAX_TENANT_LEN
# x-request-id is client-set and only logged: logged at most this long.
MAX_REQUEST_ID_LEN = 128
# --shadow: the would-be answer to a route naming a pool the sidecar lacks (outcome as in
# the rejection log line; the code is its 429's).
_UNKNOWN_POOL_VERDICT = ("unknown_pool", responses.reply(responses.Rejection.UNKNOWN_POOL,
                                                         PriorityClass.DEFAULT).code)

log = logs.get("sidecar.authz")


@dataclass(frozen=True, slots=True)
class TenantPolicy:
    """Tenant ceilings in force (replaced as a whole on config reload)."""

    policies: Mapping[str, PriorityClass]
    default_max: PriorityClass

    def ceiling(self, tenant: str) -> PriorityClass:
        return self.policies.get(tenant, self.default_max)


def resolve_tenant(source: TenantSource, view: codec.CheckView) -> str:
    """The tenant key from the trusted source only; no identity -> ``anonymous``."""
    value: object = None
    if source.kind == "header":
        value = view.headers.get(source.name)
    elif source.kind == "principal":
        value = view.principal
    else:
        payload_key, _, claim = source.name.partition(".")
        value = view.metadata_string(codec.JWT_NAMESPACE, payload_key, claim)
    # Exact, as the policy lookup is exact: no trimming, no truncation.
    if not isinstance(value, str) or not value or len(value) > MAX_TENANT_LEN:
        return ANONYMOUS
    return value


class AuthzService:
    """The Check handler: classify, then the route's pool admits."""

    def __init__(self, pools: Pools, metrics: Recorder,
                 tenant_source: TenantSource, policy: TenantPolicy,
                 preemptible: frozenset[PriorityClass] = frozenset(PriorityClass),
                 liveness: EnvoyLiveness | None = None, *, shadow: bool = False,
                 busy_status: int | None = None, hints: bool = False,
                 tracer: AdmissionTracer | None = None) -> None:
        self.pools = pools
        # --otlp-endpoint: spans for the decisions its sampler keeps (sidecar.tracing).
        self.tracer = tracer
        self.liveness = liveness
        self.metrics = metrics
        self.tenant_source = tenant_source
        self.policy = policy
        # Replaced as a whole on config reload, like the policy.
        self.preemptible = preemptible
        # --shadow: nothing waits or is refused (so the overload shed is off too); each
        # allow carries the would-be answer of its pool's shadow (sidecar.shadow).
        self.shadow = shadow
        # Every refusal's reply, serialised once (with --busy-status, the busy rows' status
        # replaced); with --overload-hints a refusal is encoded with its pool's prediction.
        self._busy_status = busy_status
        self._replies = {key: responses.busy(r, busy_status) if key[0].name in responses.BUSY
                         else r for key, r in responses.REPLIES.items()}
        self._deny = {key: codec.encode_deny(r) for key, r in self._replies.items()}
        self._hints = hints
        self._rng = random.Random()  # the Retry-After jitter
        self.open_checks = 0
        self._overload_log = logs.Throttled(log, "checks_shed_overloaded")
        self._rejections = logs.RejectionSummary(log)
        # Edge sheds join the same line; they name no tenant (Envoy answered before any
        # was resolved), so not the tenant metric (they are smg_sidecar_edge_shed_total).
        self.rejection_counted = self._rejections.add
        self._unknown_pool_log = logs.Throttled(log, "unknown_pool")
        self._decode_failed_log = logs.Throttled(log, "check_decode_failed")
        # Anonymous requests clamped below what they asked, while no Check has named a
        # tenant yet: a source Envoy never sets (None once a tenant was seen, or said).
        self._anonymous_clamped: int | None = 0

    def _rejected(self, cls: PriorityClass, outcome: str, tenant: str) -> None:
        """A refused Check: counted by tenant, and summed in the ``rejections`` line."""
        self.metrics.tenant_rejected(cls, tenant, outcome)
        self._rejections.add(cls.label, outcome, tenant)

    @property
    def handler(self) -> Callable[[bytes, grpc.aio.ServicerContext[bytes, bytes]],
                                  Awaitable[bytes]]:
        """The Check handler to serve: the traced one only when tracing is on, so that off,
        a decision pays one ``is None`` test for it (sidecar.tracing)."""
        return self.check if self.tracer is None else self.check_traced

    def _watch_tenant_source(self, tenant: str, clamped: bool) -> None:
        """Until a Check names a tenant: after ``ANONYMOUS_CLAMPS_WARNED`` anonymous
        requests clamped below what they asked, say once that the source yields nothing
        (every class above the default ceiling is then out of reach)."""
        if tenant != ANONYMOUS:
            self._anonymous_clamped = None  # the source works
        elif clamped and self._anonymous_clamped is not None:
            self._anonymous_clamped += 1
            if self._anonymous_clamped >= ANONYMOUS_CLAMPS_WARNED:
                self._anonymous_clamped = None
                log.warning("tenant_source_yields_no_tenant",
                            tenant_source=f"{self.tenant_source.kind}:"
                                          f"{self.tenant_source.name}".rstrip(":"),
                            clamped=ANONYMOUS_CLAMPS_WARNED,
                            default_max_class=self.policy.default_max.label,
                            hint="no Check so far carried a tenant from this source, so "
                                 "every request is anonymous and clamped to the default "
                                 "ceiling: check that Envoy sets it (JWT claim_to_headers, "
                                 "mTLS) or choose --tenant-source accordingly")

    async def check(self, data: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
        self.open_checks += 1
        try:
            try:
                view = codec.decode_check(data)
            except Exception as exc:  # a malformed message must not become an INTERNAL error
                await self._malformed(exc, context)
            return await self._check(view, context, None)
        finally:
            self.open_checks -= 1

    async def check_traced(self, data: bytes,
                           context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
        """:meth:`check`, with a span for each decision the sampler keeps."""
        assert self.tracer is not None
        self.open_checks += 1
        try:
            try:
                view = codec.decode_check(data)
            except Exception as exc:
                await self._malformed(exc, context)
            span = self.tracer.start(view.headers)
            try:
                return await self._check(view, context, span)
            finally:
                if span is not None:
                    span.close()  # ends it only if no decision did
        finally:
            self.open_checks -= 1

    async def _malformed(self, exc: Exception,
                         context: grpc.aio.ServicerContext[bytes, bytes]) -> NoReturn:
        self._decode_failed_log.event(error=str(exc)[:200])
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "malformed CheckRequest")
        raise AssertionError("abort returned")  # grpc.aio's abort always raises

    def _answered(self, span: AdmissionSpan, c: Classification, tenant: str,
                  pool: Pool | None, view: codec.CheckView, outcome: str, **kw: Any) -> None:
        """A traced decision: the pool's part of its span (sidecar.tracing names the rest)."""
        if pool is None:  # the route's name, clipped as the unknown_pool line clips it
            span.answered(c, tenant, (view.pool or "")[:64], outcome, **kw)
            return
        span.answered(c, tenant, pool.name, outcome, legacy=pool.legacy,
                      coordination=None if pool.fleet is None else pool.fleet.state, **kw)

    async def _check(self, view: codec.CheckView,
                     context: grpc.aio.ServicerContext[bytes, bytes],
                     span: AdmissionSpan | None) -> bytes:
        tenant = resolve_tenant(self.tenant_source, view)
        # For logs only: x-request-id is client-settable, so it never correlates a release.
        request_id = view.headers.get("x-request-id")
        if request_id is not None and len(request_id) > MAX_REQUEST_ID_LEN:
            request_id = request_id[:MAX_REQUEST_ID_LEN] + "…"
        c = classify(view.headers.get(PRIORITY_HEADER), tenant, self.policy.ceiling(tenant))
        if c.unknown_value or c.clamped:
            self.metrics.classified(tenant, c.requested, c.effective, c.unknown_value)
        if self._anonymous_clamped is not None:
            self._watch_tenant_source(tenant, c.clamped)
        pool = self.pools.for_route(view.pool or "")
        edge = pool.edge if pool is not None else None
        if edge is not None:
            edge.arrived(c.effective)
        if self.open_checks > MAX_OPEN_CHECKS and not self.shadow:
            self.metrics.overloaded(c.effective)
            self._overload_log.event(open_checks=self.open_checks)
            if span is not None:
                self._answered(span, c, tenant, pool, view, "overloaded",
                               reply=self._replies[(responses.Rejection.OVERLOADED, c.effective)])
            return self._deny[(responses.Rejection.OVERLOADED, c.effective)]
        if pool is None:  # the route and the pools disagree: counted, 429
            self.metrics.unknown_pool(c.effective)
            self._unknown_pool_log.event(pool=(view.pool or "")[:64])
            if self.shadow:  # --shadow refuses nothing: the would-be 429, held by no pool
                if span is not None:
                    self._answered(span, c, tenant, None, view, "admitted",
                                   shadow=_UNKNOWN_POOL_VERDICT[0])
                return (codec.encode_unheld_allow(c.effective.label, tenant)
                        + codec.shadow_suffix(*_UNKNOWN_POOL_VERDICT))
            self._rejected(c.effective, "unknown_pool", tenant)
            if span is not None:
                self._answered(span, c, tenant, None, view, "unknown_pool",
                               reply=self._replies[(responses.Rejection.UNKNOWN_POOL,
                                                    c.effective)])
            return self._deny[(responses.Rejection.UNKNOWN_POOL, c.effective)]
        try:
            admitted = await pool.admit(c.effective, tenant, None if pool.tokens is None
                                        else codec.token_facts(view))
        except BudgetDenied as b:  # the tenant's token budget: a Retry-After of its own
            log.debug("rejected", tenant=tenant, effective=c.effective.label,
                      outcome="over_budget", window=b.verdict.window, request_id=request_id,
                      **pool.log_fields)
            self._rejected(c.effective, "over_budget", tenant)
            over = b.verdict
            reply = responses.over_budget(over.window, over.retry_after, over.never)
            if span is not None:
                self._answered(span, c, tenant, pool, view, "over_budget", reply=reply)
            return codec.encode_deny(reply)
        except ContextDenied as x:  # fits no worker slot: retrying cannot help
            log.debug("rejected", tenant=tenant, effective=c.effective.label,
                      outcome="past_context", tokens=x.tokens, context=x.context,
                      request_id=request_id, **pool.log_fields)
            self._rejected(c.effective, "past_context", tenant)
            reply = responses.past_context(x.tokens, x.context, x.limit)
            if span is not None:
                self._answered(span, c, tenant, pool, view, "past_context", reply=reply)
            return codec.encode_deny(reply)
        except Denied as d:
            rejection = responses.for_denial(d.outcome, legacy=d.legacy,
                                             rate_limited=d.rate_limited)
            outcome = "rate_limited" if d.rate_limited else d.outcome.value
            if edge is not None and outcome == "rejected_queue_full":
                edge.overflowed(c.effective)
            # Per rejection at debug only; info gets the throttled summary (docs/reference.md).
            log.debug("rejected", tenant=tenant, requested=c.requested.label,
                      effective=c.effective.label, outcome=outcome,
                      legacy=d.legacy, waited=round(d.waited, 6), request_id=request_id,
                      **pool.log_fields)
            self._rejected(c.effective, outcome, tenant)
            if span is not None:
                self._answered(span, c, tenant, pool, view, outcome, waited=d.waited,
                               reply=self._replies[(rejection, c.effective)])
            if self._hints:
                return codec.encode_deny(responses.with_hints(
                    self._replies[(rejection, c.effective)],
                    pool.predicted_wait(c.effective), self._rng))
            return self._deny[(rejection, c.effective)]
        except asyncio.CancelledError:
            # Envoy cancelled the call: the client is gone, so there is nobody to send
            # a 499 to. The core counted it as client_cancelled (see sidecar.responses).
            outcome = Outcome.CLIENT_CANCELLED.value
            log.debug("rejected", tenant=tenant, requested=c.requested.label,
                      effective=c.effective.label, outcome=outcome, request_id=request_id,
                      **pool.log_fields)
            self._rejected(c.effective, outcome, tenant)
            if span is not None:
                self._answered(span, c, tenant, pool, view, outcome)
            raise
        if edge is not None and not admitted.queued:
            edge.admitted_at_once(c.effective)  # the class's queue had room: no shedding
        aid = admitted.admission.id
        # An allow may say `preemptible: false` (Envoy then opens no ext_proc stream) only
        # when the Envoy that asked is known to send periodic access-log entries: without
        # them the stream is the only sign that Envoy runs the request, and an admission
        # nothing acknowledges keeps its lease, which a long stream outlives.
        periodic = (self.liveness is not None
                    and self.liveness.admitted(aid, context.peer()))  # which Envoy asked
        if logs.debug_enabled():
            log.debug("admitted", tenant=tenant, requested=c.requested.label,
                      effective=c.effective.label, admission_id=aid,
                      admission_tag=logs.id_tag(aid),
                      waited=round(admitted.waited, 6), starvation=admitted.starvation,
                      predicted=None if admitted.predicted is None
                      else round(admitted.predicted, 6),
                      request_id=request_id, **pool.log_fields)
        allow = codec.encode_allow(aid, c.effective.label, tenant,
                                   c.effective in self.preemptible or not periodic)
        v = None if pool.shadow is None else pool.shadow.take_verdict(aid)
        if v is not None:
            # Over its token budget, enforcement would have refused it before its class
            # queue saw it: that is the would-be answer.
            allow += (codec.shadow_suffix("over_budget", responses.OVER_BUDGET_CODE)
                      if pool.take_budget_verdict(aid) is not None
                      else codec.shadow_suffix(v.outcome, v.code))
        if self._hints:
            allow += codec.wait_hint_suffix(round(admitted.waited * 1000))
        if span is not None:
            self._answered(span, c, tenant, pool, view, Outcome.ADMITTED.value,
                           waited=admitted.waited, queued=admitted.queued, admission_id=aid,
                           shadow=None if v is None else v.outcome)
        return allow
