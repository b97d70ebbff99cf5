"""The demo identity: one RS256 key pair whose tokens every shipped example accepts.

NOT FOR PRODUCTION. The private key (``devtools/demo-jwt-key.json``) is in this
repository, so anyone can sign a token that a config trusting its public half
(``devtools/demo-jwks.json``) accepts. It exists so that ``make run``, ``make front``,
``k8s/base`` and the Istio and Envoy Gateway recipes admit their example traffic at the
class it asks for, out of the box; before real traffic, replace the JWKS in those configs
with your identity provider's (docs/operations.md, "Tenant identity").

The shipped ``priority.yaml`` files give the demo tenants these ceilings::

    acme           interactive
    internal-cron  system

    python3 -m devtools.identity acme             # a token for tenant acme (24 h)
    python3 -m devtools.identity --jwks           # the public JWKS the configs embed
    curl ... -H "authorization: Bearer $(python3 -m devtools.identity acme)"

Standard library only (RSASSA-PKCS1-v1_5 with SHA-256 is a modular power), so it runs
from a fresh clone without the project's virtual environment.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Any

KEY_PATH = Path(__file__).with_name("demo-jwt-key.json")
JWKS_PATH = Path(__file__).with_name("demo-jwks.json")
ISSUER = "priority-gate-demo"
CLAIM = "tenant"
# The ceilings the shipped priority.yaml files give the demo tenants.
TENANTS = {"acme": "interactive", "internal-cron": "system"}
TTL_SECS = 86400
# DER prefix of a DigestInfo holding a SHA-256 digest (RFC 8017, 9.2, note 1).
_SHA256_DIGEST_INFO = bytes.fromhex("3031300d060960864801650304020105000420")
_PUBLIC_MEMBERS = ("kty", "alg", "use", "kid", "n", "e")


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> int:
    return int.from_bytes(base64.urlsafe_b64decode(text + "=" * (-len(text) % 4)), "big")


def _key() -> dict[str, Any]:
    key: dict[str, Any] = json.loads(KEY_PATH.read_text(encoding="utf-8"))
    return key


def public_jwk() -> dict[str, str]:
    """The key pair's public half as a JWK (no private member)."""
    key = _key()
    return {k: key[k] for k in _PUBLIC_MEMBERS}


def public_jwks() -> str:
    """The JWKS the demo configs trust, as compact JSON (``devtools/demo-jwks.json``)."""
    return json.dumps({"keys": [public_jwk()]}, separators=(",", ":"))


def sign_rs256(message: bytes) -> bytes:
    """RSASSA-PKCS1-v1_5 over SHA-256 with the demo key (RFC 8017, 8.2.1)."""
    key = _key()
    n, d = _unb64(key["n"]), _unb64(key["d"])
    size = (n.bit_length() + 7) // 8
    t = _SHA256_DIGEST_INFO + hashlib.sha256(message).digest()
    em = b"\x00\x01" + b"\xff" * (size - len(t) - 3) + b"\x00" + t
    return pow(int.from_bytes(em, "big"), d, n).to_bytes(size, "big")


def token(tenant: str, *, ttl_secs: float = TTL_SECS, now: float | None = None,
          issuer: str = ISSUER, **claims: object) -> str:
    """A demo JWT for ``tenant`` (claim ``tenant``), valid ``ttl_secs`` from ``now``."""
    if not tenant:
        raise ValueError("tenant must be non-empty")
    issued = int(time.time() if now is None else now)
    head = {"alg": "RS256", "typ": "JWT", "kid": _key()["kid"]}
    body = {"iss": issuer, CLAIM: tenant, "iat": issued, "exp": issued + int(ttl_secs),
            **claims}
    signing_input = (_b64(json.dumps(head, separators=(",", ":")).encode()) + "."
                     + _b64(json.dumps(body, separators=(",", ":")).encode()))
    return signing_input + "." + _b64(sign_rs256(signing_input.encode()))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m devtools.identity", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("tenant", nargs="?", help="the token's tenant claim (e.g. acme)")
    p.add_argument("--ttl", type=float, default=TTL_SECS, metavar="SECS",
                   help="seconds until the token expires")
    p.add_argument("--jwks", action="store_true", help="print the public JWKS and exit")
    a = p.parse_args(argv)
    if a.jwks:
        print(public_jwks())
        return 0
    if not a.tenant:
        p.error("name a tenant (the shipped configs know: "
                + ", ".join(f"{t} ({c})" for t, c in TENANTS.items()) + ")")
    print(token(a.tenant, ttl_secs=a.ttl))
    return 0


if __name__ == "__main__":
    sys.exit(main())
