"""Probes against a llama.cpp server that refuses them, or that runs in router mode.

The fake server below serves the bodies a real ``llama-server`` answered
(tests/data/llama-server/) and refuses the way its source does: with
``--api-key`` every path but ``/health`` answers 401 unless the key comes as
``Authorization: Bearer KEY`` or ``X-Api-Key``; ``/metrics`` answers 501
without ``--metrics``; in router mode (``--models-dir``, no ``-m``) ``/props``
describes the router and each model's own ``/props`` is ``/props?model=NAME``.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry
from structlog.testing import capture_logs

from sidecar.config import DEFAULT_POOL, ConfigError, parse_settings, worker_credential
from sidecar.health import CapacityMonitor
from sidecar.metrics import Metrics
from tests.clock import FakeClock
from tests.conftest import serve_on_loopback

DATA = Path(__file__).resolve().parent / "data" / "llama-server"
KEY = "sk-test-0123456789abcdef"
T = 2.0


def body(name: str) -> bytes:
    return (DATA / f"{name}.body").read_bytes()


class FakeLlama:
    """A llama-server's answers, from the captured bodies; counts requests per path."""

    def __init__(self, *, api_key: str | None = None, metrics: bool = True,
                 router_models: dict[str, bool] | None = None, props: bool = True) -> None:
        self.api_key = api_key
        self.props = props  # False: no /props (an engine auto cannot recognise)
        self.public_health = True  # llama.cpp's /health needs no key; False: it does
        self.metrics = metrics
        self.router_models = router_models  # name -> loaded; None = not router mode
        self.processing = 0
        self.deferred = 0
        self.requests: Counter[str] = Counter()
        self.autoloads: list[str] = []  # model queries that did not say autoload=false
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def __aenter__(self) -> FakeLlama:
        app = web.Application(middlewares=[self._auth])
        app.router.add_get("/health", self._health)
        app.router.add_get("/props", self._props)
        app.router.add_get("/models", self._models)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_route("*", "/{tail:.*}", self._not_found)
        self._runner, self.url = await serve_on_loopback(app)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._runner is not None
        await self._runner.cleanup()

    async def _health(self, request: web.Request) -> web.Response:
        return self._json(body("health"))

    async def _not_found(self, request: web.Request) -> web.Response:
        return self._json(body("server_info"), 404)

    @staticmethod
    def _json(data: bytes, status: int = 200) -> web.Response:
        return web.Response(body=data, status=status, content_type="application/json")

    @web.middleware
    async def _auth(self, request: web.Request, handler: Any) -> web.StreamResponse:
        self.requests[request.path] += 1
        public = ("/health", "/v1/health") if self.public_health else ()
        if self.api_key is not None and request.path not in public:
            given = request.headers.get("Authorization") or request.headers.get("X-Api-Key", "")
            if given.removeprefix("Bearer ") != self.api_key:
                return self._json(json.dumps({"error": {
                    "message": "Invalid API Key", "type": "authentication_error",
                    "code": 401}}).encode(), 401)
        resp: web.StreamResponse = await handler(request)
        return resp

    def _model(self, request: web.Request) -> tuple[str | None, web.Response | None]:
        """The router's checks on ?model= (server-models.cpp: router_validate_model)."""
        assert self.router_models is not None
        name = request.query.get("model", "")
        if request.query.get("autoload") != "false":
            self.autoloads.append(name)
        if not name:
            return None, self._error(400, "model name is missing from the request")
        if name not in self.router_models:
            return None, self._error(400, f"model '{name}' not found")
        if not self.router_models[name]:
            return None, self._error(400, "model is not loaded")
        return name, None

    def _error(self, status: int, message: str) -> web.Response:
        return self._json(json.dumps({"error": {"code": status, "message": message}}).encode(),
                          status)

    async def _props(self, request: web.Request) -> web.Response:
        if not self.props:
            return await self._not_found(request)
        if self.router_models is None:
            return self._json(body("props"))
        if "model" not in request.query:
            return self._json(json.dumps({
                "role": "router", "max_instances": 4, "models_autoload": True,
                "model_alias": "llama-server", "model_path": "none",
                "default_generation_settings": {"params": {}, "n_ctx": 0}}).encode())
        _, err = self._model(request)
        return err or self._json(body("props"))

    async def _models(self, request: web.Request) -> web.Response:
        if self.router_models is None:
            return self._json(json.dumps({"object": "list", "data": []}).encode())
        return self._json(json.dumps({"object": "list", "data": [
            {"id": name, "object": "model", "status": {"value": "loaded" if up else "unloaded"}}
            for name, up in self.router_models.items()]}).encode())

    async def _metrics(self, request: web.Request) -> web.Response:
        if not self.metrics:
            return self._error(501, "This server does not support metrics endpoint. "
                                    "Start it with `--metrics`")
        if self.router_models is not None:
            _, err = self._model(request)
            if err is not None:
                return err
        text = body("metrics").decode()
        text = text.replace("llamacpp:requests_processing 0",
                            f"llamacpp:requests_processing {self.processing}")
        text = text.replace("llamacpp:requests_deferred 0",
                            f"llamacpp:requests_deferred {self.deferred}")
        return web.Response(text=text, content_type="text/plain")


