"""``tokens.admit_by_kv`` at the Check: a whole sidecar over loopback gRPC, one fake vLLM
worker whose KV capacity (``vllm:cache_config_info``) the test sets.

A request waits in its queue until its tokens fit and is admitted when a release frees
them; one whose estimate alone exceeds the whole KV capacity is refused at once (413
``scheduler_token_context_exceeded``, no Retry-After, nothing held), every refusal checked
on status, code, body and metrics. Where no worker reports a KV capacity nothing is gated,
and the start-up log and ``smg_sidecar_kv_admission{state="ungated"}`` say so. The option
is a boolean, off by default, and a fleet (``--coordination-url``) refuses it by name.
Estimates here are on the test's own count: ``content-length`` ÷ 4 (rounded up) plus
``default_max_tokens`` (the Check carries no ``max_tokens``).
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
import structlog
from envoy.service.auth.v3 import external_auth_pb2

from devtools.fleet import FakeWorker
from sidecar.config import DEFAULT_POOL, parse_settings
from sidecar.priority_yaml import ConfigError, check_kv_admission, parse_priority_config
from tests import runtime_harness
from tests.grpc_client import admission_id, check_request
from tests.runtime_harness import Runtimes, past_context

KV = 1024  # 64 blocks of 16
OUT = 24  # default_max_tokens: the output part of every estimate here


def length_for(tokens: int) -> int:
    """A content-length whose estimate is ``tokens`` (input ⌈len/4⌉ + OUT)."""
    return 4 * (tokens - OUT)


class Harness(runtime_harness.Harness):
    async def ask(self, tokens: int, cls: str = "default"
                  ) -> external_auth_pb2.CheckResponse:
        return await self.check({"x-smg-tenant": "acme", "x-smg-priority": cls,
                                 "content-length": str(length_for(tokens))})

    def held(self) -> int:
        return self.snapshot().kv_held

    def queued(self) -> int:
        return sum(c.queue_depth for c in self.snapshot().classes.values())


Start = Callable[..., Awaitable[Harness]]


@pytest.fixture
async def start(tmp_path: Path) -> AsyncIterator[Start]:
    runtimes = Runtimes(tmp_path, Harness)

    async def go(tokens: str = "{admit_by_kv: true}", *extra: str, engine: str = "vllm",
                 kv: object = KV, context: object = 4096) -> Harness:
        worker = FakeWorker(engine=engine, max_running_requests=8)
        worker.dev_mode = True
        worker.kv_tokens = kv
        worker.slot_context = context
        return await runtimes.start(
            worker, f"tokens: {tokens}\nclasses:\n  interactive: {{reserved_floor: 0, "
            "reserved_per_slot: 0}\n  system: {reserved_floor: 0}\n"
            "  default: {reserved_per_slot: 0}\n", *extra, slots=8)

    yield go
    await runtimes.close()


def tokens_yaml(**kw: object) -> str:
    return "{" + ", ".join(f"{k}: {json.dumps(v)}" for k, v in
                           {"default_max_tokens": OUT, **kw}.items()) + "}"


async def test_a_request_waits_for_tokens_and_is_admitted_when_they_free(
        start: Start) -> None:
    h = await start(tokens_yaml(admit_by_kv=True))
    pool = h.app.pools[DEFAULT_POOL]
    await h.until(lambda: pool.kv_capacity == KV, "the worker's KV capacity to be read")
    assert h.sample("smg_sidecar_kv_admission", state="gated") == 1
    assert h.sample("smg_sidecar_kv_capacity_tokens") == KV
    first = await h.ask(600)
    assert first.status.code == 0 and h.held() == 600
    # 600 + 500 > 1024: a slot is free, the tokens are not; it waits in its queue.
    second = asyncio.ensure_future(h.ask(500))
    await h.until(lambda: h.queued() == 1, "the second request to queue")
    assert not second.done()
    assert h.sample("smg_sidecar_kv_tokens_held") == 600
    await h.envoy.log((admission_id(first), "end"))
    resp = await asyncio.wait_for(second, 10)
    assert resp.status.code == 0 and h.held() == 500
    await h.envoy.log((admission_id(resp), "end"))
    await h.until(lambda: h.held() == 0, "every token to be given back")


async def test_a_request_past_the_whole_kv_capacity_is_refused_at_once(
        start: Start) -> None:
    h = await start(tokens_yaml(admit_by_kv=True))
    await h.until(lambda: h.app.pools[DEFAULT_POOL].kv_capacity == KV, "the KV capacity")
    refused = await h.ask(KV + 1)
    message = past_context(refused)
    assert f"{KV + 1} tokens" in message and f"{KV}-token KV" in message
    assert h.sample("smg_sidecar_kv_refused_total", action="refused",
                    **{"class": "default"}) == 1
    assert h.sample("smg_sidecar_tenant_rejected_total", tenant="acme",
                    outcome="past_context", **{"class": "default"}) == 1
    assert h.held() == 0 and h.queued() == 0
    # Exactly the capacity fits.
    whole = await h.ask(KV)
    assert whole.status.code == 0 and h.held() == KV
    await h.envoy.log((admission_id(whole), "end"))


@pytest.mark.parametrize("engine,kv", [("generic", None), ("vllm", "None"), ("vllm", -3)])
async def test_no_reported_kv_capacity_gates_nothing_and_says_so(
        start: Start, engine: str, kv: object) -> None:
    with structlog.testing.capture_logs() as logged:
        h = await start(tokens_yaml(admit_by_kv=True), engine=engine, kv=kv)
    assert h.app.pools[DEFAULT_POOL].kv_capacity is None
    assert h.sample("smg_sidecar_kv_admission", state="ungated") == 1
    assert h.sample("smg_sidecar_kv_unreported_workers") == 1
    [line] = [e for e in logged if e["event"] == "kv_admission_ungated"]
    assert "no counted worker reports" in line["reason"]
    r = await h.ask(10**6)
    assert r.status.code == 0
    await h.envoy.log((admission_id(r), "end"))


async def test_off_by_default_and_counted_only_under_shadow(start: Start) -> None:
    off = await start(tokens_yaml())
    assert off.sample("smg_sidecar_kv_admission", state="off") == 1
    assert off.app.pools[DEFAULT_POOL].kv_capacity is None
    a, b = await off.ask(900), await off.ask(900)
    assert a.status.code == 0 and b.status.code == 0
    shadow = await start(tokens_yaml(admit_by_kv=True), "--shadow")
    await shadow.until(lambda: shadow.app.pools[DEFAULT_POOL].kv_capacity == KV,
                       "the KV capacity")
    over = await shadow.ask(KV * 10)
    assert over.status.code == 0
    assert shadow.sample("smg_sidecar_kv_refused_total", action="counted",
                         **{"class": "default"}) == 1
    # Under --shadow everything is admitted; the would-be gate holds only the shadow.
    c, d = await shadow.ask(900), await shadow.ask(900)
    assert c.status.code == 0 and d.status.code == 0


async def test_a_reload_turns_the_gate_on_and_off(start: Start, tmp_path: Path) -> None:
    h = await start(tokens_yaml())
    cfg = tmp_path / "priority0.yaml"  # the fixture's file for its first sidecar
    text = cfg.read_text()
    cfg.write_text(text.replace(tokens_yaml(), tokens_yaml(admit_by_kv=True)))
    assert await h.app.reload_now() is True
    pool = h.app.pools[DEFAULT_POOL]
    await h.until(lambda: pool.kv_capacity == KV, "the gate to follow the reload")
    assert h.sample("smg_sidecar_kv_admission", state="gated") == 1
    cfg.write_text(text)
    assert await h.app.reload_now() is True
    assert pool.kv_capacity is None and h.sample("smg_sidecar_kv_admission", state="off") == 1


async def test_tgis_input_limit_refuses_a_longer_prompt_with_refuse_past_context(
        start: Start) -> None:
    """TGI's /info max_input_tokens is the context a prompt must fit (TGI answers a longer
    one 422): with refuse_past_context the Check refuses it first, as for llama.cpp."""
    h = await start(tokens_yaml(refuse_past_context=True), engine="tgi", kv=None,
                    context=1000)
    assert h.app.pools[DEFAULT_POOL].reading.slot_context == 1000
    # 4,004 bytes are 1,001 input tokens: one past TGI's limit.
    resp = await h.check({"x-smg-tenant": "acme", "content-length": "4004"})
    assert "1001" in past_context(resp)
    assert h.sample("smg_sidecar_token_context_refused_total", action="refused",
                    **{"class": "default"}) == 1
    ok = await h.envoy._check(check_request({"x-smg-tenant": "acme",
                                             "content-length": "4000"}))
    assert ok.status.code == 0
    await h.envoy.log((admission_id(ok), "end"))


# ------------------------------------------------------------------ configuration


def test_the_option_is_a_boolean_and_off_by_default() -> None:
    settings = parse_priority_config("tokens: {default_max_tokens: 10}\n").tokens_for(
        DEFAULT_POOL)
    assert settings is not None and settings.admit_by_kv is False
    with pytest.raises(ConfigError, match=r"tokens\.admit_by_kv.*boolean"):
        parse_priority_config("tokens: {admit_by_kv: 'yes'}\n", "p.yaml")
    with pytest.raises(ConfigError, match=r"pools\.big\.tokens\.admit_by_kv.*boolean"):
        parse_priority_config("pools:\n  big: {tokens: {admit_by_kv: 1}}\n", "p.yaml")


@pytest.mark.parametrize("text,key", [
    ("tokens: {admit_by_kv: true}\n", "tokens.admit_by_kv"),
    ("pools:\n  big: {tokens: {admit_by_kv: true}}\n", "pools.big.tokens.admit_by_kv"),
])
def test_a_fleet_refuses_it_by_name_never_gating_per_replica(
        tmp_path: Path, text: str, key: str) -> None:
    cfg = parse_priority_config(text, "p.yaml")
    check_kv_admission(cfg, fleet=False)  # in process: fine
    with pytest.raises(ConfigError) as err:
        check_kv_admission(cfg, fleet=True)
    assert key in str(err.value) and "--coordination-url" in str(err.value)
    path = tmp_path / "p.yaml"
    path.write_text(text)
    pools = ["--worker-urls", "big=http://127.0.0.1:9"] if "pools" in text else []
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        parse_settings(["--priority-scheduler-enabled", "--priority-scheduler-config",
                        str(path), "--coordination-url", "redis://127.0.0.1:9", *pools])


def test_the_estimate_arithmetic_of_this_file() -> None:
    assert math.ceil(length_for(600) / 4) + OUT == 600
