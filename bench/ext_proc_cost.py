"""What an ext_proc stream costs the sidecar, without Envoy in the way.

A load client in its own process plays Envoy's part against one sidecar: per
request a Check, then (``stream``) an ext_proc stream shaped like Envoy's
(request_headers with the admission id in the metadata, the CONTINUE answer,
response_headers, then the end of the stream), then the access-log entry that
releases the slot, on one long-lived StreamAccessLogs stream. The two shapes
(``check+als`` and ``check+stream+als``) alternate round by round on the same
sidecar, and each round prints the sidecar's CPU per request (server CPU /
requests): on a shared box that figure moves less than throughput does. The
difference of the medians is what one stream costs.

    python -m bench.ext_proc_cost [--rounds 6] [--seconds 2] [--callers 8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from google.protobuf import struct_pb2

from bench._util import cpu_seconds, loadavg, run_client, terminate
from bench.check_throughput import (
    CHANNEL_OPTIONS,
    CHECK,
    Releaser,
    admission_id,
    als_bytes,
    start_sidecar,
)
from bench.codec import check_request_bytes
from sidecar import codec

PROCESS = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"
RESPONSE_HEADERS = ep.ProcessingRequest(response_headers=ep.HttpHeaders()).SerializeToString()


def request_headers(aid: str) -> bytes:
    """As Envoy sends it: the ext_authz namespace, with Envoy's own duration key too."""
    msg = ep.ProcessingRequest(request_headers=ep.HttpHeaders(end_of_stream=False))
    md = struct_pb2.Struct()
    md.update({codec.ADMISSION_ID_KEY: aid, "ext_authz_duration": 1.0})
    msg.metadata_context.filter_metadata[codec.AUTHZ_NAMESPACE].CopyFrom(md)
    out: bytes = msg.SerializeToString()
    return out


async def _load(spec: dict[str, object]) -> dict[str, object]:
    port, pid = int(str(spec["port"])), int(str(spec["server_pid"]))
    seconds, callers = float(str(spec["seconds"])), int(str(spec["callers"]))
    stream = bool(spec["stream"])
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS)
    check: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(CHECK)
    process: grpc.aio.StreamStreamMultiCallable[bytes, bytes] = channel.stream_stream(PROCESS)
    req = check_request_bytes()
    rel = Releaser(channel)
    done = 0

    async def one() -> None:
        nonlocal done
        aid = admission_id(await check(req, timeout=10))
        if aid is None:
            raise RuntimeError("denied: the sidecar should admit everything here")
        if stream:
            call = process(timeout=10)
            await call.write(request_headers(aid))
            await call.read()  # CONTINUE
            await call.write(RESPONSE_HEADERS)
            while await call.read() is not grpc.aio.EOF:  # the sidecar ends the stream
                pass
        rel.queue.put_nowait(als_bytes(aid))
        done += 1

    for _ in range(50):  # warm-up
        await one()
    done = 0
    cpu0, t0 = cpu_seconds(pid), time.perf_counter()
    end = t0 + seconds

    async def caller() -> None:
        while time.perf_counter() < end:
            await one()

    await asyncio.gather(*(caller() for _ in range(callers)))
    wall, cpu = time.perf_counter() - t0, cpu_seconds(pid) - cpu0
    await rel.close()
    await channel.close()
    return {"rps": done / wall, "us": cpu / max(1, done) * 1e6, "cpu": cpu / wall}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--seconds", type=float, default=2.0)
    p.add_argument("--callers", type=int, default=8)
    p.add_argument("--quick", action="store_true", help="3 rounds of 1 s")
    p.add_argument("--client", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.client:
        print(json.dumps(asyncio.run(_load(json.loads(args.client)))))
        return 0
    rounds, seconds = (3, 1.0) if args.quick else (args.rounds, args.seconds)
    print(f"ext_proc_cost: Envoy-shaped gRPC load straight at one sidecar ({args.callers} "
          f"callers, {seconds:g} s per point, shapes alternate); sidecar CPU per request:")
    side = start_sidecar(log_level="warning")
    per: dict[str, list[float]] = {"check+als": [], "check+stream+als": []}
    try:
        for r in range(rounds):
            shapes = list(per) if r % 2 == 0 else list(reversed(per))
            line = []
            for shape in shapes:
                res = run_client("bench.ext_proc_cost", {
                    "port": side.port, "server_pid": side.pid, "seconds": seconds,
                    "callers": args.callers, "stream": shape == "check+stream+als"}, timeout=120)
                us = float(str(res["us"]))
                per[shape].append(us)
                line.append(f"{shape} {float(str(res['rps'])):>6,.0f} req/s {us:>5.0f} us "
                            f"(cpu {float(str(res['cpu'])):.0%})")
            print(f"  round {r}, load {loadavg()}: " + " | ".join(line))
    finally:
        terminate(side.proc)  # type: ignore[arg-type]
    a, b = statistics.median(per["check+als"]), statistics.median(per["check+stream+als"])
    print(f"  median sidecar CPU per request: check+als {a:.0f} us, check+stream+als {b:.0f} us"
          f" -> one ext_proc stream {b - a:.0f} us ({b / a:.2f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
