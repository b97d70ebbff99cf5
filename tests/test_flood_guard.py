"""envoy/flood-guard.yaml, the operator's option for shedding a flood before Check.

A shed Check costs the sidecar about what an admitted one does (the gRPC call is most
of it), so the cheap shed is the one Envoy answers itself. The example's three pieces
are added to the real rendered bootstrap, validated, and run in a real Envoy with a
one-token bucket: the guarded class's second request gets the contract's request-rate
429 (status, X-SMG-Error-Code, Retry-After, content-type, body byte for byte) from
Envoy, counted in Envoy's local rate limit stats; another class is not limited. No
sidecar runs: requests that pass the guard reach ext_authz, which fails closed (503).
"""

from __future__ import annotations

import asyncio
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from devtools.httpclient import get, request
from devtools.proc import die_with_parent
from devtools.stack import load_renderer
from sidecar import responses
from sidecar.classes import PriorityClass
from tests.sidecar_proc import free_port
from tests.test_k8s import _envoy_bin

EXAMPLE = Path(__file__).resolve().parents[1] / "envoy" / "flood-guard.yaml"


def guarded_bootstrap(listen: int, admin: int, *, max_tokens: int | None = None) -> str:
    """The rendered bootstrap with the example's pieces where its comments say."""
    pieces: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text(encoding="utf-8"))
    boot = yaml.safe_load(load_renderer().render(
        listen_port=listen, admin_port=admin, sidecar_host="127.0.0.1",
        sidecar_port=free_port(), workers=[("127.0.0.1", free_port())],
        authz_timeout_secs=5, flush_interval_secs=5))
    (listener,) = boot["static_resources"]["listeners"]
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    filters = hcm["http_filters"]
    at = [f["name"] for f in filters].index("envoy.filters.http.ext_authz")
    filters.insert(at, pieces["http_filter"])
    (vhost,) = hcm["route_config"]["virtual_hosts"]
    catch_all = vhost["routes"][-1]
    assert catch_all["match"] == {"prefix": "/"}
    assert pieces["route"]["route"] == catch_all["route"]  # same action as the shipped route
    route = pieces["route"]
    if max_tokens is not None:  # a bucket that does not refill during the test
        route["typed_per_filter_config"]["envoy.filters.http.local_ratelimit"]["token_bucket"] = {
            "max_tokens": max_tokens, "tokens_per_fill": max_tokens, "fill_interval": "3600s"}
    vhost["routes"].insert(len(vhost["routes"]) - 1, route)
    hcm.setdefault("local_reply_config", {}).setdefault("mappers", []).append(
        pieces["local_reply_mapper"])
    out: str = yaml.safe_dump(boot)
    return out


def _envoy() -> Path:
    envoy = _envoy_bin()
    if envoy is None:
        pytest.skip("no Envoy binary (set ENVOY_BIN or run `make envoy`)")
    return envoy


def test_flood_guard_example_passes_envoy_validate(tmp_path: Path) -> None:
    cfg = tmp_path / "envoy.yaml"
    cfg.write_text(guarded_bootstrap(free_port(), free_port()), encoding="utf-8")
    out = subprocess.run([str(_envoy()), "--mode", "validate", "-c", str(cfg),
                          "--disable-hot-restart", "--log-level", "warn"],
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stdout + out.stderr


async def _stat(admin: int, name: str) -> int:
    status, body = await get(f"http://127.0.0.1:{admin}/stats?filter=^{name}$", 5.0)
    assert status == 200
    lines = [ln for ln in body.decode().splitlines() if ln.startswith(name + ":")]
    return int(lines[0].rpartition(" ")[2]) if lines else 0


async def test_flood_guard_answers_the_excess_with_the_contract_429(tmp_path: Path) -> None:
    envoy = _envoy()
    listen, admin = free_port(), free_port()
    cfg = tmp_path / "envoy.yaml"
    cfg.write_text(guarded_bootstrap(listen, admin, max_tokens=1), encoding="utf-8")
    log = (tmp_path / "envoy.log").open("wb")
    proc = subprocess.Popen(die_with_parent([str(envoy), "-c", str(cfg), "--disable-hot-restart",
                                             "--concurrency", "1", "--log-level", "warn"]),
                            stdout=log, stderr=log, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:  # bounded wait for Envoy to serve
            assert proc.poll() is None, (tmp_path / "envoy.log").read_text()
            try:
                if (await get(f"http://127.0.0.1:{admin}/ready", 1.0))[0] == 200:
                    break
            except (TimeoutError, OSError):
                pass
            assert time.monotonic() < deadline, "Envoy did not get ready"
            await asyncio.sleep(0.1)

        bulk = {"x-smg-priority": "bulk", "content-type": "application/json"}
        first = await request(listen, headers=bulk, body=b"{}")
        assert first.status == 503  # the token let it through to ext_authz (no sidecar)
        assert b"scheduler_queue_full" not in first.body  # other local replies keep theirs
        shed = await request(listen, headers=bulk, body=b"{}")
        want = responses.REPLIES[(responses.Rejection.RATE_LIMITED, PriorityClass.BULK)]
        assert shed.status == want.status == 429
        for name, value in want.headers:
            assert shed.headers.get(name) == value, (name, shed.headers)
        assert shed.body.decode() == want.body
        other = await request(listen, headers={"x-smg-priority": "interactive"}, body=b"{}")
        assert other.status == 503  # not guarded: reaches ext_authz
        assert await _stat(admin, "smg_flood_bulk.http_local_rate_limit.rate_limited") == 1
        assert await _stat(admin, "smg_flood_bulk.http_local_rate_limit.ok") == 1
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
