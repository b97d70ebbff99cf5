"""Capacity in tokens where the engine reports it: ``tokens.refuse_past_context``.

llama.cpp divides its context among its slots (``/props``:
``default_generation_settings.n_ctx`` per slot). A prompt longer than every slot's
context fails at the engine after it took a slot (and its tenant's tokens); with the
option on, the Check refuses it first: 413 ``scheduler_token_context_exceeded``, no
Retry-After, nothing held. Off by default; nothing is refused where a worker does not
say its context (another engine, a value that is not a size), nor under ``--shadow``.

The probe's reading is checked on the body a real llama-server served
(tests/data/llama-server/props.body); the Check through loopback gRPC against a fake
llama.cpp worker whose ``n_ctx`` the test sets, every figure on the test's own count.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
from envoy.service.auth.v3 import external_auth_pb2

from devtools.fleet import FakeWorker
from sidecar.capacity import CapacityPolicy, ProbeStatus, WorkerProbe
from sidecar.config import DEFAULT_POOL
from sidecar.health import llamacpp_slot_context
from sidecar.priority_yaml import ConfigError, parse_priority_config
from tests import runtime_harness
from tests.grpc_client import admission_id
from tests.runtime_harness import Runtimes, past_context

DATA = Path(__file__).parent / "data" / "llama-server"


def test_the_slot_context_is_read_from_a_real_llama_servers_props() -> None:
    body = json.loads((DATA / "props.body").read_text())
    assert llamacpp_slot_context(body) == 512  # -c 2048 --parallel 4: 512 a slot


@pytest.mark.parametrize("n_ctx", [0, -1, "512", 1.5, True, None, 2**31, float("nan"), [512]])
def test_a_context_that_is_not_a_size_is_not_read(n_ctx: object) -> None:
    assert llamacpp_slot_context({"default_generation_settings": {"n_ctx": n_ctx}}) is None
    assert llamacpp_slot_context({"default_generation_settings": "x"}) is None
    assert llamacpp_slot_context([]) is None


def test_a_reading_has_a_slot_context_only_when_every_counted_worker_says_it() -> None:
    policy = CapacityPolicy(fallback=64, default_cap=8, saturation_guard=False,
                            clock=time.monotonic)

    def context(*contexts: int | None) -> int | None:
        return policy.decide([WorkerProbe(f"w{i}", ProbeStatus.HEALTHY, "llamacpp", cap=4,
                                          context=c) for i, c in enumerate(contexts)]
                             ).slot_context

    assert context(4096) == 4096
    assert context(4096, 8192) == 8192  # a prompt past 4096 may still fit the other
    assert context(4096, None) is None  # one worker cannot say: nothing refused
    # An unhealthy worker is not counted, so its context does not matter.
    assert policy.decide([WorkerProbe("a", ProbeStatus.HEALTHY, "llamacpp", cap=4,
                                      context=100),
                          WorkerProbe("b", ProbeStatus.UNHEALTHY)]).slot_context == 100
    # A round that cannot see the workers holds the last reading, context and all; the
    # fallback names no worker, so no context.
    assert policy.decide(None).slot_context == 100
    fresh = CapacityPolicy(fallback=64, default_cap=8, saturation_guard=False,
                           clock=time.monotonic)
    assert fresh.decide(None).slot_context is None


def test_the_option_is_a_boolean_and_off_by_default() -> None:
    cfg = parse_priority_config("tokens: {default_max_tokens: 10}\n")
    settings = cfg.tokens_for(DEFAULT_POOL)
    assert settings is not None and settings.refuse_past_context is False
    with pytest.raises(ConfigError, match=r"tokens\.refuse_past_context.*boolean"):
        parse_priority_config("tokens: {refuse_past_context: 'yes'}\n", "p.yaml")


class Harness(runtime_harness.Harness):
    async def ask(self, length: int) -> external_auth_pb2.CheckResponse:
        return await self.check({"x-smg-tenant": "acme", "content-length": str(length)})

    def inflight(self) -> int:
        return self.snapshot().inflight


Start = Callable[..., Awaitable[Harness]]


@pytest.fixture
async def start(tmp_path: Path) -> AsyncIterator[Start]:
    runtimes = Runtimes(tmp_path, Harness)

    async def go(tokens: str = "{refuse_past_context: true}", *extra: str,
                 n_ctx: object = 1000) -> Harness:
        worker = FakeWorker(engine="llamacpp", max_running_requests=2)
        worker.slot_context = n_ctx
        return await runtimes.start(worker, f"tokens: {tokens}\n", *extra, slots=2)

    yield go
    await runtimes.close()


async def test_a_prompt_past_every_slots_context_is_refused_without_taking_a_slot(
        start: Start) -> None:
    h = await start()
    assert h.app.pools[DEFAULT_POOL].reading.slot_context == 1000
    # 4 bytes a token: 4,004 bytes are 1,001 input tokens, one past the slot's context.
    refused = await h.ask(4004)
    message = past_context(refused)
    assert "1001" in message and "1000" in message
    assert h.sample("smg_sidecar_token_context_refused_total", action="refused",
                    **{"class": "default"}) == 1
    assert h.sample("smg_sidecar_tenant_rejected_total", tenant="acme",
                    outcome="past_context", **{"class": "default"}) == 1
    assert h.inflight() == 0
    # Exactly the context fits; both slots are still there for it.
    a, b = await h.ask(4000), await h.ask(10)
    assert a.status.code == 0 and b.status.code == 0, (a, b)
    assert h.inflight() == 2
    assert h.sample("smg_sidecar_token_context_refused_total", action="refused",
                    **{"class": "default"}) == 1
    assert admission_id(a) and admission_id(b)


@pytest.mark.parametrize("n_ctx", ["lots", 0, None])
async def test_a_worker_that_does_not_say_its_context_refuses_nothing(
        start: Start, n_ctx: object) -> None:
    h = await start(n_ctx=n_ctx)
    assert h.app.pools[DEFAULT_POOL].reading.slot_context is None
    assert (await h.ask(10**7)).status.code == 0


async def test_off_by_default_and_counted_only_under_shadow(
        start: Start) -> None:
    off = await start("{default_max_tokens: 10}")
    assert (await off.ask(10**6)).status.code == 0
    assert off.sample("smg_sidecar_token_context_refused_total", action="refused",
                      **{"class": "default"}) == 0
    shadow = await start("{refuse_past_context: true}", "--shadow")
    assert (await shadow.ask(10**6)).status.code == 0
    assert shadow.sample("smg_sidecar_token_context_refused_total", action="counted",
                         **{"class": "default"}) == 1
