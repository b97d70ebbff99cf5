#!/usr/bin/env python3
"""Render envoy/envoy.yaml.tmpl into an Envoy bootstrap (stdlib + pyyaml only).

The template keeps its comments: placeholders are filled with ``string.Template`` and
optional blocks (``#@begin <name>`` ... ``#@end <name>``) are kept or dropped whole.

    python envoy/render.py --listen-port 10000 --admin-port 9901 --sidecar 127.0.0.1:9001 \
        --workers 127.0.0.1:8081,127.0.0.1:8082 --authz-timeout 310 --flush-interval 5 \
        [--jwt-jwks FILE [--jwt-issuer ISS] | --jwt-secret S] [--engine-key-file PATH] \
        [--no-preemption] [--no-edge-shed] --out envoy/envoy.yaml \
        [--pool big /big/ 127.0.0.1:8091,127.0.0.1:8092 ...]
    (--sidecar unix:///run/priority-gate/grpc.sock: the sidecar on a Unix socket)

Edge shedding is on by default (the sidecar then runs with ``--edge-shed``);
``--no-edge-shed`` opts out. ``--jwt-jwks devtools/demo-jwks.json --jwt-issuer
priority-gate-demo`` trusts the demo identity (devtools/identity.py: NOT for production).
``--engine-key-file PATH``: Envoy puts the engine's API key, read from PATH (a mounted
Secret), on every upstream request as ``Authorization: Bearer KEY``.
"""

from __future__ import annotations

import argparse
import base64
import ipaddress
import json
import math
import re
import string
import sys
from collections.abc import Sequence
from pathlib import Path

import yaml

TEMPLATE_PATH: Path = Path(__file__).with_name("envoy.yaml.tmpl")

# Margin added to the authz timeout when no stream idle timeout is given; the idle
# timeout is never below DEFAULT_MIN_STREAM_IDLE_SECS (slow prefill / token gaps).
STREAM_IDLE_MARGIN_SECS: float = 30.0
DEFAULT_MIN_STREAM_IDLE_SECS: float = 300.0
EXT_PROC_MESSAGE_TIMEOUT_SECS: float = 1.0
# Edge shedding (--edge-shed): the sidecar's own queue-full reply for bulk, byte for byte
# (sidecar.responses; tests/test_edge.py compares them), and the batch interval of the
# edge-shed access log (sidecar.edge.SHED_LOG_FLUSH_SECS).
EDGE_REPLY_BODY: str = ('{"error":{"type":"Too Many Requests","code":"scheduler_queue_full",'
                        '"message":"The \'bulk\' priority queue is full; retry later",'
                        '"param":null}}')
EDGE_LOG_FLUSH_SECS: float = 0.25
# The edge route reads a request's body before answering (so the connection stays open);
# a larger body is answered 413 by Envoy's buffer filter instead of the 429.
EDGE_MAX_BODY_BYTES: int = 8 * 1024 * 1024

# Pools (the sidecar's --worker-urls POOL=URL): a route per pool, matched on a path
# prefix (rewritten to "/"), to a cluster of its own, naming the pool to the sidecar in
# ext_authz's per-route context extension. Names as the sidecar accepts them.
_POOL_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,30}$")
_POOL_PREFIX_RE = re.compile(r"^/[A-Za-z0-9._~/-]*/$")
_ROUTES = "              routes:\n"
_DEFAULT_ROUTE = '              - match: {prefix: "/"}\n'
_WORKERS_CLUSTER = "  - name: workers\n"
_POOL_ROUTE = """\
              # Pool ${name}: the route, never the client, names the request's pool.
              - name: smg_pool_${name}
                match: {prefix: "${prefix}"}
                route:
                  cluster: pool_${name}
                  prefix_rewrite: "/"
                  timeout: 0s
                  retry_policy: {retry_on: "reset,connect-failure", num_retries: 2}
                typed_per_filter_config:
                  envoy.filters.http.ext_authz:
                    "@type": ${per_route_type}
                    check_settings:
                      context_extensions: {smg-pool: ${name}}
"""

