"""``python -m bench``: every benchmark, in order (``--quick`` for a fast pass).

Each part runs in this process one after another; servers and load clients are
child processes. Output is also written to bench/out/RESULTS.txt.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
import time
from collections.abc import Callable

from bench import (
    _util,
    check_throughput,
    codec,
    coordination,
    core,
    deadlines,
    e2e,
    edge,
    ext_proc_cost,
    fairness,
    isolation,
    ledger,
    llm,
    pools,
    qos,
    saturation,
)


class Tee(io.TextIOBase):
    def __init__(self, *streams: io.TextIOBase) -> None:
        self.streams = streams

    def write(self, s: str) -> int:
        for st in self.streams:
            st.write(s)
            st.flush()
        return len(s)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--only", default="",
                   help="comma list: codec,core,pools,check,ext_proc,e2e,pools_envoy,isolation,"
                        "fairness,saturation,ledger,coordination,edge,deadlines,llm,qos")
    args = p.parse_args(argv)
    parts: list[tuple[str, Callable[[list[str]], int]]] = [
        ("codec", codec.main), ("core", core.main), ("pools", pools.main),
        ("check", check_throughput.main),
        ("ext_proc", ext_proc_cost.main), ("e2e", e2e.main),
        ("pools_envoy", lambda flags: pools.main(["--envoy", *flags])),
        ("isolation", isolation.main),
        ("fairness", fairness.main),
        ("saturation", saturation.main), ("ledger", ledger.main),
        ("coordination", coordination.main), ("edge", edge.main),
        ("deadlines", deadlines.main), ("llm", llm.main), ("qos", qos.main)]
    if args.only:
        parts = [x for x in parts if x[0] in args.only.split(",")]
    flags = ["--quick"] if args.quick else []
    buf = io.StringIO()
    tee = Tee(sys.stdout, buf)  # type: ignore[arg-type]
    rc = 0
    t0 = time.monotonic()
    with contextlib.redirect_stdout(tee):
        print(f"python -m bench{' --quick' if args.quick else ''}: {time.strftime('%F %T')}, "
              f"load average at start {_util.loadavg()}")
        for name, fn in parts:
            t = time.monotonic()
            try:
                rc |= fn(flags)
            except Exception as exc:  # one broken part must not hide the others
                print(f"  {name}: FAILED: {exc!r}")
                rc = 1
            print(f"  [{name}: {time.monotonic() - t:.0f} s, load average {_util.loadavg()}]\n")
        print(f"total {time.monotonic() - t0:.0f} s")
    if not args.only:
        _util.out_path("RESULTS.txt").write_text(buf.getvalue())
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
