"""Configuration: every command-line flag, declared once, and the settings they make.

Flag names and defaults are public interface (docs/reference.md); they match
``smg`` exactly. A flag is a field of its settings group (see :mod:`sidecar.flags`);
every error names the flag and the reason, and is raised before anything listens.
The ``priority.yaml`` loader is :mod:`sidecar.priority_yaml` (re-exported here).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
import socket
import stat
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, ClassVar

from sidecar import flags, listen
from sidecar.classes import PriorityClass, parse_default_max_class
from sidecar.coordination.credentials import (
    PASSWORD_ENV,
    read_password,
    redact_url,
    url_has_password,
)
from sidecar.flags import Check, FlagGroup, derived, flag

# "X as X": the loader's names stay importable from here, where callers find them.
from sidecar.priority_yaml import MAX_CONFIG_BYTES as MAX_CONFIG_BYTES
from sidecar.priority_yaml import MAX_DEPTH as MAX_DEPTH
from sidecar.priority_yaml import MAX_NODES as MAX_NODES
from sidecar.priority_yaml import MAX_NUMBER_CHARS as MAX_NUMBER_CHARS
from sidecar.priority_yaml import POOL_NAME as POOL_NAME
from sidecar.priority_yaml import POOL_NAME_RULE as POOL_NAME_RULE
from sidecar.priority_yaml import QUOTE_CHARS as QUOTE_CHARS
from sidecar.priority_yaml import ConfigError as ConfigError
from sidecar.priority_yaml import PriorityConfig as PriorityConfig
from sidecar.priority_yaml import check_kv_admission as check_kv_admission
from sidecar.priority_yaml import clip as clip
from sidecar.priority_yaml import format_class_table as format_class_table
from sidecar.priority_yaml import key_segment as key_segment
from sidecar.priority_yaml import load_priority_config as load_priority_config
from sidecar.priority_yaml import parse_priority_config as parse_priority_config
from sidecar.priority_yaml import parse_priority_file as parse_priority_file
from sidecar.priority_yaml import quote as quote
from sidecar.priority_yaml import read_config_file as read_config_file
from sidecar.priority_yaml import smallest_fitting_capacity as smallest_fitting_capacity
from sidecar.ratelimit import TokenBucket
from sidecar.scheduler import BUILTIN_CLASSES as BUILTIN_CLASSES
from sidecar.scheduler.reservations import desired_reservations

# The pool of a route that names none, and of --worker-urls entries without POOL=.
DEFAULT_POOL = "default"


# --------------------------------------------------------------------------- CLI


@dataclass(frozen=True, slots=True)
class TenantSource:
    """Where the tenant key comes from: a trusted header, the mTLS principal, or a JWT claim."""

    kind: str  # "header" | "principal" | "jwt"
    name: str = ""  # header name, or "payload_key.claim" for jwt

    @classmethod
    def parse(cls, text: str) -> TenantSource:
        kind, _, arg = text.partition(":")
        kind = kind.strip().lower()
        arg = arg.strip()
        if kind == "header" and arg:
            return cls("header", arg.lower())
        if kind == "principal" and not arg:
            return cls("principal")
        if kind == "jwt" and arg.count(".") >= 1 and all(arg.split(".")):
            return cls("jwt", arg)
        raise ConfigError(
            f"invalid --tenant-source {text!r} "
            "(expected header:NAME, principal, or jwt:PAYLOAD_KEY.CLAIM)"
        )


@dataclass(frozen=True, slots=True)
class LegacyLimits:
    """Every meaning ``--max-concurrent-requests`` (with ``--rate-limit-tokens-per-second``)
    has, in one place: the legacy cap, the scheduler's fallback capacity, the legacy mode's
    name and the request-rate bucket."""

    max_concurrent_requests: int
    rate_limit_tokens_per_second: float | None = None

    @property
    def cap(self) -> int | None:
        """The legacy concurrency cap; None (``<= 0``): uncapped."""
        m = self.max_concurrent_requests
        return m if m > 0 else None

    @property
    def fallback_capacity(self) -> int:
        """Capacity while no healthy worker is known (scheduler mode).

        Read as a 16-bit count, as smg does: 0..65535 as given (0: no capacity until a
        worker is healthy); -1 (unset) or any value a 16-bit count cannot hold means 1024.
        """
        m = self.max_concurrent_requests
        return m if 0 <= m <= 65535 else 1024

    @property
    def mode(self) -> str:
        """The legacy admission's name in logs and metrics."""
        return "legacy" if self.cap is not None else "legacy_uncapped"

    def bucket(self, clock: Callable[[], float]) -> TokenBucket | None:
        """The request-rate check: only with a rate > 0 and a cap (its capacity)."""
        rate = self.rate_limit_tokens_per_second
        if rate is None or rate <= 0 or self.cap is None:
            return None
        return TokenBucket(self.cap, rate, clock)

    def cap_words(self) -> str:
        """What legacy admission would cap at, for ``--check-capacity``."""
        if self.cap is not None:
            return f"capped at --max-concurrent-requests {self.cap}"
        return "UNCAPPED (--max-concurrent-requests <= 0): every request admitted at once"


# --------------------------------------------------------------- flag checks
# Each returns what the settings hold; the messages are the start-up errors.


def _at_least(low: int) -> Check:
    def check(name: str, value: int | None) -> int | None:
        if value is not None and value < low:
            raise ConfigError(f"{name} must be >= {low}")
        return value
    return check


def _ttl(name: str, value: float) -> float:
    value = _finite_above_zero(name, value)
    if value > MAX_REPLICA_TTL_SECS:
        raise ConfigError(f"{name} must be at most {MAX_REPLICA_TTL_SECS:g}")
    return value


MAX_REPLICA_TTL_SECS = 86_400.0  # the ledger refuses a longer registration


def _busy_status(name: str, value: int | None) -> int | None:
    if value is not None and value not in BUSY_STATUSES:
        raise ConfigError(f"{name} must be one of {', '.join(map(str, BUSY_STATUSES))}")
    return value


BUSY_STATUSES = (429, 503, 529)


def _finite_above_zero(name: str, value: float) -> float:
    # Finite as well: an infinite interval or timeout cannot be scheduled.
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(f"{name} must be a finite number > 0")
    return float(value)


def _finite_at_least_zero(name: str, value: float) -> float:
    if not (math.isfinite(value) and value >= 0):
        raise ConfigError(f"{name} must be a finite number >= 0")
    return float(value)


def _finite(name: str, value: float | None) -> float | None:
    if value is not None and not math.isfinite(value):
        raise ConfigError(f"{name} must be finite")
    return value


def _grpc_listen(name: str, value: str) -> str:
    try:
        listen.parse(value)
    except ValueError as exc:
        raise ConfigError(f"{name}: {exc}") from None
    return value


def _http_listen(name: str, value: str) -> str:
    try:
        listen.host_port(value)
    except ValueError:
        raise ConfigError(f"{name} must be HOST:PORT, got {value!r}") from None
    return value


def _socket_mode(name: str, value: str) -> int:
    try:
        return listen.parse_mode(value)
    except ValueError as exc:
        raise ConfigError(f"{name}: {exc}") from None


def _priority_config(name: str, value: str | None) -> PriorityConfig:
    return load_priority_config(value)


def _tenant_source(name: str, value: str) -> TenantSource:
    return TenantSource.parse(value)


def _coordination_url(name: str, value: str | None) -> str | None:
    if value is not None:
        check_coordination_url(value)
    return value


