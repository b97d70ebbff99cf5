"""The demo (devtools/demo.py) never leaves the sidecar or Envoy behind, whatever stops it."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from devtools.stack import envoy_binary

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[1]


def children(pid: int) -> set[int]:
    """Live direct children of ``pid``, from /proc."""
    out = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            stat = (entry / "stat").read_text()
            fields = stat.rpartition(")")[2].split()
            if int(fields[1]) == pid and fields[0] != "Z":
                out.add(int(entry.name))
    return out


def alive(pid: int) -> bool:
    with contextlib.suppress(OSError):
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
        return state != "Z"
    return False


def wait_until(cond: object, timeout: float, what: str) -> None:
    assert callable(cond)
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


def port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


# A stand-in for make: runs its arguments as a child and waits for it.
MAKE = [sys.executable, "-c", "import subprocess, sys; sys.exit(subprocess.call(sys.argv[1:]))"]


@contextlib.contextmanager
def demo(*args: str, under_make: bool = False) -> Iterator[subprocess.Popen[bytes]]:
    """The demo (``under_make``: run by a stand-in for make, whose process this is)."""
    env = {**os.environ, "ENVOY_BIN": envoy_binary(), "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "devtools.demo", "--free-ports", *args]
    proc = subprocess.Popen([*MAKE, *cmd] if under_make else cmd, cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()


def banner(proc: subprocess.Popen[bytes]) -> bytes:
    """Read the demo's output up to its serving line (start-up done)."""
    assert proc.stdout is not None
    text = b""
    while b"Ctrl-C stops everything" not in text:
        line = proc.stdout.readline()
        assert line, text.decode()
        text += line
    return text


def sidecar_started(proc: subprocess.Popen[bytes]) -> set[int]:
    """Wait until the demo has started its sidecar (start-up is under way)."""
    found: set[int] = set()

    def started() -> bool:
        found.update(children(proc.pid))
        return bool(found)

    wait_until(started, 20, "the demo to start its sidecar")
    return found


@pytest.fixture
def reap() -> Iterator[set[int]]:
    """Pids to SIGKILL after the test if still alive, so a failing test leaks nothing."""
    pids: set[int] = set()
    yield pids
    for pid in pids:
        if alive(pid):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGHUP])
def test_children_die_with_the_demo_stopped_during_startup(
        sig: signal.Signals, reap: set[int]) -> None:
    with demo("--no-burst") as proc:
        kids = sidecar_started(proc)
        reap.update(kids)
        proc.send_signal(sig)
        proc.wait(20)
        wait_until(lambda: not any(alive(k) for k in kids), 10, f"children {kids} to die")
        if sig != signal.SIGKILL:  # an orderly stop, not a crash
            assert proc.returncode == 0


def test_closed_stdout_then_ctrl_c_stops_everything(reap: set[int]) -> None:
    """``make run | tee log`` and Ctrl-C: the reader goes first, then SIGINT arrives."""
    with demo("--no-burst") as proc:
        assert proc.stdout is not None
        ports = [int(p) for p in re.findall(rb"127\.0\.0\.1:(\d+)", banner(proc))]
        kids = children(proc.pid)
        reap.update(kids)
        assert len(kids) == 2 and ports  # the sidecar and Envoy, up
        proc.stdout.close()  # the pipe's reader is gone: the next print gets EPIPE
        proc.send_signal(signal.SIGINT)
        assert proc.wait(20) == 0
        wait_until(lambda: not any(alive(k) for k in kids), 10, f"children {kids} to die")
        wait_until(lambda: all(port_free(p) for p in ports), 10, f"ports {ports} to be free")


def test_the_demo_stops_in_order_when_its_parent_dies_alone(reap: set[int]) -> None:
    """``kill <make's pid>``: make dies without a word to its child (``make run`` execs
    the demo, so make is its parent). The kernel tells the demo (its parent's death as
    SIGTERM), and it stops as on Ctrl-C: orderly, its sidecar and Envoy with it."""
    with demo("--no-burst", under_make=True) as make:
        assert make.stdout is not None
        banner(make)
        (demo_pid,) = children(make.pid)
        kids = children(demo_pid)
        reap.update({demo_pid, *kids})
        assert len(kids) == 2  # the sidecar and Envoy, up
        make.send_signal(signal.SIGKILL)  # nothing reaches the demo from make itself
        make.wait(10)
        wait_until(lambda: not alive(demo_pid), 20, f"the demo ({demo_pid}) to stop")
        wait_until(lambda: not any(alive(k) for k in kids), 10, f"children {kids} to die")
        assert b"stopping" in make.stdout.read()  # its own orderly stop, not a kill
