"""Admission traces (sidecar.tracing), in process: the flags, the sampler, and a runtime
over real gRPC exporting to a real OTLP receiver (devtools.otlp).

- Flags: an endpoint with a user, a path or an odd scheme, a ratio outside 0..1, a headers
  file that is malformed, without an endpoint or over plaintext are start-up errors that
  quote no secret; the tokens stay out of the settings' repr.
- The sampler (parent-based): a sampled ``traceparent`` always gets a span, an unsampled
  one never, an absent or invalid one starts a trace kept at the ratio (counted against
  the binomial bounds, seed printed).
- Each decision's span through the real handler: admitted, queued then admitted, queue
  full (429), queue timeout (503), rate limited, cancelled by the client, a named pool, an
  unknown pool (429, or allowed under --shadow with the would-be answer); the tenant
  redacted as logs redact it, the admission id only as its tag; a fleet pool's
  coordination state, ``ok`` and then ``degraded`` with its valkey-server paused.
- The receiver stalled (accepts, never answers) or down: thousands of sampled Checks still
  answer, none waits for an export, the SDK's per-span warnings are throttled to a few
  lines, and stop() returns within its flush bound. With the receiver healthy, stop()
  flushes the last spans. Headers from the file reach a TLS receiver, and no log line
  shows them.
"""

from __future__ import annotations

import asyncio
import os
import random
import secrets
import shutil
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
from google.rpc import code_pb2
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_ON, ParentBased
from structlog.testing import capture_logs

from devtools.otlp import OtlpReceiver
from sidecar import logs, responses, tracing
from sidecar.app import Runtime, build_runtime
from sidecar.classes import PriorityClass
from sidecar.config import ConfigError, parse_settings
from tests.grpc_client import EnvoyStandIn, admission_id
from tests.otlp_support import receiver, span_of
from tests.test_app import free_port
from tests.test_coordination_security import make_certs

__all__ = ["receiver"]  # a fixture, used by name

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT_ID = "b7ad6b7169203331"


def traceparent(sampled: bool, trace_id: str = TRACE_ID, parent: str = PARENT_ID) -> str:
    return f"00-{trace_id}-{parent}-{'01' if sampled else '00'}"


def new_trace_id() -> str:
    return secrets.token_hex(16)


# ------------------------------------------------------------------------------ flags


