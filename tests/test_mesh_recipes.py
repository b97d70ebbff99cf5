"""Offline checks of the mesh recipes (k8s/istio/, k8s/envoy-gateway/).

No cluster: the recipes are parsed and compared with what the sidecar is actually run with
(k8s/base/deployment.yaml's flags, configmap-priority.yaml's queue timeouts) and with the
hand-written bootstrap's ext_proc settings (envoy/envoy.yaml.tmpl), so a change of port,
timeout or tenant header on one side fails here until the recipes follow.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from sidecar.config import parse_priority_config
from tests.test_k8s import (
    K8S,
    _arg,
    _dig,
    _docs,
    _envoy_bin,
    _envoy_bootstrap,
    _priority_text,
    _sidecar,
)

ISTIO = K8S / "istio"
EG = K8S / "envoy-gateway"
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
    assert source.startswith("header:")  # jwt: cannot work under Istio's CUSTOM ext_authz
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


def test_istio_ext_authz_provider_matches_the_sidecar() -> None:
    authz = _istio_providers()["priority-gate"]["envoyExtAuthzGrpc"]
    assert authz["port"] == _grpc_port()
    assert authz["timeout"] == _authz_timeout()
    assert _secs(authz["timeout"]) > parse_priority_config(_priority_text()).max_queue_timeout()
    assert authz["failOpen"] is False
    assert authz["statusOnError"] == "503"
    entry = _one(ISTIO, "ServiceEntry")
    assert authz["service"] in entry["spec"]["hosts"]
    assert [e["address"] for e in entry["spec"]["endpoints"]] == ["127.0.0.1"]
    ports = [(p["number"], p["protocol"]) for p in entry["spec"]["ports"]]
    assert ports == [(_grpc_port(), "GRPC")]


def test_istio_policy_and_telemetry_name_the_providers() -> None:
    providers = _istio_providers()
    policy = _one(ISTIO, "AuthorizationPolicy")
    assert policy["spec"]["action"] == "CUSTOM"
    assert "envoyExtAuthzGrpc" in providers[policy["spec"]["provider"]["name"]]
    assert policy["spec"]["rules"], "Check must be limited to the inference paths"
    (logging,) = _one(ISTIO, "Telemetry")["spec"]["accessLogging"]
    (als_ref,) = logging["providers"]
    als = providers[als_ref["name"]]["envoyHttpAls"]
    assert als["port"] == _grpc_port()
    assert als["service"] == providers["priority-gate"]["envoyExtAuthzGrpc"]["service"]


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
    """istiod puts the router last and the CUSTOM ext_authz before it; INSERT_BEFORE the
    router is what places ext_proc after ext_authz. filterClass is accepted by the CRD but
    read by no istiod code, so none of the recipe's EnvoyFilters may rely on it."""
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


# ------------------------------------------------------------------------------- CRDs


def _crd_schemas(directory: Path) -> dict[tuple[str, str], dict[str, Any]]:
    """(apiVersion, kind) -> openAPIV3Schema of every served version in DIR's YAML files."""
    schemas: dict[tuple[str, str], dict[str, Any]] = {}
    for path in sorted(directory.rglob("*.yaml")):
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
    """With MESH_CRDS=DIR (the upstream CRDs' YAML, any layout): every recipe resource
    validates against its CRD's schema, unknown fields refused."""
    crds = os.environ.get("MESH_CRDS")
    if not crds:
        pytest.skip("set MESH_CRDS to a directory of the Istio / Envoy Gateway CRDs")
    jsonschema = pytest.importorskip("jsonschema")
    schemas = _crd_schemas(Path(crds))
    checked = 0
    for directory in (ISTIO, EG):
        for path in sorted(directory.rglob("*.yaml")):
            if path.name == "kustomization.yaml" or path.name.endswith(".values.yaml"):
                continue
            for doc in _docs(path):
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
