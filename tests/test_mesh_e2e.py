"""The core scenarios through a real Envoy configured the way Istio / Envoy Gateway generate it.

``StackConfig(mesh=True, edge_shed=False)`` renders the bootstrap through envoy/mesh.py (a
mesh has no edge path unless its edge-shed recipe is applied): no periodic
access-log entries, default ALS buffering (16 KiB / 1 s flush, so releases arrive batched and
up to 1 s late), Istio's ext_authz settings (no metadata_context_namespaces, tenant from a
header), ext_proc as the recipes' EnvoyFilter / EnvoyExtensionPolicy add it.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from devtools import identity
from devtools.httpclient import HTTP_ERRORS, Exchange, Response, chat_body, request
from devtools.httpclient import get as http_get
from devtools.proc import die_with_parent
from devtools.stack import Stack, StackConfig, envoy_binary, free_port, load_renderer
from sidecar.authz import KEEPALIVE_TIME_MS, KEEPALIVE_TIMEOUT_MS
from tests.conftest import StackFactory, preempt_held_bulk, settle, until
from tests.test_e2e import PREEMPT, SECRET, inflight_is, token
from tests.test_faults import bulk_streams

pytestmark = pytest.mark.e2e

ALS_STREAMS = "smg_sidecar_envoy_access_log_streams"

# Enough queue room that a burst of 8 is all admitted (2 workers x 2 slots).
BURST = """
classes:
  system: {reserved_floor: 0}
  interactive: {reserved_floor: 0, reserved_per_slot: 0.0}
  default: {reserved_per_slot: 0.0}
  bulk: {queue_size: 16, queue_timeout_secs: 10}
