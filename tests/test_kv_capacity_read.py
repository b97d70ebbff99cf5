"""Each engine's KV capacity in tokens, read where it reports it, and TGI's context.

The readers are checked on the shapes the real engines serve (the fake workers' fixtures
cite each source), then through a real probe of a fake worker of each engine over loopback
HTTP; every value that is not a size (negative, zero, NaN, a string, a boolean, absurdly
large, vLLM's ``None`` before it profiled its memory) counts no tokens and is logged once,
never admitted on.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from typing import Any

import pytest
import structlog

from devtools.fleet import (
    FakeWorker,
    llamacpp_props,
    prometheus_gauges,
    sglang_server_info,
    tgi_info,
    vllm_cache_config_labels,
)
from sidecar.capacity import WorkerProbe
from sidecar.health import (
    MAX_KV_TOKENS,
    WorkerProber,
    llamacpp_kv_tokens,
    new_session,
    sglang_kv_tokens,
    tgi_context,
    tgi_kv_tokens,
    vllm_kv_tokens,
)

NOT_SIZES: list[object] = [0, -1, 1.5, True, "many", [4096], {"n": 1}, float("nan"),
                           float("inf"), MAX_KV_TOKENS + 1, 10**30]


def vllm_metrics(*engines: tuple[object, object]) -> str:
    return prometheus_gauges(
        [("vllm:num_requests_running", 'engine="0"', 0.0)]
        + [("vllm:cache_config_info", vllm_cache_config_labels(i, blocks, size), 1.0)
           for i, (blocks, size) in enumerate(engines)])


def test_vllm_counts_blocks_times_block_size_of_every_engine_core() -> None:
    assert vllm_kv_tokens(vllm_metrics((573, 16))) == (9168, "")
    # Data parallel: one sample per engine core, each its own cache.
    assert vllm_kv_tokens(vllm_metrics((1000, 16), (1000, 16))) == (32000, "")
    # A metric whose name only starts the same is not it.
    assert vllm_kv_tokens('vllm:cache_config_info_x{num_gpu_blocks="9"} 1\n') == (None, "")
    assert vllm_kv_tokens("vllm:num_requests_running 0\n") == (None, "")


@pytest.mark.parametrize("blocks", ["None", "", "-5", "1e3", "0", "nan", "99999999999999999"])
def test_vllm_blocks_that_are_not_a_size_count_nothing(blocks: str) -> None:
    tokens, why = vllm_kv_tokens(vllm_metrics((blocks, 16)))
    assert tokens is None and "not" in why
    # One bad engine core: the worker's figure is not a sum of the good ones.
    assert vllm_kv_tokens(vllm_metrics((1000, 16), (blocks, 16)))[0] is None
    assert vllm_kv_tokens(vllm_metrics((1000, blocks)))[0] is None


def test_sglang_counts_one_ranks_token_pool_times_its_ranks() -> None:
    assert sglang_kv_tokens(sglang_server_info(8, 1, None, 20480)) == (20480, "")
    assert sglang_kv_tokens(sglang_server_info(8, 2, None, 20480)) == (40960, "")
    assert sglang_kv_tokens({"model_path": "m"}) == (None, "")
    assert sglang_kv_tokens(sglang_server_info(8, 1, None, None)) == (None, "")


@pytest.mark.parametrize("value", NOT_SIZES)
def test_sglang_values_that_are_not_a_size_count_nothing(value: object) -> None:
    tokens, why = sglang_kv_tokens(sglang_server_info(8, 1, None, value))
    assert tokens is None and why
    tokens, why = sglang_kv_tokens({**sglang_server_info(8, 1, None, 1000), "dp_size": value})
    assert tokens is None and why


def test_tgi_reports_its_batch_tokens_only_before_3x_and_its_input_limit_always() -> None:
    assert tgi_kv_tokens(tgi_info(128)) == (None, "")  # 3.x: no max_batch_total_tokens
    assert tgi_kv_tokens(tgi_info(128, batch_tokens=32000)) == (32000, "")
    assert tgi_context(tgi_info(128, max_input=4095)) == 4095
    assert tgi_context({"max_input_length": 1024, "max_total_tokens": 2048}) == 1024  # < 2.1
    assert tgi_context({"max_total_tokens": 2048}) is None


@pytest.mark.parametrize("value", NOT_SIZES)
def test_tgi_values_that_are_not_a_size_count_nothing(value: object) -> None:
    tokens, why = tgi_kv_tokens(tgi_info(128, batch_tokens=value))
    assert tokens is None and why
    assert tgi_context(tgi_info(128, max_input=value)) is None


def test_llamacpp_counts_each_slots_context_times_its_slots() -> None:
    assert llamacpp_kv_tokens(llamacpp_props(4, 512), 512) == (2048, "")
    assert llamacpp_kv_tokens(llamacpp_props(4, "lots"), None)[0] is None
    assert llamacpp_kv_tokens(llamacpp_props(4, "lots"), None)[1]
    assert llamacpp_kv_tokens(llamacpp_props(None, 512), 512) == (None, "")
    assert llamacpp_kv_tokens(llamacpp_props(-4, 512), 512)[0] is None


# ------------------------------------------------------------- a probe, over HTTP

Probe = Callable[..., Awaitable[tuple[WorkerProbe, list[MutableMapping[str, Any]]]]]


@pytest.fixture
async def probe() -> AsyncIterator[Probe]:
    workers: list[FakeWorker] = []
    session = new_session()

    async def go(engine: str, *, rounds: int = 1, **knobs: object
                 ) -> tuple[WorkerProbe, list[MutableMapping[str, Any]]]:
        w = FakeWorker(engine=engine, max_running_requests=4)
        w.dev_mode = True
        for k, v in knobs.items():
            setattr(w, k, v)
        await w.start()
        workers.append(w)
        prober = WorkerProber(lambda: session, engine="auto", timeout=2.0,
                              saturation_guard=False)
        with structlog.testing.capture_logs() as logged:
            for _ in range(rounds):
                p = await prober.probe(w.url)
        return p, logged

    yield go
    await session.close()
    for w in workers:
        await w.stop()


async def test_each_engine_is_read_through_its_own_endpoint(probe: Probe) -> None:
    p, _ = await probe("vllm", kv_tokens=4000, kv_block_size=16)
    assert (p.engine, p.cap, p.kv_tokens, p.context) == ("vllm", 4, 4000, None)
    p, _ = await probe("vllm", kv_tokens=4000, dp_ranks=2)
    assert p.kv_tokens == 8000
    p, _ = await probe("sglang", kv_tokens=10000, dp_ranks=2)
    assert (p.engine, p.kv_tokens) == ("sglang", 20000)
    p, _ = await probe("tgi", slot_context=2048, kv_tokens=16000)
    assert (p.engine, p.cap, p.kv_tokens, p.context) == ("tgi", 4, 16000, 2048)
    p, _ = await probe("tgi")  # 3.x: no batch tokens, its input limit all the same
    assert (p.kv_tokens, p.context) == (None, 4096)
    p, _ = await probe("llamacpp", slot_context=512)
    assert (p.engine, p.kv_tokens, p.context) == ("llamacpp", 2048, 512)
    p, _ = await probe("generic")
    assert (p.kv_tokens, p.context) == (None, None)


@pytest.mark.parametrize("engine,value", [("vllm", "None"), ("vllm", -16),
                                          ("sglang", "lots"), ("sglang", 10**30),
                                          ("sglang", math.nan), ("tgi", -1), ("tgi", True)])
async def test_an_engines_absurd_kv_value_counts_nothing_and_is_logged_once(
        probe: Probe, engine: str, value: object) -> None:
    p, logged = await probe(engine, kv_tokens=value, rounds=2)
    assert p.status.value == "healthy" and p.cap == 4  # the slots are still read
    assert p.kv_tokens is None
    lines = [e for e in logged if e["event"] == "worker_kv_capacity_unreadable"]
    assert len(lines) == 1, logged
    assert lines[0]["engine"] == engine and "not" in lines[0]["reason"]
