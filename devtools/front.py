"""``make front WORKERS="URL ..."``: Envoy and the sidecar in front of your own engines.

The demo's machinery (devtools.stack) without the fake fleet: a real Envoy on
127.0.0.1:10000 routing to the given workers, the sidecar reading their capacity
(``--worker-engine auto`` unless told otherwise) with the scheduler on. Serves until
Ctrl-C; whatever stops it, Envoy and the sidecar go with it (devtools.proc).

    python -m devtools.front --worker-urls http://127.0.0.1:8080 [--priority FILE]
        [--engine llamacpp] [--worker-auth-file FILE] [--jwks FILE [--jwt-issuer ISS]]
        [--no-edge-shed] [--port 10000] [-- SIDECAR ARGS]
    python -m devtools.front --llama 1      # start a llama-server on a tiny model first

Tenant identity: Envoy verifies JWTs and takes the tenant from their ``tenant`` claim.
Out of the box it trusts the demo identity (devtools/identity.py: a key pair committed
for demos, NOT for production; ``python3 -m devtools.identity acme`` prints a token)
and the default priority.yaml gives its tenants their ceilings (``acme`` interactive,
``internal-cron`` system); ``--jwks FILE`` trusts your identity provider's keys instead.
Without a token a request is tenant ``anonymous``, capped at ``default``.

``--worker-auth-file FILE``: the engines' API key (llama-server ``--api-key``, vLLM
``--api-key``...). The sidecar's capacity probes send it, and Envoy puts it on every
request it forwards (``Authorization: Bearer KEY``, replacing the client's), read from
the file: never on argv or in a log. With ``--llama N`` the llama-servers require it.

Edge shedding is on, as shipped (Envoy answers a full bulk queue's overflow with the
429 itself); ``--no-edge-shed`` opts out.

Worker host names are resolved once at start (Envoy's cluster here is STATIC); the
shipped bootstrap (envoy/render.py) and the Kubernetes manifests are the production
forms. The engine's own options (llama.cpp ``--metrics``, vLLM's max-num-seqs...) are
in docs/reference.md, "Engines".
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import socket
import sys
import tempfile
from pathlib import Path
from urllib.parse import urlsplit

from devtools import identity
from devtools.httpclient import HTTP_ERRORS
from devtools.httpclient import get as http_get
from devtools.llama import LlamaFleet
from devtools.proc import exit_on_signals, print_safely
from devtools.stack import Stack, StackConfig, serve_until_stopped

# Generous queues and no reservations: a first look at one's own engines should admit
# what they can run and queue the rest, not shed because the fleet is small. The demo
# identity's tenants get their ceilings (devtools/identity.py), so a token's request is
# admitted at the class it asks for.
DEFAULT_PRIORITY = """\
classes:
  system: {reserved_floor: 0}
  interactive: {reserved_floor: 0, reserved_per_slot: 0.0}
  default: {reserved_per_slot: 0.0}
tenant_policies:
""" + "".join(f'  "{t}": {{max_class: {c}}}\n' for t, c in identity.TENANTS.items())


class ExternalWorker:
    """A worker somebody else runs: only its address and whether it answered /health."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname or parts.path not in ("", "/"):
            raise ValueError(f"worker URL must be http://HOST:PORT, got {url!r}")
        self.url = url.rstrip("/")
        self.port = parts.port or 80
        # Envoy's cluster is STATIC: an address, resolved once here.
        self.host = str(socket.getaddrinfo(parts.hostname, self.port, socket.AF_INET,
                                           socket.SOCK_STREAM)[0][4][0])
        self.healthy = False


class ExternalWorkers:
    """Workers already running elsewhere: a fleet :class:`devtools.stack.Stack` can front."""

    def __init__(self, urls: list[str]) -> None:
        self.workers = [ExternalWorker(u) for u in urls]

    async def start(self) -> None:
        for w in self.workers:
            with contextlib.suppress(*HTTP_ERRORS):
                status, _ = await http_get(f"{w.url}/health", 3.0)
                w.healthy = status == 200
        if not any(w.healthy for w in self.workers):
            raise RuntimeError("no worker answered 200 on /health: "
                               + " ".join(w.url for w in self.workers))

    async def stop(self) -> None:
        pass

    @property
    def urls(self) -> list[str]:
        return [w.url for w in self.workers]

    @property
    def addresses(self) -> list[tuple[str, int]]:
        return [(w.host, w.port) for w in self.workers]


def build(args: argparse.Namespace) -> Stack:
    priority = Path(args.priority).read_text() if args.priority else DEFAULT_PRIORITY
    sidecar_args = ["--worker-engine", args.engine, "--log-format", "console", *args.sidecar]
    key_file: Path | None = None
    if args.worker_auth_file:
        key_file = Path(args.worker_auth_file).resolve()
        if not key_file.read_text().strip():  # read here: a clear error, not Envoy's
            raise ValueError(f"--worker-auth-file {key_file} holds no key")
        # The front reaches its engines over plain http only (as its Envoy does): it opts in.
        sidecar_args += ["--worker-auth-file", str(key_file), "--worker-auth-allow-http"]
    jwks = Path(args.jwks).read_text() if args.jwks else identity.public_jwks()
    issuer = args.jwt_issuer if args.jwks else identity.ISSUER
    config = StackConfig(priority_yaml=priority, sidecar_args=sidecar_args,
                         health_interval_secs=1.0, flush_interval_secs=2.0, lease_secs=15.0,
                         jwt_jwks=jwks, jwt_issuer=issuer, edge_shed=args.edge_shed,
                         engine_key_file=str(key_file) if key_file is not None else None)
    if not args.free_ports:
        config.listen_port, config.admin_port = args.port, args.admin_port
        config.grpc_port, config.http_port = 9001, 9090
    workdir = Path(tempfile.mkdtemp(prefix="smg-front-"))
    engines: LlamaFleet | ExternalWorkers
    if args.llama:
        engines = LlamaFleet(args.llama, workdir=workdir / "llama", parallel=args.llama_slots,
                             api_key_file=key_file)
    else:
        engines = ExternalWorkers(args.worker_urls)
    config.workers = len(engines.workers)
    return Stack(config, workdir=workdir, engines=engines)


