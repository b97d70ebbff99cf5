"""app.py: build the whole runtime from the first capacity reading, then serve; stop
cleans up whatever state it is stopped in."""

from __future__ import annotations

import asyncio
import socket

import pytest

from sidecar.app import build_runtime
from sidecar.config import DEFAULT_POOL, parse_settings


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def settings(grpc_port: int, http_port: int, *extra: str) -> list[str]:
    return ["--grpc-listen", f"127.0.0.1:{grpc_port}", "--http-listen", f"127.0.0.1:{http_port}",
            "--log-format", "json", *extra]


def bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


async def test_a_runtime_built_but_never_served_frees_its_ports_on_stop() -> None:
    grpc_port, http_port = free_port(), free_port()
    args = parse_settings(settings(grpc_port, http_port, "--worker-capacity-override", "10"))
    app = await build_runtime(args)
    assert (app.grpc_port, app.http_port) == (grpc_port, http_port)
    assert not bindable(grpc_port) and not bindable(http_port)  # bound at build time
    await app.stop()
    assert bindable(grpc_port) and bindable(http_port)
    app = await build_runtime(args)  # the same ports again
    await app.serve()
    await app.stop()


async def test_a_failed_build_stops_the_admin_server_it_started() -> None:
    http_port = free_port()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        args = parse_settings(settings(taken.getsockname()[1], http_port,
                                       "--worker-capacity-override", "10"))
        with pytest.raises(RuntimeError, match="bind"):
            await build_runtime(args)
    assert bindable(http_port)


async def test_a_build_cancelled_while_waiting_for_capacity_stops_the_admin_server() -> None:
    http_port = free_port()
    args = parse_settings(settings(free_port(), http_port, "--priority-scheduler-enabled",
                                   "--worker-urls", f"http://127.0.0.1:{free_port()}",
                                   "--startup-capacity-wait-secs", "30",
                                   "--health-interval-secs", "0.05"))
    building = asyncio.ensure_future(build_runtime(args))

    async def admin_up() -> None:
        while bindable(http_port):
            await asyncio.sleep(0.01)

    await asyncio.wait_for(admin_up(), 5)
    assert not building.done()
    building.cancel()
    with pytest.raises(asyncio.CancelledError):
        await building
    assert bindable(http_port)


async def test_reservations_exceeding_capacity_fall_back_to_legacy() -> None:
    app = await build_runtime(parse_settings([
        "--priority-scheduler-enabled", "--worker-capacity-override", "100",
        "--grpc-listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0"]))
    await app.serve()
    try:
        assert app.pools[DEFAULT_POOL].controller.core.legacy
        assert app.metrics.registry.get_sample_value(
            "smg_sidecar_admission_mode", {"mode": "legacy"}) == 1
    finally:
        await app.stop()


async def test_startup_waits_for_real_capacity_before_choosing_the_mode() -> None:
    from devtools.fleet import FakeWorker
    from devtools.httpclient import get as http_get

    port, http_port = free_port(), free_port()
    # 100 slots: the built-in reservations (142) do not fit, so legacy admission serves
    # (after waiting out the 2 s in case more workers come). Deciding on the fallback
    # capacity (1024) instead would wrongly pick the scheduler.
    worker = FakeWorker(port=port, max_running_requests=100)
    args = parse_settings([
        "--priority-scheduler-enabled", "--worker-urls", f"http://127.0.0.1:{port}",
        "--startup-capacity-wait-secs", "2", "--health-interval-secs", "0.1",
        "--grpc-listen", "127.0.0.1:0", "--http-listen", f"127.0.0.1:{http_port}"])
    building = asyncio.ensure_future(build_runtime(args))
    base = f"http://127.0.0.1:{http_port}"
    try:
        async def alive() -> int:
            while True:
                try:
                    return (await http_get(f"{base}/healthz", 1))[0]
                except OSError:  # not listening yet
                    await asyncio.sleep(0.01)

        assert await asyncio.wait_for(alive(), 5) == 200  # alive while the build waits...
        assert (await http_get(f"{base}/readyz", 1))[0] == 503  # ...not serving yet
        assert not building.done()
        await worker.start()
        app = await asyncio.wait_for(building, 10)
        try:
            assert app.pools[DEFAULT_POOL].controller.core.legacy
            assert (await http_get(f"{base}/readyz", 1))[0] == 503  # built, not serving
            await app.serve()
            assert (await http_get(f"{base}/readyz", 1))[0] == 200
        finally:
            await app.stop()
    finally:
        if not building.done():
            building.cancel()
        await worker.stop()
