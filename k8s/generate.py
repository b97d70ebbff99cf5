#!/usr/bin/env python3
"""Generate k8s/base/configmap-envoy.yaml from envoy/envoy.yaml.tmpl (via envoy/render.py).

    .venv/bin/python k8s/generate.py          # rewrite k8s/base/configmap-envoy.yaml
    .venv/bin/python k8s/generate.py --check  # exit 1 if the committed file is stale

The base's bootstrap has edge shedding (render.py's default; the sidecar runs --edge-shed)
and trusts the demo identity's JWTs (devtools/identity.py, NOT for production: set JWKS and
JWT_ISSUER below to your identity provider's and regenerate).

It also writes k8s/overlays/no-edge-shed/kustomization.yaml: the bootstrap rendered without
the edge path (render.py --no-edge-shed) as a patch over the base's, and --edge-shed removed
from the sidecar's arguments; k8s/overlays/engine-key/kustomization.yaml: the bootstrap
rendered with the engine's API key on upstream requests (render.py --engine-key-file), read
from the Secret priority-gate-engine-key, which the sidecar's probes read too
(--worker-auth-file); and k8s/overlays/pools/kustomization.yaml: the bootstrap rendered with a
route, a cluster and an edge switch per model pool (render.py --pool), the sidecar's
--worker-urls POOL=URL entries and priority.yaml's `pools:` section, over the base (two
replicas sharing the fleet ledger: each pool has a ledger of its own in the one Valkey).

render.py binds everything to 127.0.0.1 and only knows STATIC clusters. In the pod:

- the listener must bind 0.0.0.0 so the Service (pod IP) can reach it;
- the admin API stays on 127.0.0.1 (unauthenticated; only the sidecar polls it);
- the sidecar stays on 127.0.0.1:9001 (same pod, loopback);
- the workers cluster becomes STRICT_DNS on a Service name (WORKERS_HOST): point it at
  a *headless* Service of your workers so every worker pod is its own Envoy host and
  the sidecar's capacity (read from Envoy's /clusters) counts each one;
- a pool's cluster becomes STRICT_DNS on its workers' stable pod names (a StatefulSet
  behind a headless Service), the same names the sidecar probes (--worker-urls POOL=URL),
  so admission and routing count the same workers.

The numbers below must agree with k8s/base/deployment.yaml (tests/test_k8s.py checks this).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "envoy"))
sys.path.insert(1, str(ROOT))

# envoy/render.py; envoy/ is deliberately not a package (see envoy/NOTES.md)
import render  # type: ignore[import-not-found]  # noqa: E402

from devtools import identity  # noqa: E402  (stdlib only)

LISTEN_PORT = 10000
ADMIN_PORT = 9901
SIDECAR = ("127.0.0.1", 9001)
# Must exceed the longest class queue_timeout_secs in k8s/base/configmap-priority.yaml
# (bulk: 300 s); the sidecar gets the same value as --envoy-authz-timeout.
AUTHZ_TIMEOUT_SECS = 310.0
FLUSH_INTERVAL_SECS = 5.0  # ALS heartbeat; --admission-lease-secs (30) > 3 x this
WORKERS_HOST = "llm-workers"  # headless Service of the workers, same namespace
WORKERS_PORT = 8000
_PLACEHOLDER = ("127.0.0.1", WORKERS_PORT)
# Tenant identity: jwt_authn trusts this JWKS and issuer; the tenant is the "tenant" claim.
# The demo identity's, NOT for production (its private key is in this repository): put your
# identity provider's public keys here (a JWKS file) and its issuer, and regenerate.
JWKS = ROOT / "devtools" / "demo-jwks.json"
JWT_ISSUER: str | None = identity.ISSUER
# overlays/engine-key: where the Secret with the engine's API key is mounted in both
# containers (Envoy sends it upstream, the sidecar's probes read it).
ENGINE_KEY_SECRET = "priority-gate-engine-key"
ENGINE_KEY_ITEM = "api-key"
ENGINE_KEY_DIR = "/etc/priority-gate/engine-key"
OUT = Path(__file__).resolve().parent / "base" / "configmap-envoy.yaml"
NO_EDGE_OUT = Path(__file__).resolve().parent / "overlays" / "no-edge-shed" / "kustomization.yaml"
ENGINE_KEY_OUT = (Path(__file__).resolve().parent / "overlays" / "engine-key"
                  / "kustomization.yaml")
POOLS_OUT = Path(__file__).resolve().parent / "overlays" / "pools" / "kustomization.yaml"
PRIORITY = Path(__file__).resolve().parent / "base" / "configmap-priority.yaml"
DEPLOYMENT = Path(__file__).resolve().parent / "base" / "deployment.yaml"

# Two models behind one gateway (a 70B chat model and an 8B model), each a StatefulSet of
# WORKERS_PORT engines behind a headless Service of the same name: (pool, path prefix,
# Service, replicas). The route's prefix is rewritten to "/" (render.py); every other path
# stays on the base's `workers` cluster, the default pool.
POOLS: tuple[tuple[str, str, str, int], ...] = (
    ("chat-70b", "/chat-70b/", "llm-70b", 2),
    ("small-8b", "/small-8b/", "llm-8b", 2),
)
# Per-pool class overrides (priority.yaml `pools:`): the base's floors (system 32 +
# interactive 128) need 256 slots, far more than two replicas of one model have, and a
# pool whose reservations do not fit falls back to legacy admission. Floors scaled to each
# pool's size; the rest is the top-level classes.
POOLS_PRIORITY = """\
# Model pools (k8s/overlays/pools): the route names the pool (smg-pool), each pool admits
# on its own workers' capacity; these override the classes above for that pool only.
pools:
  chat-70b:
    classes:
      system: {reserved_floor: 1}
      interactive: {reserved_floor: 2, reserved_per_slot: 0.25, queue_size: 64}
      bulk: {queue_size: 128}
  small-8b:
    classes:
      system: {reserved_floor: 2}
      interactive: {reserved_floor: 8, reserved_per_slot: 0.25}