def banner(stack: Stack, args: argparse.Namespace) -> str:
    """What is up, where the live config is, who the tenants are, and what to try."""
    c = stack.config
    port = stack.listen_port
    if args.jwks:
        tenants = (f"JWT verified against {args.jwks}; the tenant is the token's "
                   "'tenant' claim")
    else:
        tenants = ("JWT of the demo identity (devtools/identity.py, NOT for production): "
                   + ", ".join(f"{t} ({cls})" for t, cls in identity.TENANTS.items()))
    key = (f"Envoy sends the key in {c.engine_key_file} upstream; the probes too"
           if c.engine_key_file else "none (--worker-auth-file FILE)")
    edge = ("on: Envoy answers a full bulk queue's overflow with the 429 itself "
            "(--no-edge-shed opts out)" if c.edge_shed else "off (--no-edge-shed)")
    return f"""
priority-gate is in front of {' '.join(stack.fleet.urls)}
  Envoy      http://127.0.0.1:{port}   (admin http://127.0.0.1:{stack.admin_port})
  sidecar    metrics http://127.0.0.1:{stack.http_port}/metrics   logs {stack.sidecar_log}
  config     {stack.priority_path}
             live: edit it and the sidecar reloads it within about 2 s
             ({'a copy of ' + args.priority if args.priority else 'the default: no reservations'})
  tenants    {tenants}; without a token: anonymous (default)
  engine key {key}
  edge shed  {edge}

Try:
  curl -s 127.0.0.1:{port}/v1/chat/completions -H 'x-smg-priority: bulk' \\
       -d '{{"messages":[{{"role":"user","content":"hi"}}],"max_tokens":16}}'
  # as tenant acme (ceiling interactive; from the repository root):
  curl -s 127.0.0.1:{port}/v1/chat/completions -H 'x-smg-priority: interactive' \\
       -H "authorization: Bearer $(python3 -m devtools.identity acme)" \\
       -d '{{"messages":[{{"role":"user","content":"hi"}}],"max_tokens":16}}'
  curl -s 127.0.0.1:{stack.http_port}/metrics | grep -E '^smg_sidecar_(capacity|worker_capacity)'
"""


async def serve(stack: Stack, args: argparse.Namespace) -> None:
    await stack.start()
    print_safely(banner(stack, args))
    if args.exit_after_ready:
        return
    print_safely("serving; Ctrl-C stops Envoy and the sidecar.")
    await asyncio.Event().wait()


async def main_async(args: argparse.Namespace) -> int:
    try:
        stack = build(args)
    except (OSError, ValueError) as exc:
        print(f"front: {exc}", file=sys.stderr)
        return 2
    return await serve_until_stopped(stack, serve(stack, args), "front")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m devtools.front", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--worker-urls", nargs="+", metavar="URL",
                     help="the engines' base URLs (http://HOST:PORT)")
    src.add_argument("--llama", type=int, metavar="N",
                     help="start N llama-servers on a tiny random model (make llama-server)")
    p.add_argument("--llama-slots", type=int, default=4, help="--parallel of each llama-server")
    p.add_argument("--engine", default="auto",
                   choices=("auto", "sglang", "vllm", "tgi", "llamacpp", "generic"))
    p.add_argument("--priority", metavar="FILE", help="priority.yaml (default: no reservations)")
    p.add_argument("--worker-auth-file", metavar="FILE",
                   help="the engines' API key: the capacity probes send it and Envoy puts "
                        "it on every upstream request (never on argv); with --llama the "
                        "llama-servers require it")
    p.add_argument("--jwks", metavar="FILE",
                   help="trust this JWKS (your identity provider's public keys) instead of "
                        "the demo identity")
    p.add_argument("--jwt-issuer", metavar="ISS", help="with --jwks: only tokens of this iss")
    p.add_argument("--edge-shed", action=argparse.BooleanOptionalAction, default=True,
                   help="edge shedding on both sides, as shipped (--no-edge-shed: off)")
    p.add_argument("--port", type=int, default=10000, help="Envoy's listener")
    p.add_argument("--admin-port", type=int, default=9901)
    p.add_argument("--free-ports", action="store_true", help="ephemeral ports (tests)")
    p.add_argument("--exit-after-ready", action="store_true", help="stop once serving (tests)")
    p.add_argument("sidecar", nargs="*", help="after --: more sidecar flags")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    exit_on_signals()
    return asyncio.run(main_async(parse_args(argv)))


if __name__ == "__main__":
    raise SystemExit(main())
