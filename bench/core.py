"""Scheduler core cost: admit+release operations per second by queue depth.

The baseline is the same loop with an empty queue, measured in this run; the
ratios show the per-operation cost does not grow with queue length (O(1)).

    python -m bench.core [--seconds 1.0]
"""

from __future__ import annotations

import argparse
import itertools
import time
from collections import deque
from dataclasses import replace

from sidecar.classes import PriorityClass
from sidecar.config import BUILTIN_CLASSES
from sidecar.scheduler import Admitted, Scheduler

CAPACITY = 512
CLASSES = (PriorityClass.BULK, PriorityClass.DEFAULT, PriorityClass.INTERACTIVE)


def _scheduler(depth: int) -> tuple[Scheduler, deque[str]]:
    # Deep queues and long timeouts so the standing queue neither sheds nor times out.
    cfg = {c: replace(v, queue_size=200_000, queue_timeout_secs=1e9,
                      starvation_threshold_secs=1e9) for c, v in BUILTIN_CLASSES.items()}
    s = Scheduler(cfg, CAPACITY, time.monotonic)
    inflight: deque[str] = deque()
    ids = itertools.count()
    if depth:
        # Fill every slot, then park `depth` waiters across three classes.
        for c in PriorityClass:
            while True:
                rid = f"f{next(ids)}"
                if not isinstance(s.arrive(rid, c, "t"), Admitted):
                    s.cancel(rid)
                    break
                inflight.append(rid)
        for i in range(depth):
            s.arrive(f"q{i}", CLASSES[i % 3], "t")
    s.take_events()
    return s, inflight


def measure(depth: int, seconds: float) -> float:
    """admit+release pairs per second with ``depth`` requests standing in the queues."""
    s, inflight = _scheduler(depth)
    ids = itertools.count()
    done = 0
    deadline = time.perf_counter() + seconds
    start = time.perf_counter()
    while time.perf_counter() < deadline:
        for _ in range(1000):
            rid = f"n{next(ids)}"
            cls = CLASSES[done % 3]
            if depth:
                # Release the oldest in-flight: dispatch admits a queue head; the new
                # arrival queues, so the depth stays constant.
                s.release(inflight.popleft())
                s.arrive(rid, cls, "t")
                for e in s.take_events():
                    if isinstance(e, Admitted):
                        inflight.append(e.admission.id)
            else:
                s.arrive(rid, cls, "t")
                s.release(rid)
                s.take_events()
            done += 1
    return done / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--seconds", type=float, default=1.0)
    p.add_argument("--depths", default="10,1000,10000,100000")
    args = p.parse_args(argv)
    depths = [int(d) for d in args.depths.split(",")]
    print("core: admit+release pairs/s, single-threaded, one process")
    direct = measure(0, args.seconds)
    print(f"  free slots (admit, release)          {direct:>10,.0f} pairs/s  "
          f"{1e6 / direct:6.2f} us/pair")
    print("  full fleet (release -> dispatch a queue head, arrival queues); "
          f"cost ratio vs. queued={depths[0]}:")
    base = None
    for depth in depths:
        ops = measure(depth, args.seconds)
        base = base or ops
        print(f"  queued={depth:>7}                      {ops:>10,.0f} pairs/s  "
              f"{1e6 / ops:6.2f} us/pair  cost x{base / ops:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
