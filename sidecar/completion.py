"""The completion hook and the response-path hook.

* ``AccessLogService/StreamAccessLogs`` — Envoy's gRPC access log (``http_grpc``)
  sends exactly one end-of-stream entry per request, whatever ended it
  (completion, upstream failure, client disconnect), and periodic entries
  while a long stream runs (``access_log_flush_interval``). The final entry
  releases the slot; periodic entries renew its lease. The streams themselves,
  held open while Envoy lives, are its liveness signal (:mod:`sidecar.liveness`).
  The admission id is read from the ext_authz dynamic metadata the entry
  carries, which only ext_authz can set: a client-sent header could release
  someone else's slot.
* ``ExternalProcessor/Process`` — an ext_proc stream per admitted request,
  opened at its request headers and kept open until its response headers.
  Response headers are the request's first byte (it can no longer be
  preempted); the sidecar then ends the stream rather than answering, which
  Envoy takes as "carry on" and costs one message less. While the stream is
  open the sidecar can stop the request: an unsolicited ``immediate_response``
  makes Envoy answer the client with 503 ``scheduler_preempted`` and reset the
  upstream request to the worker. An allow marked ``preemptible: false`` (no
  class above can preempt it) gets no stream: Envoy's matcher skips the filter.

Neither path trusts anything but the metadata; an entry for an unknown or
already-released id is ignored and counted.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

from sidecar import codec, logs
from sidecar.classes import PriorityClass
from sidecar.envoy_features import FeatureDetector
from sidecar.liveness import EnvoyLiveness
from sidecar.metrics import NullRecorder, Recorder
from sidecar.pools import Pools
from sidecar.responses import Rejection, reply
from sidecar.scheduler import ReleaseReason, ReleaseResult

log = logs.get("sidecar.completion")


# Adoption bound when admission has no capacity of its own (legacy path without
# --max-concurrent-requests): the contract's fallback capacity.
UNLIMITED_ADOPTION_BOUND = 1024


class CompletionService:
    """ALS: final entries release, periodic entries renew.

    Adoption is bounded: a periodic entry for an id this process holds no lease
    for is adopted only while fewer admissions than the capacity are in flight
    (leases, adopted ones included). Past that it is refused and counted
    (``smg_sidecar_adoption_refused_total``), so a flood of periodic entries with
    made-up ids, from anyone who can reach the gRPC port, cannot fill the table
    or block admission. A real stream refused that way is retried at its next
    periodic entry.
    """

    def __init__(self, pools: Pools,
                 metrics: Recorder | None = None,
                 features: FeatureDetector | None = None,
                 liveness: EnvoyLiveness | None = None) -> None:
        self.pools = pools
        self._metrics: Recorder = metrics if metrics is not None else NullRecorder()
        self.features = features
        self.liveness = liveness
        self._refused_log = logs.Throttled(log, "adoption_refused")
        # Per message on a port anyone in the pod may call: one line per 10 s each.
        self._decode_failed_log = logs.Throttled(log, "access_log_decode_failed")
        self._unmatched_log = logs.Throttled(log, "completion_unmatched", level="info")

    def adoption_bound(self, aid: str) -> int:
        """How many admissions the pool ``aid`` names may hold before adoption is refused."""
        pool = self.pools.of(aid)
        capacity = pool.controller.snapshot().capacity if pool is not None else 0
        return capacity if capacity > 0 else UNLIMITED_ADOPTION_BOUND

    def _renew_or_adopt(self, entry: codec.LogEntry) -> bool:
        if self.pools.renew_or_adopt(entry.admission_id):  # a lease of ours: renewed
            return True
        cls = PriorityClass.from_name(entry.cls)
        pool = self.pools.of(entry.admission_id)
        if cls is None or pool is None:  # no class, or an id naming no pool of ours
            return False
        bound = self.adoption_bound(entry.admission_id)
        held = pool.controller.lease_count
        if held >= bound:
            self._metrics.adoption_refused(cls)
            self._refused_log.event(in_flight=held, bound=bound, **pool.log_fields)
            return False
        return pool.controller.renew_or_adopt(entry.admission_id, cls, entry.tenant)

    async def stream_access_logs(
        self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext[bytes, bytes]
    ) -> bytes:
        # Closing a stream releases nothing by itself: Envoy keeps one stream per worker
        # thread open while it lives, and liveness releases an Envoy's admissions only
        # once all its streams stayed closed past the grace (sidecar.liveness).
        liveness = self.liveness
        peer = context.peer() if liveness is not None else ""
        owner = liveness.stream_opened(peer) if liveness is not None else ""
        try:
            async for data in requests:
                try:
                    entries = codec.decode_access_logs(data)
                except Exception as exc:
                    self._decode_failed_log.event(error=str(exc)[:200])
                    continue
                if self.features is not None:
                    self._observe(entries)
                for entry in entries:
                    if entry.final:
                        result = self.pools.release(entry.admission_id,
                                                    ReleaseReason.COMPLETED)
                        pool = self.pools.of(entry.admission_id)
                        if pool is not None and result is ReleaseResult.RELEASED:
                            pool.completed(entry)
                        if liveness is not None:
                            liveness.ended(entry.admission_id)
                        if result is not ReleaseResult.RELEASED:
                            self._unmatched_log.event(
                                admission_tag=logs.id_tag(entry.admission_id),
                                reason=result.value, response_code=entry.response_code)
                        if entry.shadow_outcome:  # --shadow: what the access log carried
                            log.debug("shadow_completed", admission_id=entry.admission_id,
                                      shadow_outcome=entry.shadow_outcome,
                                      response_code=entry.response_code)
                    else:
                        if liveness is not None:
                            liveness.periodic_entry(owner)
                        if self._renew_or_adopt(entry):
                            if liveness is not None:
                                liveness.acknowledged(entry.admission_id, peer)
                        else:
                            # An id this process already ended (e.g. a preempted victim
                            # still draining in Envoy): nothing to renew or adopt.
                            log.debug("renewal_unmatched", admission_id=entry.admission_id)
        finally:
            if liveness is not None:
                liveness.stream_closed(owner)
        return codec.ALS_RESPONSE

    def _observe(self, entries: list[codec.LogEntry]) -> None:
        assert self.features is not None
        self.features.access_log_message(len(entries))
        for entry in entries:
            if entry.final:
                self.features.final_entry(lived_secs=entry.lived_secs, ended_at=entry.ended_at,
                                          preemptible=entry.preemptible)
            else:
                self.features.periodic_entry()


_IMMEDIATE_PREEMPTED = codec.encode_immediate(reply(Rejection.PREEMPTED))


class ResponsePathService:
    """ext_proc: first-byte marking and preemption delivery."""

    def __init__(self, pools: Pools,
                 metrics: Recorder | None = None,
                 features: FeatureDetector | None = None,
                 liveness: EnvoyLiveness | None = None) -> None:
        self.pools = pools
        self._metrics: Recorder = metrics if metrics is not None else NullRecorder()
        self.features = features
        self.liveness = liveness
        self._decode_failed_log = logs.Throttled(log, "ext_proc_decode_failed")

    async def _read(self, context: grpc.aio.ServicerContext[bytes, bytes]
                    ) -> codec.ProcessingEvent | None:
        """The next message, or None once Envoy closed the stream."""
        raw: object = await context.read()
        if not isinstance(raw, bytes):  # grpc.aio.EOF
            return None
        try:
            return codec.decode_processing_request(raw)
        except Exception as exc:  # malformed: a clear gRPC error, not INTERNAL
            self._decode_failed_log.event(error=str(exc)[:200])
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "malformed ProcessingRequest")
            raise  # abort() raises; this line only satisfies the type checker

    async def process(
        self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext[bytes, bytes]
    ) -> None:
        # read()/write() rather than an async generator: the preemption can then be
        # written from the watch's callback, and the common path allocates no tasks.
        aid: str | None = None
        stopped: list[asyncio.Future[None]] = []
        try:
            first = await self._read(context)
            admitted = (first is not None and first.kind == "request_headers"
                        and first.admission_id is not None)
            self._metrics.ext_proc_stream(admitted)
            if first is None:
                return
            if first.kind != "request_headers" or first.admission_id is None:
                # Not an admitted request (or an unexpected message): let it pass.
                await context.write(codec.continue_for(first.kind))
                return
            aid = first.admission_id
            if self.features is not None:
                self.features.ext_proc_stream()
            watch = self.pools.open_stop_channel(aid)
            if watch is not None and watch.done():
                # A queued higher-class request took it the moment it became a
                # candidate: answer 503 before the request ever reaches a worker.
                log.info("preempted", admission_tag=logs.id_tag(aid))
                await context.write(_IMMEDIATE_PREEMPTED)
                return
            await context.write(codec.CONTINUE_REQUEST_HEADERS)
            if watch is None:
                return  # not in flight any more: nothing to mark or stop
            if self.liveness is not None:
                self.liveness.acknowledged(aid)  # Envoy runs it: no timer once watched

            # One write at a time on the stream: the preemption may come while the
            # handler is itself writing.
            writing = asyncio.Lock()
            finished = False

            async def locked_write(data: bytes) -> None:
                async with writing:
                    await context.write(data)

            def preempt(_: object = None) -> None:
                # Idempotent, and a no-op once the handler has returned: the done
                # callback and the read loop may both get here, in either order.
                if stopped or finished:
                    return
                log.info("preempted", admission_tag=logs.id_tag(aid))
                stopped.append(asyncio.ensure_future(locked_write(_IMMEDIATE_PREEMPTED)))

            watch.add_done_callback(preempt)
            try:
                while (event := await self._read(context)) is not None:
                    if watch.done():
                        preempt()  # the callback may not have run yet: deliver now
                        break
                    if event.kind != "response_headers":
                        # Not sent in the shipped processing mode; answer, don't stall.
                        await locked_write(codec.continue_for(event.kind))
                        continue
                    watch.remove_done_callback(preempt)
                    if not await self.pools.confirm_first_byte(aid):
                        # Across a fleet: the ledger gave its slot away before it learned
                        # of the first byte. Stop it; it must not run on uncounted.
                        preempt()
                        break
                    self.pools.mark_first_byte(aid)
                    # End the stream instead of answering CONTINUE: a clean close is
                    # Envoy's "carry on without the processor" and saves a message
                    # (a grpc send batch) on every request.
                    return
                # Stream closed (the request ended): a preemption not yet written has
                # nobody left to tell, and the late callback is a no-op from here.
                for write in stopped:
                    try:
                        await write
                    except Exception as exc:
                        # The slot is already given away; the victim may run on
                        # uncounted until it ends. Say so loudly.
                        log.warning("preemption_delivery_failed",
                                    admission_tag=logs.id_tag(aid), error=str(exc))
                        self.pools.preemption_undelivered(aid)
            finally:
                finished = True
        finally:
            for write in stopped:
                if not write.done():
                    write.cancel()
            if aid is not None:
                self.pools.close_stop_channel(aid)
