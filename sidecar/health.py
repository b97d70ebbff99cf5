"""Health-driven capacity: probing the workers (the I/O around sidecar.capacity).

The worker set comes from ``--worker-urls`` or from Envoy's admin API
(``/clusters?format=json``: only hosts Envoy will route to, so admission and
routing agree, outlier ejection included). Each worker is probed every
interval: ``GET /health`` for liveness (200 = healthy; llama.cpp's 503 while
loading = not yet), then the engine's own capacity endpoint
(``--worker-engine``, see :data:`ENGINES`), and with ``--saturation-guard``
one saturation request (running / waiting counts). What capacity to count
from those results is decided by :class:`sidecar.capacity.CapacityPolicy`.
"""

from __future__ import annotations

import asyncio
import errno
import json
import math
import re
import time
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from sidecar import logs
from sidecar.capacity import (
    UNREAD_WORKER_CAPACITY,
    CapacityPolicy,
    CapacityReading,
    ProbeStatus,
    WorkerProbe,
)
from sidecar.config import sends_credential

__all__ = [
    "DEFAULT_WORKER_CAPACITY",
    "ENGINES",
    "CapacityMonitor",
    "CapacityReading",
    "WorkerProber",
    "http_get",
    "new_session",
    "probe_worker",
    "sends_credential",
]

DEFAULT_WORKER_CAPACITY = 64  # the contract's count for a healthy worker that reports none
MAX_WORKER_CAPACITY = 1 << 20  # a larger claim is not a real engine's cap: ignored
ENGINES = ("auto", "sglang", "vllm", "tgi", "llamacpp", "generic")

log = logs.get("sidecar.health")

PROBE_BODY_LIMIT = 1 << 20  # capacity endpoints: a few KiB in practice; larger is not parsed
METRICS_BODY_LIMIT = 4 << 20  # /metrics with many histograms; larger is not parsed
CLUSTERS_BODY_LIMIT = 16 << 20  # Envoy's /clusters JSON grows with the number of hosts

# errnos that say the sidecar itself could not make the request (not the worker's fault).
LOCAL_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM,
                          errno.EADDRNOTAVAIL, errno.EAGAIN})

# Saturation signals per engine: (running, waiting) metric names, exact (a prefix match
# would also take vllm:num_requests_waiting_by_reason). SGLang >= 0.5.4 may use "sglang_".
SATURATION_METRICS: Mapping[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "vllm": (("vllm:num_requests_running",), ("vllm:num_requests_waiting",)),
    "sglang": (("sglang:num_running_reqs", "sglang_num_running_reqs"),
               ("sglang:num_queue_reqs", "sglang_num_queue_reqs")),
    "tgi": (("tgi_batch_current_size",), ("tgi_queue_size",)),
    "llamacpp": (("llamacpp:requests_processing",), ("llamacpp:requests_deferred",)),
}


class BodyTooLarge(ValueError):
    pass


class BadStatus(ValueError):
    """The endpoint answered with an error status."""


class NotFound(Exception):
    """The endpoint does not exist on this worker (404/405): a different engine."""


# Answers that say the worker will not tell us (not that it is broken or another engine).
REFUSALS: Mapping[int, str] = {401: "unauthorized", 403: "forbidden", 501: "not_enabled"}
REFUSAL_HINTS: Mapping[int, str] = {
    401: "give the probes the engine's API key: --worker-auth-file FILE",
    403: "the credential in --worker-auth-file is not allowed to read this endpoint",
    501: "the engine was started without this endpoint (llama-server: --metrics)",
}
# A refused endpoint is asked again only this often: a refusal lasts until someone
# changes a flag, and asking every interval would only add requests.
REFUSED_RETRY_SECS = 30.0


class ProbeProblem(Exception):
    """The worker answered, but its capacity or saturation cannot be read this way."""

    event = "worker_probe_problem"

    def __init__(self, path: str, reason: str, hint: str) -> None:
        super().__init__(f"{reason} at {path}")
        self.path = path
        self.reason = reason
        self.hint = hint

    @property
    def endpoint(self) -> str:
        """The path without its query: a bounded metric label."""
        return self.path.split("?", 1)[0]


class Refused(ProbeProblem):
    """401/403/501: the endpoint refused the probe."""

    event = "worker_probe_refused"

    def __init__(self, path: str, status: int) -> None:
        super().__init__(path, REFUSALS[status], REFUSAL_HINTS[status])
        self.status = status


async def http_get(session: aiohttp.ClientSession, url: str, timeout: float,
                   limit: int = PROBE_BODY_LIMIT,
                   headers: Mapping[str, str] | None = None) -> tuple[int, bytes]:
    """GET ``url``: the status and its body, within ``timeout`` s.

    A body longer than ``limit`` bytes raises :class:`BodyTooLarge` (a ValueError)
    without being read further. Raises aiohttp.ClientError, OSError, TimeoutError
    or ValueError. With ``headers`` (a credential) redirects are not followed:
    a redirect must not carry the credential to another host.
    """
    async with asyncio.timeout(timeout), session.get(
            url, headers=headers, allow_redirects=not headers) as resp:
        if resp.content_length is not None and resp.content_length > limit:
            raise BodyTooLarge(f"body of {resp.content_length} bytes > {limit}")
        body = bytearray()
        while data := await resp.content.read(limit + 1 - len(body)):
            body += data
            if len(body) > limit:
                raise BodyTooLarge(f"body over {limit} bytes")
        return resp.status, bytes(body)