_FLEET_NAME = re.compile(r"[^\s{}]{1,128}\Z")


def _fleet_name(name: str, value: str) -> str:
    if not _FLEET_NAME.match(value):
        raise ConfigError(f"{name} must be 1..128 characters without spaces or braces, "
                          f"got {clip(value)!r}")
    return value


def _replica_id(name: str, value: str | None) -> str:
    return _fleet_name(name, default_replica_id() if value is None else value)


def _otlp_endpoint(name: str, value: str | None) -> str | None:
    if value is None:
        return None
    try:
        parts = urllib.parse.urlsplit(value)
        port = parts.port
    except ValueError as exc:  # a port that is not a number
        raise ConfigError(f"{name}: {exc}") from None
    if parts.username is not None or parts.password is not None:
        # Never quoted: it may hold a token. argv is public.
        raise ConfigError(f"{name}: a user or password in the URL is visible to every process "
                          "on the host; put a token in --otlp-headers-file")
    if parts.scheme.lower() not in ("http", "https") or not parts.hostname or port is None:
        raise ConfigError(f"{name} must be http://HOST:PORT or https://HOST:PORT, got "
                          f"{clip(value)!r}")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ConfigError(f"{name}: OTLP/gRPC has no path or query, got {clip(value)!r}")
    if not 1 <= port <= 65535:
        raise ConfigError(f"{name}: port must be 1..65535")
    _check_otlp_protos(name)
    return value


def _check_otlp_protos(name: str) -> None:
    """The OTLP exporter needs opentelemetry-proto's generated modules. xds-protos ships
    OTLP 0.9's under the same paths (``opentelemetry/proto/``): whichever of the two was
    installed last owns the files, and 0.9's break the exporter. Said here, before anything
    listens, with the command that repairs it (the Makefile and the Dockerfile run it)."""
    from importlib import metadata

    try:
        from opentelemetry.proto.common.v1 import common_pb2
    except ImportError as exc:
        raise ConfigError(f"{name}: the OTLP protobuf modules cannot be imported ({exc}); "
                          "install opentelemetry-proto") from None
    if not hasattr(common_pb2, "InstrumentationScope"):
        try:
            pin = f"=={metadata.version('opentelemetry-proto')}"
        except metadata.PackageNotFoundError:
            pin = ""
        raise ConfigError(f"{name}: opentelemetry/proto/ holds OTLP 0.9's modules (xds-protos, "
                          "installed after opentelemetry-proto, replaced its files); put "
                          "them back: pip install --force-reinstall --no-deps "
                          f"opentelemetry-proto{pin}")


def _sample_ratio(name: str, value: float) -> float:
    if not (math.isfinite(value) and 0.0 <= value <= 1.0):
        raise ConfigError(f"{name} must be a number from 0 to 1")
    return float(value)


# --------------------------------------------------------------- the flags
# Every flag is declared here, once, as a field of its settings group (sidecar.flags):
# the parser, --help's sections, Settings and docs/reference.md's flag tables come
# from these fields. Fields declared with derived() come from several flags.


@dataclass(frozen=True, slots=True)
class SchedulerSettings:
    TITLE: ClassVar[str] = "scheduler (the priority-scheduler flags are smg's)"

    scheduler_enabled: bool = flag(
        "--priority-scheduler-enabled", default=False, switch=True,
        help="master switch; off = legacy concurrency-limit admission",
        doc=("Master switch. Off: the legacy concurrency-limit admission serves every "
             "request (classes are still parsed, clamped and counted)."))
    default_max_class: PriorityClass = flag(  # noqa: RUF009 (flag() is a field spec)
        "--priority-scheduler-default-max-class", default="default", metavar="CLASS",
        help="ceiling for tenants not in tenant_policies (unknown value -> default)",
        doc=("Ceiling for tenants not listed in `tenant_policies`. Trimmed and "
             "case-insensitive; an unknown value means `default` and logs "
             "`unknown_default_max_class_using_default` at start-up."))
    priority: PriorityConfig = flag(  # noqa: RUF009 (flag() is a field spec)
        "--priority-scheduler-config", default=None, metavar="FILE", check=_priority_config,
        help="per-class tuning and tenant policies (YAML); unset = built-in defaults",
        doc=("The `priority.yaml` below. Unset: built-in class defaults and no tenant "
             "policies. A path that cannot be read is a start-up error (see [design: Decisions "
             "where SMG's scheduler is "
             "silent](design.md#decisions-where-smgs-scheduler-is-silent))."))
    tenant_metric_top_n: int = flag(
        "--priority-scheduler-tenant-metric-top-n", default=32, type=int, metavar="N",
        check=_at_least(0),
        help='at most N tenant label values in metrics, the rest as tenant="other"',
        doc=("At most N distinct `tenant` label values in metrics; every further tenant is "
             'reported as `tenant="other"`. Must be ≥ 0 (0 = every tenant is `other`).'))
    tenant_source: TenantSource = flag(  # noqa: RUF009 (flag() is a field spec)
        "--tenant-source", default="header:x-smg-tenant", metavar="SOURCE", check=_tenant_source,
        help=("trusted tenant identity: header:NAME (a header Envoy strips from clients "
              "and sets itself), principal (mTLS peer), or jwt:PAYLOAD_KEY.CLAIM (jwt_authn "
              "metadata)"),
        doc=("Where the tenant key comes from: `header:NAME`, `principal` or "
             "`jwt:PAYLOAD_KEY.CLAIM` ([Where the tenant key comes "
             "from](#where-the-tenant-key-comes-from))."))
    config_poll_secs: float = flag(
        "--config-poll-secs", default=1.0, type=float, metavar="SECS", check=_finite_above_zero,
        help=("how often to check --priority-scheduler-config for changes (SIGHUP checks "
              "at once)"),
        doc=("How often `--priority-scheduler-config` is checked for changes; a change "
             "applies once two polls in a row read the same file ([Reloading](#reloading)). "
             "`SIGHUP` checks at once. Finite, > 0."))
    edge_shed: bool = flag(
        "--edge-shed", default=False, switch=True,
        help=("serve RTDS switches so Envoy (envoy/render.py --edge-shed) answers the "
              "overflow of a full bulk queue with the 429 itself, without a Check; off again "
              "about 2 s after the sidecar goes silent"),
        doc=("Serve the edge-shed switches (RTDS, "
             "`envoy.service.runtime.v3.RuntimeDiscoveryService`) on the gRPC port, so that an "
             "Envoy whose bootstrap has the edge route (`envoy/render.py --edge-shed`) answers "
             "the overflow of a full `bulk` queue with the contract's 429 itself, without a "
             "Check ([Edge shedding](#edge-shedding---edge-shed)). A switch is back to off "
             "within 2.25 s (TTL 2 s + one refresh interval) of the sidecar going silent. With "
             "pools (`--worker-urls POOL=URL`) each pool's route has switches of its own, "
             "steered by that pool's queue alone (`envoy/render.py --edge-shed --pool ...`). No "
             "effect in legacy admission."))
    shadow: bool = flag(
        "--shadow", default=False, switch=True,
        help=("shadow mode: admit every request at once (no queue, no 429/503, no "
              "preemption) and record what admission would have answered, in "
              "smg_sidecar_shadow_admit_total and the allow's metadata (shadow_outcome, "
              "shadow_code); docs/operations.md"),
        doc=("Shadow mode, for rolling the scheduler out: every request is admitted at once "
             "(no queue, no 429/503, no preemption, not even the overload shed) and the "
             "admission configured by the other flags and `priority.yaml` is run beside it to "
             "record what it would have answered: "
             "`smg_sidecar_shadow_admit_total{class,outcome}`, and `shadow_outcome` / "
             "`shadow_code` in the allow's metadata ([Allow](#allow)). How the would-be "
             "decisions are computed and where they differ from enforcement: [design: Decisions "
             "where SMG's scheduler is "
             "silent](design.md#decisions-where-smgs-scheduler-is-silent). With pools "
             "(`--worker-urls POOL=URL`) each pool's admission has its own shadow on that "
             "pool's capacity, its decisions under the `pool` label, and a route naming an "
             "unknown pool is allowed too. Refused with `--coordination-url` or "
             "`--edge-shed`."))
    overload_hints: bool = flag(
        "--overload-hints", default=False, switch=True,
        help=("computed Retry-After on refusals (the class queue's predicted drain time, "
              "1..60 s, jittered) and an x-smg-queue-wait-ms header on allows and refusals"),
        doc=("Overload answers that calm retries (an extension; off, the contract's fixed "
             "values): a refusal's `Retry-After` is the predicted time for its class queue to "
             "drain what it holds, bounded to 1..60 s and jittered ±20 % (the contract's value "
             "while there is no estimate yet), and `x-smg-queue-wait-ms` tells the client the "
             "wait: predicted on a refusal, measured on an allow "
             "([Deadlines](#deadlines-ttft-targets-and-overload-answers))."))
    busy_status: int | None = flag(
        "--busy-status", default=None, type=int, metavar="CODE", check=_busy_status,
        shown_default="the contract's",
        help=("status for refusals that mean busy (queue full or timed out, rate limit, "
              "overload, over target): 429, 503 or 529; Envoy's own 503 then means down"),
        doc=("The HTTP status of every refusal that means the pool is busy: a full or "
             "timed-out queue, the request-rate check, the overload shed, an unknown pool, a "
             "wait over target (the `X-SMG-Error-Code` stays the contract's). 429, 503 or 529 "
             "(Dynamo's \"busy\"). Unset: the contract's statuses (429 full, 503 timed out). "
             "Set, a 503 is left to mean down: the sidecar or the workers unreachable (Envoy's "
             "own), or a preemption ([Deadlines](#deadlines-ttft-targets-and-overload-answers))."))
    refuse_uncapped_fallback: bool = flag(
        "--refuse-uncapped-fallback", default=False, switch=True,
        help=("start-up fails (exit 1) instead of serving a pool whose reservations do not "
              "fit its capacity with legacy admission and no cap (--max-concurrent-requests "
              "<= 0)"),
        doc=("Opt-in refusal of the contract's uncapped fallback: when a pool's reservations "
             "do not fit its capacity at start-up ([the start-up reservation "
             "check](#the-start-up-reservation-check-and-the-legacy-fallback)) and "
             "`--max-concurrent-requests` ≤ 0 leaves legacy admission without a cap, start-up "
             "fails (`startup_failed`, exit 1) instead of serving that pool uncapped. Off (the "
             "contract's default): it serves, loudly (`legacy_admission_uncapped`, "
             "`smg_sidecar_admission_fallback{mode=\"legacy_uncapped\"}`)."))
    default_max_class_valid: bool = derived()
    """False: --priority-scheduler-default-max-class named no class (default is used)."""


