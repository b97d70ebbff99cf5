"""``--check-config`` warns where the starvation rule can put a lower class ahead of a
higher one (sidecar.priority_yaml.starvation_overtakes), and the warning is the truth:
on random class tables the shipped scheduler lets a later request of the lower class in
first exactly where the warning says it can.
"""

from __future__ import annotations

import random
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

from sidecar.classes import HIGH_TO_LOW, PriorityClass
from sidecar.priority_yaml import (
    parse_priority_config,
    starvation_overtakes,
    starvation_warnings,
)
from sidecar.scheduler import BUILTIN_CLASSES, Admitted, ClassSettings, Scheduler
from tests.clock import FakeClock

S, I, D, B = (PriorityClass.SYSTEM, PriorityClass.INTERACTIVE, PriorityClass.DEFAULT,
              PriorityClass.BULK)
ROOT = Path(__file__).resolve().parent.parent


def test_the_builtin_classes_let_interactive_age_past_a_waiting_system() -> None:
    """The case seen on a 4-slot llama.cpp: interactive's 5 s against system's 30 s."""
    assert starvation_overtakes(BUILTIN_CLASSES) == [(I, S)]
    raised = dict(BUILTIN_CLASSES)
    raised[I] = replace(raised[I], starvation_threshold_secs=30.0)
    assert starvation_overtakes(raised) == []


def test_check_config_prints_the_warning_and_still_passes(tmp_path: Path) -> None:
    path = tmp_path / "priority.yaml"
    path.write_text("classes:\n  interactive: {starvation_threshold_secs: 30}\n"
                    "pools:\n  small:\n    classes:\n      default:\n"
                    "        starvation_threshold_secs: 2\n")
    out = subprocess.run([sys.executable, "-m", "sidecar", "--check-config", str(path)],
                         capture_output=True, text=True, timeout=60, cwd=ROOT, check=False)
    assert out.returncode == 0, out.stderr
    warnings = [ln for ln in out.stderr.splitlines() if "warning:" in ln]
    # The top-level table is fine now; the small pool's default ages past both above it.
    assert len(warnings) == 2, out.stderr
    assert all("pools.small.classes.default.starvation_threshold_secs (2)" in w
               for w in warnings)
    assert "pools.small.classes.system.queue_timeout_secs (30)" in warnings[0]
    assert "pools.small.classes.interactive.queue_timeout_secs (30)" in warnings[1]
    assert "PriorityGateSystemShedding" in warnings[0]
    assert "OK (sha256" in out.stdout  # the file is valid: a warning, not an error
    cfg = parse_priority_config(path.read_text())
    assert len(starvation_warnings(cfg)) == 2


def _overtakes(classes: dict[PriorityClass, ClassSettings], lo: PriorityClass,
               hi: PriorityClass) -> bool:
    """One slot, held; a ``hi`` request queues, a ``lo`` one 0.25 s after it; the slot
    frees 0.5 s after ``lo``'s threshold (all settings whole seconds, so no tie). True if
    the ``lo`` request is admitted while the ``hi`` one still waits."""
    clock = FakeClock(0.0)
    s = Scheduler(classes, 1, clock)
    assert isinstance(s.arrive("held", B, "t"), Admitted)
    s.arrive("hi", hi, "t")
    clock.advance(0.25)
    s.arrive("lo", lo, "t")
    s.take_events()
    clock.now = classes[lo].starvation_threshold_secs + 0.5
    s.tick()  # queue timeouts up to now
    s.release("held")
    admitted = [e.admission.id for e in s.take_events() if isinstance(e, Admitted)]
    return admitted == ["lo"] and s.snapshot().classes[hi].queue_depth == 1


def test_the_warning_is_exactly_when_the_scheduler_lets_the_lower_class_in_first() -> None:
    seed = random.randrange(1 << 30)
    print(f"seed={seed}")
    rng = random.Random(seed)
    seen = {True: 0, False: 0}
    for _ in range(400):
        classes = {c: ClassSettings(reserved_floor=0, reserved_per_slot=0.0,
                                    queue_size=rng.choice([0, 1, 4]),
                                    queue_timeout_secs=float(rng.randint(1, 40)),
                                    starvation_threshold_secs=float(rng.randint(1, 40)),
                                    can_preempt=False) for c in HIGH_TO_LOW}
        warned = set(starvation_overtakes(classes))
        for lo in HIGH_TO_LOW:
            for hi in HIGH_TO_LOW:
                if hi <= lo or not (classes[lo].queue_size and classes[hi].queue_size):
                    assert (lo, hi) not in warned
                    continue
                happened = _overtakes(classes, lo, hi)
                assert happened == ((lo, hi) in warned), (seed, lo, hi, classes)
                seen[happened] += 1
    assert seen[True] > 50 and seen[False] > 50, seen  # both sides were tried
