"""Hot reload the way Kubernetes updates a mounted ConfigMap: an atomic ..data swap."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from sidecar.app import Runtime, build_runtime
from sidecar.classes import PriorityClass
from sidecar.config import DEFAULT_POOL, parse_settings
from tests.conftest import describe
from tests.grpc_client import EnvoyStandIn, admission_id
from tests.test_probe_refusals import FakeLlama

CONFIG_A = """
classes:
  default: {reserved_per_slot: 0.0, queue_size: 2, queue_timeout_secs: 20}
  interactive: {reserved_floor: 0, reserved_per_slot: 0.0}
  system: {reserved_floor: 0}
"""
CONFIG_B = """
classes:
  default: {reserved_per_slot: 0.0, queue_size: 1, queue_timeout_secs: 20}
  interactive: {reserved_floor: 0, reserved_per_slot: 0.0}
  system: {reserved_floor: 0}
tenant_policies:
  "auth:vip": {max_class: system}
"""
NOBODY_PREEMPTS = """
classes:
  default: {reserved_per_slot: 0.0, queue_size: 2, queue_timeout_secs: 20}
  interactive: {reserved_floor: 0, reserved_per_slot: 0.0, can_preempt: false}
  system: {reserved_floor: 0, can_preempt: false}
"""
BROKEN = """
classes:
  default: {queue_size: 0, queue_timout_secs: 20}
"""


class ConfigMapDir:
    """The layout kubelet writes: priority.yaml -> ..data/priority.yaml, ..data -> ..<ts>."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.n = 0
        self.swap(CONFIG_A)
        os.symlink("..data/priority.yaml", root / "priority.yaml")

    @property
    def path(self) -> str:
        return str(self.root / "priority.yaml")

    def swap(self, text: str) -> None:
        self.n += 1
        version = self.root / f"..2026_12_02_{self.n}"
        version.mkdir()
        (version / "priority.yaml").write_text(text)
        tmp = self.root / "..data_tmp"
        os.symlink(version.name, tmp)
        os.replace(tmp, self.root / "..data")  # atomic, as kubelet does


@pytest.fixture
async def running(tmp_path: Path) -> AsyncIterator[tuple[Runtime, EnvoyStandIn, ConfigMapDir]]:
    cm = ConfigMapDir(tmp_path)
    app = await build_runtime(parse_settings([
        "--priority-scheduler-enabled", "--priority-scheduler-config", cm.path,
        "--worker-capacity-override", "1", "--config-poll-secs", "0.1",
        "--grpc-listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0", "--log-format", "json"]))
    await app.serve()
    envoy = EnvoyStandIn(app.grpc_port)
    yield app, envoy, cm
    await envoy.close()
    await app.stop()


def value(app: Runtime, name: str, **labels: str) -> float:
    v = app.metrics.registry.get_sample_value(name, labels)
    return 0.0 if v is None else v


# A bound on a wait for an answer or a condition, generous for a loaded box: what these
# tests check is what happens, in order, not how fast.
WAIT = 30.0


async def eventually(cond: object, timeout: float = WAIT) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():  # type: ignore[operator]
        assert asyncio.get_running_loop().time() < deadline, \
            f"not within {timeout} s: {describe(cond)}"  # type: ignore[arg-type]
        await asyncio.sleep(0.02)


async def test_valid_swap_changes_behaviour_without_disturbing_anyone(
        running: tuple[Runtime, EnvoyStandIn, ConfigMapDir]) -> None:
    app, envoy, cm = running
    inflight = await envoy.check({})
    q1 = asyncio.ensure_future(envoy.check({}))
    q2 = asyncio.ensure_future(envoy.check({}))
    await eventually(lambda: app.pools[DEFAULT_POOL].controller.waiting == 2)
    cm.swap(CONFIG_B)
    await eventually(lambda: value(app, "smg_sidecar_config_generation") == 2)
    assert value(app, "smg_sidecar_config_reload_total", result="ok") == 1
    # New admissions see queue_size 1: the queue already holds two, so a new one is shed.
    shed = await envoy.check({})
    assert shed.denied_response.status.code == 429
    # Tenant ceilings changed too.
    vip = envoy.check({"x-smg-priority": "system", "x-smg-tenant": "auth:vip"})
    # Queued requests kept their place and the in-flight one was not disturbed.
    assert app.pools[DEFAULT_POOL].controller.core.is_admitted(admission_id(inflight))
    await envoy.log((admission_id(inflight), "end"))
    # system (the vip tenant's new ceiling) outranks the queued default requests
    vip_resp = await asyncio.wait_for(vip, WAIT)
    assert vip_resp.dynamic_metadata.fields["class"].string_value == "system"
    assert not q1.done()
    await envoy.log((admission_id(vip_resp), "end"))
    first = await asyncio.wait_for(q1, WAIT)
    assert first.status.code == 0
    await envoy.log((admission_id(first), "end"))
    second = await asyncio.wait_for(q2, WAIT)
    await envoy.log((admission_id(second), "end"))
    assert app.pools[DEFAULT_POOL].controller.core.snapshot().inflight == 0


