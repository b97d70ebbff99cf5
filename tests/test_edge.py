"""Edge shedding (--edge-shed, sidecar/edge.py): Envoy answers a full bulk queue's overflow.

Unit parts: the control loop, the RTDS message, the reply bytes the renderer writes.
End to end through a real Envoy: a bulk flood is answered by Envoy itself with the
contract's 429 byte for byte and no Check (Envoy's ext_authz stats), every edge shed
is counted as the contract counts; the class is admitted again soon after its queue
has room; a killed sidecar's switch is off in Envoy within the TTL.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import re
import shutil
import subprocess
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from envoy.service.accesslog.v3 import als_pb2
from envoy.service.discovery.v3 import discovery_pb2
from envoy.service.runtime.v3 import rtds_pb2
from google.protobuf import json_format
from hypothesis import given, settings
from hypothesis import strategies as st

from devtools.httpclient import HTTP_ERRORS, get, request
from devtools.stack import Stack, StackConfig, load_renderer
from sidecar import edge, logs, responses
from sidecar.app import Runtime, build_runtime
from sidecar.classes import PriorityClass
from sidecar.config import DEFAULT_POOL, parse_settings
from sidecar.edge import ShedController
from sidecar.metrics import Metrics, NullPoolRecorder
from tests.conftest import StackFactory
from tests.grpc_client import EnvoyStandIn, admission_id
from tests.test_k8s import _envoy_bin
from tests.test_reload import eventually

B, D = PriorityClass.BULK, PriorityClass.DEFAULT
BULK_FULL = responses.reply(responses.Rejection.QUEUE_FULL, B)

# One slot, a two-deep bulk queue and long requests: a flood keeps the queue full.
PRIORITY = """
classes:
  system: {reserved_floor: 0, queue_size: 2, queue_timeout_secs: 20}
  interactive: {reserved_floor: 0, reserved_per_slot: 0.0, queue_size: 2, queue_timeout_secs: 20}
  default: {reserved_per_slot: 0.0, queue_size: 2, queue_timeout_secs: 20}
  bulk: {queue_size: 2, queue_timeout_secs: 20}
