"""Wiring: settings -> pools (capacity, admission) -> gRPC + admin HTTP.

Build, then serve: :func:`build_runtime` returns a complete :class:`Runtime`
(every part built, nothing filled in later), :meth:`Runtime.serve` starts it.
Tests run it in their own event loop; :func:`run` is what the command line calls.

Every request goes through one path: the pool its route names
(:mod:`sidecar.pools`). A sidecar without named pools has one, ``default``.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Callable, Mapping

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from sidecar import authz, listen, logs
from sidecar.adminhttp import AdminServer
from sidecar.admission import AdmissionController, AdmissionService
from sidecar.authz import AuthzService, TenantPolicy
from sidecar.capacity import CapacityReading
from sidecar.classes import PriorityClass
from sidecar.completion import CompletionService, ResponsePathService
from sidecar.config import (
    ConfigError,
    PriorityConfig,
    Settings,
    check_authz_timeout,
    check_kv_admission,
    check_pools,
)
from sidecar.coordination import server
from sidecar.coordination.controller import FleetController
from sidecar.coordination.credentials import with_password
from sidecar.edge import RTDS_SERVICE, EdgeShed
from sidecar.envoy_features import FeatureDetector
from sidecar.health import CapacityMonitor
from sidecar.limiter import AdaptiveLimit
from sidecar.liveness import AdminProcessStart, EnvoyLiveness, local_owners
from sidecar.metrics import Metrics, PoolRecorder
from sidecar.pools import DEFAULT_POOL, Pool, Pools, id_factory
from sidecar.ratelimit import TokenBucket
from sidecar.reload import ConfigWatcher
from sidecar.scheduler import (
    AdmissionCore,
    LegacyAdmission,
    Scheduler,
    desired_reservations,
    reservations_fit,
)
from sidecar.shadow import ShadowCore
from sidecar.status import StatusPage
from sidecar.tracing import Tracing

log = logs.get("sidecar")

AUTHZ_SERVICE = "envoy.service.auth.v3.Authorization"
ALS_SERVICE = "envoy.service.accesslog.v3.AccessLogService"
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
FALLBACK_REASON = "reservations_exceed_capacity"  # the only way the scheduler falls back


async def build_runtime(settings: Settings) -> Runtime:
    """Build the whole sidecar; nothing serves admission until :meth:`Runtime.serve`.

    The admin server starts first and answers ``/healthz`` (the process is
    alive) while the first capacity readings may take up to
    ``--startup-capacity-wait-secs``; ``/readyz`` stays 503 until ``serve()``.
    If the build fails or is cancelled, what it started is stopped again.
    """
    s = settings
    if not s.scheduler.default_max_class_valid:
        log.warning("unknown_default_max_class_using_default",
                    flag="--priority-scheduler-default-max-class")
    # No tenant above the default ceiling: whatever a request asks for, it is admitted at
    # most at that ceiling (a clamp, counted but silent); tell the operator at start-up.
    ceiling = s.scheduler.default_max_class
    if s.scheduler.scheduler_enabled and ceiling < PriorityClass.SYSTEM and all(
            c <= ceiling for c in s.scheduler.priority.tenant_policies.values()):
        log.warning("no_tenant_above_default_ceiling", default_max_class=ceiling.label,
                    tenant_source=f"{s.scheduler.tenant_source.kind}:"
                                  f"{s.scheduler.tenant_source.name}".rstrip(":"),
                    hint="every request is clamped to this class; give tenant_policies "
                         "a tenant above it and a --tenant-source Envoy sets")
    sources = s.capacity.pool_sources()
    # With named pools, every pool's series and log lines name it (sidecar.metrics).
    labelled = len(sources) > 1
    metrics = Metrics(tenant_top_n=s.scheduler.tenant_metric_top_n, pools=labelled)
    serving = asyncio.Event()
    admin = AdminServer(metrics.registry, serving.is_set, metrics)
    hhost, hport = listen.host_port(s.listen.http_listen)
    http_port = await admin.start(hhost, hport)
    # Until the runtime exists, a pool's readings only feed its metrics; its Pool takes
    # them over.
    monitors = {name: _monitor(s, urls, admin_url, metrics.pool(name).capacity_read,
                               _log_fields(name, labelled))
                for name, (urls, admin_url) in sources.items()}
    fleets: dict[str, FleetController] = {}
    try:
        # The first capacity reading decides scheduler vs. legacy (the start-up check),
        # for each pool.
        readings = dict(zip(monitors, await asyncio.gather(
            *(_first_reading(s, m, name, _log_fields(name, labelled))
              for name, m in monitors.items())), strict=True))
        bucket = s.legacy.limits.bucket(time.monotonic)  # one rate check for all pools
        if s.fleet.coordination_url is not None:
            # The password joins the URL in memory only (never argv, never printed).
            url = (s.fleet.coordination_url if s.fleet.coordination_password is None else
                   with_password(s.fleet.coordination_url, s.fleet.coordination_password))
            await server.check_server_at(url, max(0.05, min(1.0, s.fleet.replica_ttl_secs / 5)),
                                         metrics)
            # Connect and register; an unreachable server starts the replica degraded.
            # One controller per pool, each over its pool's own ledger in the fleet (its
            # capacity its own workers'; docs/design.md, "Pools in a fleet").
            connected = await asyncio.gather(*(FleetController.connect(
                url, fleet=s.fleet.fleet_id, replica=s.fleet.replica_id,
                ttl=s.fleet.replica_ttl_secs,
                classes=s.scheduler.priority.classes_for(name),
                capacity=readings[name].capacity,
                ack_timeout=s.liveness.admission_lease_secs,
                bucket=bucket,
                metrics=metrics.pool(name),
                pool=name if labelled else None,
                id_factory=id_factory(name)) for name in monitors), return_exceptions=True)
            fleets = {n: c for n, c in zip(monitors, connected, strict=True)
                      if isinstance(c, FleetController)}
            failed = [c for c in connected if isinstance(c, BaseException)]
            if failed:
                raise failed[0]
        return Runtime(s, metrics=metrics, admin=admin, http_port=http_port,
                       serving=serving, monitors=monitors, readings=readings, fleets=fleets,
                       bucket=bucket,
                       tracing=Tracing.build(s.tracing, instance=s.fleet.replica_id))
    except BaseException:
        for f in fleets.values():  # connected, or a Runtime that failed to build
            await f.aclose()
        for m in monitors.values():
            await m.close()
        await admin.stop()
        raise


def _log_fields(name: str, labelled: bool) -> dict[str, str]:
    """What names a pool in a log line: nothing where the default pool is the only one."""
    return {"pool": name} if labelled else {}


def _monitor(s: Settings, worker_urls: tuple[str, ...], envoy_admin_url: str | None,
             on_change: Callable[[CapacityReading], None],
             log_fields: Mapping[str, str]) -> CapacityMonitor:
    return CapacityMonitor(
        worker_urls=worker_urls,
        envoy_admin_url=envoy_admin_url,
        envoy_cluster=s.capacity.envoy_cluster,
        interval=s.capacity.health_interval_secs,
        timeout=s.capacity.health_timeout_secs,
        fallback=s.legacy.limits.fallback_capacity,
        override=s.capacity.worker_capacity_override,
        on_change=on_change,
        engine=s.capacity.worker_engine,
        default_cap=s.capacity.worker_max_running_requests,
        saturation_guard=s.capacity.saturation_guard,
        credential=s.capacity.worker_credential,
        credential_over_http=s.capacity.worker_auth_allow_http,
        envoy_cluster_scheme=s.capacity.envoy_cluster_scheme,
        pool=log_fields.get("pool"),
    )


async def _first_reading(s: Settings, monitor: CapacityMonitor, pool: str,
                         log_fields: Mapping[str, str]) -> CapacityReading:
    """Poll until real workers answer, for at most --startup-capacity-wait-secs.

    In a pod the sidecar starts before Envoy, so with --envoy-admin-url the
    first poll finds nothing; deciding the mode on the fallback capacity would
    check reservations against a guess.
    """
    reading = await monitor.poll_once()
    if not (monitor.worker_urls or monitor.envoy_admin_url):
        return reading  # nothing to wait for: fallback or override is the answer
    classes = s.scheduler.priority.classes_for(pool)

    def settled(r: CapacityReading) -> bool:
        # Workers often come up one by one: with the scheduler on, keep waiting
        # while the reservations do not fit yet, since the mode is chosen once.
        return r.source != "fallback" and (
            not s.scheduler.scheduler_enabled or reservations_fit(classes, r.capacity))

    deadline = time.monotonic() + s.capacity.startup_capacity_wait_secs
    while not settled(reading) and time.monotonic() < deadline:
        await asyncio.sleep(min(s.capacity.health_interval_secs, 0.5))
        reading = await monitor.poll_once()
    if reading.source == "fallback" and s.capacity.startup_capacity_wait_secs > 0:
        log.warning("no_healthy_worker_at_startup",
                    waited_secs=s.capacity.startup_capacity_wait_secs,
                    fallback_capacity=reading.capacity, **log_fields)
    return reading


class UncappedFallbackRefused(RuntimeError):
    """--refuse-uncapped-fallback: a pool would serve with legacy admission and no cap."""


def _build_core(s: Settings, pool: str, reading: CapacityReading,
                log_fields: Mapping[str, str]) -> AdmissionCore:
    """A pool's in-process core: the scheduler where its reservations fit its capacity,
    else the contract's legacy fallback, made impossible to miss."""
    classes = s.scheduler.priority.classes_for(pool)
    limit = s.legacy.limits.cap
    if s.scheduler.scheduler_enabled:
        if reservations_fit(classes, reading.capacity):
            return Scheduler(classes, reading.capacity, time.monotonic)
        desired = desired_reservations(classes, reading.capacity)
        mode = s.legacy.limits.mode
        log.warning("reservations_exceed_capacity_using_legacy_admission",
                    mode=mode, reason=FALLBACK_REASON, capacity=reading.capacity,
                    capacity_source=reading.source, reserved_total=sum(desired.values()),
                    reserved={c.label: n for c, n in desired.items()},
                    concurrency_cap=limit, **log_fields,
                    hint="for life of the process; lower the reservations (check with "
                         "--check-config FILE --check-capacity N) or restart once the "
                         "fleet is larger")
        if limit is None:
            if s.scheduler.refuse_uncapped_fallback:
                raise UncappedFallbackRefused(
                    f"pool {pool!r}: its reservations ({sum(desired.values())} slots) exceed "
                    f"its capacity of {reading.capacity} and --max-concurrent-requests <= 0 "
                    "leaves legacy admission without a cap; --refuse-uncapped-fallback refuses "
                    "to serve it so")
            # Without a cap it admits everything at once, whatever the workers can run.
            log.error("legacy_admission_uncapped", mode=mode, reason=FALLBACK_REASON,
                      capacity=reading.capacity, **log_fields,
                      hint="--max-concurrent-requests is <= 0, so nothing limits "
                           "admission: every request goes to the workers at once")
    return LegacyAdmission(limit=limit, queue_size=s.legacy.queue_size,
                           queue_timeout_secs=s.legacy.queue_timeout_secs, clock=time.monotonic,
                           measured=reading.capacity)


