"""No class preempts while a counted worker runs an engine that cannot cancel a running
request (llama.cpp): the rule, its metric and log, and how it follows the worker set.

Against fake workers impersonating the engines over real HTTP on loopback; the same rule
against a real llama-server is in tests/test_llama_real.py.
"""

from __future__ import annotations

from pathlib import Path

from structlog.testing import capture_logs

from devtools.fleet import FakeWorker
from sidecar.app import build_runtime
from sidecar.classes import PriorityClass
from sidecar.config import DEFAULT_POOL, parse_settings

PRIORITY = """
classes:
  system: {reserved_floor: 0}
  interactive: {reserved_floor: 0, reserved_per_slot: 0.0}
  default: {reserved_per_slot: 0.0}
"""


async def test_preemption_follows_whether_a_llamacpp_worker_is_counted(tmp_path: Path) -> None:
    cfg = tmp_path / "priority.yaml"
    cfg.write_text(PRIORITY)
    async with FakeWorker(engine="tgi", max_running_requests=4) as tgi, \
            FakeWorker(engine="llamacpp", max_running_requests=4) as llama:
        settings = parse_settings([
            "--grpc-listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0",
            "--worker-urls", tgi.url, llama.url, "--log-format", "json",
            "--priority-scheduler-enabled", "--priority-scheduler-config", str(cfg)])
        with capture_logs() as logs:
            app = await build_runtime(settings)
        await app.serve()
        try:
            reg = app.metrics.registry
            assert reg.get_sample_value("smg_sidecar_preemption_suspended") == 1
            assert app.authz.preemptible == frozenset()  # allows say preemptible: false
            assert app.pools[DEFAULT_POOL].controller.core is not None
            assert app.pools[DEFAULT_POOL].controller.core.snapshot().capacity == 8
            suspended = [e for e in logs if e["event"] == "preemption_suspended"]
            assert len(suspended) == 1 and suspended[0]["workers"] == [llama.url]
            assert suspended[0]["engines"] == ["llamacpp"]

            # The llama.cpp worker leaves the counted set: the file's rules apply again.
            llama.healthy = False
            with capture_logs() as logs:
                await app.pools[DEFAULT_POOL].monitor.poll_once()
            assert reg.get_sample_value("smg_sidecar_preemption_suspended") == 0
            assert PriorityClass.BULK in app.authz.preemptible
            assert [e["event"] for e in logs].count("preemption_resumed") == 1

            # ... and comes back: suspended again, logged once more.
            llama.healthy = True
            with capture_logs() as logs:
                await app.pools[DEFAULT_POOL].monitor.poll_once()
            assert reg.get_sample_value("smg_sidecar_preemption_suspended") == 1
            assert app.authz.preemptible == frozenset()
            assert [e["event"] for e in logs].count("preemption_suspended") == 1
        finally:
            await app.stop()


async def test_without_such_an_engine_the_files_preemption_rules_hold(tmp_path: Path) -> None:
    cfg = tmp_path / "priority.yaml"
    cfg.write_text(PRIORITY)
    async with FakeWorker(engine="tgi", max_running_requests=4) as tgi:
        settings = parse_settings([
            "--grpc-listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0",
            "--worker-urls", tgi.url, "--log-format", "json",
            "--priority-scheduler-enabled", "--priority-scheduler-config", str(cfg)])
        app = await build_runtime(settings)
        await app.serve()
        try:
            assert app.metrics.registry.get_sample_value(
                "smg_sidecar_preemption_suspended") == 0
            assert app.authz.preemptible == frozenset(
                {PriorityClass.INTERACTIVE, PriorityClass.DEFAULT, PriorityClass.BULK})
        finally:
            await app.stop()
