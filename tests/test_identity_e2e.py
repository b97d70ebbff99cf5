"""A restarted Envoy told from a connection blip, through the real Envoy.

With ``--envoy-admin-url`` (the shipped k8s base sets it) the sidecar asks its pod's Envoy
when its process started (``GET /server_info``), so for a loopback owner it tells a new
process at the same address from the same process whose access-log connection reset.
Mesh-shaped config (no periodic entries): nothing but the liveness rules keeps or frees a
long stream's slot.
"""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import pytest
import yaml

from devtools.stack import Stack, free_port
from tests.conftest import StackFactory, settle, until
from tests.test_e2e import inflight_is
from tests.test_faults import bulk_streams
from tests.test_mesh_e2e import ALS_STREAMS, BURST, warm_up

pytestmark = pytest.mark.e2e

RELEASED = "smg_sidecar_envoy_owner_released_total"
BLIPS = "smg_sidecar_envoy_owner_blips_total"


async def test_envoy_killed_before_its_first_access_log_stream_frees_its_slots_once_restarted(
        make_stack: StackFactory) -> None:
    # Review finding #2: before, the new process's first stream unleased the dead one's
    # acknowledged slots, held then until the new process died. The lease (60 s) is far
    # longer than the wait below: only the identification can free them.
    stack = await make_stack(priority_yaml=BURST, lease_secs=60.0, mesh=True, edge_shed=False,
                             capacity_from_envoy=True,
                             sidecar_args=["--envoy-owner-grace-secs", "1"])
    streams = await bulk_streams(stack, 2)  # acknowledged by ext_proc; no entry yet
    await until(stack, inflight_is("bulk", 2))
    assert (await stack.metrics()).get(ALS_STREAMS, 0) == 0  # never watched
    # Envoy's uptime has whole-second resolution: admissions within ~1 s of the new
    # process's start cannot be told from its own (the time-only rule keeps them).
    await asyncio.sleep(1.5)
    stack.kill_envoy()  # SIGKILL before any request of it ended
    for ex in streams:
        await ex.abort()
    await stack.restart_envoy()  # same address, a new process
    await warm_up(stack)  # its first entry opens its ALS stream: the sidecar asks its admin
    m = await until(stack, inflight_is("bulk", 0), timeout=5)
    assert m['smg_sidecar_lease_expired_total{class="bulk"}'] == 2
    assert m[RELEASED] == 2
    assert m.get(BLIPS, 0) == 0


class Relay:
    """A TCP relay between Envoy's access-log cluster and the sidecar's gRPC port, whose
    connections can be reset while both processes live (a conntrack reset, a keepalive
    timing out under load)."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.port = free_port()
        self.writers: list[asyncio.StreamWriter] = []
        self.server: asyncio.Server | None = None

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._conn, "127.0.0.1", self.port)

    async def _conn(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        ur, uw = await asyncio.open_connection("127.0.0.1", self.target)
        self.writers += [w, uw]
        await asyncio.gather(self._pipe(r, uw), self._pipe(ur, w))

    @staticmethod
    async def _pipe(a: asyncio.StreamReader, b: asyncio.StreamWriter) -> None:
        try:
            while data := await a.read(65536):
                b.write(data)
                await b.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            b.close()

    def reset(self) -> None:
        for w in self.writers:
            w.transport.abort()
        self.writers.clear()

    def close(self) -> None:
        if self.server is not None:
            self.server.close()


def access_log_via(stack: Stack, port: int) -> None:
    """Rewrite the stack's Envoy config: the access log reaches the sidecar through
    ``port`` (its own cluster); ext_authz and ext_proc stay direct."""
    boot: dict[str, Any] = yaml.safe_load(stack.envoy_config.read_text())
    clusters = boot["static_resources"]["clusters"]
    als = copy.deepcopy(next(c for c in clusters if c["name"] == "sidecar"))
    als["name"] = als["load_assignment"]["cluster_name"] = "sidecar_als"
    for ep in als["load_assignment"]["endpoints"]:
        for lb in ep["lb_endpoints"]:
            lb["endpoint"]["address"]["socket_address"]["port_value"] = port
    clusters.append(als)
    for listener in boot["static_resources"]["listeners"]:
        for chain in listener["filter_chains"]:
            for f in chain["filters"]:
                for log in f["typed_config"].get("access_log", []):
                    log["typed_config"]["common_config"]["grpc_service"] = {
                        "envoy_grpc": {"cluster_name": "sidecar_als"}}
    stack.envoy_config.write_text(yaml.safe_dump(boot, sort_keys=False))


async def test_a_blip_of_the_access_log_connection_keeps_a_long_streams_slot(
        make_stack: StackFactory) -> None:
    # Review finding #3: before, the lost stream read as a death after the grace and the
    # running stream's slot was released (over-admission).
    lease, grace = 3.0, 1.0
    stack = await make_stack(priority_yaml=BURST, lease_secs=lease, mesh=True, edge_shed=False,
                             capacity_from_envoy=True,
                             sidecar_args=["--envoy-owner-grace-secs", str(grace)])
    relay = Relay(stack.grpc_port)
    await relay.start()
    try:
        access_log_via(stack, relay.port)
        await stack.restart_envoy()
        await warm_up(stack)  # its ALS stream is open, through the relay
        [ex] = await bulk_streams(stack, 1, gate="finish")  # only a long stream runs
        await until(stack, inflight_is("bulk", 1))
        relay.reset()  # Envoy lives and streams; its ALS connection is gone
        await until(stack, lambda m: m.get(ALS_STREAMS, 0) == 0)
        # The condition under test is time passing: past the grace (checked twice or
        # more since) and past the lease.
        await asyncio.sleep(lease + 2 * grace)
        m = await stack.metrics()
        assert m['smg_scheduler_inflight{class="bulk"}'] == 1
        assert m.get('smg_sidecar_lease_expired_total{class="bulk"}', 0) == 0
        assert m.get(RELEASED, 0) == 0
        assert m.get(BLIPS, 0) == 1  # counted once per loss, however often it is checked
        stack.fleet.gates.open("finish")  # its final entry reopens the stream and ends it
        await asyncio.wait_for(ex.read_body(), 10)
        await ex.close()
        m = await settle(stack)
        assert m['smg_sidecar_released_total{class="bulk",reason="completed"}'] == 2
    finally:
        relay.close()
