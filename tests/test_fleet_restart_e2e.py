"""A sidecar restarted with the default replica id while its streams run: never past capacity.

Two real stacks (Envoy + sidecar process each) in front of one fleet of fake workers, their
sidecars sharing one real valkey-server (devtools.stack.Replicas). Replica A runs without
``--replica-id``: its default. A holds every slot with streams; B's requests wait in the
ledger. A's sidecar is killed and started again, Envoy and its streams running on.

The default used to be ``<hostname>-<pid>``: the new process registered under a new id and
the old registration, lapsing after ``--replica-ttl-secs``, freed A's slots while their
streams still ran; B's waiters took them (measured from outside: 12 of 9 for 0.61 s). The
default is now the hostname (the pod's name in Kubernetes, which a container restart
keeps): the new process takes over the old one's admissions. Ground truth: the fake workers'
own count of what runs at once (``Tally``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path

import pytest

from devtools.fleet import wait_for
from devtools.httpclient import Exchange, Response, chat_body
from devtools.stack import Replicas, StackConfig
from tests.conftest import until
from tests.test_fleet_e2e import FLEET, OPEN_CEILING, send

pytestmark = pytest.mark.e2e

CAPACITY = 4  # two workers of two slots
# Registered for 0.9 ttl and heartbeating every 0.3 ttl: a restart of the sidecar (a few
# seconds on a loaded machine) is well within the old registration's life.
TTL = 10.0
TAKEN_OVER = 'smg_sidecar_coordination_faults_total{kind="taken_over"}'


def without_replica_id(args: list[str]) -> list[str]:
    i = args.index("--replica-id")
    return args[:i] + args[i + 2:]


async def test_a_sidecar_restarted_with_the_default_id_keeps_its_streams_counted(
        tmp_path: Path) -> None:
    r = Replicas(StackConfig(priority_yaml=FLEET, workers=2, max_running_requests=2,
                             sidecar_args=OPEN_CEILING),
                 workdir=tmp_path, ttl_secs=TTL)
    a, b = r.stacks
    a.config = dataclasses.replace(a.config,
                                   sidecar_args=without_replica_id(list(a.config.sidecar_args)))
    await r.start()
    waiting: list[asyncio.Future[Response]] = []
    streams: list[Exchange] = []
    try:
        await until(b, lambda m: m.get("smg_sidecar_live_replicas") == 2, timeout=2 * TTL)
        for _ in range(CAPACITY):
            ex = await Exchange.send(a.listen_port, body=chat_body(stream=True),
                                     headers={"x-smg-priority": "bulk",
                                              "x-fake-stream-gate": "a-streams"})
            await ex.read_head()
            streams.append(ex)
        await wait_for(lambda: r.fleet.tally.running == CAPACITY, 10)
        waiting = [asyncio.ensure_future(send(b, "default", **{"x-fake-gate": "b-done"}))
                   for _ in range(CAPACITY)]
        await until(b, lambda m: m.get('smg_scheduler_queue_depth{class="default"}')
                    == CAPACITY, timeout=10)
        r.fleet.tally.reset()

        a.kill_sidecar()  # SIGKILL: Envoy and its streams run on
        t0 = time.monotonic()
        a.start_sidecar()
        await a.wait_sidecar_ready(timeout=30)
        restarted = time.monotonic() - t0
        # Past the old registration's life and a few periodic access-log entries: on the
        # old default the slots were freed and B's waiters ran beside the streams here.
        deadline = time.monotonic() + TTL + 3.0
        while time.monotonic() < deadline:
            assert r.fleet.tally.running <= CAPACITY, (
                f"{r.fleet.tally.running} running of {CAPACITY}, "
                f"{time.monotonic() - t0:.2f} s after the restart")
            await asyncio.sleep(0.02)
        taken = (await a.metrics()).get(TAKEN_OVER)
        print(f"restart with the default id in {restarted:.2f} s: peak "
              f"{r.fleet.tally.peak}/{CAPACITY}, taken over {taken}")
        assert r.fleet.tally.peak <= CAPACITY
        assert not any(w.done() for w in waiting)  # B's requests still wait: the fleet is full
        assert taken == 1

        # Liveness: the streams end and B's waiters get every slot, no more.
        r.fleet.gates.open("a-streams")
        for ex in streams:
            await ex.read_body()
        await wait_for(lambda: r.fleet.tally.running == CAPACITY, 15)
        r.fleet.gates.open("b-done")
        assert [x.status for x in await asyncio.gather(*waiting)] == [200] * CAPACITY
        assert r.fleet.tally.peak <= CAPACITY
    finally:
        r.fleet.gates.open("a-streams")
        r.fleet.gates.open("b-done")
        for ex in streams:
            await ex.close()
        for w in waiting:
            w.cancel()
        await r.stop()