def monitor(urls: list[str], clock: FakeClock | None = None, **kw: Any) -> CapacityMonitor:
    return CapacityMonitor(worker_urls=urls, envoy_admin_url=None, envoy_cluster="workers",
                           interval=1.0, timeout=T, fallback=1024, override=None,
                           on_change=lambda r: None, clock=clock or FakeClock(), **kw)


@pytest.fixture
async def keyed() -> AsyncIterator[FakeLlama]:
    async with FakeLlama(api_key=KEY) as w:
        yield w


def refused_gauge(m: Metrics, worker: str, endpoint: str, reason: str) -> float | None:
    return m.registry.get_sample_value("smg_sidecar_worker_probe_refused",
                                       {"worker": worker, "endpoint": endpoint,
                                        "reason": reason})


# ------------------------------------------------------------- --api-key, no credential

@pytest.mark.parametrize("engine", ["llamacpp", "auto"])
async def test_a_refused_capacity_read_counts_one_slot_never_64(keyed: FakeLlama,
                                                                engine: str) -> None:
    clock = FakeClock()
    m = monitor([keyed.url], clock, engine=engine)
    metrics = Metrics(tenant_top_n=4, registry=CollectorRegistry())
    try:
        with capture_logs() as logs:
            r = await m.poll_once()
            metrics.pool(DEFAULT_POOL).capacity_read(r)
            assert (r.source, r.capacity) == ("workers", 1)
            asked = sum(keyed.requests.values())
            for _ in range(3):  # within the retry window: only /health is asked again
                clock.advance(1.0)
                assert (await m.poll_once()).capacity == 1
            assert sum(keyed.requests.values()) == asked + 3
        refused = [e for e in logs if e["event"] == "worker_probe_refused"]
        assert len(refused) == 1, refused
        assert (refused[0]["worker"], refused[0]["reason"]) == (keyed.url, "unauthorized")
        assert "--worker-auth-file" in refused[0]["hint"]
        endpoint = refused[0]["endpoint"]
        assert refused_gauge(metrics, keyed.url, endpoint, "unauthorized") == 1
        # The retry window over, asked again; a key given to the server later is used.
        keyed.api_key = None
        clock.advance(31.0)
        r = await m.poll_once()
        metrics.pool(DEFAULT_POOL).capacity_read(r)
        assert (r.capacity, r.workers[0].engine) == (4, "llamacpp")
        assert refused_gauge(metrics, keyed.url, endpoint, "unauthorized") is None
    finally:
        await m.close()


async def test_a_cap_read_before_stays_when_the_endpoint_refuses_later(keyed: FakeLlama) -> None:
    keyed.api_key = None
    m = monitor([keyed.url], engine="llamacpp")
    try:
        assert (await m.poll_once()).capacity == 4
        keyed.api_key = KEY  # restarted with --api-key
        assert (await m.poll_once()).capacity == 4  # its last cap, never more
    finally:
        await m.close()