"""


def test_mesh_config_drops_exactly_the_tuning_meshes_lack() -> None:
    text = load_renderer().render(
        listen_port=10000, admin_port=9901, sidecar_host="127.0.0.1", sidecar_port=9001,
        workers=[("127.0.0.1", 8081)], authz_timeout_secs=310, flush_interval_secs=5,
        edge_shed=False)
    boot = yaml.safe_load(load_renderer("mesh").meshify(text))
    (listener,) = boot["static_resources"]["listeners"]
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    assert "access_log_options" not in hcm
    (als,) = hcm["access_log"]
    assert "buffer_size_bytes" not in als["typed_config"]["common_config"]
    assert "filter" not in als
    filters = {f["name"]: f["typed_config"] for f in hcm["http_filters"]}
    assert set(filters["envoy.filters.http.ext_authz"]) == {
        "@type", "transport_api_version", "grpc_service", "failure_mode_allow", "status_on_error"}
    assert filters["envoy.filters.http.ext_authz"]["status_on_error"] == {"code": 503}
    assert "envoy.filters.http.ext_proc" in filters
    assert boot["node"]["id"].startswith("router~")


async def test_mesh_batched_releases_balance_exactly(make_stack: StackFactory) -> None:
    stack = await make_stack(priority_yaml=BURST, mesh=True, edge_shed=False)
    rs = await asyncio.gather(*(request(stack.listen_port, headers={"x-smg-priority": "bulk"})
                                for _ in range(8)))
    assert [r.status for r in rs] == [200] * 8
    m = await settle(stack, timeout=8)  # releases lag up to the 1 s buffer flush
    assert m['smg_scheduler_admit_total{class="bulk",outcome="admitted"}'] == 8
    assert m['smg_sidecar_released_total{class="bulk",reason="completed"}'] == 8
    assert m.get('smg_sidecar_lease_expired_total{class="bulk"}', 0) == 0
    # the sidecar names the missing setting itself
    assert m['smg_sidecar_envoy_feature{feature="unbuffered_access_log",state="absent"}'] == 1
    assert m['smg_sidecar_envoy_feature{feature="ext_proc",state="present"}'] == 1


async def test_mesh_without_ext_proc_is_reported(make_stack: StackFactory) -> None:
    stack = await make_stack(priority_yaml=BURST, preemption=False, mesh=True, edge_shed=False)
    for _ in range(3):
        assert (await request(stack.listen_port, headers={"x-smg-priority": "bulk"})).status == 200
    absent = 'smg_sidecar_envoy_feature{feature="ext_proc",state="absent"}'
    await until(stack, lambda m: m.get(absent) == 1)
    assert "envoy_feature_absent" in stack.sidecar_log.read_text()


async def test_mesh_preemption_works_where_ext_proc_is_present(make_stack: StackFactory) -> None:
    stack = await make_stack(priority_yaml=PREEMPT, workers=1, max_running_requests=1,
                             jwt_secret=SECRET, mesh=True, edge_shed=False)
    await preempt_held_bulk(stack, {"x-smg-priority": "interactive",
                                    "authorization": f"Bearer {token('auth:gold')}"})
    m = await settle(stack)
    assert m['smg_scheduler_preemption_total{by_class="interactive",victim_class="bulk"}'] == 1


async def test_mesh_killed_envoy_slots_come_back_in_bounded_time(
        make_stack: StackFactory) -> None:
    stack = await make_stack(priority_yaml=BURST, lease_secs=1.5, mesh=True, edge_shed=False)
    streams = await bulk_streams(stack, 2)
    await until(stack, inflight_is("bulk", 2))
    stack.kill_envoy()  # SIGKILL: no final access-log entry will ever come
    for ex in streams:
        await ex.abort()
    await until(stack, inflight_is("bulk", 0), timeout=1.5 + 3)
    assert await stack.metric("smg_sidecar_lease_expired_total", **{"class": "bulk"}) == 2


async def warm_up(stack: Stack, port: int | None = None, streams: int = 1) -> None:
    """One request through Envoy ends: its access-log entry makes Envoy open its ALS
    stream (lazily, at a worker thread's first entry; envoy/NOTES.md), which it then keeps
    open while it lives: from here on the sidecar watches that Envoy."""
    r = await request(port or stack.listen_port, headers={"x-smg-priority": "bulk"})
    assert r.status == 200
    await until(stack, lambda m: m.get(ALS_STREAMS, 0) >= streams, timeout=5)


@pytest.mark.parametrize(("lease", "hold"), [
    (2.0, 6.0),     # the same condition in 6 s: a stream 3x the lease
    (30.0, 90.0),   # the case that started it: a 90 s stream under the default 30 s lease
], ids=["3x-lease", "90s-default-lease"])
async def test_mesh_long_stream_keeps_its_slot(make_stack: StackFactory, lease: float,
                                               hold: float) -> None:
    # A bulk stream, and a system one: nobody may preempt system, yet without periodic entries
    # it still gets its ext_proc stream, the sign that Envoy runs it (sidecar.authz).
    stack = await make_stack(priority_yaml=BURST, lease_secs=lease, mesh=True, edge_shed=False,
                             sidecar_args=["--priority-scheduler-default-max-class", "system"])
    await warm_up(stack)
    classes = ("bulk", "system")
    streams = []
    for cls in classes:
        ex = await Exchange.send(stack.listen_port, body=chat_body(stream=True),
                                 headers={"x-smg-priority": cls, "x-fake-stream-gate": "finish"})
        await ex.read_head()
        assert ex.status == 200
        streams.append(ex)
    try:
        await asyncio.sleep(hold)  # the condition under test is the passage of time
        m = await stack.metrics()
        for cls in classes:
            assert m[f'smg_scheduler_inflight{{class="{cls}"}}'] == 1, cls
            assert m.get(f'smg_sidecar_lease_expired_total{{class="{cls}"}}', 0) == 0, cls
    finally:
        stack.fleet.gates.open("finish")
        for ex in streams:
            await asyncio.wait_for(ex.read_body(), 10)
            await ex.close()
    m = await settle(stack)
    assert m['smg_sidecar_released_total{class="bulk",reason="completed"}'] == 2
    assert m['smg_sidecar_released_total{class="system",reason="completed"}'] == 1


async def test_mesh_killed_envoy_frees_its_acknowledged_slots_after_the_grace(
        make_stack: StackFactory) -> None:
    """SIGKILL the (watched) Envoy while its sidecar lives: its acknowledged slots, which no
    lease covers, come back once its streams stayed closed for the grace."""
    grace = 1.0
    stack = await make_stack(priority_yaml=BURST, lease_secs=60.0, mesh=True, edge_shed=False,
                             sidecar_args=["--envoy-owner-grace-secs", str(grace)])
    await warm_up(stack)
    streams = await bulk_streams(stack, 2)
    await until(stack, inflight_is("bulk", 2))
    assert stack.fleet.tally.running == 2  # ground truth: the workers run them
    t0 = time.monotonic()
    stack.kill_envoy()  # SIGKILL: no final access-log entry will ever come
    for ex in streams:
        await ex.abort()
    await until(stack, inflight_is("bulk", 0), timeout=grace + 3)
    took = time.monotonic() - t0
    assert grace * 0.9 <= took < grace + 3, took
    assert stack.fleet.tally.running == 0
    m = await stack.metrics()
    assert m['smg_sidecar_lease_expired_total{class="bulk"}'] == 2
    assert m["smg_sidecar_envoy_owner_lost_total"] == 1
    assert m["smg_sidecar_envoy_owner_released_total"] == 2
    assert m[ALS_STREAMS] == 0
    print(f"slots back {took:.3f} s after SIGKILL (grace {grace} s)")


async def test_mesh_vanished_envoy_is_found_by_keepalive(make_stack: StackFactory) -> None:
    """An Envoy host that vanished without closing its sockets (SIGSTOP: the kernel keeps
    the connections, nothing answers on them): the gRPC server's keepalive ping goes
    unanswered, the connection and its access-log stream close, and the grace runs."""
    grace = 1.0
    bound = (KEEPALIVE_TIME_MS + KEEPALIVE_TIMEOUT_MS) / 1000 + grace
    stack = await make_stack(priority_yaml=BURST, lease_secs=120.0, mesh=True, edge_shed=False,
                             sidecar_args=["--envoy-owner-grace-secs", str(grace)])
    await warm_up(stack)
    [ex] = await bulk_streams(stack, 1)
    await until(stack, inflight_is("bulk", 1))
    assert stack.envoy is not None
    t0 = time.monotonic()
    stack.envoy.send_signal(signal.SIGSTOP)
    try:
        await until(stack, inflight_is("bulk", 0), timeout=bound + 3)
        took = time.monotonic() - t0
        print(f"slots back {took:.3f} s after SIGSTOP (keepalive bound + grace {bound} s)")
        m = await stack.metrics()
        assert m["smg_sidecar_envoy_owner_released_total"] == 1
        assert m['smg_sidecar_lease_expired_total{class="bulk"}'] == 1
    finally:
        stack.envoy.send_signal(signal.SIGCONT)
        await ex.abort()


async def test_two_envoys_sharing_one_sidecar_killing_one_frees_only_its_slots(
        make_stack: StackFactory, tmp_path: Path) -> None:
    """A shared authz service: two Envoys (distinct source addresses, as distinct pods
    have) admitted through one sidecar; SIGKILL one, only its slots come back."""
    grace = 1.0
    stack = await make_stack(priority_yaml=BURST, lease_secs=60.0, mesh=True, edge_shed=False,
                             sidecar_args=["--envoy-owner-grace-secs", str(grace)])
    other = await start_second_envoy(stack, tmp_path, source="127.0.0.2")
    try:
        await warm_up(stack)
        await warm_up(stack, other.port, streams=2)
        await until(stack, lambda m: m.get("smg_sidecar_envoy_owners_alive") == 2)
        [mine] = await bulk_streams(stack, 1)
        [theirs] = await bulk_streams_via(other.port, 1)
        await until(stack, inflight_is("bulk", 2))
        other.kill()
        await theirs.abort()
        await until(stack, inflight_is("bulk", 1), timeout=grace + 3)
        assert stack.fleet.tally.running == 1
        m = await stack.metrics()
        assert m['smg_sidecar_lease_expired_total{class="bulk"}'] == 1
        assert m["smg_sidecar_envoy_owner_released_total"] == 1
        assert m["smg_sidecar_envoy_owners_alive"] == 1
        await asyncio.sleep(grace)  # the surviving Envoy's slot is not touched
        assert await stack.metric("smg_scheduler_inflight", **{"class": "bulk"}) == 1
        await mine.abort()  # its final entry (client disconnect) releases it
        m = await settle(stack)
        assert m['smg_sidecar_released_total{class="bulk",reason="completed"}'] == 3
    finally:
        other.kill()


class SecondEnvoy:
    def __init__(self, proc: subprocess.Popen[bytes], port: int) -> None:
        self.proc = proc
        self.port = port

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)


async def start_second_envoy(stack: Stack, tmp_path: Path, *, source: str) -> SecondEnvoy:
    """The stack's Envoy config on new ports, reaching the sidecar from ``source``."""
    boot = yaml.safe_load(stack.envoy_config.read_text())
    port, admin = free_port(), free_port()
    boot["admin"]["address"]["socket_address"]["port_value"] = admin
    (listener,) = boot["static_resources"]["listeners"]
    listener["address"]["socket_address"]["port_value"] = port
    for cluster in boot["static_resources"]["clusters"]:
        if cluster["name"] != "workers":
            cluster["upstream_bind_config"] = {"source_address": {
                "address": source, "port_value": 0}}
    path = tmp_path / "envoy-2.yaml"
    path.write_text(yaml.safe_dump(boot, sort_keys=False))
    log = open(tmp_path / "envoy-2.log", "ab")  # noqa: SIM115 (lives as long as Envoy)
    proc = subprocess.Popen(
        die_with_parent([envoy_binary(), "-c", str(path), "--concurrency", "1", "-l",
                         "warning", "--disable-hot-restart", "--base-id", "7"]),
        stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True)
    log.close()
    second = SecondEnvoy(proc, port)
    deadline = time.monotonic() + 20
    while True:
        if proc.poll() is not None:
            raise RuntimeError((tmp_path / "envoy-2.log").read_text()[-3000:])
        with contextlib.suppress(*HTTP_ERRORS):
            status, body = await http_get(
                f"http://127.0.0.1:{admin}/stats?filter=^cluster\\.workers\\."
                "membership_healthy$", 0.5)
            if status == 200 and body.decode().strip().endswith(
                    f" {len(stack.fleet.workers)}"):
                return second
        if time.monotonic() > deadline:
            second.kill()
            raise TimeoutError("second envoy not ready")
        await asyncio.sleep(0.05)


async def bulk_streams_via(port: int, n: int) -> list[Exchange]:
    out = []
    for _ in range(n):
        ex = await Exchange.send(port, body=chat_body(stream=True),
                                 headers={"x-smg-priority": "bulk", "x-fake-stream-gate": "never"})
        await ex.read_head()
        out.append(ex)
    return out


# --------------------------------------------------------------- the Istio recipe's order

ISTIO = Path(__file__).resolve().parent.parent / "k8s" / "istio"
# The pools add-on's routes, as k8s/istio/pools/virtualservice.yaml names them, on the paths
# the stack's renderer gives its pools (/NAME/); "/" is the default pool's route.
ISTIO_POOLS = {"chat-70b": (1, 2), "small-8b": (1, 2)}
TENANTS = """
classes:
  system: {reserved_floor: 0}
  interactive: {reserved_floor: 0, reserved_per_slot: 0.0}
  default: {reserved_per_slot: 0.0}
tenant_policies:
  acme: {max_class: interactive}
"""


def istio_envoy_filters(*, recipe_ext_authz: bool = True) -> list[dict[str, object]]:
    """The recipe's EnvoyFilters (k8s/istio and its pools/ add-on), as applied."""
    docs: list[dict[str, object]] = []
    for directory in (ISTIO, ISTIO / "pools"):
        kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
        for name in kustomization["resources"]:
            for doc in yaml.safe_load_all((directory / name).read_text()):
                if doc["kind"] == "EnvoyFilter" and (
                        recipe_ext_authz or doc["metadata"]["name"] not in (
                            "priority-gate-ext-authz", "priority-gate-pools")):
                    docs.append(doc)
    return docs


class IstioStack(Stack):
    """A stack whose Envoy runs the config an Istio ingress gateway gets with the recipe
    (envoy/mesh.py istio_gateway): istiod's filters and routes, the recipe's EnvoyFilters.
    ``custom``: the recipe as it was, Check by a CUSTOM AuthorizationPolicy (istiod's
    ext_authz, before jwt_authn) and none of the recipe's own ext_authz patches."""

    custom = False

    def write_envoy_config(self) -> None:
        super().write_envoy_config()
        routes = {f"/{name}/": name for name in self.pool_fleets} | {"/": "priority-gate"}
        self.envoy_config.write_text(load_renderer("mesh").istio_gateway(
            self.envoy_config.read_text(), istio_envoy_filters(recipe_ext_authz=not self.custom),
            route_names=routes, custom_ext_authz=self.custom))


async def first_request(stack: Stack, path: str, headers: dict[str, str]) -> Response:
    """The first request through a stack's Envoy. Its readiness check is the workers
    cluster's health, and Envoy may open its listener later (after an RTDS layer's first
    fetch, up to its initial_fetch_timeout): a refused connection is retried, boundedly."""
    deadline = time.monotonic() + 10
    while True:
        try:
            return await request(stack.listen_port, path, headers=headers)
        except HTTP_ERRORS:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.05)


