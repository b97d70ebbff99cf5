"""Shared helpers: child processes, CPU accounting, percentiles, plots."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

# Re-exported for the benchmarks: one implementation shared with the test stack.
from devtools.proc import die_with_parent
from devtools.stack import free_port as free_port
from devtools.stack import terminate as terminate

REPO = Path(__file__).resolve().parents[1]
OUT = Path(__file__).resolve().parent / "out"
CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """user+system CPU seconds of ``pid`` (threads included), from /proc."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


class CpuMeter:
    """CPU seconds per wall second since it was made: this process's and each of ``pids``'."""

    def __init__(self, pids: Sequence[int]) -> None:
        self.pids = list(pids)
        self._own0 = time.process_time()
        self._pids0 = [cpu_seconds(p) for p in self.pids]

    def per_second(self, wall: float) -> tuple[float, list[float]]:
        """(this process's share of one core, each pid's) over ``wall`` seconds."""
        own = (time.process_time() - self._own0) / wall
        return own, [(cpu_seconds(p) - c) / wall
                     for p, c in zip(self.pids, self._pids0, strict=True)]


def pct(values: Sequence[float], q: float) -> float:
    """The q-quantile (0..1) by nearest rank; nan for no values."""
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def spawn(argv: Sequence[str], log: Path | None = None) -> subprocess.Popen[bytes]:
    out = open(log, "ab") if log is not None else subprocess.DEVNULL  # noqa: SIM115
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(die_with_parent(argv), stdout=out, stderr=out,
                            stdin=subprocess.DEVNULL, cwd=REPO, env=env, start_new_session=True)


def wait_tcp(port: int, timeout: float = 20.0, proc: subprocess.Popen[bytes] | None = None
             ) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), 0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"port {port} not listening")


def run_client(module: str, spec: dict[str, object], timeout: float) -> dict[str, object]:
    """Run ``python -m module --client JSON`` in its own process; its last stdout line is
    the JSON result."""
    argv = [sys.executable, "-m", module, "--client", json.dumps(spec)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cp = subprocess.run(die_with_parent(argv), capture_output=True, cwd=REPO, env=env,
                        timeout=timeout, check=False)
    lines = cp.stdout.decode().strip().splitlines()
    if cp.returncode != 0 or not lines:
        raise RuntimeError(f"client failed ({cp.returncode}): {cp.stderr.decode()[-2000:]}")
    result: dict[str, object] = json.loads(lines[-1])
    return result


def out_path(name: str) -> Path:
    OUT.mkdir(parents=True, exist_ok=True)
    return OUT / name


async def communicate(proc: asyncio.subprocess.Process, timeout: float
                      ) -> tuple[bytes, bytes]:
    """A child's (stdout, stderr) once it exits; past ``timeout`` it is killed and reaped, and
    the TimeoutError raised."""
    try:
        return await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise


async def run_client_async(module: str, spec: dict[str, object], timeout: float
                           ) -> dict[str, object]:
    """:func:`run_client` without blocking the caller's event loop (in-process workers)."""
    argv = die_with_parent([sys.executable, "-m", module, "--client", json.dumps(spec)])
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, cwd=REPO, env=env)
    out, err = await communicate(proc, timeout)
    lines = out.decode().strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"client failed ({proc.returncode}): {err.decode()[-2000:]}")
    result: dict[str, object] = json.loads(lines[-1])
    return result


def seconds_and_levels(argv: list[str] | None, description: str | None
                       ) -> tuple[float, list[int]]:
    """The saturation benchmarks' flags: seconds per point and closed-loop connection
    counts (``--quick``: 1 s points, one level)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--concurrency", default="8,32")
    p.add_argument("--quick", action="store_true", help="1 s points, one concurrency")
    args = p.parse_args(argv)
    if args.quick:
        return 1.0, [16]
    return args.seconds, [int(c) for c in args.concurrency.split(",")]


def loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])
