"""Small fleets: when the scheduler's reservations do not fit the measured capacity.

The contract keeps its fallback (legacy admission for the life of the process);
these tests hold that it is never silent: a warning with mode and reason, an
error when nothing caps legacy admission, a metric, and ``--check-config
--check-capacity N`` telling beforehand.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from sidecar.app import build_runtime
from sidecar.classes import PriorityClass
from sidecar.config import DEFAULT_POOL, capacity_verdict, parse_priority_config, parse_settings
from tests.test_probe_refusals import FakeLlama

REASON = "reservations_exceed_capacity"


@pytest.fixture
async def llama() -> AsyncIterator[FakeLlama]:
    async with FakeLlama() as w:  # 4 slots (--parallel 4)
        yield w


def fallback(reg: object, mode: str, **pool: str) -> float | None:
    return reg.get_sample_value("smg_sidecar_admission_fallback",  # type: ignore[attr-defined]
                                {"mode": mode, "reason": REASON, **pool})


# Fits four slots; the named pool's override does not (system alone wants eight).
FITS_FOUR = """
classes:
  system: {reserved_floor: 1}
  interactive: {reserved_floor: 1, reserved_per_slot: 0.0}
  default: {reserved_per_slot: 0.0}
pools:
  small: {classes: {system: {reserved_floor: 8}}}
"""


@pytest.mark.parametrize("layout", ["one_pool", "named_pools"])
@pytest.mark.parametrize(("extra", "mode"), [([], "legacy_uncapped"),
                                             (["--max-concurrent-requests", "4"], "legacy")])
async def test_a_pool_whose_reservations_do_not_fit_falls_back_loudly(
        llama: FakeLlama, extra: list[str], mode: str, layout: str, tmp_path: Path) -> None:
    # One pool: the built-in table on a four-slot engine. Named pools: the same engine is
    # pool `small`, whose table does not fit it, beside a default pool whose table fits.
    named = layout == "named_pools"
    async with FakeLlama() as other:
        if named:
            cfg = tmp_path / "priority.yaml"
            cfg.write_text(FITS_FOUR)
            workers = ["--worker-urls", other.url, f"small={llama.url}",
                       "--priority-scheduler-config", str(cfg)]
        else:
            workers = ["--worker-urls", llama.url]
        settings = parse_settings([
            "--grpc-listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0",
            "--priority-scheduler-enabled", *workers, *extra])
        with capture_logs() as logs:
            app = await build_runtime(settings)
        try:
            name = "small" if named else DEFAULT_POOL
            label = {"pool": name} if named else {}
            pool = app.pools[name]
            assert pool.legacy and pool.reading.capacity == 4
            warned = [e for e in logs
                      if e["event"] == "reservations_exceed_capacity_using_legacy_admission"]
            assert len(warned) == 1 and warned[0]["log_level"] == "warning"
            assert (warned[0]["mode"], warned[0]["reason"], warned[0]["capacity"]) == (
                mode, REASON, 4)
            assert warned[0].get("pool") == label.get("pool")  # the line names its pool
            assert "--check-capacity" in warned[0]["hint"]
            uncapped = [e for e in logs if e["event"] == "legacy_admission_uncapped"]
            assert [(e["log_level"], e.get("pool")) for e in uncapped] == (
                [("error", label.get("pool"))] if mode == "legacy_uncapped" else [])
            reg = app.metrics.registry
            assert fallback(reg, mode, **label) == 1
            other_mode = "legacy" if mode == "legacy_uncapped" else "legacy_uncapped"
            assert fallback(reg, other_mode, **label) == 0
            assert reg.get_sample_value("smg_sidecar_admission_mode",
                                        {"mode": "legacy", **label}) == 1
            # Its capacity series shows what its workers can run, capped or not.
            assert reg.get_sample_value("smg_sidecar_capacity", label) == 4
            if named:  # the default pool kept the scheduler, and says so
                default = {"pool": DEFAULT_POOL}
                assert not app.pools[DEFAULT_POOL].legacy
                assert reg.get_sample_value("smg_sidecar_admission_mode",
                                            {"mode": "scheduler", **default}) == 1
                for m in ("legacy", "legacy_uncapped"):
                    assert fallback(reg, m, **default) == 0
            # What the metrics say is what it does: uncapped, a fifth on four slots at once.
            admitted = [await asyncio.wait_for(pool.controller.admit(PriorityClass.BULK, "t"),
                                               0.5) for _ in range(4)]
            fifth = asyncio.ensure_future(pool.controller.admit(PriorityClass.BULK, "t"))
            done, _ = await asyncio.wait({fifth}, timeout=0.2)
            assert bool(done) == (mode == "legacy_uncapped")
            fifth.cancel()
            await asyncio.gather(fifth, return_exceptions=True)
            for a in admitted:
                pool.controller.release(a.admission.id)
        finally:
            await app.stop()


async def test_no_fallback_metric_when_the_reservations_fit(llama: FakeLlama,
                                                            tmp_path: Path) -> None:
    cfg = tmp_path / "priority.yaml"
    cfg.write_text("classes:\n  system: {reserved_floor: 1}\n"
                   "  interactive: {reserved_floor: 1, reserved_per_slot: 0.0}\n"
                   "  default: {reserved_per_slot: 0.0}\n")
    settings = parse_settings([
        "--grpc-listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0",
        "--worker-urls", llama.url, "--priority-scheduler-enabled",
        "--priority-scheduler-config", str(cfg)])
    app = await build_runtime(settings)
    try:
        assert not app.pools[DEFAULT_POOL].legacy
        for mode in ("legacy", "legacy_uncapped"):
            assert fallback(app.metrics.registry, mode) == 0
    finally:
        await app.stop()


def test_capacity_verdict_matches_the_reference_examples() -> None:
    builtin = parse_priority_config("{}")
    fits, text = capacity_verdict(builtin, 100, -1)
    assert not fits
    assert "32 / interactive 100 / default 10 / bulk 0 = 142" in text
    assert "UNCAPPED" in text and "at least 178" in text
    fits, text = capacity_verdict(builtin, 256, -1)
    assert fits and "= 186 fit" in text
    fits, text = capacity_verdict(builtin, 4, 4)
    assert not fits and "capped at --max-concurrent-requests 4" in text


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sidecar", *args], capture_output=True,
                          text=True, timeout=60)


def test_check_config_with_a_capacity_says_whether_the_scheduler_would_serve(
        tmp_path: Path) -> None:
    cfg = tmp_path / "priority.yaml"
    cfg.write_text("classes: {}\n")
    small = run_cli("--check-config", str(cfg), "--check-capacity", "4")
    assert small.returncode == 1
    assert small.stdout.splitlines()[0].endswith(")") and ": OK (sha256" in small.stdout
    assert "capacity 4: NOT OK" in small.stdout and "legacy admission" in small.stdout
    big = run_cli("--check-config", str(cfg), "--check-capacity", "256")
    assert big.returncode == 0 and "capacity 256: OK" in big.stdout
    alone = run_cli("--check-capacity", "4")
    assert alone.returncode == 2 and "needs --check-config" in alone.stderr