"""


# ---------------------------------------------------------------------- unit


def _interval(c: ShedController, arrived: int, overflow: int, cls: PriorityClass = B,
              shed: int = 0, at_once: int = 0) -> float:
    for _ in range(arrived):
        c.arrived(cls)
    for _ in range(overflow):
        c.overflowed(cls)
    for _ in range(at_once):
        c.admitted_at_once(cls)
    c.edge_shed(cls, shed)
    c.tick()
    return c.shares()[B]


def test_the_share_rises_while_the_queue_overflows_and_is_zero_once_it_has_room() -> None:
    c = ShedController()
    assert _interval(c, 100, 0) == 0.0  # room: nothing shed
    shares = [_interval(c, 100, 90) for _ in range(3)]
    assert 0 < shares[0] < shares[1] <= shares[2] <= edge.MAX_SHARE
    # What got through at the share in force is what the sidecar sees; keep it overflowing.
    steady = _interval(c, 20, 10)
    assert steady > 0
    assert _interval(c, 5, 0) == 0.0  # one interval whose arrivals all found room: off


def test_a_quiet_interval_in_a_flood_lets_through_probe_times_more_not_the_flood() -> None:
    c = ShedController()
    for _ in range(3):
        _interval(c, 100, 97)
    high = c.shares()[B]
    assert high == edge.MAX_SHARE
    # 400 arrived: Envoy shed 396, the 4 Checks all found room. Let 2 x 4 (+ margin) of
    # the 400 through next, not all of them.
    quiet = _interval(c, 4, 0, shed=396)
    assert quiet == pytest.approx(1 - edge.PROBE * 4 * (1 + edge.MARGIN) / 400, abs=1e-4)
    assert quiet > 0.9
    # The flood overflows again at that share: back up at once.
    assert _interval(c, 10, 8, shed=390) > quiet
    # The flood is over: the few arrivals are all let through at once.
    assert _interval(c, 2, 0, shed=3) == 0.0


def test_an_admission_without_queuing_is_room_and_a_queue_with_room_opens_in_6_ticks() -> None:
    c = ShedController()
    for _ in range(3):
        _interval(c, 100, 97)
    # One Check admitted at once (queue empty, slot free): off at this tick, whatever
    # Envoy shed meanwhile.
    assert _interval(c, 4, 0, shed=396, at_once=1) == 0.0
    for _ in range(3):
        _interval(c, 100, 97)
    # The queue keeps room but never empties: every arrival is queued, none overflows.
    # The let-through grows PROBE x (1 + MARGIN) per tick: off within 6 ticks.
    shares = []
    for _ in range(8):
        share = c.shares()[B]
        through = round(400 * (1 - share))
        shares.append(_interval(c, through, 0, shed=400 - through))
        if shares[-1] == 0.0:
            break
    assert shares[-1] == 0.0 and len(shares) <= 6, shares
    assert all(a > b for a, b in itertools.pairwise(shares)), shares


def test_the_share_holds_within_the_deadband_and_decays_when_nothing_gets_through() -> None:
    c = ShedController()
    first = _interval(c, 100, 90)
    # Overflowing at the share that keeps a margin: no change smaller than the deadband.
    through = 1.0 - first
    absorbed = round(100 * through / (1 + edge.MARGIN))
    assert _interval(c, round(100 * through), round(100 * through) - absorbed) == first
    # Nothing reached the sidecar: unknown, so the share halves until it is negligible.
    seen = [_interval(c, 0, 0) for _ in range(8)]
    assert seen[0] == pytest.approx(first / 2, abs=1e-3)
    assert seen[-1] == 0.0


def test_the_share_jumps_up_to_its_target_and_comes_down_half_way() -> None:
    c = ShedController()
    # 100 arrived, 10 absorbed: let 12.5 of 100 through.
    assert _interval(c, 100, 90) == pytest.approx(1 - 10 * (1 + edge.MARGIN) / 100)
    high = c.shares()[B]
    # Then the queue absorbs all but one of the 20 that got through: the target is lower.
    lower_target = 1 - 19 * (1 + edge.MARGIN) / (20 / (1 - high))
    assert lower_target < high - 2 * edge.DEADBAND
    assert _interval(c, 20, 1) == pytest.approx(high + edge.GAIN * (lower_target - high),
                                                abs=1e-3)


def test_other_classes_never_move_a_switch() -> None:
    c = ShedController()
    assert _interval(c, 100, 100, cls=D) == 0.0
    assert set(c.shares()) == set(edge.EDGE_CLASSES) == {B}


def test_the_rtds_response_carries_the_layer_with_a_ttl() -> None:
    server = edge.RuntimeServer({"default": NullPoolRecorder()})
    server.publish({("default", B): 0.25}, changed=True)
    resp = discovery_pb2.DiscoveryResponse.FromString(server._with_nonce(server._current))
    assert resp.type_url == edge.RUNTIME_TYPE_URL and resp.nonce
    (wrapped,) = resp.resources
    res = discovery_pb2.Resource()
    assert wrapped.Unpack(res)
    assert res.name == edge.LAYER and res.ttl.ToNanoseconds() == int(edge.TTL_SECS * 1e9)
    rt = rtds_pb2.Runtime()
    assert res.resource.Unpack(rt)
    assert rt.name == edge.LAYER
    assert json_format.MessageToDict(rt.layer) == {
        "smg.edge.shed.bulk": {"numerator": 250000.0, "denominator": "MILLION"}}
    # With pools the one layer carries every pool's switch; the default pool's key is as
    # without pools.
    pooled = edge.RuntimeServer({"default": NullPoolRecorder(), "big": NullPoolRecorder()})
    pooled.publish({("default", B): 0.0, ("big", B): 0.5}, changed=True)
    res = discovery_pb2.Resource()
    discovery_pb2.DiscoveryResponse.FromString(pooled._current).resources[0].Unpack(res)
    res.resource.Unpack(rt)
    assert json_format.MessageToDict(rt.layer) == {
        "smg.edge.shed.bulk": {"numerator": 0.0, "denominator": "MILLION"},
        "smg.edge.shed.pool.big.bulk": {"numerator": 500000.0, "denominator": "MILLION"}}


async def test_a_stream_that_has_not_sent_yet_gets_the_newest_state() -> None:
    server = edge.RuntimeServer({"default": NullPoolRecorder()})

    async def envoy() -> AsyncIterator[bytes]:
        yield discovery_pb2.DiscoveryRequest(
            type_url=edge.RUNTIME_TYPE_URL, resource_names=[edge.LAYER]).SerializeToString()
        await asyncio.Event().wait()  # the stream stays open

    stream = server.stream_runtime(envoy(), None)  # type: ignore[arg-type]
    first = await anext(stream)  # what was in force when it subscribed
    server.publish({("default", B): 0.5}, changed=True)
    server.publish({("default", B): 0.75}, changed=True)  # before the stream sent the 0.5
    second = await anext(stream)
    await stream.aclose()

    def share(data: bytes) -> float:
        res, rt = discovery_pb2.Resource(), rtds_pb2.Runtime()
        discovery_pb2.DiscoveryResponse.FromString(data).resources[0].Unpack(res)
        res.resource.Unpack(rt)
        value = json_format.MessageToDict(rt.layer)[edge.runtime_key(B)]
        return float(value["numerator"]) / edge.DENOMINATOR
    assert (share(first), share(second)) == (0.0, 0.75)
    assert server.streams == 0


def test_the_rendered_edge_reply_is_the_sidecars_byte_for_byte() -> None:
    render = load_renderer()
    assert BULK_FULL.body == render.EDGE_REPLY_BODY
    assert render.EDGE_LOG_FLUSH_SECS == edge.SHED_LOG_FLUSH_SECS
    text = _render(edge_shed=True)
    boot = _yaml(text)
    routes = boot["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0][
        "typed_config"]["route_config"]["virtual_hosts"][0]["routes"]
    shed = routes[0]
    assert shed["name"] == "smg_edge_shed_bulk" == edge.route_name(B)  # what is counted
    assert shed["direct_response"] == {"status": BULK_FULL.status,
                                       "body": {"inline_string": BULK_FULL.body}}
    assert {h["header"]["key"]: h["header"]["value"] for h in shed["response_headers_to_add"]
            } == dict(BULK_FULL.headers)
    assert shed["match"]["runtime_fraction"]["runtime_key"] == edge.runtime_key(B)
    layers = boot["layered_runtime"]["layers"]
    assert layers[0]["static_layer"] == {edge.runtime_key(B): 0}
    assert layers[1]["rtds_layer"]["name"] == edge.LAYER
    # Off by default: the shipped bootstrap has no edge route.
    assert "smg_edge" not in _render(edge_shed=False)
    # A named pool's edge route has the name its shed log's entries are counted by.
    pooled = _yaml(load_renderer().render(
        listen_port=10000, admin_port=9901, sidecar_host="127.0.0.1", sidecar_port=9001,
        workers=[("127.0.0.1", 8081)], authz_timeout_secs=310, flush_interval_secs=5,
        edge_shed=True, pools=[("big", "/big/", [("127.0.0.1", 8091)])]))
    names = [r.get("name") for r in pooled["static_resources"]["listeners"][0]["filter_chains"][0][  # type: ignore[index]
        "filters"][0]["typed_config"]["route_config"]["virtual_hosts"][0]["routes"]]
    assert edge.route_name(B, "big") in names and edge.route_name(B) in names


def test_edge_sheds_join_the_rejections_line() -> None:
    lines: list[dict[str, object]] = []

    class Log:
        def info(self, event: str, **kw: object) -> None:
            lines.append({"event": event, **kw})

    summary = logs.RejectionSummary(Log(), schedule=lambda delay, fn: None)  # type: ignore[arg-type]
    shed = edge.EdgeShed({"default": NullPoolRecorder()}, summary.add)
    shed.shed_counted(B, 3)
    summary.flush()
    # The first at once, the others summed at the end of the interval.
    assert sum(ln["total"] for ln in lines) == 3  # type: ignore[misc]
    assert all(ln["by_class_outcome"].keys() == {"bulk/rejected_queue_full"}  # type: ignore[attr-defined]
               and ln["top_tenants"].keys() == {edge.EDGE_TENANT} for ln in lines)  # type: ignore[attr-defined]


def _render(*, edge_shed: bool, sidecar_port: int = 9001, listen: int = 10000,
            admin: int = 9901) -> str:
    text: str = load_renderer().render(
        listen_port=listen, admin_port=admin, sidecar_host="127.0.0.1",
        sidecar_port=sidecar_port, workers=[("127.0.0.1", 8081)], authz_timeout_secs=310,
        flush_interval_secs=5, edge_shed=edge_shed)
    return text


def _yaml(text: str) -> dict[str, object]:
    import yaml
    out: dict[str, object] = yaml.safe_load(text)
    return out


def _envoy() -> Path:
    envoy = _envoy_bin()
    if envoy is None:
        pytest.skip("no Envoy binary (set ENVOY_BIN or run `make envoy`)")
    return envoy


def test_the_edge_bootstrap_passes_envoy_validate(tmp_path: Path) -> None:
    cfg = tmp_path / "envoy.yaml"
    cfg.write_text(_render(edge_shed=True), encoding="utf-8")
    out = subprocess.run([str(_envoy()), "--mode", "validate", "-c", str(cfg),
                          "--disable-hot-restart", "--log-level", "warn"],
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stdout + out.stderr


# ------------------------------------------------------------------ end to end


@contextlib.asynccontextmanager
async def edge_stack(tmp_path: Path) -> AsyncIterator[Stack]:
    """A stack whose sidecar runs --edge-shed behind a bootstrap rendered with it."""
    _envoy()
    stack = Stack(StackConfig(workers=1, max_running_requests=1, service_time=0.5,
                              priority_yaml=PRIORITY, edge_shed=True), workdir=tmp_path)
    try:
        await stack.start()
        yield stack
    finally:
        await stack.stop()


class Flood:
    """Closed-loop bulk clients; every response kept for the checks."""

    def __init__(self, stack: Stack, clients: int = 16,
                 path: str = "/v1/chat/completions") -> None:
        self.stack = stack
        self.path = path
        self.responses: list[tuple[int, dict[str, str], bytes]] = []
        self.errors = 0
        self._stop = False
        self._tasks = [asyncio.create_task(self._client()) for _ in range(clients)]

    async def _client(self) -> None:
        while not self._stop:
            try:
                r = await request(self.stack.listen_port, self.path,
                                  headers={"x-smg-priority": "bulk"}, body=b"{}", timeout=30)
                self.responses.append((r.status, r.headers, r.body))
            except HTTP_ERRORS:
                self.errors += 1

    async def stop(self) -> None:
        self._stop = True
        await asyncio.gather(*self._tasks)


async def envoy_share(stack: Stack, key: str = edge.runtime_key(B)) -> float:
    """The share Envoy's runtime has for bulk now (0 when only the static layer has it)."""
    _, body = await get(f"http://127.0.0.1:{stack.admin_port}/runtime?format=json", 2.0)
    entry = json.loads(body)["entries"].get(key, {})
    # Envoy prints a map value as protobuf text: ... "numerator" value { number_value: N }
    m = re.search(r"numerator\D*?([0-9][0-9.e+]*)", entry.get("final_value", ""), re.S)
    return float(m.group(1)) / edge.DENOMINATOR if m else 0.0