@dataclass(frozen=True, slots=True)
class LegacySettings:
    TITLE: ClassVar[str] = "legacy admission (same flags as smg)"

    max_concurrent_requests: int = flag(
        "--max-concurrent-requests", default=-1, type=int, metavar="N",
        help=("legacy: concurrency cap (<=0: none). Scheduler on: capacity while no "
              "healthy worker is known (0..65535 as given; -1 or above 65535 -> 1024); 0 also "
              "removes the token bucket"),
        doc=("Scheduler off: the legacy concurrency cap; ≤ 0 means no cap. Scheduler on: "
             "only the capacity used while no healthy worker is known, read as a 16-bit count: "
             "0..65535 is used as given (0 = no capacity until a worker is healthy), -1 or "
             "anything above 65535 means 1024; once a capacity was read from workers, never "
             "more than that ([Capacity](#capacity)). On both paths, a value ≤ 0 also removes "
             "the request-rate token bucket."))
    queue_size: int = flag(
        "--queue-size", default=100, type=int, metavar="N", check=_at_least(0),
        help="legacy queue depth (unused by the scheduler)",
        doc=("Legacy path: depth of its single FIFO queue (0 = never queue). Unused by the "
             "scheduler, whose queues are per class. Must be ≥ 0."))
    queue_timeout_secs: float = flag(
        "--queue-timeout-secs", default=60, type=float, metavar="SECS", check=_finite_above_zero,
        help="legacy queue timeout (unused by the scheduler)",
        doc=("Legacy path: longest queued wait. Unused by the scheduler. Must be finite and "
             "> 0."))
    rate_limit_tokens_per_second: float | None = flag(
        "--rate-limit-tokens-per-second", default=None, type=float, metavar="RATE", check=_finite,
        help=("token bucket refill rate (capacity = --max-concurrent-requests), checked "
              "before admission"),
        doc=("If > 0 and `--max-concurrent-requests` > 0: a token bucket (capacity = "
             "`--max-concurrent-requests`, refill = RATE per second, starts full) checked "
             "before admission on either path. A request that finds no token is shed with 429 "
             "`scheduler_queue_full`. Must be finite."))
    prefill_max_inflight_requests_per_worker: int | None = flag(
        "--prefill-max-inflight-requests-per-worker", default=None, type=int, metavar="N",
        help="PD prefill admission; refused with the scheduler",
        doc=("SMG's prefill/decode admission. Combining it with "
             "`--priority-scheduler-enabled` is refused at start-up; otherwise it is accepted "
             "and has no effect (the sidecar has no prefill admission)."))

    @property
    def limits(self) -> LegacyLimits:
        return LegacyLimits(self.max_concurrent_requests, self.rate_limit_tokens_per_second)


@dataclass(frozen=True, slots=True)
class ListenSettings:
    TITLE: ClassVar[str] = "listen: the gRPC port for Envoy and the admin HTTP port"

    grpc_listen: str = flag(
        "--grpc-listen", default="127.0.0.1:9001", metavar="HOST:PORT", check=_grpc_listen,
        help=("ext_authz Check, access-log completion and ext_proc gRPC server; HOST:PORT "
              "or unix:///absolute/path (a Unix socket)"),
        doc=("gRPC server for Envoy: ext_authz `Check`, the access-log service and "
             "ext_proc, plus the standard gRPC health service. Keep it on loopback, or give "
             "`unix:///absolute/path` to serve on a Unix socket instead (Envoy: a `pipe` "
             "address; `envoy/render.py --sidecar unix:///PATH`). See [who can call the gRPC "
             "port](#who-can-call-the-grpc-port)."))
    grpc_socket_mode: int = flag(
        "--grpc-socket-mode", default="0660", metavar="OCTAL", check=_socket_mode,
        help="permissions of the --grpc-listen Unix socket",
        doc=("Permissions of the `--grpc-listen` Unix socket, set as it is created (never "
             "wider for a moment). A stale socket at the path (a killed sidecar's) is replaced; "
             "any other file there is refused (start-up exits 1). The socket is removed on stop."))
    http_listen: str = flag(
        "--http-listen", default="127.0.0.1:9090", metavar="HOST:PORT", check=_http_listen,
        help="/metrics, /healthz, /readyz",
        doc=("Admin HTTP: `/metrics`, `/healthz`, `/readyz`. In Kubernetes use "
             "`0.0.0.0:9090` so kubelet probes and Prometheus reach it."))


