"""A keyed engine behind JWT tenants: a real Envoy and the sidecar in front of a real
``llama-server`` started with an API key (``--api-key-file``, the key never on argv).

The tenant's token is verified and dropped by Envoy's jwt_authn; Envoy puts the engine's
own key on the upstream request (credential_injector, from the file); the sidecar's
capacity probes send the same key (``--worker-auth-file``). Ground truth is the engine:
its 200 with a completion, its 401 when the key is missing, its own ``/slots``. Built with
``devtools.front`` (``make front LLAMA=1 FRONT_ARGS="--worker-auth-file FILE"``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from devtools import identity
from devtools.front import build, parse_args
from devtools.httpclient import get as http_get
from devtools.httpclient import request
from devtools.llama import LlamaFleet, llama_server_binary
from devtools.stack import Stack
from tests.conftest import settle, until

pytestmark = [pytest.mark.e2e, pytest.mark.llama]

if llama_server_binary() is None:
    if os.environ.get("CI"):
        raise RuntimeError("CI must run the real-engine tests: no llama-server binary "
                           "(make llama-server)")
    pytest.skip("no llama-server binary: `make llama-server` builds it",
                allow_module_level=True)

KEY = "sk-llama-3f9a0c1d"
SLOTS = 2


def completion(tokens: int = 8) -> bytes:
    return json.dumps({"model": "tiny", "max_tokens": tokens, "ignore_eos": True,
                       "messages": [{"role": "user", "content": "hi"}]}).encode()


def _cmdline(pid: int) -> bytes:
    return Path(f"/proc/{pid}/cmdline").read_bytes()


async def test_a_keyed_llama_server_behind_jwt_tenants_is_served_and_probed(
        tmp_path: Path) -> None:
    key_file = tmp_path / "engine.key"
    key_file.write_text(KEY + "\n")
    args = parse_args(["--llama", "1", "--llama-slots", str(SLOTS), "--free-ports",
                       "--worker-auth-file", str(key_file), "--exit-after-ready"])
    stack = build(args)
    assert isinstance(stack.fleet, LlamaFleet)
    (engine,) = stack.fleet.workers
    try:
        await stack.start()
        # The engine itself refuses a request without its key: what Envoy must fix.
        direct = await request(engine.port, headers={"content-type": "application/json"},
                               body=completion(), timeout=30)
        assert direct.status == 401, direct.body
        # Probes: the capacity is the engine's own slot count, read with the key.
        m = await until(stack, lambda m: m.get("smg_sidecar_capacity") == SLOTS, timeout=20)
        assert "worker_probe_refused" not in stack.sidecar_log.read_text()

        acme = {"x-smg-priority": "interactive",
                "authorization": f"Bearer {identity.token('acme')}"}
        r = await request(stack.listen_port, headers=acme, body=completion(), timeout=60)
        assert r.status == 200, r.body
        assert r.json()["usage"]["completion_tokens"] == 8  # the engine generated them
        m = await settle(stack, timeout=30)
        assert m['smg_sidecar_tenant_admitted_total{class="interactive",tenant="acme"}'] == 1
        assert await engine.slots_processing() == 0

        # The key is nowhere but in its file and the engine.
        _, dump = await http_get(f"http://127.0.0.1:{stack.admin_port}/config_dump", 5.0)
        assert stack.envoy is not None and stack.sidecar is not None and engine.proc
        for where, data in {
                "envoy argv": _cmdline(stack.envoy.pid),
                "sidecar argv": _cmdline(stack.sidecar.pid),
                "llama-server argv": _cmdline(engine.proc.pid),
                "envoy config": stack.envoy_config.read_bytes(),
                "config dump": dump,
                "envoy log": stack.envoy_log.read_bytes(),
                "sidecar log": stack.sidecar_log.read_bytes()}.items():
            assert KEY.encode() not in data, where

        # Control: the same Envoy config without the key injection, the same request: the
        # engine's 401 reaches the client, admitted all the same (what was broken before).
        await _restart_envoy_without_the_key(stack)
        r = await request(stack.listen_port, headers=acme, body=completion(), timeout=60)
        assert r.status == 401, r.body
        m = await settle(stack, timeout=30)
        assert m['smg_sidecar_tenant_admitted_total{class="interactive",tenant="acme"}'] == 2
    finally:
        await stack.stop()


async def _restart_envoy_without_the_key(stack: Stack) -> None:
    stack.config.engine_key_file = None
    stack.write_envoy_config()
    assert "credential_injector" not in stack.envoy_config.read_text().split(
        "static_resources:")[1]
    await stack.restart_envoy()
