"""The status page in a real browser: headless Chromium loads /status from a sidecar.

Chromium renders the page the way a person sees it: the test keeps its screenshot (under
the test's tmp dir, and copied to ``$PG_ARTIFACTS`` when set) and reads the DOM Chromium
built, which must hold the numbers /status.json gives, with hostile tenant names as text
and no element they smuggled in. Chromium comes from devtools/install-chromium.sh; when it
is missing the test runs that script, and skips (fails under CI) only if it cannot
install it.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import struct
import subprocess
import zlib
from collections.abc import AsyncIterator
from html.parser import HTMLParser
from pathlib import Path

import pytest

from sidecar.app import Runtime, build_runtime
from sidecar.classes import PriorityClass
from sidecar.config import DEFAULT_POOL, parse_settings
from tests.grpc_client import EnvoyStandIn
from tests.test_status import HOSTILE, PRIORITY

ROOT = Path(__file__).resolve().parent.parent
INSTALL = ROOT / "devtools" / "install-chromium.sh"
WIDTH, HEIGHT = 1280, 1400


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() not in ("", "0", "false", "no")


def _find() -> str | None:
    for name in (os.environ.get("CHROMIUM"), "chromium", "chromium-browser"):
        if name and (path := shutil.which(name)):
            return path
    return None


@pytest.fixture(scope="module")
def chromium() -> str:
    found = _find()
    if found is None:
        out = subprocess.run([str(INSTALL)], capture_output=True, text=True, timeout=900,
                             check=False)
        found = _find()
        if found is None:
            reason = (f"chromium is not installed and devtools/install-chromium.sh could not "
                      f"install it: {(out.stderr or out.stdout).strip()[-300:]}")
            if _in_ci():
                pytest.fail(reason)
            pytest.skip(reason)
    return found


async def _run(argv: list[str], timeout: float = 90.0) -> tuple[int, bytes, bytes]:
    """A child process the event loop waits for (the sidecar serves meanwhile)."""
    proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    return proc.returncode or 0, out, err


def _png(path: Path) -> tuple[int, int, set[int]]:
    """Width, height and the distinct byte values of the pixel data (blank: one or two)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, size = 8, b"", (0, 0)
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            size = struct.unpack(">II", body[:8])
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    return size[0], size[1], set(zlib.decompress(idat))


class _Dom(HTMLParser):
    """The elements and the text of a serialised DOM."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[str] = []
        self.attrs: list[tuple[str, str | None]] = []
        self.text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append(tag)
        self.attrs.extend(attrs)

    def handle_data(self, data: str) -> None:
        self.text.append(data)


@pytest.fixture
async def sidecar(tmp_path: Path) -> AsyncIterator[tuple[Runtime, EnvoyStandIn]]:
    # No slot kept for system: bulk may take all 3.
    (tmp_path / "priority.yaml").write_text(
        PRIORITY.replace("reserved_floor: 1", "reserved_floor: 0"))
    app = await build_runtime(parse_settings([
        "--priority-scheduler-enabled", "--priority-scheduler-config",
        str(tmp_path / "priority.yaml"), "--grpc-listen", "127.0.0.1:0",
        "--http-listen", "127.0.0.1:0", "--log-format", "json",
        "--priority-scheduler-default-max-class", "system", "--admission-lease-secs", "300",
        "--worker-capacity-override", "3"]))
    await app.serve()
    envoy = EnvoyStandIn(app.grpc_port)
    try:
        yield app, envoy
    finally:
        await envoy.close()
        await app.stop()


async def test_chromium_renders_the_status_page(chromium: str, tmp_path: Path,
                                                sidecar: tuple[Runtime, EnvoyStandIn]) -> None:
    app, envoy = sidecar
    port = app.http_port
    # bulk over 3 slots with a queue of 3: 3 admitted, 3 queued, then each hostile tenant
    # refused (two of the first).
    for _ in range(3):
        assert (await envoy.check({"x-smg-priority": "bulk", "x-smg-tenant": "calm"})
                ).status.code == 0
    calls = [asyncio.ensure_future(envoy.check({"x-smg-priority": "bulk",
                                                "x-smg-tenant": "calm"})) for _ in range(3)]
    bulk = app.pools[DEFAULT_POOL].controller
    deadline = asyncio.get_running_loop().time() + 10
    while bulk.snapshot().classes[PriorityClass.BULK].queue_depth < 3:
        assert asyncio.get_running_loop().time() < deadline, "the 3 never queued"
        await asyncio.sleep(0.01)
    for name in (*HOSTILE, HOSTILE[0]):
        assert (await envoy.check({"x-smg-priority": "bulk", "x-smg-tenant": name})
                ).status.code != 0
    url = f"http://127.0.0.1:{port}/status"
    common = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
              f"--user-data-dir={tmp_path / 'profile'}", f"--window-size={WIDTH},{HEIGHT}"]
    shot = tmp_path / "status.png"
    try:
        rc, _, err = await _run([*common, f"--screenshot={shot}", url])
        assert rc == 0 and shot.is_file(), err.decode(errors="replace")[-2000:]
        rc, dom_bytes, err = await _run([*common, "--dump-dom", url])
        assert rc == 0, err.decode(errors="replace")[-2000:]
    finally:
        for c in calls:
            c.cancel()
    if artifacts := os.environ.get("PG_ARTIFACTS"):
        Path(artifacts).mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, Path(artifacts) / "status.png")
    width, height, colours = _png(shot)
    assert (width, height) == (WIDTH, HEIGHT)
    assert len(colours) > 20, "the screenshot is blank"

    dom = _Dom()
    dom.feed(dom_bytes.decode())
    text = " ".join(" ".join(dom.text).split())
    # What the browser built: the page's own elements only, every hostile name as text.
    assert "script" not in dom.tags and "img" not in dom.tags
    assert not [a for a, _ in dom.attrs if a.startswith("on")]
    for name in HOSTILE:
        assert name in text, name
    assert "priority-gate status" in text and "Pool default" in text
    assert "mode: scheduler" in text and "capacity: 3 from override" in text
    # The bulk row: 3 in flight, 3 queued, limit 3; 3 admitted and 4 refused for queue full.
    row = re.search(r"bulk 3 3 3 0 [\d.]+s [\d.]+ 3 [^ ]+ 4 ", text)
    assert row, text
    assert "Tenants refused most" in text
    assert re.search(re.escape(HOSTILE[0]) + r" 2 [^ ]+ rejected_queue_full 2", text), text