class Runtime:
    """The whole sidecar, complete from construction; :func:`build_runtime` makes it.

    Everything is built here, synchronously, from each pool's first capacity reading:
    the pools (sidecar.pools), the three gRPC services, the gRPC server (port bound, not
    yet started) and the config watcher. :meth:`serve` starts serving, :meth:`stop`
    ends it.
    """

    def __init__(self, settings: Settings, *, metrics: Metrics, admin: AdminServer,
                 http_port: int, serving: asyncio.Event,
                 monitors: Mapping[str, CapacityMonitor],
                 readings: Mapping[str, CapacityReading],
                 fleets: Mapping[str, FleetController],
                 bucket: TokenBucket | None = None, tracing: Tracing | None = None) -> None:
        s = self.settings = settings
        # --otlp-endpoint: admission spans (sidecar.tracing); flushed, bounded, in stop().
        self.tracing = tracing
        self.metrics = metrics
        self.http_port = http_port
        self._admin = admin
        self._serving = serving  # the admin server's /readyz reads it
        self.generation = 1
        self._tasks: list[asyncio.Task[None]] = []
        self._grpc_started = False
        self._config = s.scheduler.priority
        labelled = len(monitors) > 1
        self.pools = Pools({name: self._build_pool(
            name, monitor=monitors[name], reading=readings[name], fleet=fleets.get(name),
            metrics=metrics.pool(name), labelled=labelled, bucket=bucket)
            for name in monitors}, metrics)
        metrics.started(config_digest=s.scheduler.priority.digest)

        # Which Envoy asked for each admission and whether it is still there: slots of
        # requests Envoy still runs are never reclaimed by a timer alone.
        # With the local Envoy's admin known, a loopback owner's restart and a blip of its
        # connection are told apart by that process's start (GET /server_info).
        admin_url = s.capacity.envoy_admin_url
        default_monitor = self.pools[DEFAULT_POOL].monitor  # the pool Envoy's cluster feeds
        self.liveness = EnvoyLiveness(
            self.pools, grace=s.liveness.envoy_owner_grace_secs, metrics=metrics,
            start_of=None if admin_url is None else AdminProcessStart(
                admin_url, lambda: default_monitor.session),
            identifiable=None if admin_url is None else local_owners(admin_url))
        for p in self.pools:
            if p.fleet is not None:
                p.fleet.liveness_decides = True  # acknowledged only while its Envoy is watched
        self.authz = AuthzService(self.pools, metrics, s.scheduler.tenant_source,
                                  TenantPolicy(s.scheduler.priority.tenant_policies,
                                               s.scheduler.default_max_class),
                                  self.pools.preemptible(), liveness=self.liveness,
                                  shadow=s.scheduler.shadow, busy_status=s.scheduler.busy_status,
                                  hints=s.scheduler.overload_hints,
                                  tracer=None if tracing is None else tracing.tracer)
        self.features = FeatureDetector(metrics, lease_secs=s.liveness.admission_lease_secs,
                                        wall_clock=time.time)
        self.completion = CompletionService(self.pools, metrics, self.features, self.liveness)
        self.response_path = ResponsePathService(self.pools, metrics, self.features,
                                                 self.liveness)

        # --edge-shed: RTDS switches for Envoy's edge routes, one set per pool, each
        # steered by its pool's Checks. Legacy admission answers admission_queue_full,
        # which the edge route does not send: a legacy pool's switches stay 0.
        self.edge = (EdgeShed({p.name: p.metrics for p in self.pools},
                              self.authz.rejection_counted)
                     if s.scheduler.edge_shed else None)
        if self.edge is not None:
            for p in self.pools:
                if p.legacy:
                    p.log.warning("edge_shed_off_in_legacy_admission")
                else:
                    p.edge = self.edge.controllers[p.name]
        als = (self.completion.stream_access_logs if self.edge is None
               else self.edge.access_logs(self.completion.stream_access_logs))

        self._grpc = grpc.aio.server(options=list(authz.GRPC_SERVER_OPTIONS))
        # No (de)serialiser: grpc hands the handlers bytes and sends theirs as they are,
        # without a Python call per message each way (what bench.noop, the floor, does).
        p_ = None
        self._grpc.add_generic_rpc_handlers([
            grpc.method_handlers_generic_handler(AUTHZ_SERVICE, {
                "Check": grpc.unary_unary_rpc_method_handler(
                    self.authz.handler, request_deserializer=p_, response_serializer=p_)}),
            grpc.method_handlers_generic_handler(ALS_SERVICE, {
                "StreamAccessLogs": grpc.stream_unary_rpc_method_handler(
                    als, request_deserializer=p_, response_serializer=p_)}),
            grpc.method_handlers_generic_handler(EXT_PROC_SERVICE, {
                "Process": grpc.stream_stream_rpc_method_handler(
                    self.response_path.process, request_deserializer=p_,
                    response_serializer=p_)}),
        ])
        if self.edge is not None:
            self._grpc.add_generic_rpc_handlers([
                grpc.method_handlers_generic_handler(RTDS_SERVICE, {
                    "StreamRuntime": grpc.stream_stream_rpc_method_handler(
                        self.edge.server.stream_runtime, request_deserializer=p_,
                        response_serializer=p_)})])
        self._health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._grpc)
        self.grpc_listen = listen.parse(s.listen.grpc_listen)
        self.grpc_port = listen.bind(self._grpc, self.grpc_listen, s.listen.grpc_socket_mode)

        # None: no config file, so nothing to watch.
        self.watcher = None if s.scheduler.priority.source is None else ConfigWatcher(
            s.scheduler.priority.source, s.scheduler.priority,
            interval=s.scheduler.config_poll_secs,
            apply=self._apply_config, on_error=self._reload_failed,
            validate=self._validate_reload)
        self.status = StatusPage(self)  # /status, /status.json on the admin port
        admin.serve_status(self.status)

    def _build_pool(self, name: str, *, monitor: CapacityMonitor, reading: CapacityReading,
                    fleet: FleetController | None, metrics: PoolRecorder, labelled: bool,
                    bucket: TokenBucket | None) -> Pool:
        """One pool's admission: its fleet controller (the ledger decides; the start-up
        reservation check does not apply, the ledger scales reservations to the fleet's
        capacity), or an in-process controller over its own core (--shadow: the core only
        says what it would have done, and takes the request-rate check)."""
        s = self.settings
        shadow: ShadowCore | None = None
        controller: AdmissionService
        if fleet is not None:
            controller = fleet
        else:
            core = _build_core(s, name, reading, _log_fields(name, labelled))
            if s.scheduler.shadow:
                shadow = core = ShadowCore(
                    core, time.monotonic, metrics, bucket=bucket,
                    summary=logs.ShadowSummary(log.bind(**_log_fields(name, labelled))))
                bucket = None
            controller = AdmissionController(core, lease_secs=s.liveness.admission_lease_secs,
                                             bucket=bucket, metrics=metrics,
                                             id_factory=id_factory(name))
        legacy = controller.legacy
        metrics.admission_started(
            legacy=legacy, snapshot=controller.snapshot,
            fallback=(s.legacy.limits.mode, FALLBACK_REASON)
            if legacy and s.scheduler.scheduler_enabled else None)
        if shadow is not None:
            metrics.shadow_started(shadow.shadow_snapshot)
        c = s.capacity
        limiter = None if not c.adaptive_capacity else AdaptiveLimit(
            start=c.adaptive_capacity_start or reading.capacity,
            floor=c.adaptive_capacity_floor, ceiling=reading.capacity)
        return Pool(name, controller=controller, monitor=monitor, reading=reading,
                    config=s.scheduler.priority, metrics=metrics, labelled=labelled,
                    fleet=fleet, shadow=shadow, on_classes_changed=self._classes_changed,
                    limiter=limiter)

    async def serve(self) -> None:
        s = self.settings
        self._grpc_started = True
        await self._grpc.start()
        for name in ("", AUTHZ_SERVICE, ALS_SERVICE, EXT_PROC_SERVICE):
            await self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        ttl = s.fleet.replica_ttl_secs
        for p in self.pools:
            self._tasks.append(asyncio.create_task(p.monitor.run()))
            if p.limiter is not None:
                self._tasks.append(asyncio.create_task(p.tune()))
            if p.fleet is not None:
                p.fleet.start()
                # A library replaced after start-up is noticed within one
                # --replica-ttl-secs (each pool's ledger refuses it), and so is a second
                # deployment under this fleet id (within two).
                self._tasks.append(asyncio.create_task(
                    server.watch_library(p.fleet.ledger, ttl, self.metrics)))
                self._tasks.append(asyncio.create_task(
                    server.watch_fleet(p.fleet.ledger, ttl, p.metrics)))
        if self.watcher is not None:
            self._tasks.append(asyncio.create_task(self.watcher.run()))
        if self.edge is not None:
            self._tasks.append(asyncio.create_task(self.edge.run()))
        self._tasks.append(asyncio.create_task(self.status.run()))  # its rates' samples
        self._serving.set()
        default = self.pools[DEFAULT_POOL]
        log.info(
            "started",
            grpc=str(self.grpc_listen) if self.grpc_listen.path is not None
            else f"{self.grpc_listen.host}:{self.grpc_port}",
            http=f"{listen.host_port(s.listen.http_listen)[0]}:{self.http_port}",
            mode="legacy" if default.legacy else "scheduler",
            capacity=default.reading.capacity, capacity_source=default.reading.source,
            pools={p.name: {"mode": "legacy" if p.legacy else "scheduler",
                            "capacity": p.reading.capacity} for p in self.pools},
            config=s.scheduler.priority.source or "builtin",
            config_sha256=s.scheduler.priority.digest,
            tenant_source=f"{s.scheduler.tenant_source.kind}:"
                          f"{s.scheduler.tenant_source.name}".rstrip(":"),
            lease_secs=s.liveness.admission_lease_secs,
            coordination="fleet" if s.fleet.coordination_url is not None else "in-process",
            shadow=s.scheduler.shadow,
            traces=None if self.tracing is None else {
                "endpoint": self.tracing.endpoint, "sample_ratio": self.tracing.ratio},
        )
        if s.liveness.envoy_authz_timeout is None and s.scheduler.scheduler_enabled:
            log.info("envoy_authz_timeout_reminder",
                     longest_queue_timeout_secs=s.scheduler.priority.max_queue_timeout(),
                     hint="Envoy's ext_authz timeout must exceed it; pass "
                          "--envoy-authz-timeout to have start-up check it")

    def _classes_changed(self) -> None:
        """A pool's class table changed (preemption suspended or resumed): one allow format
        for all pools, so the preemptible classes are recomputed over all of them."""
        self.authz.preemptible = self.pools.preemptible()

    def _apply_config(self, cfg: PriorityConfig) -> None:
        """A valid new config: new knobs and tenant ceilings for new decisions."""
        self._config = cfg
        for p in self.pools:
            p.apply_config(cfg)
        self.authz.preemptible = self.pools.preemptible()
        self.authz.policy = TenantPolicy(cfg.tenant_policies,
                                         self.settings.scheduler.default_max_class)
        self.generation += 1
        self.metrics.config_reloaded(self.generation, cfg.digest)
        self.status.reloaded(cfg)

    def _validate_reload(self, cfg: PriorityConfig) -> None:
        """The start-up rules hold on reload too: the pools are the workers', Envoy
        must outwait every queue, and a reload must not make the next restart uncapped."""
        check_pools(cfg, self.settings.capacity.pool_workers)
        s = self.settings
        check_kv_admission(cfg, fleet=s.fleet.coordination_url is not None)
        check_authz_timeout(s.liveness.envoy_authz_timeout, cfg, s.scheduler.scheduler_enabled,
                            file=cfg.source)
        self._check_restart_fits(cfg)

    def _check_restart_fits(self, cfg: PriorityConfig) -> None:
        """A reload whose reservations do not fit a pool's capacity now, where the file in
        force fits it, would leave the next restart on legacy admission for that pool (the
        start-up check; in-process pools only, a fleet's ledger scales its reservations).
        Uncapped (--max-concurrent-requests <= 0): refused, the file in force stays. Capped:
        applied, with a warning (the restart would serve without priorities, capped)."""
        s = self.settings
        if not s.scheduler.scheduler_enabled:
            return
        limit = s.legacy.limits.cap
        for p in self.pools:
            if p.fleet is not None:
                continue
            capacity = p.reading.capacity
            new = cfg.classes_for(p.name)
            if reservations_fit(new, capacity) or not reservations_fit(
                    self._config.classes_for(p.name), capacity):
                continue  # fits, or the file in force does not fit either: not this reload
            reserved = sum(desired_reservations(new, capacity).values())
            if limit is None:
                raise ConfigError(
                    f"its reservations ({reserved} slots) exceed pool {p.name!r}'s capacity of "
                    f"{capacity}: the next restart would serve that pool with legacy admission "
                    "and no cap (--max-concurrent-requests <= 0); lower the reservations "
                    "(--check-config FILE --check-capacity N) or give the pool more capacity",
                    file=cfg.source, key=f"pools.{p.name}.classes" if p.name in cfg.pools
                    else "classes")
            p.log.warning("config_reload_reservations_exceed_capacity", capacity=capacity,
                          reserved_total=reserved, concurrency_cap=limit,
                          hint="applied; the next restart would serve this pool with legacy "
                               "admission capped at --max-concurrent-requests, without "
                               "priorities, until the reservations fit")

    def _reload_failed(self, exc: ConfigError) -> None:
        self.metrics.config_reload_failed()
        self.status.reload_failed(exc)

    async def reload_now(self) -> bool:
        """Check the config file at once (what SIGHUP asks the watcher for)."""
        return await self.watcher.check(force=True) if self.watcher is not None else False

    def request_reload(self) -> None:
        """SIGHUP: wake the watcher for a forced check."""
        if self.watcher is not None:
            self.watcher.request_check()

    async def stop(self) -> None:
        """Stop serving and release everything (also after a failed or skipped serve())."""
        self._serving.clear()
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        if not self._grpc_started:
            # grpc.aio frees a bound port only when a started server stops: start it
            # only to stop it at once.
            await self._grpc.start()
        self.liveness.close()  # streams the stop closes are not Envoys dying
        await self._grpc.stop(grace=1.0)
        await self._admin.stop()
        for p in self.pools:
            await p.monitor.close()
            p.controller.close()
            if p.fleet is not None:
                await p.fleet.aclose()
        if self.tracing is not None:
            await self.tracing.close()  # the last decisions' spans, for a bounded time
        log.info("stopped")


async def _serve(settings: Settings) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    # Installed before the build: it may wait for capacity, and a SIGTERM or SIGHUP
    # then must not kill the process the default way (nothing to reload yet).
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, lambda: None)
    building = asyncio.ensure_future(build_runtime(settings))
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait({building, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if not building.done():  # asked to stop while still building
        building.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await building  # build_runtime stops what it started
        return 0
    if building.exception() is not None:
        stopping.cancel()
        log.error("startup_failed", error=str(building.exception()))
        return 1
    runtime = building.result()
    try:
        await runtime.serve()
    except Exception as exc:
        stopping.cancel()
        log.error("startup_failed", error=str(exc))
        await runtime.stop()
        return 1
    loop.add_signal_handler(signal.SIGHUP, runtime.request_reload)
    await stopping
    await runtime.stop()
    return 0


def run(settings: Settings) -> int:
    logs.configure(settings.logging.log_format, settings.logging.log_level)
    return asyncio.run(_serve(settings))
