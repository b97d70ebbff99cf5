"""Offline checks of the Kubernetes deliverables: k8s/, the dashboard, the Dockerfile.

No cluster and no network: manifests are validated against the Kubernetes OpenAPI
schemas bundled with ``kubernetes-validate``; the embedded priority.yaml and
envoy.yaml are checked with the real ``--check-config`` and ``envoy --mode validate``.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "k8s"
SCHEMA_VERSIONS = ("1.31", "1.33")  # native sidecars: GA in 1.33, on by default since 1.29
CRD_REQUIRED: dict[str, tuple[str, tuple[str, ...]]] = {
    # kind -> (apiVersion, required dotted paths): CRDs have no bundled schema. The mesh
    # recipes' own consistency checks live in tests/test_mesh_recipes.py.
    "ServiceMonitor": ("monitoring.coreos.com/v1",
                       ("metadata.name", "spec.selector", "spec.endpoints")),
    "PrometheusRule": ("monitoring.coreos.com/v1", ("metadata.name", "spec.groups")),
    "ServiceEntry": ("networking.istio.io/v1", ("spec.hosts", "spec.endpoints", "spec.ports")),
    "AuthorizationPolicy": ("security.istio.io/v1", ("spec.action", "spec.provider.name")),
    "RequestAuthentication": ("security.istio.io/v1", ("spec.jwtRules",)),
    "Telemetry": ("telemetry.istio.io/v1", ("spec.accessLogging",)),
    "EnvoyFilter": ("networking.istio.io/v1alpha3", ("spec.configPatches",)),
    "VirtualService": ("networking.istio.io/v1", ("spec.hosts", "spec.http")),
    "HTTPRoute": ("gateway.networking.k8s.io/v1", ("spec.parentRefs", "spec.rules")),
    "Backend": ("gateway.envoyproxy.io/v1alpha1", ("spec.endpoints",)),
    "EnvoyProxy": ("gateway.envoyproxy.io/v1alpha1", ("spec.telemetry.accessLog",)),
    "SecurityPolicy": ("gateway.envoyproxy.io/v1alpha1", ("spec.targetRefs", "spec.extAuth.grpc")),
    "EnvoyExtensionPolicy": ("gateway.envoyproxy.io/v1alpha1", ("spec.targetRefs", "spec.extProc")),
    "BackendTrafficPolicy": ("gateway.envoyproxy.io/v1alpha1",
                             ("spec.targetRefs", "spec.retry.retryOn.triggers")),
    "EnvoyPatchPolicy": ("gateway.envoyproxy.io/v1alpha1",
                         ("spec.targetRef", "spec.type", "spec.jsonPatches")),
    "HTTPRouteFilter": ("gateway.envoyproxy.io/v1alpha1",
                        ("spec.credentialInjection.credential.valueRef.name",)),
}


def _manifest_files() -> list[Path]:
    # *.values.yaml: Helm values (k8s/istio's meshConfig); *.test.yaml: promtool unit tests
    # (tests/test_alerts.py). Neither is a manifest.
    return sorted(
        p for p in K8S.rglob("*.yaml")
        if p.name != "kustomization.yaml" and not p.name.endswith((".values.yaml", ".test.yaml"))
    )


def _docs(path: Path) -> list[dict[str, Any]]:
    docs = [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d is not None]
    assert docs, f"{path}: no YAML documents"
    for d in docs:
        assert isinstance(d, dict), f"{path}: a document is not a mapping"
    return docs


def _all_docs() -> Iterator[tuple[Path, dict[str, Any]]]:
    for path in _manifest_files():
        for doc in _docs(path):
            yield path, doc


def _find(kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for _, d in _all_docs()
             if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def _dig(doc: dict[str, Any], dotted: str) -> Any:
    cur: Any = doc
    for part in dotted.split("."):
        assert isinstance(cur, dict) and part in cur, f"missing {dotted}"
        cur = cur[part]
    return cur


def _deployment() -> dict[str, Any]:
    return _find("Deployment", "priority-gate")


def _pod() -> dict[str, Any]:
    pod: dict[str, Any] = _deployment()["spec"]["template"]["spec"]
    return pod


def _sidecar() -> dict[str, Any]:
    (c,) = [c for c in _pod().get("initContainers", []) if c["name"] == "sidecar"]
    container: dict[str, Any] = c
    return container


def _envoy() -> dict[str, Any]:
    (c,) = [c for c in _pod()["containers"] if c["name"] == "envoy"]
    container: dict[str, Any] = c
    return container


def _valkey() -> dict[str, Any]:
    (c,) = _find("Deployment", "priority-gate-valkey")["spec"]["template"]["spec"]["containers"]
    container: dict[str, Any] = c
    return container


def _expanded_args(container: dict[str, Any]) -> list[str]:
    """The container's args as the kubelet passes them: ``$(VAR)`` replaced by the
    container's env (a downward-API field gets a plausible pod name)."""
    env: dict[str, str] = {}
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = e["value"]
        elif e["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name":
            env[e["name"]] = "priority-gate-7d9f8b6c5-x2x4q"
    return [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in container["args"]]


def _local_password_file(args: list[str], tmp_path: Path) -> None:
    """Point --coordination-password-file (a mounted Secret in the pod) at a local file."""
    if "--coordination-password-file" in args:
        pw = tmp_path / "coordination-password"
        pw.write_text("from-the-secret\n")
        args[args.index("--coordination-password-file") + 1] = str(pw)


def _arg(container: dict[str, Any], flag: str) -> str:
    args: list[str] = container["args"]
    assert flag in args, f"{container['name']}: {flag} missing"
    return args[args.index(flag) + 1]


# ------------------------------------------------------------------- manifests


def test_kustomizations_list_existing_files() -> None:
    kfiles = sorted(K8S.rglob("kustomization.yaml"))
    assert K8S / "kustomization.yaml" in kfiles
    assert K8S / "overlays" / "servicemonitor" / "kustomization.yaml" in kfiles
    assert K8S / "overlays" / "single-replica" / "kustomization.yaml" in kfiles
    listed: set[Path] = set()
    for kf in kfiles:
        doc = yaml.safe_load(kf.read_text(encoding="utf-8"))
        assert doc["kind"] == "Kustomization"
        for res in doc.get("resources", []):
            target = (kf.parent / res).resolve()
            assert target.exists(), f"{kf}: resource {res} does not exist"
            if target.is_dir():
                assert (target / "kustomization.yaml").exists(), f"{kf}: {res} has no kustomization"
            else:
                listed.add(target)
    unlisted = set(_manifest_files()) - listed
    assert not unlisted, f"manifests not in any kustomization: {sorted(map(str, unlisted))}"


@pytest.mark.parametrize("path", _manifest_files(), ids=lambda p: str(p.relative_to(K8S)))
def test_manifest_validates_against_openapi_schema(path: Path) -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    for doc in _docs(path):
        for key in ("apiVersion", "kind", "metadata"):
            assert key in doc, f"{path}: {key} missing"
        if doc["kind"] in CRD_REQUIRED:
            api_version, required = CRD_REQUIRED[doc["kind"]]
            assert doc["apiVersion"] == api_version
            for dotted in required:
                assert _dig(doc, dotted), f"{path}: {dotted} empty"
            continue
        for version in SCHEMA_VERSIONS:
            # strict: unknown fields (typos) are errors too
            kubernetes_validate.validate(doc, version, strict=True)


def test_servicemonitor_selects_the_metrics_service() -> None:
    sm = _find("ServiceMonitor")
    svc = _find("Service", "priority-gate-metrics")
    selector = sm["spec"]["selector"]["matchLabels"]
    assert selector.items() <= svc["metadata"]["labels"].items()
    ports = {p["name"] for p in svc["spec"]["ports"]}
    for ep in sm["spec"]["endpoints"]:
        assert ep["port"] in ports
        assert ep.get("path", "/metrics") == "/metrics"


def test_networkpolicy_admits_only_prometheus_to_the_admin_port() -> None:
    pol = _find("NetworkPolicy", "priority-gate")["spec"]
    assert pol["policyTypes"] == ["Ingress"]
    ports = {p["name"]: p["containerPort"]
             for c in [*_pod().get("initContainers", []), *_pod()["containers"]]
             for p in c.get("ports", [])}
    assert ports == {"metrics": 9090, "http": 10000}  # every port the pod exposes has a rule
    by_port: dict[int, list[dict[str, Any]]] = {}
    for rule in pol["ingress"]:
        for p in rule["ports"]:
            assert p["protocol"] == "TCP"
            by_port.setdefault(ports[p["port"]], []).append(rule)
    # The inference listener stays open (no "from": every source).
    assert [r.get("from") for r in by_port[10000]] == [None]
    # 9090: one rule, whose only peer is Prometheus pods (namespace AND pod selector).
    (metrics_rule,) = by_port[9090]
    (peer,) = metrics_rule["from"]
    assert set(peer) == {"namespaceSelector", "podSelector"}
    assert peer["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "prometheus"}
    assert "ipBlock" not in peer


def test_selectors_match_pod_labels() -> None:
    pods = {d["metadata"]["name"]: d["spec"]["template"]["metadata"]["labels"]
            for _, d in _all_docs() if d["kind"] == "Deployment"}
    assert set(pods) == {"priority-gate", "priority-gate-valkey", "priority-gate-ledger-loader"}
    for name, labels in pods.items():
        assert _find("Deployment", name)["spec"]["selector"]["matchLabels"].items() \
            <= labels.items()
    gate = pods["priority-gate"]
    for sel in (_find("PodDisruptionBudget")["spec"]["selector"]["matchLabels"],
                _find("NetworkPolicy", "priority-gate")["spec"]["podSelector"]["matchLabels"]):
        assert sel.items() <= gate.items()
    valkey_policy = _find("NetworkPolicy", "priority-gate-valkey")["spec"]
    assert valkey_policy["podSelector"]["matchLabels"].items() \
        <= pods["priority-gate-valkey"].items()
    # every Service selects the pods of exactly one Deployment
    for _, svc in _all_docs():
        if svc["kind"] == "Service":
            sel = svc["spec"]["selector"]
            matched = [n for n, labels in pods.items() if sel.items() <= labels.items()]
            assert len(matched) == 1, (svc["metadata"]["name"], matched)


_BASE_KINDS = ["ConfigMap", "ConfigMap", "ConfigMap", "Deployment", "Deployment",
               "Deployment", "NetworkPolicy", "NetworkPolicy", "PodDisruptionBudget", "Service",
               "Service"]


def _build(target: str) -> list[dict[str, Any]]:
    out = subprocess.run(["kubectl", "kustomize", str(K8S / target)], capture_output=True,
                         text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def _built_sidecar(docs: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the gateway Deployment, its sidecar container) from a kustomize build."""
    (dep,) = [d for d in docs
              if d["kind"] == "Deployment" and d["metadata"]["name"] == "priority-gate"]
    (c,) = dep["spec"]["template"]["spec"]["initContainers"]
    return dep, c


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed")
@pytest.mark.parametrize("target,want", [
    ("", _BASE_KINDS),
    ("overlays/servicemonitor", sorted([*_BASE_KINDS, "PrometheusRule", "Service",
                                        "ServiceMonitor"])),
    ("overlays/single-replica", ["ConfigMap", "ConfigMap", "Deployment", "NetworkPolicy",
                                 "Service"]),
    ("overlays/pools", _BASE_KINDS),  # two replicas on the fleet ledger, a ledger per pool
    ("overlays/no-edge-shed", _BASE_KINDS),  # the opt-out: no edge path on either side
    ("overlays/engine-key", _BASE_KINDS),  # the engine's key upstream and on the probes
])
def test_kustomize_builds(target: str, want: list[str], tmp_path: Path) -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    from sidecar.config import build_parser, settings_from_args

    docs = _build(target)
    assert sorted(d["kind"] for d in docs) == want
    for d in docs:
        if d["kind"] not in CRD_REQUIRED:
            kubernetes_validate.validate(d, SCHEMA_VERSIONS[0], strict=True)
    # the built sidecar's flags pass the sidecar's own validation
    dep, sidecar = _built_sidecar(docs)
    (cm,) = [d for d in docs if d["metadata"]["name"] == "priority-gate-config"]
    cfg = tmp_path / "priority.yaml"
    cfg.write_text(cm["data"]["priority.yaml"], encoding="utf-8")
    args = _expanded_args(sidecar)
    args[args.index("--priority-scheduler-config") + 1] = str(cfg)
    _local_password_file(args, tmp_path)
    if "--worker-auth-file" in args:  # the mounted Secret, here a local file
        key = tmp_path / "api-key"
        key.write_text("engine-key")
        args[args.index("--worker-auth-file") + 1] = str(key)
    settings = settings_from_args(build_parser().parse_args(args), isatty=False)
    # Both sides of edge shedding, or neither: the sidecar's switch and Envoy's edge path.
    boot = _built_envoy(docs)
    assert settings.edge_shed == ("layered_runtime" in boot) == (
        target != "overlays/no-edge-shed"), target
    if target.startswith("overlays/pools"):
        # the pools the routes name are the sidecar's, each with its own workers and table
        assert set(settings.pool_workers) == set(settings.priority.pools) == set(
            _route_pools(_built_envoy(docs)))
    if target == "overlays/single-replica":
        # one replica, admitting in-process: no server to point at
        assert dep["spec"]["replicas"] == 1
        assert settings.coordination_url is None
        assert "--coordination-url" not in sidecar["args"]
        assert "--coordination-password-file" not in sidecar["args"]
    else:
        assert dep["spec"]["replicas"] == 2
        assert settings.coordination_url == "redis://priority-gate@priority-gate-valkey:6379/0"
        assert settings.coordination_password == "from-the-secret"


def _built_envoy(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (cm,) = [d for d in docs if d["metadata"]["name"] == "priority-gate-envoy"]
    boot: dict[str, Any] = yaml.safe_load(cm["data"]["envoy.yaml"])
    return boot


def _route_pools(boot: dict[str, Any]) -> dict[str, str]:
    """pool -> the cluster of the route that names it (ext_authz's smg-pool)."""
    (listener,) = boot["static_resources"]["listeners"]
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    out: dict[str, str] = {}
    for vhost in hcm["route_config"]["virtual_hosts"]:
        for route in vhost["routes"]:
            per_route = route.get("typed_per_filter_config", {}).get(
                "envoy.filters.http.ext_authz", {})
            pool = per_route.get("check_settings", {}).get("context_extensions", {}).get(
                "smg-pool")
            if pool is not None:
                out[pool] = route["route"]["cluster"]
    return out


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed")
def test_pools_overlay_routes_each_pool_to_the_workers_its_sidecar_probes(
        tmp_path: Path) -> None:
    """Two model pools on one gateway: each route names its pool, its cluster holds exactly
    the workers the sidecar probes for that pool, and Envoy accepts the whole bootstrap."""
    from sidecar.config import split_worker_urls

    docs = _build("overlays/pools")
    boot = _built_envoy(docs)
    _, sidecar = _built_sidecar(docs)
    args = sidecar["args"]
    urls = args[args.index("--worker-urls") + 1:]
    _, pool_workers = split_worker_urls(urls)
    routes = _route_pools(boot)
    assert len(routes) == 2 and set(routes) == set(pool_workers)
    clusters = {c["name"]: c for c in boot["static_resources"]["clusters"]}
    for pool, cluster in routes.items():
        eps = [e["endpoint"]["address"]["socket_address"]
               for lb in clusters[cluster]["load_assignment"]["endpoints"]
               for e in lb["lb_endpoints"]]
        assert [f"http://{a['address']}:{a['port_value']}" for a in eps] == list(
            pool_workers[pool]), pool
        assert clusters[cluster]["type"] == "STRICT_DNS"
    # the default pool keeps the base's workers cluster, read from Envoy's admin API
    assert _arg(sidecar, "--envoy-cluster") in clusters
    envoy = _envoy_bin()
    if envoy is None:
        pytest.skip("no Envoy binary (set ENVOY_BIN or run `make envoy`)")
    cfg = tmp_path / "envoy.yaml"
    cfg.write_text(yaml.safe_dump(boot), encoding="utf-8")
    out = subprocess.run([str(envoy), "--mode", "validate", "-c", str(cfg),
                          "--disable-hot-restart", "--log-level", "warn"],
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stdout + out.stderr


# ------------------------------------------------------------------- the pod


def test_sidecar_is_a_native_sidecar() -> None:
    pod = _pod()
    assert [c["name"] for c in pod["initContainers"]] == ["sidecar"]
    assert _sidecar()["restartPolicy"] == "Always"
    assert [c["name"] for c in pod["containers"]] == ["envoy"]
    assert _envoy()["image"] == "envoyproxy/envoy:v1.40.0"


def test_containers_are_locked_down() -> None:
    valkey_pod = _find("Deployment", "priority-gate-valkey")["spec"]["template"]["spec"]
    loader_pod = _loader_pod()
    for pod in (_pod(), valkey_pod, loader_pod):
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
        assert pod["automountServiceAccountToken"] is False
    for c in (_sidecar(), _envoy(), _valkey(), *valkey_pod["initContainers"],
              *loader_pod["containers"]):
        sc = c["securityContext"]
        assert sc["runAsNonRoot"] is True, c["name"]
        assert sc.get("runAsUser", 1) != 0, c["name"]
        assert sc["readOnlyRootFilesystem"] is True, c["name"]
        assert sc["allowPrivilegeEscalation"] is False, c["name"]
        assert sc["capabilities"]["drop"] == ["ALL"], c["name"]
        assert not sc["capabilities"].get("add"), c["name"]
        assert sc["seccompProfile"]["type"] == "RuntimeDefault", c["name"]
        res = c["resources"]
        assert res["requests"]["cpu"] and res["requests"]["memory"], c["name"]
        assert res["limits"]["cpu"] and res["limits"]["memory"], c["name"]


def test_sidecar_probes_and_listen_addresses() -> None:
    c = _sidecar()
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    http_host, _, http_port = _arg(c, "--http-listen").rpartition(":")
    # kubelet probes and Prometheus connect to the pod IP, not loopback
    assert http_host == "0.0.0.0"
    assert ports["metrics"] == int(http_port)
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert c["startupProbe"]["httpGet"]["path"] == "/healthz"
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert c[probe]["httpGet"]["port"] in (ports["metrics"], "metrics")
    ann = _deployment()["spec"]["template"]["metadata"]["annotations"]
    assert ann["prometheus.io/scrape"] == "true"
    assert ann["prometheus.io/port"] == http_port
    assert ann["prometheus.io/path"] == "/metrics"
    # the gRPC side is for the co-located Envoy only
    assert _arg(c, "--grpc-listen") == "127.0.0.1:9001"


def test_sidecar_args_parse_and_match_envoy() -> None:
    from sidecar.config import build_parser

    c = _sidecar()
    ns = build_parser().parse_args(_expanded_args(c))
    assert ns.priority_scheduler_enabled is True
    assert ns.priority_scheduler_config == "/etc/smg/priority.yaml"
    assert ns.envoy_admin_url == "http://127.0.0.1:9901"
    assert ns.envoy_cluster == "workers"
    assert ns.log_format == "json"
    # the config file sits in a directory-mounted ConfigMap (no subPath: hot reload)
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    mount = mounts[str(Path(ns.priority_scheduler_config).parent)]
    assert "subPath" not in mount
    vols = {v["name"]: v for v in _pod()["volumes"]}
    cm_name = vols[mount["name"]]["configMap"]["name"]
    assert Path(ns.priority_scheduler_config).name in _find("ConfigMap", cm_name)["data"]

    envoy = _envoy_bootstrap()
    assert f"127.0.0.1:{_admin_port(envoy)}" in ns.envoy_admin_url
    assert ns.envoy_cluster in {cl["name"] for cl in envoy["static_resources"]["clusters"]}
    authz = _authz_timeout_secs(envoy)
    assert ns.envoy_authz_timeout == authz
    # Envoy's ext_authz timeout must exceed every class queue_timeout_secs
    from sidecar.config import parse_priority_config

    assert authz > parse_priority_config(_priority_text()).max_queue_timeout()


def test_sidecar_settings_accept_the_deployment(tmp_path: Path) -> None:
    """The full flag set passes the sidecar's own validation (incl. the timeout rule)."""
    from sidecar.config import build_parser, settings_from_args

    cfg = tmp_path / "priority.yaml"
    cfg.write_text(_priority_text(), encoding="utf-8")
    args = _expanded_args(_sidecar())
    args[args.index("--priority-scheduler-config") + 1] = str(cfg)
    _local_password_file(args, tmp_path)
    settings = settings_from_args(build_parser().parse_args(args), isatty=False)
    assert settings.scheduler_enabled
    assert settings.http_listen == "0.0.0.0:9090"
    assert settings.replica_id == "priority-gate-7d9f8b6c5-x2x4q"


def test_replicas_share_the_shipped_valkey() -> None:
    """replicas: 2 is correct only because every sidecar points at one ledger."""
    assert _deployment()["spec"]["replicas"] == 2
    c = _sidecar()
    url = _arg(c, "--coordination-url")
    m = re.fullmatch(r"redis://([a-z0-9-]+)@([a-z0-9-]+):(\d+)/0", url)
    assert m, url
    svc = _find("Service", m.group(2))
    (port,) = svc["spec"]["ports"]
    assert port["port"] == int(m.group(3))
    valkey_dep = _find("Deployment", "priority-gate-valkey")
    assert valkey_dep["spec"]["replicas"] == 1  # one ledger, never two
    assert valkey_dep["spec"]["strategy"]["type"] == "Recreate"
    assert svc["spec"]["selector"].items() <= \
        valkey_dep["spec"]["template"]["metadata"]["labels"].items()
    v = _valkey()
    assert port["targetPort"] in {p["name"] for p in v["ports"]}
    assert int(_arg(v, "--port")) == v["ports"][0]["containerPort"]
    # soft state: no persistence, and never evict a ledger key
    assert _arg(v, "--save") == "" and _arg(v, "--appendonly") == "no"
    assert _arg(v, "--maxmemory-policy") == "noeviction"
    for probe in ("readinessProbe", "livenessProbe"):
        assert "ping" in v[probe]["exec"]["command"]
    # the replica id is the pod's name (downward API), so ids are unique among live pods
    assert _arg(c, "--replica-id") == "$(POD_NAME)"
    (pod_name,) = [e for e in c["env"] if e["name"] == "POD_NAME"]
    assert pod_name["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert _arg(c, "--fleet-id") == "priority-gate"
    assert float(_arg(c, "--replica-ttl-secs")) > 0


def test_envoy_container_uses_the_envoy_configmap() -> None:
    c = _envoy()
    cfg = Path(_arg(c, "-c"))
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    mount = mounts[str(cfg.parent)]
    vols = {v["name"]: v for v in _pod()["volumes"]}
    cm = _find("ConfigMap", vols[mount["name"]]["configMap"]["name"])
    assert cfg.name in cm["data"]
    listener_ports = {
        ln["address"]["socket_address"]["port_value"]
        for ln in _envoy_bootstrap()["static_resources"]["listeners"]
    }
    container_ports = {p["containerPort"] for p in c["ports"]}
    assert listener_ports == container_ports
    svc = _find("Service", "priority-gate")
    names = {p["name"] for p in c["ports"]}
    assert all(p["targetPort"] in names for p in svc["spec"]["ports"])


# ------------------------------------------------------------------- configs


def _priority_text() -> str:
    text: str = _find("ConfigMap", "priority-gate-config")["data"]["priority.yaml"]
    return text


def _envoy_text() -> str:
    text: str = _find("ConfigMap", "priority-gate-envoy")["data"]["envoy.yaml"]
    return text


def _envoy_bootstrap() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load(_envoy_text())
    return doc


def _admin_port(envoy: dict[str, Any]) -> int:
    sa = envoy["admin"]["address"]["socket_address"]
    assert sa["address"] == "127.0.0.1"  # admin is unauthenticated: loopback only
    port: int = sa["port_value"]
    return port


def _authz_timeout_secs(envoy: dict[str, Any]) -> float:
    (listener,) = envoy["static_resources"]["listeners"]
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    (authz,) = [f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.ext_authz"]
    timeout: str = authz["typed_config"]["grpc_service"]["timeout"]
    assert timeout.endswith("s")
    return float(timeout[:-1])


def test_priority_yaml_passes_check_config(tmp_path: Path) -> None:
    cfg = tmp_path / "priority.yaml"
    cfg.write_text(_priority_text(), encoding="utf-8")
    out = subprocess.run([sys.executable, "-m", "sidecar", "--check-config", str(cfg)],
                         capture_output=True, text=True, timeout=60, cwd=ROOT, check=False)
    assert out.returncode == 0, out.stdout + out.stderr


def _envoy_bin() -> Path | None:
    env = os.environ.get("ENVOY_BIN")
    if env:
        return Path(env)
    default = ROOT / ".venv-envoy" / "bin" / "envoy"
    return default if default.exists() else None


def test_envoy_yaml_passes_envoy_validate(tmp_path: Path) -> None:
    envoy = _envoy_bin()
    if envoy is None:
        pytest.skip("no Envoy binary (set ENVOY_BIN or run `make envoy`)")
    cfg = tmp_path / "envoy.yaml"  # validate cannot read /dev/stdin
    cfg.write_text(_envoy_text(), encoding="utf-8")
    out = subprocess.run([str(envoy), "--mode", "validate", "-c", str(cfg),
                          "--disable-hot-restart", "--log-level", "warn"],
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "OK" in out.stdout + out.stderr


def test_envoy_yaml_is_for_the_pod() -> None:
    envoy = _envoy_bootstrap()
    (listener,) = envoy["static_resources"]["listeners"]
    assert listener["address"]["socket_address"]["address"] == "0.0.0.0"
    clusters = {c["name"]: c for c in envoy["static_resources"]["clusters"]}
    ep = clusters["sidecar"]["load_assignment"]["endpoints"][0]["lb_endpoints"][0]
    sa = ep["endpoint"]["address"]["socket_address"]
    assert f"{sa['address']}:{sa['port_value']}" == _arg(_sidecar(), "--grpc-listen")
    assert clusters["workers"]["type"] == "STRICT_DNS"


def test_envoy_configmap_is_up_to_date() -> None:
    out = subprocess.run([sys.executable, str(K8S / "generate.py"), "--check"],
                         capture_output=True, text=True, timeout=60, cwd=ROOT, check=False)
    assert out.returncode == 0, out.stderr


# ------------------------------------------------------------------- dashboard

_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}


def _exported_metric_names() -> set[str]:
    from sidecar.config import BUILTIN_CLASSES, DEFAULT_POOL
    from sidecar.metrics import Metrics
    from sidecar.scheduler import Scheduler

    m = Metrics(tenant_top_n=4)
    snapshot = Scheduler(BUILTIN_CLASSES, 256, time.monotonic).snapshot()
    m.pool(DEFAULT_POOL).admission_started(legacy=False, snapshot=lambda: snapshot)
    m.pool(DEFAULT_POOL).shadow_started(lambda: snapshot)  # --shadow's gauges too
    names: set[str] = set()
    for family in m.registry.collect():
        # A labelled metric with no child yet has no samples; what Prometheus would
        # see once it has one is the family name plus the type's suffixes. A counter
        # is never exported under its bare family name.
        if family.type in _SUFFIXES:
            names.update(family.name + s for s in _SUFFIXES[family.type])
        else:
            names.add(family.name)
        names.update(s.name for s in family.samples if not s.name.endswith("_created"))
    return names


def _dashboard_exprs() -> list[str]:
    dash = json.loads((K8S / "dashboard.json").read_text(encoding="utf-8"))
    exprs: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                if k == "expr" and isinstance(v, str):
                    exprs.append(v)
                elif k == "query" and isinstance(v, str | dict):
                    q = v if isinstance(v, str) else v.get("query", "")
                    if isinstance(q, str) and "(" in q:
                        exprs.append(q)
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(dash)
    return exprs


def _metric_names_in(expr: str) -> set[str]:
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # drop label values
    expr = re.sub(r"\{[^}]*\}", "", expr)  # and matchers
    return set(re.findall(r"\bsmg_[a-z0-9_]+", expr))


def test_dashboard_queries_only_exported_metrics() -> None:
    exported = _exported_metric_names()
    exprs = _dashboard_exprs()
    assert len(exprs) >= 12
    used: set[str] = set()
    for e in exprs:
        used |= _metric_names_in(e)
    unknown = sorted(used - exported)
    assert not unknown, f"dashboard queries metrics the sidecar does not export: {unknown}"
    required = {
        "smg_scheduler_admit_total", "smg_scheduler_queue_depth",
        "smg_scheduler_queue_size_limit", "smg_scheduler_queue_wait_seconds_bucket",
        "smg_scheduler_inflight", "smg_sidecar_reserved_slots", "smg_sidecar_capacity",
        "smg_sidecar_capacity_source", "smg_scheduler_preemption_total",
        "smg_scheduler_clamp_total", "smg_scheduler_starvation_promotion_total",
        "smg_sidecar_lease_expired_total", "smg_sidecar_config_reload_total",
        "smg_sidecar_config_generation", "smg_scheduler_utilization",
    }
    assert required <= used, sorted(required - used)


def test_dashboard_quantiles_are_by_le() -> None:
    for e in _dashboard_exprs():
        if "histogram_quantile" in e:
            assert "_bucket" in e and re.search(r"by \((le, class|class, le)\)", e), e


def test_metric_name_extraction() -> None:
    e = ('histogram_quantile(0.99, sum by (le, class) '
         '(rate(smg_scheduler_queue_wait_seconds_bucket{instance=~"smg_x"}[5m])))')
    assert _metric_names_in(e) == {"smg_scheduler_queue_wait_seconds_bucket"}
    exported = _exported_metric_names()
    assert "smg_scheduler_admit_total" in exported
    assert "smg_scheduler_admit" not in exported  # counters only with _total
    assert "smg_scheduler_queue_depth_total" not in exported


# ------------------------------------------------------------------- Dockerfile


def _dockerfile() -> list[tuple[str, str]]:
    text = (ROOT / "Dockerfile").read_text(encoding="utf-8")
    text = re.sub(r"\\\n", " ", text)  # line continuations
    out: list[tuple[str, str]] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        instr, _, rest = line.partition(" ")
        out.append((instr.upper(), rest.strip()))
    return out


def test_dockerfile() -> None:
    instrs = _dockerfile()
    froms = [rest for i, rest in instrs if i == "FROM"]
    assert len(froms) >= 2, "multi-stage build expected"
    stages: set[str] = set()
    for rest in froms:
        parts = shlex.split(rest)
        image = next(p for p in parts if not p.startswith("--"))
        if image not in stages:
            name, _, tag = image.rpartition(":")
            assert name and tag and tag != "latest", f"FROM {image} is not pinned"
        if len(parts) >= 3 and parts[-2].upper() == "AS":
            stages.add(parts[-1])
    assert shlex.split(froms[-1])[0] == "python:3.11-slim"
    assert any(i == "RUN" and "pip wheel" in r for i, r in instrs)
    # USER in the final stage, not root
    last_from = max(n for n, (i, _) in enumerate(instrs) if i == "FROM")
    users = [r for i, r in instrs[last_from:] if i == "USER"]
    assert users, "no USER in the runtime stage"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0"), users[-1]
    # numeric, so that Kubernetes runAsNonRoot can verify it; matches the Deployment
    assert user == str(_sidecar()["securityContext"]["runAsUser"])
    entry = [r for i, r in instrs if i == "ENTRYPOINT"]
    assert entry and json.loads(entry[-1]) == ["priority-sidecar"]
    ignore = [ln.strip() for ln in (ROOT / ".dockerignore").read_text(encoding="utf-8")
              .splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    # the venvs (hundreds of MB, host-specific) never enter the build context
    assert "**" in ignore or {".venv", ".venv-envoy"} <= set(ignore)
    for _, rest in (x for x in instrs if x[0] == "COPY" and "--from" not in x[1]):
        for src in shlex.split(rest)[:-1]:
            assert (ROOT / src).exists(), f"COPY {src}: not in the repo"
            if "**" in ignore:
                assert f"!{src.rstrip('/')}" in ignore or f"!{src.rstrip('/')}/" in ignore, src


# ------------------------------------------------------------ the ledger's server: ACL

LEDGER_LUA = ROOT / "sidecar" / "coordination" / "ledger.lua"
CREDENTIALS_SECRET = "priority-gate-valkey-credentials"
# What a runtime user must never be granted: each would let one fleet's credentials change
# the code, another fleet's keys, or the server itself.
FORBIDDEN = {"+@all", "allcommands", "+@admin", "+@dangerous", "+@scripting", "+function",
             "+function|load", "+function|delete", "+function|flush", "+function|restore",
             "+flushall", "+flushdb", "+config", "+config|set", "+keys", "+scan", "+eval",
             # CONFIG GET shows requirepass/masterauth where set; no ACL narrows it to one
             # parameter (the loader checks the server's settings with the admin user).
             "+config|get",
             "+script", "+acl", "+debug", "+shutdown", "allkeys", "~*", "nopass"}


def _loader_pod() -> dict[str, Any]:
    pod: dict[str, Any] = _find("Deployment", "priority-gate-ledger-loader")["spec"][
        "template"]["spec"]
    return pod


def _acl() -> dict[str, str]:
    data: dict[str, str] = _find("ConfigMap", "priority-gate-valkey-acl")["data"]
    return data


def runtime_rules() -> list[str]:
    """The fleet runtime user's ACL rules, as shipped (also used by
    tests/test_coordination_security.py to create the user in a real server)."""
    return _acl()["runtime-rules"].split()


def _library_commands() -> set[str]:
    return {c.lower() for c in re.findall(r"redis\.p?call\('([A-Za-z]+)'",
                                          LEDGER_LUA.read_text(encoding="utf-8"))}


def test_runtime_user_may_run_what_the_library_calls_and_nothing_dangerous() -> None:
    rules = runtime_rules()
    granted = {r[1:] for r in rules if r.startswith("+")}
    missing = _library_commands() - granted
    assert not missing, (f"ledger.lua calls {sorted(missing)}, which the runtime user may not "
                         "run: add them to runtime-rules in k8s/base/valkey-acl.yaml")
    # What the sidecar sends itself: FCALL, the library check, notifications, connection
    # set-up.
    assert {"fcall", "function|list", "blmpop", "lpop", "auth", "hello", "ping"} <= granted
    assert not FORBIDDEN & set(rules), sorted(FORBIDDEN & set(rules))
    assert rules[:3] == ["~pg:{priority-gate}*", "resetchannels", "-@all"], rules[:3]
    # Every rule is a command grant after the key pattern: nothing broader slipped in.
    assert all(r.startswith("+") and "@" not in r for r in rules[3:]), rules


def test_acl_file_users_and_the_sidecars_credentials_match() -> None:
    script = _acl()["make-acl.sh"]
    users = dict(re.findall(r'^\s*echo "user (\S+) (.*)"$', script, re.M))
    assert set(users) == {"default", "health", "admin", "priority-gate"}
    assert users["default"].startswith("off resetpass")
    assert users["health"] == "on nopass -@all +ping"
    runtime = users["priority-gate"]
    assert "runtime-rules" in runtime and "runtime-password" in runtime
    assert "admin-password" in users["admin"]
    # Password hashes only: the plain text never lands in the ACL file.
    assert ">" not in script.replace("> /acl/users.acl", "")
    # The sidecar connects as the runtime user named after its fleet, whose keys it owns.
    c = _sidecar()
    assert _arg(c, "--coordination-url").startswith(f"redis://{_arg(c, '--fleet-id')}@")
    assert f"~pg:{{{_arg(c, '--fleet-id')}}}*" in runtime_rules()
    # ... with the runtime password only; the admin password is the loader's alone.
    vols = {v["name"]: v for v in _pod()["volumes"]}
    mount = {m["mountPath"]: m for m in c["volumeMounts"]}[
        str(Path(_arg(c, "--coordination-password-file")).parent)]
    secret = vols[mount["name"]]["secret"]
    assert secret["secretName"] == CREDENTIALS_SECRET
    assert [i["key"] for i in secret["items"]] == ["runtime-password"]
    assert secret["items"][0]["path"] == Path(_arg(c, "--coordination-password-file")).name
    (loader,) = _loader_pod()["containers"]
    assert loader["command"][-1] == "sidecar.coordination.server"
    assert _arg(loader, "--coordination-url").startswith("redis://admin@")
    (lvol,) = _loader_pod()["volumes"]
    assert lvol["secret"]["secretName"] == CREDENTIALS_SECRET
    assert [i["key"] for i in lvol["secret"]["items"]] == ["admin-password"]
    for container in (c, loader):  # a password file's path, never a password in argv
        assert all(a == "--coordination-password-file" or a.startswith("/run/secrets/")
                   for a in container["args"] if "password" in a.lower())
        userinfo = _arg(container, "--coordination-url").split("://", 1)[1].split("@")[0]
        assert ":" not in userinfo


def test_valkey_runs_with_the_acl_file_and_protected_mode() -> None:
    v = _valkey()
    assert _arg(v, "--protected-mode") == "yes"
    assert _arg(v, "--aclfile") == "/acl/users.acl"
    pod = _find("Deployment", "priority-gate-valkey")["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    assert init["command"] == ["sh", "/etc/valkey-acl/make-acl.sh"]
    vols = {v["name"]: v for v in pod["volumes"]}
    assert vols["acl"]["emptyDir"]["medium"] == "Memory"
    assert vols["credentials"]["secret"]["secretName"] == CREDENTIALS_SECRET
    for probe in ("readinessProbe", "livenessProbe"):
        cmd = v[probe]["exec"]["command"]
        assert cmd[-1] == "ping" and cmd[cmd.index("--user") + 1] == "health"
    # The loader reaches the server (NetworkPolicy).
    policy = _find("NetworkPolicy", "priority-gate-valkey")["spec"]
    sources = [p["podSelector"]["matchLabels"]["app.kubernetes.io/name"]
               for p in policy["ingress"][0]["from"]]
    assert sorted(sources) == ["priority-gate", "priority-gate-ledger-loader"]


def test_readme_says_how_to_create_the_credentials() -> None:
    readme = (K8S / "README.md").read_text(encoding="utf-8")
    assert f"kubectl create secret generic {CREDENTIALS_SECRET}" in readme
    assert "rediss://" in readme


def test_dashboard_selects_pools_on_the_pooled_series() -> None:
    """A `pool` variable (All = `.*`, which also matches a sidecar without pools) filters
    every scheduler and capacity series, the ones that carry `pool` with pools."""
    dash = json.loads((K8S / "dashboard.json").read_text(encoding="utf-8"))
    (var,) = [v for v in dash["templating"]["list"] if v["name"] == "pool"]
    assert var["includeAll"] and var["allValue"] == ".*"
    assert "pool" in var["definition"]
    pooled = ("smg_scheduler_admit_total", "smg_scheduler_utilization",
              "smg_scheduler_queue_depth", "smg_scheduler_inflight", "smg_sidecar_capacity{",
              "smg_sidecar_reserved_slots", "smg_scheduler_queue_wait_seconds_bucket")
    for e in _dashboard_exprs():
        if any(m in e for m in pooled):
            assert 'pool=~"$pool"' in e, e
