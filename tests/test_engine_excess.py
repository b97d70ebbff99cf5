"""The engines' own count is the ground truth (``--saturation-guard``).

A llama.cpp server keeps generating for a client that went away, and other
clients may reach it directly: its running + waiting count then exceeds what
the sidecar holds, and the sidecar must hold back as many slots until the
engine shows them gone. Real sidecar runtime, fake llama-server over loopback.
"""

from __future__ import annotations

from pathlib import Path

from structlog.testing import capture_logs

from sidecar.app import build_runtime
from sidecar.config import DEFAULT_POOL, parse_settings
from tests.test_probe_refusals import FakeLlama

SMALL = """
classes:
  system: {reserved_floor: 1}
  interactive: {reserved_floor: 1, reserved_per_slot: 0.0}
  default: {reserved_per_slot: 0.0}
"""


async def test_requests_the_sidecar_does_not_hold_take_slots_until_gone(
        tmp_path: Path) -> None:
    cfg = tmp_path / "priority.yaml"
    cfg.write_text(SMALL)
    async with FakeLlama() as w:
        settings = parse_settings([
            "--grpc-listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0",
            "--worker-urls", w.url, "--worker-engine", "llamacpp", "--saturation-guard",
            "--priority-scheduler-enabled", "--priority-scheduler-config", str(cfg)])
        app = await build_runtime(settings)
        try:
            reg = app.metrics.registry
            assert app.pools[DEFAULT_POOL].controller.snapshot().capacity == 4
            w.processing = 3  # three requests the sidecar never admitted (or released)
            with capture_logs() as logs:
                await app.pools[DEFAULT_POOL].monitor.poll_once()
                await app.pools[DEFAULT_POOL].monitor.poll_once()
            assert app.pools[DEFAULT_POOL].controller.snapshot().capacity == 1
            assert reg.get_sample_value("smg_sidecar_engine_excess") == 3
            assert [e["excess"] for e in logs if e["event"] == "engine_excess"] == [3]
            w.processing = 0
            with capture_logs() as logs:
                await app.pools[DEFAULT_POOL].monitor.poll_once()
            assert app.pools[DEFAULT_POOL].controller.snapshot().capacity == 4
            assert reg.get_sample_value("smg_sidecar_engine_excess") == 0
            assert [e["event"] for e in logs if e["event"].startswith("engine_excess")] == [
                "engine_excess_gone"]
        finally:
            await app.stop()