@dataclass(frozen=True, slots=True)
class CapacitySettings:
    TITLE: ClassVar[str] = "capacity: the workers and how their capacity is read"

    worker_urls: tuple[str, ...] = flag(
        "--worker-urls", default=[], metavar="[POOL=]URL", repeat=True, shown_default="none",
        help=("workers to poll for health and max_running_requests; POOL=URL puts a worker "
              "in a named pool (capacity and queues of its own, chosen by the route's smg-pool "
              "context extension)"),
        doc=("Workers to probe for health and capacity (`http://` or `https://`). An entry "
             "`POOL=URL` puts the worker in the named pool instead of the default one "
             "([Pools](design.md#pools-the-unit-of-admission)); `default=URL` is "
             "the same as a bare URL."))
    worker_capacity_override: int | None = flag(
        "--worker-capacity-override", default=None, type=int, metavar="N", check=_at_least(1),
        help="fixed capacity; ignores worker health",
        doc=("Fixed capacity of N slots (≥ 1); worker health is not polled at all. Used "
             "e.g. to give each of several gateway replicas its share."))
    envoy_admin_url: str | None = flag(
        "--envoy-admin-url", default=None, metavar="URL",
        help="take the worker set from Envoy admin /clusters (routable hosts only)",
        doc=("Take the worker set from Envoy's admin API (`/clusters?format=json`): only "
             "the hosts Envoy would route to (health checks and outlier ejection included), so "
             "admission and routing agree. Each such host is then probed like a `--worker-urls` "
             "entry. Second use: that Envoy's process start (`/server_info`, 1 s timeout) tells "
             "a restart of the pod's own Envoy (loopback, `unix` or this URL's host as peer) "
             "from a blip of its access-log connection ([Leases and Envoy "
             "liveness](design.md#leases-and-envoy-liveness))."))
    envoy_cluster: str = flag(
        "--envoy-cluster", default="workers", metavar="NAME",
        help="Envoy cluster holding the workers (with --envoy-admin-url)",
        doc="The Envoy cluster holding the workers (with `--envoy-admin-url`).")
    envoy_cluster_scheme: str = flag(
        "--envoy-cluster-scheme", default="http", choices=("http", "https"),
        help=("how the hosts found through --envoy-admin-url are probed: http, or https "
              "for workers that serve TLS"),
        doc=("How the hosts found through `--envoy-admin-url` are probed: `http://` or "
             "`https://ADDRESS:PORT` (workers that serve TLS; their certificate is checked "
             "against the system's CAs, or `$SSL_CERT_FILE`, for the address Envoy lists). "
             "With `--worker-auth-file`, `http` needs `--worker-auth-allow-http`."))
    health_interval_secs: float = flag(
        "--health-interval-secs", default=1.0, type=float, metavar="SECS", check=_finite_above_zero,
        help="worker health poll interval",
        doc="How often capacity is re-read. Finite, > 0.")
    health_timeout_secs: float = flag(
        "--health-timeout-secs", default=0.5, type=float, metavar="SECS", check=_finite_above_zero,
        help="per-probe timeout",
        doc=("Timeout of each probe. Finite, > 0. An older SGLang's `/health` runs a "
             "one-token generation (≥ 1 s): raise it above that for such workers."))
    worker_engine: str = flag(
        "--worker-engine", default="auto",
        choices=("auto", "sglang", "vllm", "tgi", "llamacpp", "generic"),
        help=("how to read each worker's capacity (every worker); auto recognises the "
              "engine from what it serves"),
        doc=("How each worker's capacity is read ([Engines: where each worker's capacity "
             "comes from](#engines-where-each-workers-capacity-comes-from)); applies to every "
             "worker, `--envoy-admin-url` hosts included. `auto` recognises each worker's "
             "engine from what it serves."))
    worker_max_running_requests: int = flag(
        "--worker-max-running-requests", default=64, type=int, metavar="N", check=_at_least(1),
        help=("capacity of a healthy worker whose engine exposes no cap (vLLM outside dev "
              "mode: set it to --max-num-seqs)"),
        doc=("Capacity of a healthy worker whose engine reports no cap (vLLM outside dev "
             "mode: set it to the workers' `--max-num-seqs`). A worker whose capacity endpoint "
             "refused the probe or failed, never read, counts for 1 instead ([Engines: where "
             "each worker's capacity comes "
             "from](#engines-where-each-workers-capacity-comes-from)). ≥ 1."))
    saturation_guard: bool = flag(
        "--saturation-guard", default=False, switch=True,
        help=("a worker reporting waiting requests counts for min(cap, running) until its "
              "queue is empty, so the backlog waits in the class queues"),
        doc=("A healthy worker that reports waiting requests counts for min(its cap, the "
             "requests it is running) (llama.cpp, which queues only when every slot is busy: "
             "running − waiting, at least 1), then grows back to its cap gradually once nothing "
             "waits, so the backlog waits in the sidecar's class queues (where priority "
             "applies) rather than in the engine's FIFO queue ([the saturation "
             "guard](#engines-where-each-workers-capacity-comes-from)). One extra request per "
             "worker per interval (per loaded model of a llama.cpp router); a refused one (401, "
             "or 501 without `--metrics`) only every 30 s."))
    adaptive_capacity: bool = flag(
        "--adaptive-capacity", default=False, switch=True,
        help=("tune each pool's capacity from the engines' time to first byte, between "
              "--adaptive-capacity-floor and what the workers report"),
        doc=("Each pool's capacity tunes itself: a limit between `--adaptive-capacity-floor` "
             "and the capacity its workers report (their cap, or "
             "`--worker-max-running-requests` per worker for an engine that reports none), "
             "lowered when the engines' time to first byte jumps (requests queue inside the "
             "engine) and raised by one while it is all used and the engines keep up "
             "([Capacity that tunes itself](#capacity-that-tunes-itself---adaptive-capacity)). "
             "With `--coordination-url` the pool reports the limit to the ledger, so the "
             "fleet's capacity is the smallest limit its replicas found."))
    adaptive_capacity_start: int | None = flag(
        "--adaptive-capacity-start", default=None, type=int, metavar="N", check=_at_least(1),
        shown_default="the workers' capacity",
        help="the limit --adaptive-capacity starts from (default: what the workers report)",
        doc=("The limit `--adaptive-capacity` starts from. Unset: the capacity the workers "
             "report. ≥ 1."))
    adaptive_capacity_floor: int = flag(
        "--adaptive-capacity-floor", default=1, type=int, metavar="N", check=_at_least(1),
        help="the lowest limit --adaptive-capacity goes to",
        doc="The lowest limit `--adaptive-capacity` goes to. ≥ 1.")
    worker_auth_file: str | None = flag(
        "--worker-auth-file", default=None, metavar="FILE",
        help=("file holding the workers' API key, sent with every probe as 'Authorization: "
              "Bearer KEY' (never put the key itself in argv)"),
        doc=("The workers' API key (llama-server/vLLM/SGLang `--api-key`): FILE holds it on "
             "one line (a final line break is dropped; ≤ 8 KiB, ASCII, no control characters). "
             "Sent with every probe to the workers as `Authorization: Bearer KEY`, over "
             "`https://` only (plain `http://` needs `--worker-auth-allow-http`), never to "
             "Envoy's admin API; with it, probes follow no redirect. Never give the key in argv "
             "(every process on the host can read argv); no log line shows it or any 8 "
             "characters of it, even where a worker echoes it back into a value the sidecar "
             "quotes, and errors about the file never quote it. Unset: probes carry no "
             "credential, and an engine that "
             "answers 401 is counted as "
             "[refused](#engines-where-each-workers-capacity-comes-from)."))
    worker_auth_header: str | None = flag(
        "--worker-auth-header", default=None, metavar="NAME",
        help=("send the --worker-auth-file content verbatim as this header instead (e.g. "
              "x-api-key)"),
        doc=("With `--worker-auth-file`: send the key verbatim as header NAME (e.g. "
             "`x-api-key`) instead of `Authorization: Bearer KEY`. Without `--worker-auth-file` "
             "it is a start-up error."))
    worker_auth_allow_http: bool = flag(
        "--worker-auth-allow-http", default=False, switch=True,
        help=("send the --worker-auth-file key to workers over plain http:// too (default: "
              "only over https://; an http:// worker with a key is a start-up error)"),
        doc=("With `--worker-auth-file`: also send the key to workers over plain `http://` "
             "(anyone on the path reads it). Without it the key goes over TLS only: an "
             "`http://` entry of `--worker-urls`, or `--envoy-admin-url` with "
             "`--envoy-cluster-scheme http`, is a start-up error naming the worker, and a probe "
             "to an `http://` worker never carries the key (`worker_credential_withheld`). "
             "For workers on loopback or a network you trust, as the demo's are."))
    startup_capacity_wait_secs: float = flag(
        "--startup-capacity-wait-secs", default=0, type=float, metavar="SECS",
        check=_finite_at_least_zero,
        help=("wait up to SECS for a first capacity reading from real workers before "
              "deciding scheduler vs. legacy admission (/healthz answers meanwhile, /readyz and "
              "gRPC do not); 0 = decide at once"),
        doc=("Wait up to SECS for a first capacity reading from real workers before "
             "choosing scheduler or legacy admission ([The start-up reservation check and the "
             "legacy fallback](#the-start-up-reservation-check-and-the-legacy-fallback)). "
             "`/healthz` answers meanwhile; `/readyz` and gRPC do not. 0 = decide at once. "
             "Finite, ≥ 0."))
    pool_workers: Mapping[str, tuple[str, ...]] = derived()
    """Named pools' worker URLs (--worker-urls POOL=URL); empty: no pools. The default
    pool's workers stay in worker_urls (bare entries) or come from --envoy-admin-url."""
    worker_credential: Mapping[str, str] | None = derived(repr=False)
    """Header name -> value sent with every worker probe; never in a repr."""

    def pool_sources(self) -> dict[str, tuple[tuple[str, ...], str | None]]:
        """Every pool's workers, the default pool first: (worker URLs, Envoy admin URL).
        The default pool's are the bare ``--worker-urls`` entries or ``--envoy-admin-url``'s
        cluster; a named pool's are its ``POOL=URL`` entries."""
        return {DEFAULT_POOL: (self.worker_urls, self.envoy_admin_url),
                **{name: (urls, None) for name, urls in self.pool_workers.items()}}


