"""The workers' API key (--worker-auth-file): over TLS only, and never in a log line.

- Every worker source that would send the key over plain http is refused at start-up
  (``--worker-urls http://…``, ``--envoy-admin-url`` hosts probed as http) unless
  ``--worker-auth-allow-http`` says so; and a probe to an http worker never carries it.
- Hosts found through Envoy's admin API are probed over https with
  ``--envoy-cluster-scheme https``: a TLS worker gets the key (its slots are read), a port
  that does not speak TLS gets a TLS handshake, never the key in clear.
- A worker that echoes the key into every value the sidecar reads (every engine's
  capacity fields, model names, /metrics) never gets any 8-character piece of it into a
  log line: in-process for every engine, and a real sidecar process at debug.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import ssl
import subprocess
import sys
from pathlib import Path
from typing import Any, Self

import pytest
from aiohttp import web
from structlog.testing import capture_logs

from sidecar import logs
from sidecar.config import ConfigError, parse_settings
from sidecar.health import ENGINES, CapacityMonitor, sends_credential
from tests.clock import FakeClock
from tests.sidecar_proc import SidecarProcess

REPO = Path(__file__).resolve().parents[1]


def new_key() -> str:
    key = "sk-" + secrets.token_hex(20)
    print(f"worker key for this test: {key}")  # shown with a failure
    return key


def assert_no_piece(text: str, key: str, window: int = logs.REDACT_WINDOW) -> None:
    """Neither the key nor any ``window`` characters of it in ``text``."""
    leaked = [key[i:i + window] for i in range(len(key) - window + 1)
              if key[i:i + window] in text]
    assert not leaked, f"pieces of the key in the log: {leaked[:5]}"


def key_file(tmp_path: Path, key: str) -> Path:
    f = tmp_path / "worker.key"
    f.write_text(key + "\n")
    return f


# --------------------------------------------------------------------------- fakes


@pytest.fixture(scope="module")
def tls_cert(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 (cert, key)."""
    d = tmp_path_factory.mktemp("tls")
    cert, key = d / "cert.pem", d / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                    "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=127.0.0.1", "-addext",
                    "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True, timeout=60)
    return cert, key


class LoopbackApp:
    """An aiohttp fake on a free loopback port (over TLS with ``ssl_context``), its base URL
    in ``url`` while entered; every request goes to ``_handle`` unless ``routes`` says
    otherwise."""

    def __init__(self, ssl_context: ssl.SSLContext | None = None) -> None:
        self.ssl_context = ssl_context
        self.url = ""
        self._runner: web.AppRunner | None = None

    def routes(self, app: web.Application) -> None:
        app.router.add_route("*", "/{tail:.*}", self._handle)

    async def _handle(self, request: web.Request) -> web.Response:
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        app = web.Application()
        self.routes(app)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0, ssl_context=self.ssl_context)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"{'https' if self.ssl_context else 'http'}://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._runner is not None
        await self._runner.cleanup()


class KeyedWorker(LoopbackApp):
    """A generic engine that wants the key on every path but /health (as llama.cpp and
    vLLM with --api-key do); records the credential each request carried."""

    def __init__(self, key: str, ssl_context: ssl.SSLContext | None = None) -> None:
        super().__init__(ssl_context)
        self.key = key
        self.seen: list[str | None] = []

    async def _handle(self, request: web.Request) -> web.Response:
        given = request.headers.get("Authorization")
        self.seen.append(given)
        if request.path == "/health":
            return web.json_response({"status": "ok"})
        if given != f"Bearer {self.key}":
            return web.json_response({"error": "Invalid API Key"}, status=401)
        if request.path == "/server_info":
            return web.json_response({"max_running_requests": 7})
        return web.json_response({}, status=404)


