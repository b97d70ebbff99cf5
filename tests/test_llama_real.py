"""Through a real Envoy and the sidecar, in front of a real llama.cpp ``llama-server``.

The engine is nobody's fake: llama.cpp built from the source PyPI's llama-cpp-python
sdist vendors (``make llama-server``), serving a tiny random-weight model written with
``gguf`` (devtools/llama.py). Ground truth is what the engine itself reports
(``/slots``), never the sidecar's own count. Run with ``make test-llama`` (CI does).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from devtools.httpclient import Exchange, request
from devtools.llama import LlamaFleet, llama_server_binary, write_tiny_model
from devtools.stack import Stack, StackConfig
from tests.conftest import assert_denied, settle, until

pytestmark = [pytest.mark.e2e, pytest.mark.llama]

if llama_server_binary() is None:
    if os.environ.get("CI"):
        raise RuntimeError("CI must run the real-engine tests: no llama-server binary "
                           "(make llama-server)")
    pytest.skip("no llama-server binary: `make llama-server` builds it",
                allow_module_level=True)

NO_RESERVATIONS = """
classes:
  system: {reserved_floor: 0, queue_size: 4, queue_timeout_secs: 30}
  interactive: {reserved_floor: 0, reserved_per_slot: 0.0, queue_size: 4, queue_timeout_secs: 30}
  default: {reserved_per_slot: 0.0, queue_size: 4, queue_timeout_secs: 30}
  bulk: {queue_size: 1, queue_timeout_secs: 30}