@dataclass(frozen=True, slots=True)
class LivenessSettings:
    TITLE: ClassVar[str] = "liveness: admission leases and Envoy"

    admission_lease_secs: float = flag(
        "--admission-lease-secs", default=30.0, type=float, metavar="SECS",
        check=_finite_above_zero,
        help=("an admission not renewed by an access-log entry within this time is "
              "reclaimed, unless Envoy acknowledged it while its access-log stream was open "
              "(then only its end or that Envoy's death frees it)"),
        doc=("An admission not renewed by an access-log entry within this time is "
             "reclaimed, unless Envoy acknowledged it while its access-log stream was open: "
             "then only its end, a preemption or that Envoy's death frees it "
             "([Leases](design.md#leases-and-envoy-liveness)). With periodic entries keep it "
             "above 3× Envoy's `access_log_flush_interval` (5 s in the shipped config). Finite, "
             "> 0."))
    envoy_owner_grace_secs: float = flag(
        "--envoy-owner-grace-secs", default=2.0, type=float, metavar="SECS",
        check=_finite_above_zero,
        help=("an Envoy whose access-log streams all closed and stayed closed this long is "
              "dead: the admissions it asked for are released"),
        doc=("An Envoy whose access-log streams all closed and stayed closed this long is "
             "dead: the admissions it asked for are released (`lease_expired`). Envoy killed "
             "(even SIGKILL) closes its sockets, so its slots are back after about this long; a "
             "host that vanished without closing them is detected by gRPC keepalive first (10 s "
             "+ 5 s). Finite, > 0."))
    envoy_authz_timeout: float | None = flag(
        "--envoy-authz-timeout", default=None, type=float, metavar="SECS",
        help=("Envoy's ext_authz timeout; start-up is refused if it is not longer than "
              "every class queue_timeout_secs"),
        doc=("Envoy's ext_authz timeout, for checking. When given (scheduler on), start-up "
             "is refused unless it exceeds every class's `queue_timeout_secs`, and so is a "
             "reload that would break that. When not given, the sidecar logs "
             "`envoy_authz_timeout_reminder` with the longest queue timeout."))


@dataclass(frozen=True, slots=True)
class FleetSettings:
    TITLE: ClassVar[str] = "fleet coordination (several gateway replicas, one admission)"

    coordination_url: str | None = flag(
        "--coordination-url", default=None, metavar="URL", check=_coordination_url,
        help=("Valkey/Redis server shared by the fleet's replicas: redis://HOST:PORT[/DB], "
              "rediss://... (TLS) or unix:///path; unset = in-process admission"),
        doc=("Requires `--priority-scheduler-enabled`. Share one fleet's slots among "
             "several gateway replicas through a Valkey ≥ 7.2 or Redis ≥ 7 server: "
             "`redis://HOST:PORT[/DB]`, `rediss://HOST:PORT[/DB]` (TLS) or `unix:///path`; an "
             "ACL user goes in the URL (`redis://USER@HOST:PORT/0`), its password never "
             "([operations: Security: who may decide "
             "admission](operations.md#security-who-may-decide-admission)). Unset: in-process "
             "admission, as a single replica needs. Any other scheme, a missing host or path, a "
             "non-numeric database, or a password in the URL (`USER:PASSWORD@`, `?password=`) "
             "is a start-up error; the error quotes the URL with its userinfo replaced by "
             "`***`, and no log line prints it."))
    coordination_password_file: str | None = flag(
        "--coordination-password-file", default=None, metavar="FILE",
        help=("file holding the coordination server's password (for the URL's user, or the "
              "default user); or set $" + PASSWORD_ENV + ". Never put it in the "
              "URL: argv is visible to every process on the host"),
        doc=("The coordination server's password for the URL's user (or the default user), "
             "read once at start-up: the file's text without its final line break (a mounted "
             f"Secret). Instead of the file, `${PASSWORD_ENV}` (ignored "
             "without `--coordination-url`); both at once, an unreadable, empty or multi-line "
             "file, or the flag without `--coordination-url` is a start-up error naming the "
             "flag, never quoting the password. The password joins the client's connection "
             "settings in memory only: never argv, never a log line or error."))
    fleet_id: str = flag(
        "--fleet-id", default="default", metavar="NAME", check=_fleet_name,
        help="replicas with the same fleet id and server share one fleet's slots",
        doc=("Replicas with the same fleet id and server share one fleet (the keys carry a "
             "`{NAME}` hash tag, one Redis Cluster slot; with pools each pool has a ledger of "
             "its own in that slot, [Pools in a fleet](design.md#pools-in-a-fleet)). 1..128 "
             "characters, no spaces or braces."))
    replica_id: str = flag(
        "--replica-id", default=None, metavar="NAME",
        check=_replica_id, shown_default="`<hostname>`",
        help="this replica's name in the fleet (default: the hostname: in Kubernetes the "
             "pod's name, kept across a container restart)",
        doc=("This replica's name in the fleet; one live sidecar per name. The default, "
             "the hostname, is the pod's name in Kubernetes: a restarted sidecar container "
             "keeps it and takes over the admissions its predecessor left running. Two "
             "sidecars sharing a hostname (two on one host outside Kubernetes) each need "
             "their own: once the second registers, the ledger refuses the first "
             "(`coordination_replica_id_in_use`, and it admits within its degraded share). "
             "1..128 characters, no spaces or braces (others in a hostname become `_`)."))
    replica_ttl_secs: float = flag(
        "--replica-ttl-secs", default=10.0, type=float, metavar="SECS", check=_ttl,
        help=("a replica that stops heartbeating this long loses its admissions "
              "fleet-wide; also how soon a replica degrades to its local share when the server "
              "is unreachable"),
        doc=("A replica that stops heartbeating this long loses its admissions and waiters "
             "fleet-wide; heartbeats go every third of it. Also the bound on how soon a replica "
             "degrades to its local share when the server is unreachable. Give every replica of "
             "a fleet the same value. Finite, > 0 and at most 86,400 (a day: the ledger refuses "
             "longer)."))
    coordination_password: str | None = derived(repr=False)
    """Never in a repr: Settings may be printed or logged whole."""