class RawPort:
    """A port that reads what a client sends and answers nothing (a TLS-only worker port,
    as far as a plain-http client is concerned): what came over the wire, per connection."""

    def __init__(self) -> None:
        self.received: list[bytes] = []
        self.port = 0
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> RawPort:
        self._server = await asyncio.start_server(self._conn, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()

    async def _conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        data = b""
        with contextlib.suppress(TimeoutError, ConnectionError):
            data = await asyncio.wait_for(reader.read(65536), 2)
        self.received.append(data)
        writer.close()


class FakeEnvoyAdmin(LoopbackApp):
    """Envoy's admin API as the capacity monitor reads it: ``/clusters?format=json`` with
    the hosts of cluster ``workers``."""

    def __init__(self, hosts: list[tuple[str, int]]) -> None:
        super().__init__()
        self.hosts = hosts

    def routes(self, app: web.Application) -> None:
        app.router.add_get("/clusters", self._clusters)

    async def _clusters(self, request: web.Request) -> web.Response:
        return web.json_response({"cluster_statuses": [{"name": "workers", "host_statuses": [
            {"address": {"socket_address": {"address": a, "port_value": p}},
             "health_status": {"eds_health_status": "HEALTHY"}} for a, p in self.hosts]}]})


def monitor(urls: list[str], **kw: Any) -> CapacityMonitor:
    return CapacityMonitor(worker_urls=urls, envoy_admin_url=None, envoy_cluster="workers",
                           interval=1.0, timeout=2.0, fallback=1024, override=None,
                           on_change=lambda r: None, clock=FakeClock(), **kw)


# ------------------------------------------------------------------ start-up refusals


@pytest.mark.parametrize("workers", [
    ["--worker-urls", "http://127.0.0.1:8000"],
    ["--worker-urls", "https://127.0.0.1:8000", "big=http://127.0.0.1:8001"],  # a named pool
    ["--envoy-admin-url", "http://127.0.0.1:9901"],  # its hosts probed as http
    ["--envoy-admin-url", "http://127.0.0.1:9901", "--envoy-cluster-scheme", "http"],
])
def test_a_key_that_would_go_over_plain_http_is_refused_at_start_up(
        tmp_path: Path, workers: list[str]) -> None:
    key = new_key()
    args = [*workers, "--worker-auth-file", str(key_file(tmp_path, key))]
    with pytest.raises(ConfigError, match="--worker-auth-allow-http") as err:
        parse_settings(args)
    assert "plain http" in str(err.value)
    assert_no_piece(str(err.value), key)
    # Allowed explicitly, or no key at all: it starts.
    assert parse_settings([*args, "--worker-auth-allow-http"]).worker_auth_allow_http
    assert parse_settings(workers).worker_credential is None


@pytest.mark.parametrize("workers", [
    ["--worker-urls", "https://127.0.0.1:8000", "big=https://127.0.0.1:8001"],
    ["--envoy-admin-url", "http://127.0.0.1:9901", "--envoy-cluster-scheme", "https"],
    [],  # nothing to send it to
])
def test_a_key_that_goes_over_tls_only_is_accepted(tmp_path: Path, workers: list[str]) -> None:
    s = parse_settings([*workers, "--worker-auth-file", str(key_file(tmp_path, new_key()))])
    assert s.worker_credential is not None and not s.worker_auth_allow_http


def test_the_refusal_is_a_config_error_of_the_process(tmp_path: Path) -> None:
    key = new_key()
    out = subprocess.run([sys.executable, "-m", "sidecar", "--worker-urls",
                          "http://127.0.0.1:9", "--worker-auth-file",
                          str(key_file(tmp_path, key))],
                         capture_output=True, text=True, timeout=60, cwd=REPO, check=False)
    assert out.returncode == 2, out.stderr
    assert "--worker-auth-allow-http" in out.stderr
    assert_no_piece(out.stdout + out.stderr, key)


def test_the_rule_is_https_or_allowed() -> None:
    assert sends_credential("https://w:1", False) and sends_credential("HTTPS://w:1", False)
    assert not sends_credential("http://w:1", False)
    assert sends_credential("http://w:1", True)


# ------------------------------------------------------------------ at run time


@pytest.mark.parametrize("allowed", [False, True])
async def test_a_probe_to_an_http_worker_carries_the_key_only_when_allowed(
        allowed: bool) -> None:
    key = new_key()
    async with KeyedWorker(key) as w:
        m = monitor([w.url], engine="generic",
                    credential={"Authorization": f"Bearer {key}"}, credential_over_http=allowed)
        try:
            with capture_logs() as logged:
                r1 = await m.poll_once()
                await m.poll_once()
        finally:
            await m.close()
    assert w.seen, "the worker was never asked"
    if allowed:  # the opt-in works: the slots are read with the key
        assert r1.capacity == 7 and set(w.seen) == {f"Bearer {key}"}
    else:  # withheld: the worker refuses, counted for one slot; said once
        assert r1.capacity == 1 and set(w.seen) == {None}
        withheld = [e for e in logged if e["event"] == "worker_credential_withheld"]
        assert len(withheld) == 1 and withheld[0]["worker"] == w.url
        assert "--worker-auth-allow-http" in withheld[0]["hint"]
    assert_no_piece(repr(logged), key)


async def test_workers_found_through_envoy_get_the_key_over_tls_only(
        tmp_path: Path, tls_cert: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """A TLS worker and a port that does not speak TLS, both listed by Envoy's admin: with
    --envoy-cluster-scheme https the first is read with the key, the second gets TLS
    handshakes and never the key (plain http gave it the key in clear every probe)."""
    cert, cert_key = tls_cert
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert, cert_key)
    key = new_key()
    async with KeyedWorker(key, ctx) as tls, RawPort() as raw:
        tls_port = int(tls.url.rsplit(":", 1)[1])
        async with FakeEnvoyAdmin([("127.0.0.1", tls_port), ("127.0.0.1", raw.port)]) as admin:
            monkeypatch.setenv("SSL_CERT_FILE", str(cert))  # the sidecar trusts this CA
            proc = SidecarProcess(["--envoy-admin-url", admin.url, "--envoy-cluster-scheme",
                                   "https", "--worker-auth-file", str(key_file(tmp_path, key)),
                                   "--worker-engine", "generic", "--health-interval-secs", "0.2",
                                   "--log-level", "debug"], tmp_path / "sidecar.log")
            await proc.start()
            try:
                deadline = asyncio.get_running_loop().time() + 20
                while True:
                    m = await proc.metrics()
                    if m.get("smg_sidecar_capacity") == 7 and len(raw.received) >= 5:
                        break
                    assert asyncio.get_running_loop().time() < deadline, (m, raw.received)
                    await asyncio.sleep(0.1)
            finally:
                proc.stop()
    # The TLS worker was read with the key (7 slots: without it, 1).
    assert f"Bearer {key}" in tls.seen
    # The other port saw TLS handshakes (a record of type 22), never the key.
    assert all(data[:1] == b"\x16" for data in raw.received if data), raw.received[:2]
    for data in raw.received:
        assert_no_piece(data.decode("latin-1"), key)
    assert_no_piece(proc.log_path.read_text(), key)


# ---------------------------------------------------------------- echoed secrets


class EchoingWorker(LoopbackApp):
    """A hostile worker: /health is fine, and every value any engine's capacity or
    saturation read looks at is the credential it was sent (whole, clipped, or the bare
    key), as are its model names and its /metrics samples."""

    def __init__(self, role_router: bool = True) -> None:
        super().__init__()
        self.role_router = role_router
        self.asked = 0

    async def _handle(self, request: web.Request) -> web.Response:
        self.asked += 1
        header = request.headers.get("Authorization") or request.headers.get("X-Api-Key", "")
        bare = header.removeprefix("Bearer ")
        echo: Any = header
        path = request.path
        if path == "/health":
            return web.json_response({"status": "ok", "echo": header})
        if path == "/metrics":
            text = "".join(f'{name}{{model="{bare}"}} {bare}\n' for name in (
                "vllm:num_requests_running", "vllm:num_requests_waiting",
                "sglang:num_running_reqs", "sglang:num_queue_reqs", "tgi_batch_current_size",
                "tgi_queue_size", "llamacpp:requests_processing", "llamacpp:requests_deferred"))
            return web.Response(text=text, content_type="text/plain")
        if path in ("/server_info", "/get_server_info"):
            body = {"max_running_requests": echo, "tp_size": bare,
                    "internal_states": [{"effective_max_running_requests_per_dp": echo}]}
            if request.query.get("config_format") == "json":  # what vLLM's dev mode asks
                body["vllm_config"] = {"scheduler_config": {"max_num_seqs": echo},
                                       "parallel_config": {"data_parallel_size": bare}}
            return web.json_response(body)
        if path == "/v1/loads":
            return web.json_response({"loads": [{"max_running_requests": bare,
                                                 "num_running_reqs": echo,
                                                 "num_waiting_reqs": bare}]})
        if path == "/info":
            return web.json_response({"max_concurrent_requests": echo})
        if path == "/props":
            if "model" in request.query or not self.role_router:
                return web.json_response({"total_slots": echo})
            return web.json_response({"role": "router"})
        if path == "/models":
            return web.json_response({"data": [{"id": header, "status": {"value": "loaded"}},
                                               {"id": bare[:40], "status": {"value": "loaded"}}]})
        return web.json_response({"error": header}, status=500, reason="Echo")


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("header", [None, "X-Api-Key"])
async def test_a_worker_echoing_the_key_everywhere_never_gets_it_into_a_line(
        engine: str, header: str | None) -> None:
    key = new_key()
    cred = {"Authorization": f"Bearer {key}"} if header is None else {header: key}
    async with EchoingWorker(role_router=engine == "llamacpp") as w:
        m = monitor([w.url], engine=engine, credential=cred, credential_over_http=True,
                    saturation_guard=True)
        try:
            with capture_logs() as logged:
                for _ in range(3):
                    await m.poll_once()
        finally:
            await m.close()
    assert w.asked > 3
    warned = [e for e in logged if e["log_level"] == "warning"]
    assert warned, "the worker's answers were never quoted: nothing was tried"
    assert_no_piece(json.dumps(logged, default=str), key)


async def test_a_real_sidecar_logs_no_piece_of_an_echoed_key(tmp_path: Path) -> None:
    """The process's own log configuration: every line, debug included, scrubbed."""
    key = new_key()
    async with EchoingWorker(role_router=True) as w:
        proc = SidecarProcess(["--worker-urls", w.url, "--worker-auth-file",
                               str(key_file(tmp_path, key)), "--worker-auth-allow-http",
                               "--saturation-guard", "--worker-engine", "llamacpp",
                               "--health-interval-secs", "0.1", "--log-level", "debug"],
                              tmp_path / "sidecar.log")
        await proc.start()
        try:
            deadline = asyncio.get_running_loop().time() + 10
            while "worker_saturation_unreadable" not in proc.log_path.read_text():
                assert asyncio.get_running_loop().time() < deadline, proc.log_lines()[-5:]
                await asyncio.sleep(0.1)
        finally:
            proc.stop()
    text = proc.log_path.read_text()
    assert logs.REDACTED in text  # the worker's answers were quoted, and cut
    assert_no_piece(text, key)


def test_the_redactor_cuts_every_piece_and_nothing_else() -> None:
    r = logs.Redactor()
    r.add("0123456789abcdef")
    assert r.scrub("no secret here") == "no secret here"
    assert r.scrub("x0123456789abcdefy") == f"x{logs.REDACTED}y"
    assert r.scrub("clipped: 0123456789a'") == f"clipped: {logs.REDACTED}'"
    assert r.scrub("tail 89abcdef and 1234567") == f"tail {logs.REDACTED} and 1234567"
    assert r.scrub_value({"a": ["..23456789..", 5], "b": None}) == {
        "a": [f"..{logs.REDACTED}..", 5], "b": None}


def test_the_process_log_configuration_scrubs_every_line_and_traceback() -> None:
    """logs.configure's processor: any line, any level, an exception's text included."""
    key = new_key()
    code = (
        "import sys\n"
        "from sidecar import logs\n"
        "logs.configure('json', 'debug')\n"
        f"logs.register_secret({key!r})\n"
        "log = logs.get('t')\n"
        f"log.debug('d', value={key!r}, nested={{'k': [{key[3:30]!r}]}})\n"
        f"log.info('i', clipped={('Bearer ' + key)[:40]!r})\n"
        "try:\n"
        f"    raise ValueError({key!r})\n"
        "except ValueError:\n"
        "    log.exception('boom')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, cwd=REPO, check=True)
    lines = [json.loads(ln) for ln in out.stderr.splitlines()]
    assert [ln["event"] for ln in lines] == ["d", "i", "boom"]
    assert "ValueError" in lines[2]["exception"] and logs.REDACTED in lines[2]["exception"]
    assert_no_piece(out.stderr, key)
