"""A tiny OTLP/gRPC trace receiver for the tests and the demo: what the sidecar's spans meet.

It serves ``opentelemetry.proto.collector.trace.v1.TraceService/Export`` (the protobuf
messages ship with ``opentelemetry-proto``) on loopback, in the caller's event loop, and
keeps every span it received as a flat :class:`ReceivedSpan` (ids as hex, attributes as
Python values, the resource's attributes beside them). Tests read ``spans`` and wait on
:meth:`OtlpReceiver.wait_for`; the demo runs it as ``python -m devtools.otlp`` and prints
one JSON line per span.

Faults the tests need: ``stall()`` makes every Export hang until ``resume()`` (a receiver
that accepts and never answers), ``stop()`` closes the port (a receiver that is down).
``metadata`` keeps each Export's gRPC metadata (the headers the exporter sent); ``tls``
serves TLS (an ``https://`` endpoint).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as ts
from opentelemetry.proto.common.v1 import common_pb2

SERVICE = "opentelemetry.proto.collector.trace.v1.TraceService"


@dataclass(frozen=True)
class ReceivedSpan:
    """One span as the receiver got it."""

    name: str
    trace_id: str
    span_id: str
    parent_span_id: str  # "" for a root span
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    resource: dict[str, Any]
    status_code: int = 0
    trace_state: str = ""
    received_at: float = field(default_factory=time.monotonic)

    @property
    def duration(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9


def _value(v: common_pb2.AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    if kind == "bytes_value":
        return v.bytes_value.hex()
    return None if kind is None else getattr(v, kind)


def _attrs(kvs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs}


def spans_of(request: ts.ExportTraceServiceRequest) -> list[ReceivedSpan]:
    """Every span of one Export request, flattened."""
    out = []
    for rs in request.resource_spans:
        resource = _attrs(rs.resource.attributes)
        for ss in rs.scope_spans:
            for s in ss.spans:
                out.append(ReceivedSpan(
                    name=s.name, trace_id=s.trace_id.hex(), span_id=s.span_id.hex(),
                    parent_span_id=s.parent_span_id.hex(), kind=s.kind,
                    start_ns=s.start_time_unix_nano, end_ns=s.end_time_unix_nano,
                    attributes=_attrs(s.attributes), resource=resource,
                    status_code=s.status.code, trace_state=s.trace_state))
    return out


class OtlpReceiver:
    """An OTLP/gRPC trace receiver on 127.0.0.1 (``port`` 0: a free one)."""

    def __init__(self, port: int = 0,
                 on_span: Callable[[ReceivedSpan], None] | None = None, *,
                 tls: tuple[bytes, bytes] | None = None, keep: bool = True) -> None:
        self.port = port
        self.tls = tls  # (certificate chain PEM, private key PEM): serve TLS
        self.keep = keep  # False: count spans only (the benchmarks' receiver)
        self.spans: list[ReceivedSpan] = []
        self.received = 0  # spans received, kept or not
        self.exports = 0  # Export calls answered
        self.metadata: list[dict[str, str]] = []
        self._on_span = on_span
        self._server: grpc.aio.Server | None = None
        self._running = asyncio.Event()
        self._running.set()
        self._changed = asyncio.Event()

    @property
    def endpoint(self) -> str:
        """What ``--otlp-endpoint`` takes."""
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"

    async def start(self) -> None:
        server = grpc.aio.server()
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, {
            "Export": grpc.unary_unary_rpc_method_handler(
                self._export, request_deserializer=ts.ExportTraceServiceRequest.FromString,
                response_serializer=ts.ExportTraceServiceResponse.SerializeToString)})])
        address = f"127.0.0.1:{self.port}"
        self.port = (server.add_insecure_port(address) if self.tls is None else
                     server.add_secure_port(address, grpc.ssl_server_credentials(
                         [(self.tls[1], self.tls[0])])))
        await server.start()
        self._server = server

    async def stop(self) -> None:
        """Close the port (a receiver that is down); ``start()`` again reopens it."""
        self._running.set()  # a stalled Export may end now
        if self._server is not None:
            await self._server.stop(grace=0.5)
            self._server = None

    def stall(self) -> None:
        """From now on each Export hangs (accepted, never answered) until ``resume()``."""
        self._running.clear()

    def resume(self) -> None:
        self._running.set()

    async def _export(self, request: ts.ExportTraceServiceRequest,
                      context: grpc.aio.ServicerContext[Any, Any]
                      ) -> ts.ExportTraceServiceResponse:
        await self._running.wait()
        self.exports += 1
        if not self.keep:
            self.received += sum(len(ss.spans) for rs in request.resource_spans
                                 for ss in rs.scope_spans)
            return ts.ExportTraceServiceResponse()
        self.metadata.append({k: str(v) for k, v in (context.invocation_metadata() or ())})
        got = spans_of(request)
        self.received += len(got)
        self.spans.extend(got)
        if self._on_span is not None:
            for s in got:
                self._on_span(s)
        self._changed.set()
        return ts.ExportTraceServiceResponse()

    async def wait_for(self, cond: Callable[[list[ReceivedSpan]], bool], timeout: float,
                       what: str) -> list[ReceivedSpan]:
        """Wait until ``cond(spans)`` holds; AssertionError naming ``what`` after ``timeout``."""
        deadline = time.monotonic() + timeout
        while not cond(self.spans):
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"timed out after {timeout:g} s waiting for {what}; "
                                     f"{len(self.spans)} spans received: "
                                     f"{[s.attributes for s in self.spans[-5:]]}")
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), min(left, 0.5))
        return self.spans


def as_json(span: ReceivedSpan) -> str:
    record: Mapping[str, Any] = asdict(span)
    return json.dumps({k: v for k, v in record.items() if k != "received_at"}, sort_keys=True)


async def _main(port: int, quiet: bool) -> None:
    receiver = OtlpReceiver(port, keep=not quiet,
                            on_span=lambda s: print(as_json(s), flush=True))
    await receiver.start()
    print(f"OTLP/gRPC trace receiver on {receiver.endpoint} "
          f"({'counting spans' if quiet else 'one JSON line per span'})", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await receiver.stop()
    print(f"received {receiver.received} spans in {receiver.exports} exports", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, default=4317, help="loopback port (0: a free one)")
    p.add_argument("--quiet", action="store_true",
                   help="count spans, print nothing per span (the benchmarks)")
    args = p.parse_args(argv)
    asyncio.run(_main(args.port, args.quiet))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
