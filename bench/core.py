"""Scheduler core cost: admit+release operations per second by queue depth.

The baseline is the same loop with an empty queue, measured in this run; the
ratios show the per-operation cost does not grow with queue length (O(1)).

A second table prices fair queuing between tenants: the same
admit+release pair with 10,000 bulk requests queued across 1, 100 and 10,000
tenants, ``fair_queuing`` off (one FIFO) and on (per-tenant FIFOs, a heap of
tenant turns: O(log tenants)); baseline: the FIFO with one tenant.

A third table prices the tenant label cap: ``Metrics(tenant_top_n=32).classified``
per call with 4 tenants vs. 10,000 (all but 32 folded into ``other``); baseline 4.
Plot: bench/out/core_scaling.png.

    python -m bench.core [--seconds 1.0] [--quick]
"""

from __future__ import annotations

import argparse
import itertools
import time
from collections import deque
from dataclasses import replace

from bench._util import out_path
from sidecar.classes import PriorityClass
from sidecar.config import BUILTIN_CLASSES
from sidecar.metrics import Metrics
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


def measure_fair(tenants: int, fair: bool, seconds: float, depth: int = 10_000) -> float:
    """admit+release pairs per second, ``depth`` bulk waiters spread over ``tenants``."""
    cfg = {c: replace(v, queue_size=200_000, queue_timeout_secs=1e9,
                      starvation_threshold_secs=1e9, fair_queuing=fair)
           for c, v in BUILTIN_CLASSES.items()}
    s = Scheduler(cfg, CAPACITY, time.monotonic)
    bulk = PriorityClass.BULK
    names = [f"auth:tenant-{i}" for i in range(tenants)]
    inflight: deque[str] = deque()
    ids = itertools.count()
    while True:  # fill what bulk may take (the rest is reserved for the classes above)
        rid = f"f{next(ids)}"
        if not isinstance(s.arrive(rid, bulk, "filler"), Admitted):
            s.cancel(rid)
            break
        inflight.append(rid)
    for i in range(depth):
        s.arrive(f"q{i}", bulk, names[i % tenants])
    s.take_events()
    done = 0
    deadline = time.perf_counter() + seconds
    start = time.perf_counter()
    while time.perf_counter() < deadline:
        for _ in range(1000):
            # A release admits the fair queue's head; the arrival (tenants in rotation)
            # queues, so the depth stays constant and tenants keep joining and leaving.
            s.release(inflight.popleft())
            s.arrive(f"n{next(ids)}", bulk, names[done % tenants])
            for e in s.take_events():
                if isinstance(e, Admitted):
                    inflight.append(e.admission.id)
            done += 1
    assert s.queue_depth(bulk) == depth
    return done / (time.perf_counter() - start)


def measure_tenants(tenants: int, seconds: float) -> float:
    """Microseconds per ``Metrics.classified`` call (a clamp: counted) over ``tenants``."""
    m = Metrics(tenant_top_n=32)
    names = [f"auth:tenant-{i}" for i in range(tenants)]
    for t in names:  # first-come: the first 32 keep their label, the rest are "other"
        m.classified(t, PriorityClass.SYSTEM, PriorityClass.DEFAULT, False)
    calls = 0
    n = len(names)
    deadline = time.perf_counter() + seconds
    start = time.perf_counter()
    while time.perf_counter() < deadline:
        for i in range(1000):
            m.classified(names[(calls + i) % n], PriorityClass.SYSTEM, PriorityClass.DEFAULT,
                         False)
        calls += 1000
    return (time.perf_counter() - start) / calls * 1e6


def plot(depths: list[int], us: list[float], direct: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(depths, us, marker="o", label="full fleet: release + dispatch + arrival queues")
    ax.axhline(1e6 / direct, color="gray", ls="--", label="free slots: admit + release")
    ax.set_xscale("log")
    ax.set_ylim(0, max(us) * 1.3)
    ax.set_xlabel("requests standing in the queues")
    ax.set_ylabel("us per admit+release pair")
    ax.set_title("scheduler core cost vs. queue depth (one thread)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_path("core_scaling.png"), dpi=90)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--seconds", type=float, default=1.0)
    p.add_argument("--depths", default="10,1000,10000,100000")
    p.add_argument("--quick", action="store_true", help="0.3 s per point")
    args = p.parse_args(argv)
    if args.quick:
        args.seconds = 0.3
    depths = [int(d) for d in args.depths.split(",")]
    print("core: admit+release pairs/s, single-threaded, one process")
    direct = measure(0, args.seconds)
    print(f"  free slots (admit, release)          {direct:>10,.0f} pairs/s  "
          f"{1e6 / direct:6.2f} us/pair")
    print("  full fleet (release -> dispatch a queue head, arrival queues); "
          f"cost ratio vs. queued={depths[0]}:")
    base = None
    us: list[float] = []
    for depth in depths:
        ops = measure(depth, args.seconds)
        base = base or ops
        us.append(1e6 / ops)
        print(f"  queued={depth:>7}                      {ops:>10,.0f} pairs/s  "
              f"{1e6 / ops:6.2f} us/pair  cost x{base / ops:.2f}")
    plot(depths, us, direct)
    print("  plot: bench/out/core_scaling.png")
    print("  fair queuing: 10,000 bulk queued across N tenants, release -> "
          "dispatch the head, arrival queues:")
    fifo1 = measure_fair(1, False, args.seconds)
    for tenants in (1, 100, 10_000):
        fifo = fifo1 if tenants == 1 else measure_fair(tenants, False, args.seconds)
        fair = measure_fair(tenants, True, args.seconds)
        print(f"    tenants={tenants:>6}  fifo {1e6 / fifo:6.2f} us/pair  "
              f"fair {1e6 / fair:6.2f} us/pair  fair cost x{fifo1 / fair:.2f} vs fifo, "
              "1 tenant")
    print("  tenant label cap (Metrics(tenant_top_n=32).classified, a clamped request):")
    t4 = measure_tenants(4, args.seconds / 2)
    t10k = measure_tenants(10_000, args.seconds / 2)
    print(f"    4 tenants       {t4:6.2f} us/call")
    print(f"    10,000 tenants  {t10k:6.2f} us/call  cost x{t10k / t4:.2f} vs 4 tenants "
          "(series stay at 32 + other)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