"""


def pool_worker_urls() -> list[str]:
    """The sidecar's --worker-urls entries: one per StatefulSet pod of each pool."""
    return [f"{name}=http://{host}:{WORKERS_PORT}" for name, _, _, _, host in _pool_hosts()]


def _pool_hosts() -> list[tuple[str, str, str, int, str]]:
    """(pool, prefix, service, index, pod host name) for every pool worker."""
    return [(name, prefix, svc, i, f"{svc}-{i}.{svc}")
            for name, prefix, svc, n in POOLS for i in range(n)]

_HEADER = """\
# GENERATED by k8s/generate.py from envoy/envoy.yaml.tmpl -- do not edit by hand.
# Envoy reads this once at start: after changing it, `kubectl rollout restart
# deployment/priority-gate`. (priority.yaml, by contrast, is hot-reloaded.)
apiVersion: v1
kind: ConfigMap
metadata:
  name: priority-gate-envoy
  labels:
    app.kubernetes.io/name: priority-gate
    app.kubernetes.io/component: envoy-config
data:
  envoy.yaml: |
"""


def _replace_once(text: str, old: str, new: str) -> str:
    if text.count(old) != 1:
        raise SystemExit(f"generate.py: expected exactly one {old!r} in the rendered config")
    return text.replace(old, new)


def envoy_yaml(edge_shed: bool = True, pools: bool = False, engine_key: bool = False) -> str:
    """The rendered bootstrap, post-processed for the pod."""
    # Placeholder IPs, one per pool worker, replaced below by the pod's host name.
    hosts = _pool_hosts() if pools else []
    placeholders = {host: f"127.0.1.{k + 1}" for k, (*_, host) in enumerate(hosts)}
    text = render.render(
        listen_port=LISTEN_PORT,
        admin_port=ADMIN_PORT,
        sidecar_host=SIDECAR[0],
        sidecar_port=SIDECAR[1],
        workers=[_PLACEHOLDER],
        authz_timeout_secs=AUTHZ_TIMEOUT_SECS,
        flush_interval_secs=FLUSH_INTERVAL_SECS,
        jwt_jwks=JWKS.read_text(encoding="utf-8"),
        jwt_issuer=JWT_ISSUER,
        edge_shed=edge_shed,
        engine_key_file=f"{ENGINE_KEY_DIR}/{ENGINE_KEY_ITEM}" if engine_key else None,
        pools=[(name, prefix, [(placeholders[h], WORKERS_PORT)
                               for n, _, _, _, h in hosts if n == name])
               for name, prefix, _, _ in (POOLS if pools else ())],
    )
    for name, *_ in (POOLS if pools else ()):
        text = _replace_once(
            text, f"  - name: pool_{name}\n    type: STATIC\n",
            f"  - name: pool_{name}\n"
            "    # Kubernetes: the pool's StatefulSet pods by their stable names, the same the\n"
            "    # sidecar probes (--worker-urls POOL=URL).\n"
            "    type: STRICT_DNS\n"
            "    dns_lookup_family: V4_PREFERRED\n"
            "    dns_refresh_rate: 5s\n")
    for host, ip in placeholders.items():
        text = _replace_once(
            text, f"address: {{socket_address: {{address: {ip}, port_value: {WORKERS_PORT}}}}}",
            f"address: {{socket_address: {{address: {host}, port_value: {WORKERS_PORT}}}}}")
    text = _replace_once(
        text,
        "# Everything binds to 127.0.0.1: Envoy and the sidecar are co-located.",
        "# Kubernetes (k8s/generate.py): the listener binds 0.0.0.0 (the Service reaches it on\n"
        "# the pod IP); admin and the sidecar stay on 127.0.0.1 (same pod).",
    )
    text = _replace_once(
        text,
        f"address: {{socket_address: {{address: 127.0.0.1, port_value: {LISTEN_PORT}}}}}",
        f"address: {{socket_address: {{address: 0.0.0.0, port_value: {LISTEN_PORT}}}}}",
    )
    text = _replace_once(
        text,
        "  - name: workers\n    type: STATIC\n",
        "  - name: workers\n"
        "    # Kubernetes: one Envoy host per A record of the workers' headless Service.\n"
        "    # Operators: set the address below to your worker Service (k8s/README.md).\n"
        "    type: STRICT_DNS\n"
        "    dns_lookup_family: V4_PREFERRED\n"
        "    dns_refresh_rate: 5s\n",
    )
    text = _replace_once(
        text,
        f"address: {{socket_address: {{address: {_PLACEHOLDER[0]}, "
        f"port_value: {_PLACEHOLDER[1]}}}}}",
        f"address: {{socket_address: {{address: {WORKERS_HOST}, port_value: {WORKERS_PORT}}}}}",
    )
    return text