def _admitted(m: dict[str, float], **labels: str) -> float:
    """Sum of smg_sidecar_tenant_admitted_total / smg_scheduler_admit_total series whose
    labels include ``labels`` (other labels, such as pool, summed over)."""
    name = labels.pop("metric")
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(v for k, v in m.items() if k.startswith(name + "{") and all(w in k for w in want))


def istio_jwt_rule() -> dict[str, object]:
    """The recipe's RequestAuthentication rule: the identity istiod's jwt_authn trusts."""
    (doc,) = yaml.safe_load_all((ISTIO / "requestauthentication.yaml").read_text())
    (rule,) = doc["spec"]["jwtRules"]
    rule_: dict[str, object] = rule
    return rule_


async def _istio_stack(tmp_path: Path, tenant_source: str, *, custom: bool) -> IstioStack:
    # jwt_authn as istiod generates it from the recipe's RequestAuthentication: its JWKS and
    # issuer (the demo identity as shipped), the tenant claim to x-smg-tenant.
    rule = istio_jwt_rule()
    stack = IstioStack(StackConfig(
        priority_yaml=TENANTS, jwt_jwks=str(rule["jwks"]), jwt_issuer=str(rule["issuer"]),
        pools=ISTIO_POOLS, edge_shed=False,
        sidecar_args=["--tenant-source", tenant_source]), workdir=tmp_path)
    stack.custom = custom
    try:
        await stack.start()
    except BaseException:
        await stack.stop()
        raise
    return stack


