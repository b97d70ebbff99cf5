"""``make run``: two fake workers, the sidecar with the scheduler on, and Envoy.

Ports: Envoy 127.0.0.1:10000 (admin 9901), sidecar gRPC 9001 and metrics 9090,
workers 8081-8082. After start-up a short burst shows admission, queueing and
shedding by class; then it serves until Ctrl-C.

Tenant identity: the demo's Envoy verifies JWTs of the demo identity
(devtools/identity.py: an RS256 key pair committed for the demo only, NOT for
production) and takes the tenant from their ``tenant`` claim; ``demo-priority.yaml``
gives ``acme`` the ceiling ``interactive`` and ``internal-cron`` ``system``
(``--token TENANT`` prints a token). Without a token a request is tenant
``anonymous``, whose ceiling is ``default``.

Edge shedding is on, as the product ships: Envoy answers the overflow of a full bulk
queue with the 429 itself (``--no-edge-shed`` opts out, for comparison).

The sidecar watches a copy of ``demo-priority.yaml`` whose path the banner prints:
edit that file and the sidecar reloads it.

Whatever stops it (Ctrl-C, SIGTERM or SIGHUP at any moment, a closed stdout, even
SIGKILL) the sidecar and Envoy go with it: see ``devtools.proc``.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import hashlib
import hmac
import json
import time
from collections import Counter
from pathlib import Path

from devtools import identity
from devtools.httpclient import request
from devtools.proc import exit_on_signals, print_safely
from devtools.stack import Stack, StackConfig, serve_until_stopped

PRIORITY = (Path(__file__).parent / "demo-priority.yaml").read_text()


def make_token(tenant: str, secret: str) -> str:
    """An HS256 token for a test stack rendered with ``StackConfig(jwt_secret=secret)``;
    the demo itself trusts the demo identity's RS256 key (:func:`identity.token`)."""

    def b64(data: bytes) -> str:
        return base64.urlsafe_b64encode(data).rstrip(b"=").decode()

    head = b64(json.dumps({"alg": "HS256", "typ": "JWT", "kid": "smg-hs256"}).encode())
    body = b64(json.dumps({"tenant": tenant, "exp": int(time.time()) + 86400}).encode())
    sig = hmac.new(secret.encode(), f"{head}.{body}".encode(), hashlib.sha256).digest()
    return f"{head}.{body}.{b64(sig)}"


async def burst(stack: Stack) -> None:
    """24 bulk + 6 interactive (tenant acme) requests at once, 1.5 s each."""
    acme = {"authorization": f"Bearer {identity.token('acme')}"}

    async def one(cls: str) -> tuple[str, str]:
        headers = {"x-smg-priority": cls, "x-fake-service-time": "1.5"}
        if cls == "interactive":
            headers |= acme
        r = await request(stack.listen_port, headers=headers, timeout=30)
        return cls, str(r.status) + (f" {r.headers.get('x-smg-error-code')}"
                                    if r.status != 200 else " ok")

    print_safely("\nburst: 24 bulk + 6 interactive requests at once (capacity 8, 1.5 s each) ...")
    jobs = [one("bulk") for _ in range(24)]
    await asyncio.sleep(0)
    jobs += [one("interactive") for _ in range(6)]
    t0 = time.monotonic()
    results = await asyncio.gather(*jobs)
    counts = Counter(results)
    for (cls, outcome), n in sorted(counts.items()):
        print_safely(f"  {cls:<12} {outcome:<28} x{n}")
    print_safely(f"  (done in {time.monotonic() - t0:.1f} s: interactive goes ahead of queued "
                 "bulk, uses its reservation and may preempt bulk that has not answered yet "
                 "(503 scheduler_preempted); bulk fills its share and queue, the rest is shed)")