async def test_invalid_swap_changes_nothing_and_is_counted(
        running: tuple[Runtime, EnvoyStandIn, ConfigMapDir]) -> None:
    app, envoy, cm = running
    cm.swap(BROKEN)
    await eventually(lambda: value(app, "smg_sidecar_config_reload_total", result="error") == 1)
    assert value(app, "smg_sidecar_config_generation") == 1
    assert value(app, "smg_sidecar_config_reload_total", result="ok") == 0
    # Old config still in force: queue_size 2, so two requests queue rather than shed.
    first = await envoy.check({})
    queued = [asyncio.ensure_future(envoy.check({})) for _ in range(2)]
    await eventually(lambda: app.pools[DEFAULT_POOL].controller.waiting == 2)
    await envoy.log((admission_id(first), "end"))
    for q in queued:
        r = await asyncio.wait_for(q, WAIT)
        await envoy.log((admission_id(r), "end"))
    # Fixing the file is picked up again.
    cm.swap(CONFIG_B)
    await eventually(lambda: value(app, "smg_sidecar_config_generation") == 2)


async def test_reload_now_is_what_sighup_calls(
        running: tuple[Runtime, EnvoyStandIn, ConfigMapDir]) -> None:
    app, _, cm = running
    assert app.watcher is not None
    app.watcher.interval = 3600  # only the forced check can see the change
    await asyncio.sleep(0.2)
    (Path(os.path.realpath(cm.path))).write_text(CONFIG_B)
    assert await app.reload_now() is True
    assert value(app, "smg_sidecar_config_generation") == 2
    assert await app.reload_now() is False  # unchanged content: nothing to apply


async def test_reload_keeps_the_envoy_timeout_rule(tmp_path: Path) -> None:
    cm = ConfigMapDir(tmp_path)
    app = await build_runtime(parse_settings([
        "--priority-scheduler-enabled", "--priority-scheduler-config", cm.path,
        "--worker-capacity-override", "1", "--config-poll-secs", "0.1",
        "--envoy-authz-timeout", "310", "--grpc-listen", "127.0.0.1:0",
        "--http-listen", "127.0.0.1:0", "--log-format", "json"]))
    await app.serve()
    try:
        cm.swap("classes:\n  bulk: {queue_timeout_secs: 400}\n")
        await eventually(lambda: value(app, "smg_sidecar_config_reload_total",
                                       result="error") == 1)
        assert value(app, "smg_sidecar_config_generation") == 1
    finally:
        await app.stop()


DEEP_FIFO = """
classes:
  default: {reserved_per_slot: 0.0, queue_size: 10, queue_timeout_secs: 20}
  interactive: {reserved_floor: 0, reserved_per_slot: 0.0}
  system: {reserved_floor: 0}
"""
DEEP_FAIR = DEEP_FIFO.replace("queue_timeout_secs: 20}", "queue_timeout_secs: 20, "
                              "fair_queuing: true}")


