"""The baseline authz server: grpc.aio, generic handlers, identity serialisers.

Check returns one CheckResponse serialised at start-up (the same shape and size as
the sidecar's allow) without decoding the request; StreamAccessLogs drains its
stream. Nothing else: it is the floor a Python grpc.aio ext_authz server costs.

    python -m bench.noop --port PORT
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import AsyncIterator

import grpc

from sidecar import codec

CHECK_OK = codec.encode_allow("noop-0000000000000", "default", "anonymous")


async def check(data: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
    return CHECK_OK


async def stream_access_logs(requests: AsyncIterator[bytes],
                             context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
    async for _ in requests:
        pass
    return codec.ALS_RESPONSE


async def serve(port: int) -> None:
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    server.add_generic_rpc_handlers([
        grpc.method_handlers_generic_handler("envoy.service.auth.v3.Authorization", {
            "Check": grpc.unary_unary_rpc_method_handler(check)}),
        grpc.method_handlers_generic_handler("envoy.service.accesslog.v3.AccessLogService", {
            "StreamAccessLogs": grpc.stream_unary_rpc_method_handler(stream_access_logs)}),
    ])
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--port", type=int, required=True)
    args = p.parse_args(argv)
    asyncio.run(serve(args.port))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