@dataclass(frozen=True, slots=True)
class TracingSettings:
    TITLE: ClassVar[str] = "tracing (an extension: one OpenTelemetry span per admission decision)"

    otlp_endpoint: str | None = flag(
        "--otlp-endpoint", default=None, metavar="URL", check=_otlp_endpoint,
        help=("export one span per admission decision to this OTLP/gRPC receiver "
              "(http://HOST:PORT plaintext, https://HOST:PORT TLS); unset = no traces"),
        doc=("Admission traces, an extension (off when unset): one span per Check decision, "
             "joined to the request's W3C `traceparent`, exported in batches to this OTLP/gRPC "
             "receiver (an OpenTelemetry Collector, Jaeger, Tempo): `http://HOST:PORT` "
             "(plaintext) or `https://HOST:PORT` (TLS, the system's CAs or "
             "`$OTEL_EXPORTER_OTLP_CERTIFICATE`). No user, password, path or query: a token "
             "goes in `--otlp-headers-file`. A receiver that is down or slow costs spans, never "
             "admission ([Admission traces](#admission-traces))."))
    trace_sample_ratio: float = flag(
        "--trace-sample-ratio", default=0.01, type=float, metavar="R",
        check=_sample_ratio,
        help=("share of requests without a sampled parent that get a span (0..1); a request "
              "whose traceparent is sampled always gets one; 0 = none at all"),
        doc=("With `--otlp-endpoint`: the share (0..1) of requests that start a trace here "
             "(no `traceparent`, or an invalid one) that get a span. Parent-based: a request "
             "whose `traceparent` is sampled always gets one, one whose parent is not sampled "
             "never does. `0` turns spans off entirely, sampled parents included."))
    otlp_headers_file: str | None = flag(
        "--otlp-headers-file", default=None, metavar="FILE",
        help=("file of 'name: value' lines sent as gRPC metadata with every export (a "
              "collector's token; never in argv); https:// endpoints only"),
        doc=("With an `https://` `--otlp-endpoint`: headers sent with every export (a "
             "collector's or vendor's token), one `name: value` per line (blank lines and `#` "
             "comments skipped; ≤ 8 KiB, ASCII, no control characters), read once at start-up. "
             "Never give a token in argv; no log line shows a value or any 8 characters of it, "
             "and errors about the file never quote it. Over a plaintext `http://` endpoint it "
             "is a start-up error."))
    otlp_headers: tuple[tuple[str, str], ...] = derived(repr=False)
    """Never in a repr: the values are tokens."""


@dataclass(frozen=True, slots=True)
class LoggingSettings:
    TITLE: ClassVar[str] = "logging"

    log_format: str = flag(
        "--log-format", default=None, choices=("json", "console"),
        shown_default="console on a terminal, json otherwise",
        help="log format (default: console on a terminal, json otherwise)",
        doc="Structured log format (stderr).")
    log_level: str = flag(
        "--log-level", default="info", choices=("debug", "info", "warning", "error"),
        help="log level",
        doc=("Log level. At `debug` each admission and each denial is logged; at `info` "
             "denials are summarised once per 10 s ([Log events](#log-events))."))


@dataclass(frozen=True, slots=True)
class CheckFlags:
    """``--check-config``: validate a file and exit; not a setting of a running sidecar."""

    TITLE: ClassVar[str] = "checking a priority.yaml (nothing is started)"

    check_config: str | None = flag(
        "--check-config", default=None, metavar="FILE", shown_default="—",
        help="validate FILE as priority.yaml, print the effective class table, exit",
        doc=("Validate FILE as `priority.yaml` with the same loader, print `FILE: OK "
             "(sha256 …)` and the effective class table, and exit 0; on an error print the "
             "one-line error and exit 1. Nothing is started."))
    check_capacity: int | None = flag(
        "--check-capacity", default=None, type=int, metavar="N",
        help=("with --check-config: also say whether FILE's reservations fit a capacity of "
              "N slots (priority scheduling) or legacy admission would serve; exit 1 if they do "
              "not fit"),
        doc=("With `--check-config`: also print whether FILE's reservations fit a capacity "
             "of N slots (`capacity N: OK …`: the scheduler would serve) or not (`capacity N: "
             "NOT OK …`: [legacy "
             "admission](#the-start-up-reservation-check-and-the-legacy-fallback) would, "
             "uncapped unless `--max-concurrent-requests` > 0 is given too), and the smallest "
             "capacity from which they fit; exit 1 when they do not. Without `--check-config` "
             "it is a start-up error (exit 2)."))


SETTINGS_GROUPS: tuple[type[FlagGroup], ...] = (
    SchedulerSettings, LegacySettings, ListenSettings, CapacitySettings, LivenessSettings,
    FleetSettings, TracingSettings, LoggingSettings)
FLAG_GROUPS: tuple[type[FlagGroup], ...] = (*SETTINGS_GROUPS, CheckFlags)
"""Every flag's group, in --help's and the reference's order."""


@dataclass(frozen=True, slots=True)
class Settings:
    """Everything the process needs, validated, by group (``settings.capacity.worker_urls``).

    ``settings.worker_urls`` still works (every field name is unique across groups);
    code under mypy uses the groups.
    """

    scheduler: SchedulerSettings
    legacy: LegacySettings
    listen: ListenSettings
    capacity: CapacitySettings
    liveness: LivenessSettings
    fleet: FleetSettings
    tracing: TracingSettings
    logging: LoggingSettings

    if not TYPE_CHECKING:
        def __getattr__(self, name: str) -> Any:
            group = _GROUP_OF.get(name)
            if group is None:
                raise AttributeError(name)
            return getattr(getattr(self, group), name)


