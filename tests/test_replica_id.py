"""Two live sidecars with one replica id collide loudly, never silently.

The default ``--replica-id`` is the hostname (the pod's name in Kubernetes, kept across a
container restart, so a restarted sidecar takes over its predecessor's admissions). Two
sidecars that share a hostname outside Kubernetes get the same id: the second one's
registration takes over the first one's admissions, and the ledger then refuses every
call of the first (``replica_id_in_use``): it logs ``coordination_replica_id_in_use``
once and admits within its degraded share, instead of taking the admissions back and
forth with the other. Two in-process sidecars (build_runtime) on one real valkey-server.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path

import redis.asyncio as redis
from structlog.testing import capture_logs

from devtools.valkey import ValkeyServer
from sidecar.config import default_replica_id, parse_settings
from tests.ledger_support import client, valkey_server
from tests.test_fleet import FLEET, eventually, ok, start_replica

__all__ = ["client", "valkey_server"]  # fixtures used by name


def test_the_default_replica_id_is_the_hostname_not_the_process() -> None:
    s = parse_settings(["--priority-scheduler-enabled"])
    assert s.fleet.replica_id == default_replica_id()
    assert default_replica_id() == socket.gethostname()[:128]  # not "<hostname>-<pid>"


async def test_a_second_live_sidecar_with_the_same_id_is_refused_to_the_first_loudly(
        tmp_path: Path, valkey_server: ValkeyServer, client: redis.Redis) -> None:
    ttl = 1.0
    first = await start_replica(tmp_path, valkey_server.url, "shared", capacity=4, ttl=ttl)
    second = None
    try:
        held = await ok(first.check())
        with capture_logs() as logs:
            second = await start_replica(tmp_path, valkey_server.url, "shared", capacity=4,
                                         ttl=ttl)
            assert held in second.fleet.held  # taken over: its stream still runs
            t0 = time.monotonic()
            # The refusal itself: a call that times out on a loaded machine (ttl/5) also
            # degrades the first sidecar, for a while, without it being refused.
            await eventually(
                lambda: any(e["event"] == "coordination_replica_id_in_use" for e in logs),
                timeout=5 * ttl, what="the first sidecar's refusal to be logged")
            print(f"the first sidecar refused {time.monotonic() - t0:.2f} s after the "
                  "second registered")
            await eventually(lambda: first.fleet.state == "degraded", timeout=5 * ttl,
                             what="the refused first sidecar degraded")
            await eventually(lambda: second is not None and second.fleet.state == "ok",
                             timeout=5 * ttl, what="the second sidecar ok")
        refusals = [e for e in logs if e["event"] == "coordination_replica_id_in_use"]
        assert len(refusals) == 1, [e["event"] for e in logs]
        assert refusals[0]["replica"] == "shared"
        # The admissions stay with the second: the first never took them back.
        inc = await client.hget(f"pg:{{{FLEET}}}:inc", "shared")
        assert inc == second.fleet.ledger.incarnation
        assert first.sample("smg_sidecar_coordination_state", state="degraded") == 1
        await second.end(held)
    finally:
        await first.close()
        if second is not None:
            await second.close()