def _indented(text: str, prefix: str) -> str:
    return "".join(
        (prefix + line if line.strip() else "\n") if line.endswith("\n") else prefix + line
        for line in text.splitlines(keepends=True)
    )


def configmap_text() -> str:
    return _HEADER + _indented(envoy_yaml(), "    ")


def _sidecar_arg_index(flag: str) -> int:
    """Where ``flag`` sits in the base's sidecar arguments (a JSON patch path needs it)."""
    dep = yaml.safe_load(DEPLOYMENT.read_text(encoding="utf-8"))
    (sidecar,) = dep["spec"]["template"]["spec"]["initContainers"]
    args: list[str] = sidecar["args"]
    if args.count(flag) != 1:
        raise SystemExit(f"generate.py: expected exactly one {flag} in {DEPLOYMENT}")
    return args.index(flag)


_PREAMBLE = """\
apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources:
- ../../base
patches:
- target:
    kind: Deployment
    name: priority-gate
  patch: |-
    - op: test
      path: /spec/template/spec/initContainers/0/name
      value: sidecar"""
"""Every overlay's start (its header's ``{preamble}``): over the base, a patch of the
Deployment whose ops that follow address the sidecar as init container 0, tested first."""


def _replace_data(configmap: str, key: str, text: str) -> str:
    """A patch replacing ``key`` of ConfigMap ``configmap`` with ``text``."""
    return (f"- target:\n    kind: ConfigMap\n    name: {configmap}\n"
            f"  patch: |-\n    - op: replace\n      path: /data/{key}\n      value: |\n"
            + _indented(text, "        "))


_NO_EDGE_HEADER = """\
# GENERATED by k8s/generate.py -- do not edit by hand.
# The base without edge shedding (docs/reference.md "Edge shedding"): every bulk 429 is the
# sidecar's, each costing a Check. The base runs it on both sides; this overlay turns both
# off: --edge-shed removed from the sidecar's arguments (the `test` op fails the build
# rather than remove another flag if the base's argument list changes shape), and the
# Envoy config rendered without the edge path (render.py --no-edge-shed). Needed for
# --shadow, which the sidecar refuses with --edge-shed.
#   kubectl apply -k k8s/overlays/no-edge-shed
{preamble}
    - op: test
      path: /spec/template/spec/initContainers/0/args/{index}
      value: --edge-shed
    - op: remove
      path: /spec/template/spec/initContainers/0/args/{index}
"""


def no_edge_overlay_text() -> str:
    return (_NO_EDGE_HEADER.format(preamble=_PREAMBLE,
                                   index=_sidecar_arg_index("--edge-shed"))
            + _replace_data("priority-gate-envoy", "envoy.yaml", envoy_yaml(edge_shed=False)))


