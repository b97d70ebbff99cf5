"""Wiring: settings -> core -> controller -> gRPC + admin HTTP + capacity polling.

Build, then serve: :func:`build_runtime` returns a complete :class:`Runtime`
(every part built, nothing filled in later), :meth:`Runtime.serve` starts it.
Tests run it in their own event loop; :func:`run` is what the command line calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
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
from sidecar.config import ConfigError, PriorityConfig, Settings, check_authz_timeout, check_pools
from sidecar.coordination import server
from sidecar.coordination.controller import FleetController
from sidecar.coordination.credentials import with_password
from sidecar.edge import RTDS_SERVICE, EdgeShed
from sidecar.envoy_features import FeatureDetector
from sidecar.health import CapacityMonitor
from sidecar.liveness import AdminProcessStart, EnvoyLiveness, local_owners
from sidecar.metrics import Metrics
from sidecar.pools import DEFAULT_POOL, PooledAdmission, PoolRecorder, id_factory, pool_of
from sidecar.reload import ConfigWatcher
from sidecar.scheduler import (
    AdmissionCore,
    ClassSettings,
    LegacyAdmission,
    Scheduler,
    desired_reservations,
    reservations_fit,
)
from sidecar.shadow import ShadowCore, Verdict

log = logs.get("sidecar")

AUTHZ_SERVICE = "envoy.service.auth.v3.Authorization"
ALS_SERVICE = "envoy.service.accesslog.v3.AccessLogService"
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"

# Engines that cannot stop a request whose client went away while they are busy:
# llama.cpp's server notices a closed connection only after one second without a result
# of *any* task, which another stream, a /metrics or /slots request never lets pass. A
# preempted victim runs to its end there, so preempting frees no slot: the preemptor
# would wait in the engine's own queue while the engine runs one more than its capacity
# (docs/reference.md, Engines). While a worker counted runs one, no class preempts.
CANNOT_CANCEL_ENGINES = frozenset({"llamacpp"})


def uncancellable_workers(reading: CapacityReading) -> tuple[str, ...]:
    """The workers counted in ``reading`` whose engine cannot cancel a running request."""
    return tuple(sorted(w.url for w in reading.workers if w.engine in CANNOT_CANCEL_ENGINES))


def without_preemption(classes: Mapping[PriorityClass, ClassSettings]
                       ) -> dict[PriorityClass, ClassSettings]:
    return {c: dataclasses.replace(k, can_preempt=False) for c, k in classes.items()}


async def build_runtime(settings: Settings) -> Runtime:
    """Build the whole sidecar; nothing serves admission until :meth:`Runtime.serve`.

    The admin server starts first and answers ``/healthz`` (the process is
    alive) while the first capacity reading may take up to
    ``--startup-capacity-wait-secs``; ``/readyz`` stays 503 until ``serve()``.
    If the build fails or is cancelled, what it started is stopped again.
    """
    s = settings
    if not s.scheduler.default_max_class_valid:
        log.warning("unknown_default_max_class_using_default",
                    flag="--priority-scheduler-default-max-class")
    metrics = Metrics(tenant_top_n=s.scheduler.tenant_metric_top_n,
                      pools=bool(s.capacity.pool_workers))
    serving = asyncio.Event()
    admin = AdminServer(metrics.registry, serving.is_set, metrics)
    hhost, hport = listen.host_port(s.listen.http_listen)
    http_port = await admin.start(hhost, hport)
    # Until the runtime exists, readings only feed metrics; it takes them over.
    monitor = _monitor(s, s.capacity.worker_urls, s.capacity.envoy_admin_url, metrics.capacity_read,
                       DEFAULT_POOL if s.capacity.pool_workers else None)
    # Named pools probe their own --worker-urls POOL=URL entries (sidecar.pools); the
    # default pool is the monitor above. Their readings reach metrics via the runtime.
    pool_monitors = {name: _monitor(s, urls, None, lambda _r: None, name)
                     for name, urls in s.capacity.pool_workers.items()}
    fleets: dict[str, FleetController] = {}
    try:
        # The first capacity reading decides scheduler vs. legacy (the startup check),
        # per pool when there are pools.
        reading, *rest = await asyncio.gather(
            _first_reading(s, monitor),
            *(_first_reading(s, m, name) for name, m in pool_monitors.items()))
        pool_readings = dict(zip(pool_monitors, rest, strict=True))
        if s.fleet.coordination_url is not None:
            # The password joins the URL in memory only (never argv, never printed).
            url = (s.fleet.coordination_url if s.fleet.coordination_password is None else
                   with_password(s.fleet.coordination_url, s.fleet.coordination_password))
            await server.check_server_at(url, max(0.05, min(1.0, s.fleet.replica_ttl_secs / 5)),
                                         metrics)
            # Connect and register; an unreachable server starts the replica degraded.
            # With pools, one controller per pool, each over its pool's own ledger in the
            # fleet (its capacity its own workers'; docs/design.md, "Pools in a fleet").
            bucket = s.legacy.limits.bucket(time.monotonic)  # one rate check for all pools
            readings = {DEFAULT_POOL: reading, **pool_readings}
            names = list(readings) if pool_readings else [DEFAULT_POOL]
            connected = await asyncio.gather(*(FleetController.connect(
                url, fleet=s.fleet.fleet_id, replica=s.fleet.replica_id,
                ttl=s.fleet.replica_ttl_secs,
                classes=s.scheduler.priority.classes_for(name),
                capacity=readings[name].capacity,
                ack_timeout=s.liveness.admission_lease_secs,
                bucket=bucket,
                metrics=PoolRecorder(metrics, name) if pool_readings else metrics,
                pool=name if pool_readings else None,
                id_factory=id_factory(name)) for name in names), return_exceptions=True)
            fleets = {n: c for n, c in zip(names, connected, strict=True)
                      if isinstance(c, FleetController)}
            failed = [c for c in connected if isinstance(c, BaseException)]
            if failed:
                raise failed[0]
        return Runtime(s, metrics=metrics, admin=admin, http_port=http_port,
                       serving=serving, monitor=monitor, reading=reading,
                       fleet=fleets.get(DEFAULT_POOL),
                       pool_monitors=pool_monitors, pool_readings=pool_readings,
                       pool_fleets=fleets if pool_readings else None)
    except BaseException:
        for f in fleets.values():  # connected, or a Runtime that failed to build
            await f.aclose()
        await monitor.close()
        for m in pool_monitors.values():
            await m.close()
        await admin.stop()
        raise


def _monitor(s: Settings, worker_urls: tuple[str, ...], envoy_admin_url: str | None,
             on_change: Callable[[CapacityReading], None],
             pool: str | None = None) -> CapacityMonitor:
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
        pool=pool,
    )


async def _first_reading(s: Settings, monitor: CapacityMonitor,
                         pool: str = DEFAULT_POOL) -> CapacityReading:
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
                    fallback_capacity=reading.capacity,
                    **({"pool": pool} if s.capacity.pool_workers else {}))
    return reading


def _build_core(s: Settings, reading: CapacityReading,
                pool: str | None = None) -> AdmissionCore:
    priority = s.scheduler.priority
    classes = priority.classes if pool is None else priority.classes_for(pool)
    limit = s.legacy.limits.cap
    if s.scheduler.scheduler_enabled:
        if reservations_fit(classes, reading.capacity):
            return Scheduler(classes, reading.capacity, time.monotonic)
        # The contract's fallback, made impossible to miss: without a cap it admits
        # everything at once, whatever the workers can run.
        desired = desired_reservations(classes, reading.capacity)
        mode, reason = s.legacy.limits.mode, FALLBACK_REASON
        log.warning("reservations_exceed_capacity_using_legacy_admission",
                    mode=mode, reason=reason, capacity=reading.capacity,
                    capacity_source=reading.source, reserved_total=sum(desired.values()),
                    reserved={c.label: n for c, n in desired.items()},
                    concurrency_cap=limit, **({"pool": pool} if pool is not None else {}),
                    hint="for life of the process; lower the reservations (check with "
                         "--check-config FILE --check-capacity N) or restart once the "
                         "fleet is larger")
        if limit is None:
            log.error("legacy_admission_uncapped", mode=mode, reason=reason,
                      capacity=reading.capacity,
                      hint="--max-concurrent-requests is <= 0, so nothing limits "
                           "admission: every request goes to the workers at once")
    return LegacyAdmission(limit=limit, queue_size=s.legacy.queue_size,
                           queue_timeout_secs=s.legacy.queue_timeout_secs, clock=time.monotonic)


def _pool_verdict(shadows: Mapping[str, ShadowCore], aid: str) -> Verdict | None:
    shadow = shadows.get(pool_of(aid))
    return None if shadow is None else shadow.take_verdict(aid)


def _inflight(controller: AdmissionService) -> int:
    return controller.snapshot().inflight


FALLBACK_REASON = "reservations_exceed_capacity"  # the only way the scheduler falls back


class Runtime:
    """The whole sidecar, complete from construction; :func:`build_runtime` makes it.

    Everything is built here, synchronously, from the first capacity reading:
    core, controller, the three gRPC services, the gRPC server (port bound, not
    yet started) and the config watcher. :meth:`serve` starts serving,
    :meth:`stop` ends it.
    """

    def __init__(self, settings: Settings, *, metrics: Metrics, admin: AdminServer,
                 http_port: int, serving: asyncio.Event, monitor: CapacityMonitor,
                 reading: CapacityReading, fleet: FleetController | None = None,
                 pool_monitors: Mapping[str, CapacityMonitor] | None = None,
                 pool_readings: Mapping[str, CapacityReading] | None = None,
                 pool_fleets: Mapping[str, FleetController] | None = None) -> None:
        s = self.settings = settings
        self.metrics = metrics
        self.monitor = monitor
        self.reading = reading
        self.http_port = http_port
        self._admin = admin
        self._serving = serving  # the admin server's /readyz reads it
        self.generation = 1
        self._tasks: list[asyncio.Task[None]] = []
        self._grpc_started = False

        # With --coordination-url the fleet's ledger decides (no in-process core);
        # the reservation check does not apply: the ledger scales reservations to
        # the fleet's capacity.
        self.fleet = fleet
        # Every fleet controller: one per pool with pools (the default pool's is
        # self.fleet), else just self.fleet.
        self.fleets: dict[str, FleetController] = (
            dict(pool_fleets) if pool_fleets else
            {DEFAULT_POOL: fleet} if fleet is not None else {})
        for name, f in self.fleets.items():
            # Each pool's ledger sees its own workers (the fleet-id collision check).
            f.ledger.identity = server.capacity_source(
                reading if name == DEFAULT_POOL else (pool_readings or {})[name])
        self.core: AdmissionCore | None = None
        self.controller: AdmissionService
        # Pools (sidecar.pools): one monitor, core and controller each; the default
        # pool's monitor and core are also self.monitor and self.core.
        self.pools: PooledAdmission | None = None
        self._pool_monitors: dict[str, CapacityMonitor] = {}
        self._pool_readings: dict[str, CapacityReading] = {}
        self._pool_uncancellable: dict[str, tuple[str, ...]] = {}
        # --shadow with pools: each pool's shadow (self.core is the default pool's).
        self._shadows: dict[str, ShadowCore] = {}
        if fleet is not None and not pool_monitors:
            self.controller = fleet
        elif pool_monitors:
            self._pool_monitors = {DEFAULT_POOL: monitor, **pool_monitors}
            self._pool_readings = {DEFAULT_POOL: reading, **(pool_readings or {})}
            if fleet is not None:  # each pool's ledger decides
                self.pools = PooledAdmission(self.fleets, metrics)
            else:
                # One request-rate check for all pools (--shadow: taken in the shadows only).
                bucket = s.legacy.limits.bucket(time.monotonic)
                cores = {name: _build_core(s, r, name)
                         for name, r in self._pool_readings.items()}
                if s.scheduler.shadow:
                    # Each pool's shadow runs beside that pool's own core and capacity and
                    # records under the pool's label (docs/design.md, "Shadow mode").
                    self._shadows = {name: ShadowCore(core, time.monotonic,
                                                      PoolRecorder(metrics, name), bucket=bucket)
                                     for name, core in cores.items()}
                    cores = dict(self._shadows)
                    shadows = self._shadows
                    metrics.shadow_started(shadows[DEFAULT_POOL].shadow_snapshot, lambda: {
                        name: sc.shadow_snapshot() for name, sc in shadows.items()})
                    bucket = None
                controllers = {
                    name: AdmissionController(core,
                                              lease_secs=s.liveness.admission_lease_secs,
                                              bucket=bucket, metrics=PoolRecorder(metrics, name),
                                              id_factory=id_factory(name))
                    for name, core in cores.items()}
                self.pools = PooledAdmission(controllers, metrics)
                self.core = controllers[DEFAULT_POOL].core
            self.controller = self.pools
        else:
            self.core = _build_core(s, reading)
            bucket = s.legacy.limits.bucket(time.monotonic)
            if s.scheduler.shadow:  # the core built above only says what it would have done
                self.core = ShadowCore(self.core, time.monotonic, metrics, bucket=bucket)
                metrics.shadow_started(self.core.shadow_snapshot)
                bucket = None
            self.controller = AdmissionController(
                self.core,
                lease_secs=s.liveness.admission_lease_secs,
                bucket=bucket,
                metrics=metrics,
            )
        self.legacy = self.controller.legacy
        # The file's; preemption may be suspended below.
        self._classes = s.scheduler.priority.classes
        self._config = s.scheduler.priority
        self._uncancellable = uncancellable_workers(reading)
        if self.pools is not None:
            for name, r in self._pool_readings.items():
                self._pool_uncancellable[name] = uncancellable_workers(r)
                if self._pool_uncancellable[name]:
                    self._preemption_suspended(r, name)
                ctl = self.pools.controllers[name]
                if fleet is None:
                    ctl.update_config(self._pool_classes(name))
                    # The guard of each pool compares its engines with that pool's
                    # admissions (a fleet's ledger holds other replicas' too: not compared).
                    self._pool_monitors[name].policy.held = functools.partial(_inflight, ctl)
                elif self._pool_uncancellable[name]:  # it registered the file's table
                    ctl.update_config(self._pool_classes(name))
                self._pool_monitors[name].on_change = functools.partial(
                    self._on_pool_capacity, name)
            for name, r in self._pool_readings.items():
                metrics.pool_capacity_read(name, r)
            metrics.pools_started(self.pools.snapshots)
            metrics.preemption_suspended(any(self._pool_uncancellable.values()))
        else:
            if self._uncancellable:
                self._preemption_suspended(reading)
                self.controller.update_config(self._effective_classes())
            metrics.preemption_suspended(bool(self._uncancellable))
            if fleet is None:
                # The guard compares the engines' own counts with what this sidecar holds
                # (a fleet's ledger holds other replicas' admissions too: not compared).
                monitor.policy.held = lambda: self.controller.snapshot().inflight
            # From here on a new capacity reading also resizes admission.
            monitor.on_change = self._on_capacity
        metrics.started(legacy=self.legacy, snapshot=self.controller.snapshot,
                        config_digest=s.scheduler.priority.digest,
                        fallback=(s.legacy.limits.mode, FALLBACK_REASON)
                        if self.legacy and s.scheduler.scheduler_enabled else None)
        # Which Envoy asked for each admission and whether it is still there: slots of
        # requests Envoy still runs are never reclaimed by a timer alone.
        # With the local Envoy's admin known, a loopback owner's restart and a blip of its
        # connection are told apart by that process's start (GET /server_info).
        admin_url = s.capacity.envoy_admin_url
        self.liveness = EnvoyLiveness(
            self.controller, grace=s.liveness.envoy_owner_grace_secs, metrics=metrics,
            start_of=None if admin_url is None else AdminProcessStart(
                admin_url, lambda: self.monitor.session),
            identifiable=None if admin_url is None else local_owners(admin_url))
        for f in self.fleets.values():
            f.liveness_decides = True  # acknowledged only while its Envoy is watched
        self.authz = AuthzService(self.controller, metrics, s.scheduler.tenant_source,
                                  TenantPolicy(s.scheduler.priority.tenant_policies,
                                               s.scheduler.default_max_class),
                                  self._preemptible_now(),
                                  liveness=self.liveness)
        if self._shadows:  # the would-be answer of the pool the admission id names
            self.authz.shadow_verdict = functools.partial(_pool_verdict, self._shadows)
        elif isinstance(self.core, ShadowCore):
            self.authz.shadow_verdict = self.core.take_verdict
        self.authz.pools = self.pools
        self.features = FeatureDetector(metrics, lease_secs=s.liveness.admission_lease_secs,
                                        wall_clock=time.time)
        self.completion = CompletionService(self.controller, metrics, self.features,
                                            self.liveness)
        self.response_path = ResponsePathService(self.controller, metrics, self.features,
                                                 self.liveness)

        # --edge-shed: RTDS switches for Envoy's edge route, steered by the Checks' outcomes.
        # Legacy admission answers admission_queue_full, which the edge route does not
        # send: the switches then stay 0.
        # With pools, each pool's switches follow that pool's queue alone.
        self.edge = (EdgeShed(metrics, self.authz.rejection_counted,
                              self.pools.controllers if self.pools is not None
                              else (DEFAULT_POOL,))
                     if s.scheduler.edge_shed else None)
        if self.edge is not None:
            if self.legacy:
                log.warning("edge_shed_off_in_legacy_admission")
            else:
                self.authz.edge = self.edge.controller
                self.authz.edges = self.edge.controllers
        als = (self.completion.stream_access_logs if self.edge is None
               else self.edge.access_logs(self.completion.stream_access_logs))

        self._grpc = grpc.aio.server(options=list(authz.GRPC_SERVER_OPTIONS))
        # No (de)serialiser: grpc hands the handlers bytes and sends theirs as they are,
        # without a Python call per message each way (what bench.noop, the floor, does).
        p = None
        self._grpc.add_generic_rpc_handlers([
            grpc.method_handlers_generic_handler(AUTHZ_SERVICE, {
                "Check": grpc.unary_unary_rpc_method_handler(
                    self.authz.check, request_deserializer=p, response_serializer=p)}),
            grpc.method_handlers_generic_handler(ALS_SERVICE, {
                "StreamAccessLogs": grpc.stream_unary_rpc_method_handler(
                    als, request_deserializer=p, response_serializer=p)}),
            grpc.method_handlers_generic_handler(EXT_PROC_SERVICE, {
                "Process": grpc.stream_stream_rpc_method_handler(
                    self.response_path.process, request_deserializer=p,
                    response_serializer=p)}),
        ])
        if self.edge is not None:
            self._grpc.add_generic_rpc_handlers([
                grpc.method_handlers_generic_handler(RTDS_SERVICE, {
                    "StreamRuntime": grpc.stream_stream_rpc_method_handler(
                        self.edge.server.stream_runtime, request_deserializer=p,
                        response_serializer=p)})])
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

    async def serve(self) -> None:
        s = self.settings
        self._grpc_started = True
        await self._grpc.start()
        for name in ("", AUTHZ_SERVICE, ALS_SERVICE, EXT_PROC_SERVICE):
            await self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self._tasks.append(asyncio.create_task(self.monitor.run()))
        for name, m in self._pool_monitors.items():
            if name != DEFAULT_POOL:
                self._tasks.append(asyncio.create_task(m.run()))
        for name, f in self.fleets.items():
            f.start()
            # A library replaced after start-up is noticed within one --replica-ttl-secs
            # (each pool's ledger refuses it; the default pool's watch reports it).
            self._tasks.append(asyncio.create_task(server.watch_library(
                f.ledger, s.fleet.replica_ttl_secs,
                self.metrics if name == DEFAULT_POOL else None)))
            # So is a second deployment under this fleet id (within two), per pool.
            self._tasks.append(asyncio.create_task(server.watch_fleet(
                f.ledger, s.fleet.replica_ttl_secs,
                self.metrics if self.pools is None else PoolRecorder(self.metrics, name))))
        if self.watcher is not None:
            self._tasks.append(asyncio.create_task(self.watcher.run()))
        if self.edge is not None:
            self._tasks.append(asyncio.create_task(self.edge.run()))
        self._serving.set()
        log.info(
            "started",
            grpc=str(self.grpc_listen) if self.grpc_listen.path is not None
            else f"{self.grpc_listen.host}:{self.grpc_port}",
            http=f"{listen.host_port(s.listen.http_listen)[0]}:{self.http_port}",
            mode="legacy" if self.legacy else "scheduler",
            capacity=self.reading.capacity, capacity_source=self.reading.source,
            config=s.scheduler.priority.source or "builtin",
            config_sha256=s.scheduler.priority.digest,
            tenant_source=f"{s.scheduler.tenant_source.kind}:"
                          f"{s.scheduler.tenant_source.name}".rstrip(":"),
            lease_secs=s.liveness.admission_lease_secs,
            coordination="fleet" if self.fleet is not None else "in-process",
            shadow=s.scheduler.shadow,
            **({"pools": {n: r.capacity for n, r in self._pool_readings.items()}}
               if self.pools is not None else {}),
        )
        if s.liveness.envoy_authz_timeout is None and s.scheduler.scheduler_enabled:
            log.info("envoy_authz_timeout_reminder",
                     longest_queue_timeout_secs=s.scheduler.priority.max_queue_timeout(),
                     hint="Envoy's ext_authz timeout must exceed it; pass "
                          "--envoy-authz-timeout to have start-up check it")

    def _on_capacity(self, reading: CapacityReading) -> None:
        self.metrics.capacity_read(reading)
        if self.fleet is not None:  # published with the next heartbeat (watch_fleet)
            self.fleet.ledger.identity = server.capacity_source(reading)
        uncancellable = uncancellable_workers(reading)
        was, self._uncancellable = self._uncancellable, uncancellable
        if bool(uncancellable) != bool(was):
            if uncancellable:
                self._preemption_suspended(reading)
            else:
                log.info("preemption_resumed", reason="no counted worker runs an engine that "
                                                      "cannot cancel a running request")
            self._apply_classes()
            self.metrics.preemption_suspended(bool(uncancellable))
        self.controller.set_capacity(reading.capacity)

    def _on_pool_capacity(self, pool: str, reading: CapacityReading) -> None:
        """A pool's reading: resizes that pool only."""
        assert self.pools is not None
        self._pool_readings[pool] = reading
        self.metrics.pool_capacity_read(pool, reading)
        f = self.fleets.get(pool)
        if f is not None:  # published with the next heartbeat (watch_fleet)
            f.ledger.identity = server.capacity_source(reading)
        uncancellable = uncancellable_workers(reading)
        was = self._pool_uncancellable.get(pool, ())
        self._pool_uncancellable[pool] = uncancellable
        if bool(uncancellable) != bool(was):
            if uncancellable:
                self._preemption_suspended(reading, pool)
            else:
                log.info("preemption_resumed", pool=pool,
                         reason="no counted worker of the pool runs an engine that cannot "
                                "cancel a running request")
            self._apply_classes()
            self.metrics.preemption_suspended(any(self._pool_uncancellable.values()))
        self.pools.controllers[pool].set_capacity(reading.capacity)

    def _pool_classes(self, pool: str) -> Mapping[PriorityClass, ClassSettings]:
        """A pool's class table, with can_preempt off while its preemption is suspended."""
        classes = self._config.classes_for(pool)
        return without_preemption(classes) if self._pool_uncancellable.get(pool) else classes

    def _preemptible_now(self) -> frozenset[PriorityClass]:
        if self.pools is None:
            return self._preemptible(self._effective_classes())
        # One allow format for all pools: a class preemptible in any pool opens a stream.
        out: frozenset[PriorityClass] = frozenset()
        for name, ctl in self.pools.controllers.items():
            if not ctl.legacy:
                out |= authz.preemptible_classes(self._pool_classes(name))
        return out

    def _preemption_suspended(self, reading: CapacityReading, pool: str | None = None) -> None:
        log.warning("preemption_suspended", workers=list(uncancellable_workers(reading)),
                    **({"pool": pool} if pool is not None else {}),
                    engines=sorted({w.engine for w in reading.workers
                                    if w.engine in CANNOT_CANCEL_ENGINES}),
                    reason="the engine runs a preempted request to its end, so preempting "
                           "frees no slot; higher classes wait at the head of their queue "
                           "instead")

    def _effective_classes(self) -> Mapping[PriorityClass, ClassSettings]:
        """The file's class settings, with can_preempt off while preemption is suspended."""
        return without_preemption(self._classes) if self._uncancellable else self._classes

    def _apply_classes(self) -> None:
        if self.pools is not None:
            for name, ctl in self.pools.controllers.items():
                ctl.update_config(self._pool_classes(name))
            self.authz.preemptible = self._preemptible_now()
            return
        classes = self._effective_classes()
        self.controller.update_config(classes)
        self.authz.preemptible = self._preemptible(classes)

    def _apply_config(self, cfg: PriorityConfig) -> None:
        """A valid new config: new knobs and tenant ceilings for new decisions."""
        # Queued requests keep their place; in-flight ones are untouched;
        # reservations are recomputed at the live capacity.
        self._classes = cfg.classes
        self._config = cfg
        self._apply_classes()
        if self.legacy:
            log.warning("config_reload_legacy_mode",
                        hint="class knobs apply only to the scheduler; tenant ceilings apply")
        self.authz.policy = TenantPolicy(cfg.tenant_policies,
                                         self.settings.scheduler.default_max_class)
        self.generation += 1
        self.metrics.config_reloaded(self.generation, cfg.digest)

    def _preemptible(self, classes: Mapping[PriorityClass, ClassSettings]
                     ) -> frozenset[PriorityClass]:
        # Legacy admission never preempts: no request needs a stream.
        return frozenset() if self.legacy else authz.preemptible_classes(classes)

    def _validate_reload(self, cfg: PriorityConfig) -> None:
        """The start-up rule holds on reload too: Envoy must outwait every queue."""
        check_pools(cfg, self.settings.capacity.pool_workers)  # the pools are the workers'
        s = self.settings
        check_authz_timeout(s.liveness.envoy_authz_timeout, cfg, s.scheduler.scheduler_enabled,
                            file=cfg.source)

    def _reload_failed(self, exc: ConfigError) -> None:
        self.metrics.config_reload_failed()

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
        await self.monitor.close()
        for name, m in self._pool_monitors.items():
            if name != DEFAULT_POOL:
                await m.close()
        self.controller.close()
        for f in self.fleets.values():
            await f.aclose()
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
