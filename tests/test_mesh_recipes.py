"""Offline checks of the mesh recipes (k8s/istio/, k8s/envoy-gateway/).

No cluster: the recipes are parsed and compared with what the sidecar is actually run with
(k8s/base/deployment.yaml's flags, configmap-priority.yaml's queue timeouts) and with the
hand-written bootstrap's ext_proc settings (envoy/envoy.yaml.tmpl), so a change of port,
timeout or tenant header on one side fails here until the recipes follow.
"""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from sidecar.config import parse_priority_config
from tests.test_k8s import (
    K8S,
    _arg,
    _build,
    _dig,
    _docs,
    _envoy_bin,
    _envoy_bootstrap,
    _priority_text,
    _sidecar,
)

ISTIO = K8S / "istio"
EG = K8S / "envoy-gateway"
EG_POOLS = K8S / "overlays" / "envoy-gateway-pools"
EG_EDGE = K8S / "overlays" / "envoy-gateway-edge-shed"
EXT_AUTHZ_NS = "envoy.filters.http.ext_authz"
DEFAULT_EG_CIRCUIT_BREAKER = 1024  # EG's maxParallelRequests default (api/v1alpha1/shared_types.go)


def _one(directory: Path, kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for p in sorted(directory.rglob("*.yaml")) if p.name != "kustomization.yaml"
             and not p.name.endswith(".values.yaml") for d in _docs(p)
             if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"{directory.name}: {len(found)} x {kind} {name or ''}, want 1"
    return found[0]


def _grpc_port() -> int:
    host, _, port = _arg(_sidecar(), "--grpc-listen").rpartition(":")
    assert host == "127.0.0.1"  # the recipes reach it on loopback
    return int(port)


def _authz_timeout() -> str:
    return f"{int(float(_arg(_sidecar(), '--envoy-authz-timeout')))}s"


def _tenant_header() -> str:
    source = _arg(_sidecar(), "--tenant-source")
    assert source.startswith("header:")  # the recipes copy the claim to this header
    return source.removeprefix("header:")


def _secs(duration: str) -> float:
    assert duration.endswith("s")
    return float(duration[:-1])


def _template_ext_proc_filter(bootstrap: dict[str, Any] | None = None) -> dict[str, Any]:
    """The bootstrap's ext_proc http filter, as written (wrapped in its matcher)."""
    (listener,) = (bootstrap or _envoy_bootstrap())["static_resources"]["listeners"]
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    (ext_proc,) = [f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.ext_proc"]
    return ext_proc


def _unwrap(cfg: dict[str, Any]) -> dict[str, Any]:
    if cfg["@type"].endswith("ExtensionWithMatcher"):  # skipped for some requests
        inner: dict[str, Any] = cfg["extension_config"]["typed_config"]
        return inner
    return cfg


def _template_ext_proc() -> dict[str, Any]:
    return _unwrap(_template_ext_proc_filter()["typed_config"])


def _skip_inputs(cfg: dict[str, Any]) -> list[tuple[str, Any]]:
    """What each skip rule of an ExtensionWithMatcher reads and how it matches."""
    out = []
    for m in cfg["xds_matcher"]["matcher_list"]["matchers"]:
        assert m["on_match"]["action"]["typed_config"]["@type"].endswith("SkipFilter")
        pred = m["predicate"]["single_predicate"]
        inp = pred["input"]["typed_config"]
        assert inp["filter"] == EXT_AUTHZ_NS
        match = pred["custom_match"]["typed_config"]
        out.append(([p["key"] for p in inp["path"]], (match["value"], match.get("invert", False))))
    return out


def _istio_providers() -> dict[str, dict[str, Any]]:
    values = yaml.safe_load((ISTIO / "mesh-config.values.yaml").read_text(encoding="utf-8"))
    return {p["name"]: p for p in values["meshConfig"]["extensionProviders"]}


def _patch_values(filt: dict[str, Any]) -> list[dict[str, Any]]:
    return [cp["patch"]["value"] for cp in filt["spec"]["configPatches"]]


# ------------------------------------------------------------------------------ Istio


def _istio_ext_authz() -> tuple[dict[str, Any], dict[str, Any]]:
    """(the filter patch, the default pool's route patch) of the recipe's ext_authz."""
    filt = _one(ISTIO, "EnvoyFilter", "priority-gate-ext-authz")
    by_kind = {cp["applyTo"]: cp for cp in filt["spec"]["configPatches"]}
    assert sorted(by_kind) == ["HTTP_FILTER", "HTTP_ROUTE"]
    return by_kind["HTTP_FILTER"], by_kind["HTTP_ROUTE"]


def _template_ext_authz() -> dict[str, Any]:
    (listener,) = _envoy_bootstrap()["static_resources"]["listeners"]
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    (f,) = [f for f in hcm["http_filters"] if f["name"] == EXT_AUTHZ_NS]
    cfg: dict[str, Any] = f["typed_config"]
    return cfg


def _per_route_ext_authz(cp: dict[str, Any]) -> dict[str, Any]:
    """A route patch's ext_authz settings, unwrapped from the FilterConfig that enables it."""
    assert cp["patch"]["operation"] == "MERGE"
    cfg = cp["patch"]["value"]["typed_per_filter_config"][EXT_AUTHZ_NS]
    assert cfg["@type"].endswith("envoy.config.route.v3.FilterConfig")
    assert not cfg.get("disabled", False)
    inner: dict[str, Any] = cfg["config"]
    assert inner["@type"].endswith("ExtAuthzPerRoute")
    return inner


def test_istio_ext_authz_runs_after_jwt_authn_with_the_bootstraps_settings() -> None:
    """Check is the recipe's own filter, put before the router (after jwt_authn, which
    istiod puts right after a CUSTOM policy's ext_authz), with the bootstrap's settings."""
    filter_patch, _ = _istio_ext_authz()
    assert filter_patch["patch"]["operation"] == "INSERT_BEFORE"
    assert filter_patch["match"]["listener"]["filterChain"]["filter"]["subFilter"]["name"] == (
        "envoy.filters.http.router")
    value = filter_patch["patch"]["value"]
    assert value["name"] == EXT_AUTHZ_NS
    assert value["disabled"] is True  # on only where a route patch enables it
    cfg = value["typed_config"]
    assert cfg["grpc_service"]["envoy_grpc"]["cluster_name"] == (
        f"outbound|{_grpc_port()}||priority-gate.local")
    assert cfg["grpc_service"]["timeout"] == _authz_timeout()
    assert _secs(cfg["grpc_service"]["timeout"]) > parse_priority_config(
        _priority_text()).max_queue_timeout()
    want = _template_ext_authz()
    assert {k: v for k, v in cfg.items() if k != "grpc_service"} == {
        k: v for k, v in want.items() if k != "grpc_service"}
    # applied before ext_proc's patch: both go right before the router, so ext_authz first
    ext_proc = _one(ISTIO, "EnvoyFilter", "priority-gate-ext-proc")
    assert (_one(ISTIO, "EnvoyFilter", "priority-gate-ext-authz")["spec"]["priority"]
            < ext_proc["spec"]["priority"])
    entry = _one(ISTIO, "ServiceEntry")
    assert [e["address"] for e in entry["spec"]["endpoints"]] == ["127.0.0.1"]
    ports = [(p["number"], p["protocol"]) for p in entry["spec"]["ports"]]
    assert ports == [(_grpc_port(), "GRPC")]


def test_istio_has_no_custom_policy_and_telemetry_names_the_als_provider() -> None:
    """A CUSTOM AuthorizationPolicy would add istiod's ext_authz before jwt_authn: a second
    Check, without the tenant."""
    providers = _istio_providers()
    assert not any("envoyExtAuthzGrpc" in p for p in providers.values())
    for path in sorted(ISTIO.rglob("*.yaml")):
        if not path.name.endswith(".values.yaml") and path.name != "kustomization.yaml":
            assert all(d["kind"] != "AuthorizationPolicy" for d in _docs(path)), path.name
    (logging,) = _one(ISTIO, "Telemetry")["spec"]["accessLogging"]
    (als_ref,) = logging["providers"]
    als = providers[als_ref["name"]]["envoyHttpAls"]
    assert als["port"] == _grpc_port()
    assert als["service"] in _one(ISTIO, "ServiceEntry")["spec"]["hosts"]


def test_istio_default_route_enables_check_without_a_pool() -> None:
    _, route_patch = _istio_ext_authz()
    assert route_patch["match"]["routeConfiguration"]["vhost"]["route"]["name"] == (
        "priority-gate")
    assert _per_route_ext_authz(route_patch) == {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_authz.v3."
                 "ExtAuthzPerRoute", "check_settings": {}}


def _overlay_pools() -> list[str]:
    """The pools k8s/overlays/pools gives the sidecar (--worker-urls POOL=URL)."""
    from sidecar.config import split_worker_urls
    text = (K8S / "overlays" / "pools" / "kustomization.yaml").read_text(encoding="utf-8")
    urls = [line.split("value: ", 1)[1] for line in text.splitlines()
            if line.strip().startswith("value: ") and "=http" in line]
    return sorted(split_worker_urls(urls)[1])


def test_istio_pools_each_route_names_its_pool() -> None:
    """Every VirtualService route of the pools add-on has Check enabled by exactly one
    patch; the pool routes name the sidecar's pools (k8s/overlays/pools), the catch-all
    is the default pool's route of the base recipe."""
    pools = ISTIO / "pools"
    vs = _one(pools, "VirtualService")
    names = [r["name"] for r in vs["spec"]["http"]]
    patches = {cp["match"]["routeConfiguration"]["vhost"]["route"]["name"]: cp
               for cp in _one(pools, "EnvoyFilter")["spec"]["configPatches"]}
    assert all(cp["applyTo"] == "HTTP_ROUTE" for cp in patches.values())
    _, default_patch = _istio_ext_authz()
    patches["priority-gate"] = default_patch
    assert sorted(names) == sorted(patches)
    named = {name: _per_route_ext_authz(cp)["check_settings"].get(
        "context_extensions", {}).get("smg-pool") for name, cp in patches.items()}
    assert sorted(p for p in named.values() if p is not None) == _overlay_pools()
    assert named["priority-gate"] is None
    # the catch-all goes last (Envoy takes the first match)
    assert vs["spec"]["http"][-1]["name"] == "priority-gate"
    for route in vs["spec"]["http"][:-1]:
        (match,) = route["match"]
        assert match["uri"]["prefix"] == f"/{named[route['name']]}/"


def test_istio_recipe_passes_envoy_validate_on_an_istio_shaped_gateway(
        tmp_path: Path) -> None:
    """The recipe's EnvoyFilters applied (envoy/mesh.py istio_gateway) to the filters and
    routes istiod generates for the gateway: Envoy accepts the result."""
    envoy = _envoy_bin()
    if envoy is None:
        pytest.skip("no Envoy binary (set ENVOY_BIN or run `make envoy`)")
    from devtools.stack import load_renderer
    from tests.test_mesh_e2e import istio_envoy_filters

    pools = _overlay_pools()
    text = load_renderer().render(
        listen_port=10000, admin_port=9901, sidecar_host="127.0.0.1", sidecar_port=9001,
        workers=[("127.0.0.1", 8000)], authz_timeout_secs=310, flush_interval_secs=5,
        jwt_hs256_secret="s", pools=[(p, f"/{p}/", [("127.0.0.1", 8001)]) for p in pools],
        edge_shed=False)
    routes = {f"/{p}/": p for p in pools} | {"/": "priority-gate"}
    shaped = load_renderer("mesh").istio_gateway(text, istio_envoy_filters(),
                                                 route_names=routes)
    cfg = tmp_path / "envoy.yaml"
    cfg.write_text(shaped, encoding="utf-8")
    out = subprocess.run([str(envoy), "--mode", "validate", "-c", str(cfg),
                          "--disable-hot-restart", "--log-level", "warn"],
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stdout + out.stderr


def test_istio_tenant_header_is_verified_and_client_copies_removed() -> None:
    header = _tenant_header()
    (rule,) = _one(ISTIO, "RequestAuthentication")["spec"]["jwtRules"]
    assert [h["header"] for h in rule["outputClaimToHeaders"]] == [header]
    strip = _one(ISTIO, "EnvoyFilter", "priority-gate-strip-client-headers")
    (cp,) = strip["spec"]["configPatches"]
    assert cp["patch"]["operation"] == "INSERT_FIRST"  # before jwt_authn writes the header
    removed = {m["remove"] for m in
               cp["patch"]["value"]["typed_config"]["mutations"]["request_mutations"]}
    assert {header, "x-smg-admission-id"} <= removed


def test_istio_ext_proc_skips_what_the_bootstrap_skips() -> None:
    """No stream where ext_authz did not admit, nor for an allow with preemptible: false."""
    (value,) = _patch_values(_one(ISTIO, "EnvoyFilter", "priority-gate-ext-proc"))
    want = _template_ext_proc_filter()["typed_config"]
    assert value["typed_config"]["@type"] == want["@type"]
    assert value["typed_config"]["xds_matcher"] == want["xds_matcher"]
    assert sorted(_skip_inputs(value["typed_config"])) == [
        (["admission_id"], ({"present_match": True}, True)),
        (["preemptible"], ({"bool_match": False}, False))]


def test_istio_ext_proc_filter_passes_envoy_validate(tmp_path: Path) -> None:
    """The EnvoyFilter's value, put where the bootstrap has its ext_proc, is valid Envoy
    config (istiod inserts it as is; only the cluster name is Istio's)."""
    envoy = _envoy_bin()
    if envoy is None:
        pytest.skip("no Envoy binary (set ENVOY_BIN or run `make envoy`)")
    (value,) = _patch_values(_one(ISTIO, "EnvoyFilter", "priority-gate-ext-proc"))
    inner = _unwrap(value["typed_config"])
    inner["grpc_service"]["envoy_grpc"]["cluster_name"] = "sidecar"  # the bootstrap's
    bootstrap = _envoy_bootstrap()
    _template_ext_proc_filter(bootstrap).update(value)
    cfg = tmp_path / "envoy.yaml"
    cfg.write_text(yaml.safe_dump(bootstrap), encoding="utf-8")
    out = subprocess.run([str(envoy), "--mode", "validate", "-c", str(cfg),
                          "--disable-hot-restart", "--log-level", "warn"],
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stdout + out.stderr


def test_istio_ext_proc_is_ordered_by_the_router_alone() -> None:
    """istiod puts the router last; INSERT_BEFORE the router, applied after ext_authz's
    (a higher priority), is what places ext_proc after ext_authz. filterClass is accepted
    by the CRD but read by no istiod code, so none of the recipe's EnvoyFilters may rely
    on it."""
    filt = _one(ISTIO, "EnvoyFilter", "priority-gate-ext-proc")
    (cp,) = filt["spec"]["configPatches"]
    assert cp["applyTo"] == "HTTP_FILTER"
    assert cp["patch"]["operation"] == "INSERT_BEFORE"
    assert cp["match"]["listener"]["filterChain"]["filter"]["subFilter"]["name"] == (
        "envoy.filters.http.router")
    for path in sorted(ISTIO.rglob("*.yaml")):
        for doc in (_docs(path) if not path.name.endswith(".values.yaml") else []):
            if doc.get("kind") == "EnvoyFilter":
                for patch in doc["spec"]["configPatches"]:
                    assert "filterClass" not in patch["patch"], f"{path.name}: filterClass"


def test_istio_ext_proc_matches_the_bootstrap() -> None:
    (value,) = _patch_values(_one(ISTIO, "EnvoyFilter", "priority-gate-ext-proc"))
    cfg = _unwrap(value["typed_config"])
    want = _template_ext_proc()
    for key in ("processing_mode", "metadata_options", "message_timeout", "failure_mode_allow"):
        assert cfg[key] == want[key], key
    assert EXT_AUTHZ_NS in cfg["metadata_options"]["forwarding_namespaces"]["untyped"]
    assert "timeout" not in cfg["grpc_service"]  # the stream lives as long as the request
    assert cfg["grpc_service"]["envoy_grpc"]["cluster_name"] == (
        f"outbound|{_grpc_port()}||priority-gate.local")


def test_istio_als_tuning() -> None:
    (hcm,) = _patch_values(_one(ISTIO, "EnvoyFilter", "priority-gate-als-tuning"))
    assert _secs(hcm["typed_config"]["access_log_options"]["access_log_flush_interval"]) > 0
    (value,) = _patch_values(_one(ISTIO / "unbuffered-als", "EnvoyFilter"))
    (logger,) = value["typed_config"]["access_log"]
    common = logger["typed_config"]["common_config"]
    assert common["buffer_size_bytes"] == 0
    assert common["log_name"] == _istio_providers()["priority-gate-als"]["envoyHttpAls"]["logName"]
    assert logger["filter"]["metadata_filter"]["matcher"]["filter"] == EXT_AUTHZ_NS


# ----------------------------------------------------------------------- Envoy Gateway


def test_eg_backend_is_the_sidecar() -> None:
    (ep,) = _one(EG, "Backend")["spec"]["endpoints"]
    assert ep["ip"] == {"address": "127.0.0.1", "port": _grpc_port()}


def test_eg_ext_auth_matches_the_sidecar() -> None:
    ext_auth = _one(EG, "SecurityPolicy")["spec"]["extAuth"]
    assert ext_auth["timeout"] == _authz_timeout()
    assert ext_auth["failOpen"] is False
    assert ext_auth["statusOnError"] == 503
    (ref,) = ext_auth["grpc"]["backendRefs"]
    assert (ref["kind"], ref["port"]) == ("Backend", _grpc_port())
    breaker = ext_auth["grpc"]["backendSettings"]["circuitBreaker"]
    # every queued Check is one parallel request: above EG's default and the sidecar's cap
    floor = max(DEFAULT_EG_CIRCUIT_BREAKER, int(_arg(_sidecar(), "--max-concurrent-requests")))
    assert breaker["maxParallelRequests"] > floor
    assert breaker["maxPendingRequests"] > floor


def test_eg_ext_proc_matches_the_bootstrap() -> None:
    (ext_proc,) = _one(EG, "EnvoyExtensionPolicy")["spec"]["extProc"]
    want = _template_ext_proc()
    assert ext_proc["messageTimeout"] == want["message_timeout"]
    assert ext_proc["failOpen"] is want["failure_mode_allow"]
    assert EXT_AUTHZ_NS in ext_proc["metadata"]["accessibleNamespaces"]
    # headers only, both directions (bodies stay out of Python)
    assert ext_proc["processingMode"] == {"request": {}, "response": {}}


def test_eg_filter_order_and_tenant() -> None:
    proxy = _one(EG, "EnvoyProxy")
    assert {"name": "envoy.filters.http.jwt_authn",
            "before": "envoy.filters.http.ext_authz"} in proxy["spec"]["filterOrder"]
    (provider,) = _one(EG, "SecurityPolicy")["spec"]["jwt"]["providers"]
    assert [h["header"] for h in provider["claimToHeaders"]] == [_tenant_header()]
    (container,) = _dig(proxy, "spec.provider.kubernetes.envoyDeployment.patch.value.spec"
                               ".template.spec.containers")
    for flag in ("--grpc-listen", "--envoy-authz-timeout", "--tenant-source"):
        assert _arg(container, flag) == _arg(_sidecar(), flag), flag


def test_eg_access_log_sink_and_tuning() -> None:
    (setting,) = _one(EG, "EnvoyProxy")["spec"]["telemetry"]["accessLog"]["settings"]
    (sink,) = setting["sinks"]
    assert sink["type"] == "ALS"
    assert sink["als"]["type"] == "HTTP"
    assert sink["als"]["backendRefs"][0]["kind"] == "Backend"
    assert any("admission_id" in m for m in setting["matches"])
    patches = {p["operation"]["path"].rsplit("/", 1)[-1]: p["operation"]["value"]
               for p in _one(EG, "EnvoyPatchPolicy")["spec"]["jsonPatches"]}
    assert _secs(patches["access_log_options"]["access_log_flush_interval"]) > 0
    assert patches["buffer_size_bytes"] == 0


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed")
def test_eg_pools_each_route_has_a_policy_naming_its_pool(tmp_path: Path) -> None:
    """k8s/overlays/envoy-gateway-pools: one HTTPRoute and one SecurityPolicy per pool, the
    policy the base's but for the pool in extAuth.contextExtensions; ext_proc and retries on
    every route; the sidecar's --worker-urls those of k8s/overlays/pools, accepted by the
    sidecar with that overlay's priority.yaml."""
    from sidecar.config import build_parser, settings_from_args

    docs = _build("overlays/envoy-gateway-pools")
    routes = {d["metadata"]["name"]: d for d in docs if d["kind"] == "HTTPRoute"}
    base = _one(EG, "SecurityPolicy")
    pools: dict[str, str] = {}
    for policy in (d for d in docs if d["kind"] == "SecurityPolicy"):
        if policy["metadata"]["name"] == base["metadata"]["name"]:
            assert policy["spec"] == base["spec"]
            continue
        spec = copy.deepcopy(policy["spec"])
        (ext,) = spec["extAuth"].pop("contextExtensions")
        assert (ext["name"], ext["type"]) == ("smg-pool", "Value")
        assert spec["extAuth"] == base["spec"]["extAuth"] and spec["jwt"] == base["spec"]["jwt"]
        (ref,) = spec["targetRefs"]
        assert ref["kind"] == "HTTPRoute" and ref["name"] in routes
        pools[ext["value"]] = ref["name"]
    assert sorted(pools) == _overlay_pools()
    assert sorted(pools.values()) == sorted(routes)  # one policy per route
    for pool, name in pools.items():
        (rule,) = routes[name]["spec"]["rules"]
        (match,) = rule["matches"]
        assert match["path"] == {"type": "PathPrefix", "value": f"/{pool}/"}
    for kind in ("EnvoyExtensionPolicy", "BackendTrafficPolicy"):
        (policy,) = [d for d in docs if d["kind"] == kind]
        assert set(routes) <= {r["name"] for r in policy["spec"]["targetRefs"]}, kind
    (proxy,) = [d for d in docs if d["kind"] == "EnvoyProxy"]
    (container,) = _dig(proxy, "spec.provider.kubernetes.envoyDeployment.patch.value.spec"
                               ".template.spec.containers")
    args = list(container["args"])
    overlay = (K8S / "overlays" / "pools" / "kustomization.yaml").read_text(encoding="utf-8")
    urls = args[args.index("--worker-urls") + 1:]
    assert urls == [u for u in (line.split("value: ", 1)[-1] for line in overlay.splitlines())
                    if "=http" in u and not u.startswith("#")]
    (cm,) = [d for d in _build("overlays/pools") if d["metadata"]["name"] ==
             "priority-gate-config"]
    cfg = tmp_path / "priority.yaml"
    cfg.write_text(cm["data"]["priority.yaml"], encoding="utf-8")
    args[args.index("--priority-scheduler-config") + 1] = str(cfg)
    settings = settings_from_args(build_parser().parse_args(args), isatty=False)
    assert sorted(settings.pool_workers) == sorted(settings.priority.pools) == sorted(pools)


def _rendered_edge() -> dict[str, Any]:
    from devtools.stack import load_renderer
    boot: dict[str, Any] = yaml.safe_load(load_renderer().render(
        listen_port=10000, admin_port=9901, sidecar_host="127.0.0.1",
        sidecar_port=_grpc_port(), workers=[("127.0.0.1", 8000)], authz_timeout_secs=310,
        flush_interval_secs=5, edge_shed=True))
    return boot


def test_eg_edge_shed_is_the_bootstraps_edge_path() -> None:
    """k8s/overlays/envoy-gateway-edge-shed: the route, the counting logger and the runtime
    layers, and the buffer filter the edge route enables, are the bootstrap's (but for the
    cluster, the static one the merge adds, and the route's ext_authz override, which EG's
    per-route-enabled filters do not need), on the
    listener the recipe's own patch names."""
    from tests.test_mesh_e2e import eg_edge_pieces

    merge_text, policies = eg_edge_pieces()
    merge = yaml.safe_load(merge_text)
    (cluster,) = merge["static_resources"]["clusters"]
    (lb,) = cluster["load_assignment"]["endpoints"]
    (ep,) = lb["lb_endpoints"]
    addr = ep["endpoint"]["address"]["socket_address"]
    assert (addr["address"], addr["port_value"]) == ("127.0.0.1", _grpc_port())
    boot = _rendered_edge()
    layers = copy.deepcopy(merge["layered_runtime"])
    (rtds,) = layers["layers"][1]["rtds_layer"]["rtds_config"]["api_config_source"][
        "grpc_services"]
    assert rtds["envoy_grpc"]["cluster_name"] == cluster["name"]
    rtds["envoy_grpc"]["cluster_name"] = "sidecar"
    assert layers == boot["layered_runtime"]
    (listener,) = boot["static_resources"]["listeners"]
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    want_route = copy.deepcopy(hcm["route_config"]["virtual_hosts"][0]["routes"][0])
    assert want_route["typed_per_filter_config"][EXT_AUTHZ_NS]["disabled"] is True
    del want_route["typed_per_filter_config"][EXT_AUTHZ_NS]
    (want_buffer,) = [f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.buffer"]
    (want_logger,) = [lg for lg in hcm["access_log"]
                      if lg["typed_config"]["common_config"]["log_name"] ==
                      "priority-gate-edge-shed"]
    base_policy, edge_policy = policies
    assert edge_policy["spec"]["targetRef"] == base_policy["spec"]["targetRef"]
    route_patch, buffer_patch, logger_patch = edge_policy["spec"]["jsonPatches"]
    assert {route_patch["name"], logger_patch["name"]} == {
        p["name"] for p in base_policy["spec"]["jsonPatches"]}
    assert route_patch["operation"]["value"] == want_route
    # The edge route reads the body first: the buffer filter, off but on that route.
    assert buffer_patch["name"] == logger_patch["name"]
    assert buffer_patch["operation"]["value"] == want_buffer
    logger = copy.deepcopy(logger_patch["operation"]["value"])
    grpc = logger["typed_config"]["common_config"]["grpc_service"]["envoy_grpc"]
    assert grpc["cluster_name"] == cluster["name"]
    grpc["cluster_name"] = "sidecar"
    assert logger == want_logger


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed")
def test_eg_edge_shed_overlay_turns_the_sidecar_on(tmp_path: Path) -> None:
    from sidecar.config import build_parser, settings_from_args

    docs = _build("overlays/envoy-gateway-edge-shed")
    (proxy,) = [d for d in docs if d["kind"] == "EnvoyProxy"]
    assert proxy["spec"]["bootstrap"]["type"] == "Merge"
    (container,) = _dig(proxy, "spec.provider.kubernetes.envoyDeployment.patch.value.spec"
                               ".template.spec.containers")
    args = list(container["args"])
    assert "--edge-shed" in args
    cfg = tmp_path / "priority.yaml"
    cfg.write_text(_priority_text(), encoding="utf-8")
    args[args.index("--priority-scheduler-config") + 1] = str(cfg)
    assert settings_from_args(build_parser().parse_args(args), isatty=False).edge_shed
    assert sorted(d["metadata"]["name"] for d in docs if d["kind"] == "EnvoyPatchPolicy") == [
        "priority-gate-als-tuning", "priority-gate-edge-shed"]


def test_eg_edge_shed_passes_envoy_validate_on_an_eg_shaped_proxy(tmp_path: Path) -> None:
    """The merge and every EnvoyPatchPolicy applied (envoy/mesh.py envoy_gateway) to the
    proxy config EG generates: Envoy accepts the result."""
    envoy = _envoy_bin()
    if envoy is None:
        pytest.skip("no Envoy binary (set ENVOY_BIN or run `make envoy`)")
    from devtools.stack import load_renderer
    from tests.test_mesh_e2e import eg_edge_pieces

    merge, policies = eg_edge_pieces()
    text = load_renderer().render(
        listen_port=10000, admin_port=9901, sidecar_host="127.0.0.1", sidecar_port=9001,
        workers=[("127.0.0.1", 8000)], authz_timeout_secs=310, flush_interval_secs=5,
        edge_shed=False)
    cfg = tmp_path / "envoy.yaml"
    cfg.write_text(load_renderer("mesh").envoy_gateway(
        text, bootstrap_merge=merge, patch_policies=policies), encoding="utf-8")
    out = subprocess.run([str(envoy), "--mode", "validate", "-c", str(cfg),
                          "--disable-hot-restart", "--log-level", "warn"],
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stdout + out.stderr


# ------------------------------------------------------------------------------- CRDs


def _crd_schemas_in(directory: Path) -> dict[tuple[str, str], dict[str, Any]]:
    """(apiVersion, kind) -> openAPIV3Schema of every served version in DIR's YAML files
    (not its subfolders')."""
    schemas: dict[tuple[str, str], dict[str, Any]] = {}
    for path in sorted(directory.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")):
            if not isinstance(doc, dict) or doc.get("kind") != "CustomResourceDefinition":
                continue
            spec = doc["spec"]
            for version in spec["versions"]:
                if version.get("served"):
                    schemas[(f"{spec['group']}/{version['name']}", spec["names"]["kind"])] = \
                        version["schema"]["openAPIV3Schema"]
    return schemas


def _strict(schema: Any) -> Any:
    """The schema with unknown fields refused below the root, as the API server's strict
    field validation does (except where the CRD preserves unknown fields)."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: (v if k.startswith("x-kubernetes") else _strict(v)) for k, v in schema.items()}
    if (out.get("type") == "object" and "properties" in out
            and not out.get("x-kubernetes-preserve-unknown-fields")
            and "additionalProperties" not in out):
        out["additionalProperties"] = False
    return out


def test_recipes_validate_against_the_crds() -> None:
    """With MESH_CRDS=DIR (the upstream CRDs' YAML, a folder per release or any layout):
    every recipe resource validates against its CRD's schema in each folder that has it,
    unknown fields refused."""
    crds = os.environ.get("MESH_CRDS")
    if not crds:
        pytest.skip("set MESH_CRDS to a directory of the Istio / Envoy Gateway CRDs")
    jsonschema = pytest.importorskip("jsonschema")
    # One schema set per folder: two releases of one CRD must not overwrite each other.
    releases = [_crd_schemas_in(folder) for folder in
                sorted({p.parent for p in Path(crds).rglob("*.yaml")})]
    checked = 0
    for directory in (ISTIO, EG, EG_POOLS, EG_EDGE):
        for path in sorted(directory.rglob("*.yaml")):
            if path.name == "kustomization.yaml" or path.name.endswith(".values.yaml"):
                continue
            for doc in _docs(path):
                for schemas in releases:
                    schema = schemas.get((doc["apiVersion"], doc["kind"]))
                    if schema is None:
                        continue  # a core kind, or CRDs of the other mesh only
                    body = {k: v for k, v in doc.items()
                            if k in schema.get("properties", {}) or k == "spec"}
                    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in
                              jsonschema.Draft7Validator(_strict(schema)).iter_errors(body)]
                    assert not errors, f"{path.relative_to(K8S)}: {errors}"
                    checked += 1
    assert checked, f"no recipe resource has a CRD in {crds}"