# Settings' fields are the groups in SETTINGS_GROUPS' order; a field name is in one group
# (tests/test_config_flags.py checks both).
_GROUP_OF = {f.name: member.name
             for member, group in zip(dataclasses.fields(Settings), SETTINGS_GROUPS, strict=True)
             for f in dataclasses.fields(group)}


def build_parser() -> argparse.ArgumentParser:
    return flags.build_parser(
        FLAG_GROUPS, prog="priority-sidecar",
        description=("Envoy ext_authz sidecar admitting LLM requests by priority class "
                     "(x-smg-priority: system > interactive > default > bulk)."))


def check_authz_timeout(authz_timeout: float | None, cfg: PriorityConfig,
                        scheduler_enabled: bool, *, file: str | None = None) -> None:
    """``--envoy-authz-timeout`` must outlast every class queue (scheduler on), or Envoy
    gives up on queued requests first: the one rule, at start-up and on every reload
    (which names the ``file`` it rejects)."""
    if authz_timeout is None or not scheduler_enabled:
        return
    longest = cfg.max_queue_timeout()
    if authz_timeout <= longest:
        raise ConfigError(
            f"--envoy-authz-timeout {authz_timeout:g}s must exceed the longest class "
            f"queue_timeout_secs ({longest:g}s), or Envoy gives up on queued requests first",
            file=file)


def check_coordination_url(url: str) -> None:
    """Refuse a ``--coordination-url`` the client could not connect with, or one holding a
    password (argv is public); every message quotes it redacted."""
    if url_has_password(url):
        raise ConfigError(f"--coordination-url {clip(redact_url(url, keep_user=False))!r}: "
                          "a password in the "
                          "URL is visible to every process on the host; put it in "
                          f"--coordination-password-file or ${PASSWORD_ENV}")
    url = redact_url(url, keep_user=False)  # what follows only quotes it
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
    except ValueError as exc:  # a port that is not a number
        raise ConfigError(f"--coordination-url {clip(url)!r}: {exc}") from None
    scheme = parts.scheme.lower()
    if scheme in ("redis", "rediss"):
        if not parts.hostname:
            raise ConfigError(f"--coordination-url {clip(url)!r}: missing host "
                              f"(expected {scheme}://HOST:PORT[/DB])")
        if port == 0:
            raise ConfigError(f"--coordination-url {clip(url)!r}: port must be 1..65535")
        db = parts.path.strip("/")
        if db and not db.isdigit():
            raise ConfigError(f"--coordination-url {clip(url)!r}: database must be a "
                              f"number, got {clip(db)!r}")
    elif scheme == "unix":
        if not parts.path:
            raise ConfigError(f"--coordination-url {clip(url)!r}: missing socket path "
                              "(expected unix:///path)")
    else:
        raise ConfigError(f"--coordination-url {clip(url)!r} must start with redis://, "
                          "rediss:// or unix://")


def coordination_password(ns: argparse.Namespace,
                          environ: Mapping[str, str] | None = None) -> str | None:
    """The coordination password: ``--coordination-password-file``, else the environment."""
    env = os.environ if environ is None else environ
    from_env = env.get(PASSWORD_ENV) or None
    path = ns.coordination_password_file
    if path is None:
        return from_env if ns.coordination_url is not None else None
    if ns.coordination_url is None:
        raise ConfigError("--coordination-password-file requires --coordination-url")
    if from_env is not None:
        raise ConfigError(f"--coordination-password-file and ${PASSWORD_ENV} both given: "
                          "give the password once")
    try:
        return read_password(path)
    except ValueError as exc:
        raise ConfigError(f"--coordination-password-file: {exc}") from None


def default_replica_id() -> str:
    """The hostname (spaces and braces as ``_``, at most 128 characters): in Kubernetes the
    pod's name, unique among live pods and kept across a container restart, so that a
    restarted sidecar takes over the admissions still running under it (a new id each
    start, ``<hostname>-<pid>`` before, let the old registration lapse and free them while
    they ran: 12 of 9 measured). Two sidecars on one hostname collide loudly, never
    silently: the ledger refuses the one taken over (``replica_id_in_use``)."""
    return re.sub(r"[\s{}]", "_", socket.gethostname())[:128] or "replica"


MAX_CREDENTIAL_BYTES = 8192
_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+\Z")


def worker_credential(path: str | None, header: str | None) -> dict[str, str] | None:
    """The probe credential from ``--worker-auth-file``: ``{header: value}``.

    The file holds one line, the key (a final line break is dropped). Errors
    name the file and why, never its content.
    """
    if path is None:
        if header is not None:
            raise ConfigError("--worker-auth-header needs --worker-auth-file")
        return None
    if header is not None and not _HEADER_NAME.match(header):
        raise ConfigError(f"--worker-auth-header {clip(header)!r} is not a header name")
    key = _read_secret_file("--worker-auth-file", path).removesuffix("\n").removesuffix("\r")
    if not key.strip():
        raise ConfigError("--worker-auth-file: empty", file=path)
    # A header value cannot hold a line break or control character (a second line
    # would be a header injected into every probe).
    if any((ord(ch) < 0x20 and ch != "\t") or ord(ch) == 0x7F for ch in key):
        raise ConfigError("--worker-auth-file: holds more than one line or a control "
                          "character", file=path)
    key = key.strip()
    if header is None:
        return {"Authorization": f"Bearer {key}"}
    return {header: key}


def otlp_headers(path: str | None, endpoint: str | None) -> tuple[tuple[str, str], ...]:
    """The export headers from ``--otlp-headers-file``: ``((name, value), ...)``, names
    lowercased (gRPC metadata). Errors name the file and the line, never a value."""
    if path is None:
        return ()
    flag_ = "--otlp-headers-file"
    if endpoint is None:
        raise ConfigError(f"{flag_} needs --otlp-endpoint")
    if not endpoint.lower().startswith("https://"):
        raise ConfigError(f"{flag_}: the headers would go over plaintext (--otlp-endpoint "
                          "http://...); give an https:// endpoint")
    text = _read_secret_file(flag_, path)
    if any((ord(ch) < 0x20 and ch not in "\t\r\n") or ord(ch) == 0x7F for ch in text):
        raise ConfigError(f"{flag_}: holds a control character", file=path)
    headers: list[tuple[str, str]] = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        name, sep, value = line.partition(":")
        name, value = name.strip(), value.strip()
        if not sep or not _HEADER_NAME.match(name) or not value:
            raise ConfigError(f"{flag_}: line {lineno} is not 'name: value'", file=path)
        headers.append((name.lower(), value))
    if not headers:
        raise ConfigError(f"{flag_}: no header in it", file=path)
    return tuple(headers)