@pytest.mark.parametrize("tenant_source", ["header:x-smg-tenant", "jwt:payload.tenant"])
async def test_istio_recipe_checks_after_jwt_authn_with_each_routes_pool(
        tmp_path: Path, tenant_source: str) -> None:
    """Under the recipe's filter order the tenant from the verified token reaches Check
    (the header outputClaimToHeaders writes, or istiod's jwt payload metadata), a client's
    own tenant header does not, and each pool route's Check names its pool."""
    stack = await _istio_stack(tmp_path, tenant_source, custom=False)
    try:
        (listener,) = yaml.safe_load(stack.envoy_config.read_text())[
            "static_resources"]["listeners"]
        hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
        assert [f["name"].rsplit(".", 1)[-1] for f in hcm["http_filters"]] == [
            "header_mutation", "jwt_authn", "fault", "cors", "ext_authz", "ext_proc", "router"]
        from tests.test_first_hour import example_request
        _, acme, _ = example_request(ISTIO / "README.md")  # the README's own example
        spoofed = {"x-smg-priority": "interactive", "x-smg-tenant": "acme"}
        for path, headers in (("/chat-70b/v1/chat/completions", acme),
                              ("/small-8b/v1/chat/completions", spoofed),
                              ("/v1/chat/completions", acme)):
            r = await first_request(stack, path, headers)
            assert r.status == 200, (path, r.status)
        m = await settle(stack)
        tenants = "smg_sidecar_tenant_admitted_total"
        assert _admitted(m, metric=tenants, tenant="acme", **{"class": "interactive"}) == 2
        # the spoofed header was stripped: anonymous, capped at the default class
        assert _admitted(m, metric=tenants, tenant="anonymous", **{"class": "default"}) == 1
        admits = "smg_scheduler_admit_total"
        for pool, cls in (("chat-70b", "interactive"), ("small-8b", "default"),
                          ("default", "interactive")):
            assert _admitted(m, metric=admits, pool=pool, outcome="admitted",
                             **{"class": cls}) == 1, pool
        for pool, fleet in stack.pool_fleets.items():
            assert sum(len(w.records) for w in fleet.workers) == 1, pool
    finally:
        await stack.stop()