"""

LlamaStackFactory = Callable[..., Awaitable[Stack]]


def completion(tokens: int, *, stream: bool = False, **extra: Any) -> bytes:
    """A chat completion that generates exactly ``tokens`` tokens (EOS ignored)."""
    return json.dumps({"model": "tiny", "stream": stream, "max_tokens": tokens,
                       "ignore_eos": True, "temperature": 1.0,
                       "messages": [{"role": "user", "content": "hi"}], **extra}).encode()


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("model") / "tiny.gguf")


@pytest.fixture
async def llama_stack(tmp_path: Path, model: Path) -> AsyncIterator[LlamaStackFactory]:
    stacks: list[Stack] = []

    async def factory(*, servers: int = 1, parallel: int = 2, engine: str = "auto",
                      router: bool = False, server_kwargs: dict[str, Any] | None = None,
                      **kw: Any) -> Stack:
        kw.setdefault("priority_yaml", NO_RESERVATIONS)
        kw.setdefault("health_interval_secs", 0.2)
        kw["sidecar_args"] = ["--worker-engine", engine, *kw.get("sidecar_args", ())]
        engines = LlamaFleet(servers, workdir=tmp_path / "engines", model=model,
                             parallel=parallel, router=router, **(server_kwargs or {}))
        stack = Stack(StackConfig(workers=servers, **kw), workdir=tmp_path, engines=engines)
        stacks.append(stack)
        await stack.start()
        return stack

    yield factory
    try:
        for stack in stacks:
            if stack.sidecar is not None:
                await settle(stack, timeout=30)
                await engine_idle(stack)
    finally:
        for stack in stacks:
            await stack.stop()


async def engine_idle(stack: Stack, timeout: float = 30.0) -> None:
    """Every engine says no slot is processing (its own /slots), within ``timeout``."""
    assert isinstance(stack.fleet, LlamaFleet)
    deadline = time.monotonic() + timeout
    while True:
        busy = [await w.slots_processing() for w in stack.fleet.workers]
        if not any(busy):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"engines still processing: {busy}")
        await asyncio.sleep(0.1)


async def capacity(stack: Stack) -> float:
    return await stack.metric("smg_sidecar_capacity")


# ------------------------------------------------------------------ capacity


@pytest.mark.parametrize("engine", ["auto", "llamacpp"])
async def test_capacity_is_the_servers_slot_count(llama_stack: LlamaStackFactory,
                                                   engine: str) -> None:
    stack = await llama_stack(servers=2, parallel=3, engine=engine)
    m = await until(stack, lambda m: m.get("smg_sidecar_capacity") == 6, timeout=10)
    for url in stack.fleet.urls:
        assert m[f'smg_sidecar_worker_capacity{{engine="llamacpp",worker="{url}"}}'] == 3


async def test_a_prompt_past_a_slots_context_is_refused_before_it_takes_a_slot(
        llama_stack: LlamaStackFactory) -> None:
    # tokens.refuse_past_context: the probe reads the engine's own context per slot
    # (-c 2048, 2 slots: 1,024); the tiny model's vocabulary is a token a byte, so
    # bytes_per_token 1 estimates a prompt's tokens from above.
    stack = await llama_stack(parallel=2, server_kwargs={"context": 2048},
                              priority_yaml=NO_RESERVATIONS + (
                                  "tokens: {refuse_past_context: true, bytes_per_token: 1}\n"))
    await until(stack, lambda m: m.get("smg_sidecar_capacity") == 2, timeout=10)
    assert isinstance(stack.fleet, LlamaFleet)
    engine = stack.fleet.workers[0]
    long = json.dumps({"model": "tiny", "max_tokens": 5, "messages": [
        {"role": "user", "content": "x" * 1500}]}).encode()
    # Sent straight to the engine, it fails there, after a slot took it.
    direct = await request(engine.port, body=long, timeout=60)
    assert direct.status == 400, (direct.status, direct.body)
    refused = await request(stack.listen_port, body=long)
    assert refused.status == 413, (refused.status, refused.body)
    assert refused.headers["x-smg-error-code"] == "scheduler_token_context_exceeded"
    assert "retry-after" not in refused.headers
    body = refused.json()["error"]
    assert body["code"] == "scheduler_token_context_exceeded" and "1024" in body["message"]
    assert await stack.metric("smg_sidecar_token_context_refused_total", **{
        "class": "default", "action": "refused"}) == 1
    # A prompt that fits is served on the same slots.
    ok = await request(stack.listen_port, body=completion(5), timeout=60)
    assert ok.status == 200, ok.body
    await settle(stack, timeout=10)


async def test_an_engine_with_an_api_key_is_read_with_the_key_file_and_never_counted_64(
        llama_stack: LlamaStackFactory, tmp_path: Path) -> None:
    key = tmp_path / "engine.key"
    key.write_text("s3cret-engine-key\n")
    # Without the key the probes are refused: the worker counts for 1, never the default 64.
    blind = await llama_stack(parallel=4, server_kwargs={"api_key_file": key})
    url = blind.fleet.urls[0]
    m = await until(blind, lambda m: m.get("smg_sidecar_capacity") == 1 and any(
        k.startswith("smg_sidecar_worker_probe_refused{") and 'reason="unauthorized"' in k
        and v == 1 for k, v in m.items()), timeout=10)
    assert m["smg_sidecar_capacity"] == 1
    assert "s3cret" not in blind.sidecar_log.read_text()
    await blind.stop()
    # With --worker-auth-file the slots are read; the client's own key reaches the engine.
    stack = await llama_stack(parallel=4, server_kwargs={"api_key_file": key},
                              sidecar_args=["--worker-auth-file", str(key),
                                            "--worker-auth-allow-http"])  # loopback engines
    await until(stack, lambda m: m.get("smg_sidecar_capacity") == 4, timeout=10)
    r = await request(stack.listen_port, body=completion(3), headers={
        "authorization": "Bearer s3cret-engine-key"})
    assert r.status == 200, r.body
    assert "s3cret" not in stack.sidecar_log.read_text()
    assert url  # the first stack's worker was a distinct engine


async def test_router_mode_counts_the_loaded_models_slots(llama_stack: LlamaStackFactory) -> None:
    """llama-server --models-dir (no -m): /props has no total_slots; the sidecar counts the
    loaded models' slots (none loaded: 1, never 64) and follows a model being loaded."""
    stack = await llama_stack(parallel=3, router=True)
    await until(stack, lambda m: m.get("smg_sidecar_capacity") == 1, timeout=10)
    r = await request(stack.listen_port, body=completion(3), timeout=60)  # loads "tiny"
    assert r.status == 200, r.body
    await until(stack, lambda m: m.get("smg_sidecar_capacity") == 3, timeout=15)


async def test_a_request_taking_several_slots_is_held_back_by_the_engines_own_count(
        llama_stack: LlamaStackFactory) -> None:
    """One admitted request with n=3 runs 3 sequences: the engine's own count (running +
    waiting) beyond what the sidecar holds is held back, so what follows waits in the
    sidecar's queue rather than inside the engine."""
    stack = await llama_stack(parallel=4, sidecar_args=["--saturation-guard"])
    await until(stack, lambda m: m.get("smg_sidecar_capacity") == 4, timeout=10)
    assert isinstance(stack.fleet, LlamaFleet)
    engine = stack.fleet.workers[0]
    body = json.dumps({"prompt": "hi", "max_tokens": 700, "ignore_eos": True, "n": 3}).encode()
    wide = await Exchange.send(stack.listen_port, "/v1/completions", body=body,
                               headers={"x-smg-priority": "bulk"})
    await until(stack, lambda m: m.get("smg_sidecar_engine_excess") == 2, timeout=10)
    bulk = {"x-smg-priority": "bulk"}
    more = [await Exchange.send(stack.listen_port, headers=bulk, body=completion(300))
            for _ in range(2)]
    # Capacity 4 - excess 2 = 2, one held: one more admitted, the other queued.
    await until(stack, lambda m: m.get('smg_scheduler_inflight{class="bulk"}') == 2
                and m.get('smg_scheduler_queue_depth{class="bulk"}') == 1)
    running = int(await engine.metric("llamacpp:requests_processing")
                  + await engine.metric("llamacpp:requests_deferred"))
    assert running <= 4, f"the engine runs or queues {running} with 4 slots"
    for ex in [wide, *more]:
        await asyncio.wait_for(ex.read_head(), 120)
        assert ex.status == 200
        await ex.close()


