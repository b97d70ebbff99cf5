"""Codec cost: decode+encode of the hot-path messages, xds-protos vs envoy-data-plane.

The messages are what Envoy really sends/receives: a CheckRequest with 10 request
headers and JWT metadata, the allow CheckResponse the sidecar builds, and an ALS
StreamAccessLogsMessage with one HTTP entry. Each library decodes the same bytes and
re-encodes its decoded message; the baseline is xds-protos (the sidecar's codec),
measured in this run.

    python -m bench.codec [--seconds 0.5] [--quick]
"""

from __future__ import annotations

import argparse
import time
import warnings
from collections.abc import Callable

from envoy.data.accesslog.v3 import accesslog_pb2
from envoy.service.accesslog.v3 import als_pb2
from envoy.service.auth.v3 import external_auth_pb2
from google.protobuf import struct_pb2

from sidecar import codec

warnings.filterwarnings("ignore", category=DeprecationWarning)


def check_request_bytes(extra_headers: dict[str, str] | None = None) -> bytes:
    req = external_auth_pb2.CheckRequest()
    a = req.attributes
    a.source.address.socket_address.address = "10.0.0.7"
    a.source.address.socket_address.port_value = 51234
    a.destination.address.socket_address.address = "10.0.0.1"
    a.destination.address.socket_address.port_value = 10000
    http = a.request.http
    http.id = "1234567890123456789"
    http.method = "POST"
    http.path = "/v1/chat/completions"
    http.host = "llm.example.com"
    http.scheme = "https"
    http.protocol = "HTTP/1.1"
    http.size = 180
    headers = {
        ":authority": "llm.example.com", ":method": "POST", ":path": "/v1/chat/completions",
        ":scheme": "https", "content-type": "application/json", "content-length": "180",
        "user-agent": "openai-python/1.40.0", "x-request-id": "5f1c2a9e-8b7d-4e0f-9a61",
        "x-smg-priority": "interactive", "x-smg-tenant": "auth:acme", **(extra_headers or {}),
    }
    for k, v in headers.items():
        http.headers[k] = v
    s = struct_pb2.Struct()
    s.update({"jwt_payload": {"tenant": "auth:acme", "exp": 1900000000}})
    a.metadata_context.filter_metadata[codec.JWT_NAMESPACE].CopyFrom(s)
    out: bytes = req.SerializeToString()
    return out


def als_message_bytes() -> bytes:
    msg = als_pb2.StreamAccessLogsMessage()
    msg.identifier.node.id = "envoy-0"
    msg.identifier.log_name = "smg_completion"
    e = msg.http_logs.log_entry.add()
    cp = e.common_properties
    cp.access_log_type = accesslog_pb2.DownstreamEnd
    cp.downstream_remote_address.socket_address.address = "10.0.0.7"
    cp.downstream_remote_address.socket_address.port_value = 51234
    cp.start_time.seconds = 1_790_000_000
    cp.time_to_last_downstream_tx_byte.nanos = 52_000_000
    cp.upstream_cluster = "workers"
    fields = cp.metadata.filter_metadata[codec.AUTHZ_NAMESPACE].fields
    fields[codec.ADMISSION_ID_KEY].string_value = "a1b2c3d4e5f60718"
    fields["class"].string_value = "interactive"
    fields["tenant"].string_value = "auth:acme"
    e.protocol_version = accesslog_pb2.HTTPAccessLogEntry.HTTP11
    e.request.request_method = 2  # POST
    e.request.path = "/v1/chat/completions"
    e.request.authority = "llm.example.com"
    e.request.request_id = "5f1c2a9e-8b7d-4e0f-9a61"
    e.response.response_code.value = 200
    e.response.response_body_bytes = 512
    out: bytes = msg.SerializeToString()
    return out


def time_per_call(fn: Callable[[], object], seconds: float) -> float:
    """Microseconds per call, best of 3 rounds of ``seconds / 3``."""
    n = 1
    while True:  # calibrate a batch of about 10 ms
        t = time.perf_counter()
        for _ in range(n):
            fn()
        if time.perf_counter() - t > 0.01:
            break
        n *= 2
    best = float("inf")
    for _ in range(3):
        end = time.perf_counter() + seconds / 3
        calls = 0
        t0 = time.perf_counter()
        while time.perf_counter() < end:
            for _ in range(n):
                fn()
            calls += n
        best = min(best, (time.perf_counter() - t0) / calls)
    return best * 1e6


def cases() -> list[tuple[str, Callable[[], object], Callable[[], object]]]:
    from envoy_data_plane.envoy.service.accesslog import v3 as edp_als
    from envoy_data_plane.envoy.service.auth import v3 as edp_auth

    req = check_request_bytes()
    resp = codec.encode_allow("a1b2c3d4e5f60718", "interactive", "auth:acme")
    als = als_message_bytes()

    def x_req() -> object:
        return external_auth_pb2.CheckRequest.FromString(req).SerializeToString()

    def e_req() -> object:
        return edp_auth.CheckRequest.FromString(req).SerializeToString()

    def x_resp() -> object:
        return external_auth_pb2.CheckResponse.FromString(resp).SerializeToString()

    def e_resp() -> object:
        return edp_auth.CheckResponse.FromString(resp).SerializeToString()

    def x_als() -> object:
        return als_pb2.StreamAccessLogsMessage.FromString(als).SerializeToString()

    def e_als() -> object:
        return edp_als.StreamAccessLogsMessage.FromString(als).SerializeToString()

    def sidecar_check() -> object:
        view = codec.decode_check(req)
        view.headers.get("x-smg-priority")
        return codec.encode_allow("a1b2c3d4e5f60718", "interactive", "auth:acme")

    def sidecar_als() -> object:
        return codec.decode_access_logs(als)

    return [
        (f"CheckRequest ({len(req)} B, 10 headers)", x_req, e_req),
        (f"CheckResponse allow ({len(resp)} B)", x_resp, e_resp),
        (f"StreamAccessLogsMessage, 1 entry ({len(als)} B)", x_als, e_als),
        ("sidecar codec.decode_check+encode_allow", sidecar_check, sidecar_check),
        ("sidecar codec.decode_access_logs", sidecar_als, sidecar_als),
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--seconds", type=float, default=0.6, help="per library per message")
    p.add_argument("--quick", action="store_true", help="0.15 s per measurement")
    args = p.parse_args(argv)
    seconds = 0.15 if args.quick else args.seconds
    print("codec: decode+encode per message, one thread; baseline = xds-protos (upb), "
          "this run")
    print(f"  {'message':<46} {'xds-protos':>11} {'envoy-data-plane':>17} {'ratio':>8}")
    for name, x, e in cases():
        tx = time_per_call(x, seconds)
        if x is e:  # the sidecar's own adapter, for reference: xds-protos only
            print(f"  {name:<46} {tx:>8.2f} us {'-':>17} {'':>8}")
            continue
        te = time_per_call(e, seconds)
        print(f"  {name:<46} {tx:>8.2f} us {te:>14.2f} us {te / tx:>7.1f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