async def test_istio_custom_authorization_policy_checks_before_jwt_authn(
        tmp_path: Path) -> None:
    """Why the recipe inserts its own ext_authz: where istiod puts a CUSTOM policy's filter,
    a valid token's tenant is not there yet at Check, so it is admitted as anonymous."""
    stack = await _istio_stack(tmp_path, "header:x-smg-tenant", custom=True)
    try:
        r = await first_request(stack, "/v1/chat/completions", {
            "x-smg-priority": "interactive",
            "authorization": f"Bearer {identity.token('acme')}"})
        assert r.status == 200
        m = await settle(stack)
        tenants = "smg_sidecar_tenant_admitted_total"
        assert _admitted(m, metric=tenants, tenant="anonymous", **{"class": "default"}) == 1
        assert _admitted(m, metric=tenants, tenant="acme") == 0
    finally:
        await stack.stop()


# ------------------------------------------------------- Envoy Gateway: edge shedding

EG_EDGE = Path(__file__).resolve().parent.parent / "k8s" / "overlays" / "envoy-gateway-edge-shed"


def eg_edge_pieces(grpc_port: int = 9001) -> tuple[str, list[dict[str, object]]]:
    """The overlay's EnvoyProxy bootstrap merge (the sidecar on ``grpc_port``) and every
    EnvoyPatchPolicy it applies (the recipe's access-log tuning and the edge path)."""
    kustomization = yaml.safe_load((EG_EDGE / "kustomization.yaml").read_text())
    (ops,) = [yaml.safe_load(p["patch"]) for p in kustomization["patches"]
              if p["target"]["kind"] == "EnvoyProxy"]
    (merge,) = [op["value"] for op in ops if op["path"] == "/spec/bootstrap"]
    assert merge["type"] == "Merge"
    policies = [d for path in (EG_EDGE.parent.parent / "envoy-gateway" / "envoypatchpolicy.yaml",
                               EG_EDGE / "envoypatchpolicy-edge-shed.yaml")
                for d in yaml.safe_load_all(path.read_text())]
    return merge["value"].replace("port_value: 9001", f"port_value: {grpc_port}"), policies


