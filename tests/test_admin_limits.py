"""The admin port stays bounded under a connection storm.

1,100 connections that never finish their request, against a sidecar whose file
descriptor limit is 1,024 (soft = hard, so start-up cannot raise it): before the
connection cap they exhausted the descriptors, probes failed, and ``/metrics``
timed out. Now ``/metrics`` answers during the storm, Checks are decided as
before, and capacity read from a real worker does not move.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import grpc
import pytest
from envoy.service.auth.v3 import external_auth_pb2

from devtools.fleet import FakeWorker
from sidecar import adminhttp
from sidecar.adminhttp import AdminServer
from sidecar.metrics import Metrics
from tests.grpc_client import check_request
from tests.sidecar_proc import SidecarProcess, free_port

STORM = 1100
CONFIG = """
classes:
  system: {reserved_floor: 0}
  interactive: {reserved_floor: 0, reserved_per_slot: 0.0}
  default: {reserved_per_slot: 0.0}
  bulk: {queue_size: 0}
"""


async def open_silent(port: int, n: int) -> list[asyncio.StreamWriter]:
    """``n`` connections that send half a request line and then nothing."""
    writers = []
    for _ in range(n):
        try:
            _, w = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 2)
        except (OSError, TimeoutError):
            continue  # refused or reset at the cap: the storm goes on
        w.write(b"GET /metr")
        writers.append(w)
    return writers


def close_all(writers: list[asyncio.StreamWriter]) -> None:
    for w in writers:
        w.transport.abort()


async def test_connection_storm_leaves_metrics_admission_and_capacity_alone(
        tmp_path: Path) -> None:
    cfg = tmp_path / "priority.yaml"
    cfg.write_text(CONFIG)
    async with FakeWorker(engine="llamacpp", max_running_requests=8) as worker:
        proc = SidecarProcess(
            ["--priority-scheduler-enabled", "--priority-scheduler-config", str(cfg),
             "--worker-urls", worker.url,
             "--worker-engine", "llamacpp", "--health-interval-secs", "0.2",
             "--max-concurrent-requests", "1024"],
            tmp_path / "sidecar.log", limits={"nofile": 1024})
        try:
            await proc.start()
            before = await proc.metrics()
            assert before["smg_sidecar_capacity"] == 8
            storm = await open_silent(proc.http_port, STORM)
            try:
                # During the storm: the scrape is answered, capacity holds, probes run.
                during = await proc.metrics(timeout=3)
                assert during["smg_sidecar_capacity"] == 8
                assert during['smg_sidecar_capacity_source{source="workers"}'] == 1
                channel = grpc.aio.insecure_channel(f"127.0.0.1:{proc.grpc_port}")
                check = channel.unary_unary(
                    "/envoy.service.auth.v3.Authorization/Check",
                    request_serializer=external_auth_pb2.CheckRequest.SerializeToString,
                    response_deserializer=external_auth_pb2.CheckResponse.FromString)
                try:
                    answers = [await check(check_request({"x-smg-priority": "bulk"}),
                                           timeout=5) for _ in range(12)]
                finally:
                    await channel.close()
                # 8 slots, no bulk queue: exactly the capacity admitted, the rest shed.
                assert [a.status.code == 0 for a in answers] == [True] * 8 + [False] * 4
                assert all(a.denied_response.status.code == 429 for a in answers[8:])
                await asyncio.sleep(0.5)  # a few probe intervals under the storm
                after = await proc.metrics(timeout=3)
                assert after["smg_sidecar_capacity"] == 8
                dropped = after['smg_sidecar_admin_connections_dropped_total{reason="over_cap"}']
                assert dropped >= len(storm) - adminhttp.MAX_CONNECTIONS - 5
            finally:
                close_all(storm)
        finally:
            proc.stop()
        lines = proc.log_lines()
        assert not any("Traceback" in line for line in lines)
        events = [json.loads(x)["event"] for x in lines if x.startswith("{")]
        # One line per 10 s interval, not one per dropped connection.
        assert events.count("admin_connections_dropped") <= 2
        assert "resource_exhausted" not in events


async def test_a_connection_that_never_completes_its_request_is_closed_at_the_deadline(
        ) -> None:
    metrics = Metrics(tenant_top_n=4)
    admin = AdminServer(metrics.registry, lambda: True, metrics, request_deadline=0.2)
    port = await admin.start("127.0.0.1", free_port())
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")  # never the final CRLF
        assert await asyncio.wait_for(reader.read(), 3) == b""  # closed by the sidecar
        assert metrics.registry.get_sample_value(
            "smg_sidecar_admin_connections_dropped_total", {"reason": "deadline"}) == 1
        writer.close()
    finally:
        await admin.stop()


async def test_over_the_cap_the_oldest_stalled_connection_makes_room() -> None:
    metrics = Metrics(tenant_top_n=4)
    admin = AdminServer(metrics.registry, lambda: True, metrics, max_connections=3)
    port = await admin.start("127.0.0.1", free_port())
    try:
        stalled = await open_silent(port, 3)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        reply = await asyncio.wait_for(reader.read(), 3)
        assert reply.startswith(b"HTTP/1.1 200") and reply.endswith(b"ok\n")
        assert metrics.registry.get_sample_value(
            "smg_sidecar_admin_connections_dropped_total", {"reason": "over_cap"}) == 1
        close_all(stalled)
        writer.close()
    finally:
        await admin.stop()


@pytest.mark.parametrize("path", ["/metrics", "/healthz", "/readyz"])
async def test_admin_paths_answer_get_and_head_only(path: str) -> None:
    admin = AdminServer(Metrics(tenant_top_n=4).registry, lambda: False)
    port = await admin.start("127.0.0.1", free_port())
    try:
        for method, expected in (("GET", 503 if path == "/readyz" else 200),
                                 ("HEAD", 503 if path == "/readyz" else 200), ("POST", 405)):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(f"{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                         f"Content-Length: 0\r\n\r\n".encode())
            reply = await asyncio.wait_for(reader.read(), 3)
            assert reply.startswith(f"HTTP/1.1 {expected}".encode()), (method, reply[:40])
            if method == "HEAD":
                assert reply.endswith(b"\r\n\r\n")  # no body
            writer.close()
    finally:
        await admin.stop()


async def test_descriptor_exhaustion_is_logged_once_per_interval_and_recovers(
        tmp_path: Path) -> None:
    # A limit below the connection cap: accepts fail with EMFILE (before the fix,
    # one traceback per failed accept: 3,592 in 14 s).
    proc = SidecarProcess(["--worker-capacity-override", "8"], tmp_path / "sidecar.log",
                          limits={"nofile": 50})
    try:
        await proc.start()
        storm = await open_silent(proc.http_port, 300)
        await asyncio.sleep(1.5)  # accepts fail and are retried under the storm
        close_all(storm)
        deadline = asyncio.get_running_loop().time() + 10
        while True:  # bounded: the port answers again once the storm is gone
            try:
                m = await proc.metrics(timeout=2)
                break
            except (OSError, TimeoutError):
                assert asyncio.get_running_loop().time() < deadline, "admin port never recovered"
        assert m['smg_sidecar_admin_connections_dropped_total{reason="exhausted"}'] >= 1
    finally:
        proc.stop()
    lines = proc.log_lines()
    assert not any("Traceback" in line for line in lines), "\n".join(lines)[-3000:]
    logged = [json.loads(x) for x in lines if x.startswith("{")]
    exhausted = [e for e in logged if e["event"] == "resource_exhausted"]
    assert 1 <= len(exhausted) <= 3, len(exhausted)
    assert exhausted[0]["error"] == "EMFILE"
