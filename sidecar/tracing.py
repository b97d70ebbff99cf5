"""Admission traces (an extension, off unless ``--otlp-endpoint``): one span per decision.

Each Check the sampler keeps gets one span, ``smg.admission``, in the request's own
trace: its parent is the W3C ``traceparent`` Envoy passes in the CheckRequest's headers
(read by OpenTelemetry's propagator, never by hand). It starts when the Check is decoded
and ends when the decision is answered, allowed or refused, so a queued request's span
covers its wait, and a cancelled one's ends with the cancel. The attributes are named
here only (:data:`ATTRIBUTES`, the reference's table).

Why a library: spans go out over OTLP (protobuf over gRPC, batched, retried with
backoff, TLS), a protocol the sidecar would otherwise hand-write; the OpenTelemetry SDK
and its OTLP exporter are what every collector is tested against.

Cost. Tracing off, the Check handler is the untraced one (chosen once at start-up, see
:meth:`sidecar.authz.AuthzService.handler`) and each decision runs one ``is None`` test.
On, a request that does not start a span costs one dict lookup and one random number
(no ``traceparent``: the root coin is tossed here, before the SDK is touched), or the
propagator's parse (a ``traceparent``: its sampled flag decides, parent-based). A kept
span is built by the SDK and queued for the exporter's thread: the Check never waits for
the receiver. The queue is bounded (:data:`MAX_QUEUE_SPANS`; a full queue drops spans) and
each export gives up after :data:`EXPORT_TIMEOUT_SECS`, retries included.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import threading
import time
from collections.abc import Callable, Mapping
from typing import Final

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import ALWAYS_ON, ParentBased
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

import sidecar
from sidecar import logs
from sidecar.classes import Classification
from sidecar.config import TracingSettings
from sidecar.health import credential_secrets
from sidecar.responses import Reply

log = logs.get("sidecar.tracing")

SPAN_NAME: Final = "smg.admission"
SERVICE_NAME: Final = "priority-gate"  # $OTEL_SERVICE_NAME overrides it
TRACEPARENT: Final = "traceparent"

# ---------------------------------------------------------------- span attributes
# Every attribute a span can carry, named here only (docs/reference.md, "Admission traces").
CLASS_REQUESTED: Final = "smg.class.requested"
CLASS_EFFECTIVE: Final = "smg.class.effective"
TENANT: Final = "smg.tenant"
POOL: Final = "smg.pool"
OUTCOME: Final = "smg.outcome"
HTTP_STATUS: Final = "http.response.status_code"
ERROR_CODE: Final = "smg.error_code"
QUEUED: Final = "smg.queued"
QUEUE_WAIT: Final = "smg.queue.wait_seconds"
ADMISSION_TAG: Final = "smg.admission.tag"
LEGACY: Final = "smg.legacy"
COORDINATION_STATE: Final = "smg.coordination.state"
SHADOW_OUTCOME: Final = "smg.shadow.outcome"

ATTRIBUTES: Final = (CLASS_REQUESTED, CLASS_EFFECTIVE, TENANT, POOL, OUTCOME, HTTP_STATUS,
                     ERROR_CODE, QUEUED, QUEUE_WAIT, ADMISSION_TAG, LEGACY, COORDINATION_STATE,
                     SHADOW_OUTCOME)

# The outcomes a span reports: the contract's (smg_scheduler_admit_total's outcome label, less
# preempted, which comes after the decision), the deadline extension's, and the refusals the
# sidecar makes outside admission, named as in smg_sidecar_tenant_rejected_total.
OUTCOMES: Final = frozenset({
    "admitted", "rejected_queue_full", "rejected_queue_timeout", "client_cancelled",
    "rejected_over_target", "rate_limited", "unknown_pool", "overloaded", "over_budget",
    "past_context"})

# ------------------------------------------------------------------- export bounds
MAX_QUEUE_SPANS: Final = 2048  # ended spans waiting for the exporter; more are dropped
MAX_BATCH_SPANS: Final = 512
SCHEDULE_DELAY_MS: Final = 1000  # a span reaches the receiver within about a second
EXPORT_TIMEOUT_SECS: Final = 5.0  # one export, retries included
SHUTDOWN_FLUSH_SECS: Final = 2.0  # what stop() gives the last spans
# The SDK's own warnings (a failed export, a full queue: one per dropped span) as one
# throttled line per kind.
LOG_INTERVAL_SECS: Final = 10.0


class AdmissionSpan:
    """One decision's span, from the Check's decode to its answer."""

    __slots__ = ("_ended", "_span", "_t0")

    def __init__(self, span: trace.Span) -> None:
        self._span = span
        self._t0 = time.monotonic()
        self._ended = False

    def answered(self, c: Classification, tenant: str, pool: str, outcome: str, *,
                 reply: Reply | None = None, waited: float | None = None,
                 queued: bool | None = None, admission_id: str | None = None,
                 legacy: bool | None = None, coordination: str | None = None,
                 shadow: str | None = None) -> None:
        """The decision was answered: record it and end the span.

        ``waited``: the core's measure of the queue wait; None means the time since the
        span started (a cancel, a refusal before admission). Tenant and ids follow the
        logs' rules: the tenant as an info line shows it (secrets cut), the admission id
        only as its tag (``logs.id_tag``, which the ``preempted`` line shows too).
        """
        if self._ended:
            return
        attrs: dict[str, str | bool | int | float] = {
            CLASS_REQUESTED: c.requested.label, CLASS_EFFECTIVE: c.effective.label,
            TENANT: str(logs.redact(tenant)), POOL: pool, OUTCOME: outcome,
            QUEUE_WAIT: round(time.monotonic() - self._t0 if waited is None else waited, 6),
        }
        if queued is not None:
            attrs[QUEUED] = queued
        if reply is not None:
            attrs[HTTP_STATUS] = reply.status
            attrs[ERROR_CODE] = reply.code
        if admission_id is not None:
            attrs[ADMISSION_TAG] = logs.id_tag(admission_id)
        if legacy is not None:
            attrs[LEGACY] = legacy
        if coordination is not None:
            attrs[COORDINATION_STATE] = coordination
        if shadow is not None:
            attrs[SHADOW_OUTCOME] = shadow
        self._span.set_attributes(attrs)
        self._end()

    def close(self) -> None:
        """End the span if no decision did (the handler failed): marked an error."""
        if not self._ended:
            self._span.set_status(trace.StatusCode.ERROR, "no admission decision")
            self._end()

    def _end(self) -> None:
        self._ended = True
        self._span.end()


class AdmissionTracer:
    """Starts a span for the Checks the sampler keeps (the hot path: see the module doc)."""

    def __init__(self, tracer: trace.Tracer, ratio: float,
                 coin: Callable[[], float] = random.random) -> None:
        if not 0.0 < ratio <= 1.0:
            raise ValueError("a tracer needs a sample ratio in (0, 1]: 0 builds none")
        self._tracer = tracer
        self._ratio = ratio
        self._coin = coin
        self._propagator = TraceContextTextMapPropagator()

    def start(self, headers: Mapping[str, str]) -> AdmissionSpan | None:
        """A span for this Check, or None when the sampler does not keep it.

        Parent-based: a valid ``traceparent`` decides by its sampled flag; otherwise this
        request starts a trace here, kept with probability ``ratio``.
        """
        if TRACEPARENT in headers:
            ctx = self._propagator.extract(headers)
            parent = trace.get_current_span(ctx).get_span_context()
            if parent.is_valid:
                if not parent.trace_flags.sampled:
                    return None
                return AdmissionSpan(self._tracer.start_span(
                    SPAN_NAME, context=ctx, kind=trace.SpanKind.SERVER))
        if self._ratio < 1.0 and self._coin() >= self._ratio:
            return None
        # The SDK's sampler (ParentBased(ALWAYS_ON)) keeps what reaches it: chosen above.
        return AdmissionSpan(self._tracer.start_span(SPAN_NAME, kind=trace.SpanKind.SERVER))


class Tracing:
    """The tracer provider and its OTLP exporter: built at start-up, flushed at stop."""

    def __init__(self, settings: TracingSettings, *, instance: str) -> None:
        if settings.otlp_endpoint is None or settings.trace_sample_ratio <= 0:
            raise ValueError("tracing is off: build none (Tracing.build)")
        _bridge_sdk_logs()
        for secret in credential_secrets(dict(settings.otlp_headers)):
            logs.register_secret(secret)  # the workers' key's rule: no log line shows it
        # Imported here, not at the top: with tracing off nothing imports the OTLP protobuf
        # modules, which an xds-protos installed after them can break (sidecar.config).
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        endpoint = settings.otlp_endpoint
        self._exporter = exporter = OTLPSpanExporter(
            endpoint=endpoint, insecure=endpoint.lower().startswith("http://"),
            headers=settings.otlp_headers or None, timeout=EXPORT_TIMEOUT_SECS)
        resource = Resource.create({"service.name": SERVICE_NAME,
                                    "service.version": sidecar.__version__,
                                    "service.instance.id": instance})
        # shutdown_on_exit=False: the runtime flushes, bounded, in stop(); the SDK's own
        # exit hook would wait up to 30 s for an unreachable receiver.
        self._provider = TracerProvider(resource=resource, sampler=ParentBased(ALWAYS_ON),
                                        shutdown_on_exit=False)
        self._processor = BatchSpanProcessor(
            exporter, max_queue_size=MAX_QUEUE_SPANS, max_export_batch_size=MAX_BATCH_SPANS,
            schedule_delay_millis=SCHEDULE_DELAY_MS,
            export_timeout_millis=EXPORT_TIMEOUT_SECS * 1000)
        self._provider.add_span_processor(self._processor)
        self.tracer = AdmissionTracer(self._provider.get_tracer("sidecar.tracing"),
                                      settings.trace_sample_ratio)
        self.endpoint = endpoint
        self.ratio = settings.trace_sample_ratio

    @classmethod
    def build(cls, settings: TracingSettings, *, instance: str) -> Tracing | None:
        """Tracing as the flags ask: None when off (no endpoint, or ratio 0)."""
        if settings.otlp_endpoint is None or settings.trace_sample_ratio <= 0:
            return None
        return cls(settings, instance=instance)

    async def close(self, timeout: float = SHUTDOWN_FLUSH_SECS) -> bool:
        """Export what is queued, for at most ``timeout`` seconds; True if all went.

        The flush runs in a daemon thread: a receiver that does not answer keeps it past
        the timeout, and then it is abandoned (the process may exit) and the exporter's
        channel closed, which ends its retries.
        """
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()

        def finished() -> None:
            if not done.done():
                done.set_result(None)

        def flush() -> None:
            try:
                self._provider.shutdown()
            finally:
                with contextlib.suppress(RuntimeError):  # the loop is gone: nobody waits
                    loop.call_soon_threadsafe(finished)

        threading.Thread(target=flush, name="smg-trace-flush", daemon=True).start()
        try:
            await asyncio.wait_for(asyncio.shield(done), timeout)
            return True
        except TimeoutError:
            log.warning("trace_flush_incomplete", timeout_secs=timeout, endpoint=self.endpoint)
            _mute_sdk_logs(True)
            self._exporter.shutdown()
            return False
        finally:
            # What the SDK says from here on is about the abandoned flush (aborted retries,
            # "already shut down"): told once above, not line by line.
            _mute_sdk_logs(True)


class _ThrottledSdkLog(logging.Handler):
    """The SDK's warnings and errors (from its exporter thread) as structured lines, at most
    one per message kind per :data:`LOG_INTERVAL_SECS` (a full queue warns per dropped
    span)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self._kinds: dict[tuple[str, object], logs.Throttled] = {}
        self.muted = False  # a stopped runtime's exporter: nothing more to tell

    def emit(self, record: logging.LogRecord) -> None:  # under the handler's lock
        if self.muted:
            return
        key = (record.name, record.msg)
        throttled = self._kinds.get(key)
        if throttled is None:
            if len(self._kinds) >= 64:  # kinds are the SDK's format strings: a few
                self._kinds.clear()
            throttled = self._kinds[key] = logs.Throttled(
                log, "trace_export_problem", interval=LOG_INTERVAL_SECS)
        try:
            message = record.getMessage()
        except Exception:  # a malformed record must not break the exporter thread
            message = str(record.msg)
        throttled.event(sdk_logger=record.name, sdk_level=record.levelname,
                        message=message[:300])


_bridged = threading.Lock()
_handler: _ThrottledSdkLog | None = None


def _bridge_sdk_logs() -> None:
    """Route the ``opentelemetry`` loggers through :class:`_ThrottledSdkLog`, once; a new
    :class:`Tracing` is heard again."""
    global _handler
    with _bridged:
        if _handler is not None:
            _handler.muted = False
            return
        _handler = _ThrottledSdkLog()
        sdk = logging.getLogger("opentelemetry")
        sdk.addHandler(_handler)
        sdk.setLevel(logging.WARNING)
        sdk.propagate = False


def _mute_sdk_logs(muted: bool) -> None:
    with _bridged:
        if _handler is not None:
            _handler.muted = muted