async def test_reload_turning_fair_queuing_on_re_sorts_the_queued_and_loses_none(
        running: tuple[Runtime, EnvoyStandIn, ConfigMapDir]) -> None:
    """Fair queuing: the real reload path (a ConfigMap swap) re-sorts a FIFO into per-tenant
    FIFOs by arrival; nothing queued is shed, and the order served interleaves tenants."""
    app, envoy, cm = running
    cm.swap(DEEP_FIFO)
    await eventually(lambda: value(app, "smg_sidecar_config_generation") == 2)
    blocker = await envoy.check({})
    queued: dict[asyncio.Future[Any], str] = {}
    for n, tenant in enumerate(["auth:a", "auth:a", "auth:a", "auth:b", "auth:b"], start=1):
        queued[asyncio.ensure_future(envoy.check({"x-smg-tenant": tenant}))] = tenant
        await eventually(lambda n=n: app.pools[DEFAULT_POOL].controller.waiting == n)
    cm.swap(DEEP_FAIR)
    await eventually(lambda: value(app, "smg_sidecar_config_generation") == 3)
    snap = app.pools[DEFAULT_POOL].controller.snapshot()
    assert snap.classes[PriorityClass.DEFAULT].queue_depth == 5
    order: list[str] = []
    holder = admission_id(blocker)
    pending = set(queued)
    while pending:
        await envoy.log((holder, "end"))
        done, pending = await asyncio.wait(pending, timeout=WAIT,
                                           return_when=asyncio.FIRST_COMPLETED)
        assert len(done) == 1, "exactly one admitted per release"
        resp = done.pop()
        order.append(str(resp.result().dynamic_metadata.fields["tenant"].string_value))
        holder = admission_id(resp.result())
    await envoy.log((holder, "end"))
    assert order == ["auth:a", "auth:b", "auth:a", "auth:b", "auth:a"]
    assert value(app, "smg_scheduler_admit_total", **{"class": "default",
                                                      "outcome": "rejected_queue_full"}) == 0
    await eventually(lambda: app.pools[DEFAULT_POOL].controller.core.snapshot().inflight == 0)


async def test_reload_of_can_preempt_changes_which_allows_say_preemptible(
        running: tuple[Runtime, EnvoyStandIn, ConfigMapDir]) -> None:
    from sidecar import codec

    app, envoy, cm = running

    async def preemptible_key() -> bool | None:
        resp = await envoy.check({})  # default class
        await envoy.log((admission_id(resp), "end"))
        fields = resp.dynamic_metadata.fields
        if codec.PREEMPTIBLE_KEY not in fields:
            return None
        return bool(fields[codec.PREEMPTIBLE_KEY].bool_value)

    # The key is only ever set once Envoy is seen sending periodic entries (sidecar.authz).
    resp = await envoy.check({})
    await envoy.log((admission_id(resp), "periodic"), cls="default")
    await envoy.log((admission_id(resp), "end"))
    await eventually(lambda: app.liveness.table.sends_periodic("127.0.0.1"))
    # system and interactive preempt (built-in): default can be a victim, no key
    assert await preemptible_key() is None
    cm.swap(NOBODY_PREEMPTS)
    await eventually(lambda: value(app, "smg_sidecar_config_generation") == 2)
    assert app.authz.preemptible == frozenset()
    assert await preemptible_key() is False  # Envoy then opens no ext_proc stream for it


# ---------------------------------------------------------------- no silent fail-open
# A reload is checked against the start-up rule it would meet at the next restart: whose
# reservations do not fit a pool's capacity start that pool on legacy admission, uncapped
# while --max-concurrent-requests <= 0. Such a reload is refused (the file in force stays);
# capped, it is applied with a warning.

FITS_FOUR = """
classes:
  system: {reserved_floor: 1}
  interactive: {reserved_floor: 1, reserved_per_slot: 0.0}
  default: {reserved_per_slot: 0.0}
"""
NEEDS_EIGHT = FITS_FOUR.replace("system: {reserved_floor: 1}", "system: {reserved_floor: 8}")
NEEDS_EIGHT_VIP = NEEDS_EIGHT + 'tenant_policies:\n  "auth:vip": {max_class: system}\n'


@contextlib.asynccontextmanager
async def reloading(tmp_path: Path, first: str, *extra: str) -> AsyncIterator[
        tuple[Runtime, ConfigMapDir]]:
    cm = ConfigMapDir(tmp_path)
    cm.swap(first)
    app = await build_runtime(parse_settings([
        "--priority-scheduler-enabled", "--priority-scheduler-config", cm.path,
        "--worker-capacity-override", "4", "--config-poll-secs", "0.1",
        "--grpc-listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0", "--log-format", "json",
        *extra]))
    await app.serve()
    try:
        yield app, cm
    finally:
        await app.stop()