@pytest.mark.parametrize(("argv", "message"), [
    (["--otlp-endpoint", "grpc://127.0.0.1:4317"], "must be http://HOST:PORT or https://"),
    (["--otlp-endpoint", "http://127.0.0.1"], "must be http://HOST:PORT or https://"),
    (["--otlp-endpoint", "http://127.0.0.1:notaport"], "--otlp-endpoint"),
    (["--otlp-endpoint", "http://127.0.0.1:0"], "port must be 1..65535"),
    (["--otlp-endpoint", "http://127.0.0.1:4317/v1/traces"], "no path or query"),
    (["--otlp-endpoint", "https://user:hunter2-secret@127.0.0.1:4317"],
     "put a token in --otlp-headers-file"),
    (["--trace-sample-ratio", "1.5"], "from 0 to 1"),
    (["--trace-sample-ratio", "-0.1"], "from 0 to 1"),
    (["--trace-sample-ratio", "nan"], "from 0 to 1"),
])
def test_bad_tracing_flags_are_start_up_errors(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_settings(argv)
    assert message in str(e.value)
    assert "hunter2" not in str(e.value)


TOKEN = "tok-" + secrets.token_hex(12)


@pytest.mark.parametrize(("content", "endpoint", "message"), [
    (f"authorization: Bearer {TOKEN}\n", None, "needs --otlp-endpoint"),
    (f"authorization: Bearer {TOKEN}\n", "http://127.0.0.1:4317", "over plaintext"),
    (f"authorization Bearer {TOKEN}\n", "https://127.0.0.1:4317", "line 1 is not 'name: value'"),
    (f"# c\n\nx-ok: 1\nbad name: {TOKEN}\n", "https://127.0.0.1:4317", "line 4 is not"),
    ("# only a comment\n", "https://127.0.0.1:4317", "no header in it"),
    (f"authorization: Bearer {TOKEN}\x01\n", "https://127.0.0.1:4317", "control character"),
    (f"authorization: Bearer {TOKEN}é\n", "https://127.0.0.1:4317", "not ASCII"),
    ("x: " + "a" * 9000, "https://127.0.0.1:4317", "longer than 8192 bytes"),
], ids=["no-endpoint", "plaintext", "no-colon", "bad-name", "only-comment", "control",
        "not-ascii", "too-long"])  # fixed ids: the random token must not name a test
def test_a_bad_headers_file_is_refused_without_quoting_it(
        tmp_path: Path, content: str, endpoint: str | None, message: str) -> None:
    f = tmp_path / "headers"
    f.write_bytes(content.encode())
    argv = ["--otlp-headers-file", str(f)] + ([] if endpoint is None else
                                               ["--otlp-endpoint", endpoint])
    with pytest.raises(ConfigError) as e:
        parse_settings(argv)
    assert message in str(e.value)
    assert TOKEN not in str(e.value) and "aaaaaaaa" not in str(e.value)


def test_the_headers_file_is_read_and_kept_out_of_the_repr(tmp_path: Path) -> None:
    f = tmp_path / "headers"
    f.write_text(f"# vendor token\nAuthorization: Bearer {TOKEN}\n\nX-Scope-OrgID:  acme \n")
    s = parse_settings(["--otlp-endpoint", "https://collector.example:4317",
                        "--otlp-headers-file", str(f)])
    assert s.tracing.otlp_headers == (("authorization", f"Bearer {TOKEN}"),
                                      ("x-scope-orgid", "acme"))
    assert TOKEN not in repr(s)
    assert parse_settings([]).tracing.otlp_endpoint is None  # off by default


def test_off_or_ratio_zero_builds_no_tracing() -> None:
    assert tracing.Tracing.build(parse_settings([]).tracing, instance="x") is None
    zero = parse_settings(["--otlp-endpoint", "http://127.0.0.1:4317",
                           "--trace-sample-ratio", "0"])
    assert tracing.Tracing.build(zero.tracing, instance="x") is None


# ---------------------------------------------------------------------------- sampler


def sdk_tracer() -> tuple[trace.Tracer, InMemorySpanExporter]:
    """The SDK as sidecar.tracing sets it up, ending in the SDK's in-memory exporter."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=ParentBased(ALWAYS_ON), shutdown_on_exit=False)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider.get_tracer("test"), exporter


def test_parent_based_sampling_follows_the_traceparent() -> None:
    tracer, exported = sdk_tracer()
    # A ratio so small that no root is ever kept: only the parent can decide.
    t = tracing.AdmissionTracer(tracer, 1e-12)
    for _ in range(50):
        tid = new_trace_id()
        span = t.start({"traceparent": traceparent(True, tid), "tracestate": "vendor=x"})
        assert span is not None, "a sampled parent must always be followed"
        span.close()
        got = exported.get_finished_spans()[-1]
        assert f"{got.context.trace_id:032x}" == tid
        assert got.parent is not None and f"{got.parent.span_id:016x}" == PARENT_ID
        assert got.context.trace_state.get("vendor") == "x"
        assert t.start({"traceparent": traceparent(False, tid)}) is None
        assert t.start({}) is None
        # Invalid (all-zero trace id, bad version, garbage): no parent, a root: not kept.
        for bad in (traceparent(True, "0" * 32), "ff-" + traceparent(True)[3:], "garbage"):
            assert t.start({"traceparent": bad}) is None
    # Every span the tracer kept is one the test ended: nothing else reached the exporter.
    assert len(exported.get_finished_spans()) == 50

    always = tracing.AdmissionTracer(tracer, 1.0)
    assert always.start({"traceparent": traceparent(False)}) is None, \
        "ratio 1 still follows an unsampled parent"
    span = always.start({"traceparent": "garbage"})
    assert span is not None
    span.close()
    got = exported.get_finished_spans()[-1]
    assert got.parent is None and f"{got.context.trace_id:032x}" != "0" * 32
    with pytest.raises(ValueError):
        tracing.AdmissionTracer(tracer, 0.0)


@pytest.mark.parametrize("ratio", [0.01, 0.25])
def test_roots_are_kept_at_the_ratio(ratio: float) -> None:
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    tracer, exported = sdk_tracer()
    t = tracing.AdmissionTracer(tracer, ratio, coin=random.Random(seed).random)
    n = 20_000
    kept = 0
    for _ in range(n):
        span = t.start({"x-smg-priority": "bulk"})
        if span is not None:
            kept += 1
            span.close()
    sd = (n * ratio * (1 - ratio)) ** 0.5
    assert abs(kept - n * ratio) < 5 * sd, (kept, n * ratio, seed)
    assert len(exported.get_finished_spans()) == kept
    assert len({s.context.trace_id for s in exported.get_finished_spans()}) == kept


# ------------------------------------------------------------------- runtime + receiver

PRIORITY = """
classes:
  system: {reserved_floor: 0, queue_size: 0}
  interactive: {reserved_floor: 0, reserved_per_slot: 0.0, queue_size: 0}
  default: {reserved_per_slot: 0.0, queue_size: 1, queue_timeout_secs: 0.3}
  bulk: {queue_size: 1, queue_timeout_secs: 30}
tenant_policies:
  gold: {max_class: interactive}
"""


async def start_runtime(tmp_path: Path, receiver: OtlpReceiver, *extra: str,
                        capacity: int = 1, priority: str = PRIORITY) -> Runtime:
    yaml = tmp_path / "priority.yaml"
    yaml.write_text(priority)
    app = await build_runtime(parse_settings([
        "--priority-scheduler-enabled", "--priority-scheduler-config", str(yaml),
        "--worker-capacity-override", str(capacity), "--grpc-listen", f"127.0.0.1:{free_port()}",
        "--http-listen", f"127.0.0.1:{free_port()}", "--log-format", "json",
        "--otlp-endpoint", receiver.endpoint, *extra]))
    await app.serve()
    return app


async def test_each_decision_gets_its_span_with_its_attributes(
        tmp_path: Path, receiver: OtlpReceiver) -> None:
    secret = "sk-" + secrets.token_hex(10)
    logs.register_secret(secret)  # as the workers' key is: no span may show it either
    app = await start_runtime(tmp_path, receiver, "--trace-sample-ratio", "1e-12",
                              "--rate-limit-tokens-per-second", "0.001",
                              "--max-concurrent-requests", "6")
    envoy = EnvoyStandIn(app.grpc_port)
    ids = {k: new_trace_id() for k in ("held", "queued", "full", "timeout", "cancelled",
                                       "limited", "untraced")}

    def hdrs(key: str, priority: str = "bulk", **more: str) -> dict[str, str]:
        return {"traceparent": traceparent(key != "untraced", ids[key]),
                "x-smg-priority": priority, **more}

    try:
        held = await envoy.check(hdrs("held", "system", **{"x-smg-tenant": "gold"}))
        assert held.status.code == code_pb2.OK
        held_id = admission_id(held)
        queued = asyncio.ensure_future(envoy.check(hdrs("queued")))
        await until(lambda: app.pools["default"].controller.snapshot().classes[
            cls_of("bulk")].queue_depth == 1, "the bulk request to queue")
        full = await envoy.check(hdrs("full", **{"x-smg-tenant": f"acme-{secret}"}))
        assert full.status.code != code_pb2.OK and full.denied_response.status.code == 429
        timeout = await envoy.check(hdrs("timeout", "default"))
        assert timeout.denied_response.status.code == 503
        cancelled = envoy.check(hdrs("cancelled", "default"))
        await until(lambda: app.pools["default"].controller.snapshot().classes[
            cls_of("default")].queue_depth == 1, "the default request to queue")
        cancelled.cancel()
        await envoy.log((held_id, "end"))  # the held slot is released: queued is admitted
        admitted = await asyncio.wait_for(queued, 10)
        assert admitted.status.code == code_pb2.OK
        # The bucket (6 tokens, a trickle of refill) has 6 - 4 left: drain it.
        answers = [await envoy.check(hdrs("untraced", "interactive")) for _ in range(3)]
        limited = await envoy.check(hdrs("limited", "interactive"))
        assert limited.denied_response.status.code == 429, answers
        await envoy.log((admission_id(admitted), "end"))

        spans = await receiver.wait_for(lambda s: len(s) >= 6, 15, "six decisions' spans")
        for s in spans:
            assert s.name == tracing.SPAN_NAME and s.parent_span_id == PARENT_ID
            assert s.kind == 2  # SERVER
            assert set(s.attributes) <= set(tracing.ATTRIBUTES), s.attributes
            assert s.resource["service.name"] == tracing.SERVICE_NAME
            assert not any(secret[:8] in str(v) for v in s.attributes.values())
            assert s.attributes["smg.outcome"] in tracing.OUTCOMES
            assert s.attributes["smg.pool"] == "default"
            assert s.attributes["smg.legacy"] is False
            assert "smg.coordination.state" not in s.attributes  # no fleet
        assert not [s for s in spans if s.trace_id == ids["untraced"]]

        a = span_of(spans, ids["held"]).attributes
        assert a["smg.outcome"] == "admitted" and a["smg.queued"] is False
        assert a["smg.class.requested"] == "system" and a["smg.class.effective"] == "interactive"
        assert a["smg.tenant"] == "gold"
        assert a["smg.admission.tag"] == logs.id_tag(held_id)
        assert held_id not in str(spans)  # the full id is never in a span

        q = span_of(spans, ids["queued"])
        assert q.attributes["smg.outcome"] == "admitted" and q.attributes["smg.queued"] is True
        assert q.attributes["smg.tenant"] == "anonymous"
        assert q.attributes["smg.admission.tag"] == logs.id_tag(admission_id(admitted))
        # The span covers the wait: it ends at the answer, after the queued time.
        assert q.attributes["smg.queue.wait_seconds"] > 0
        assert q.duration >= q.attributes["smg.queue.wait_seconds"]

        f = span_of(spans, ids["full"]).attributes
        assert (f["smg.outcome"], f["http.response.status_code"], f["smg.error_code"]) == (
            "rejected_queue_full", 429, "scheduler_queue_full")
        assert "smg.admission.tag" not in f and f["smg.class.effective"] == "bulk"
        assert f["smg.tenant"] == f"acme-{logs.REDACTED}"  # as a log line shows it

        t = span_of(spans, ids["timeout"])
        assert (t.attributes["smg.outcome"], t.attributes["http.response.status_code"],
                t.attributes["smg.error_code"]) == (
            "rejected_queue_timeout", 503, "scheduler_queue_timeout")
        assert t.attributes["smg.queue.wait_seconds"] >= 0.3 and t.duration >= 0.3

        c = span_of(spans, ids["cancelled"]).attributes
        assert c["smg.outcome"] == "client_cancelled" and "http.response.status_code" not in c

        r = span_of(spans, ids["limited"]).attributes
        assert (r["smg.outcome"], r["http.response.status_code"], r["smg.error_code"]) == (
            "rate_limited", 429, "scheduler_queue_full")
        assert len(spans) == 6
    finally:
        await envoy.close()
        await app.stop()


async def test_a_token_budget_refusal_gets_its_span(
        tmp_path: Path, receiver: OtlpReceiver) -> None:
    # Refused before admission by the tenant's token budget: its own outcome and code.
    app = await start_runtime(tmp_path, receiver, priority=PRIORITY + (
        "  acme: {budgets: {day: 50}}\ntokens: {default_max_tokens: 10}\n"))
    envoy = EnvoyStandIn(app.grpc_port)
    trace = new_trace_id()
    try:
        over = await envoy.check({"traceparent": traceparent(True, trace),
                                  "x-smg-tenant": "acme", "content-length": "4000"})
        assert over.denied_response.status.code == 429
        spans = await receiver.wait_for(lambda s: len(s) >= 1, 15, "the refusal's span")
        a = span_of(spans, trace).attributes
        assert (a["smg.outcome"], a["http.response.status_code"], a["smg.error_code"]) == (
            "over_budget", 429, responses.OVER_BUDGET_CODE)
        assert a["smg.outcome"] in tracing.OUTCOMES and a["smg.tenant"] == "acme"
    finally:
        await envoy.close()
        await app.stop()


def cls_of(name: str) -> PriorityClass:
    cls = PriorityClass.from_name(name)
    assert cls is not None
    return cls


async def until(cond: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


N_FLOOD = tracing.MAX_QUEUE_SPANS + tracing.MAX_QUEUE_SPANS // 2


# Seconds of real time each (the flood, the exporter's failing tries, stop's flush): the
# whole suite's, not the inner loop's (tests/tiers.py).
@pytest.mark.external
@pytest.mark.parametrize("fault", ["stalled", "down"])
async def test_a_receiver_that_hangs_or_is_down_never_holds_a_check(
        tmp_path: Path, receiver: OtlpReceiver, fault: str) -> None:
    """Thousands of sampled Checks while the receiver accepts and never answers (or is
    gone): every Check answers at once, the queue stays bounded (spans are dropped, not
    held), the SDK's warnings come as a few throttled lines, and stop() keeps its bound."""
    app = await start_runtime(tmp_path, receiver, "--trace-sample-ratio", "1",
                              capacity=1_000_000)
    envoy = EnvoyStandIn(app.grpc_port)
    try:
        # One span through first: the exporter's channel is up before the fault.
        assert (await envoy.check({"x-smg-priority": "bulk"})).status.code == code_pb2.OK
        await receiver.wait_for(lambda s: len(s) == 1, 10, "the first span")
        if fault == "stalled":
            receiver.stall()
        else:
            await receiver.stop()
        slowest = 0.0
        with capture_logs() as captured:
            sem = asyncio.Semaphore(64)

            async def check() -> None:
                nonlocal slowest
                async with sem:
                    t0 = time.monotonic()
                    r = await envoy.check({"x-smg-priority": "bulk"})
                    slowest = max(slowest, time.monotonic() - t0)
                    assert r.status.code == code_pb2.OK

            t0 = time.monotonic()
            await asyncio.gather(*(check() for _ in range(N_FLOOD)))
            flood = time.monotonic() - t0
            # Long enough for the exporter to try (and for its retries to fail) a few times.
            await asyncio.sleep(2 * tracing.SCHEDULE_DELAY_MS / 1000)
            stop_t0 = time.monotonic()
            await app.stop()
            stopped_in = time.monotonic() - stop_t0
        print(f"{fault}: {N_FLOOD} Checks in {flood:.1f} s, slowest {slowest * 1000:.0f} ms, "
              f"stop {stopped_in:.2f} s")
        # No Check waited for an export: an export to a hung receiver takes
        # EXPORT_TIMEOUT_SECS before it gives up.
        assert slowest < tracing.EXPORT_TIMEOUT_SECS
        assert stopped_in < tracing.SHUTDOWN_FLUSH_SECS + 3.0
        elapsed = time.monotonic() - t0
        problems = [e for e in captured if e["event"] == "trace_export_problem"]
        kinds = Counter(e["message"].split(" ")[0] for e in problems)
        print(f"{len(problems)} trace_export_problem lines in {elapsed:.1f} s: {kinds}")
        assert problems, "the failed exports and dropped spans are told"
        if fault == "stalled":  # (down, each export fails at once and takes its batch along)
            assert "Queue" in kinds, "the spans dropped from the full queue are told"
        # Throttled: per message kind, one line per 10 s, however many spans were dropped.
        per_kind = 1 + int(elapsed // tracing.LOG_INTERVAL_SECS)
        assert max(kinds.values()) <= per_kind and len(kinds) <= 4, problems
        assert not [e for e in captured if e["event"] != "trace_export_problem"
                    and e.get("log_level") in ("warning", "error")
                    and e["event"] != "trace_flush_incomplete"], captured
    finally:
        await envoy.close()
    if fault == "stalled":
        receiver.resume()
    got = len(receiver.spans)
    # Bounded: at most what fits the queue (plus a batch in flight) ever reaches it.
    assert got <= 1 + tracing.MAX_QUEUE_SPANS + tracing.MAX_BATCH_SPANS, got


async def test_stop_flushes_the_last_spans(tmp_path: Path, receiver: OtlpReceiver) -> None:
    app = await start_runtime(tmp_path, receiver, "--trace-sample-ratio", "1",
                              capacity=1_000)
    envoy = EnvoyStandIn(app.grpc_port)
    try:
        for _ in range(20):
            assert (await envoy.check({"x-smg-priority": "bulk"})).status.code == code_pb2.OK
    finally:
        await envoy.close()
        await app.stop()  # before the exporter's next scheduled batch
    await receiver.wait_for(lambda s: len(s) == 20, 5, "the 20 spans flushed at stop")


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl CLI not installed")
async def test_headers_reach_a_tls_receiver_and_no_log_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    await asyncio.to_thread(make_certs, tmp_path)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_CERTIFICATE", str(tmp_path / "ca.pem"))
    token = "Bearer tls-" + secrets.token_hex(12)
    (tmp_path / "headers").write_text(f"Authorization: {token}\n")
    receiver = OtlpReceiver(tls=((tmp_path / "srv.pem").read_bytes(),
                                 (tmp_path / "srv.key").read_bytes()))
    await receiver.start()
    assert receiver.endpoint.startswith("https://")
    try:
        with capture_logs() as captured:
            app = await start_runtime(tmp_path, receiver, "--trace-sample-ratio", "1",
                                      "--otlp-headers-file", str(tmp_path / "headers"))
            envoy = EnvoyStandIn(app.grpc_port)
            try:
                r = await envoy.check({"x-smg-priority": "bulk",
                                       "x-smg-tenant": f"t-{token[7:]}"})
                assert r.status.code == code_pb2.OK
                await receiver.wait_for(lambda s: len(s) == 1, 10, "the span, over TLS")
            finally:
                await envoy.close()
                await app.stop()
        assert receiver.metadata[0]["authorization"] == token
        assert token[7:15] not in str(receiver.spans)  # the tenant quoting it: redacted
        assert token[7:15] not in str([logs.redact(e) for e in captured])
        assert token[7:15] not in str(captured)
    finally:
        await receiver.stop()


async def test_a_grpc_client_cancel_on_an_unsampled_check_changes_nothing(
        tmp_path: Path, receiver: OtlpReceiver) -> None:
    """The traced handler's untraced path (sampler says no) admits and cancels as the
    untraced handler does: nothing leaks, no span."""
    app = await start_runtime(tmp_path, receiver, "--trace-sample-ratio", "1e-12")
    envoy = EnvoyStandIn(app.grpc_port)
    try:
        first = await envoy.check({"x-smg-priority": "bulk"})
        waiting = envoy.check({"x-smg-priority": "bulk"})
        await until(lambda: app.pools["default"].controller.snapshot().classes[
            cls_of("bulk")].queue_depth == 1, "the bulk request to queue")
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await until(lambda: app.pools["default"].controller.snapshot().classes[
            cls_of("bulk")].queue_depth == 0, "the cancelled waiter to leave")
        await envoy.log((admission_id(first), "end"))
        await until(lambda: app.pools["default"].controller.snapshot().inflight == 0,
                    "the slot to be released")
        assert app.authz.open_checks == 0
    finally:
        await envoy.close()
        await app.stop()
    assert receiver.exports == 0


async def test_a_fleet_pool_names_its_coordination_state(
        tmp_path: Path, receiver: OtlpReceiver) -> None:
    """With --coordination-url the span says whether the ledger decided (``ok``) or the
    replica alone, within its degraded share (the server paused: ``degraded``)."""
    from devtools.valkey import ValkeyServer

    server = ValkeyServer(tmp_path / "valkey")
    server.start()
    app = None
    envoy = None
    try:
        app = await start_runtime(tmp_path, receiver, "--trace-sample-ratio", "1e-12",
                                  "--coordination-url", server.url, "--fleet-id", "traces",
                                  "--replica-id", "a", "--replica-ttl-secs", "2", capacity=4)
        fleet = app.pools["default"].fleet
        assert fleet is not None
        envoy = EnvoyStandIn(app.grpc_port)
        t_ok, t_degraded = new_trace_id(), new_trace_id()
        first = await envoy.check({"traceparent": traceparent(True, t_ok),
                                   "x-smg-priority": "bulk"})
        assert first.status.code == code_pb2.OK
        server.pause()
        await until(lambda: fleet.state == "degraded", "the replica to degrade", 10)
        second = await envoy.check({"traceparent": traceparent(True, t_degraded),
                                    "x-smg-priority": "bulk"})
        assert second.status.code == code_pb2.OK
        spans = await receiver.wait_for(lambda s: len(s) == 2, 10, "both decisions' spans")
        assert span_of(spans, t_ok).attributes["smg.coordination.state"] == "ok"
        assert span_of(spans, t_degraded).attributes["smg.coordination.state"] == "degraded"
        assert {s.attributes["smg.outcome"] for s in spans} == {"admitted"}
        server.resume()
        await until(lambda: fleet.state == "ok", "the replica back to ok", 10)
        await envoy.log((admission_id(first), "end"), (admission_id(second), "end"))
    finally:
        if envoy is not None:
            await envoy.close()
        if app is not None:
            await app.stop()
        server.stop()


@pytest.mark.parametrize("shadow", [False, True])
async def test_pools_name_themselves_and_an_unknown_pool_its_route(
        tmp_path: Path, receiver: OtlpReceiver, shadow: bool) -> None:
    """With named pools the span names the pool that decided; a route naming no pool here
    is refused 429 (``unknown_pool``), or under --shadow allowed with the would-be answer."""
    from tests.grpc_client import check_request

    app = await build_runtime(parse_settings([
        "--priority-scheduler-enabled", "--worker-urls", "http://127.0.0.1:9",
        "big=http://127.0.0.1:9", "--worker-capacity-override", "300",
        "--grpc-listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0", "--log-format", "json",
        "--otlp-endpoint", receiver.endpoint, "--trace-sample-ratio", "1",
        *(["--shadow"] if shadow else [])]))
    await app.serve()
    envoy = EnvoyStandIn(app.grpc_port)
    try:
        answers = {}
        for route in ("big", "ghost"):
            req = check_request({"x-smg-priority": "bulk",
                                 "traceparent": traceparent(True, new_trace_id())})
            req.attributes.context_extensions["smg-pool"] = route
            answers[route] = await envoy._check(req)
        assert answers["big"].status.code == code_pb2.OK
        if shadow:
            assert answers["ghost"].status.code == code_pb2.OK
        else:
            assert answers["ghost"].denied_response.status.code == 429
        spans = await receiver.wait_for(lambda s: len(s) == 2, 10, "both routes' spans")
        by_pool = {s.attributes["smg.pool"]: s.attributes for s in spans}
        assert by_pool["big"]["smg.outcome"] == "admitted"
        assert by_pool["big"]["smg.legacy"] is False
        ghost = by_pool["ghost"]
        assert "smg.legacy" not in ghost  # no pool decided
        if shadow:
            assert ghost["smg.outcome"] == "admitted"
            assert ghost["smg.shadow.outcome"] == "unknown_pool"
        else:
            assert (ghost["smg.outcome"], ghost["http.response.status_code"],
                    ghost["smg.error_code"]) == ("unknown_pool", 429, "scheduler_queue_full")
        await envoy.log((admission_id(answers["big"]), "end"))
    finally:
        await envoy.close()
        await app.stop()


def test_otlp_0_9_modules_in_place_of_opentelemetry_protos_are_a_clear_start_up_error(
        tmp_path: Path) -> None:
    """What an xds-protos installed after opentelemetry-proto leaves behind: OTLP 0.9's
    modules at opentelemetry-proto's paths (stood in for here by a ``common_pb2`` with
    0.9's message and not 1.x's, first on the path). Tracing off, the sidecar imports and
    starts as before (nothing imports those modules); with --otlp-endpoint, start-up stops
    before anything listens with one line saying how to repair it."""
    root = tmp_path / "shadow"
    pkg = root / "opentelemetry"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(
        "__path__ = __import__('pkgutil').extend_path(__path__, __name__)\n")
    v1 = pkg / "proto" / "common" / "v1"
    v1.mkdir(parents=True)
    for d in (pkg / "proto", pkg / "proto" / "common", v1):
        (d / "__init__.py").write_text("")
    (v1 / "common_pb2.py").write_text("class InstrumentationLibrary:\n    pass\n")
    repo = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{repo}"}

    def run(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, *argv], env=env, cwd=repo, capture_output=True,
                              text=True, timeout=60, check=False)

    off = run("-c", "import opentelemetry.proto.common.v1.common_pb2 as m; "
                    "assert not hasattr(m, 'InstrumentationScope'), 'not shadowed'; "
                    "import sidecar.app; from sidecar.config import parse_settings; "
                    "parse_settings(['--worker-capacity-override', '1'])")
    assert off.returncode == 0, off.stderr
    on = run("-m", "sidecar", "--otlp-endpoint", "http://127.0.0.1:4317")
    assert on.returncode == 2, on.stderr
    assert "--otlp-endpoint: opentelemetry/proto/ holds OTLP 0.9's modules" in on.stderr
    assert "pip install --force-reinstall --no-deps opentelemetry-proto==" in on.stderr
    assert len(on.stderr.strip().splitlines()) == 1, on.stderr
