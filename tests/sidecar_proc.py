"""The sidecar as a child process, for tests that must not share its event loop.

A burst or a connection storm measured from the sidecar's own loop would slow the
sidecar and the client together and hide what a separate Envoy sees.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import aiohttp

from devtools.proc import die_with_parent
from devtools.stack import READY_SECS


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class SidecarProcess:
    def __init__(self, args: Sequence[str], log: Path, *,
                 limits: Mapping[str, int] | None = None) -> None:
        self.grpc_port = free_port()
        self.http_port = free_port()
        self._extra = list(args)
        self.log_path = log
        self._limits = limits
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def args(self) -> list[str]:
        return ["--grpc-listen", f"127.0.0.1:{self.grpc_port}",
                "--http-listen", f"127.0.0.1:{self.http_port}",
                "--log-format", "json", *self._extra]

    async def start(self, timeout: float = READY_SECS) -> None:
        # A port free_port() found can be taken (another test run's ephemeral bind)
        # before the sidecar binds it: then it exits saying so, and starts again on
        # fresh ports. Any other exit is the test's to see.
        for attempt in range(3):
            try:
                await self._start_once(timeout)
                return
            except AssertionError:
                if attempt == 2 or "address already in use" not in self.log_path.read_text(
                        errors="replace"):
                    raise
                self.grpc_port, self.http_port = free_port(), free_port()

    async def _start_once(self, timeout: float) -> None:
        argv = die_with_parent([sys.executable, "-m", "sidecar", *self.args],
                               limits=self._limits)
        with self.log_path.open("wb") as out:
            self.proc = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        deadline = asyncio.get_running_loop().time() + timeout
        async with aiohttp.ClientSession() as s:
            while True:
                if self.proc.poll() is not None:
                    raise AssertionError(f"sidecar exited: {self.log_path.read_text()}")
                try:
                    async with s.get(f"http://127.0.0.1:{self.http_port}/readyz") as r:
                        if r.status == 200:
                            return
                except aiohttp.ClientError:
                    pass
                if asyncio.get_running_loop().time() > deadline:
                    raise AssertionError(
                        f"sidecar not ready within {timeout} s (GET /readyz on "
                        f"127.0.0.1:{self.http_port} never 200); log: {self.log_path}")
                await asyncio.sleep(0.05)

    async def metrics(self, timeout: float = 5.0) -> dict[str, float]:
        out: dict[str, float] = {}
        async with (aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as s,
                    s.get(f"http://127.0.0.1:{self.http_port}/metrics") as r):
            assert r.status == 200
            text = await r.text()
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out

    def log_lines(self) -> list[str]:
        return self.log_path.read_text(errors="replace").splitlines()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
