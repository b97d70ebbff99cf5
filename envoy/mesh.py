#!/usr/bin/env python3
"""Turn a rendered bootstrap into the config a service mesh generates (stdlib + pyyaml only).

The hand-written bootstrap (envoy.yaml.tmpl) sets things neither Istio nor Envoy Gateway
sets. This filter removes exactly those, so the e2e suite can run the sidecar under the
config users actually get (istio/istio pilot/pkg/model/telemetry_logging.go and
pilot/pkg/security/authz/builder/extauthz.go; envoyproxy/gateway internal/xds/translator/
accesslog.go; recipes in k8s/istio/ and k8s/envoy-gateway/):

- HCM: no ``access_log_options`` (no periodic access-log entries) and ``stream_idle_timeout: 0s``
  (Istio's listener builder disables it);
- gRPC access log: default buffering (``buffer_size_bytes`` unset: 16 KiB / 1 s flush) and no
  ``metadata_filter`` (Istio's Telemetry provider logs every request);
- ext_authz: only what Istio's ``generateGRPCConfig`` sets (``status_on_error``,
  ``failure_mode_allow``, ``transport_api_version``, ``grpc_service`` with a timeout): no
  ``metadata_context_namespaces``, no ``include_peer_certificate``;
- ext_proc: kept as rendered, skip matcher included (the Istio recipe's EnvoyFilter inserts the
  same; Envoy Gateway's generated filter has no matcher, see k8s/envoy-gateway/README.md), or
  absent when the bootstrap was rendered with ``--no-preemption``;
- node: an Istio-shaped node id (``router~<ip>~<pod>.<ns>~<ns>.svc.cluster.local``).

    python envoy/render.py ... | python envoy/mesh.py [--node-id ID] > envoy-mesh.yaml

:func:`istio_gateway` goes further for the Istio recipe: the HTTP filters and routes an
Istio ingress gateway gets from istiod (its filter order, its route names, no filter of
this project's), with the recipe's EnvoyFilter patches then applied as istiod applies
them, so the recipe's own filter order can be run through a real Envoy.
:func:`envoy_gateway` does the same for Envoy Gateway: its per-policy filter names, each
filter disabled on the HCM and enabled per route, then an ``EnvoyProxy`` bootstrap merge
and ``EnvoyPatchPolicy`` JSON patches.
"""

from __future__ import annotations

import argparse
import copy
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import yaml

ISTIO_NODE_ID = (
    "router~127.0.0.1~istio-ingressgateway-0.istio-system~istio-system.svc.cluster.local")
# istio/istio pilot/pkg/security/authz/builder/extauthz.go generateGRPCConfig
EXT_AUTHZ_KEYS = {
    "transport_api_version", "grpc_service", "failure_mode_allow", "status_on_error"}


