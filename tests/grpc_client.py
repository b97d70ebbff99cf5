"""A tiny Envoy stand-in for gRPC-level tests: builds CheckRequests and ALS entries."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.data.accesslog.v3 import accesslog_pb2
from envoy.service.accesslog.v3 import als_pb2
from envoy.service.auth.v3 import external_auth_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from google.protobuf import struct_pb2

from sidecar import codec


def check_request(headers: dict[str, str], principal: str = "",
                  jwt_payload: dict[str, object] | None = None) -> external_auth_pb2.CheckRequest:
    req = external_auth_pb2.CheckRequest()
    http = req.attributes.request.http
    http.method = "POST"
    http.path = "/v1/chat/completions"
    for k, v in headers.items():
        http.headers[k] = v
    if principal:
        req.attributes.source.principal = principal
    if jwt_payload is not None:
        s = struct_pb2.Struct()
        s.update({"jwt_payload": jwt_payload})
        req.attributes.metadata_context.filter_metadata[codec.JWT_NAMESPACE].CopyFrom(s)
    return req


class EnvoyStandIn:
    def __init__(self, port: int) -> None:
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        self._check = self.channel.unary_unary(
            "/envoy.service.auth.v3.Authorization/Check",
            request_serializer=external_auth_pb2.CheckRequest.SerializeToString,
            response_deserializer=external_auth_pb2.CheckResponse.FromString)
        self._als = self.channel.stream_unary(
            "/envoy.service.accesslog.v3.AccessLogService/StreamAccessLogs",
            request_serializer=als_pb2.StreamAccessLogsMessage.SerializeToString,
            response_deserializer=als_pb2.StreamAccessLogsResponse.FromString)

    def check(self, headers: dict[str, str] | None = None, **kw: object) -> grpc.aio.UnaryUnaryCall:
        return self._check(check_request(headers or {}, **kw))  # type: ignore[arg-type]

    async def log(self, *entries: tuple[str, str], cls: str = "") -> None:
        """Send ALS entries (admission_id, "end" | "periodic") on one stream."""
        msg = als_pb2.StreamAccessLogsMessage()
        msg.identifier.node.id = "test"
        msg.identifier.log_name = "smg_completion"
        for aid, kind in entries:
            e = msg.http_logs.log_entry.add()
            cp = e.common_properties
            cp.access_log_type = (accesslog_pb2.DownstreamEnd if kind == "end"
                                  else accesslog_pb2.DownstreamPeriodic)
            if aid:
                fields = cp.metadata.filter_metadata[codec.AUTHZ_NAMESPACE].fields
                fields[codec.ADMISSION_ID_KEY].string_value = aid
                if cls:
                    fields["class"].string_value = cls
            e.response.response_code.value = 200
        await self._als(iter([msg]))

    def open_log_stream(self) -> LogStream:
        """An ALS stream held open, as Envoy holds one per worker thread while it lives."""
        return LogStream(self._als)

    async def close(self) -> None:
        await self.channel.close()


class LogStream:
    """One access-log stream: its first message (node identifier, no entries) is sent at
    once; ``end()`` half-closes it as an Envoy shutting down would, ``cancel()`` resets it
    as a killed one does."""

    def __init__(self, method: grpc.aio.StreamUnaryMultiCallable) -> None:
        self._out: asyncio.Queue[als_pb2.StreamAccessLogsMessage | None] = asyncio.Queue()
        first = als_pb2.StreamAccessLogsMessage()
        first.identifier.node.id = "test"
        first.identifier.log_name = "smg_completion"
        self._out.put_nowait(first)
        self.call = method(self._messages())

    async def _messages(self) -> AsyncIterator[als_pb2.StreamAccessLogsMessage]:
        while (m := await self._out.get()) is not None:
            yield m

    async def end(self) -> None:
        self._out.put_nowait(None)
        await self.call

    def cancel(self) -> None:
        self.call.cancel()


def admission_id(resp: external_auth_pb2.CheckResponse) -> str:
    return str(resp.dynamic_metadata.fields[codec.ADMISSION_ID_KEY].string_value)


def headers_of(options: list[base_pb2.HeaderValueOption]) -> dict[str, str]:
    return {o.header.key: o.header.value for o in options}


def assert_preemption_message(msg: ep.ProcessingResponse) -> None:
    """An ext_proc message delivering the contract's preemption: an immediate 503 with
    X-SMG-Error-Code and JSON body ``scheduler_preempted``."""
    assert msg.WhichOneof("response") == "immediate_response"
    imm = msg.immediate_response
    assert imm.status.code == 503
    hdrs = {h.header.key: h.header.value or h.header.raw_value.decode()
            for h in imm.headers.set_headers}
    assert hdrs["x-smg-error-code"] == "scheduler_preempted"
    assert json.loads(imm.body)["error"]["code"] == "scheduler_preempted"