# With --edge-shed, each pool's edge route (ahead of the pool's own route) and shed logger
# are the template's default-pool ones with the pool's prefix, runtime key, route name and
# a stream mark naming the pool (sidecar/edge.py: runtime_key, POOL_MARK_KEY).
_EDGE_ROUTE = "              - name: smg_edge_shed_bulk\n"
_EDGE_LOGGER = ("          - name: envoy.access_loggers.http_grpc\n"
                "            filter:\n              extension_filter:\n")
_EDGE_MARK = "initial_metadata: [{key: x-smg-edge-shed, value: bulk}]"
_EDGE_STATIC_KEY = "      smg.edge.shed.bulk: 0\n"
_ROUTE_CONFIG = "          route_config:\n"

_PER_ROUTE_TYPE = ("type.googleapis.com/envoy.extensions.filters.http.ext_authz.v3."
                   "ExtAuthzPerRoute")

_BLOCK_RE = re.compile(r"^#@(begin|end) ([a-z_]+)\s*$")
_HEADER_RE = re.compile(r"^[a-z0-9!#$%&'*+.^_`|~-]+$")


def _duration(secs: float) -> str:
    """Format seconds as a protobuf Duration string Envoy accepts ("310s", "0.25s")."""
    if not math.isfinite(secs) or secs < 0:
        raise ValueError(f"duration must be finite and >= 0, got {secs!r}")
    text = f"{secs:.9f}".rstrip("0").rstrip(".")
    return f"{text or '0'}s"


