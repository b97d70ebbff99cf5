"""Wiring: settings -> core -> controller -> gRPC + admin HTTP + capacity polling.

:class:`Sidecar` is the whole process as an object, so tests can run it in
their own event loop; :func:`run` is what the command line calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from sidecar import codec, logs
from sidecar.adminhttp import AdminServer
from sidecar.admission import AdmissionController
from sidecar.authz import AuthzService, TenantPolicy
from sidecar.capacity import CapacityReading, per_worker
from sidecar.completion import CompletionService, ResponsePathService
from sidecar.config import ConfigError, PriorityConfig, Settings
from sidecar.health import CapacityMonitor
from sidecar.metrics import Metrics
from sidecar.ratelimit import build_bucket
from sidecar.reload import ConfigWatcher
from sidecar.scheduler import (
    AdmissionCore,
    LegacyAdmission,
    Scheduler,
    desired_reservations,
    reservations_fit,
)

log = logs.get("sidecar")

AUTHZ_SERVICE = "envoy.service.auth.v3.Authorization"
ALS_SERVICE = "envoy.service.accesslog.v3.AccessLogService"
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"


def _split(listen: str) -> tuple[str, int]:
    host, _, port = listen.rpartition(":")
    return host.strip("[]"), int(port)


class Sidecar:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.metrics = Metrics(tenant_top_n=settings.tenant_metric_top_n)
        self.monitor = CapacityMonitor(
            worker_urls=settings.worker_urls,
            envoy_admin_url=settings.envoy_admin_url,
            envoy_cluster=settings.envoy_cluster,
            interval=settings.health_interval_secs,
            timeout=settings.health_timeout_secs,
            fallback=settings.fallback_capacity,
            override=settings.worker_capacity_override,
            on_change=self._on_capacity,
            engine=settings.worker_engine,
            default_cap=settings.worker_max_running_requests,
            saturation_guard=settings.saturation_guard,
        )
        self.core: AdmissionCore | None = None
        self.controller: AdmissionController | None = None
        self.grpc_port = 0
        self.http_port = 0
        self._grpc: grpc.aio.Server | None = None
        self._admin = AdminServer(self.metrics.registry, self.ready)
        self._tasks: list[asyncio.Task[None]] = []
        self._serving = False
        self.generation = 1
        self.watcher: ConfigWatcher | None = None

    def ready(self) -> bool:
        return self._serving

    async def _first_reading(self) -> CapacityReading:
        """Poll until real workers answer, for at most --startup-capacity-wait-secs.

        In a pod the sidecar starts before Envoy, so with --envoy-admin-url the
        first poll finds nothing; deciding the mode on the fallback capacity would
        check reservations against a guess.
        """
        s = self.settings
        reading = await self.monitor.poll_once()
        if not (s.worker_urls or s.envoy_admin_url):
            return reading  # nothing to wait for: fallback or override is the answer

        def settled(r: CapacityReading) -> bool:
            # Workers often come up one by one: with the scheduler on, keep waiting
            # while the reservations do not fit yet, since the mode is chosen once.
            return r.source != "fallback" and (
                not s.scheduler_enabled or reservations_fit(s.priority.classes, r.capacity))

        deadline = time.monotonic() + s.startup_capacity_wait_secs
        while not settled(reading) and time.monotonic() < deadline:
            await asyncio.sleep(min(s.health_interval_secs, 0.5))
            reading = await self.monitor.poll_once()
        if reading.source == "fallback" and s.startup_capacity_wait_secs > 0:
            log.warning("no_healthy_worker_at_startup", waited_secs=s.startup_capacity_wait_secs,
                        fallback_capacity=reading.capacity)
        return reading

    def _build_core(self, reading: CapacityReading) -> AdmissionCore:
        s = self.settings
        classes = s.priority.classes
        if s.scheduler_enabled:
            if reservations_fit(classes, reading.capacity):
                return Scheduler(classes, reading.capacity, time.monotonic,
                                 preemptible_on_admit=False)
            desired = desired_reservations(classes, reading.capacity)
            log.warning("reservations_exceed_capacity_using_legacy_admission",
                        capacity=reading.capacity, reserved_total=sum(desired.values()),
                        reserved={c.label: n for c, n in desired.items()})
        limit = s.max_concurrent_requests if s.max_concurrent_requests > 0 else None
        return LegacyAdmission(limit=limit, queue_size=s.queue_size,
                               queue_timeout_secs=s.queue_timeout_secs, clock=time.monotonic)

    def _on_capacity(self, reading: CapacityReading) -> None:
        self.metrics.set_capacity_source(reading.source)
        self.metrics.healthy_workers.set(reading.healthy)
        self.metrics.worker_capacity(per_worker(reading))
        if self.controller is not None:
            self.controller.set_capacity(reading.capacity)

    async def start(self) -> None:
        s = self.settings
        if not s.default_max_class_valid:
            log.warning("unknown_default_max_class_using_default",
                        value="--priority-scheduler-default-max-class")
        # /healthz answers from here on (the process is alive); /readyz only once
        # admission is serving.
        hhost, hport = _split(s.http_listen)
        self.http_port = await self._admin.start(hhost, hport)
        # The first capacity reading decides scheduler vs. legacy (the startup check).
        reading = await self._first_reading()
        self.core = self._build_core(reading)
        self.metrics.set_mode(self.core.legacy)
        self.controller = AdmissionController(
            self.core,
            lease_secs=s.admission_lease_secs,
            bucket=build_bucket(s.max_concurrent_requests, s.rate_limit_tokens_per_second,
                                time.monotonic),
            listeners=[self.metrics],
            stats=self.metrics,
        )
        core = self.core
        self.metrics.watch(core.snapshot)
        self.metrics.config_generation.set(1)
        self.metrics.config_info.labels(s.priority.digest).set(1)
        policy = TenantPolicy(s.priority.tenant_policies, s.default_max_class)
        self.authz = AuthzService(self.controller, self.metrics, s.tenant_source, policy)
        self.completion = CompletionService(self.controller)
        self.response_path = ResponsePathService(
            self.controller, on_delivery_failed=self.metrics.preemption_delivery_failed.inc)

        server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        p = codec.passthrough
        server.add_generic_rpc_handlers([
            grpc.method_handlers_generic_handler(AUTHZ_SERVICE, {
                "Check": grpc.unary_unary_rpc_method_handler(
                    self.authz.check, request_deserializer=p, response_serializer=p)}),
            grpc.method_handlers_generic_handler(ALS_SERVICE, {
                "StreamAccessLogs": grpc.stream_unary_rpc_method_handler(
                    self.completion.stream_access_logs, request_deserializer=p,
                    response_serializer=p)}),
            grpc.method_handlers_generic_handler(EXT_PROC_SERVICE, {
                "Process": grpc.stream_stream_rpc_method_handler(
                    self.response_path.process, request_deserializer=p,
                    response_serializer=p)}),
        ])
        health_servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        host, port = _split(s.grpc_listen)
        self.grpc_port = server.add_insecure_port(f"{host}:{port}")
        if self.grpc_port == 0:
            raise OSError(f"cannot bind --grpc-listen {s.grpc_listen}")
        await server.start()
        self._grpc = server
        for name in ("", AUTHZ_SERVICE, ALS_SERVICE, EXT_PROC_SERVICE):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
        self._tasks.append(asyncio.create_task(self.monitor.run()))
        if s.priority.source is not None:
            self.watcher = ConfigWatcher(s.priority.source, s.priority,
                                         interval=s.config_poll_secs,
                                         apply=self._apply_config, on_error=self._reload_failed,
                                         validate=self._validate_reload)
            self._tasks.append(asyncio.create_task(self.watcher.run()))
        self._serving = True
        log.info(
            "started",
            grpc=f"{host}:{self.grpc_port}", http=f"{hhost}:{self.http_port}",
            mode="legacy" if core.legacy else "scheduler",
            capacity=reading.capacity, capacity_source=reading.source,
            config=s.priority.source or "builtin", config_sha256=s.priority.digest,
            tenant_source=f"{s.tenant_source.kind}:{s.tenant_source.name}".rstrip(":"),
            lease_secs=s.admission_lease_secs,
        )
        if s.envoy_authz_timeout is None and s.scheduler_enabled:
            log.info("envoy_authz_timeout_reminder",
                     longest_queue_timeout_secs=s.priority.max_queue_timeout(),
                     hint="Envoy's ext_authz timeout must exceed it; pass "
                          "--envoy-authz-timeout to have start-up check it")

    def _apply_config(self, cfg: PriorityConfig) -> None:
        """A valid new config: new knobs and tenant ceilings for new decisions."""
        assert self.core is not None and self.controller is not None
        # Queued requests keep their place; in-flight ones are untouched;
        # reservations are recomputed at the live capacity.
        self.controller.update_config(cfg.classes)
        if self.core.legacy:
            log.warning("config_reload_legacy_mode",
                        hint="class knobs apply only to the scheduler; tenant ceilings apply")
        self.authz.policy = TenantPolicy(cfg.tenant_policies, self.settings.default_max_class)
        self.generation += 1
        self.metrics.config_generation.set(self.generation)
        self.metrics.config_info.clear()
        self.metrics.config_info.labels(cfg.digest).set(1)
        self.metrics.reload.labels("ok").inc()

    def _validate_reload(self, cfg: PriorityConfig) -> None:
        """The start-up rule holds on reload too: Envoy must outwait every queue."""
        limit = self.settings.envoy_authz_timeout
        if limit is not None and cfg.max_queue_timeout() >= limit:
            raise ConfigError(
                f"longest queue_timeout_secs {cfg.max_queue_timeout():g}s must stay below "
                f"--envoy-authz-timeout {limit:g}s", file=cfg.source)

    def _reload_failed(self, exc: ConfigError) -> None:
        self.metrics.reload.labels("error").inc()

    async def reload_now(self) -> bool:
        """Check the config file at once (what SIGHUP asks the watcher for)."""
        return await self.watcher.check(force=True) if self.watcher is not None else False

    def request_reload(self) -> None:
        """SIGHUP: wake the watcher for a forced check."""
        if self.watcher is not None:
            self.watcher.request_check()

    async def stop(self) -> None:
        self._serving = False
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        if self._grpc is not None:
            await self._grpc.stop(grace=1.0)
        await self._admin.stop()
        await self.monitor.close()
        if self.controller is not None:
            self.controller.close()
        log.info("stopped")


async def _serve(settings: Settings) -> int:
    app = Sidecar(settings)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    # Installed before start(): it may wait for capacity, and a SIGTERM or SIGHUP
    # then must not kill the process the default way.
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, app.request_reload)
    starting = asyncio.ensure_future(app.start())
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if starting.done() and starting.exception() is not None:
        stopping.cancel()
        exc = starting.exception()
        log.error("startup_failed", error=str(exc))
        await app.stop()
        return 1
    if not starting.done():  # asked to stop while still starting
        starting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await starting
    else:
        await stopping
    await app.stop()
    return 0


def run(settings: Settings) -> int:
    logs.configure(settings.log_format, settings.log_level)
    return asyncio.run(_serve(settings))