class EgEdgeStack(Stack):
    """A stack whose Envoy runs what Envoy Gateway generates with the edge-shed overlay
    (envoy/mesh.py envoy_gateway), its sidecar with --edge-shed."""

    def write_envoy_config(self) -> None:
        super().write_envoy_config()
        merge, policies = eg_edge_pieces(self.grpc_port)
        self.envoy_config.write_text(load_renderer("mesh").envoy_gateway(
            self.envoy_config.read_text(), bootstrap_merge=merge, patch_policies=policies))


async def test_eg_edge_shed_sheds_a_flood_at_envoy_and_counts_it(tmp_path: Path) -> None:
    """Under EG's filter layout (ext_authz and ext_proc per policy, off on the HCM, on per
    route) the overlay's edge route needs no override: a flood turns the switch on over the
    RTDS cluster the bootstrap merge adds, Envoy answers the contract's 429 itself, and the
    sidecar counts each one from the marked log stream."""
    from sidecar import edge
    from sidecar.classes import PriorityClass
    from tests.test_edge import PRIORITY, Flood, counted, wait_share

    # The bootstrap's own edge path off: the overlay's pieces are the edge path here.
    stack = EgEdgeStack(StackConfig(workers=1, max_running_requests=1, service_time=0.5,
                                    priority_yaml=PRIORITY, edge_shed=False,
                                    sidecar_args=["--edge-shed"]),
                        workdir=tmp_path)
    try:
        await stack.start()
        # Admitted through EG's per-policy ext_authz, released by its log entry.
        r = await first_request(stack, "/v1/chat/completions", {"x-smg-priority": "bulk"})
        assert r.status == 200
        await settle(stack)
        flood = Flood(stack)
        try:
            await wait_share(stack, lambda s: s >= 0.5, timeout=15)
            await until(stack, lambda m: m.get(
                'smg_sidecar_edge_shed_total{class="bulk"}', 0) > 0, timeout=5)
        finally:
            await flood.stop()
        body = edge.EDGE_REPLIES[PriorityClass.BULK].body.encode()
        assert any(status == 429 and b == body for status, _, b in flood.responses)
        rejected, edge_shed = await counted(stack)
        assert edge_shed > 0 and rejected >= edge_shed
        await settle(stack, timeout=30)
    finally:
        await stack.stop()
