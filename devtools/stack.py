"""The whole loop on loopback: fake workers, the sidecar process, and a real Envoy.

Used by the end-to-end tests, the demo (``make run``) and the benchmarks. The
workers run in the caller's event loop (so tests can read what each worker
saw); the sidecar and Envoy are real child processes on free ports.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

from prometheus_client.parser import text_string_to_metric_families

from devtools.fleet import Fleet
from devtools.httpclient import HTTP_ERRORS
from devtools.httpclient import get as http_get
from devtools.proc import die_with_parent, print_safely
from devtools.valkey import ValkeyServer
from sidecar.config import parse_priority_config

REPO = Path(__file__).resolve().parents[1]
# Bounds on waits for the child processes, generous for a loaded 2-core box (other test
# runs, CI neighbours): how long one may take to start serving, and to answer one query.
# They bound a wait for a condition, not a promise under test.
READY_SECS = 60.0
ANSWER_SECS = 10.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def envoy_binary() -> str:
    """``$ENVOY_BIN``, else the Makefile's tool venv, else ``envoy`` on PATH."""
    candidates = [os.environ.get("ENVOY_BIN"), str(REPO / ".venv-envoy" / "bin" / "envoy"),
                  shutil.which("envoy")]
    for c in candidates:
        if c and os.access(c, os.X_OK):
            return c
    raise FileNotFoundError("no Envoy binary: run `make envoy` or set ENVOY_BIN")