@pytest.mark.parametrize("header", [None, "X-Api-Key"])
async def test_the_credential_file_opens_the_probes(keyed: FakeLlama, tmp_path: Path,
                                                    header: str | None) -> None:
    f = tmp_path / "key"
    f.write_text(KEY + "\n")
    cred = worker_credential(str(f), header)
    # The fake engine serves plain http: the key goes there only because it is allowed.
    m = monitor([keyed.url], engine="auto", credential=cred, saturation_guard=True,
                credential_over_http=True)
    try:
        with capture_logs() as logs:
            r = await m.poll_once()
        assert (r.capacity, r.workers[0].engine) == (4, "llamacpp")
        assert keyed.requests["/metrics"] == 1  # the guard's read was let in too
        assert not [e for e in logs if e["event"] == "worker_probe_refused"]
        assert KEY not in repr(logs)
    finally:
        await m.close()


async def test_the_key_is_never_in_a_log_line_or_the_settings_repr(keyed: FakeLlama,
                                                                   tmp_path: Path) -> None:
    f = tmp_path / "key"
    f.write_text("wrong-" + KEY)
    s = parse_settings(["--worker-urls", keyed.url, "--worker-auth-file", str(f),
                        "--worker-auth-allow-http", "--worker-engine", "llamacpp"])
    assert s.worker_credential == {"Authorization": f"Bearer wrong-{KEY}"}
    assert KEY not in repr(s)
    m = monitor([keyed.url], engine="llamacpp", credential=s.worker_credential,
                saturation_guard=True, credential_over_http=True)
    try:
        with capture_logs() as logs:
            assert (await m.poll_once()).capacity == 1
        assert [e["reason"] for e in logs if e["event"] == "worker_probe_refused"] == [
            "unauthorized", "unauthorized"]  # /props and /metrics
        assert KEY not in repr(logs)
    finally:
        await m.close()


@pytest.mark.parametrize(("content", "why"), [
    (b"", "empty"), (b"\n", "empty"), (KEY.encode() + b"\nX-Evil: 1\n", "more than one line"),
    (KEY.encode() + b"\x00", "control"), ("clé".encode() + KEY.encode(), "not ASCII"),
    (b"k" * 9000 + KEY.encode(), "longer than"),
])
def test_a_bad_credential_file_is_refused_without_quoting_it(tmp_path: Path, content: bytes,
                                                             why: str) -> None:
    f = tmp_path / "key"
    f.write_bytes(content)
    with pytest.raises(ConfigError) as err:
        worker_credential(str(f), None)
    assert why in str(err.value) and KEY not in str(err.value)


def test_credential_flags_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="needs --worker-auth-file"):
        worker_credential(None, "x-api-key")
    with pytest.raises(ConfigError, match="cannot read"):
        worker_credential(str(tmp_path / "missing"), None)
    with pytest.raises(ConfigError, match="not a regular file"):
        worker_credential(str(tmp_path), None)
    f = tmp_path / "key"
    f.write_text(KEY)
    with pytest.raises(ConfigError, match="not a header name"):
        worker_credential(str(f), "bad header:")
    os.chmod(f, 0o600)
    assert worker_credential(str(f), "x-api-key") == {"x-api-key": KEY}


# ------------------------------------------------------------- /metrics without --metrics

async def test_metrics_not_enabled_is_said_once_and_not_asked_every_round() -> None:
    clock = FakeClock()
    async with FakeLlama(metrics=False) as w:
        m = monitor([w.url], clock, engine="llamacpp", saturation_guard=True)
        metrics = Metrics(tenant_top_n=4, registry=CollectorRegistry())
        try:
            with capture_logs() as logs:
                for _ in range(5):
                    r = await m.poll_once()
                    clock.advance(1.0)
            metrics.pool(DEFAULT_POOL).capacity_read(r)
            assert r.capacity == 4  # the cap is read; only the guard is blind
            assert w.requests["/metrics"] == 1
            refused = [e for e in logs if e["event"] == "worker_probe_refused"]
            assert [(e["endpoint"], e["reason"]) for e in refused] == [
                ("/metrics", "not_enabled")]
            assert "--metrics" in refused[0]["hint"]
            assert refused_gauge(metrics, w.url, "/metrics", "not_enabled") == 1
            clock.advance(30.0)
            await m.poll_once()
            assert w.requests["/metrics"] == 2
        finally:
            await m.close()


# ------------------------------------------------------------------------- router mode

