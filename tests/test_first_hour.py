"""Works the first time: what a new user and an operator meet before reading anything.

- Identity out of the box: the demo, ``make front``, ``k8s/base`` and the mesh recipes
  trust one documented demo identity (devtools/identity.py, not for production) whose
  tenants the shipped ``priority.yaml`` files give their ceilings, so the README's and the
  k8s README's example traffic is admitted at the class it asks for: checked from the
  worker's view of the admitted request (``x-smg-effective-class``) through a real Envoy.
- The engine's own API key on upstream requests, put there by Envoy from a file, never in
  argv, a log or Envoy's config dump (the real llama-server: tests/test_engine_key_llama.py).
- Edge shedding on both sides wherever the product writes Envoy's configuration, with an
  opt-out.
- The banners print the path of the live ``priority.yaml``, and editing it reloads.
- Start-up warns when no tenant can be admitted above the default ceiling.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import re
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from structlog.testing import capture_logs

from devtools import identity
from devtools.demo import PRIORITY as DEMO_PRIORITY
from devtools.demo import banner as demo_banner
from devtools.demo import demo_config
from devtools.fleet import Fleet
from devtools.front import DEFAULT_PRIORITY as FRONT_PRIORITY
from devtools.front import banner as front_banner
from devtools.front import build, parse_args
from devtools.httpclient import Response, request
from devtools.httpclient import get as http_get
from devtools.stack import Stack, StackConfig, load_renderer
from sidecar.app import build_runtime
from sidecar.authz import ANONYMOUS_CLAMPS_WARNED
from sidecar.config import parse_priority_config, parse_settings
from tests.conftest import settle, until
from tests.grpc_client import EnvoyStandIn, admission_id
from tests.test_app import free_port

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "k8s"
INTERACTIVE_ACME = 'smg_sidecar_tenant_admitted_total{class="interactive",tenant="acme"}'


# ----------------------------------------------------------------- the demo identity


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def test_the_demo_jwks_is_the_key_pairs_public_half_and_nothing_more() -> None:
    jwks = json.loads((ROOT / "devtools" / "demo-jwks.json").read_text())
    assert jwks == json.loads(identity.public_jwks())
    (key,) = jwks["keys"]
    assert key.keys() == {"kty", "alg", "use", "kid", "n", "e"}  # no private member
    private = json.loads(identity.KEY_PATH.read_text())
    assert "NOT FOR PRODUCTION" in private["WARNING"]
    n, e, d = (int.from_bytes(_unb64(private[k]), "big") for k in ("n", "e", "d"))
    assert (key["n"], key["e"]) == (private["n"], private["e"])
    assert pow(pow(0x5EC12E7, e, n), d, n) == 0x5EC12E7  # d is n's private exponent


def test_a_token_verifies_with_the_public_key_alone() -> None:
    """Verified here from the JWKS with RFC 8017's encoding written out again, not by the
    signer's code; Envoy verifies the same tokens in the end-to-end tests."""
    token = identity.token("acme", now=1_700_000_000, ttl_secs=60)
    head, body, sig = token.split(".")
    assert json.loads(_unb64(head)) == {"alg": "RS256", "typ": "JWT",
                                        "kid": "priority-gate-demo-1"}
    assert json.loads(_unb64(body)) == {"iss": "priority-gate-demo", "tenant": "acme",
                                        "iat": 1_700_000_000, "exp": 1_700_000_060}
    (key,) = json.loads(identity.public_jwks())["keys"]
    n, e = (int.from_bytes(_unb64(key[k]), "big") for k in ("n", "e"))
    em = pow(int.from_bytes(_unb64(sig), "big"), e, n).to_bytes(256, "big")
    digest = hashlib.sha256(f"{head}.{body}".encode()).digest()
    assert em == (b"\x00\x01" + b"\xff" * 202 + b"\x00"
                  + bytes.fromhex("3031300d060960864801650304020105000420") + digest)
    forged = identity.token("acme", now=1_700_000_000, ttl_secs=60, tenant_note="x")
    assert forged.split(".")[2] != sig  # another body, another signature


def _ceilings(priority_yaml: str) -> dict[str, str]:
    return {t: c.label for t, c in parse_priority_config(priority_yaml).tenant_policies.items()}


def _k8s_priority() -> str:
    doc = yaml.safe_load((K8S / "base" / "configmap-priority.yaml").read_text())
    text: str = doc["data"]["priority.yaml"]
    return text


