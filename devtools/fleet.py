"""A fleet of fake LLM workers for the sidecar's tests and demo (aiohttp servers).

Each ``FakeWorker`` is a real HTTP server. Handler cancellation is on, so a
client that hangs up *while* a request is still being "computed" (what Envoy
does when the sidecar or the end user gives up on a request) cancels the
handler, and the worker records it as cancelled. The worker records what it
really saw (headers, outcome, timing) so tests can assert on admission
behaviour from the upstream's point of view.

Each completion counts its tokens as an engine would and reports them in the response's
``usage`` block (a streamed one in a final chunk when the request sets
``stream_options.include_usage``): prompt tokens from the prompt's text
(:func:`prompt_tokens`), completion tokens as many as it generates (``tokens``, at most
the request's ``max_completion_tokens`` / ``max_tokens``). ``x-fake-usage: JSON`` replaces
the block with what a test wants an engine to claim (a lying one); ``x-fake-usage: none``
leaves it out. The record keeps what the worker really served: the ground truth of the
token-budget tests.

Tests hold a request at the worker with a *gate* rather than a long service
time: ``x-fake-gate: NAME`` holds the response until the gate is opened,
``x-fake-stream-gate: NAME`` holds a stream after its first token.
``Fleet.gates.open(NAME)`` (or ``POST /admin/gates`` with ``{"open": NAME}``)
releases every request waiting on it, now and later.

A worker can impersonate an inference engine (``engine=``): it then serves that
engine's liveness, capacity and metrics endpoints with the same paths, field
names, nesting and metric names as the real server (the fixtures below cite
where each shape comes from), so the sidecar's engine rules are tested against
what it will meet. ``batch_limit`` makes the worker behave like an engine with a
full batch: at most that many completions run, the rest wait in the worker's
own FIFO queue and are reported as waiting.

Run ``python -m devtools.fleet --help`` for the CLI.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import signal
import sys
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from typing import Any, Literal

from aiohttp import web

log = logging.getLogger(__name__)

Outcome = Literal["running", "finished", "cancelled"]
JSONObject = dict[str, Any]

SERVER_HEADER = "fake-llm-worker"
SERVICE_TIME_HEADER = "x-fake-service-time"
GATE_HEADER = "x-fake-gate"
STREAM_GATE_HEADER = "x-fake-stream-gate"
USAGE_HEADER = "x-fake-usage"  # a JSON usage block to report instead, or "none"
COMPLETION_TOKENS_HEADER = "x-fake-completion-tokens"  # generate this many (≤ max_tokens)
BYTES_PER_TOKEN = 3  # the fake tokenizer: a token per 3 bytes of prompt text (denser
# than the sidecar's default estimate of 4: its estimates of a prompt run short)
_FIELD_LIMIT = 1 << 20  # generous: Envoy and the sidecar may add long headers

# engine names (as --worker-engine spells them); "generic" = this project's own shape.
ENGINES = ("generic", "sglang", "vllm", "tgi", "llamacpp")
MODEL = "meta-llama/Llama-3.1-8B-Instruct"


def sglang_server_info(per_rank: int | None, ranks: int, cli_cap: int | None,
                       kv_tokens: object = 20480) -> JSONObject:
    """SGLang ``GET /server_info``: ``{**asdict(server_args), **scheduler_info,
    "internal_states": [...], "version"}`` (sgl-project/sglang
    python/sglang/srt/entrypoints/http_server.py ``get_server_info``). The top-level
    ``max_running_requests`` is the CLI argument (null by default); the effective cap is
    ``internal_states[i].effective_max_running_requests_per_dp``, one entry per DP rank
    (docs.sglang.io basic_usage/native_api, managers/scheduler.py ``get_internal_state``).
    ``max_total_num_tokens`` is one DP rank's token pool (scheduler_info from rank 0:
    managers/data_parallel_controller.py).
    """
    states: list[JSONObject] = [
        {"memory_usage": {"weight": 15.0, "kvcache": 2.5, "token_capacity": 20480},
         "effective_max_running_requests_per_dp": per_rank,
         "last_gen_throughput": 0.0}
        for _ in range(ranks)]
    return {"model_path": MODEL, "tp_size": 1, "dp_size": ranks,
            "max_running_requests": cli_cap, "max_total_num_tokens": kv_tokens,
            "internal_states": states, "version": "0.5.2"}


def sglang_loads(per_rank: int | None, ranks: int, running: int, waiting: int) -> JSONObject:
    """SGLang ``GET /v1/loads``: per-DP ``loads[]`` (sgl-project/sglang
    python/sglang/srt/entrypoints/v1_loads.py; field names as in lightseekorg/smg
    crates/protocols/src/worker.rs ``SchedulerLoadSnapshot``). Load goes to rank 0."""
    return {"loads": [
        {"dp_rank": i, "num_running_reqs": running if i == 0 else 0,
         "num_waiting_reqs": waiting if i == 0 else 0,
         "num_total_reqs": (running + waiting) if i == 0 else 0,
         "num_used_tokens": 0, "max_total_num_tokens": 20480, "token_usage": 0.0,
         "max_running_requests": per_rank}
        for i in range(ranks)]}


def vllm_server_info(max_num_seqs: int | None, dp: int) -> JSONObject:
    """vLLM ``GET /server_info?config_format=json``, served only with VLLM_SERVER_DEV_MODE=1:
    ``{"vllm_config": PydanticVllmConfig.dump_python(...), "vllm_env", "system_env"}``
    (vllm-project/vllm vllm/entrypoints/serve/dev/server_info/api_router.py); the cap is
    SchedulerConfig.max_num_seqs, per data-parallel rank."""
    return {"vllm_config": {
        "model_config": {"model": MODEL, "max_model_len": 8192},
        "scheduler_config": {"max_num_seqs": max_num_seqs, "max_num_batched_tokens": 8192},
        "parallel_config": {"data_parallel_size": dp, "tensor_parallel_size": 1}},
        "vllm_env": {}, "system_env": {}}


def tgi_info(max_concurrent: int | None, max_input: object = 4095,
             batch_tokens: object = None) -> JSONObject:
    """TGI ``GET /info`` (huggingface/text-generation-inference router/src/lib.rs ``Info``;
    ``max_concurrent_requests`` is the router's concurrency limit, schema example 128;
    ``max_input_tokens`` the longest prompt it accepts). ``batch_tokens``: TGI 2.x's
    ``max_batch_total_tokens`` (schema example 32000), absent from 3.x's (None)."""
    info: JSONObject = {
        "model_id": MODEL, "model_sha": None, "model_pipeline_tag": "text-generation",
        "max_concurrent_requests": max_concurrent, "max_best_of": 2,
        "max_stop_sequences": 4, "max_input_tokens": max_input,
        "max_total_tokens": max_input + 1 if isinstance(max_input, int) else 4096,
        "validation_workers": 2, "max_client_batch_size": 4,
        "router": "text-generation-router", "version": "3.1.0"}
    if batch_tokens is not None:
        info["max_batch_total_tokens"] = batch_tokens
    return info