async def wait_share(stack: Stack, cond: object, timeout: float,
                     key: str = edge.runtime_key(B)) -> float:
    deadline = time.monotonic() + timeout
    while True:
        share = await envoy_share(stack, key)
        if cond(share):  # type: ignore[operator]
            return time.monotonic()
        if time.monotonic() > deadline:
            raise AssertionError(f"share {share} after {timeout}s")
        await asyncio.sleep(0.02)


async def checks(stack: Stack) -> int:
    """Check RPCs Envoy made (whatever their answer)."""
    total = 0
    for s in ("ok", "denied", "error", "failure_mode_allowed"):
        total += await stack.envoy_stat(f"http\\.ingress\\.ext_authz\\.{s}")
    return total


async def counted(stack: Stack) -> tuple[float, float]:
    m = await stack.metrics()
    return (m.get('smg_scheduler_admit_total{class="bulk",outcome="rejected_queue_full"}', 0.0),
            m.get('smg_sidecar_edge_shed_total{class="bulk"}', 0.0))


@pytest.mark.e2e
async def test_a_flood_is_answered_by_envoy_with_the_contract_bytes_and_counted(
        tmp_path: Path) -> None:
    async with edge_stack(tmp_path) as stack:
        flood = Flood(stack)
        try:
            await wait_share(stack, lambda s: s >= 0.5, timeout=10)
            checks0, before = await checks(stack), len(flood.responses)
            await asyncio.sleep(1.5)
            checks1, after = await checks(stack), len(flood.responses)
        finally:
            await flood.stop()
        sent = after - before
        # Most of the flood never became a Check: Envoy answered it.
        assert checks1 - checks0 < sent / 2, (checks1 - checks0, sent)
        rejected = [r for r in flood.responses if r[0] == 429]
        assert len(rejected) > sent / 2
        for status, headers, body in rejected:  # Envoy's and the sidecar's alike
            assert status == BULK_FULL.status
            assert body == BULK_FULL.body.encode()
            for k, v in BULK_FULL.headers:
                assert headers.get(k) == v, (k, headers)
        assert {r[0] for r in flood.responses} <= {200, 429}
        # Every 429 counted once as the contract counts (the edge ones within a flush).
        denied_by_sidecar = await stack.envoy_stat("http\\.ingress\\.ext_authz\\.denied")
        deadline = time.monotonic() + 2 * edge.SHED_LOG_FLUSH_SECS + 2
        while True:
            full, shed = await counted(stack)
            if full == len(rejected) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.05)
        assert full == len(rejected)
        assert shed == len(rejected) - denied_by_sidecar > 0