async def test_router_mode_counts_the_loaded_models_slots_and_never_loads_one() -> None:
    async with FakeLlama(router_models={"a": True, "b": False, "c": True}) as w:
        m = monitor([w.url], engine="auto", saturation_guard=True)
        try:
            with capture_logs() as logs:
                r = await m.poll_once()
                w.processing, w.deferred = 3, 0
                await m.poll_once()
            # Two loaded models of 4 slots each; "b" is not loaded and never asked.
            assert (r.capacity, r.workers[0].engine) == (8, "llamacpp")
            assert w.autoloads == []
            assert [e["engine"] for e in logs if e["event"] == "worker_engine_detected"] == [
                "llamacpp"]
        finally:
            await m.close()


async def test_router_mode_without_a_loaded_model_says_so_once_and_counts_one() -> None:
    async with FakeLlama(router_models={"a": False}) as w:
        m = monitor([w.url], engine="llamacpp")
        metrics = Metrics(tenant_top_n=4, registry=CollectorRegistry())
        try:
            with capture_logs() as logs:
                for _ in range(3):
                    r = await m.poll_once()
            metrics.pool(DEFAULT_POOL).capacity_read(r)
            assert r.capacity == 1
            said = [e for e in logs if e["event"] == "llamacpp_router_no_loaded_model"]
            assert len(said) == 1 and said[0]["worker"] == w.url
            assert refused_gauge(metrics, w.url, "/models", "router_no_loaded_model") == 1
            w.router_models = {"a": True}  # loaded on a first request
            assert (await m.poll_once()).capacity == 4
        finally:
            await m.close()


async def test_an_engine_recognised_once_is_not_recognised_again_every_round() -> None:
    # A worker auto recognises as generic (no engine endpoint answers): its /server_info
    # 404s every round, which must not start a recognition (five requests) each time.
    async with FakeLlama(props=False) as w:
        m = monitor([w.url], engine="auto")
        try:
            with capture_logs() as logs:
                for _ in range(4):
                    r = await m.poll_once()
            assert (r.capacity, r.workers[0].engine) == (64, "generic")
            assert len([e for e in logs if e["event"] == "worker_engine_detected"]) == 1
            first_round = 6  # /health + four recognition paths + /metrics
            assert sum(w.requests.values()) == first_round + 1 + 3 * 2
        finally:
            await m.close()


# ---------------------------------------------------------------- the saturation guard

async def test_the_guard_shrinks_a_full_llamacpp_worker_with_requests_deferred() -> None:
    async with FakeLlama() as w:
        m = monitor([w.url], engine="llamacpp", saturation_guard=True)
        try:
            assert (await m.poll_once()).capacity == 4
            w.processing, w.deferred = 4, 3  # every slot busy, three waiting in its queue
            r = await m.poll_once()
            assert (r.capacity, r.workers[0].saturated) == (1, True)
            w.processing, w.deferred = 4, 0
            assert [(await m.poll_once()).capacity for _ in range(4)] == [2, 3, 4, 4]
            assert w.requests["/metrics"] == 6  # one read per round, no more
        finally:
            await m.close()


async def test_a_refused_health_probe_counts_one_slot_not_the_fallback() -> None:
    # Counted unhealthy, a worker that wants a key even on /health would leave the
    # sidecar on the fallback capacity (1024 before any worker was read).
    async with FakeLlama(api_key=KEY) as w:
        w.public_health = False
        m = monitor([w.url], engine="llamacpp")
        metrics = Metrics(tenant_top_n=4, registry=CollectorRegistry())
        try:
            with capture_logs() as logs:
                r = await m.poll_once()
                await m.poll_once()
            metrics.pool(DEFAULT_POOL).capacity_read(r)
            assert (r.source, r.capacity) == ("workers", 1)
            assert [(e["endpoint"], e["reason"]) for e in logs
                    if e["event"] == "worker_probe_refused"] == [("/health", "unauthorized")]
            assert refused_gauge(metrics, w.url, "/health", "unauthorized") == 1
            assert w.requests["/props"] == 0
        finally:
            await m.close()


async def test_metrics_without_the_engines_gauges_is_said_once() -> None:
    async with FakeLlama() as w:
        m = monitor([w.url], engine="tgi", saturation_guard=True)  # wrong engine: no tgi_*
        try:
            with capture_logs() as logs:
                await m.poll_once()
                await m.poll_once()
            said = [e for e in logs if e["event"] == "worker_saturation_unreadable"]
            assert len(said) == 1 and "tgi_queue_size" in said[0]["error"]
        finally:
            await m.close()
