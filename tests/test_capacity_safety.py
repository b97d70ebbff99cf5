"""Capacity never rises because a probe failed.

The decision rules are unit-tested on :class:`sidecar.capacity.CapacityPolicy`
with an injected clock; the I/O around them against real fake workers: a slow
capacity endpoint, workers really answering unhealthy, and an EMFILE storm in a
child process whose file-descriptor limit is lowered with ``resource``.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from devtools.fleet import FakeWorker
from sidecar.capacity import CapacityPolicy, ProbeStatus, WorkerProbe
from sidecar.health import CapacityMonitor
from tests.clock import FakeClock

H, U, I = ProbeStatus.HEALTHY, ProbeStatus.UNHEALTHY, ProbeStatus.INCONCLUSIVE
REPO = Path(__file__).resolve().parent.parent


def policy(clock: FakeClock | None = None, guard: bool = False,
           fallback: int = 1024) -> CapacityPolicy:
    return CapacityPolicy(fallback=fallback, default_cap=64, saturation_guard=guard,
                          clock=clock or FakeClock())


# ------------------------------------------------------------------ the pure rules

def test_a_worker_never_read_counts_as_the_default_then_keeps_its_last_cap() -> None:
    p = policy()
    # Refused or failed, never read: one slot, never the default.
    assert p.decide([WorkerProbe("a", H, cap_failed=True)]).capacity == 1
    assert p.decide([WorkerProbe("a", H)]).capacity == 64  # reports none
    assert p.decide([WorkerProbe("a", H, cap=4)]).capacity == 4
    assert p.decide([WorkerProbe("a", H)]).capacity == 4  # unreadable now: last cap, not 64
    # Unhealthy in between: still its last cap when it comes back unreadable.
    assert p.decide([WorkerProbe("a", U), WorkerProbe("b", H, cap=2)]).capacity == 2
    assert p.decide([WorkerProbe("a", H), WorkerProbe("b", H, cap=2)]).capacity == 6


def test_the_workers_sum_saturates_at_65535_as_smgs_does() -> None:
    p = policy()
    big = [WorkerProbe("a", H, cap=50_000), WorkerProbe("b", H, cap=50_000)]
    reading = p.decide(big)
    assert reading.capacity == 65_535
    assert [w.capacity for w in reading.workers] == [50_000, 50_000]  # each as read
    assert p.decide([WorkerProbe("a", H, cap=65_535)]).capacity == 65_535
    assert p.decide([WorkerProbe("a", H, cap=65_534), WorkerProbe("b", H, cap=1)]
                    ).capacity == 65_535


def test_all_inconclusive_holds_the_last_reading() -> None:
    clock = FakeClock()
    p = policy(clock)
    first = p.decide([WorkerProbe("a", H, cap=4), WorkerProbe("b", H, cap=4)])
    clock.advance(3)
    held = p.decide([WorkerProbe("a", I), WorkerProbe("b", I)])
    assert held == first and held.held and held.capacity == 8 and held.source == "workers"
    clock.advance(2)
    assert p.held_for() == 2
    assert p.decide(None).capacity == 8  # worker set unknown (Envoy admin unreadable)
    assert p.held_for() == 2
    back = p.decide([WorkerProbe("a", H, cap=4), WorkerProbe("b", U)])
    assert not back.held and back.capacity == 4 and p.last_hold_secs == 2 and p.held_for() == 0


def test_inconclusive_among_completed_probes_counts_as_unhealthy() -> None:
    p = policy()
    p.decide([WorkerProbe("a", H, cap=4), WorkerProbe("b", H, cap=4)])
    r = p.decide([WorkerProbe("a", H, cap=4), WorkerProbe("b", I)])
    assert (r.capacity, r.healthy, r.held) == (4, 1, False)


def test_fallback_applies_only_with_no_healthy_worker_and_never_above_last_good() -> None:
    p = policy(fallback=1024)
    start = p.decide([WorkerProbe("a", U)])
    assert (start.source, start.capacity) == ("fallback", 1024)  # start-up: none seen yet
    assert p.decide([WorkerProbe("a", I)]).capacity == 1024  # nothing to hold yet
    assert p.decide([WorkerProbe("a", H, cap=8)]).capacity == 8
    r = p.decide([WorkerProbe("a", U)])
    assert (r.source, r.capacity) == ("fallback", 8)
    assert p.decide([]).capacity == 8  # worker set empty
    # A lower fallback is used as given.
    low = policy(fallback=3)
    low.decide([WorkerProbe("a", H, cap=8)])
    assert low.decide([WorkerProbe("a", U)]).capacity == 3


def test_saturation_guard_counts_running_while_requests_wait() -> None:
    p = policy(guard=True)
    r = p.decide([WorkerProbe("a", H, cap=16, running=4, waiting=9),
                  WorkerProbe("b", H, cap=8, running=8, waiting=0)])
    assert r.capacity == 4 + 8
    assert [(w.capacity, w.saturated) for w in r.workers] == [(4, True), (8, False)]
    # min(cap, running): running above the cap does not raise it.
    assert p.decide([WorkerProbe("c", H, cap=16, running=40, waiting=1)]).capacity == 16
    # A guard that is off leaves the cap alone.
    assert policy().decide([WorkerProbe("a", H, cap=16, running=4, waiting=9)]).capacity == 16


def test_saturation_guard_shrinks_an_engine_that_queues_only_when_full() -> None:
    # llama.cpp defers a request only once every slot is busy: running is its cap then,
    # so min(cap, running) would never shrink it. What waits was sent beyond it.
    p = policy(guard=True)

    def count(running: int, waiting: int, engine: str = "llamacpp") -> int:
        probe = WorkerProbe("a", H, engine, cap=4, running=running, waiting=waiting)
        return p.decide([probe]).capacity

    assert count(4, 0) == 4
    assert count(4, 2) == 2  # full with two waiting: hold two back
    assert count(4, 1) == 3  # a higher reading counts at once
    assert count(4, 9) == 2  # more waiting: down one step per round, never below 1
    assert count(4, 9) == 1 and count(4, 9) == 1
    assert [count(4, 0) for _ in range(4)] == [2, 3, 4, 4]  # drained: grows back
    # Other engines keep min(cap, running): their batch is what they run.
    p = policy(guard=True)
    assert count(4, 2, engine="vllm") == 4


def test_the_engines_own_count_beyond_what_the_sidecar_holds_is_held_back() -> None:
    held = [0]
    p = policy(guard=True)
    p.held = lambda: held[0]

    def reading(*counts: tuple[int, int], engine: str = "llamacpp") -> tuple[int, int]:
        r = p.decide([WorkerProbe(f"w{i}", H, engine, cap=4, running=run, waiting=wait)
                      for i, (run, wait) in enumerate(counts)])
        return r.capacity, r.excess

    held[0] = 2
    assert reading((4, 0)) == (2, 2)  # two it never admitted run there: two slots left
    assert reading((2, 0)) == (4, 0)  # gone: back at once (no guard learning involved)
    assert reading((1, 0)) == (4, 0)  # admitted, not arrived yet: no excess
    held[0] = 4
    # Full with two waiting that the sidecar did not send: the guard's own shrink and
    # the excess are not added up.
    assert reading((4, 2)) == (2, 2)
    assert reading((4, 0)) == (3, 0)  # grows back as the guard does
    held[0] = 3
    assert reading((4, 0), (3, 0)) == (4, 4)  # fleet-wide: 7 run, 3 held; caps 8 - 4
    assert p.decide([WorkerProbe("w0", H, "llamacpp", cap=4, running=4, waiting=0),
                     WorkerProbe("w1", H, "generic", cap=4)]).excess == 0  # one count unknown
    off = policy()
    off.held = lambda: 0
    assert off.decide([WorkerProbe("w0", H, "llamacpp", cap=4, running=4, waiting=0)]
                      ).capacity == 4  # the guard off: not compared


def test_saturation_guard_grows_back_gradually_once_the_queue_drains() -> None:
    p = policy(guard=True)

    def count(running: int, waiting: int) -> int:
        return p.decide([WorkerProbe("a", H, cap=16, running=running, waiting=waiting)]).capacity

    assert count(4, 12) == 4
    assert count(4, 3) == 4
    assert count(4, 0) == 5  # nothing waits: one more (an eighth, at least one slot)
    assert count(5, 0) == 6
    assert count(5, 1) == 5  # the 6th waited: back to what it runs
    assert count(1, 3) == 4  # a batch turning over: down by one step, not to 1
    assert count(5, 2) == 5  # a higher reading while work waits counts at once
    assert [count(0, 0) for _ in range(7)] == [6, 7, 8, 9, 10, 11, 12]  # idle: grows too
    assert count(0, 0) == 13
    assert count(0, 0) == 14
    assert count(0, 0) == 15
    assert count(0, 0) == 16  # back at its cap: no longer limited
    assert p.learned == {}
    # An unhealthy spell forgets what was learned (a restart may change the batch size).
    assert count(3, 5) == 3
    p.decide([WorkerProbe("a", U)])
    assert p.decide([WorkerProbe("a", H, cap=16)]).capacity == 16


# ------------------------------------------------------ the I/O: real fake workers

def make_monitor(urls: list[str], **kw: Any) -> CapacityMonitor:
    kw.setdefault("timeout", 0.3)
    kw.setdefault("fallback", 1024)
    return CapacityMonitor(worker_urls=urls, envoy_admin_url=None, envoy_cluster="workers",
                           interval=1.0, override=None, on_change=lambda r: None, **kw)


@pytest.fixture
async def worker() -> AsyncIterator[FakeWorker]:
    async with FakeWorker(engine="llamacpp", max_running_requests=4) as w:
        yield w


@pytest.mark.parametrize("engine", ["llamacpp", "auto"])
async def test_slow_capacity_endpoint_keeps_the_last_cap(worker: FakeWorker, engine: str) -> None:
    m = make_monitor([worker.url], engine=engine)
    try:
        assert (await m.poll_once()).capacity == 4
        worker.capacity_delay = 1.0  # > the 0.3 s probe timeout; /health still answers
        with capture_logs() as logs:
            r = await m.poll_once()
        assert (r.capacity, r.source, r.healthy) == (4, "workers", 1)  # not 64
        assert any(e["event"] == "worker_capacity_unreadable" for e in logs)
        worker.capacity_delay, worker.capacity_status = 0.0, 500  # erroring instead
        assert (await m.poll_once()).capacity == 4
    finally:
        await m.close()


async def test_slow_capacity_endpoint_of_a_worker_never_read_is_one_slot(
        worker: FakeWorker) -> None:
    # A read that failed is not an engine reporting no cap: never the default.
    worker.capacity_delay = 1.0
    m = make_monitor([worker.url], engine="llamacpp", default_cap=64)
    try:
        assert (await m.poll_once()).capacity == 1
    finally:
        await m.close()


async def test_workers_really_unhealthy_fall_back_no_higher_than_last_good(
        worker: FakeWorker) -> None:
    m = make_monitor([worker.url], fallback=1024)
    try:
        assert (await m.poll_once()).capacity == 4
        worker.healthy = False  # answers 503
        r = await m.poll_once()
        assert (r.source, r.capacity) == ("fallback", 4)
        await worker.stop()  # refuses connections
        r = await m.poll_once()
        assert (r.source, r.capacity) == ("fallback", 4)
    finally:
        await m.close()


async def test_every_probe_timing_out_holds_capacity() -> None:
    """Every probe times out (what a sidecar too busy to read replies looks like):
    capacity holds. One worker timing out while another answers is unhealthy."""
    async with FakeWorker(engine="llamacpp", max_running_requests=4) as a, \
            FakeWorker(engine="llamacpp", max_running_requests=2) as b:
        m = make_monitor([a.url, b.url], timeout=0.2)
        try:
            assert (await m.poll_once()).capacity == 6
            a.health_delay = b.health_delay = 1.0
            with capture_logs() as logs:
                r1 = await m.poll_once()
                r2 = await m.poll_once()
            assert (r1.capacity, r1.source, r1.held) == (6, "workers", True)
            assert (r2.capacity, r2.held) == (6, True)
            assert [e["event"] for e in logs if e["event"].startswith("capacity_")] == [
                "capacity_held"]  # logged once, and no capacity change
            b.health_delay = 0.0
            r = await m.poll_once()
            assert (r.capacity, r.healthy, r.held) == (2, 1, False)
        finally:
            await m.close()


EMFILE_CHILD = textwrap.dedent("""
    import asyncio, json, os, resource, sys
    from sidecar.health import CapacityMonitor

    async def main(url):
        out = {}
        m = CapacityMonitor(worker_urls=[url], envoy_admin_url=None, envoy_cluster="w",
                            interval=1.0, timeout=1.0, fallback=1024, override=None,
                            on_change=lambda r: None, engine="llamacpp")
        r = await m.poll_once()
        out["before"] = [r.capacity, r.source]
        await m.close()  # no kept-alive connection: the next probe needs new sockets
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (128, hard))
        hog = []
        try:
            while True:
                hog.append(os.open(os.devnull, os.O_RDONLY))
        except OSError as exc:
            out["storm_errno"] = exc.errno
        r = await m.poll_once()
        out["storm"] = [r.capacity, r.source, r.held]
        for fd in hog:
            os.close(fd)
        r = await m.poll_once()
        out["after"] = [r.capacity, r.source, r.held]
        await m.close()
        print(json.dumps(out), flush=True)

    asyncio.run(main(sys.argv[1]))
""")


async def test_emfile_storm_holds_capacity(worker: FakeWorker) -> None:
    """The sidecar out of file descriptors: every probe fails locally; capacity holds
    at the last good value instead of jumping to the 1024 fallback."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", EMFILE_CHILD, worker.url, cwd=REPO,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        stdout, stderr = await asyncio.wait_for(proc.communicate(), 30)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 0, stderr.decode()[-2000:]
    out = json.loads(stdout.decode().strip().splitlines()[-1])
    assert out["storm_errno"] == 24  # EMFILE
    assert out["before"] == [4, "workers"]
    assert out["storm"] == [4, "workers", True]
    assert out["after"] == [4, "workers", False]
    assert b"capacity_held" in stderr + stdout