async def test_a_reload_that_would_start_the_next_process_uncapped_is_refused(
        tmp_path: Path) -> None:
    with capture_logs() as logged:
        async with reloading(tmp_path, FITS_FOUR) as (app, cm):
            cm.swap(NEEDS_EIGHT)
            await eventually(lambda: value(app, "smg_sidecar_config_reload_total",
                                           result="error") == 1)
            assert value(app, "smg_sidecar_config_generation") == 1
            assert not app.pools[DEFAULT_POOL].legacy  # the file in force keeps serving
            # A file that fits is applied as ever: the rule refuses only what it must.
            cm.swap(FITS_FOUR + 'tenant_policies:\n  "auth:vip": {max_class: system}\n')
            await eventually(lambda: value(app, "smg_sidecar_config_generation") == 2)
    (rejected,) = [e for e in logged if e["event"] == "config_reload_rejected"]
    assert rejected["log_level"] == "error" and rejected["key"] == "classes"
    assert "no cap" in rejected["reason"] and "capacity of 4" in rejected["reason"]
    assert "--check-capacity" in rejected["reason"]
    # The ground truth: the refused file would have started this sidecar uncapped.
    cfg = tmp_path / "refused.yaml"
    cfg.write_text(NEEDS_EIGHT)
    restarted = await build_runtime(parse_settings([
        "--priority-scheduler-enabled", "--priority-scheduler-config", str(cfg),
        "--worker-capacity-override", "4", "--grpc-listen", "127.0.0.1:0",
        "--http-listen", "127.0.0.1:0"]))
    try:
        assert restarted.pools[DEFAULT_POOL].legacy
        assert restarted.metrics.registry.get_sample_value(
            "smg_sidecar_admission_fallback",
            {"mode": "legacy_uncapped", "reason": "reservations_exceed_capacity"}) == 1
    finally:
        await restarted.stop()


async def test_a_capped_fallback_is_applied_with_a_warning(tmp_path: Path) -> None:
    with capture_logs() as logged:
        async with reloading(tmp_path, FITS_FOUR, "--max-concurrent-requests", "4") as (app, cm):
            cm.swap(NEEDS_EIGHT)
            await eventually(lambda: value(app, "smg_sidecar_config_generation") == 2)
            assert value(app, "smg_sidecar_config_reload_total", result="error") == 0
    (warned,) = [e for e in logged if e["event"] == "config_reload_reservations_exceed_capacity"]
    assert (warned["log_level"], warned["capacity"], warned["concurrency_cap"]) == (
        "warning", 4, 4)
    assert warned["reserved_total"] > 4


async def test_a_reload_is_not_refused_for_what_the_file_in_force_does_too(
        tmp_path: Path) -> None:
    """Started on legacy admission (the file in force does not fit either): a reload that
    does not fit is not this reload's doing, and tenant ceilings must still be changeable."""
    async with reloading(tmp_path, NEEDS_EIGHT) as (app, cm):
        assert app.pools[DEFAULT_POOL].legacy
        cm.swap(NEEDS_EIGHT_VIP)
        await eventually(lambda: value(app, "smg_sidecar_config_generation") == 2)
        assert value(app, "smg_sidecar_config_reload_total", result="error") == 0


async def test_a_named_pools_reload_is_refused_naming_the_pool(tmp_path: Path) -> None:
    async with FakeLlama() as big, FakeLlama() as small:  # four slots each
        cm = ConfigMapDir(tmp_path)
        cm.swap(FITS_FOUR)
        app = await build_runtime(parse_settings([
            "--priority-scheduler-enabled", "--priority-scheduler-config", cm.path,
            "--worker-urls", big.url, f"small={small.url}", "--config-poll-secs", "0.1",
            "--grpc-listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0"]))
        await app.serve()
        try:
            with capture_logs() as logged:
                cm.swap(FITS_FOUR + "pools:\n  small: {classes: {system: {reserved_floor: 8}}}\n")
                await eventually(lambda: value(app, "smg_sidecar_config_reload_total",
                                               result="error") == 1)
            (rejected,) = [e for e in logged if e["event"] == "config_reload_rejected"]
            assert rejected["key"] == "pools.small.classes" and "'small'" in rejected["reason"]
            assert value(app, "smg_sidecar_config_generation") == 1
        finally:
            await app.stop()
