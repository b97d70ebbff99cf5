"""The scenarios side by side: what an operator would otherwise deploy, and priority-gate.

Each row of :data:`SCENARIOS` is one front for the same engine and the same requests:

* ``S0`` interactive alone, through Envoy alone: the baseline of interactive latency;
* ``S1`` Envoy alone in front of the engine: the engine's own FIFO queue holds the backlog;
* ``S2`` Envoy's adaptive concurrency filter, configured as its documentation's example
  (p90 of the samples, limit recomputed every 100 ms, minRTT from 50 requests every 60 s
  with 10 % jitter), its concurrency floor the engine's slot count;
* ``S3`` Envoy's local rate limit on the bulk class (a route on ``x-smg-priority: bulk``
  with a token bucket at 80 % of the engine's bulk capacity, bursts of one slot count);
* ``S4`` priority-gate as shipped: the shipped bootstrap (envoy/render.py) and the sidecar
  with its default flags; priority.yaml keeps the shipped per-slot shares for the class
  that has traffic here (interactive 0.25 of capacity) and no reservation for the classes
  that have none (system, default); on llama.cpp the sidecar suspends preemption
  (sidecar/app.py ``CANNOT_CANCEL_ENGINES``), so the reservation is what protects
  interactive;
* ``S5`` S4 with the options that help on this engine: ``--edge-shed`` (bulk's overflow
  answered by Envoy) and ``--saturation-guard`` (the engine's own queue read from its
  /metrics, so a request the engine still runs after its client left holds its slot).

A new option (deadlines, token budgets) is a new row: a name, a title, the sidecar flags
(and a priority.yaml tweak if any).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import yaml

ENVOY = "envoy"  # Envoy alone, bench/qos's own bootstrap below
GATE = "priority-gate"  # the shipped bootstrap and the sidecar (devtools.stack)


@dataclass(frozen=True)
class Scenario:
    name: str
    title: str
    front: str  # ENVOY or GATE
    bulk: bool = True
    envoy_filter: str = ""  # ENVOY fronts: "", "adaptive_concurrency" or "bulk_ratelimit"
    sidecar_args: tuple[str, ...] = ()
    edge_shed: bool = False
    priority_overrides: dict[str, dict[str, Any]] = field(default_factory=dict)


SCENARIOS: tuple[Scenario, ...] = (
    Scenario("S0", "interactive alone (baseline)", ENVOY, bulk=False),
    Scenario("S1", "Envoy alone (the engine's own queue)", ENVOY),
    Scenario("S2", "Envoy adaptive concurrency", ENVOY, envoy_filter="adaptive_concurrency"),
    Scenario("S3", "Envoy local rate limit on bulk", ENVOY, envoy_filter="bulk_ratelimit"),
    Scenario("S4", "priority-gate as shipped", GATE),
    Scenario("S5", "priority-gate + edge shed + saturation guard", GATE,
             sidecar_args=("--saturation-guard",), edge_shed=True),
)
# More rows for exploring, run with --scenarios (not in the default set).
EXTRA_SCENARIOS: tuple[Scenario, ...] = (
    Scenario("S4-r0", "priority-gate, no interactive reservation", GATE,
             priority_overrides={"interactive": {"reserved_per_slot": 0.0}}),
    Scenario("S4-r2", "priority-gate, interactive reserves 2 slots", GATE,
             priority_overrides={"interactive": {"reserved_floor": 2}}),
    Scenario("S4-guard", "priority-gate + saturation guard", GATE,
             sidecar_args=("--saturation-guard",)),
    Scenario("S4-edge", "priority-gate + edge shed", GATE, edge_shed=True),
)
BY_NAME = {s.name: s for s in SCENARIOS + EXTRA_SCENARIOS}

# Bulk's share of its capacity that S3's token bucket lets through: what is left once
# interactive's bursts (a fifth of the engine's tokens, workload.py) are served.
RATELIMIT_SHARE = 0.8


def priority_yaml(bulk_timeout: float, overrides: dict[str, dict[str, Any]] | None = None
                  ) -> str:
    """S4's class table: the shipped values (k8s/base/configmap-priority.yaml) with the
    floors, sized for 256-slot fleets, at 0, and no reservation for the classes that send
    nothing here (system, default: a reservation of theirs would only idle slots). Bulk
    waits as long as its clients do."""
    classes: dict[str, dict[str, Any]] = {
        "system": {"reserved_floor": 0, "reserved_per_slot": 0.0},
        "interactive": {"reserved_floor": 0, "reserved_per_slot": 0.25, "queue_size": 256,
                        "queue_timeout_secs": 30},
        "default": {"reserved_floor": 0, "reserved_per_slot": 0.0},
        "bulk": {"queue_size": 1024, "queue_timeout_secs": bulk_timeout},
    }
    for cls, knobs in (overrides or {}).items():
        classes[cls] = {**classes[cls], **knobs}
    return yaml.safe_dump({"classes": classes}, sort_keys=False)


def reservation(slots: int, overrides: dict[str, dict[str, Any]] | None = None) -> int:
    """Interactive's reservation on ``slots`` (the contract's max(floor, ceil(share x cap)))."""
    knobs = {"reserved_floor": 0, "reserved_per_slot": 0.25,
             **(overrides or {}).get("interactive", {})}
    return min(slots, max(int(knobs["reserved_floor"]),
                          math.ceil(float(knobs["reserved_per_slot"]) * slots)))


def _adaptive_concurrency(slots: int) -> dict[str, Any]:
    return {
        "name": "envoy.filters.http.adaptive_concurrency",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.adaptive_concurrency"
                     ".v3.AdaptiveConcurrency",
            "gradient_controller_config": {
                "sample_aggregate_percentile": {"value": 90},
                "concurrency_limit_params": {"concurrency_update_interval": "0.1s"},
                "min_rtt_calc_params": {
                    "jitter": {"value": 10}, "interval": "60s", "request_count": 50,
                    # The limit while minRTT is measured, and its floor: the engine's
                    # slots (the docs' 25/50 are for a service with thousands in flight).
                    "min_concurrency": slots},
            },
            "enabled": {"default_value": True, "runtime_key": "adaptive_concurrency.enabled"},
        },
    }


def _ratelimit_route(route: dict[str, Any], bulk_rps: float, burst: int) -> dict[str, Any]:
    # Envoy refills whole tokens at least 50 ms apart: one token per 1/rate seconds.
    interval_ms = max(50, round(1000.0 / bulk_rps))
    return {
        "match": {"prefix": "/", "headers": [
            {"name": "x-smg-priority", "string_match": {"exact": "bulk", "ignore_case": True}}]},
        "route": route,
        "typed_per_filter_config": {"envoy.filters.http.local_ratelimit": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.local_ratelimit.v3"
                     ".LocalRateLimit",
            "stat_prefix": "bulk_ratelimit",
            "token_bucket": {"max_tokens": burst, "tokens_per_fill": 1,
                             "fill_interval": f"{interval_ms / 1000:g}s"},
            "filter_enabled": {"default_value": {"numerator": 100, "denominator": "HUNDRED"}},
            "filter_enforced": {"default_value": {"numerator": 100, "denominator": "HUNDRED"}},
        }},
    }


def envoy_bootstrap(scenario: Scenario, *, listen_port: int, admin_port: int,
                    workers: list[tuple[str, int]], slots: int, bulk_rps_limit: float,
                    health_interval_secs: float = 1.0) -> str:
    """Envoy alone in front of the workers: the shipped bootstrap's listener, route and
    workers cluster (timeouts, retry on reset, health checks, open circuit breakers),
    without ext_authz, ext_proc and the access logs, plus the scenario's filter."""
    route = {"cluster": "workers", "timeout": "0s",
             "retry_policy": {"retry_on": "reset,connect-failure", "num_retries": 2}}
    routes: list[dict[str, Any]] = [{"match": {"prefix": "/"}, "route": route}]
    filters: list[dict[str, Any]] = []
    if scenario.envoy_filter == "adaptive_concurrency":
        filters.append(_adaptive_concurrency(slots))
    elif scenario.envoy_filter == "bulk_ratelimit":
        filters.append({"name": "envoy.filters.http.local_ratelimit", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.local_ratelimit.v3"
                     ".LocalRateLimit",
            "stat_prefix": "bulk_ratelimit"}})
        routes.insert(0, _ratelimit_route(route, bulk_rps_limit, slots))
    elif scenario.envoy_filter:
        raise ValueError(f"{scenario.name}: unknown Envoy filter {scenario.envoy_filter!r}")
    filters.append({"name": "envoy.filters.http.router", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}})
    open_breakers = {"thresholds": [{"priority": "DEFAULT", "max_connections": 100000,
                                     "max_pending_requests": 100000,
                                     "max_requests": 100000}]}
    boot = {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1",
                                                 "port_value": admin_port}}},
        "static_resources": {
            "listeners": [{
                "name": "main",
                "address": {"socket_address": {"address": "127.0.0.1",
                                               "port_value": listen_port}},
                "filter_chains": [{"filters": [{
                    "name": "envoy.filters.network.http_connection_manager",
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.filters.network"
                                 ".http_connection_manager.v3.HttpConnectionManager",
                        "stat_prefix": "ingress", "codec_type": "AUTO",
                        "stream_idle_timeout": "300s", "request_timeout": "0s",
                        "route_config": {"name": "local", "virtual_hosts": [
                            {"name": "all", "domains": ["*"], "routes": routes}]},
                        "http_filters": filters}}]}]}],
            "clusters": [{
                "name": "workers", "type": "STATIC", "connect_timeout": "1s",
                "lb_policy": "ROUND_ROBIN",
                "typed_extension_protocol_options": {
                    "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                        "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3"
                                 ".HttpProtocolOptions",
                        "explicit_http_config": {"http_protocol_options": {}}}},
                "circuit_breakers": open_breakers,
                "health_checks": [{
                    "timeout": "0.5s", "interval": f"{health_interval_secs:g}s",
                    "no_traffic_interval": f"{health_interval_secs:g}s",
                    "unhealthy_threshold": 1, "healthy_threshold": 1,
                    "http_health_check": {"path": "/health"}}],
                "load_assignment": {"cluster_name": "workers", "endpoints": [{"lb_endpoints": [
                    {"endpoint": {"address": {"socket_address": {"address": h,
                                                                 "port_value": p}}}}
                    for h, p in workers]}]}}],
        },
    }
    return f"# bench.qos {scenario.name}: {scenario.title}\n" + yaml.safe_dump(
        boot, sort_keys=False)