def _port(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
        raise ValueError(f"{name} must be a TCP port 1..65535, got {value!r}")
    return value


def _ip(name: str, value: str) -> str:
    """STATIC clusters need literal IPs (no DNS)."""
    try:
        return str(ipaddress.ip_address(value))
    except ValueError as exc:
        raise ValueError(f"{name} must be an IP address (STATIC cluster), got {value!r}") from exc


def _positive(name: str, value: float) -> float:
    if isinstance(value, bool) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


def _jwks_inline(secret: str) -> str:
    """JWKS with one HS256 symmetric key, as a YAML (JSON) double-quoted scalar."""
    if not secret:
        raise ValueError("jwt_hs256_secret must be non-empty")
    k = base64.urlsafe_b64encode(secret.encode()).rstrip(b"=").decode()
    jwks = {"keys": [{"kty": "oct", "alg": "HS256", "kid": "smg-hs256", "k": k}]}
    return json.dumps(json.dumps(jwks, separators=(",", ":")))


# JWK members that hold a private key (RFC 7518, 6.2.2 and 6.3.2; "k" is a shared secret).
_PRIVATE_JWK_MEMBERS = frozenset({"d", "p", "q", "dp", "dq", "qi", "oth", "k"})


def _public_jwks_inline(jwks: str) -> str:
    """A JWKS of public keys, checked and compacted, as a YAML (JSON) double-quoted scalar.
    A private member is refused: the rendered config is no place for a signing key."""
    try:
        doc = json.loads(jwks)
    except ValueError as exc:
        raise ValueError(f"jwt_jwks is not JSON: {exc}") from None
    keys = doc.get("keys") if isinstance(doc, dict) else None
    if not isinstance(keys, list) or not keys or not all(isinstance(k, dict) for k in keys):
        raise ValueError('jwt_jwks must be a JWKS: {"keys": [a JWK, ...]}')
    for i, key in enumerate(keys):
        private = sorted(_PRIVATE_JWK_MEMBERS & set(key))
        if private:
            raise ValueError(f"jwt_jwks key {i} holds private members {private}: "
                             "give the public keys only")
    return json.dumps(json.dumps(doc, separators=(",", ":")))


def _select_blocks(text: str, enabled: set[str]) -> str:
    """Keep the lines of enabled ``#@begin name``/``#@end name`` blocks, drop the others."""
    out: list[str] = []
    stack: list[tuple[str, bool]] = []
    for lineno, line in enumerate(text.splitlines(keepends=True), 1):
        m = _BLOCK_RE.match(line)
        if m:
            kind, name = m.groups()
            if kind == "begin":
                stack.append((name, name in enabled))
            elif not stack or stack[-1][0] != name:
                raise ValueError(f"template line {lineno}: unmatched #@end {name}")
            else:
                stack.pop()
            continue
        if all(keep for _, keep in stack):
            out.append(line)
    if stack:
        raise ValueError(f"template: unclosed #@begin {stack[-1][0]}")
    return "".join(out)


def render(
    *,
    listen_port: int,
    admin_port: int,
    sidecar_host: str,
    sidecar_port: int,
    workers: list[tuple[str, int]],
    authz_timeout_secs: float,
    flush_interval_secs: float,
    health_interval_secs: float = 1.0,
    preemption: bool = True,
    tenant_header: str = "x-smg-tenant",
    jwt_hs256_secret: str | None = None,
    jwt_jwks: str | None = None,
    jwt_issuer: str | None = None,
    stream_idle_timeout_secs: float | None = None,
    sidecar_pipe: str | None = None,
    edge_shed: bool = True,
    engine_key_file: str | None = None,
    pools: Sequence[tuple[str, str, list[tuple[str, int]]]] = (),
) -> str:
    """Return the Envoy bootstrap YAML (comments preserved) for these settings.

    ``sidecar_pipe``: reach the sidecar on this Unix socket path (its
    ``--grpc-listen unix://PATH``) instead of ``sidecar_host:sidecar_port``.
    ``edge_shed`` (default on): the edge-shed route, runtime layers and access log (the
    sidecar's ``--edge-shed``; sidecar/edge.py); False opts out.
    ``jwt_jwks``: jwt_authn trusting this JWKS (JSON text, public keys only), tokens of
    ``jwt_issuer`` if given; ``jwt_hs256_secret`` instead: one shared HS256 secret (tests).
    ``engine_key_file``: the engine's API key, read by Envoy from this path, put on every
    upstream request as ``Authorization: Bearer KEY`` (credential_injector).
    ``pools``: (name, path prefix, workers) per pool (the sidecar's ``--worker-urls
    POOL=URL``): a route matching the prefix, to a cluster of the pool's workers, with
    ``smg-pool: name`` in ext_authz's context extensions. Other paths stay on the
    default pool's ``workers`` cluster.

    Raises ValueError on invalid input (bad port/IP, no workers, idle timeout not above
    the authz timeout, ...). The result is also parsed with yaml.safe_load as a check.
    """
    _port("listen_port", listen_port)
    _port("admin_port", admin_port)
    if listen_port == admin_port:
        raise ValueError("listen_port and admin_port must differ")
    if sidecar_pipe is None:
        _port("sidecar_port", sidecar_port)
        sidecar_address = (f"{{socket_address: {{address: {_ip('sidecar_host', sidecar_host)}, "
                           f"port_value: {sidecar_port}}}}}")
    else:
        if not sidecar_pipe.startswith("/") or "\x00" in sidecar_pipe:
            raise ValueError(f"sidecar_pipe must be an absolute path, got {sidecar_pipe!r}")
        sidecar_address = f"{{pipe: {{path: {json.dumps(sidecar_pipe)}}}}}"
    if not workers:
        raise ValueError("workers must list at least one (ip, port)")
    authz = _positive("authz_timeout_secs", authz_timeout_secs)
    flush = _positive("flush_interval_secs", flush_interval_secs)
    health = _positive("health_interval_secs", health_interval_secs)
    tenant = tenant_header.strip().lower()
    if not _HEADER_RE.match(tenant) or tenant.startswith(":"):
        raise ValueError(f"tenant_header is not a valid header name: {tenant_header!r}")
    if stream_idle_timeout_secs is None:
        idle = max(authz + STREAM_IDLE_MARGIN_SECS, DEFAULT_MIN_STREAM_IDLE_SECS)
    else:
        idle = _positive("stream_idle_timeout_secs", stream_idle_timeout_secs)
        if idle <= authz:
            raise ValueError(
                f"stream_idle_timeout_secs ({idle}) must exceed authz_timeout_secs ({authz}): "
                "a request queued in ext_authz moves no bytes and would be cut off"
            )

    endpoint_lines = []
    for i, (host, port) in enumerate(workers):
        ip = _ip(f"workers[{i}] host", host)
        _port(f"workers[{i}] port", port)
        endpoint_lines.append(
            "        - endpoint: {address: {socket_address: "
            f"{{address: {ip}, port_value: {port}}}}}}}"
        )

    enabled: set[str] = set()
    jwks = ""
    if preemption:
        enabled.add("preemption")
    if edge_shed:
        enabled.add("edge")
    if jwt_hs256_secret is not None and jwt_jwks is not None:
        raise ValueError("give jwt_jwks or jwt_hs256_secret, not both")
    if jwt_hs256_secret is not None:
        enabled.add("jwt")
        jwks = _jwks_inline(jwt_hs256_secret)
    elif jwt_jwks is not None:
        enabled.add("jwt")
        jwks = _public_jwks_inline(jwt_jwks)
    issuer = ""
    if jwt_issuer is not None:
        if "jwt" not in enabled:
            raise ValueError("jwt_issuer needs jwt_jwks or jwt_hs256_secret")
        if not jwt_issuer or any(c in jwt_issuer for c in "\r\n\x00"):
            raise ValueError(f"jwt_issuer must be one non-empty line, got {jwt_issuer!r}")
        enabled.add("jwt_issuer")
        issuer = json.dumps(jwt_issuer)
    key_file = ""
    if engine_key_file is not None:
        if not engine_key_file.startswith("/") or any(c in engine_key_file for c in "\r\n\x00"):
            raise ValueError(f"engine_key_file must be an absolute path, got {engine_key_file!r}")
        enabled.add("engine_key")
        key_file = json.dumps(engine_key_file)

    text = _select_blocks(TEMPLATE_PATH.read_text(encoding="utf-8"), enabled)
    pool_endpoints: dict[str, str] = {}
    if pools:
        text, pool_endpoints = _add_pools(text, pools, edge_shed)
    rendered = string.Template(text).substitute(
        listen_port=listen_port,
        admin_port=admin_port,
        sidecar_address=sidecar_address,
        authz_timeout=_duration(authz),
        flush_interval=_duration(flush),
        health_interval=_duration(health),
        stream_idle_timeout=_duration(idle),
        ext_proc_message_timeout=_duration(EXT_PROC_MESSAGE_TIMEOUT_SECS),
        tenant_header=tenant,
        jwks_inline=jwks,
        jwt_issuer=issuer,
        engine_key_file=key_file,
        worker_endpoints="\n".join(endpoint_lines),
        edge_reply_body=json.dumps(EDGE_REPLY_BODY),
        edge_log_flush=_duration(EDGE_LOG_FLUSH_SECS),
        edge_max_body=EDGE_MAX_BODY_BYTES,
        **pool_endpoints,
    )
    yaml.safe_load(rendered)  # fail here, not in Envoy, if a substitution broke the YAML
    return rendered


def _add_pools(text: str, pools: Sequence[tuple[str, str, list[tuple[str, int]]]],
               edge_shed: bool = False) -> tuple[str, dict[str, str]]:
    """The template with a route and a cluster per pool (and with ``edge_shed``, an edge
    route, a switch and a shed logger per pool); the pools' endpoint lines."""
    names = [p[0] for p in pools]
    if len(set(names)) != len(names) or "default" in names:
        raise ValueError(f"pool names must be unique and not 'default', got {names}")
    # The route table's catch-all, not jwt_authn's rule of the same text further down.
    routes_at = text.find(_ROUTES)
    if (routes_at < 0 or _DEFAULT_ROUTE not in text[routes_at:]
            or text.count(_WORKERS_CLUSTER) != 1):
        raise ValueError("template: the default route or the workers cluster moved")
    # The workers cluster (last in the template) is the pattern of each pool's cluster.
    block = [line for line in text[text.index(_WORKERS_CLUSTER):].splitlines()
             if not line.lstrip().startswith("#")]
    edge_route = edge_logger = ""
    if edge_shed:
        edge_route, edge_logger = _edge_blocks(text)
    routes, clusters, endpoints, keys, loggers = [], [], {}, [], []
    for i, (name, prefix, workers) in enumerate(pools):
        if not _POOL_NAME_RE.match(name):
            raise ValueError(f"pool name {name!r}: 1..31 of a-z, 0-9, '_', '-'")
        if not _POOL_PREFIX_RE.match(prefix):
            raise ValueError(f"pool {name}: prefix {prefix!r} must start and end with '/'")
        if not workers:
            raise ValueError(f"pool {name}: no workers")
        if edge_shed:
            key, route_name = f"smg.edge.shed.pool.{name}.bulk", f"smg_edge_shed_pool_{name}_bulk"
            mark = _EDGE_MARK[:-1] + f", {{key: x-smg-edge-pool, value: {name}}}]"
            routes.append(edge_route.replace("smg_edge_shed_bulk", route_name)
                          .replace('prefix: "/"', f'prefix: "{prefix}"')
                          .replace("smg.edge.shed.bulk", key))
            keys.append(f"      {key}: 0\n")
            loggers.append(edge_logger.replace("smg_edge_shed_bulk", route_name)
                           .replace(_EDGE_MARK, mark))
        routes.append(string.Template(_POOL_ROUTE).substitute(name=name, prefix=prefix,
                                                          per_route_type=_PER_ROUTE_TYPE))
        clusters.append("\n".join(block).replace("name: workers", f"name: pool_{name}")
                        .replace("${worker_endpoints}", f"${{pool{i}_endpoints}}"))
        lines = []
        for j, (host, port) in enumerate(workers):
            ip = _ip(f"pool {name} workers[{j}] host", host)
            _port(f"pool {name} workers[{j}] port", port)
            lines.append("        - endpoint: {address: {socket_address: "
                         f"{{address: {ip}, port_value: {port}}}}}}}")
        endpoints[f"pool{i}_endpoints"] = "\n".join(lines)
    # First in the table: ahead of the default pool's edge route, which matches every path.
    at = routes_at + len(_ROUTES)
    text = text[:at] + "".join(routes) + text[at:]
    if edge_shed:
        at = text.index(_ROUTE_CONFIG)
        text = text[:at] + "".join(loggers) + text[at:]
        at = text.index(_EDGE_STATIC_KEY) + len(_EDGE_STATIC_KEY)
        text = text[:at] + "".join(keys) + text[at:]
    return text.rstrip("\n") + "\n" + "\n".join(clusters) + "\n", endpoints


def _edge_blocks(text: str) -> tuple[str, str]:
    """The template's edge route and edge-shed logger (comment lines left out)."""
    if (text.count(_EDGE_STATIC_KEY) != 1 or text.count(_ROUTE_CONFIG) != 1
            or text.count(_EDGE_ROUTE) != 1 or text.count(_EDGE_MARK) != 1):
        raise ValueError("template: the edge path moved")
    route_at = text.index(_EDGE_ROUTE)
    route = text[route_at:text.index(_DEFAULT_ROUTE, route_at)]
    config_at = text.index(_ROUTE_CONFIG)
    logger = text[text.rindex(_EDGE_LOGGER, 0, config_at):config_at]
    if _EDGE_MARK not in logger:
        raise ValueError("template: the edge path moved")

    def code(block: str) -> str:
        return "".join(ln for ln in block.splitlines(keepends=True)
                       if not ln.lstrip().startswith("#"))
    return code(route), code(logger)


def _host_port(spec: str) -> tuple[str, int]:
    host, sep, port = spec.strip().rpartition(":")
    if not sep or not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {spec!r}")
    return host.strip("[]"), int(port)


def _sidecar(spec: str) -> tuple[str, int] | str:
    """HOST:PORT, or ``unix:///path`` (the sidecar's ``--grpc-listen`` Unix socket)."""
    if spec.startswith("unix://"):
        return spec[len("unix://"):]
    return _host_port(spec)


def _workers(spec: str) -> list[tuple[str, int]]:
    return [_host_port(s) for s in spec.split(",") if s.strip()]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Render the Envoy bootstrap for priority-gate.")
    p.add_argument("--listen-port", type=int, required=True)
    p.add_argument("--admin-port", type=int, required=True)
    p.add_argument("--sidecar", type=_sidecar, required=True, metavar="HOST:PORT|unix:///PATH")
    p.add_argument("--workers", type=_workers, required=True, metavar="HOST:PORT[,HOST:PORT...]")
    p.add_argument("--authz-timeout", type=float, required=True, metavar="SECS")
    p.add_argument("--flush-interval", type=float, required=True, metavar="SECS")
    p.add_argument("--health-interval", type=float, default=1.0, metavar="SECS")
    p.add_argument("--stream-idle-timeout", type=float, default=None, metavar="SECS")
    p.add_argument("--tenant-header", default="x-smg-tenant")
    jwt = p.add_mutually_exclusive_group()
    jwt.add_argument("--jwt-jwks", metavar="FILE", default=None,
                     help="enable jwt_authn trusting this JWKS file (public keys; the demo's "
                          "devtools/demo-jwks.json is NOT for production)")
    jwt.add_argument("--jwt-secret", default=None,
                     help="enable jwt_authn with this HS256 secret (tests)")
    p.add_argument("--jwt-issuer", default=None, metavar="ISS",
                   help="accept only tokens of this issuer (iss claim)")
    p.add_argument("--engine-key-file", default=None, metavar="PATH",
                   help="Envoy puts the engine's API key read from PATH (its path in Envoy's "
                        "container) on upstream requests as Authorization: Bearer KEY")
    p.add_argument("--no-preemption", action="store_true", help="omit the ext_proc filter")
    p.add_argument("--edge-shed", action=argparse.BooleanOptionalAction, default=True,
                   help="Envoy answers the share of bulk the sidecar sets (sidecar "
                        "--edge-shed); on by default, --no-edge-shed opts out")
    p.add_argument("--pool", nargs=3, action="append", default=[],
                   metavar=("NAME", "PREFIX", "HOST:PORT[,HOST:PORT...]"),
                   help="a pool's route (path prefix, rewritten to /) and workers; "
                        "repeatable (sidecar --worker-urls NAME=URL)")
    p.add_argument("--out", default="-", help="output file ('-' = stdout)")
    a = p.parse_args(argv)
    pipe = a.sidecar if isinstance(a.sidecar, str) else None
    sidecar_host, sidecar_port = ("127.0.0.1", 1) if pipe is not None else a.sidecar
    try:
        jwks = Path(a.jwt_jwks).read_text(encoding="utf-8") if a.jwt_jwks else None
        text = render(
            listen_port=a.listen_port,
            admin_port=a.admin_port,
            sidecar_host=sidecar_host,
            sidecar_port=sidecar_port,
            sidecar_pipe=pipe,
            workers=a.workers,
            authz_timeout_secs=a.authz_timeout,
            flush_interval_secs=a.flush_interval,
            health_interval_secs=a.health_interval,
            preemption=not a.no_preemption,
            tenant_header=a.tenant_header,
            jwt_hs256_secret=a.jwt_secret,
            jwt_jwks=jwks,
            jwt_issuer=a.jwt_issuer,
            stream_idle_timeout_secs=a.stream_idle_timeout,
            edge_shed=a.edge_shed,
            engine_key_file=a.engine_key_file,
            pools=[(n, prefix, _workers(w)) for n, prefix, w in a.pool],
        )
    except (OSError, ValueError, argparse.ArgumentTypeError) as exc:
        p.error(str(exc))
    if a.out == "-":
        sys.stdout.write(text)
    else:
        Path(a.out).write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