@pytest.mark.parametrize("name,priority", [
    ("demo", DEMO_PRIORITY), ("front", FRONT_PRIORITY), ("k8s/base", _k8s_priority())])
def test_the_shipped_tenant_policies_give_the_demo_tenants_their_ceilings(
        name: str, priority: str) -> None:
    assert _ceilings(priority) == identity.TENANTS, name


def _jwt_provider(boot: dict[str, Any]) -> dict[str, Any]:
    (listener,) = boot["static_resources"]["listeners"]
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    (jwt,) = [f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.jwt_authn"]
    (provider,) = jwt["typed_config"]["providers"].values()
    return dict(provider)


def _shipped_identities() -> Iterator[tuple[str, str, str]]:
    """(where, issuer, JWKS JSON) of every shipped config that trusts a token issuer."""
    cm = yaml.safe_load((K8S / "base" / "configmap-envoy.yaml").read_text())
    provider = _jwt_provider(yaml.safe_load(cm["data"]["envoy.yaml"]))
    yield "k8s/base", provider["issuer"], provider["local_jwks"]["inline_string"]
    (ra,) = yaml.safe_load_all((K8S / "istio" / "requestauthentication.yaml").read_text())
    (rule,) = ra["spec"]["jwtRules"]
    yield "istio", rule["issuer"], rule["jwks"]
    for path in (K8S / "envoy-gateway" / "securitypolicy.yaml",
                 K8S / "overlays" / "envoy-gateway-pools" / "securitypolicy-pools.yaml"):
        for doc in yaml.safe_load_all(path.read_text()):
            for p in doc["spec"]["jwt"]["providers"]:
                assert p["localJWKS"]["type"] == "Inline"
                yield str(path.relative_to(K8S)), p["issuer"], p["localJWKS"]["inline"]


def test_every_shipped_issuer_is_the_demo_identity_until_replaced() -> None:
    seen = set()
    for where, issuer, jwks in _shipped_identities():
        seen.add(where.split("/")[0])
        assert issuer == identity.ISSUER, where
        assert json.loads(jwks) == json.loads(identity.public_jwks()), where
    assert seen == {"k8s", "istio", "envoy-gateway", "overlays"}


def test_render_refuses_a_private_key_and_half_a_jwt_setup() -> None:
    render = load_renderer().render
    base: dict[str, Any] = dict(
        listen_port=10000, admin_port=9901, sidecar_host="127.0.0.1", sidecar_port=9001,
        workers=[("127.0.0.1", 8081)], authz_timeout_secs=310, flush_interval_secs=5)
    with pytest.raises(ValueError, match=r"private members \['d'\]"):
        render(**base, jwt_jwks=json.dumps({"keys": [json.loads(
            identity.KEY_PATH.read_text())]}))
    with pytest.raises(ValueError, match="not JSON"):
        render(**base, jwt_jwks="{keys")
    with pytest.raises(ValueError, match="not both"):
        render(**base, jwt_jwks=identity.public_jwks(), jwt_hs256_secret="s")
    with pytest.raises(ValueError, match="jwt_issuer needs"):
        render(**base, jwt_issuer=identity.ISSUER)
    with pytest.raises(ValueError, match="absolute path"):
        render(**base, engine_key_file="key.txt")
    # Only the path is in the config; the key itself is read by Envoy.
    text = render(**base, engine_key_file="/run/secrets/engine/key")
    assert '"/run/secrets/engine/key"' in text and "credential_injector" in text


# ------------------------------------------------------- the README's example traffic


def example_request(markdown: Path) -> tuple[str, dict[str, str], bytes]:
    """The first ``curl`` asking for ``interactive`` in ``markdown``'s code blocks, as a
    shell would run it: (path, headers, body), ``$(python3 -m devtools.identity T)``
    replaced by a token of T."""
    for block in re.findall(r"```bash\n(.*?)```", markdown.read_text(), re.S):
        command = block.replace("\\\n", " ")
        for line in command.splitlines():
            if "curl" in line and "x-smg-priority: interactive" in line:
                line = re.sub(r"\$\(python3 -m devtools\.identity ([\w-]+)\)",
                              lambda m: identity.token(m.group(1)), line)
                words = shlex.split(line[line.index("curl"):])
                headers: dict[str, str] = {}
                body, path = b"", ""
                for i, w in enumerate(words):
                    if w == "-H":
                        name, _, value = words[i + 1].partition(":")
                        headers[name.strip().lower()] = value.strip()
                    elif w == "-d":
                        body = words[i + 1].encode()
                    elif "/v1/" in w and not path:
                        path = w[w.index("/v1/"):]
                return path, headers, body
    raise AssertionError(f"{markdown}: no curl asking for interactive")


async def _send(stack: Stack, path: str, headers: dict[str, str], body: bytes) -> Response:
    return await request(stack.listen_port, path, headers=headers, body=body, timeout=30)


def _last_class(stack: Stack) -> str | None:
    records = [r for w in stack.fleet.workers for r in getattr(w, "records", [])]
    latest = max(records, key=lambda r: r.started_at)
    return latest.priority_class


@pytest.mark.e2e
async def test_the_readmes_example_is_admitted_at_the_class_it_asks_for(
        tmp_path: Path) -> None:
    path, headers, body = example_request(ROOT / "README.md")
    assert "authorization" in headers  # the example carries its tenant
    stack = Stack(demo_config(free_ports=True), workdir=tmp_path)
    try:
        await stack.start()
        r = await _send(stack, path, headers, body)
        assert r.status == 200, r.body
        assert _last_class(stack) == "interactive"  # the worker's view
        m = await settle(stack)
        assert m[INTERACTIVE_ACME] == 1
        assert not any(k.startswith("smg_scheduler_clamp_total") for k in m)
        # The same request without the token: anonymous, clamped to default, counted.
        anonymous = {k: v for k, v in headers.items() if k != "authorization"}
        r = await _send(stack, path, anonymous, body)
        assert r.status == 200 and _last_class(stack) == "default"
        m = await settle(stack)
        assert m['smg_scheduler_clamp_total{effective_class="default",'
                 'requested_class="interactive",tenant="anonymous"}'] == 1
        # A token the demo identity did not sign, or no longer valid, never reaches Check.
        good = identity.token("acme")
        h, b, s = good.split(".")
        bad = {"tampered": f"{h}.{b}.{s[:-4]}AAAA",
               "expired": identity.token("acme", now=1_600_000_000, ttl_secs=60),
               "other issuer": identity.token("acme", issuer="someone-else")}
        for why, tok in bad.items():
            r = await _send(stack, path, {**headers, "authorization": f"Bearer {tok}"}, body)
            assert r.status == 401, (why, r.status, r.body)
        m = await settle(stack)
        assert m[INTERACTIVE_ACME] == 1
        assert sum(v for k, v in m.items() if k.startswith("smg_scheduler_admit_total{")) == 2
    finally:
        await stack.stop()


class K8sBaseStack(Stack):
    """The k8s base as shipped: its Envoy ConfigMap, its priority.yaml and its sidecar's
    arguments, on loopback ports, the workers cluster pointed at the fake fleet, without
    the fleet ledger (overlays/single-replica's cut)."""

    def __init__(self, fleet_size: int, workdir: Path) -> None:
        super().__init__(StackConfig(workers=fleet_size, max_running_requests=128,
                                     priority_yaml=_k8s_priority(), capacity_from_envoy=True,
                                     health_interval_secs=0.5), workdir=workdir)

    def sidecar_argv(self) -> list[str]:
        from tests.test_k8s import _expanded_args, _sidecar
        args = _expanded_args(_sidecar())
        cut = args.index("--fleet-id")
        args = args[:cut]  # the fleet flags are last (the single-replica overlay's rule)
        replace = {"--priority-scheduler-config": str(self.priority_path),
                   "--envoy-admin-url": f"http://127.0.0.1:{self.admin_port}",
                   "--grpc-listen": f"127.0.0.1:{self.grpc_port}",
                   "--http-listen": f"127.0.0.1:{self.http_port}",
                   "--startup-capacity-wait-secs": "5"}
        for flag, value in replace.items():
            args[args.index(flag) + 1] = value
        return [*super().sidecar_argv()[:3], *args,
                "--health-interval-secs", str(self.config.health_interval_secs)]

    def write_envoy_config(self) -> None:
        cm = yaml.safe_load((K8S / "base" / "configmap-envoy.yaml").read_text())
        boot = yaml.safe_load(cm["data"]["envoy.yaml"])
        boot["admin"]["address"]["socket_address"]["port_value"] = self.admin_port
        (listener,) = boot["static_resources"]["listeners"]
        listener["address"]["socket_address"] = {"address": "127.0.0.1",
                                                 "port_value": self.listen_port}
        clusters = {c["name"]: c for c in boot["static_resources"]["clusters"]}
        (sidecar,) = clusters["sidecar"]["load_assignment"]["endpoints"][0]["lb_endpoints"]
        sidecar["endpoint"]["address"]["socket_address"]["port_value"] = self.grpc_port
        clusters["workers"]["load_assignment"]["endpoints"] = [{"lb_endpoints": [
            {"endpoint": {"address": {"socket_address": {"address": h, "port_value": p}}}}
            for h, p in self.fleet.addresses]}]
        self.envoy_config.write_text(yaml.safe_dump(boot), encoding="utf-8")


@pytest.mark.e2e
async def test_the_k8s_readmes_example_is_admitted_at_the_class_it_asks_for(
        tmp_path: Path) -> None:
    """The k8s README's test traffic through the base's own Envoy config, priority.yaml
    and sidecar arguments (the built-in reservations need 256 slots: 2 x 128)."""
    path, headers, body = example_request(K8S / "README.md")
    stack = K8sBaseStack(2, tmp_path)
    try:
        await stack.start()
        assert "--edge-shed" in stack.sidecar_argv()  # both sides of the edge path
        r = await _send(stack, path, headers, body)
        assert r.status == 200, r.body
        assert _last_class(stack) == "interactive"
        m = await settle(stack)
        assert m[INTERACTIVE_ACME] == 1
        # The switch is served: its gauge is set at the edge controller's first publish,
        # which a loaded box may not have reached when the request is through.
        share = 'smg_sidecar_edge_shed_share{class="bulk"}'
        m = await until(stack, lambda m: share in m)
        assert m[share] == 0
        cron = {**headers, "x-smg-priority": "system",
                "authorization": f"Bearer {identity.token('internal-cron')}"}
        r = await _send(stack, path, cron, body)
        assert r.status == 200 and _last_class(stack) == "system"
        await settle(stack)
    finally:
        await stack.stop()


# ------------------------------------------------ edge shedding on both sides, by default


def _has_edge_path(stack: Stack) -> bool:
    text = stack.envoy_config.read_text()
    return "smg_edge_shed_bulk" in text and "layered_runtime" in text


def test_the_demo_and_front_run_edge_shedding_on_both_sides_unless_opted_out(
        tmp_path: Path) -> None:
    # Rendered, not started: the demo's fixed ports are only written into the config.
    cases = {
        "demo": (Stack(demo_config(), workdir=tmp_path / "d1"), True),
        "demo --no-edge-shed": (
            Stack(demo_config(edge_shed=False), workdir=tmp_path / "d2"), False),
    }
    for argv, on in ((["--worker-urls", "http://127.0.0.1:1"], True),
                     (["--worker-urls", "http://127.0.0.1:1", "--no-edge-shed"], False)):
        cases[" ".join(["front", *argv[2:]])] = (
            build(parse_args([*argv, "--free-ports"])), on)
    for name, (stack, on) in cases.items():
        stack.write_envoy_config()
        assert ("--edge-shed" in stack.sidecar_argv()) is on, name
        assert _has_edge_path(stack) is on, name


def test_a_mesh_shaped_stack_must_say_it_has_no_edge_path() -> None:
    with pytest.raises(ValueError, match="edge_shed=False"):
        Stack(StackConfig(mesh=True))
    text = load_renderer().render(
        listen_port=10000, admin_port=9901, sidecar_host="127.0.0.1", sidecar_port=9001,
        workers=[("127.0.0.1", 8081)], authz_timeout_secs=310, flush_interval_secs=5)
    with pytest.raises(ValueError, match="edge_shed=False"):
        load_renderer("mesh").meshify(text)


# ------------------------------------------------------------ the live config's path


async def _reload_to(stack: Stack, text: str) -> None:
    """Replace the file the banner names (atomically, as docs say) and wait for the reload."""
    before = await stack.metric("smg_sidecar_config_generation")
    tmp = stack.priority_path.with_suffix(".new")
    tmp.write_text(text)
    tmp.replace(stack.priority_path)
    await until(stack, lambda m: m.get("smg_sidecar_config_generation", 0) > before,
                timeout=15)


@pytest.mark.e2e
async def test_the_demo_banner_names_the_live_config_and_editing_it_reloads(
        tmp_path: Path) -> None:
    stack = Stack(demo_config(free_ports=True), workdir=tmp_path)
    try:
        await stack.start()
        text = demo_banner(stack)
        assert f"config     {stack.priority_path}\n" in text
        assert "reloads" in text and "NOT for production" in text
        path, headers, body = example_request(ROOT / "README.md")
        assert (await _send(stack, path, headers, body)).status == 200
        assert _last_class(stack) == "interactive"
        await settle(stack)
        # acme lowered to default in the file the banner printed: the next request is.
        await _reload_to(stack, DEMO_PRIORITY.replace(
            '"acme":\n    max_class: interactive', '"acme":\n    max_class: default'))
        assert (await _send(stack, path, headers, body)).status == 200
        assert _last_class(stack) == "default"
        await settle(stack)
    finally:
        await stack.stop()


@pytest.mark.e2e
async def test_front_banner_names_the_live_config_and_the_engine_key_file(
        tmp_path: Path) -> None:
    key = tmp_path / "engine.key"
    key.write_text("front-key-9f3c\n")
    async with Fleet(1, max_running_requests=2) as fleet:
        args = parse_args(["--worker-urls", *fleet.urls, "--free-ports",
                           "--worker-auth-file", str(key)])
        stack = build(args)
        try:
            await stack.start()
            text = front_banner(stack, args)
            assert f"config     {stack.priority_path}\n" in text and "reloads" in text
            assert str(key) in text and "front-key-9f3c" not in text
            r = await request(stack.listen_port, headers={
                "x-smg-priority": "interactive",
                "authorization": f"Bearer {identity.token('acme')}"})
            assert r.status == 200
            (record,) = fleet.workers[0].records
            # The tenant's ceiling applied; the engine got its own key, not the token.
            assert record.priority_class == "interactive"
            assert record.headers["authorization"] == "Bearer front-key-9f3c"
            await settle(stack)
            await _reload_to(stack, FRONT_PRIORITY.replace("acme\": {max_class: interactive",
                                                          "acme\": {max_class: bulk"))
            await request(stack.listen_port, headers={
                "x-smg-priority": "interactive",
                "authorization": f"Bearer {identity.token('acme')}"})
            assert fleet.workers[0].records[-1].priority_class == "bulk"
            await settle(stack)
        finally:
            await stack.stop()


# --------------------------------------------------------- the engine's key upstream


def _cmdline(pid: int) -> bytes:
    return Path(f"/proc/{pid}/cmdline").read_bytes()


@pytest.mark.e2e
async def test_envoy_puts_the_engine_key_upstream_and_nowhere_else(tmp_path: Path) -> None:
    """With JWT tenants: the tenant's token stays at Envoy (jwt_authn removes it), the
    engine gets its key from the file, and the key is in no argv, log, rendered config or
    config dump; a client's own Authorization is replaced, not forwarded."""
    secret = "engine-key-7c1e2d"
    key = tmp_path / "engine.key"
    key.write_text(secret + "\n")  # a trailing newline, as `echo KEY > file` writes it
    stack = Stack(StackConfig(
        workers=1, max_running_requests=2, jwt_jwks=identity.public_jwks(),
        jwt_issuer=identity.ISSUER, engine_key_file=str(key),
        priority_yaml=FRONT_PRIORITY,
        sidecar_args=["--worker-auth-file", str(key), "--worker-auth-allow-http"]),
        workdir=tmp_path / "stack")
    try:
        await stack.start()
        token = identity.token("acme")
        for headers in ({"authorization": f"Bearer {token}", "x-smg-priority": "interactive"},
                        {"authorization": "Bearer client-chosen"}):
            r = await request(stack.listen_port, headers=headers)
            # A bearer that is no JWT of the demo identity is refused by jwt_authn.
            assert r.status == (200 if "client" not in headers["authorization"] else 401)
        (record,) = stack.fleet.workers[0].records
        assert record.headers["authorization"] == f"Bearer {secret}"
        assert record.priority_class == "interactive"
        assert token not in json.dumps(record.headers)
        _, dump = await http_get(f"http://127.0.0.1:{stack.admin_port}/config_dump", 5.0)
        assert b"[redacted]" in dump
        await settle(stack)
        assert stack.envoy is not None and stack.sidecar is not None
        for where, data in {
                "envoy argv": _cmdline(stack.envoy.pid),
                "sidecar argv": _cmdline(stack.sidecar.pid),
                "envoy config": stack.envoy_config.read_bytes(),
                "config dump": dump,
                "envoy log": stack.envoy_log.read_bytes(),
                "sidecar log": stack.sidecar_log.read_bytes()}.items():
            assert secret.encode() not in data, where
    finally:
        await stack.stop()


class IstioEngineKeyStack(Stack):
    """The Istio recipe with its engine-key add-on (k8s/istio/engine-key) applied to an
    Istio-shaped gateway (envoy/mesh.py), the SDS file and the key where the pod mounts
    them (here: the test's directory)."""

    key_path: Path

    def write_envoy_config(self) -> None:
        from tests.test_mesh_e2e import istio_envoy_filters
        super().write_envoy_config()
        recipe = K8S / "istio" / "engine-key"
        (cm,) = yaml.safe_load_all((recipe / "configmap-engine-key-sds.yaml").read_text())
        (sds_name, sds_text), = cm["data"].items()
        sds_text = sds_text.replace(f"{ISTIO_KEY_DIR}/api-key", str(self.key_path))
        sds = self.workdir / sds_name
        sds.write_text(sds_text)
        filters = [d for d in yaml.safe_load_all(
            (recipe / "envoyfilter-engine-key.yaml").read_text())]
        text = json.dumps(filters).replace(f"{ISTIO_SDS_DIR}/{sds_name}", str(sds))
        self.envoy_config.write_text(load_renderer("mesh").istio_gateway(
            self.envoy_config.read_text(), [*istio_envoy_filters(), *json.loads(text)],
            route_names={"/": "priority-gate"}))


ISTIO_KEY_DIR = "/etc/priority-gate/engine-key"
ISTIO_SDS_DIR = "/etc/priority-gate/engine-key-sds"


@pytest.mark.e2e
async def test_the_istio_engine_key_recipe_puts_the_key_upstream(tmp_path: Path) -> None:
    from tests.test_mesh_e2e import istio_jwt_rule
    key = tmp_path / "api-key"
    key.write_text("istio-engine-key\n")
    rule = istio_jwt_rule()
    stack = IstioEngineKeyStack(StackConfig(
        workers=1, max_running_requests=2, priority_yaml=FRONT_PRIORITY, edge_shed=False,
        jwt_jwks=str(rule["jwks"]), jwt_issuer=str(rule["issuer"])), workdir=tmp_path / "s")
    stack.key_path = key
    try:
        await stack.start()
        filters = yaml.safe_load(stack.envoy_config.read_text())["static_resources"][
            "listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]["http_filters"]
        names = [f["name"].rsplit(".", 1)[-1] for f in filters]
        assert names[-4:] == ["ext_authz", "ext_proc", "credential_injector", "router"]
        deadline = asyncio.get_running_loop().time() + 10
        while True:  # the listener opens once the SDS file's secret is loaded
            try:
                r = await request(stack.listen_port, headers={
                    "x-smg-priority": "interactive",
                    "authorization": f"Bearer {identity.token('acme')}"})
                break
            except OSError:
                assert asyncio.get_running_loop().time() < deadline, "listener never opened"
                await asyncio.sleep(0.1)
        assert r.status == 200, r.body
        (record,) = stack.fleet.workers[0].records
        assert record.headers["authorization"] == "Bearer istio-engine-key"
        assert record.priority_class == "interactive"
        await settle(stack)
    finally:
        await stack.stop()


# -------------------------------------------------------------- the start-up warning


@pytest.mark.parametrize("extra,policies,warned", [
    ((), "", True),  # the built-in config: nobody above default
    ((), 'tenant_policies: {"acme": {max_class: interactive}}', False),
    ((), 'tenant_policies: {"batch": {max_class: bulk}}', True),  # only lowered
    (("--priority-scheduler-default-max-class", "system"), "", False),
    (("--priority-scheduler-default-max-class", "interactive"), "", True),
])
async def test_startup_warns_when_no_tenant_can_be_admitted_above_the_default_ceiling(
        tmp_path: Path, extra: tuple[str, ...], policies: str, warned: bool) -> None:
    cfg = tmp_path / "priority.yaml"
    cfg.write_text("classes: {system: {reserved_floor: 0}, interactive: {reserved_floor: 0}}\n"
                   + policies + "\n")
    settings = parse_settings([
        "--grpc-listen", f"127.0.0.1:{free_port()}", "--http-listen",
        f"127.0.0.1:{free_port()}", "--priority-scheduler-enabled",
        "--priority-scheduler-config", str(cfg), "--worker-capacity-override", "8", *extra])
    with capture_logs() as logs:
        app = await build_runtime(settings)
    await app.stop()
    lines = [ln for ln in logs if ln["event"] == "no_tenant_above_default_ceiling"]
    assert bool(lines) is warned, logs
    if warned:
        (line,) = lines
        assert line["log_level"] == "warning"
        assert line["tenant_source"] == "header:x-smg-tenant"
        assert line["default_max_class"] in ("default", "interactive")


@pytest.mark.parametrize("first_tenant", [None, "acme"])
async def test_a_tenant_source_that_never_yields_a_tenant_is_named_once(
        tmp_path: Path, first_tenant: str | None) -> None:
    """Envoy never sets the tenant header: after ANONYMOUS_CLAMPS_WARNED anonymous requests
    clamped below what they asked, one warning, never repeated; one Check that named a
    tenant first proves the source works, and nothing is said."""
    cfg = tmp_path / "priority.yaml"
    cfg.write_text("classes: {system: {reserved_floor: 0}, interactive: {reserved_floor: 0}}\n"
                   'tenant_policies: {"acme": {max_class: interactive}}\n')
    settings = parse_settings([
        "--grpc-listen", f"127.0.0.1:{free_port()}", "--http-listen",
        f"127.0.0.1:{free_port()}", "--priority-scheduler-enabled",
        "--priority-scheduler-config", str(cfg), "--worker-capacity-override", "64"])
    app = await build_runtime(settings)
    await app.serve()
    envoy = EnvoyStandIn(app.grpc_port)
    try:
        with capture_logs() as logs:
            if first_tenant is not None:
                r = await envoy.check({"x-smg-priority": "interactive",
                                       "x-smg-tenant": first_tenant})
                assert r.status.code == 0
                await envoy.log((admission_id(r), "end"))
            for _ in range(2 * ANONYMOUS_CLAMPS_WARNED):
                r = await envoy.check({"x-smg-priority": "interactive"})
                assert r.status.code == 0  # admitted, at default
                await envoy.log((admission_id(r), "end"))
        lines = [ln for ln in logs if ln["event"] == "tenant_source_yields_no_tenant"]
        if first_tenant is not None:
            assert not lines, lines
        else:
            (line,) = lines
            assert line["log_level"] == "warning"
            assert line["tenant_source"] == "header:x-smg-tenant"
            assert line["default_max_class"] == "default"
    finally:
        await envoy.close()
        await app.stop()


# ------------------------------------------- the Envoy Gateway recipe's identity, run


class EgStack(Stack):
    """The Envoy Gateway recipe's proxy (envoy/mesh.py envoy_gateway: EG's filter names and
    per-route enabling, the recipe's EnvoyPatchPolicy), jwt_authn from its SecurityPolicy."""

    def write_envoy_config(self) -> None:
        super().write_envoy_config()
        policies = list(yaml.safe_load_all((K8S / "envoy-gateway" / "envoypatchpolicy.yaml")
                                           .read_text()))
        self.envoy_config.write_text(load_renderer("mesh").envoy_gateway(
            self.envoy_config.read_text(), patch_policies=policies))


@pytest.mark.e2e
async def test_the_envoy_gateway_recipes_identity_admits_the_demo_tenant_at_its_class(
        tmp_path: Path) -> None:
    (policy,) = yaml.safe_load_all((K8S / "envoy-gateway" / "securitypolicy.yaml").read_text())
    (provider,) = policy["spec"]["jwt"]["providers"]
    assert [c["header"] for c in provider["claimToHeaders"]] == ["x-smg-tenant"]
    stack = EgStack(StackConfig(
        workers=1, max_running_requests=2, priority_yaml=FRONT_PRIORITY, edge_shed=False,
        jwt_jwks=provider["localJWKS"]["inline"], jwt_issuer=provider["issuer"]),
        workdir=tmp_path)
    try:
        await stack.start()
        path, headers, body = example_request(K8S / "envoy-gateway" / "README.md")
        r = await _send(stack, path, headers, body)
        assert r.status == 200, r.body
        assert _last_class(stack) == "interactive"
        m = await settle(stack)
        assert m[INTERACTIVE_ACME] == 1
    finally:
        await stack.stop()