@pytest.mark.e2e
async def test_the_edge_429_keeps_the_clients_keep_alive_connection(tmp_path: Path) -> None:
    """Envoy closes an HTTP/1.1 connection after a local reply sent before the request
    was complete; the edge route reads the body first, so a flood's client keeps its
    connection (and Envoy accepts no new one per shed request)."""
    async with edge_stack(tmp_path) as stack:
        flood = Flood(stack)
        try:
            await wait_share(stack, lambda s: s >= 0.9, timeout=15)
            edge0 = (await counted(stack))[1]
            reader, writer = await asyncio.open_connection("127.0.0.1", stack.listen_port)
            body = b'{"model": "demo", "messages": []}'
            req = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nx-smg-priority: bulk\r\n"
                   b"content-length: %d\r\n\r\n%s" % (len(body), body))
            rejected = 0
            for _ in range(20):  # at a share of 0.9 or more, most of them are Envoy's
                writer.write(req)
                head = (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)).decode()
                lines = head.lower().split("\r\n")
                length = next(int(ln.partition(":")[2]) for ln in lines
                              if ln.startswith("content-length:"))
                got = await reader.readexactly(length)
                assert "connection: close" not in lines, head
                if lines[0].startswith("http/1.1 429"):
                    assert got == BULK_FULL.body.encode()
                    rejected += 1
            writer.close()
        finally:
            await flood.stop()
        assert rejected >= 10
        deadline = time.monotonic() + 2 * edge.SHED_LOG_FLUSH_SECS + 2
        while (await counted(stack))[1] == edge0:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)


@pytest.mark.e2e
async def test_the_class_is_admitted_again_soon_after_its_queue_has_room(
        tmp_path: Path) -> None:
    async with edge_stack(tmp_path) as stack:
        flood = Flood(stack)
        try:
            await wait_share(stack, lambda s: s >= 0.5, timeout=10)
        finally:
            await flood.stop()
        # The flood's clients are gone; the queue drains (1 slot, 0.5 s per request).
        m = await stack.metrics()
        deadline = time.monotonic() + 5
        while m.get('smg_scheduler_queue_depth{class="bulk"}', 0) >= 2:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
            m = await stack.metrics()
        room = time.monotonic()
        # A bulk request every 50 ms from now on: how long is one still shed by Envoy?
        last_edge = room
        admitted_at = None
        while admitted_at is None:
            sent = time.monotonic()  # an admitted one answers 0.5 s later
            r = await request(stack.listen_port, headers={"x-smg-priority": "bulk"},
                              body=b"{}", timeout=30)
            if r.status == 429:
                last_edge = sent
            else:
                admitted_at = sent
            assert time.monotonic() - room < 5
            await asyncio.sleep(0.05)
        # Two control intervals to see a quiet one, plus Envoy's reload and a request.
        bound = 2 * edge.CONTROL_INTERVAL_SECS + 0.5
        assert last_edge - room <= bound, last_edge - room
        off_at = await wait_share(stack, lambda s: s == 0.0, timeout=bound)
        assert off_at - room <= bound + 0.1


@pytest.mark.e2e
async def test_a_killed_sidecar_leaves_the_switch_off_within_the_ttl(tmp_path: Path) -> None:
    async with edge_stack(tmp_path) as stack:
        flood = Flood(stack)
        try:
            await wait_share(stack, lambda s: s >= 0.5, timeout=10)
            stack.kill_sidecar()
            killed = time.monotonic()
            off = await wait_share(stack, lambda s: s == 0.0, timeout=edge.TTL_SECS + 2)
        finally:
            await flood.stop()
        # The sidecar last spoke at most one control interval before it died.
        assert off - killed <= edge.TTL_SECS + 0.5, off - killed
        # Off means every bulk request goes to ext_authz again: no sidecar -> 503.
        for _ in range(10):
            r = await request(stack.listen_port, headers={"x-smg-priority": "bulk"},
                              body=b"{}", timeout=10)
            assert r.status == 503
        # A sidecar started again is asked again (Envoy's xDS retry) and steers again.
        stack.start_sidecar()
        await stack.wait_sidecar_ready()
        flood = Flood(stack)
        try:
            await wait_share(stack, lambda s: s >= 0.5, timeout=30)
        finally:
            await flood.stop()


