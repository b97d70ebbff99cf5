"""A class that may preempt but reserves no slot waits behind running requests where
preemption is suspended (llama.cpp): said at start-up and by ``--check-config``, and the
warning is the truth: on random class tables, with the shipped scheduler's preemption
off, a request of such a class finding every other slot taken waits, and a request of a
class not warned about is admitted at once.
"""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

from structlog.testing import capture_logs

from devtools.fleet import FakeWorker
from sidecar.app import build_runtime
from sidecar.classes import HIGH_TO_LOW, PriorityClass
from sidecar.config import parse_settings
from sidecar.priority_yaml import parse_priority_config, preemption_warnings, unreserved_preemptors
from sidecar.scheduler import Admitted, ClassSettings, Scheduler
from sidecar.scheduler.reservations import reservations_fit
from sidecar.scheduler.settings import without_preemption
from tests.clock import FakeClock

S, I, D, B = (PriorityClass.SYSTEM, PriorityClass.INTERACTIVE, PriorityClass.DEFAULT,
              PriorityClass.BULK)
ROOT = Path(__file__).resolve().parent.parent
UNRESERVED = """
classes:
  system: {reserved_floor: 0}
  interactive: {reserved_floor: 0, reserved_per_slot: 0.0}
  default: {reserved_per_slot: 0.0}
"""
RESERVED = """
classes:
  system: {reserved_floor: 1}
  interactive: {reserved_floor: 1, reserved_per_slot: 0.0}
  default: {reserved_per_slot: 0.0}
"""


def test_check_config_warns_for_each_preempting_class_without_a_floor(tmp_path: Path) -> None:
    path = tmp_path / "priority.yaml"
    for text, want in ((UNRESERVED, ["system", "interactive"]), (RESERVED, [])):
        path.write_text(text)
        out = subprocess.run([sys.executable, "-m", "sidecar", "--check-config", str(path)],
                             capture_output=True, text=True, timeout=60, cwd=ROOT,
                             check=False)
        assert out.returncode == 0 and "OK (sha256" in out.stdout, out.stderr  # valid
        warned = [ln for ln in out.stderr.splitlines() if "can_preempt is true" in ln]
        assert [w.split("classes.")[1].split(".")[0] for w in warned] == want, out.stderr
        for w in warned:
            assert w.startswith("priority-sidecar: warning: classes.")
            assert "reserved_floor at least 1" in w and "llama.cpp" in w
    cfg = parse_priority_config(UNRESERVED)
    assert len(preemption_warnings(cfg)) == 2


def _waits(classes: dict[PriorityClass, ClassSettings], capacity: int,
           cls: PriorityClass) -> bool:
    """Preemption suspended; the classes below ``cls`` take every slot they may (lowest
    first); then a ``cls`` request comes: True if it waits."""
    s = Scheduler(without_preemption(classes), capacity, FakeClock(0.0))
    for low in reversed(HIGH_TO_LOW):
        if low >= cls:
            break
        n = 0
        while isinstance(s.arrive(f"{low.label}{n}", low, "t"), Admitted):
            n += 1
    return not isinstance(s.arrive("x", cls, "t"), Admitted)


def test_the_warning_is_exactly_when_such_a_request_waits_for_a_running_one() -> None:
    seed = random.randrange(1 << 30)
    print(f"seed={seed}")
    rng = random.Random(seed)
    seen = {True: 0, False: 0}
    for _ in range(400):
        capacity = rng.randint(1, 8)
        classes = {c: ClassSettings(reserved_floor=rng.choice([0, 0, 1, 2]) if c > B else 0,
                                    reserved_per_slot=rng.choice([0.0, 0.0, 0.25]),
                                    queue_size=4, queue_timeout_secs=30.0,
                                    starvation_threshold_secs=30.0,
                                    can_preempt=c > D and rng.random() < 0.8)
                   for c in HIGH_TO_LOW}
        if not reservations_fit(classes, capacity):
            continue  # the start-up check would fall back to legacy admission
        warned = set(unreserved_preemptors(classes, capacity))
        for c in HIGH_TO_LOW:
            if not classes[c].can_preempt:
                assert c not in warned
                continue
            waits = _waits(classes, capacity, c)
            assert waits == (c in warned), (seed, c, capacity, classes)
            seen[waits] += 1
        # Without a capacity, only a class with no floor is warned about (a share alone
        # rounds to nothing on few slots).
        assert set(unreserved_preemptors(classes)) == {
            c for c in HIGH_TO_LOW if classes[c].can_preempt and not classes[c].reserved_floor}
    assert seen[True] > 50 and seen[False] > 50, seen  # both sides were tried


async def test_start_up_names_the_classes_on_a_llamacpp_pool(tmp_path: Path) -> None:
    cfg = tmp_path / "priority.yaml"
    for text, want in ((UNRESERVED, ["system", "interactive"]), (RESERVED, None)):
        cfg.write_text(text)
        async with FakeWorker(engine="llamacpp", max_running_requests=4) as llama:
            settings = parse_settings([
                "--grpc-listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0",
                "--worker-urls", llama.url, "--log-format", "json",
                "--priority-scheduler-enabled", "--priority-scheduler-config", str(cfg)])
            with capture_logs() as logs:
                app = await build_runtime(settings)
            try:
                found = [e for e in logs
                         if e["event"] == "preempting_class_without_reservation"]
                if want is None:
                    assert not found, found
                else:
                    (event,) = found
                    assert event["classes"] == want and event["capacity"] == 4
                    assert event["log_level"] == "warning"
            finally:
                await app.stop()