def _hcms(boot: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for listener in boot["static_resources"]["listeners"]:
        for chain in listener["filter_chains"]:
            for f in chain["filters"]:
                if f["name"] == "envoy.filters.network.http_connection_manager":
                    out.append(f["typed_config"])
    return out


def meshify(text: str, *, node_id: str = ISTIO_NODE_ID) -> str:
    """Return ``text`` (a rendered bootstrap) as a mesh control plane would generate it.

    ``text`` must be rendered without the edge path (``render(edge_shed=False)``): a mesh
    has none unless its edge-shed recipe adds it, and without the access-log filters this
    drops, the edge-shed logger would count every request as shed."""
    boot: dict[str, Any] = yaml.safe_load(text)
    if "layered_runtime" in boot:
        raise ValueError("a mesh-generated config has no edge path: render the bootstrap "
                         "with edge_shed=False (--no-edge-shed)")
    boot["node"]["id"] = node_id
    for hcm in _hcms(boot):
        hcm.pop("access_log_options", None)
        hcm["stream_idle_timeout"] = "0s"
        for log in hcm.get("access_log", []):
            log.pop("filter", None)
            log["typed_config"]["common_config"].pop("buffer_size_bytes", None)
        for f in hcm["http_filters"]:
            if f["name"] == "envoy.filters.http.ext_authz":
                cfg = f["typed_config"]
                for key in set(cfg) - EXT_AUTHZ_KEYS - {"@type"}:
                    del cfg[key]
    rendered: str = yaml.safe_dump(boot, sort_keys=False)
    return rendered


# What istiod puts in an ingress gateway's HCM, in this order (istio/istio
# pilot/pkg/networking/core/listener_builder.go): metadata exchange, the CUSTOM
# AuthorizationPolicy's shadow RBAC and ext_authz, jwt_authn (RequestAuthentication), the
# ALLOW/DENY RBAC, stats, fault, CORS, the router last. Istio's own filters (metadata
# exchange, stats) are not in upstream Envoy and hold no admission state: left out.
JWT_AUTHN = "envoy.filters.http.jwt_authn"
EXT_AUTHZ = "envoy.filters.http.ext_authz"
ROUTER = "envoy.filters.http.router"
# istio/istio pilot/pkg/security/authn/policy_applier.go: the verified payload's key.
ISTIO_JWT_PAYLOAD_KEY = "payload"
# The cluster istiod generates for the recipe's ServiceEntry, and the bootstrap's name.
ISTIO_SIDECAR_CLUSTER = "outbound|9001||priority-gate.local"


def istio_gateway(text: str, envoy_filters: Iterable[Mapping[str, Any]], *,
                  route_names: Mapping[str, str], custom_ext_authz: bool = False,
                  vhost_name: str = "llm.example.com:80") -> str:
    """``text`` (a rendered bootstrap, rendered with a JWT secret) as an Istio ingress
    gateway runs it: istiod's filters and routes, then ``envoy_filters`` (EnvoyFilter
    resources) applied in istiod's order (by ``priority``, then as given).

    ``route_names``: a route's path prefix -> its name, as a VirtualService's
    ``http[].name`` names the route istiod builds (``HTTP_ROUTE`` patches match on it).
    ``custom_ext_authz``: add the ext_authz a CUSTOM AuthorizationPolicy makes istiod
    generate, where istiod puts it (before jwt_authn).

    Only the patch operations the recipes use are modelled; any other one raises, so a
    recipe cannot silently rely on something this does not check.
    """
    boot: dict[str, Any] = yaml.safe_load(meshify(text))
    (hcm,) = _hcms(boot)
    by_name = {f["name"]: f for f in hcm["http_filters"]}
    jwt = by_name[JWT_AUTHN]
    for provider in jwt["typed_config"]["providers"].values():
        provider["payload_in_metadata"] = ISTIO_JWT_PAYLOAD_KEY
    ext = "type.googleapis.com/envoy.extensions.filters.http"
    filters = [jwt,
               {"name": "envoy.filters.http.fault",
                "typed_config": {"@type": f"{ext}.fault.v3.HTTPFault"}},
               {"name": "envoy.filters.http.cors",
                "typed_config": {"@type": f"{ext}.cors.v3.Cors"}},
               by_name[ROUTER]]
    if custom_ext_authz:
        filters.insert(0, by_name[EXT_AUTHZ])  # as meshify left it: Istio's settings only
    hcm["http_filters"] = filters
    for vhost in hcm["route_config"]["virtual_hosts"]:
        vhost["name"] = vhost_name
        for route in vhost["routes"]:
            route.pop("typed_per_filter_config", None)  # istiod sets none of this project's
            route["name"] = route_names[route["match"]["prefix"]]
    patches = [(int(f.get("spec", {}).get("priority", 0)), i, cp)
               for i, f in enumerate(envoy_filters) for cp in f["spec"]["configPatches"]]
    for _, _, cp in sorted(patches, key=lambda t: t[:2]):
        _apply(hcm, cp)
    out: str = yaml.safe_dump(boot, sort_keys=False).replace(ISTIO_SIDECAR_CLUSTER, "sidecar")
    return out


def _apply(hcm: dict[str, Any], cp: Mapping[str, Any]) -> None:
    """One EnvoyFilter config patch on the gateway's one HCM, as istiod applies it."""
    apply_to, op = cp["applyTo"], cp["patch"]["operation"]
    value = copy.deepcopy(cp["patch"]["value"])
    match = cp.get("match", {})
    if apply_to == "HTTP_FILTER":
        sub = match["listener"]["filterChain"]["filter"].get("subFilter", {}).get("name")
        names = [f["name"] for f in hcm["http_filters"]]
        if op == "INSERT_FIRST":
            hcm["http_filters"].insert(0, value)
        elif op in ("INSERT_BEFORE", "INSERT_AFTER") and sub in names:
            at = names.index(sub) + (op == "INSERT_AFTER")
            hcm["http_filters"].insert(at, value)
        elif op not in ("INSERT_BEFORE", "INSERT_AFTER"):
            raise ValueError(f"HTTP_FILTER {op} is not modelled")
        # istiod skips an INSERT_BEFORE/AFTER whose subFilter is absent: so does this
    elif apply_to == "NETWORK_FILTER" and op == "MERGE":
        _merge(hcm, value["typed_config"])
    elif apply_to == "HTTP_ROUTE" and op == "MERGE":
        want = match["routeConfiguration"]["vhost"].get("route", {}).get("name")
        for vhost in hcm["route_config"]["virtual_hosts"]:
            for route in vhost["routes"]:
                if want is None or route.get("name") == want:
                    _merge(route, value)
    else:
        raise ValueError(f"{apply_to} {op} is not modelled")


def _merge(into: dict[str, Any], value: Mapping[str, Any]) -> None:
    """Proto merge: messages field by field, repeated fields appended, map entries
    (typed_per_filter_config) and scalars replaced."""
    for key, v in value.items():
        if key == "@type":
            continue
        if key == "typed_per_filter_config":
            into.setdefault(key, {}).update(copy.deepcopy(v))
        elif isinstance(v, dict) and isinstance(into.get(key), dict):
            _merge(into[key], v)
        elif isinstance(v, list) and isinstance(into.get(key), list):
            into[key].extend(copy.deepcopy(v))
        else:
            into[key] = copy.deepcopy(v)


# envoyproxy/gateway internal/xds/translator (extauth.go, extproc.go, utils.go): one filter
# per policy, named <type>/<kind>/<namespace>/<name>[/...], disabled on the HCM and enabled
# on each route the policy targets by a per-route config under that name.
EXT_PROC = "envoy.filters.http.ext_proc"
EG_EXT_AUTHZ = f"{EXT_AUTHZ}/securitypolicy/default/priority-gate"
EG_EXT_PROC = f"{EXT_PROC}/envoyextensionpolicy/default/priority-gate/extproc/0"
EG_LISTENER = "default/llm-gateway/http"  # <namespace>/<gateway>/<listener>, also its routes'
# EG's default bootstrap has one runtime layer of its own (internal/xds/bootstrap).
EG_RUNTIME_LAYER = {"name": "global_config", "static_layer": {
    "re2.max_program_size.error_level": 4294967295, "re2.max_program_size.warn_level": 1000}}
_TYPES = "type.googleapis.com/envoy"


def envoy_gateway(text: str, *, bootstrap_merge: str | None = None,
                  patch_policies: Iterable[Mapping[str, Any]] = ()) -> str:
    """``text`` (a rendered bootstrap) as Envoy Gateway runs it: meshify's settings, EG's
    filter names (ext_proc without the skip matcher, which EG cannot express), both filters
    disabled on the HCM and enabled on every route, EG's runtime layer; then
    ``bootstrap_merge`` (``EnvoyProxy.spec.bootstrap`` of type Merge: a proto merge,
    repeated fields appended) and the ``EnvoyPatchPolicy`` resources' JSON patches.

    Only the JSON patch forms the recipes use are modelled; any other one raises.
    """
    boot: dict[str, Any] = yaml.safe_load(meshify(text))
    (hcm,) = _hcms(boot)
    filters = []
    for f in hcm["http_filters"]:
        if f["name"] == "envoy.filters.http.header_mutation":
            continue  # this project's; EG generates none
        if f["name"] == EXT_AUTHZ:
            f = {"name": EG_EXT_AUTHZ, "disabled": True, "typed_config": f["typed_config"]}
        elif f["name"] == EXT_PROC:
            cfg = f["typed_config"]
            if cfg["@type"].endswith("ExtensionWithMatcher"):
                cfg = cfg["extension_config"]["typed_config"]
            f = {"name": EG_EXT_PROC, "disabled": True, "typed_config": cfg}
        filters.append(f)
    hcm["http_filters"] = filters
    names = {f["name"] for f in filters}
    for vhost in hcm["route_config"]["virtual_hosts"]:
        for route in vhost["routes"]:
            per_route = route.pop("typed_per_filter_config", {})
            enable = {EG_EXT_AUTHZ: per_route.get(EXT_AUTHZ, {
                "@type": f"{_TYPES}.extensions.filters.http.ext_authz.v3.ExtAuthzPerRoute",
                "check_settings": {}}),
                EG_EXT_PROC: {
                "@type": f"{_TYPES}.extensions.filters.http.ext_proc.v3.ExtProcPerRoute",
                "overrides": {}}}
            route["typed_per_filter_config"] = {k: v for k, v in enable.items() if k in names}
    boot["layered_runtime"] = {"layers": [copy.deepcopy(EG_RUNTIME_LAYER)]}
    if bootstrap_merge is not None:
        _merge(boot, yaml.safe_load(bootstrap_merge))
    for policy in patch_policies:
        for patch in policy["spec"]["jsonPatches"]:
            _eg_patch(hcm, patch)
    out: str = yaml.safe_dump(boot, sort_keys=False)
    return out


def _eg_patch(hcm: dict[str, Any], patch: Mapping[str, Any]) -> None:
    """One EnvoyPatchPolicy JSON patch, on the listener's HCM or its route table."""
    op = patch["operation"]
    if patch["name"] != EG_LISTENER or op["op"] != "add":
        raise ValueError(f"not modelled: {patch['name']} {op['op']}")
    value = copy.deepcopy(op["value"])
    if patch["type"].endswith("RouteConfiguration"):
        if (op.get("jsonPath"), op.get("path")) != ("$.virtual_hosts[*]", "/routes/0"):
            raise ValueError(f"not modelled: {op}")
        for vhost in hcm["route_config"]["virtual_hosts"]:
            vhost["routes"].insert(0, copy.deepcopy(value))
        return
    prefix = "/default_filter_chain/filters/0/typed_config/"
    if not patch["type"].endswith("Listener") or not op["path"].startswith(prefix) \
            or "jsonPath" in op or "~" in op["path"]:
        raise ValueError(f"not modelled: {op}")
    *parents, last = op["path"][len(prefix):].split("/")
    node: Any = hcm
    for token in parents:
        node = node[int(token)] if isinstance(node, list) else node[token]
    if isinstance(node, list):
        node.insert(len(node) if last == "-" else int(last), value)
    else:
        node[last] = value


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Rewrite a rendered bootstrap as a mesh would.")
    p.add_argument("--node-id", default=ISTIO_NODE_ID)
    a = p.parse_args(argv)
    sys.stdout.write(meshify(sys.stdin.read(), node_id=a.node_id))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