def load_renderer(name: str = "render") -> ModuleType:
    """envoy/<name>.py, loaded by path (``envoy`` is also xds-protos' package name)."""
    spec = importlib.util.spec_from_file_location(f"smg_envoy_{name}",
                                                  REPO / "envoy" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Worker(Protocol):
    @property
    def healthy(self) -> bool: ...


class Engines(Protocol):
    """Workers a stack fronts instead of its fake fleet: real llama-servers
    (:class:`devtools.llama.LlamaFleet`), someone's own engines (``devtools.front``)."""

    @property
    def workers(self) -> Sequence[_Worker]: ...
    @property
    def urls(self) -> list[str]: ...
    @property
    def addresses(self) -> list[tuple[str, int]]: ...
    async def start(self) -> None: ...
    async def stop(self) -> None: ...


@dataclass
class StackConfig:
    workers: int = 2
    max_running_requests: int | None = 2
    service_time: float = 0.02
    priority_yaml: str = ""
    sidecar_args: Sequence[str] = ()
    flush_interval_secs: float = 1.0
    lease_secs: float = 10.0
    authz_timeout_secs: float | None = None  # None: longest queue timeout + 5 s
    preemption: bool = True
    jwt_secret: str | None = None
    # jwt_authn trusting this JWKS (JSON, public keys) instead of jwt_secret, tokens of
    # jwt_issuer if set (the demo identity: devtools.identity).
    jwt_jwks: str | None = None
    jwt_issuer: str | None = None
    # Envoy puts the engine's API key read from this file on upstream requests.
    engine_key_file: str | None = None
    health_interval_secs: float = 0.2
    envoy_concurrency: int = 1
    listen_port: int = 0
    admin_port: int = 0
    grpc_port: int = 0
    http_port: int = 0
    worker_base_port: int = 0
    log_level: str = "info"
    capacity_from_envoy: bool = False
    extra_env: dict[str, str] = field(default_factory=dict)
    # Serve gRPC on a Unix socket (Envoy reaches it as a pipe) instead of a TCP port.
    grpc_unix: bool = False
    # Envoy config as Istio / Envoy Gateway generate it (envoy/mesh.py): no periodic
    # access-log entries, default ALS buffering, the mesh's ext_authz settings.
    mesh: bool = False
    # Named pools (sidecar --worker-urls NAME=URL): name -> (workers, max_running_requests
    # of each), a fleet of their own each, reached through Envoy at /NAME/ (rewritten
    # to /). The fleet above is the default pool.
    pools: dict[str, tuple[int, int]] = field(default_factory=dict)
    # Per named pool, its workers' engine and engine knobs (FakeWorker's; e.g. {"engine":
    # "vllm", "dev_mode": True}).
    pool_worker_kwargs: dict[str, dict[str, Any]] = field(default_factory=dict)
    # Pools Envoy routes (at /NAME/, to the default fleet) that the sidecar is not told of.
    envoy_extra_pools: tuple[str, ...] = ()
    # Edge shedding on both sides: the bootstrap's edge path and the sidecar's --edge-shed.
    # On, as the product ships (envoy/render.py, the demo, k8s/base); a mesh-shaped config
    # (mesh=True) has no edge path and needs edge_shed=False.
    edge_shed: bool = True
    # Token budgets' Envoy filters (render.py --tokens, on as shipped), and the request body
    # in the Check too (--with-request-body BYTES).
    envoy_tokens: bool = True
    with_request_body: int | None = None
    # Tokens each fake worker generates per completion (at most the request's max_tokens).
    completion_tokens: int = 5


class Stack:
    """One Envoy and one sidecar in front of a fleet of fake workers.

    With ``fleet`` given, the stack shares that (already started) fleet with others and
    neither starts nor stops it (see :class:`Replicas`); otherwise it owns one built from
    the config. The same for ``pool_fleets`` (the named pools' workers,
    ``config.pools``). ``engines`` (not started) puts real engines where the fake workers
    would be; the stack starts and stops them.
    """

    def __init__(self, config: StackConfig, workdir: Path | None = None,
                 fleet: Fleet | None = None, engines: Engines | None = None,
                 pool_fleets: dict[str, Fleet] | None = None) -> None:
        self.config = config
        self.workdir = workdir or Path(tempfile.mkdtemp(prefix="smg-stack-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.owns_fleet = fleet is None
        self.fleet: Fleet | Engines = engines or fleet or Fleet(
            config.workers, base_port=config.worker_base_port,
            max_running_requests=config.max_running_requests, service_time=config.service_time,
            tokens=config.completion_tokens)
        self.owns_pool_fleets = pool_fleets is None
        self.pool_fleets = pool_fleets if pool_fleets is not None else pool_fleets_of(config)
        self.sidecar: subprocess.Popen[bytes] | None = None
        self.envoy: subprocess.Popen[bytes] | None = None
        self.listen_port = config.listen_port or free_port()
        self.admin_port = config.admin_port or free_port()
        self.grpc_port = config.grpc_port or free_port()
        self.http_port = config.http_port or free_port()
        self.sidecar_log = self.workdir / "sidecar.log"
        self.envoy_log = self.workdir / "envoy.log"
        self.envoy_config = self.workdir / "envoy.yaml"
        self.priority_path = self.workdir / "priority.yaml"
        # sun_path holds 107 bytes: a short directory of its own, not the workdir.
        self.grpc_socket: Path | None = (
            Path(tempfile.mkdtemp(prefix="pg-")) / "grpc.sock" if config.grpc_unix else None)
        if config.mesh and config.edge_shed:
            raise ValueError("mesh=True renders what a mesh generates, without the edge "
                             "path: pass edge_shed=False")
        longest = parse_priority_config(config.priority_yaml).max_queue_timeout()
        self.authz_timeout = config.authz_timeout_secs or longest + 5.0

    # ----------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        if self.owns_fleet:
            await self.fleet.start()
        if self.owns_pool_fleets:
            for fleet in self.pool_fleets.values():
                await fleet.start()
        self.priority_path.write_text(self.config.priority_yaml)
        c = self.config
        # A port free_port() found can be taken before the child binds it (by an
        # ephemeral bind or connection in between). Retry with fresh ports, unless
        # the caller fixed them.
        for attempt in range(3):
            self.start_sidecar()
            try:
                await self.wait_sidecar_ready()
                break
            except RuntimeError:
                if attempt == 2 or c.grpc_port or c.http_port:
                    raise
                self.grpc_port, self.http_port = free_port(), free_port()
        for attempt in range(3):
            self.write_envoy_config()
            self.start_envoy()
            try:
                await self.wait_envoy_ready()
                break
            except RuntimeError:
                if attempt == 2 or c.listen_port or c.admin_port:
                    raise
                self.listen_port = free_port()
                if not c.capacity_from_envoy:  # the sidecar already polls this admin port
                    self.admin_port = free_port()

    async def stop(self) -> None:
        for proc in (self.envoy, self.sidecar):
            if proc is not None:
                terminate(proc)
        self.envoy = self.sidecar = None
        if self.owns_fleet:
            await self.fleet.stop()
        if self.owns_pool_fleets:
            for fleet in self.pool_fleets.values():
                await fleet.stop()
        if self.grpc_socket is not None:
            shutil.rmtree(self.grpc_socket.parent, ignore_errors=True)

    def sidecar_argv(self) -> list[str]:
        c = self.config
        argv = [
            sys.executable, "-m", "sidecar",
            "--priority-scheduler-enabled",
            "--priority-scheduler-config", str(self.priority_path),
            "--grpc-listen", (f"unix://{self.grpc_socket}" if self.grpc_socket is not None
                              else f"127.0.0.1:{self.grpc_port}"),
            "--http-listen", f"127.0.0.1:{self.http_port}",
            "--health-interval-secs", str(c.health_interval_secs),
            "--admission-lease-secs", str(c.lease_secs),
            "--envoy-authz-timeout", str(self.authz_timeout),
            "--log-format", "json", "--log-level", c.log_level,
        ]
        if c.capacity_from_envoy:
            argv += ["--envoy-admin-url", f"http://127.0.0.1:{self.admin_port}"]
        else:
            argv += ["--worker-urls", *self.fleet.urls]
        pooled = [f"{name}={url}" for name, f in self.pool_fleets.items() for url in f.urls]
        if pooled:
            argv += (["--worker-urls"] if c.capacity_from_envoy else []) + pooled
        return argv + (["--edge-shed"] if c.edge_shed else []) + list(c.sidecar_args)

    def start_sidecar(self) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.config.extra_env}
        with open(self.sidecar_log, "ab") as log:
            self.sidecar = subprocess.Popen(die_with_parent(self.sidecar_argv()), stdout=log,
                                            stderr=log, stdin=subprocess.DEVNULL, env=env,
                                            cwd=REPO, start_new_session=True)

    def kill_sidecar(self) -> None:
        if self.sidecar is not None:
            self.sidecar.kill()
            self.sidecar.wait(10)
            self.sidecar = None

    async def wait_sidecar_ready(self, timeout: float = READY_SECS) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.sidecar is not None and self.sidecar.poll() is not None:
                raise RuntimeError(f"sidecar exited: {self.sidecar_log.read_text()[-2000:]}")
            with contextlib.suppress(*HTTP_ERRORS):
                status, _ = await http_get(f"http://127.0.0.1:{self.http_port}/readyz", 0.5)
                if status == 200:
                    return
            await asyncio.sleep(0.05)
        raise TimeoutError(f"sidecar not ready: {self.sidecar_log.read_text()[-2000:]}")

    def write_envoy_config(self) -> None:
        c = self.config
        text = load_renderer().render(
            listen_port=self.listen_port, admin_port=self.admin_port,
            sidecar_host="127.0.0.1", sidecar_port=self.grpc_port,
            workers=self.fleet.addresses, authz_timeout_secs=self.authz_timeout,
            flush_interval_secs=c.flush_interval_secs,
            health_interval_secs=c.health_interval_secs, preemption=c.preemption,
            jwt_hs256_secret=c.jwt_secret, jwt_jwks=c.jwt_jwks, jwt_issuer=c.jwt_issuer,
            engine_key_file=c.engine_key_file,
            sidecar_pipe=str(self.grpc_socket) if self.grpc_socket is not None else None,
            edge_shed=c.edge_shed, tokens=c.envoy_tokens,
            with_request_body=c.with_request_body,
            pools=[(name, f"/{name}/", f.addresses) for name, f in self.pool_fleets.items()]
            + [(name, f"/{name}/", self.fleet.addresses) for name in c.envoy_extra_pools])
        if c.mesh:
            text = load_renderer("mesh").meshify(text)
        self.envoy_config.write_text(text)

    def start_envoy(self) -> None:
        argv = [envoy_binary(), "-c", str(self.envoy_config), "--concurrency",
                str(self.config.envoy_concurrency), "-l", "warning", "--disable-hot-restart"]
        with open(self.envoy_log, "ab") as log:
            # A session of its own: a shell's job control must not signal Envoy;
            # it dies with this process all the same (devtools.proc).
            self.envoy = subprocess.Popen(die_with_parent(argv), stdout=log, stderr=log,
                                          stdin=subprocess.DEVNULL, start_new_session=True)

    def kill(self) -> None:
        """The replica dies: SIGKILL to its Envoy and its sidecar, nothing said to anyone."""
        self.kill_envoy()
        self.kill_sidecar()

    def kill_envoy(self) -> None:
        if self.envoy is not None:
            self.envoy.send_signal(signal.SIGKILL)
            self.envoy.wait(10)
            self.envoy = None

    async def restart_envoy(self) -> None:
        """SIGKILL Envoy (if running) and start a new process on the same ports and config
        file (a container restart): the sidecar sees the same address, a new process."""
        self.kill_envoy()
        self.start_envoy()
        await self.wait_envoy_ready()

    async def wait_envoy_ready(self, timeout: float = READY_SECS) -> None:
        deadline = time.monotonic() + timeout
        admin = f"http://127.0.0.1:{self.admin_port}"
        while time.monotonic() < deadline:
            if self.envoy is not None and self.envoy.poll() is not None:
                raise RuntimeError(f"envoy exited: {self.envoy_log.read_text()[-3000:]}")
            with contextlib.suppress(*HTTP_ERRORS):
                status, body = await http_get(
                    f"{admin}/stats?filter=^cluster\\.workers\\.membership_healthy$", 0.5)
                healthy = body.decode().strip().rpartition(" ")[2]
                # /ready: LIVE, listeners open (with the edge path they open only after the
                # RTDS layer's first fetch, which can come after the workers' health).
                if status == 200 and healthy.isdigit() and int(healthy) == len(
                        [w for w in self.fleet.workers if w.healthy]) and (
                        await http_get(f"{admin}/ready", 0.5))[0] == 200:
                    return
            await asyncio.sleep(0.05)
        raise TimeoutError(f"envoy not ready: {self.envoy_log.read_text()[-3000:]}")

    # ------------------------------------------------------------------ queries

    async def metrics(self) -> dict[str, float]:
        """The sidecar's /metrics as ``{'name{label="v",...}': value}`` (labels sorted)."""
        status, body = await http_get(f"http://127.0.0.1:{self.http_port}/metrics", ANSWER_SECS)
        assert status == 200
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(body.decode()):
            for s in family.samples:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return out

    async def metric(self, name: str, **labels: str) -> float:
        key = name
        if labels:
            key += "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"
        return (await self.metrics()).get(key, 0.0)

    async def envoy_stat(self, name: str) -> int:
        _, body = await http_get(
            f"http://127.0.0.1:{self.admin_port}/stats?filter=^{name}$", ANSWER_SECS)
        value = body.decode().strip().rpartition(" ")[2]
        return int(value) if value.isdigit() else 0


def pool_fleets_of(config: StackConfig) -> dict[str, Fleet]:
    """The named pools' fake workers (``config.pools``), not started."""
    fleets = {}
    for name, (n, cap) in config.pools.items():
        knobs = dict(config.pool_worker_kwargs.get(name, {}))
        fleet = Fleet(n, max_running_requests=cap, service_time=config.service_time,
                      engine=knobs.pop("engine", "generic"))
        for worker in fleet.workers:  # the engine knobs are the workers' attributes
            for knob, value in knobs.items():
                if not hasattr(worker, knob):
                    raise ValueError(f"pool {name}: FakeWorker has no knob {knob!r}")
                setattr(worker, knob, value)
        fleets[name] = fleet
    return fleets


class Replicas:
    """Several full stacks (an Envoy and a sidecar each) in front of ONE fleet of fake
    workers, their sidecars coordinated through ONE valkey-server.

    The fleet's :class:`~devtools.fleet.Tally` is the ground truth: what the workers
    really ran at once, whichever replica admitted it. ``server`` can be paused
    (SIGSTOP), resumed, killed and started again (empty); each stack can be killed
    (``stacks[i].kill()``) and started again.
    """

    def __init__(self, config: StackConfig, n: int = 2, workdir: Path | None = None, *,
                 fleet_id: str = "e2e", ttl_secs: float = 2.0) -> None:
        self.workdir = workdir or Path(tempfile.mkdtemp(prefix="smg-replicas-"))
        self.fleet = Fleet(config.workers, base_port=config.worker_base_port,
                           max_running_requests=config.max_running_requests,
                           service_time=config.service_time, tokens=config.completion_tokens)
        # Each named pool's workers too: one set for all replicas, as in a real fleet.
        self.pool_fleets = pool_fleets_of(config)
        self.server = ValkeyServer(self.workdir / "valkey")
        self.fleet_id = fleet_id
        self.ttl_secs = ttl_secs
        self.stacks: list[Stack] = []
        for i in range(n):
            replica_id = chr(ord("a") + i)
            args = [*config.sidecar_args,
                    "--coordination-url", self.server.url, "--fleet-id", fleet_id,
                    "--replica-id", replica_id, "--replica-ttl-secs", str(ttl_secs)]
            self.stacks.append(Stack(replace(config, sidecar_args=args),
                                     self.workdir / replica_id, fleet=self.fleet,
                                     pool_fleets=self.pool_fleets))

    async def start(self) -> None:
        self.server.start()
        await self.fleet.start()
        for fleet in self.pool_fleets.values():
            await fleet.start()
        try:
            # One at a time: two Envoys and two Pythons starting at once on a small box
            # only make each other's readiness waits longer.
            for stack in self.stacks:
                await stack.start()
        except BaseException:
            await self.stop()
            raise

    async def stop(self) -> None:
        for stack in self.stacks:
            await stack.stop()
        await self.fleet.stop()
        for fleet in self.pool_fleets.values():
            await fleet.stop()
        self.server.stop()

    async def restart(self, stack: Stack) -> None:
        """Start a killed stack's sidecar and Envoy again (same ports, same replica id)."""
        stack.start_sidecar()
        await stack.wait_sidecar_ready()
        stack.start_envoy()
        await stack.wait_envoy_ready()


async def serve_until_stopped(stack: Stack, work: Coroutine[object, object, None],
                              name: str) -> int:
    """Run ``work`` (start-up, then serving) until it ends or SIGINT, SIGTERM or SIGHUP
    arrives, start-up included; stop ``stack`` either way. Returns 0, or 1 when start-up
    failed (said on stderr as ``NAME failed to start: ...``)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        loop.add_signal_handler(sig, stop.set)
    running = asyncio.ensure_future(work)
    stopping = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({running, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if running.done():
            running.result()  # raises what start-up raised
            return 0
        print_safely("stopping ...")
        return 0
    except (OSError, RuntimeError, TimeoutError) as exc:
        print(f"{name} failed to start: {exc}", file=sys.stderr)
        return 1
    finally:
        for task in (running, stopping):
            task.cancel()
        await asyncio.gather(running, stopping, return_exceptions=True)
        await stack.stop()


def terminate(proc: subprocess.Popen[bytes] | None) -> None:
    """SIGTERM, then SIGKILL after 5 s; a no-op for None or an exited process."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)
