"""Engine rules (sidecar/health.py) against fake workers impersonating each engine.

Every worker here is a real HTTP server on loopback (devtools/fleet.py) serving
the engine's own paths, field names and metric names.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from structlog.testing import capture_logs

from devtools.fleet import FakeWorker, prometheus_gauges, sglang_server_info, wait_for
from sidecar.app import build_runtime
from sidecar.capacity import UNREAD_WORKER_CAPACITY, ProbeStatus
from sidecar.config import DEFAULT_POOL, parse_settings
from sidecar.health import (
    DEFAULT_WORKER_CAPACITY,
    SATURATION_METRICS,
    CapacityMonitor,
    WorkerProber,
    new_session,
    prometheus_sums,
    recognise_server_info,
)
from tests.conftest import serve_on_loopback

T = 2.0  # probe timeout: generous, loopback answers in milliseconds


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with new_session() as s:
        yield s


def prober(session: aiohttp.ClientSession, engine: str = "auto",
           guard: bool = False) -> WorkerProber:
    return WorkerProber(lambda: session, engine=engine, timeout=T, saturation_guard=guard)


def monitor(urls: list[str], **kw: Any) -> CapacityMonitor:
    kw.setdefault("timeout", T)
    return CapacityMonitor(worker_urls=urls, envoy_admin_url=None, envoy_cluster="workers",
                           interval=1.0, fallback=1024, override=None,
                           on_change=lambda r: None, **kw)


# --------------------------------------------------------------- the rules, per engine

ENGINE_CASES = [
    # (engine, worker kwargs, worker attributes, expected cap)
    ("sglang", {"max_running_requests": 128, "dp_ranks": 2}, {}, 256),
    ("tgi", {"max_running_requests": 96}, {}, 96),
    ("llamacpp", {"max_running_requests": 6}, {}, 6),
    ("vllm", {"max_running_requests": 512}, {"dev_mode": True}, 512),
    ("vllm", {"max_running_requests": 256, "dp_ranks": 2}, {"dev_mode": True}, 512),
    ("generic", {"max_running_requests": 7}, {}, 7),
]


@pytest.mark.parametrize(("engine", "kwargs", "attrs", "cap"), ENGINE_CASES)
@pytest.mark.parametrize("flag", ["explicit", "auto"])
async def test_each_engine_is_read_by_its_rule(session: aiohttp.ClientSession, engine: str,
                                               kwargs: dict[str, Any], attrs: dict[str, Any],
                                               cap: int, flag: str) -> None:
    async with FakeWorker(engine=engine, **kwargs) as w:
        for k, v in attrs.items():
            setattr(w, k, v)
        p = await prober(session, engine if flag == "explicit" else "auto").probe(w.url)
        assert (p.status, p.engine, p.cap) == (ProbeStatus.HEALTHY, engine, cap)


async def test_sglang_falls_back_in_order(session: aiohttp.ClientSession) -> None:
    async with FakeWorker(engine="sglang", max_running_requests=None, dp_ranks=2) as w:
        pr = prober(session, "sglang")
        # Default launch without per-rank values: top-level CLI arg when given...
        w.sglang_cli_cap = 40
        assert (await pr.probe(w.url)).cap == 40
        # ...else Σ /v1/loads max_running_requests (server_info without internal_states).
        w.sglang_cli_cap = None
        w.max_running_requests = 30
        w.capacity_body = json.dumps({"model_path": "m", "tp_size": 1,
                                      "max_running_requests": None}).encode()
        assert (await pr.probe(w.url)).cap == 60
        # Nothing anywhere: not read (counts as the default, never read before).
        w.max_running_requests = None
        assert (await pr.probe(w.url)).cap is None


async def test_older_sglang_serves_only_get_server_info(session: aiohttp.ClientSession) -> None:
    async with FakeWorker(engine="sglang", max_running_requests=48) as w:
        w.legacy_paths = True
        for engine in ("sglang", "auto"):
            p = await prober(session, engine).probe(w.url)
            assert (p.engine, p.cap) == ("sglang", 48)


async def test_vllm_without_dev_mode_counts_as_the_flag_and_says_so(
        session: aiohttp.ClientSession) -> None:
    async with FakeWorker(engine="vllm", max_running_requests=256) as w:
        pr = prober(session, "auto")
        with capture_logs() as logs:
            p1 = await pr.probe(w.url)
            p2 = await pr.probe(w.url)
        assert (p1.engine, p1.cap, p2.cap) == ("vllm", None, None)
        hints = [e for e in logs if e["event"] == "vllm_capacity_not_exposed"]
        assert len(hints) == 1 and "--worker-max-running-requests" in hints[0]["hint"]
        m = monitor([w.url], default_cap=200)
        assert (await m.poll_once()).capacity == 200
        m2 = monitor([w.url])
        assert (await m2.poll_once()).capacity == DEFAULT_WORKER_CAPACITY
        await m.close()
        await m2.close()


async def test_llamacpp_loading_is_not_healthy_then_detected(
        session: aiohttp.ClientSession) -> None:
    async with FakeWorker(engine="llamacpp", max_running_requests=6) as w:
        w.loading = True
        pr = prober(session)
        assert (await pr.probe(w.url)).status is ProbeStatus.UNHEALTHY
        w.loading = False
        with capture_logs() as logs:
            p = await pr.probe(w.url)
            await pr.probe(w.url)
        assert (p.engine, p.cap) == ("llamacpp", 6)
        detected = [e for e in logs if e["event"] == "worker_engine_detected"]
        assert detected == [{"event": "worker_engine_detected", "log_level": "info",
                             "worker": w.url, "engine": "llamacpp"}]


async def test_unknown_server_is_generic_at_the_default(session: aiohttp.ClientSession) -> None:
    async with FakeWorker(engine="generic", max_running_requests=None) as w:
        w.capacity_body = b'{"hello": "world"}'
        p = await prober(session).probe(w.url)
        assert (p.engine, p.cap) == ("generic", None)


def test_server_info_shapes_are_told_apart() -> None:
    assert recognise_server_info({"vllm_config": {}}) == "vllm"
    assert recognise_server_info({"internal_states": [], "max_running_requests": None}) == "sglang"
    assert recognise_server_info({"max_running_requests": 4, "name": "w1"}) == "generic"
    assert recognise_server_info({"status": "ok"}) is None
    assert recognise_server_info([1, 2]) is None


# ------------------------------------------------------------ fleets and restarts

async def test_mixed_fleet_sums_and_labels_each_worker() -> None:
    workers = [FakeWorker(engine="sglang", max_running_requests=128, dp_ranks=2),
               FakeWorker(engine="tgi", max_running_requests=96),
               FakeWorker(engine="llamacpp", max_running_requests=6),
               FakeWorker(engine="vllm", max_running_requests=999),
               FakeWorker(engine="generic", max_running_requests=3)]
    for w in workers:
        await w.start()
    try:
        m = monitor([w.url for w in workers], default_cap=10)
        r = await m.poll_once()
        assert r.capacity == 256 + 96 + 6 + 10 + 3 and r.source == "workers"
        assert {(c.url, c.engine, c.capacity) for c in r.workers} == {
            (workers[0].url, "sglang", 256), (workers[1].url, "tgi", 96),
            (workers[2].url, "llamacpp", 6), (workers[3].url, "vllm", 10),
            (workers[4].url, "generic", 3)}
        await m.close()
    finally:
        for w in workers:
            await w.stop()


async def test_worker_changing_engine_and_cap_across_a_restart() -> None:
    w = FakeWorker(engine="tgi", max_running_requests=96)
    await w.start()
    m = monitor([w.url])
    try:
        assert (await m.poll_once()).capacity == 96
        await w.stop()  # restart: refused connections first
        r = await m.poll_once()
        assert r.source == "fallback" and r.capacity == 96  # never above the last good
        w.engine, w.max_running_requests = "llamacpp", 6
        await w.start()  # same port
        r = await m.poll_once()
        assert (r.capacity, r.workers[0].engine) == (6, "llamacpp")
        # Swapped without an unhealthy spell in between: the old endpoint's 404
        # triggers recognition again in the same probe.
        w.engine, w.max_running_requests = "sglang", 16
        r = await m.poll_once()
        assert (r.capacity, r.workers[0].engine) == (16, "sglang")
    finally:
        await m.close()
        await w.stop()


SMALL = """
classes:
  system: {reserved_floor: 1}
  interactive: {reserved_floor: 2, reserved_per_slot: 0.0}
  default: {reserved_per_slot: 0.0}