def llamacpp_props(total_slots: int | None, n_ctx: object = 4096) -> JSONObject:
    """llama.cpp ``GET /props``: ``total_slots`` = ``--parallel``, ``n_ctx`` the context
    of one slot (ggml-org/llama.cpp tools/server/README.md)."""
    return {"default_generation_settings": {"n_ctx": n_ctx, "temperature": 0.8},
            "total_slots": total_slots, "model_path": "/models/llama-3.1-8b.gguf",
            "chat_template": "", "is_sleeping": False}


# llama.cpp's reply on every path while the model loads (tools/server/README.md, /health).
LLAMACPP_LOADING = {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}


def vllm_cache_config_labels(engine: int, blocks: object, block_size: object) -> str:
    """The labels of vLLM's ``vllm:cache_config_info`` info gauge (value 1), one sample per
    engine core: the CacheConfig's fields as strings, ``num_gpu_blocks`` ``None`` until the
    engine profiled its memory (vllm-project/vllm vllm/v1/metrics/loggers.py
    ``log_metrics_info``, vllm/config/cache.py ``metrics_info``)."""
    return (f'block_size="{block_size}",cache_dtype="auto",calculate_kv_scales="False",'
            f'cpu_offload_gb="0",enable_prefix_caching="True",'
            f'gpu_memory_utilization="0.9",is_attention_free="False",num_cpu_blocks="None",'
            f'num_gpu_blocks="{blocks}",num_gpu_blocks_override="None",'
            f'sliding_window="None",swap_space_bytes="4294967296",engine="{engine}"')


def prometheus_gauges(gauges: list[tuple[str, str, float]]) -> str:
    """Prometheus text for ``(name, labels, value)`` gauges, HELP/TYPE once per name."""
    out: list[str] = []
    seen: set[str] = set()
    for name, labels, value in gauges:
        if name not in seen:
            seen.add(name)
            out += [f"# HELP {name} {name}", f"# TYPE {name} gauge"]
        out.append(f"{name}{{{labels}}} {value!r}" if labels else f"{name} {value!r}")
    return "\n".join(out) + "\n"


@dataclass
class RequestRecord:
    """What one completion request looked like when it reached the worker."""

    request_id: str | None
    admission_id: str | None
    priority_class: str | None
    headers: dict[str, str]
    stream: bool
    started_at: float
    ended_at: float | None = None
    outcome: Outcome = "running"
    service_started_at: float | None = None  # left the worker's own queue (batch_limit)
    prompt_tokens: int = 0  # the fake tokenizer's count of the prompt
    completion_tokens: int = 0  # tokens generated (sent, if it finished)
    body_bytes: int = 0  # the request body's length
    max_tokens: int | None = None  # its max_completion_tokens / max_tokens (None: none)

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    @property
    def duration(self) -> float | None:
        """Seconds between arrival and completion/cancellation (None while running)."""
        return None if self.ended_at is None else self.ended_at - self.started_at

    def to_json(self) -> JSONObject:
        """The record as served by /admin/stats (headers left out to keep it short)."""
        data = asdict(self)
        del data["headers"]
        data["duration"] = self.duration
        return data