# ------------------------------------------------------------------ Istio recipe

ISTIO_EDGE = Path(__file__).resolve().parents[1] / "k8s" / "istio" / "edge-shed"
ISTIO_SIDECAR_CLUSTER = "outbound|9001||priority-gate.local"


def _istio_pieces() -> tuple[dict[str, Any], dict[str, Any], dict[str, Any], dict[str, Any]]:
    """The recipe's route, access logger, bootstrap override and buffer filter."""
    import yaml
    (ef,) = yaml.safe_load_all((ISTIO_EDGE / "envoyfilter-edge-shed.yaml").read_text())
    route_patch, filter_patch, hcm_patch = ef["spec"]["configPatches"]
    assert route_patch["applyTo"] == "HTTP_ROUTE"
    assert route_patch["patch"]["operation"] == "INSERT_FIRST"
    assert filter_patch["applyTo"] == "HTTP_FILTER"
    assert filter_patch["patch"]["operation"] == "INSERT_BEFORE"
    assert filter_patch["match"]["listener"]["filterChain"]["filter"]["subFilter"][
        "name"] == "envoy.filters.http.router"
    assert hcm_patch["patch"]["operation"] == "MERGE"
    (logger,) = hcm_patch["patch"]["value"]["typed_config"]["access_log"]
    (cm,) = yaml.safe_load_all((ISTIO_EDGE / "bootstrap-override.yaml").read_text())
    override = json.loads(cm["data"]["custom_bootstrap.json"])
    return route_patch["patch"]["value"], logger, override, filter_patch["patch"]["value"]


def _hcm(boot: dict[str, Any]) -> dict[str, Any]:
    hcm: dict[str, Any] = boot["static_resources"]["listeners"][0]["filter_chains"][0][
        "filters"][0]["typed_config"]
    return hcm


def test_the_istio_edge_recipe_is_the_bootstraps_edge_path() -> None:
    route, logger, override, buffer = _istio_pieces()
    boot: dict[str, Any] = _yaml(_render(edge_shed=True))  # type: ignore[assignment]
    hcm = _hcm(boot)
    assert route == hcm["route_config"]["virtual_hosts"][0]["routes"][0]
    # The edge route reads the body first: the buffer filter, off but on that route.
    (want_buffer,) = [f for f in hcm["http_filters"] if f["name"] == buffer["name"]]
    assert buffer == want_buffer
    (want_logger,) = [lg for lg in hcm["access_log"]
                      if lg["typed_config"]["common_config"]["log_name"] == edge.SHED_LOG_NAME]
    grpc = logger["typed_config"]["common_config"]["grpc_service"]
    assert grpc["envoy_grpc"]["cluster_name"] == ISTIO_SIDECAR_CLUSTER
    grpc["envoy_grpc"]["cluster_name"] = "sidecar"
    assert logger == want_logger
    layers = override["layered_runtime"]["layers"]
    rtds = layers[1]["rtds_layer"]["rtds_config"]["api_config_source"]["grpc_services"][0]
    (cluster,) = override["static_resources"]["clusters"]
    assert rtds["envoy_grpc"]["cluster_name"] == cluster["name"]
    rtds["envoy_grpc"]["cluster_name"] = "sidecar"
    assert layers == boot["layered_runtime"]["layers"]  # type: ignore[index]


