"""--refuse-uncapped-fallback: start-up fails rather than serve a pool uncapped.

The contract's default is kept (reservations that do not fit: legacy admission, uncapped
at --max-concurrent-requests' default; loud, tests/test_small_fleet.py). With the flag, a
pool that would serve so stops start-up (exit 1, ``startup_failed`` naming the pool);
a capped fallback, or reservations that fit, start as before.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

from sidecar.app import UncappedFallbackRefused, build_runtime
from sidecar.config import DEFAULT_POOL, parse_settings
from tests.test_app import bindable, free_port
from tests.test_probe_refusals import FakeLlama
from tests.test_reload import FITS_FOUR

REPO = Path(__file__).resolve().parents[1]


async def test_the_flag_refuses_an_uncapped_fallback_and_frees_what_it_started() -> None:
    http = free_port()
    with pytest.raises(UncappedFallbackRefused, match=r"'default'.*capacity of 4"):
        await build_runtime(parse_settings([
            "--priority-scheduler-enabled", "--refuse-uncapped-fallback",
            "--worker-capacity-override", "4", "--grpc-listen", "127.0.0.1:0",
            "--http-listen", f"127.0.0.1:{http}"]))
    assert bindable(http), "the admin server was left running"


@pytest.mark.parametrize("extra", [
    ["--max-concurrent-requests", "4"],  # legacy, but capped
    ["--priority-scheduler-config", "FITS"],  # the scheduler serves
])
async def test_the_flag_lets_a_capped_or_fitting_start_through(extra: list[str],
                                                               tmp_path: Path) -> None:
    cfg = tmp_path / "priority.yaml"
    cfg.write_text(FITS_FOUR)
    extra = [str(cfg) if a == "FITS" else a for a in extra]
    app = await build_runtime(parse_settings([
        "--priority-scheduler-enabled", "--refuse-uncapped-fallback",
        "--worker-capacity-override", "4", "--grpc-listen", "127.0.0.1:0",
        "--http-listen", "127.0.0.1:0", *extra]))
    try:
        pool = app.pools[DEFAULT_POOL]
        assert pool.legacy == ("--max-concurrent-requests" in extra)
    finally:
        await app.stop()


async def test_a_named_pool_that_would_serve_uncapped_fails_the_process(tmp_path: Path) -> None:
    """A real process, real workers: the default pool fits, pool `small` does not; exit 1
    with the pool in the line, nothing served."""
    cfg = tmp_path / "priority.yaml"
    cfg.write_text(FITS_FOUR + "pools:\n  small: {classes: {system: {reserved_floor: 8}}}\n")
    async with FakeLlama() as big, FakeLlama() as small:  # served by this loop: no blocking
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "sidecar", "--priority-scheduler-enabled",
            "--refuse-uncapped-fallback", "--priority-scheduler-config", str(cfg),
            "--worker-urls", big.url, f"small={small.url}", "--grpc-listen",
            f"127.0.0.1:{free_port()}", "--http-listen", f"127.0.0.1:{free_port()}",
            "--log-format", "json", cwd=REPO, stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE)
        _, err = await asyncio.wait_for(proc.communicate(), 60)
    stderr = err.decode()
    assert proc.returncode == 1, stderr
    lines = [json.loads(ln) for ln in stderr.splitlines() if ln.startswith("{")]
    (failed,) = [ln for ln in lines if ln["event"] == "startup_failed"]
    assert "'small'" in failed["error"] and "--refuse-uncapped-fallback" in failed["error"]
    assert not [ln for ln in lines if ln["event"] in ("started", "legacy_admission_uncapped")]