def demo_config(free_ports: bool = False, edge_shed: bool = True) -> StackConfig:
    """The demo's stack; ``free_ports`` (for tests) picks ephemeral ports instead;
    ``edge_shed=False``: without the edge path on either side (``--no-edge-shed``)."""
    config = StackConfig(
        workers=2, max_running_requests=4, service_time=0.2, priority_yaml=PRIORITY,
        jwt_jwks=identity.public_jwks(), jwt_issuer=identity.ISSUER,
        flush_interval_secs=2.0, lease_secs=15.0, health_interval_secs=1.0,
        envoy_concurrency=2, edge_shed=edge_shed, sidecar_args=["--log-format", "console"])
    if not free_ports:
        config.listen_port, config.admin_port = 10000, 9901
        config.grpc_port, config.http_port, config.worker_base_port = 9001, 9090, 8081
    return config


async def show(stack: Stack, args: argparse.Namespace) -> None:
    """Start-up, banner, burst, then serve until stopped (cancelled)."""
    await stack.start()
    print_safely(banner(stack))
    if not args.no_burst:
        await burst(stack)
    if args.exit_after_burst:
        return
    print_safely("\nserving; Ctrl-C stops everything.")
    await asyncio.Event().wait()


def banner(stack: Stack) -> str:
    """What is up, where the live config is, who the tenants are, and what to try."""
    config = stack.config
    port = stack.listen_port
    edge = ("on: Envoy answers a full bulk queue's overflow with the 429 itself "
            "(--no-edge-shed opts out)" if config.edge_shed else
            "off (--no-edge-shed): every bulk 429 is the sidecar's")
    tenants = ", ".join(f"{t} ({c})" for t, c in identity.TENANTS.items())
    return f"""
priority-gate demo is up.
  Envoy      http://127.0.0.1:{port}   (admin http://127.0.0.1:{stack.admin_port})
  sidecar    metrics http://127.0.0.1:{stack.http_port}/metrics   logs {stack.sidecar_log}
  workers    {' '.join(stack.fleet.urls)}  (capacity {config.workers} x 4)
  config     {stack.priority_path}
             live: edit it and the sidecar reloads it within about 2 s
  tenants    JWT of the demo identity (devtools/identity.py, NOT for production):
             {tenants}; without a token: anonymous (default)
  edge shed  {edge}

Try:
  curl -si 127.0.0.1:{port}/v1/chat/completions -H 'x-smg-priority: bulk' \\
       -d '{{"model":"demo","messages":[{{"role":"user","content":"hi"}}]}}'
  # as tenant acme (ceiling interactive), streaming (from the repository root):
  curl -sN 127.0.0.1:{port}/v1/chat/completions -H 'x-smg-priority: interactive' \\
       -H "authorization: Bearer $(python3 -m devtools.identity acme)" \\
       -d '{{"model":"demo","stream":true,"messages":[{{"role":"user","content":"hi"}}]}}'
  curl -s 127.0.0.1:{stack.http_port}/metrics | grep ^smg_
"""


async def main_async(args: argparse.Namespace) -> int:
    stack = Stack(demo_config(args.free_ports, edge_shed=args.edge_shed))
    # Every stop signal ends the demo the same way, start-up included.
    return await serve_until_stopped(stack, show(stack, args), "demo")


def main(argv: list[str] | None = None) -> int:
    exit_on_signals()  # until the event loop installs its own handlers
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--no-burst", action="store_true", help="skip the start-up burst")
    p.add_argument("--exit-after-burst", action="store_true", help="stop after the burst")
    p.add_argument("--token", metavar="TENANT",
                   help="print a token of the demo identity for TENANT and exit "
                        "(= python3 -m devtools.identity TENANT)")
    p.add_argument("--edge-shed", action=argparse.BooleanOptionalAction, default=True,
                   help="edge shedding on both sides, as shipped (--no-edge-shed: off, for "
                        "comparison)")
    p.add_argument("--free-ports", action="store_true",
                   help="ephemeral ports instead of the fixed ones (tests)")
    args = p.parse_args(argv)
    if args.token:
        print_safely(identity.token(args.token))
        return 0
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    raise SystemExit(main())