"""


async def test_worker_capacity_metric_through_the_sidecar(tmp_path: Path) -> None:
    cfg = tmp_path / "priority.yaml"
    cfg.write_text(SMALL)
    async with FakeWorker(engine="tgi", max_running_requests=96) as a, \
            FakeWorker(engine="llamacpp", max_running_requests=6) as b:
        settings = parse_settings([
            "--grpc-listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0",
            "--worker-urls", a.url, b.url, "--log-format", "json",
            "--priority-scheduler-enabled", "--priority-scheduler-config", str(cfg)])
        app = await build_runtime(settings)
        await app.serve()
        try:
            reg = app.metrics.registry
            assert reg.get_sample_value("smg_sidecar_worker_capacity",
                                        {"worker": a.url, "engine": "tgi"}) == 96
            assert reg.get_sample_value("smg_sidecar_worker_capacity",
                                        {"worker": b.url, "engine": "llamacpp"}) == 6
            assert reg.get_sample_value("smg_sidecar_capacity") == 102
            b.healthy = False
            await app.pools[DEFAULT_POOL].monitor.poll_once()
            assert reg.get_sample_value("smg_sidecar_worker_capacity",
                                        {"worker": b.url, "engine": "llamacpp"}) is None
            assert reg.get_sample_value("smg_sidecar_capacity") == 96
        finally:
            await app.stop()


# -------------------------------------------------------- malformed and hostile replies

HOSTILE = [
    ("string", b'{"max_concurrent_requests": "128"}'),
    ("null", b'{"max_concurrent_requests": null}'),
    ("NaN", b'{"max_concurrent_requests": NaN}'),
    ("Infinity", b'{"max_concurrent_requests": Infinity}'),
    ("negative", b'{"max_concurrent_requests": -5}'),
    ("zero", b'{"max_concurrent_requests": 0}'),
    ("fraction", b'{"max_concurrent_requests": 2.5}'),
    ("absurd", b'{"max_concurrent_requests": 1e300}'),
    ("bool", b'{"max_concurrent_requests": true}'),
    ("4301 digits", b'{"max_concurrent_requests": ' + b"9" * 4301 + b"}"),
    ("deep nesting", b"[" * 200_000 + b"]" * 200_000),
    ("not JSON", b"<html>oops</html>"),
    ("a list", b"[128]"),
    ("over 1 MiB", b'{"max_concurrent_requests": 8, "pad": "' + b"x" * (1 << 20) + b'"}'),
]


@pytest.mark.parametrize(("label", "body"), HOSTILE, ids=[h[0] for h in HOSTILE])
async def test_hostile_capacity_reply_counts_by_the_safe_rule(label: str, body: bytes) -> None:
    async with FakeWorker(engine="tgi", max_running_requests=12) as w:
        m = monitor([w.url], engine="tgi", default_cap=5)
        try:
            # Never read: one slot, since a reply that is not a cap must not raise
            # capacity (null is the engine reporting none: the default). Read once:
            # that cap is kept.
            w.capacity_body = body
            never_read = 5 if label == "null" else UNREAD_WORKER_CAPACITY
            with capture_logs() as logs:
                assert (await m.poll_once()).capacity == never_read
                assert (await m.poll_once()).capacity == never_read
            unreadable = [e for e in logs if e["event"] == "worker_capacity_unreadable"]
            assert len(unreadable) == 1 and unreadable[0]["worker"] == w.url
            assert len(unreadable[0]["reason"]) <= 200
            w.capacity_body = None
            assert (await m.poll_once()).capacity == 12
            w.capacity_body = body
            assert (await m.poll_once()).capacity == 12
        finally:
            await m.close()


async def test_hostile_server_info_in_auto_mode_does_not_crash() -> None:
    async with FakeWorker(engine="generic") as w:
        m = monitor([w.url], default_cap=5)
        try:
            for body in (b'{"max_running_requests": NaN}', b'{"max_running_requests": -1}',
                         b"[" * 100_000, b'{"internal_states": [{"effective_max_running_'
                         b'requests_per_dp": "lots"}]}'):
                w.capacity_body = body
                r = await m.poll_once()
                assert r.source == "workers" and r.capacity in (4, 5, UNREAD_WORKER_CAPACITY)
        finally:
            await m.close()


# ----------------------------------------------------------------- saturation signals

def test_prometheus_sums_take_exact_names_only() -> None:
    text = prometheus_gauges([
        ("vllm:num_requests_waiting", 'engine="0",model_name="a"', 2.0),
        ("vllm:num_requests_waiting", 'engine="1",model_name="a"', 3.0),
        ("vllm:num_requests_waiting_by_reason", 'reason="capacity"', 100.0),
        ("vllm:num_requests_running", 'engine="0"', 4.0)])
    sums = prometheus_sums(text, ["vllm:num_requests_waiting", "vllm:num_requests_running"])
    assert sums == {"vllm:num_requests_waiting": 5.0, "vllm:num_requests_running": 4.0}


@pytest.mark.parametrize("engine", ["vllm", "sglang", "tgi", "llamacpp"])
async def test_each_engine_reports_running_and_waiting(session: aiohttp.ClientSession,
                                                       engine: str) -> None:
    """A worker with a full batch (2 slots, 5 requests held): 2 running, 3 waiting."""
    async with FakeWorker(engine=engine, max_running_requests=8, batch_limit=2) as w, \
            aiohttp.ClientSession() as client:
        w.dev_mode = True  # vLLM: so that its cap is read too

        async def one() -> None:
            async with client.post(f"{w.url}/v1/chat/completions", json={},
                                   headers={"x-fake-gate": "go"}) as r:
                await r.read()

        tasks = [asyncio.create_task(one()) for _ in range(5)]
        try:
            await wait_for(lambda: w.running == 2 and w.waiting == 3, 5)
            p = await prober(session, engine, guard=True).probe(w.url)
            assert (p.cap, p.running, p.waiting) == (8, 2, 3)
            if engine == "sglang":
                # A build without /v1/loads: its sglang:* metrics from the next round on.
                w.serve_loads = False
                pr = prober(session, engine, guard=True)
                assert (await pr.probe(w.url)).waiting is None
                p = await pr.probe(w.url)
                assert (p.cap, p.running, p.waiting) == (8, 2, 3)
        finally:
            w.gates.open("go")
            await asyncio.gather(*tasks)


def test_newer_sglang_metric_prefix_is_read_too() -> None:
    running, waiting = SATURATION_METRICS["sglang"]
    text = prometheus_gauges([("sglang_num_running_reqs", 'model_name="m"', 3.0),
                              ("sglang_num_queue_reqs", 'model_name="m"', 2.0)])
    assert prometheus_sums(text, [*running, *waiting]) == {
        "sglang_num_running_reqs": 3.0, "sglang_num_queue_reqs": 2.0}


async def test_sglang_top_level_effective_cap_is_not_the_total(
        session: aiohttp.ClientSession) -> None:
    """A proposed top-level effective_max_running_requests is the minimum across ranks:
    the total is still the sum over internal_states."""
    async with FakeWorker(engine="sglang", max_running_requests=128, dp_ranks=2) as w:
        info = sglang_server_info(128, 2, None)
        info["effective_max_running_requests"] = 128
        w.capacity_body = json.dumps(info).encode()
        assert (await prober(session, "auto").probe(w.url)).cap == 256


async def test_envoy_admin_hosts_follow_the_same_rules() -> None:
    """Hosts found through --envoy-admin-url are recognised and read like --worker-urls;
    an admin API that stops answering holds the last reading."""
    from aiohttp import web

    async with FakeWorker(engine="tgi", max_running_requests=96) as w:
        clusters = {"cluster_statuses": [{"name": "workers", "host_statuses": [{
            "address": {"socket_address": {"address": "127.0.0.1", "port_value": w.port}},
            "health_status": {"eds_health_status": "HEALTHY"}}]}]}
        up = {"ok": True}

        async def handler(request: web.Request) -> web.Response:
            if not up["ok"]:
                return web.Response(status=503)
            return web.json_response(clusters)

        app = web.Application()
        app.router.add_get("/clusters", handler)
        runner, url = await serve_on_loopback(app)
        m = CapacityMonitor(worker_urls=[], envoy_admin_url=url,
                            envoy_cluster="workers", interval=1.0, timeout=T, fallback=1024,
                            override=None, on_change=lambda r: None)
        try:
            r = await m.poll_once()
            assert (r.capacity, r.workers[0].engine) == (96, "tgi")
            up["ok"] = False
            r = await m.poll_once()
            assert (r.capacity, r.source, r.held) == (96, "workers", True)
        finally:
            await m.close()
            await runner.cleanup()