# ---------------------------------------------- admission, queueing, 429, release


async def test_admits_queues_sheds_and_releases_against_the_real_engine(
        llama_stack: LlamaStackFactory) -> None:
    stack = await llama_stack(parallel=2)
    await until(stack, lambda m: m.get("smg_sidecar_capacity") == 2, timeout=10)
    assert isinstance(stack.fleet, LlamaFleet)
    engine = stack.fleet.workers[0]
    bulk = {"x-smg-priority": "bulk"}
    running = [await Exchange.send(stack.listen_port, headers=bulk, body=completion(1500))
               for _ in range(2)]
    await until(stack, lambda m: m.get('smg_scheduler_inflight{class="bulk"}') == 2)
    queued = await Exchange.send(stack.listen_port, headers=bulk, body=completion(5))
    await until(stack, lambda m: m.get('smg_scheduler_queue_depth{class="bulk"}') == 1)
    shed = await request(stack.listen_port, headers=bulk, body=completion(5))
    assert_denied(shed, 429, "scheduler_queue_full", shed.headers.get("retry-after"))
    # The engine runs exactly what the sidecar admitted, no more.
    assert await engine.slots_processing() == 2
    assert await stack.metric("smg_scheduler_admit_total", **{
        "class": "bulk", "outcome": "rejected_queue_full"}) == 1
    for ex in [*running, queued]:
        await asyncio.wait_for(ex.read_head(), 60)
        assert ex.status == 200, await ex.read_body()
        body = json.loads(await ex.read_body())
        assert body["usage"]["completion_tokens"] in (1500, 5)
        await ex.close()
    await settle(stack, timeout=10)
    await engine_idle(stack)


# ---------------------------------------------------- streaming and closed upstreams


async def test_streamed_responses_are_never_a_bare_503(llama_stack: LlamaStackFactory) -> None:
    """llama-server closes the connection after each stream; Envoy must not hand a later
    admitted request a connection the engine already closed."""
    stack = await llama_stack(parallel=2)
    await until(stack, lambda m: m.get("smg_sidecar_capacity") == 2, timeout=10)
    statuses: list[int] = []

    async def client(n: int) -> None:
        for _ in range(n):
            r = await request(stack.listen_port, body=completion(3, stream=True), timeout=60)
            statuses.append(r.status)
            assert r.status == 200, (r.status, r.body[:300])

    await asyncio.gather(*(client(40) for _ in range(2)))
    assert statuses == [200] * 80


# ------------------------------------------------------------------ preemption


async def test_no_class_preempts_on_llamacpp_and_the_engine_never_runs_past_its_slots(
        llama_stack: LlamaStackFactory) -> None:
    """llama-server runs a preempted request to its end while anything else produces a
    result (another stream, a /metrics scrape): preempting would free no slot. So no class
    preempts there; the system request waits at the head of its queue for a real slot."""
    stack = await llama_stack(parallel=2, sidecar_args=[
        "--priority-scheduler-default-max-class", "system"])
    await until(stack, lambda m: m.get("smg_sidecar_capacity") == 2
                and m.get("smg_sidecar_preemption_suspended") == 1, timeout=10)
    assert isinstance(stack.fleet, LlamaFleet)
    engine = stack.fleet.workers[0]
    bulk = [await Exchange.send(stack.listen_port, headers={"x-smg-priority": "bulk"},
                                body=completion(800)) for _ in range(2)]
    await until(stack, lambda m: m.get('smg_scheduler_inflight{class="bulk"}') == 2)
    peak = 0
    done = asyncio.Event()

    async def watch() -> None:  # the engine's own count: running + waiting in its queue
        nonlocal peak
        while not done.is_set():
            peak = max(peak, int(await engine.metric("llamacpp:requests_processing")
                                 + await engine.metric("llamacpp:requests_deferred")))
            await asyncio.sleep(0.05)

    watcher = asyncio.create_task(watch())
    try:
        r = await request(stack.listen_port, headers={"x-smg-priority": "system"},
                          body=completion(5), timeout=120)
        assert r.status == 200, r.body
        for ex in bulk:
            await asyncio.wait_for(ex.read_head(), 120)
            assert ex.status == 200  # nobody's work was thrown away
            await ex.close()
    finally:
        done.set()
        await watcher
    assert peak == 2, f"the engine ran or queued {peak} with 2 slots"
    m = await stack.metrics()
    assert m.get('smg_scheduler_admit_total{class="bulk",outcome="preempted"}', 0) == 0
    assert m['smg_scheduler_admit_total{class="system",outcome="admitted"}'] == 1
