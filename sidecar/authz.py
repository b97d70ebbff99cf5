"""``envoy.service.auth.v3.Authorization/Check``: Envoy asks, the sidecar decides.

Per request: resolve the tenant from the one configured trusted source,
classify and clamp the priority, then await admission. A queued request holds
its Check call open; when Envoy cancels the call (client gone, Envoy timeout)
the waiter is removed and counted as ``client_cancelled``.

Wired on ``grpc.aio`` with generic handlers and bytes in/out: the codec
adapter decodes, and every denial is a response serialised once at start-up.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass

import grpc

from sidecar import codec, logs
from sidecar.admission import AdmissionController, Denied
from sidecar.classes import HIGH_TO_LOW, PRIORITY_HEADER, PriorityClass, classify
from sidecar.config import TenantSource
from sidecar.metrics import Metrics
from sidecar.scheduler import Outcome

ANONYMOUS = "anonymous"
# A tenant key longer than this is not an identity anyone configured: anonymous.
MAX_TENANT_LEN = 1024

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


def _deny_specs() -> dict[tuple[Outcome, bool, PriorityClass], codec.DenySpec]:
    retry2 = (("retry-after", "2"),)
    specs: dict[tuple[Outcome, bool, PriorityClass], codec.DenySpec] = {}
    for cls in HIGH_TO_LOW:
        c = cls.label
        specs[(Outcome.REJECTED_QUEUE_FULL, False, cls)] = codec.DenySpec(
            429, "scheduler_queue_full",
            f"The '{c}' priority queue is full; retry later", retry2)
        specs[(Outcome.REJECTED_QUEUE_TIMEOUT, False, cls)] = codec.DenySpec(
            503, "scheduler_queue_timeout",
            f"Timed out waiting in the '{c}' priority queue", retry2)
        specs[(Outcome.CLIENT_CANCELLED, False, cls)] = codec.DenySpec(
            499, "scheduler_client_cancelled", "Client closed the request while queued")
        specs[(Outcome.REJECTED_QUEUE_FULL, True, cls)] = codec.DenySpec(
            429, "admission_queue_full", "Too many concurrent requests; queue is full", retry2)
        specs[(Outcome.REJECTED_QUEUE_TIMEOUT, True, cls)] = codec.DenySpec(
            503, "admission_queue_timeout", "Timed out waiting for a concurrency slot", retry2)
        specs[(Outcome.CLIENT_CANCELLED, True, cls)] = codec.DenySpec(
            499, "scheduler_client_cancelled", "Client closed the request while queued")
    return specs


DENY_SPECS = _deny_specs()
RATE_LIMITED = codec.DenySpec(429, "scheduler_queue_full",
                              "Request rate limit exceeded; retry later", (("retry-after", "2"),))
PREEMPTED = codec.DenySpec(503, "scheduler_preempted",
                           "Preempted by a higher-priority request before the first byte",
                           (("retry-after", "1"), ("x-smg-preempted", "true")))


class AuthzService:
    """The Check handler."""

    def __init__(self, controller: AdmissionController, metrics: Metrics,
                 tenant_source: TenantSource, policy: TenantPolicy) -> None:
        self.controller = controller
        self.metrics = metrics
        self.tenant_source = tenant_source
        self.policy = policy
        self._deny = {k: codec.encode_deny(v) for k, v in DENY_SPECS.items()}
        # The contract's flag table: the request-rate check sheds with 429
        # scheduler_queue_full, on either admission path.
        self._rate_limited = codec.encode_deny(RATE_LIMITED)

    async def check(self, data: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
        try:
            view = codec.decode_check(data)
        except Exception as exc:  # a malformed message must not become an INTERNAL error
            log.warning("check_decode_failed", error=str(exc))
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "malformed CheckRequest")
        tenant = resolve_tenant(self.tenant_source, view)
        # For logs only: x-request-id is client-settable, so it never correlates a release.
        request_id = view.headers.get("x-request-id")
        c = classify(view.headers.get(PRIORITY_HEADER), tenant, self.policy.ceiling(tenant))
        if c.unknown_value or c.clamped:
            self.metrics.classified(tenant, c.requested, c.effective, c.unknown_value)
        try:
            admitted = await self.controller.admit(c.effective, tenant)
        except Denied as d:
            if d.rate_limited:
                log.info("rejected", tenant=tenant, requested=c.requested.label,
                         effective=c.effective.label, outcome="rate_limited",
                         legacy=d.legacy, request_id=request_id)
                return self._rate_limited
            log.info("rejected", tenant=tenant, requested=c.requested.label,
                     effective=c.effective.label, outcome=d.outcome.value,
                     legacy=d.legacy, waited=round(d.waited, 6), request_id=request_id)
            return self._deny[(d.outcome, d.legacy, c.effective)]
        except asyncio.CancelledError:
            log.info("rejected", tenant=tenant, requested=c.requested.label,
                     effective=c.effective.label, outcome=Outcome.CLIENT_CANCELLED.value,
                     request_id=request_id)
            raise
        aid = admitted.admission.id
        if logs.debug_enabled():
            log.debug("admitted", tenant=tenant, requested=c.requested.label,
                      effective=c.effective.label, admission_id=aid,
                      waited=round(admitted.waited, 6), starvation=admitted.starvation,
                      request_id=request_id)
        return codec.encode_allow(aid, c.effective.label, tenant)