_ENGINE_KEY_HEADER = """\
# GENERATED by k8s/generate.py -- do not edit by hand.
# The engine's own API key (llama-server --api-key, vLLM --api-key, ...) on every request
# Envoy forwards to the workers, and on the sidecar's capacity probes. Envoy reads it from
# the Secret mounted at {dir}/{item} (credential_injector, after ext_authz and ext_proc:
# the sidecar never sees it in a Check) and replaces the client's Authorization with
# `Bearer KEY`; the sidecar reads the same file (--worker-auth-file). The key is never in
# a ConfigMap, argv or a log. Create the Secret first (the key alone, no "Bearer "):
#   kubectl create secret generic {secret} --from-literal={item}="$ENGINE_KEY"
#   kubectl apply -k k8s/overlays/engine-key
# Envoy reads the file at start: after rotating the key, restart the pods
# (`kubectl rollout restart deployment/priority-gate`).
# The workers cluster speaks plain http (as the base does), so the sidecar opts in with
# --worker-auth-allow-http: inside a mesh the hop is mTLS underneath. Without a mesh, serve
# the engines over TLS (a TLS transport socket on Envoy's workers cluster) and give the
# sidecar --envoy-cluster-scheme https instead.
{preamble}
    - op: test
      path: /spec/template/spec/containers/0/name
      value: envoy
    - op: add
      path: /spec/template/spec/initContainers/0/args/-
      value: --worker-auth-file
    - op: add
      path: /spec/template/spec/initContainers/0/args/-
      value: {dir}/{item}
    - op: add
      path: /spec/template/spec/initContainers/0/args/-
      value: --worker-auth-allow-http
    - op: add
      path: /spec/template/spec/initContainers/0/volumeMounts/-
      value: {{name: engine-key, mountPath: {dir}, readOnly: true}}
    - op: add
      path: /spec/template/spec/containers/0/volumeMounts/-
      value: {{name: engine-key, mountPath: {dir}, readOnly: true}}
    - op: add
      path: /spec/template/spec/volumes/-
      value:
        name: engine-key
        secret:
          secretName: {secret}
          items:
          - {{key: {item}, path: {item}}}
"""


def engine_key_overlay_text() -> str:
    return (_ENGINE_KEY_HEADER.format(preamble=_PREAMBLE, dir=ENGINE_KEY_DIR,
                                      item=ENGINE_KEY_ITEM, secret=ENGINE_KEY_SECRET)
            + _replace_data("priority-gate-envoy", "envoy.yaml", envoy_yaml(engine_key=True)))


_POOLS_HEADER = """\
# GENERATED by k8s/generate.py -- do not edit by hand.
# Model pools (docs/reference.md "Pools"): one gateway in front of two models, a 70B chat
# model at /chat-70b/ and an 8B model at /small-8b/ (each a StatefulSet behind a headless
# Service of the same name; every other path stays on the base's `workers`, the default
# pool). Each route names its pool to the sidecar in ext_authz's per-route context
# extension `smg-pool`; each pool admits on its own workers' capacity with its own queues.
#   kubectl apply -k k8s/overlays/pools
# Over the base: two gateway replicas sharing the fleet ledger (--coordination-url); each
# pool has a ledger of its own in the one Valkey, under the fleet's keys and ACL user
# (docs/design.md "Pools in a fleet"). For one replica admitting in-process, put these
# patches over overlays/single-replica instead. Edge shedding as in the base (--edge-shed):
# each pool's route has a switch of its own, steered by that pool's queue alone.
{preamble}
"""


def pools_overlay_text() -> str:
    args = ["--worker-urls", *pool_worker_urls()]
    ops = ["    - op: add\n      path: /spec/template/spec/initContainers/0/args/-\n"
           f"      value: {arg}\n" for arg in args]
    priority = yaml.safe_load(PRIORITY.read_text(encoding="utf-8"))["data"]["priority.yaml"]
    return (_POOLS_HEADER.format(preamble=_PREAMBLE) + "".join(ops)
            + _replace_data("priority-gate-envoy", "envoy.yaml", envoy_yaml(pools=True))
            + _replace_data("priority-gate-config", "priority.yaml", priority + POOLS_PRIORITY))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="fail if the committed file is stale")
    a = p.parse_args()
    outputs = {OUT: configmap_text(), NO_EDGE_OUT: no_edge_overlay_text(),
               ENGINE_KEY_OUT: engine_key_overlay_text(), POOLS_OUT: pools_overlay_text()}
    if a.check:
        for out, text in outputs.items():
            if not out.exists() or out.read_text(encoding="utf-8") != text:
                print(f"{out} is stale: run python k8s/generate.py", file=sys.stderr)
                return 1
        return 0
    for out, text in outputs.items():
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text, encoding="utf-8")
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