def new_session() -> aiohttp.ClientSession:
    """A session for probes: keep-alive to each worker, no proxy from the environment."""
    return aiohttp.ClientSession(headers={"Accept": "application/json"}, trust_env=False)


PROBE_ERRORS = (aiohttp.ClientError, OSError, TimeoutError, ValueError, RecursionError)


def is_local_failure(exc: BaseException) -> bool:
    """Did the sidecar fail to make the request (timeout, out of fds...), rather than
    the worker answer badly or refuse the connection?"""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, TimeoutError):
            return True
        code = getattr(e, "errno", None)
        if code in LOCAL_ERRNOS:
            return True
        os_error = getattr(e, "os_error", None)  # aiohttp.ClientConnectorError
        if isinstance(os_error, OSError) and os_error.errno in LOCAL_ERRNOS:
            return True
        e = e.__cause__ or e.__context__
    return False


def positive_int(value: object) -> int | None:
    """A plausible cap: a positive finite integer (an integral float passes), else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, float):
        if not (math.isfinite(value) and value.is_integer()):
            return None
        value = int(value)
    if isinstance(value, int) and 0 < value <= MAX_WORKER_CAPACITY:
        return value
    return None


def _dict(value: object) -> dict[str, object] | None:
    return value if isinstance(value, dict) else None


def _field(value: object, name: str) -> object:
    """``value[name]`` if ``value`` is a JSON object, else None."""
    return value.get(name) if isinstance(value, dict) else None


def _has(value: object, name: str) -> bool:
    return isinstance(value, dict) and name in value


# ----------------------------------------------------------- per-engine readers
# Each returns the cap found in a parsed JSON body, or None (with the reason).

def sglang_cap(info: object) -> tuple[int | None, str]:
    """SGLang ``/server_info``: Σ internal_states[].effective_max_running_requests_per_dp
    (one entry per DP rank), else a positive top-level max_running_requests (the CLI arg,
    null unless given)."""
    d = _dict(info)
    if d is None:
        return None, "not a JSON object"
    states = d.get("internal_states")
    if isinstance(states, list) and states:
        caps = [positive_int(_field(s, "effective_max_running_requests_per_dp"))
                for s in states]
        if all(c is not None for c in caps):
            return sum(c for c in caps if c is not None), ""
        reason = "internal_states[].effective_max_running_requests_per_dp not all positive ints"
    else:
        reason = "no internal_states"
    top = positive_int(d.get("max_running_requests"))
    if top is not None:
        return top, ""
    return None, reason + " and no positive max_running_requests"


def sglang_loads_cap(body: object) -> tuple[int | None, str]:
    """SGLang ``/v1/loads``: Σ loads[].max_running_requests."""
    d = _dict(body)
    loads = d.get("loads") if d is not None else None
    if not isinstance(loads, list) or not loads:
        return None, "no loads[]"
    caps = [positive_int(_field(x, "max_running_requests")) for x in loads]
    if all(c is not None for c in caps):
        return sum(c for c in caps if c is not None), ""
    return None, "loads[].max_running_requests not all positive ints"


def vllm_cap(info: object) -> tuple[int | None, str]:
    """vLLM dev-mode ``/server_info?config_format=json``: vllm_config.scheduler_config
    .max_num_seqs (per data-parallel rank) × parallel_config.data_parallel_size."""
    cfg = _dict(_field(info, "vllm_config"))
    if cfg is None:
        return None, "no vllm_config object"
    seqs = positive_int(_field(cfg.get("scheduler_config"), "max_num_seqs"))
    if seqs is None:
        return None, "vllm_config.scheduler_config.max_num_seqs not a positive int"
    dp = positive_int(_field(cfg.get("parallel_config"), "data_parallel_size"))
    return seqs * (dp or 1), ""


def field_cap(name: str) -> Callable[[object], tuple[int | None, str]]:
    """A top-level field: absent or null = the engine reports none (None); any other
    value that is not a plausible cap raises ValueError (a failed read)."""
    def read(body: object) -> tuple[int | None, str]:
        d = _dict(body)
        if d is None:
            raise ValueError("not a JSON object")
        if d.get(name) is None:
            return None, f"no {name}"
        value = positive_int(d.get(name))
        if value is None:
            raise ValueError(f"{name} is {str(d.get(name))[:40]!r}, not a positive int")
        return value, ""
    return read


MAX_SLOT_CONTEXT = 1 << 30  # tokens; a larger n_ctx is not a context an engine has


def llamacpp_slot_context(props: object) -> int | None:
    """The tokens one llama.cpp slot holds (``/props``: ``default_generation_settings.n_ctx``,
    the server's context divided among its slots); None when absent or not a plausible
    size (nothing is refused on a context the sidecar could not read)."""
    d = _dict(props)
    settings = None if d is None else _dict(d.get("default_generation_settings"))
    n = None if settings is None else settings.get("n_ctx")
    if isinstance(n, float) and math.isfinite(n) and n.is_integer():
        n = int(n)
    return n if isinstance(n, int) and not isinstance(n, bool) and 0 < n <= MAX_SLOT_CONTEXT \
        else None


# ------------------------------------------------- capacity in tokens, per engine
# Each KV reader returns (tokens, why): tokens None and why "" when the engine reports
# none; None and a reason when what it reports is not a size (logged once, and the
# worker counts no tokens: smg_sidecar_kv_unreported_workers).

MAX_KV_TOKENS = 1 << 40  # a larger KV capacity is not a cache an engine has
KV_REFRESH_SECS = 30.0  # vLLM's cache size is read from /metrics at most this often
_DIGITS = re.compile(r"^[0-9]{1,15}$")


def kv_size(value: object, limit: int = MAX_KV_TOKENS) -> int | None:
    """A plausible size: a positive integer up to ``limit`` (an integral float, or a
    string of digits as a Prometheus label carries it, passes), else None."""
    if isinstance(value, str):
        value = int(value) if _DIGITS.match(value) else None
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    if isinstance(value, int) and not isinstance(value, bool) and 0 < value <= limit:
        return value
    return None


def _sized(d: Mapping[str, object], name: str) -> tuple[int | None, str]:
    """A top-level size field: (None, "") when absent or null, (None, reason) when it is
    not a size."""
    raw = d.get(name)
    if raw is None:
        return None, ""
    size = kv_size(raw)
    return (size, "") if size is not None else (None, f"{name} is {str(raw)[:40]!r}, "
                                                       "not a size")


def _product(a: int, b: int, what: str) -> tuple[int | None, str]:
    return (a * b, "") if a * b <= MAX_KV_TOKENS else (None, f"{what} = {a * b}, not a size")


VLLM_CACHE_INFO = "vllm:cache_config_info"


def vllm_kv_tokens(metrics: str) -> tuple[int | None, str]:
    """vLLM ``/metrics``: ``vllm:cache_config_info``, an info gauge whose labels are the
    cache config, one sample per engine core (label ``engine``, one per data-parallel
    rank): Σ num_gpu_blocks × block_size. ``num_gpu_blocks`` is ``None`` until the
    engine has profiled its memory: not a size, so not counted until it is."""
    lines = [ln for ln in metrics.splitlines()
             if ln.startswith(VLLM_CACHE_INFO) and ln[len(VLLM_CACHE_INFO):][:1] in ("{", " ")]
    if not lines:
        return None, ""
    total = 0
    for fam in text_string_to_metric_families("\n".join(lines) + "\n"):
        for sample in fam.samples:
            blocks = kv_size(sample.labels.get("num_gpu_blocks"))
            size = kv_size(sample.labels.get("block_size"))
            if blocks is None or size is None:
                return None, (f"{VLLM_CACHE_INFO} num_gpu_blocks="
                              f"{sample.labels.get('num_gpu_blocks')!r:.40} block_size="
                              f"{sample.labels.get('block_size')!r:.40}: not sizes")
            total += blocks * size
    return (total, "") if 0 < total <= MAX_KV_TOKENS else (None, f"{VLLM_CACHE_INFO}: "
                                                                  f"{total} tokens, not a size")


def sglang_kv_tokens(info: object) -> tuple[int | None, str]:
    """SGLang ``/server_info``: ``max_total_num_tokens`` (the token pool of one
    data-parallel rank: the controller reports rank 0's) × ``dp_size``."""
    d = _dict(info)
    if d is None:
        return None, ""
    tokens, why = _sized(d, "max_total_num_tokens")
    if tokens is None:
        return None, why
    ranks, why = _sized(d, "dp_size")
    if why:
        return None, why
    return _product(tokens, ranks or 1, "max_total_num_tokens × dp_size")


def tgi_kv_tokens(info: object) -> tuple[int | None, str]:
    """TGI ``/info``: ``max_batch_total_tokens`` (the tokens one batch may hold, which TGI
    sizes from its KV cache; served by TGI up to 2.x, absent in 3.x)."""
    d = _dict(info)
    return (None, "") if d is None else _sized(d, "max_batch_total_tokens")


def tgi_context(info: object) -> int | None:
    """TGI ``/info``: the most input tokens TGI accepts in one request
    (``max_input_tokens``; ``max_input_length`` before 2.1), None when absent or not a
    size: TGI refuses a longer prompt (422), so it is the context a request must fit."""
    d = _dict(info)
    if d is None:
        return None
    for name in ("max_input_tokens", "max_input_length"):
        if d.get(name) is not None:
            return kv_size(d.get(name), MAX_SLOT_CONTEXT)
    return None


def llamacpp_kv_tokens(props: object, context: int | None) -> tuple[int | None, str]:
    """llama.cpp ``/props``: ``n_ctx`` per slot × ``total_slots``. llama.cpp does not say
    whether its KV cache is split among its slots (``--parallel N``) or unified
    (``--kv-unified``, on by default when ``--parallel`` is not given): unified, every
    slot reports the whole cache and this product counts it ``total_slots`` times
    (docs/reference.md, Capacity in tokens)."""
    d = _dict(props)
    if d is None or context is None:
        raw = None if d is None else _field(d.get("default_generation_settings"), "n_ctx")
        return None, ("" if raw is None else f"n_ctx is {str(raw)[:40]!r}, not a size")
    slots, why = _sized(d, "total_slots")
    if slots is None:
        return None, why
    return _product(context, slots, "n_ctx × total_slots")


_SGLANG_MARKERS = ("internal_states", "tp_size", "dp_size", "model_path")


def recognise_server_info(info: object) -> str | None:
    """Which engine served this ``/server_info`` body (None: none we know)."""
    d = _dict(info)
    if d is None:
        return None
    if "vllm_config" in d:
        return "vllm"
    if any(k in d for k in _SGLANG_MARKERS):
        return "sglang"
    if "max_running_requests" in d:
        return "generic"
    return None


def prometheus_sums(text: str, names: Sequence[str]) -> dict[str, float]:
    """Σ of each named metric's samples in a Prometheus text body (exact names only).

    Only the lines of the wanted metrics are handed to the parser, so a large
    /metrics body costs one scan, not a full parse.
    """
    wanted = set(names)
    lines = [ln for ln in text.splitlines()
             if ln and ln[0] != "#" and ln.split("{", 1)[0].split(" ", 1)[0] in wanted]
    sums: dict[str, float] = {}
    for fam in text_string_to_metric_families("\n".join(lines) + "\n"):
        for s in fam.samples:
            if s.name in wanted:
                sums[s.name] = sums.get(s.name, 0.0) + s.value
    return sums


def _count(value: float | None) -> int | None:
    if value is None or not math.isfinite(value) or value < 0:
        return None
    return int(value)


@dataclass
class _WorkerState:
    engine: str | None = None  # recognised engine (auto), None = detect on next healthy probe
    loads_missing: bool = False  # SGLang without /v1/loads: saturation from /metrics
    # The recognised engine's capacity endpoint answered since it was recognised: only
    # then does a later 404 mean another engine (else it is how this one answers).
    cap_answered: bool = False
    refused: dict[str, tuple[Refused, float]] = field(default_factory=dict)  # path -> retry at
    detect_refused: tuple[Refused, float] | None = None  # recognition refused: retry at
    router_models: tuple[str, ...] = ()  # llama.cpp router: the models loaded at last read
    context: int | None = None  # tokens per slot (llama.cpp n_ctx, TGI max_input_tokens)
    kv_tokens: int | None = None  # its KV capacity in tokens at the last read
    kv_due: float = 0.0  # vLLM: when /metrics is read for the cache size next


class NoLoadedModel(ProbeProblem):
    """A llama.cpp router with no model loaded: no slots to read."""

    event = "llamacpp_router_no_loaded_model"

    def __init__(self) -> None:
        super().__init__("/models", "router_no_loaded_model",
                         "no model is loaded; counted as one slot until one is")


def credential_secrets(credential: Mapping[str, str]) -> list[str]:
    """What of a credential must never be shown: each header value, without the
    ``Bearer`` scheme word (the key itself)."""
    return [v.removeprefix("Bearer ").strip() for v in credential.values()]


class WorkerProber:
    """Probes workers by engine; remembers per worker what ``auto`` recognised.

    ``credential`` (header name -> value, from ``--worker-auth-file``) goes with
    every probe to a worker over TLS (or over plain http with ``credential_over_http``),
    never anywhere else, and is never logged: whatever a worker answers, every line
    this prober writes is scrubbed of it (:func:`sidecar.logs.redact`), and so is every
    line of the process once it is registered here.
    """

    def __init__(self, session: Callable[[], aiohttp.ClientSession], *, engine: str,
                 timeout: float, saturation_guard: bool,
                 credential: Mapping[str, str] | None = None,
                 credential_over_http: bool = False,
                 refused_retry_secs: float = REFUSED_RETRY_SECS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._session = session
        self.engine = engine
        self.timeout = timeout
        self.saturation_guard = saturation_guard
        self._headers = dict(credential) if credential else None
        for secret in credential_secrets(self._headers or {}):
            logs.register_secret(secret)
        self.credential_over_http = credential_over_http
        self.refused_retry_secs = refused_retry_secs
        self._clock = clock
        self.state: dict[str, _WorkerState] = {}
        self._logged: set[tuple[str, ...]] = set()

    def log_once(self, event: str, key: tuple[str, ...], **kw: object) -> None:
        if (event, *key) in self._logged:
            return
        if len(self._logged) > 10_000:  # bounded: a churning fleet must not grow it forever
            self._logged.clear()
        self._logged.add((event, *key))
        # What a worker answered is in these fields: never its echo of the key.
        log.warning(event, **{k: logs.redact(v) for k, v in kw.items()})

    def _credential_for(self, base: str) -> Mapping[str, str] | None:
        """The credential headers for a request to worker ``base``: none over plain http
        unless allowed (start-up refuses such a worker set, so this is the last guard)."""
        if self._headers is None or sends_credential(base, self.credential_over_http):
            return self._headers
        self.log_once("worker_credential_withheld", (base,), worker=base,
                      reason="the workers' key goes over TLS (https://) only",
                      hint="give the worker as https://, or allow plain http with "
                           "--worker-auth-allow-http")
        return None

    def _problem(self, base: str, p: ProbeProblem, problems: list[tuple[str, str]]) -> None:
        """Note a refusal for the metric; log it once per worker, endpoint and reason."""
        if (p.endpoint, p.reason) not in problems:
            problems.append((p.endpoint, p.reason))
        effect = ("the saturation guard cannot read this worker" if p.endpoint == "/metrics"
                  else f"it counts for the last cap read from it, else "
                       f"{UNREAD_WORKER_CAPACITY} slot")
        self.log_once(p.event, (base, p.endpoint, p.reason), worker=base, endpoint=p.endpoint,
                      reason=p.reason, hint=p.hint, effect=effect,
                      retry_secs=self.refused_retry_secs)

    async def _get(self, base: str, path: str, st: _WorkerState,
                   limit: int = PROBE_BODY_LIMIT) -> tuple[int, bytes]:
        """GET ``base + path`` with the credential; a refusal raises :class:`Refused` and
        is remembered, so the path is not asked again for ``refused_retry_secs``."""
        held = st.refused.get(path)
        if held is not None:
            if self._clock() < held[1]:
                raise held[0]
            del st.refused[path]
        status, body = await http_get(self._session(), base + path, self.timeout, limit,
                                      self._credential_for(base))
        if status in REFUSALS:
            refusal = Refused(path, status)
            st.refused[path] = (refusal, self._clock() + self.refused_retry_secs)
            raise refusal
        return status, body

    async def _get_json(self, base: str, path: str, st: _WorkerState) -> object:
        status, body = await self._get(base, path, st)
        if status in (404, 405):
            raise NotFound(path)
        if status != 200:
            raise BadStatus(f"HTTP {status} from {path}")
        return json.loads(body)

    async def probe(self, base_url: str) -> WorkerProbe:
        base = base_url.rstrip("/")
        try:
            status, _ = await http_get(self._session(), f"{base}/health", self.timeout,
                                       headers=self._credential_for(base))
        except PROBE_ERRORS as exc:
            self.state.pop(base, None)
            kind = ProbeStatus.INCONCLUSIVE if is_local_failure(exc) else ProbeStatus.UNHEALTHY
            return WorkerProbe(base_url, kind)
        if status in (401, 403):
            # It answers but will not say: counting it unhealthy could raise capacity to
            # the fallback (1024 before any worker was read). Up, cap unknown: one slot.
            refused: list[tuple[str, str]] = []
            self._problem(base, Refused("/health", status), refused)
            return WorkerProbe(base_url, ProbeStatus.HEALTHY, self.engine, None,
                               cap_failed=True, problems=tuple(refused))
        if status != 200:  # llama.cpp answers 503 while loading: detect again afterwards
            self.state.pop(base, None)
            return WorkerProbe(base_url, ProbeStatus.UNHEALTHY)
        st = self.state.setdefault(base, _WorkerState())
        problems: list[tuple[str, str]] = []
        engine, cap, failed = await self._capacity(base, st, problems)
        if engine == "vllm":
            await self._vllm_kv(base, st)
        running = waiting = None
        if self.saturation_guard and engine in SATURATION_METRICS:
            running, waiting = await self._saturation(base, engine, st, problems)
        return WorkerProbe(base_url, ProbeStatus.HEALTHY, engine, cap, running, waiting,
                           failed, tuple(problems), st.context, st.kv_tokens)

    def _kv_read(self, base: str, engine: str, st: _WorkerState,
                 read: tuple[int | None, str]) -> None:
        """Keep a KV capacity read; one that is not a size is logged once and counts none."""
        st.kv_tokens, why = read
        if why:
            self.log_once("worker_kv_capacity_unreadable", (base, engine, why), worker=base,
                          engine=engine, reason=why,
                          effect="the worker counts no KV tokens (tokens.admit_by_kv)")

    async def _vllm_kv(self, base: str, st: _WorkerState) -> None:
        """vLLM's cache size, from /metrics (a large body: read again every
        :data:`KV_REFRESH_SECS`; the size changes only with a restart, which a failed
        health probe notices and which forgets it)."""
        now = self._clock()
        if now < st.kv_due:
            return
        st.kv_due = now + KV_REFRESH_SECS
        try:
            status, raw = await self._get(base, "/metrics", st, METRICS_BODY_LIMIT)
        except ProbeProblem as p:
            self.log_once("worker_kv_capacity_unreadable", (base, "vllm", p.reason),
                          worker=base, engine="vllm", reason=f"/metrics: {p.reason}",
                          hint=p.hint, effect="the worker counts no KV tokens")
            return
        except PROBE_ERRORS as exc:
            if not is_local_failure(exc):
                self.log_once("worker_kv_capacity_unreadable", (base, "vllm", "error"),
                              worker=base, engine="vllm",
                              reason=f"/metrics: {type(exc).__name__}: {exc}"[:200])
            st.kv_due = now  # try again next round; the last size read holds meanwhile
            return
        if status == 200:
            self._kv_read(base, "vllm", st, vllm_kv_tokens(raw.decode("utf-8", "replace")))

    async def _recognise(self, base: str, st: _WorkerState,
                         problems: list[tuple[str, str]]) -> str | None:
        """The worker's engine (auto), recognising it once; None while it cannot be."""
        if st.engine is not None:
            return st.engine
        if st.detect_refused is not None:
            refusal, retry_at = st.detect_refused
            if self._clock() < retry_at:
                self._problem(base, refusal, problems)
                return None
            st.detect_refused = None
        try:
            st.engine = await self._detect(base, st)
        except Refused as r:
            st.detect_refused = (r, self._clock() + self.refused_retry_secs)
            self._problem(base, r, problems)
            return None
        if st.engine is not None:
            st.cap_answered = False
            log.info("worker_engine_detected", worker=base, engine=st.engine)
        return st.engine

    async def _capacity(self, base: str, st: _WorkerState, problems: list[tuple[str, str]],
                        redetected: bool = False) -> tuple[str, int | None, bool]:
        """(engine, cap read or None, whether the read failed rather than found none)."""
        if self.engine != "auto":
            st.engine = self.engine
        elif await self._recognise(base, st, problems) is None:
            return "auto", None, True  # recognition could not finish: counted by the safe rule
        engine = st.engine or self.engine
        failed = False
        try:
            cap, reason = await self._read_cap(base, engine, st)
            st.cap_answered = True
        except NotFound:
            if self.engine == "auto" and st.cap_answered and not redetected:
                # The endpoint that answered is gone: another engine after a restart.
                # One that never answered is not re-recognised every round.
                st.engine = None
                return await self._capacity(base, st, problems, redetected=True)
            cap, reason = None, "capacity endpoint not found"
        except ProbeProblem as p:
            self._problem(base, p, problems)
            cap, reason, failed = None, str(p), True
        except PROBE_ERRORS as exc:
            cap, reason, failed = None, f"{type(exc).__name__}: {exc}"[:200], True
        if cap is None:
            if engine == "vllm" and not failed:
                self.log_once("vllm_capacity_not_exposed", (base,), worker=base,
                              hint="vLLM exposes max_num_seqs only in dev mode; pass "
                                   "--worker-max-running-requests N (its --max-num-seqs)")
            elif not problems:
                self.log_once("worker_capacity_unreadable", (base, engine, reason), worker=base,
                              engine=engine, reason=reason,
                              rule="last cap read from it, else "
                                   + (f"{UNREAD_WORKER_CAPACITY} slot" if failed
                                      else "--worker-max-running-requests"))
        return engine, cap, failed

    async def _read_cap(self, base: str, engine: str, st: _WorkerState) -> tuple[int | None, str]:
        """The cap, or (None, reason) when the engine reports none; raises when the read
        fails or is refused."""
        # What a worker reports of its context and cache is kept from its last read that
        # answered (the cap's rule); vLLM's cache size comes from /metrics (_vllm_kv).
        if engine == "sglang":
            try:
                info = await self._get_json(base, "/server_info", st)
            except NotFound:
                info = await self._get_json(base, "/get_server_info", st)  # older SGLang
            st.context = None
            self._kv_read(base, engine, st, sglang_kv_tokens(info))
            cap, reason = sglang_cap(info)
            if cap is not None:
                return cap, ""
            try:
                loads_cap, loads_reason = sglang_loads_cap(
                    await self._get_json(base, "/v1/loads", st))
            except NotFound:
                return None, reason
            return loads_cap, f"{reason}; /v1/loads: {loads_reason}"
        if engine == "vllm":
            st.context = None
            try:
                return vllm_cap(await self._get_json(base, "/server_info?config_format=json", st))
            except NotFound:
                return None, "no /server_info (vLLM dev mode off)"
        if engine == "tgi":
            info = await self._get_json(base, "/info", st)
            st.context = tgi_context(info)
            self._kv_read(base, engine, st, tgi_kv_tokens(info))
            return field_cap("max_concurrent_requests")(info)
        if engine == "llamacpp":
            props = await self._get_json(base, "/props", st)
            if _field(props, "role") == "router":
                # Each loaded model is a child server with its own context and cache: the
                # worker as a whole reports neither.
                st.context = st.kv_tokens = None
                return await self._router_cap(base, st)
            st.router_models = ()
            st.context = llamacpp_slot_context(props)
            self._kv_read(base, engine, st, llamacpp_kv_tokens(props, st.context))
            return field_cap("total_slots")(props)
        info = await self._get_json(base, "/server_info", st)
        st.context = st.kv_tokens = None
        return field_cap("max_running_requests")(info)

    async def _router_cap(self, base: str, st: _WorkerState) -> tuple[int | None, str]:
        """llama.cpp in router mode (``--models-dir``, no ``-m``): each loaded model is a
        child server with its own slots; the worker's cap is their sum. ``autoload=false``
        so that reading a model's slots never loads it."""
        listing = _field(await self._get_json(base, "/models", st), "data")
        if not isinstance(listing, list):
            raise ValueError("router /models has no data[]")
        loaded = tuple(m["id"] for m in listing
                       if isinstance(m, dict) and isinstance(m.get("id"), str)
                       and _field(m.get("status"), "value") == "loaded")
        st.router_models = loaded
        if not loaded:
            raise NoLoadedModel()
        total = 0
        for name in loaded:
            cap, reason = field_cap("total_slots")(
                await self._get_json(base, f"/props?{_model_query(name)}", st))
            if cap is None:
                raise ValueError(f"model {name[:80]!r}: {reason}")
            total += cap
        return min(total, MAX_WORKER_CAPACITY), ""

    async def _detect(self, base: str, st: _WorkerState) -> str | None:
        """Recognise the engine from what it serves; None if a probe could not finish.

        Order: the endpoint three engines share first (``/server_info``: SGLang, vLLM
        in dev mode, generic, told apart by their fields), then SGLang's older name,
        then the fields only TGI (``/info``) and llama.cpp (``/props``: ``total_slots``,
        or ``role: router`` in router mode) serve, and vLLM's metric names last:
        ``/metrics`` is the largest body and the only marker a vLLM outside dev mode
        has. Anything else is generic. Raises :class:`Refused` when nothing was
        recognised and a path refused the probe: the engine cannot be told.
        """
        probes: list[tuple[str, Callable[[object], str | None]]] = [
            ("/server_info?config_format=json", recognise_server_info),
            ("/get_server_info", lambda b: "sglang" if recognise_server_info(b) else None),
            ("/info", lambda b: "tgi" if _has(b, "max_concurrent_requests") else None),
            ("/props", lambda b: "llamacpp" if _has(b, "total_slots")
             or _field(b, "role") == "router" else None),
        ]
        refused: Refused | None = None
        for path, recognise in probes:
            try:
                found = recognise(await self._get_json(base, path, st))
            except NotFound:
                continue
            except Refused as r:
                refused = refused or r
                continue
            except PROBE_ERRORS as exc:
                if is_local_failure(exc):
                    return None
                continue  # an error or a non-JSON body: not this engine
            if found is not None:
                return found
        try:
            status, body = await self._get(base, "/metrics", st, METRICS_BODY_LIMIT)
            if status == 200 and any(ln.startswith("vllm:")
                                     for ln in body.decode("utf-8", "replace").splitlines()):
                return "vllm"
        except Refused as r:
            refused = refused or r
        except PROBE_ERRORS as exc:
            if is_local_failure(exc):
                return None
        if refused is not None:
            raise refused
        return "generic"

    async def _saturation(self, base: str, engine: str, st: _WorkerState,
                          problems: list[tuple[str, str]]) -> tuple[int | None, int | None]:
        """(running, waiting) from one request (one per loaded model of a llama.cpp
        router), or (None, None) if not readable."""
        try:
            if engine == "sglang" and not st.loads_missing:
                try:
                    body = _dict(await self._get_json(base, "/v1/loads", st))
                except NotFound:
                    st.loads_missing = True  # read /metrics from the next round on
                    return None, None
                loads = body.get("loads") if body is not None else None
                if isinstance(loads, list) and loads and all(isinstance(x, dict) for x in loads):
                    running = [_count(_num(x.get("num_running_reqs"))) for x in loads]
                    waiting = [_count(_num(x.get("num_waiting_reqs"))) for x in loads]
                    if None not in running and None not in waiting:
                        return (sum(r for r in running if r is not None),
                                sum(w for w in waiting if w is not None))
                return None, None
            running_names, waiting_names = SATURATION_METRICS[engine]
            paths = ([f"/metrics?{_model_query(m)}" for m in st.router_models]
                     if engine == "llamacpp" and st.router_models else ["/metrics"])
            sums: dict[str, float] = {}
            for path in paths:
                status, raw = await self._get(base, path, st, METRICS_BODY_LIMIT)
                if status != 200:
                    return None, None
                for name, value in prometheus_sums(raw.decode("utf-8", "replace"),
                                                   (*running_names, *waiting_names)).items():
                    sums[name] = sums.get(name, 0.0) + value
        except ProbeProblem as p:
            self._problem(base, p, problems)
            return None, None
        except PROBE_ERRORS as exc:
            self.log_once("worker_saturation_unreadable", (base,), worker=base,
                          error=f"{type(exc).__name__}: {exc}"[:200])
            return None, None

        def pick(names: tuple[str, ...]) -> int | None:
            found = [sums[n] for n in names if n in sums]
            return _count(sum(found)) if found else None

        run_count, wait_count = pick(running_names), pick(waiting_names)
        if run_count is None or wait_count is None:
            # A /metrics without the engine's gauges: the guard would do nothing unseen.
            self.log_once("worker_saturation_unreadable", (base,), worker=base,
                          error=f"/metrics has no {' or '.join(running_names + waiting_names)}")
        return run_count, wait_count


def _model_query(name: str) -> str:
    return urllib.parse.urlencode({"model": name, "autoload": "false"})


def _num(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


async def probe_worker(session: aiohttp.ClientSession, base_url: str, timeout: float,
                       engine: str = "generic") -> int | None:
    """One-off probe: the worker's capacity if healthy, else None. Not read: the
    default when the engine reports none, one slot when the read failed."""
    prober = WorkerProber(lambda: session, engine=engine, timeout=timeout,
                          saturation_guard=False)
    p = await prober.probe(base_url)
    if p.status is not ProbeStatus.HEALTHY:
        return None
    if p.cap is not None:
        return p.cap
    return UNREAD_WORKER_CAPACITY if p.cap_failed else DEFAULT_WORKER_CAPACITY


def routable_hosts(clusters_json: object, cluster: str, scheme: str = "http") -> list[str]:
    """Base URLs (``scheme``://addr:port, ``--envoy-cluster-scheme``) of the hosts Envoy
    would route to in ``cluster``."""
    out: list[str] = []
    if not isinstance(clusters_json, dict):
        return out
    for status in clusters_json.get("cluster_statuses", []):
        if not isinstance(status, dict) or status.get("name") != cluster:
            continue
        for host in status.get("host_statuses", []):
            sock = host.get("address", {}).get("socket_address", {})
            addr, port = sock.get("address"), sock.get("port_value")
            if not addr or not port:
                continue
            hs = host.get("health_status", {})
            failed = any(v is True for k, v in hs.items() if k != "eds_health_status")
            eds = hs.get("eds_health_status")
            if failed or eds not in (None, "HEALTHY"):
                continue
            out.append(f"{scheme}://{addr}:{port}")
    return out


class CapacityMonitor:
    """Polls the workers and reports capacity changes."""

    def __init__(
        self,
        *,
        worker_urls: Sequence[str],
        envoy_admin_url: str | None,
        envoy_cluster: str,
        interval: float,
        timeout: float,
        fallback: int,
        override: int | None,
        on_change: Callable[[CapacityReading], None],
        engine: str = "auto",
        default_cap: int = DEFAULT_WORKER_CAPACITY,
        saturation_guard: bool = False,
        clock: Callable[[], float] | None = None,
        credential: Mapping[str, str] | None = None,
        credential_over_http: bool = False,
        envoy_cluster_scheme: str = "http",
        pool: str | None = None,
    ) -> None:
        # With pools (sidecar.pools) every line of this monitor names its pool.
        self._log = log if pool is None else log.bind(pool=pool)
        self.worker_urls = list(worker_urls)
        self.envoy_admin_url = envoy_admin_url
        self.envoy_cluster = envoy_cluster
        self.envoy_cluster_scheme = envoy_cluster_scheme
        self.interval = interval
        self.timeout = timeout
        self.fallback = fallback
        self.override = override
        self.on_change = on_change
        self.last: CapacityReading | None = None
        self._session: aiohttp.ClientSession | None = None
        self.policy = CapacityPolicy(fallback=fallback, default_cap=default_cap,
                                     saturation_guard=saturation_guard,
                                     clock=clock or time.monotonic)
        self.prober = WorkerProber(lambda: self.session, engine=engine, timeout=timeout,
                                   saturation_guard=saturation_guard, credential=credential,
                                   credential_over_http=credential_over_http,
                                   clock=clock or time.monotonic)

    @property
    def session(self) -> aiohttp.ClientSession:
        """Created on first use: aiohttp sessions belong to the running event loop."""
        if self._session is None:
            self._session = new_session()
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _workers(self) -> list[str] | None:
        """The worker set; None when Envoy's admin API could not be read (set unknown)."""
        if self.envoy_admin_url is None:
            return self.worker_urls
        url = self.envoy_admin_url.rstrip("/") + "/clusters?format=json"
        try:
            status, body = await http_get(self.session, url, self.timeout,
                                           CLUSTERS_BODY_LIMIT)
            if status == 200:
                return routable_hosts(json.loads(body), self.envoy_cluster,
                                      self.envoy_cluster_scheme)
            self._log.warning("envoy_admin_unreachable", url=url, status=status)
        except PROBE_ERRORS as exc:
            self._log.warning("envoy_admin_unreachable", url=url, error=str(exc)[:200])
        return None

    async def read(self) -> CapacityReading:
        if self.override is not None:
            return CapacityReading(self.override, "override", 0, 0)
        urls = await self._workers()
        if urls is None:
            return self.policy.decide(None)
        probes = await asyncio.gather(*(self.prober.probe(u) for u in urls))
        return self.policy.decide(probes)

    async def poll_once(self) -> CapacityReading:
        reading = await self.read()
        was_held = self.last is not None and self.last.held
        if reading.held and not was_held:
            self._log.warning("capacity_held", capacity=reading.capacity, workers=reading.total,
                              reason="no probe could complete (a sidecar-side failure: local "
                                     "timeout, out of file descriptors); last reading kept")
        elif was_held and not reading.held:
            self._log.info("capacity_hold_ended", held_secs=round(self.policy.last_hold_secs, 3))
        if reading.excess and not (self.last is not None and self.last.excess):
            self._log.warning("engine_excess", excess=reading.excess, capacity=reading.capacity,
                              reason="the engines run or queue more requests than the sidecar "
                                     "holds (not admitted by it, or released while still running); "
                                     "capacity is lowered by as many until they are gone")
        elif self.last is not None and self.last.excess and not reading.excess:
            self._log.info("engine_excess_gone")
        changed = reading != self.last
        if changed:
            self._log.info("capacity_changed", capacity=reading.capacity, source=reading.source,
                           healthy_workers=reading.healthy, workers=reading.total,
                           excess=reading.excess,
                           previous=self.last.capacity if self.last else None)
        self.last = reading
        if changed:
            self.on_change(reading)
        return reading

    async def run(self) -> None:
        if self.override is not None:
            return
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.poll_once()
            except Exception:  # keep polling whatever one round did
                self._log.exception("capacity_poll_failed")