class Tally:
    """Completions running at once across several workers, and the highest count seen:
    the fleet-wide ground truth a test compares with the fleet's capacity (per-worker
    peaks can each be below their worker's cap while their sum is above the fleet's).

    The peaks count only completions whose connection is still open (``gone``, given to
    ``enter``, says when it closed). Envoy ends an aborted request by closing its upstream
    connection as it writes the access-log entry that releases the slot; a worker that
    has not yet run the cancellation still holds the request though nobody waits for it
    (an engine aborts it on the next step, as vLLM does on disconnect). ``running`` counts
    every completion whose handler has not ended.

    ``weigh`` (a test's own measure of a request, e.g. its documented token estimate):
    ``tokens`` is the sum over the completions running, ``peak_tokens`` its highest."""

    def __init__(self, weigh: Callable[[RequestRecord], int] = lambda r: 0) -> None:
        self.running = 0
        self.peak = 0
        self.weigh = weigh
        self.tokens = 0
        self.peak_tokens = 0
        self._held: dict[int, tuple[RequestRecord, Callable[[], bool]]] = {}

    def enter(self, record: RequestRecord, gone: Callable[[], bool] = lambda: False) -> None:
        self.running += 1
        self.tokens += self.weigh(record)
        self._held[id(record)] = (record, gone)
        here = self._connected()
        self.peak = max(self.peak, len(here))
        self.peak_tokens = max(self.peak_tokens, sum(self.weigh(r) for r in here))

    def leave(self, record: RequestRecord) -> None:
        del self._held[id(record)]
        self.running -= 1
        self.tokens -= self.weigh(record)

    def _connected(self) -> list[RequestRecord]:
        return [r for r, gone in self._held.values() if not gone()]

    def reset(self) -> None:
        """Forget the peaks: they restart from what runs now."""
        here = self._connected()
        self.peak = len(here)
        self.peak_tokens = sum(self.weigh(r) for r in here)


class Journal:
    """The fake workers' log: one line per completion request, outcome and change of
    state, newest last, in memory and bounded. A failed test's report ends with the
    lines written while it ran (tests/logtails.py); ``count`` only grows, so a reader
    remembers it and later asks for what came since."""

    def __init__(self, maxlen: int = 5000) -> None:
        self._lines: deque[str] = deque(maxlen=maxlen)
        self.count = 0

    def write(self, who: str, event: str) -> None:
        now = time.time()
        stamp = time.strftime("%H:%M:%S", time.localtime(now)) + f".{int(now % 1 * 1000):03d}"
        self._lines.append(f"{stamp} {who} {event}")
        self.count += 1

    def since(self, count: int) -> list[str]:
        """The lines written after ``count`` was read (as many as are still kept)."""
        new = self.count - count
        return list(self._lines)[-new:] if new > 0 else []


JOURNAL = Journal()  # every fake worker in this process writes here


class Gates:
    """Named one-shot gates a test opens to let held requests go on."""

    def __init__(self) -> None:
        self._events: dict[str, asyncio.Event] = {}

    def _event(self, name: str) -> asyncio.Event:
        return self._events.setdefault(name, asyncio.Event())

    def open(self, name: str) -> None:
        """Release every request held on ``name``, and those that arrive later."""
        if not self._event(name).is_set():
            JOURNAL.write("gates", f"open {name}")
        self._event(name).set()

    async def wait(self, name: str) -> None:
        await self._event(name).wait()


