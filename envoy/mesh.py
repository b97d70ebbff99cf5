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
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
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
    """Return ``text`` (a rendered bootstrap) as a mesh control plane would generate it."""
    boot: dict[str, Any] = yaml.safe_load(text)
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


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Rewrite a rendered bootstrap as a mesh would.")
    p.add_argument("--node-id", default=ISTIO_NODE_ID)
    a = p.parse_args(argv)
    sys.stdout.write(meshify(sys.stdin.read(), node_id=a.node_id))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
