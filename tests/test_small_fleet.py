"""Small fleets: when the scheduler's reservations do not fit the measured capacity.

The contract keeps its fallback (legacy admission for the life of the process);
these tests hold that it is never silent: a warning with mode and reason, an
error when nothing caps legacy admission, a metric, and ``--check-config
--check-capacity N`` telling beforehand.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from sidecar.app import build_runtime
from sidecar.config import capacity_verdict, parse_priority_config, parse_settings
from tests.test_probe_refusals import FakeLlama

REASON = "reservations_exceed_capacity"


@pytest.fixture
async def llama() -> AsyncIterator[FakeLlama]:
    async with FakeLlama() as w:  # 4 slots (--parallel 4)
        yield w


def fallback(reg: object, mode: str) -> float | None:
    return reg.get_sample_value("smg_sidecar_admission_fallback",  # type: ignore[attr-defined]
                                {"mode": mode, "reason": REASON})


@pytest.mark.parametrize(("extra", "mode"), [([], "legacy_uncapped"),
                                             (["--max-concurrent-requests", "4"], "legacy")])
async def test_builtin_reservations_on_a_four_slot_engine_fall_back_loudly(
        llama: FakeLlama, extra: list[str], mode: str) -> None:
    settings = parse_settings([
        "--grpc-listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0",
        "--worker-urls", llama.url, "--priority-scheduler-enabled", *extra])
    with capture_logs() as logs:
        app = await build_runtime(settings)
    try:
        assert app.legacy and app.reading.capacity == 4
        warned = [e for e in logs
                  if e["event"] == "reservations_exceed_capacity_using_legacy_admission"]
        assert len(warned) == 1 and warned[0]["log_level"] == "warning"
        assert (warned[0]["mode"], warned[0]["reason"], warned[0]["capacity"]) == (
            mode, REASON, 4)
        assert "--check-capacity" in warned[0]["hint"]
        uncapped = [e for e in logs if e["event"] == "legacy_admission_uncapped"]
        assert [e["log_level"] for e in uncapped] == (
            ["error"] if mode == "legacy_uncapped" else [])
        reg = app.metrics.registry
        assert fallback(reg, mode) == 1
        other = "legacy" if mode == "legacy_uncapped" else "legacy_uncapped"
        assert fallback(reg, other) == 0
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
        assert not app.legacy
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