def _read_secret_file(flag_: str, path: str) -> str:
    """A small ASCII file of secrets, as text; errors name the flag and the file only."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise ConfigError(f"{flag_}: cannot read: {exc.strerror}", file=path) from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ConfigError(f"{flag_}: not a regular file", file=path)
        data = os.read(fd, MAX_CREDENTIAL_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"{flag_}: cannot read: {exc.strerror}", file=path) from None
    finally:
        os.close(fd)
    if len(data) > MAX_CREDENTIAL_BYTES:
        raise ConfigError(f"{flag_}: longer than {MAX_CREDENTIAL_BYTES} bytes", file=path)
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError:
        raise ConfigError(f"{flag_}: not ASCII text", file=path) from None
    return text


def settings_from_args(ns: argparse.Namespace, *, isatty: bool | None = None) -> Settings:
    """Validate parsed flags and load the YAML; raise :class:`ConfigError`.

    Each flag's own check comes from the table; what follows are the rules that
    involve several flags, and the fields derived from several.
    """
    if ns.priority_scheduler_enabled and ns.prefill_max_inflight_requests_per_worker is not None:
        raise ConfigError(
            "--priority-scheduler-enabled cannot be combined with "
            "--prefill-max-inflight-requests-per-worker"
        )
    listen_ = ListenSettings(**flags.checked_values(ListenSettings, ns))
    default_urls, pool_workers = split_worker_urls(ns.worker_urls)
    credential = worker_credential(ns.worker_auth_file, ns.worker_auth_header)
    capacity = CapacitySettings(**{**flags.checked_values(CapacitySettings, ns),
                                   "worker_urls": default_urls}, pool_workers=pool_workers,
                                worker_credential=credential)
    check_credential_transport(capacity)
    legacy = LegacySettings(**flags.checked_values(LegacySettings, ns))
    liveness = LivenessSettings(**flags.checked_values(LivenessSettings, ns))
    fleet_values = flags.checked_values(FleetSettings, ns)
    if ns.coordination_url is not None and not ns.priority_scheduler_enabled:
        # The ledger implements the priority scheduler; the legacy path has no fleet form.
        raise ConfigError("--coordination-url requires --priority-scheduler-enabled")
    if ns.shadow and ns.coordination_url is not None:
        # The fleet's ledger queues and refuses across replicas: no shadow form of it.
        raise ConfigError("--shadow cannot be combined with --coordination-url")
    if ns.shadow and ns.edge_shed:
        raise ConfigError("--shadow cannot be combined with --edge-shed (Envoy would refuse "
                          "requests itself)")
    fleet = FleetSettings(**fleet_values, coordination_password=coordination_password(ns))
    # An unknown class means default (logged at start-up), so this flag never fails.
    default_max, valid = parse_default_max_class(ns.priority_scheduler_default_max_class)
    scheduler = SchedulerSettings(**{**flags.checked_values(SchedulerSettings, ns),
                                     "default_max_class": default_max},
                                  default_max_class_valid=valid)
    check_pools(scheduler.priority, pool_workers)
    check_kv_admission(scheduler.priority, fleet=ns.coordination_url is not None)
    check_authz_timeout(liveness.envoy_authz_timeout, scheduler.priority,
                        scheduler.scheduler_enabled)
    tracing = TracingSettings(**flags.checked_values(TracingSettings, ns),
                              otlp_headers=otlp_headers(ns.otlp_headers_file, ns.otlp_endpoint))
    logging_ = LoggingSettings(**flags.checked_values(LoggingSettings, ns))
    if logging_.log_format is None:
        tty = os.isatty(2) if isatty is None else isatty
        logging_ = replace(logging_, log_format="console" if tty else "json")
    return Settings(scheduler=scheduler, legacy=legacy, listen=listen_, capacity=capacity,
                    liveness=liveness, fleet=fleet, tracing=tracing, logging=logging_)


def split_worker_urls(entries: Sequence[str]
                      ) -> tuple[tuple[str, ...], dict[str, tuple[str, ...]]]:
    """``--worker-urls``: bare URLs (and ``default=URL``) are the default pool's; ``POOL=URL``
    entries make up the named pools."""
    default: list[str] = []
    pools: dict[str, list[str]] = {}
    for entry in entries:
        name, sep, url = entry.partition("=")
        if not sep or "/" in name or ":" in name:
            name, url = DEFAULT_POOL, entry  # a bare URL (which may hold '=' itself)
        elif not POOL_NAME.match(name):
            raise ConfigError(f"--worker-urls: pool name {clip(name)!r} must be "
                              f"{POOL_NAME_RULE}")
        if not url.startswith(("http://", "https://")):
            raise ConfigError(f"--worker-urls: {redact_url(url)!r} must start with http:// or "
                              "https://")
        if name == DEFAULT_POOL:
            default.append(url)
        else:
            pools.setdefault(name, []).append(url)
    return tuple(default), {name: tuple(urls) for name, urls in pools.items()}


def sends_credential(url: str, over_http: bool) -> bool:
    """The one rule for where the workers' key may go: over TLS (``https://``) only,
    unless plain ``http://`` was allowed (``--worker-auth-allow-http``). Checked for every
    worker source at start-up (:func:`check_credential_transport`) and for every probe
    (sidecar.health)."""
    return url.lower().startswith("https://") or over_http


def check_credential_transport(capacity: CapacitySettings) -> None:
    """Every worker source that would send the workers' key over plain http is refused
    here, before anything is probed (:func:`sends_credential`)."""
    if capacity.worker_credential is None or capacity.worker_auth_allow_http:
        return
    allow = "--worker-auth-allow-http"
    for urls, _ in capacity.pool_sources().values():
        for url in urls:
            if not sends_credential(url, False):
                raise ConfigError(f"--worker-urls {clip(redact_url(url))!r}: "
                                  f"--worker-auth-file's key would go over plain http; give "
                                  f"the worker as https://, or allow plain http with {allow}")
    if capacity.envoy_admin_url is not None and not sends_credential(
            f"{capacity.envoy_cluster_scheme}://", False):
        raise ConfigError("--envoy-admin-url with --worker-auth-file: the hosts found there are "
                          "probed over http (--envoy-cluster-scheme http), so the key would go "
                          "over plain http; give --envoy-cluster-scheme https for workers "
                          f"that serve TLS, or allow plain http with {allow}")


def check_pools(cfg: PriorityConfig, pool_workers: Mapping[str, tuple[str, ...]]) -> None:
    """Every ``pools.<name>`` of the file is a pool the workers define."""
    for name in cfg.pools:
        if name == DEFAULT_POOL and pool_workers:
            continue
        if name not in pool_workers:
            raise ConfigError(
                f"no worker is in this pool (start with --worker-urls {name}=URL ...)"
                if name != DEFAULT_POOL else
                "pools are off (no --worker-urls POOL=URL entry): nothing to override",
                file=cfg.source, key=f"pools.{name}")


def parse_settings(argv: Sequence[str] | None = None) -> Settings:
    """Parse ``argv`` into :class:`Settings` (argparse exits 2 on unknown flags)."""
    return settings_from_args(build_parser().parse_args(argv))


def capacity_verdict(cfg: PriorityConfig, capacity: int,
                     max_concurrent_requests: int) -> tuple[bool, str]:
    """``--check-config --check-capacity N``: do the reservations fit N, and what would
    serve if they do not (docs/reference.md, "The start-up reservation check")."""
    desired = desired_reservations(cfg.classes, max(0, capacity))
    total = sum(desired.values())
    shares = " / ".join(f"{c.label} {n}" for c, n in desired.items())
    need = smallest_fitting_capacity(cfg)
    needs = (f"priority scheduling needs a capacity of at least {need}" if need is not None
             else "these reservations do not fit any capacity up to 65535")
    if capacity >= 1 and total <= capacity:
        least = f" (it needs at least {need})" if need is not None else ""
        return True, (f"capacity {capacity}: OK, reservations {shares} = {total} fit: the "
                      f"scheduler serves{least}")
    cap = LegacyLimits(max_concurrent_requests).cap_words()
    return False, (f"capacity {capacity}: NOT OK, reservations {shares} = {total} exceed it: "
                   f"the sidecar would serve with legacy admission for its whole life, {cap}; "
                   f"{needs}")