def _json_object(body: bytes) -> JSONObject:
    """Parse a request body that must be a JSON object; an empty body counts as {}."""
    if not body.strip():
        return {}
    try:
        value = json.loads(body)
    except ValueError as exc:
        raise ValueError(f"invalid JSON body: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError("JSON body must be an object")
    return value


def prompt_tokens(payload: JSONObject) -> int:
    """The fake tokenizer: a token per :data:`BYTES_PER_TOKEN` bytes (rounded up) of the
    prompt's text (a chat's message contents, text parts included, or ``prompt``), plus
    3 per chat message for its role's markers, as chat templates add."""
    def text_of(content: object) -> str:
        if isinstance(content, str):
            return content
        if isinstance(content, list):
            return "".join(p.get("text", "") for p in content
                           if isinstance(p, dict) and isinstance(p.get("text"), str))
        return ""

    messages = payload.get("messages")
    if isinstance(messages, list):
        msgs = [m for m in messages if isinstance(m, dict)]
        size = sum(len(text_of(m.get("content")).encode()) for m in msgs)
        return -(-size // BYTES_PER_TOKEN) + 3 * len(msgs)
    prompt = payload.get("prompt")
    text = prompt if isinstance(prompt, str) else "".join(
        p for p in prompt if isinstance(p, str)) if isinstance(prompt, list) else ""
    return -(-len(text.encode()) // BYTES_PER_TOKEN)


def max_tokens_of(payload: JSONObject) -> int | None:
    """The request's output limit, as an engine reads it (None: absent or unusable)."""
    for key in ("max_completion_tokens", "max_tokens"):
        value = payload.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
            return value
    return None


def _json(status: int, payload: JSONObject, **headers: str) -> web.Response:
    return web.Response(status=status, body=json.dumps(payload).encode(),
                        content_type="application/json", headers=headers or None)


_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _url(host: str, port: int) -> str:
    """A URL clients can actually connect to, even for wildcard binds."""
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}"


class FakeWorker:
    """A fake OpenAI-compatible LLM worker that records every completion it serves.

    ``healthy``, ``service_time``, ``stream_interval``, ``tokens``,
    ``max_running_requests`` and the engine knobs may be changed at any time; they
    are read per request. ``max_running_requests`` is the cap the worker *reports*
    (per DP rank for SGLang; None = not reported, e.g. SGLang's null, vLLM outside
    dev mode); the worker enforces a cap only with ``batch_limit`` (its *real*
    batch size), so tests can check the sidecar respects what it was told, e.g.
    with ``peak_running``.

    Engine knobs: ``engine`` (see :data:`ENGINES`); ``dp_ranks`` (SGLang, vLLM);
    ``sglang_cli_cap`` (SGLang's top-level ``max_running_requests``, null by
    default); ``serve_loads`` (SGLang's ``/v1/loads``); ``legacy_paths`` (an older
    SGLang serving only ``/get_server_info``);
    ``dev_mode`` (vLLM: serve ``/server_info``); ``loading`` (503 on every path, as
    llama.cpp while it loads); ``capacity_delay`` / ``capacity_status`` /
    ``capacity_body`` (a slow, failing or hostile capacity endpoint);
    ``health_delay`` (a slow ``/health``); ``slot_context`` (llama.cpp's ``n_ctx`` per
    slot in ``/props``, TGI's ``max_input_tokens`` in ``/info``, any JSON value);
    ``kv_tokens`` (the KV capacity the engine reports, any value, None for its default:
    SGLang's ``max_total_num_tokens`` per DP rank, 20480; TGI 2.x's
    ``max_batch_total_tokens``, absent by default as in 3.x; vLLM's
    ``vllm:cache_config_info``, per engine core ``kv_tokens // kv_block_size`` blocks of
    ``kv_block_size``, 32768 tokens by default, a value that is not an int written as the
    ``num_gpu_blocks`` label verbatim).
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        max_running_requests: int | None = 4,
        service_time: float = 0.05,
        tokens: int = 5,
        stream_interval: float = 0.01,
        name: str | None = None,
        gates: Gates | None = None,
        engine: str = "generic",
        dp_ranks: int = 1,
        batch_limit: int | None = None,
        tally: Tally | None = None,
    ) -> None:
        if engine not in ENGINES:
            raise ValueError(f"unknown engine {engine!r} (expected one of {ENGINES})")
        self.host = host
        self.port = port
        self.max_running_requests = max_running_requests
        self.service_time = service_time
        self.tokens = tokens
        self.stream_interval = stream_interval
        self.healthy = True
        self._answered_healthy = True
        self.engine = engine
        self.dp_ranks = dp_ranks
        self.sglang_cli_cap: int | None = None
        self.legacy_paths = False
        self.serve_loads = True  # SGLang's /v1/loads ("some builds serve it")
        self.dev_mode = False
        self.loading = False
        self.capacity_delay = 0.0
        self.health_delay = 0.0
        self.capacity_status = 200
        self.capacity_body: bytes | None = None
        self.batch_limit = batch_limit
        self.slot_context: object = 4096  # llama.cpp: /props n_ctx (any JSON value)
        self.kv_tokens: object = None  # the KV capacity reported (None: the engine's default)
        self.kv_block_size: object = 16  # vLLM's block_size label
        self._waiting = 0
        self._slots = asyncio.Condition()
        self.records: list[RequestRecord] = []
        self.gates = gates if gates is not None else Gates()
        self.tally = tally if tally is not None else Tally()
        self._name = name
        self._runner: web.AppRunner | None = None
        self._running = 0
        self._peak_running = 0
        self._ids = itertools.count(1)
        self._routes: dict[tuple[str, str], _Handler] = {
            ("GET", "/health"): self._health,
            ("POST", "/v1/chat/completions"): self._chat_completions,
            ("GET", "/admin/stats"): self._admin_stats,
            ("POST", "/admin/health"): self._admin_health,
            ("POST", "/admin/reset"): self._admin_reset,
            ("POST", "/admin/gates"): self._admin_gates,
        }

    # -- lifecycle ---------------------------------------------------------

    async def start(self) -> None:
        """Bind and start serving; ``port`` holds the real port afterwards."""
        if self._runner is not None:
            raise RuntimeError(f"worker {self.name} already started")
        app = web.Application()
        # One catch-all route: unknown paths and methods get this worker's JSON 404.
        app.router.add_route("*", "/{path:.*}", self._dispatch)
        runner = web.AppRunner(
            # shutdown_timeout: stop() aborts in-flight requests (0 would mean "wait forever").
            app, access_log=None, handler_cancellation=True, shutdown_timeout=0.01,
            max_line_size=_FIELD_LIMIT, max_field_size=_FIELD_LIMIT)
        await runner.setup()
        try:
            site = web.TCPSite(runner, self.host, self.port)
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        self.port = runner.addresses[0][1]
        JOURNAL.write(self.name, f"listening on {self.url} (engine {self.engine})")

    async def stop(self) -> None:
        """Stop listening and abort open connections (in-flight requests become cancelled)."""
        if self._runner is None:
            return
        runner, self._runner = self._runner, None
        JOURNAL.write(self.name, f"stopping ({self._running} running)")
        await runner.cleanup()

    async def __aenter__(self) -> FakeWorker:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    # -- observation -------------------------------------------------------

    @property
    def name(self) -> str:
        return self._name if self._name is not None else f"worker-{self.port}"

    @property
    def url(self) -> str:
        return _url(self.host, self.port)

    @property
    def started(self) -> int:
        return len(self.records)

    @property
    def finished(self) -> int:
        return sum(1 for r in self.records if r.outcome == "finished")

    @property
    def cancelled(self) -> int:
        return sum(1 for r in self.records if r.outcome == "cancelled")

    @property
    def running(self) -> int:
        """Completions in progress right now (not affected by ``reset``)."""
        return self._running

    @property
    def peak_running(self) -> int:
        """Highest ``running`` seen since start or the last ``reset``."""
        return self._peak_running

    def stats(self) -> JSONObject:
        return {
            "name": self.name,
            "started": self.started,
            "finished": self.finished,
            "cancelled": self.cancelled,
            "running": self.running,
            "peak_running": self.peak_running,
            "requests": [r.to_json() for r in self.records],
        }

    def reset(self) -> None:
        """Forget past requests (those still running keep running, unrecorded)."""
        self.records = []
        self._peak_running = self._running

    # -- endpoints -----------------------------------------------------------

    async def _dispatch(self, request: web.Request) -> web.StreamResponse:
        if self.loading and not request.path.startswith("/admin/"):
            return _json(503, LLAMACPP_LOADING)
        key = (request.method, request.path)
        handler = self._routes.get(key) or self._engine_routes().get(key, self._not_found)
        response = await handler(request)
        response.headers.setdefault("Server", SERVER_HEADER)
        return response

    async def _health(self, request: web.Request) -> web.StreamResponse:
        if self.health_delay > 0:
            await asyncio.sleep(self.health_delay)
        if self.healthy != self._answered_healthy:  # the checkers' view changes now
            self._answered_healthy = self.healthy
            JOURNAL.write(self.name, f"GET /health now {200 if self.healthy else 503}")
        if self.healthy:
            return _json(200, {"status": "ok"})
        return _json(503, {"status": "unhealthy"})

    # -- engine impersonation ------------------------------------------------

    @property
    def waiting(self) -> int:
        """Completions waiting in this worker's own queue (``batch_limit`` reached)."""
        return self._waiting

    def _engine_routes(self) -> dict[tuple[str, str], _Handler]:
        """The engine's own endpoints: what is absent here answers 404, as on the real one."""
        e = self.engine
        routes: dict[tuple[str, str], _Handler]
        if e == "sglang":
            info = "/get_server_info" if self.legacy_paths else "/server_info"
            routes = {("GET", info): self._sglang_info, ("GET", "/metrics"): self._metrics}
            if self.serve_loads:
                routes[("GET", "/v1/loads")] = self._sglang_loads
            return routes
        if e == "vllm":
            routes = {("GET", "/metrics"): self._metrics}
            if self.dev_mode:
                routes[("GET", "/server_info")] = self._vllm_info
            return routes
        if e == "tgi":
            return {("GET", "/info"): self._tgi_info, ("GET", "/metrics"): self._metrics}
        if e == "llamacpp":
            return {("GET", "/props"): self._llamacpp_props, ("GET", "/metrics"): self._metrics}
        return {("GET", "/server_info"): self._server_info}

    async def _capacity_reply(self, payload: JSONObject) -> web.StreamResponse:
        if self.capacity_delay > 0:
            await asyncio.sleep(self.capacity_delay)
        if self.capacity_status != 200:
            return _json(self.capacity_status, {"error": "capacity endpoint failing"})
        if self.capacity_body is not None:
            return web.Response(status=200, body=self.capacity_body,
                                content_type="application/json")
        return _json(200, payload)

    async def _server_info(self, request: web.Request) -> web.StreamResponse:
        info: JSONObject = {"name": self.name}
        if self.max_running_requests is not None:
            info["max_running_requests"] = self.max_running_requests
        return await self._capacity_reply(info)

    async def _sglang_info(self, request: web.Request) -> web.StreamResponse:
        return await self._capacity_reply(sglang_server_info(
            self.max_running_requests, self.dp_ranks, self.sglang_cli_cap,
            20480 if self.kv_tokens is None else self.kv_tokens))

    async def _sglang_loads(self, request: web.Request) -> web.StreamResponse:
        return _json(200, sglang_loads(self.max_running_requests, self.dp_ranks,
                                       self._running, self._waiting))

    async def _vllm_info(self, request: web.Request) -> web.StreamResponse:
        if request.query.get("config_format") != "json":
            return _json(200, {"vllm_config": f"model='{MODEL}', max_num_seqs=..."})
        return await self._capacity_reply(vllm_server_info(self.max_running_requests,
                                                           self.dp_ranks))

    async def _tgi_info(self, request: web.Request) -> web.StreamResponse:
        return await self._capacity_reply(tgi_info(self.max_running_requests,
                                                   self.slot_context, self.kv_tokens))

    async def _llamacpp_props(self, request: web.Request) -> web.StreamResponse:
        return await self._capacity_reply(llamacpp_props(self.max_running_requests,
                                                         self.slot_context))

    async def _metrics(self, request: web.Request) -> web.StreamResponse:
        """The engine's /metrics, with its real metric names for running and waiting."""
        run, wait = float(self._running), float(self._waiting)
        labels = f'model_name="{MODEL}"'
        e = self.engine
        if e == "vllm":
            # vllm-project/vllm vllm/v1/metrics/loggers.py; labels model_name, engine.
            # num_requests_waiting_by_reason is the prefix-match trap.
            lab = f'engine="0",{labels}'
            gauges = [("vllm:num_requests_running", lab, run),
                      ("vllm:num_requests_waiting", lab, wait),
                      ("vllm:num_requests_waiting_by_reason", f'{lab},reason="capacity"', 7.0),
                      ("vllm:kv_cache_usage_perc", lab, 0.1)]
            kv = 32768 if self.kv_tokens is None else self.kv_tokens
            size = self.kv_block_size
            blocks = kv // size if isinstance(kv, int) and isinstance(size, int) and size else kv
            gauges += [("vllm:cache_config_info", vllm_cache_config_labels(i, blocks, size), 1.0)
                       for i in range(self.dp_ranks)]
        elif e == "sglang":
            # sgl-project/sglang docs/references/production_metrics.md (--enable-metrics)
            gauges = [("sglang:num_running_reqs", labels, run),
                      ("sglang:num_queue_reqs", labels, wait),
                      ("sglang:token_usage", labels, 0.1)]
        elif e == "tgi":
            # huggingface.co/docs/text-generation-inference/reference/metrics
            gauges = [("tgi_batch_current_size", "", run), ("tgi_queue_size", "", wait),
                      ("tgi_batch_current_max_tokens", "", 0.0)]
        else:
            # ggml-org/llama.cpp tools/server/README.md (--metrics)
            gauges = [("llamacpp:requests_processing", "", run),
                      ("llamacpp:requests_deferred", "", wait),
                      ("llamacpp:n_busy_slots_per_decode", "", 1.0)]
        return web.Response(status=200, text=prometheus_gauges(gauges),
                            content_type="text/plain")

    async def _admin_stats(self, request: web.Request) -> web.StreamResponse:
        return _json(200, self.stats())

    async def _admin_health(self, request: web.Request) -> web.StreamResponse:
        try:
            healthy = _json_object(await request.read()).get("healthy")
        except ValueError as exc:
            return _json(400, {"error": str(exc)})
        if not isinstance(healthy, bool):
            return _json(400, {"error": 'body must be {"healthy": true|false}'})
        self.healthy = healthy
        return _json(200, {"healthy": healthy})

    async def _admin_reset(self, request: web.Request) -> web.StreamResponse:
        self.reset()
        return _json(200, {"status": "reset"})

    async def _admin_gates(self, request: web.Request) -> web.StreamResponse:
        try:
            name = _json_object(await request.read()).get("open")
        except ValueError as exc:
            return _json(400, {"error": str(exc)})
        if not isinstance(name, str) or not name:
            return _json(400, {"error": 'body must be {"open": "GATE"}'})
        self.gates.open(name)
        return _json(200, {"opened": name})

    async def _not_found(self, request: web.Request) -> web.StreamResponse:
        return _json(404, {"error": f"no route for {request.method} {request.path}"})

    async def _chat_completions(self, request: web.Request) -> web.StreamResponse:
        try:
            payload = _json_object(await request.read())
            service_time = self._service_time_for(request)
            generate = self._completion_tokens_for(request, payload)
        except ValueError as exc:
            return _json(400, {"error": str(exc)})
        stream = payload.get("stream") is True
        record = RequestRecord(
            request_id=request.headers.get("x-request-id"),
            admission_id=request.headers.get("x-smg-admission-id"),
            priority_class=request.headers.get("x-smg-effective-class"),
            headers={k.lower(): v for k, v in request.headers.items()},
            stream=stream,
            started_at=time.time(),
            prompt_tokens=prompt_tokens(payload),
            body_bytes=len(await request.read()),  # read once already: kept
            max_tokens=max_tokens_of(payload),
        )
        self.records.append(record)
        JOURNAL.write(self.name, f"POST {request.path} id={record.request_id} "
                      f"class={record.priority_class} admission={record.admission_id} "
                      f"stream={stream} gate={request.headers.get(GATE_HEADER)}")
        # An engine with a full batch queues the request FIFO, whatever its priority.
        in_slot = False
        self._waiting += 1
        try:
            async with self._slots:
                await self._slots.wait_for(
                    lambda: self.batch_limit is None or self._running < self.batch_limit)
                self._running += 1
                in_slot = True
        finally:
            self._waiting -= 1
            if not in_slot:
                record.outcome, record.ended_at = "cancelled", time.time()
                JOURNAL.write(self.name, f"id={record.request_id} cancelled in the queue")
        record.service_started_at = time.time()
        self._peak_running = max(self._peak_running, self._running)
        # Closed: Envoy ended the request (see Tally); the handler's cancellation follows.
        self.tally.enter(record, lambda: request.transport is None
                         or request.transport.is_closing())
        # Cancelled unless we get to the last byte: a client hang-up cancels this
        # handler (CancelledError) or fails a write (ConnectionError).
        outcome: Outcome = "cancelled"
        try:
            completion_id = f"chatcmpl-{self.name}-{next(self._ids)}"
            model = str(payload.get("model", "fake-model"))
            await asyncio.sleep(service_time)
            if gate := request.headers.get(GATE_HEADER):
                await self.gates.wait(gate)
            usage = self._usage_for(request, record, generate)
            if stream:
                options = payload.get("stream_options")
                include = isinstance(options, dict) and options.get("include_usage") is True
                response = await self._serve_stream(request, completion_id, model, record,
                                                    generate, usage if include else None)
            else:
                record.completion_tokens = generate
                response = self._whole(completion_id, model, generate, usage)
            outcome = "finished"
            return response
        except ConnectionError:
            return web.Response(status=499)  # never sent: the peer is gone
        finally:
            self._running -= 1
            self.tally.leave(record)
            record.outcome = outcome
            record.ended_at = time.time()
            JOURNAL.write(self.name, f"id={record.request_id} {outcome} after "
                          f"{record.ended_at - record.started_at:.3f} s ({self._running} running)")
            async with self._slots:
                self._slots.notify_all()

    def _service_time_for(self, request: web.Request) -> float:
        raw = request.headers.get(SERVICE_TIME_HEADER)
        if raw is None:
            return self.service_time
        try:
            value = float(raw)
        except ValueError:
            raise ValueError(f"bad {SERVICE_TIME_HEADER} {raw!r}") from None
        if not value >= 0:  # also rejects NaN
            raise ValueError(f"bad {SERVICE_TIME_HEADER} {raw!r}")
        return value

    def _completion_tokens_for(self, request: web.Request, payload: JSONObject) -> int:
        """How many tokens this completion generates: ``tokens`` (or the header's), at most
        the request's max_tokens."""
        raw = request.headers.get(COMPLETION_TOKENS_HEADER)
        n = self.tokens
        if raw is not None:
            if not raw.isdigit():
                raise ValueError(f"bad {COMPLETION_TOKENS_HEADER} {raw!r}")
            n = int(raw)
        limit = max_tokens_of(payload)
        return n if limit is None else min(n, limit)

    @staticmethod
    def _usage_for(request: web.Request, record: RequestRecord, generate: int
                   ) -> JSONObject | str | None:
        """The usage block to report: the true one, a test's claim (raw JSON text), or
        None (``x-fake-usage: none``)."""
        claim = request.headers.get(USAGE_HEADER)
        if claim == "none":
            return None
        if claim is not None:
            return claim
        return {"prompt_tokens": record.prompt_tokens, "completion_tokens": generate,
                "total_tokens": record.prompt_tokens + generate}

    def _whole(self, completion_id: str, model: str, generate: int,
               usage: JSONObject | str | None) -> web.Response:
        """Non-streaming completion, answered in one go."""
        body = {
            "id": completion_id,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant",
                                "content": "".join(self._words(generate))},
                    "finish_reason": "stop",
                }
            ],
            "worker": self.name,
        }
        text = json.dumps(body)
        if usage is not None:  # last, as engines put it (a claim goes in verbatim)
            block = usage if isinstance(usage, str) else json.dumps(usage)
            text = text[:-1] + f', "usage": {block}}}'
        return web.Response(status=200, body=text.encode(), content_type="application/json",
                            headers={"x-fake-worker": self.name})

    async def _serve_stream(
        self, request: web.Request, completion_id: str, model: str, record: RequestRecord,
        generate: int, usage: JSONObject | str | None
    ) -> web.StreamResponse:
        """SSE completion: headers and first token now (time to first byte), then
        one token every ``stream_interval`` s, then ``[DONE]``."""
        response = web.StreamResponse(status=200, headers={
            "Content-Type": "text/event-stream",
            "Cache-Control": "no-cache",
            "Server": SERVER_HEADER,
            "x-fake-worker": self.name,
        })
        response.enable_chunked_encoding()
        await response.prepare(request)
        words = self._words(generate)
        for i, word in enumerate(words):
            if i == 1 and (gate := request.headers.get(STREAM_GATE_HEADER)):
                await self.gates.wait(gate)
            if i > 0:
                await asyncio.sleep(self.stream_interval)
            chunk = {
                "id": completion_id,
                "object": "chat.completion.chunk",
                "created": int(time.time()),
                "model": model,
                "choices": [{
                    "index": 0,
                    "delta": {"content": word},
                    "finish_reason": "stop" if i == len(words) - 1 else None,
                }],
                "worker": self.name,
            }
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
            record.completion_tokens = i + 1
        if usage is not None:  # stream_options.include_usage: a last chunk, no choices
            block = usage if isinstance(usage, str) else json.dumps(usage)
            head = json.dumps({"id": completion_id, "object": "chat.completion.chunk",
                               "created": int(time.time()), "model": model, "choices": []})
            await response.write(f"data: {head[:-1]}, \"usage\": {block}}}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    def _words(self, n: int) -> list[str]:
        return [f"tok{i} " for i in range(n)]


async def wait_for(predicate: Callable[[], bool], timeout: float) -> None:
    """Poll ``predicate`` every 10 ms until true; raise TimeoutError after ``timeout`` s."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() >= deadline:
            raise TimeoutError(f"condition not met within {timeout} s")
        await asyncio.sleep(0.01)


class Fleet:
    """``n`` fake workers named w1..wn; extra kwargs go to every ``FakeWorker``.

    With ``base_port`` set, worker i listens on ``base_port + i``; otherwise
    each gets an ephemeral port.
    """

    def __init__(
        self, n: int = 2, *, host: str = "127.0.0.1", base_port: int = 0, **worker_kwargs: Any
    ) -> None:
        self.gates = Gates()  # shared: a test need not know which worker got a request
        self.tally = Tally()  # completions running on all workers together
        self.workers = [
            FakeWorker(host, base_port + i if base_port else 0, name=f"w{i + 1}",
                       gates=self.gates, tally=self.tally, **worker_kwargs)
            for i in range(n)
        ]

    async def start(self) -> None:
        """Start all workers; if one fails to bind, stop the others and re-raise."""
        try:
            for worker in self.workers:
                await worker.start()
        except BaseException:
            await self.stop()
            raise

    async def stop(self) -> None:
        await asyncio.gather(*(w.stop() for w in self.workers))

    async def __aenter__(self) -> Fleet:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    @property
    def urls(self) -> list[str]:
        return [w.url for w in self.workers]

    def tokens_served(self) -> int:
        """Tokens (prompt + completion) of every completion the workers finished, by
        their own count: a token-budget test's ground truth."""
        return sum(r.total_tokens for w in self.workers for r in w.records
                   if r.outcome == "finished")

    @property
    def addresses(self) -> list[tuple[str, int]]:
        return [(w.host, w.port) for w in self.workers]


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m devtools.fleet", description="Run a fleet of fake LLM workers."
    )
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--base-port", type=int, default=8081,
                        help="first worker's port (0: ephemeral ports)")
    parser.add_argument("--max-running-requests", type=int, default=4,
                        help="reported in /server_info; <= 0 omits the field")
    parser.add_argument("--service-time", type=float, default=0.05,
                        help="seconds before the response (time to first byte)")
    parser.add_argument("--engine", choices=ENGINES, default="generic",
                        help="impersonate this engine's endpoints and metric names")
    parser.add_argument("--batch-limit", type=int, default=None,
                        help="run at most N completions at once; the rest wait FIFO")
    parser.add_argument("--tokens", type=int, default=5)
    parser.add_argument("--stream-interval", type=float, default=0.01)
    return parser.parse_args(argv)


async def _serve(args: argparse.Namespace) -> int:
    max_running = args.max_running_requests if args.max_running_requests > 0 else None
    fleet = Fleet(
        args.workers,
        host=args.host,
        base_port=args.base_port,
        max_running_requests=max_running,
        service_time=args.service_time,
        tokens=args.tokens,
        stream_interval=args.stream_interval,
        engine=args.engine,
        batch_limit=args.batch_limit,
    )
    try:
        await fleet.start()
    except OSError as exc:
        print(f"error: cannot start fleet: {exc}", file=sys.stderr)
        return 1
    for worker in fleet.workers:
        print(f"worker {worker.name} listening on {worker.url}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    signals = (signal.SIGINT, signal.SIGTERM)
    for sig in signals:
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)
        await fleet.stop()
    return 0


def main(argv: list[str] | None = None) -> int:
    """CLI entry point: serve until SIGINT/SIGTERM; returns the exit status."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    return asyncio.run(_serve(_parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