def test_the_istio_edge_recipe_passes_envoy_validate_on_a_mesh_bootstrap(
        tmp_path: Path) -> None:
    """The pieces put where istiod / istio-agent put them, on the bootstrap as a mesh
    generates it (envoy/mesh.py): route first, buffer filter before the router, logger
    appended, override merged."""
    route, logger, override, buffer = _istio_pieces()
    mesh = load_renderer("mesh")
    boot: dict[str, Any] = _yaml(mesh.meshify(_render(edge_shed=False)))  # type: ignore[assignment]
    hcm = _hcm(boot)
    hcm["route_config"]["virtual_hosts"][0]["routes"].insert(0, route)
    names = [f["name"] for f in hcm["http_filters"]]
    hcm["http_filters"].insert(names.index("envoy.filters.http.router"), buffer)
    logger["typed_config"]["common_config"]["grpc_service"]["envoy_grpc"][
        "cluster_name"] = "sidecar"  # istiod's name for the same loopback port
    hcm["access_log"].append(logger)
    boot["layered_runtime"] = override["layered_runtime"]
    boot["static_resources"]["clusters"] += override["static_resources"]["clusters"]
    cfg = tmp_path / "envoy.yaml"
    import yaml
    cfg.write_text(yaml.safe_dump(boot), encoding="utf-8")
    out = subprocess.run([str(_envoy()), "--mode", "validate", "-c", str(cfg),
                          "--disable-hot-restart", "--log-level", "warn"],
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stdout + out.stderr


# ------------------------------------------------------------------ fleet

@pytest.mark.e2e
async def test_a_replicas_switch_follows_the_fleet_queue_not_its_own(tmp_path: Path) -> None:
    """Two replicas, one ledger: a flood through replica a fills the fleet's bulk queue;
    replica b's own bulk traffic (one request at a time, which its queue alone would
    always take) is refused by the ledger, and b's Envoy sheds bulk at the edge too."""
    _envoy()
    from devtools.stack import Replicas
    r = Replicas(StackConfig(workers=1, max_running_requests=1, service_time=0.5,
                             priority_yaml=PRIORITY, edge_shed=True), workdir=tmp_path)
    try:
        await r.start()
        a, b = r.stacks
        flood = Flood(a)
        try:
            await wait_share(a, lambda s: s >= 0.5, timeout=15)
            stop = False

            async def one_at_a_time() -> None:
                while not stop:
                    await request(b.listen_port, headers={"x-smg-priority": "bulk"},
                                  body=b"{}", timeout=30)
            trickle = asyncio.create_task(one_at_a_time())
            try:
                await wait_share(b, lambda s: s > 0, timeout=10)
            finally:
                stop = True
                await trickle
        finally:
            await flood.stop()
    finally:
        await r.stop()


# ------------------------------------------------------------------ k8s overlay

K8S = Path(__file__).resolve().parents[1] / "k8s"


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed")
@pytest.mark.parametrize("target,first_route", [
    ("base", "smg_edge_shed_bulk"),  # on by default
    ("overlays/pools", "smg_edge_shed_pool_chat-70b_bulk"),  # a switch per pool
])
def test_the_k8s_base_turns_both_sides_on_and_its_envoy_config_validates(
        target: str, first_route: str, tmp_path: Path) -> None:
    import yaml
    out = subprocess.run(["kubectl", "kustomize", str(K8S / target)],
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    (dep,) = [d for d in docs if d["kind"] == "Deployment"
              and d["metadata"]["name"] == "priority-gate"]
    (sidecar,) = dep["spec"]["template"]["spec"]["initContainers"]
    assert "--edge-shed" in sidecar["args"]
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap"
             and d["metadata"]["name"] == "priority-gate-envoy"]
    text = cm["data"]["envoy.yaml"]
    boot = yaml.safe_load(text)
    assert _hcm(boot)["route_config"]["virtual_hosts"][0]["routes"][0]["name"] == first_route
    # render.py's default has the edge path; its opt-out has none of it.
    render = load_renderer().render
    args: dict[str, Any] = dict(
        listen_port=1, admin_port=2, sidecar_host="127.0.0.1", sidecar_port=3,
        workers=[("127.0.0.1", 4)], authz_timeout_secs=310, flush_interval_secs=5)
    assert "layered_runtime" in yaml.safe_load(render(**args)) and "layered_runtime" in boot
    off = render(**args, edge_shed=False)
    assert "layered_runtime" not in yaml.safe_load(off) and "smg_edge_shed" not in off
    cfg = tmp_path / "envoy.yaml"
    cfg.write_text(text, encoding="utf-8")
    done = subprocess.run([str(_envoy()), "--mode", "validate", "-c", str(cfg),
                           "--disable-hot-restart", "--log-level", "warn"],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr


# ============================================================================
# Edge shedding with pools, through a real Envoy: each pool's route has a switch of its own,
# steered by that pool's queue alone, and its edge sheds are counted for that pool.


# One slot and a two-deep bulk queue on the flooded pool; two slots on the calm one.
POOLS = {"flooded": (1, 1), "calm": (1, 2)}


@pytest.mark.e2e
async def test_a_flood_on_one_pool_switches_only_that_pools_edge(
        make_stack: StackFactory) -> None:
    stack = await make_stack(priority_yaml=PRIORITY, workers=1, max_running_requests=1,
                             service_time=0.5, pools=POOLS, edge_shed=True)
    flooded, calm = edge.runtime_key(B, "flooded"), edge.runtime_key(B, "calm")
    flood = Flood(stack, path="/flooded/v1/chat/completions")
    try:
        await wait_share(stack, lambda s: s >= 0.5, timeout=10, key=flooded)
        # The other routes' bulk requests still reach their own pools' queues.
        calm_results = await asyncio.gather(*(
            request(stack.listen_port, "/calm/v1/chat/completions",
                    headers={"x-smg-priority": "bulk"}, body=b"{}", timeout=30)
            for _ in range(4)))
        default_result = await request(stack.listen_port, headers={"x-smg-priority": "bulk"},
                                       body=b"{}", timeout=30)
        others = (await envoy_share(stack, calm), await envoy_share(stack, edge.runtime_key(B)))
        still_on = await envoy_share(stack, flooded)
    finally:
        await flood.stop()
    assert [r.status for r in calm_results] == [200] * 4
    assert default_result.status == 200
    # Still on (its share moves with the flood's rate, which a loaded box slows).
    assert others == (0.0, 0.0) and still_on > 0.0
    rejected = [r for r in flood.responses if r[0] == 429]
    assert rejected
    for status, headers, body in rejected:  # Envoy's and the sidecar's alike
        assert status == BULK_FULL.status and body == BULK_FULL.body.encode()
        for k, v in BULK_FULL.headers:
            assert headers.get(k) == v, (k, headers)
    # Counted for the flooded pool only, as the contract counts (the edge's within a flush).
    denied_by_sidecar = await stack.envoy_stat("http\\.ingress\\.ext_authz\\.denied")
    full_key = 'smg_scheduler_admit_total{class="bulk",outcome="rejected_queue_full",pool="%s"}'
    shed_key = 'smg_sidecar_edge_shed_total{class="bulk",pool="%s"}'
    deadline = time.monotonic() + 2 * edge.SHED_LOG_FLUSH_SECS + 2
    while True:
        m = await stack.metrics()
        if m.get(full_key % "flooded") == len(rejected) or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.05)
    assert m[full_key % "flooded"] == len(rejected)
    assert m[shed_key % "flooded"] == len(rejected) - denied_by_sidecar > 0
    for pool in ("calm", "default"):
        assert m.get(full_key % pool, 0.0) == 0.0, pool
        assert m.get(shed_key % pool, 0.0) == 0.0, pool
        assert m[f'smg_sidecar_edge_shed_share{{class="bulk",pool="{pool}"}}'] == 0.0
    assert m['smg_sidecar_edge_shed_share{class="bulk",pool="flooded"}'] > 0.0


def test_a_shed_log_naming_no_pool_of_this_sidecar_is_not_counted() -> None:
    metrics = Metrics(tenant_top_n=4, pools=True)
    lines: list[tuple[str, str, str]] = []
    shed = edge.EdgeShed({p: metrics.pool(p) for p in ("default", "big")},
                         lambda *a: lines.append(a))
    shed.shed_counted(B, 3, "big")
    shed.shed_counted(B, 5, "ghost")  # an Envoy rendered with a pool this sidecar lacks
    shed.shed_counted(B, 2)
    r = metrics.registry
    assert r.get_sample_value("smg_sidecar_edge_shed_total",
                              {"class": "bulk", "pool": "big"}) == 3
    assert r.get_sample_value("smg_sidecar_edge_shed_total",
                              {"class": "bulk", "pool": "default"}) == 2
    assert r.get_sample_value("smg_sidecar_edge_shed_total",
                              {"class": "bulk", "pool": "ghost"}) is None
    assert r.get_sample_value("smg_scheduler_admit_total", {
        "class": "bulk", "outcome": "rejected_queue_full", "pool": "big"}) == 3
    assert len(lines) == 5
    # Each pool's switch moves on its own pool's overflow only.
    for _ in range(10):
        shed.controllers["big"].arrived(B)
        shed.controllers["big"].overflowed(B)
    for c in shed.controllers.values():
        c.tick()
    assert shed.controllers["big"].shares()[B] > 0 == shed.controllers["default"].shares()[B]
    assert edge.runtime_key(B, "big") == "smg.edge.shed.pool.big.bulk"
    assert edge.runtime_key(B) == "smg.edge.shed.bulk"


# ============================================================================
# The edge-shed logger's stream on an unauthenticated port: what a forger can do.
# Anyone reaching the gRPC port can open a stream marked as the edge-shed logger and send
# entries. It may raise bulk's counters of a pool the sidecar has, nothing else, and can
# never hold a switch on: the counted sheds are trusted only as far as the share in force
# explains them.


@settings(max_examples=300, deadline=None)
@given(overflow=st.integers(1, 400), arrivals=st.lists(st.integers(1, 50), min_size=6,
                                                      max_size=6),
       sheds=st.lists(st.integers(0, 10**7), min_size=6, max_size=6))
def test_counted_sheds_never_hold_a_switch_on(overflow: int, arrivals: list[int],
                                              sheds: list[int]) -> None:
    """After a flood, intervals whose Checks all queue (the queue has room, none overflow,
    none admitted at once) while any number of sheds is counted: the switch falls every
    interval and is off within 6 (from the 0.99 at most), as an honest count gives."""
    c = ShedController()
    _interval(c, overflow, overflow)  # nothing absorbed: the share jumps to its target
    seen = [c.shares()[B]]
    assert 0 < seen[0] <= edge.MAX_SHARE
    for arrived, shed in zip(arrivals, sheds, strict=True):
        seen.append(_interval(c, arrived, 0, shed=shed))
        if seen[-1] == 0.0:
            break
    assert seen[-1] == 0.0, seen
    assert all(a > b for a, b in itertools.pairwise(seen)), seen


def test_an_honest_count_still_keeps_a_flood_from_being_let_through_whole() -> None:
    """The liveness twin's other side: with sheds the share in force explains, a quiet
    interval lets PROBE x (1 + MARGIN) times as many through, not everything."""
    c = ShedController()
    _interval(c, 100, 100)
    high = c.shares()[B]
    through = 4
    total = round(through / (1 - high))
    quiet = _interval(c, through, 0, shed=total - through)
    assert quiet == pytest.approx(1 - edge.PROBE * (1 + edge.MARGIN) * through / total,
                                  abs=2e-3)
    assert quiet > 0.9


def _als_batch(n: int, route: str = edge.route_name(B), code: int = 429) -> bytes:
    """A batch as Envoy's edge-shed logger sends it (or a forgery with other fields)."""
    msg = als_pb2.StreamAccessLogsMessage()
    msg.identifier.log_name = edge.SHED_LOG_NAME
    for _ in range(n):
        e = msg.http_logs.log_entry.add()
        e.common_properties.route_name = route
        e.response.response_code.value = code
    out: bytes = msg.SerializeToString()
    return out


def _als_stream(channel: grpc.aio.Channel) -> grpc.aio.StreamUnaryMultiCallable:
    return channel.stream_unary("/envoy.service.accesslog.v3.AccessLogService/StreamAccessLogs",
                                request_serializer=None, response_deserializer=None)


@contextlib.asynccontextmanager
async def edge_runtime(tmp_path: Path) -> AsyncIterator[tuple[Runtime, EnvoyStandIn]]:
    """The sidecar with --edge-shed in this loop: one slot, a two-deep bulk queue."""
    cfg = tmp_path / "priority.yaml"
    cfg.write_text(PRIORITY)
    app = await build_runtime(parse_settings([
        "--priority-scheduler-enabled", "--edge-shed", "--priority-scheduler-config", str(cfg),
        "--worker-capacity-override", "1", "--grpc-listen", "127.0.0.1:0",
        "--http-listen", "127.0.0.1:0", "--log-format", "json"]))
    await app.serve()
    envoy = EnvoyStandIn(app.grpc_port)
    try:
        yield app, envoy
    finally:
        await envoy.close()
        await app.stop()


def _sample(app: Runtime, name: str, **labels: str) -> float:
    v = app.metrics.registry.get_sample_value(name, labels)
    return 0.0 if v is None else v


async def test_only_what_envoys_edge_logger_sends_is_counted(tmp_path: Path) -> None:
    async with edge_runtime(tmp_path) as (app, envoy):
        send = _als_stream(envoy.channel)

        async def stream(batches: list[bytes], *marks: tuple[str, str]) -> None:
            await send(iter(batches), metadata=marks)

        def full(cls: str) -> float:
            return _sample(app, "smg_scheduler_admit_total",
                           **{"class": cls, "outcome": "rejected_queue_full"})

        bulk = (edge.STREAM_MARK_KEY, "bulk")
        # A class no edge route sheds: nothing counted for it (no system rejections).
        for cls in ("system", "interactive", "default", "Bulk", "nonsense"):
            await stream([_als_batch(50)], (edge.STREAM_MARK_KEY, cls))
        # Entries Envoy's edge logger never writes: another route, another status.
        await stream([_als_batch(50, route="some_other_route"), _als_batch(50, code=200),
                      _als_batch(50, route=edge.route_name(B, "ghost"))], bulk)
        # A pool this sidecar does not have.
        await stream([_als_batch(50, route=edge.route_name(B, "ghost"))], bulk,
                     (edge.POOL_MARK_KEY, "ghost"))
        assert [full(c) for c in ("system", "interactive", "default", "bulk")] == [0] * 4
        assert _sample(app, "smg_sidecar_edge_shed_total", **{"class": "bulk"}) == 0
        # What the logger does send is counted, entry by entry, mixed batches included.
        mixed = als_pb2.StreamAccessLogsMessage.FromString(_als_batch(7))
        mixed.MergeFrom(als_pb2.StreamAccessLogsMessage.FromString(_als_batch(5, code=503)))
        await stream([_als_batch(3), mixed.SerializeToString()], bulk)
        assert full("bulk") == 10
        assert _sample(app, "smg_sidecar_edge_shed_total", **{"class": "bulk"}) == 10


async def test_a_forged_shed_stream_cannot_hold_the_switch_on(tmp_path: Path) -> None:
    """The switch goes on by a real overflow; then every bulk Check queues (the queue keeps
    room, nothing overflows) while a forger streams perfect edge-shed entries. The switch is
    off within six intervals of the overflow's end, not held for the whole forgery."""
    async with edge_runtime(tmp_path) as (app, envoy):
        controller = app.edge.controllers[DEFAULT_POOL] if app.edge is not None else None
        assert controller is not None
        bulk = {"x-smg-priority": "bulk"}
        holder = admission_id(await envoy.check(bulk))
        queued = [asyncio.ensure_future(envoy.check(bulk)) for _ in range(2)]
        await eventually(lambda: app.pools[DEFAULT_POOL].controller.waiting == 2, 5)
        # The flood: the queue is full, every further bulk Check overflows.
        deadline = time.monotonic() + 5
        while controller.shares()[B] < 0.5:
            assert time.monotonic() < deadline, "the switch never went on"
            for r in await asyncio.gather(*(envoy.check(bulk) for _ in range(20))):
                assert r.denied_response.status.code == 429
            await asyncio.sleep(0.05)
        on = controller.shares()[B]
        stop = asyncio.Event()

        async def forger() -> None:
            async def batches() -> AsyncIterator[bytes]:
                while not stop.is_set():
                    yield _als_batch(500)
                    await asyncio.sleep(0.02)
            await _als_stream(envoy.channel)(batches(), metadata=(
                (edge.STREAM_MARK_KEY, "bulk"),))

        async def keeper() -> None:
            """One release and one new bulk Check per step: a queued one takes the slot,
            the new one queues behind it. Arrivals every interval, none overflowing."""
            nonlocal holder
            while not stop.is_set():
                await envoy.log((holder, "end"))
                first = queued.pop(0)
                holder = admission_id(await asyncio.wait_for(first, 5))
                queued.append(asyncio.ensure_future(envoy.check(bulk)))
                await asyncio.sleep(0.05)

        tasks = [asyncio.create_task(forger()), asyncio.create_task(keeper())]
        started = time.monotonic()
        try:
            off_at = None
            forged_before = _sample(app, "smg_sidecar_edge_shed_total", **{"class": "bulk"})
            while time.monotonic() - started < 6.0:  # the finding: held 6 s at 0.83
                if controller.shares()[B] == 0.0:
                    off_at = time.monotonic()
                    break
                await asyncio.sleep(0.01)
            forged = _sample(app, "smg_sidecar_edge_shed_total",
                             **{"class": "bulk"}) - forged_before
        finally:
            stop.set()
            await asyncio.gather(*tasks)
        assert forged > 0, "the forged entries were not counted at all: nothing was tried"
        assert off_at is not None, f"the switch was held on at {controller.shares()[B]} " \
                                   f"(from {on}) for 6 s of forging"
        # Six intervals from the share in force when the forgery began, with a margin for
        # the interval under way and a loaded machine.
        assert off_at - started <= 7 * edge.CONTROL_INTERVAL_SECS + 1.0, off_at - started
        for q in queued:
            await envoy.log((admission_id(await asyncio.wait_for(q, 5)), "end"))
        await envoy.log((holder, "end"))
