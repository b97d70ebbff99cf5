"""The gRPC layer over loopback: Check, access-log completion, leases, tenant sources."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from envoy_data_plane.envoy.service.auth.v3 import CheckResponse as EdpCheckResponse

from sidecar.app import Runtime, build_runtime
from sidecar.config import DEFAULT_POOL, parse_settings
from tests.grpc_client import EnvoyStandIn, admission_id, headers_of

PRIORITY = """
classes:
  system: {reserved_floor: 0, queue_size: 1, queue_timeout_secs: 0.3}
  interactive: {reserved_floor: 0, reserved_per_slot: 0.0, queue_size: 1,
                queue_timeout_secs: 0.3}
  default: {reserved_per_slot: 0.0, queue_size: 1, queue_timeout_secs: 0.3}
  bulk: {queue_size: 2, queue_timeout_secs: 0.3}
tenant_policies:
  "auth:gold": {max_class: system}
"""


class Harness:
    def __init__(self, app: Runtime, envoy: EnvoyStandIn) -> None:
        self.app = app
        self.envoy = envoy

    def sample(self, name: str, **labels: str) -> float:
        v = self.app.metrics.registry.get_sample_value(name, labels)
        return 0.0 if v is None else v

    @property
    def inflight(self) -> int:
        return self.app.pools[DEFAULT_POOL].controller.core.snapshot().inflight


async def start(tmp_path: Path, *extra: str) -> Harness:
    cfg = tmp_path / "priority.yaml"
    cfg.write_text(PRIORITY)
    settings = parse_settings([
        "--priority-scheduler-enabled", "--priority-scheduler-config", str(cfg),
        "--grpc-listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0",
        "--worker-capacity-override", "1", "--log-format", "json", *extra])
    app = await build_runtime(settings)
    await app.serve()
    return Harness(app, EnvoyStandIn(app.grpc_port))


@pytest.fixture
async def h(tmp_path: Path) -> AsyncIterator[Harness]:
    harness = await start(tmp_path)
    yield harness
    await harness.envoy.close()
    await harness.app.stop()


def check_deny(resp: object, status: int, code: str, retry_after: str | None) -> dict[str, object]:
    denied = resp.denied_response  # type: ignore[attr-defined]
    assert resp.status.code != 0  # type: ignore[attr-defined]
    assert denied.status.code == status
    hdrs = headers_of(denied.headers)
    assert hdrs["x-smg-error-code"] == code
    assert hdrs["content-type"] == "application/json"
    assert hdrs.get("retry-after") == retry_after
    body = json.loads(denied.body)
    assert set(body) == {"error"}
    assert body["error"]["code"] == code
    assert body["error"]["param"] is None
    assert body["error"]["type"] == {429: "Too Many Requests", 503: "Service Unavailable"}[status]
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body  # type: ignore[no-any-return]


async def test_allow_carries_unguessable_id_in_metadata_and_headers(h: Harness) -> None:
    resp = await h.envoy.check({"x-smg-priority": "bulk", "x-smg-tenant": "auth:a"})
    assert resp.status.code == 0
    aid = admission_id(resp)
    assert re.fullmatch(r"[0-9a-f]{32}", aid)  # 128 random bits
    md = resp.dynamic_metadata.fields
    assert md["class"].string_value == "bulk" and md["tenant"].string_value == "auth:a"
    hdrs = headers_of(resp.ok_response.headers)
    assert hdrs == {"x-smg-admission-id": aid, "x-smg-effective-class": "bulk"}
    assert h.inflight == 1
    assert h.sample("smg_scheduler_admit_total", **{"class": "bulk", "outcome": "admitted"}) == 1
    await h.envoy.log((aid, "end"))
    assert h.inflight == 0
    assert h.sample("smg_sidecar_released_total", **{"class": "bulk", "reason": "completed"}) == 1


async def test_response_decodes_with_envoy_data_plane(h: Harness) -> None:
    # The user's named library is the reference decoder of what the fast codec builds.
    call = h.envoy.check({"x-smg-priority": "interactive"})
    resp = await call
    edp = EdpCheckResponse.FromString(resp.SerializeToString())
    aid = edp.dynamic_metadata.fields["admission_id"].string_value
    assert aid == admission_id(resp)
    assert {o.header.key: o.header.value for o in edp.ok_response.headers}[
        "x-smg-effective-class"] == "default"  # anonymous tenant: ceiling default
    # fill the queue, then a denial
    waiter = asyncio.ensure_future(h.envoy.check({}))
    await asyncio.sleep(0.05)
    denied = EdpCheckResponse.FromString((await h.envoy.check({})).SerializeToString())
    assert denied.denied_response.status.code == 429
    assert json.loads(denied.denied_response.body)["error"]["code"] == "scheduler_queue_full"
    await h.envoy.log((aid, "end"))
    second = await waiter
    await h.envoy.log((admission_id(second), "end"))
    assert h.inflight == 0


async def test_queue_full_429(h: Harness) -> None:
    first = await h.envoy.check({})
    queued = asyncio.ensure_future(h.envoy.check({}))
    await asyncio.sleep(0.05)
    resp = await h.envoy.check({})
    check_deny(resp, 429, "scheduler_queue_full", "2")
    assert h.sample("smg_scheduler_admit_total",
                    **{"class": "default", "outcome": "rejected_queue_full"}) == 1
    await h.envoy.log((admission_id(first), "end"))
    await h.envoy.log((admission_id(await queued), "end"))
    assert h.inflight == 0


async def test_queue_timeout_503(h: Harness) -> None:
    first = await h.envoy.check({})
    resp = await asyncio.wait_for(h.envoy.check({}), 5)
    body = check_deny(resp, 503, "scheduler_queue_timeout", "2")
    assert "default" in body["error"]["message"]  # type: ignore[index]
    assert h.sample("smg_scheduler_admit_total",
                    **{"class": "default", "outcome": "rejected_queue_timeout"}) == 1
    await h.envoy.log((admission_id(first), "end"))
    assert h.inflight == 0


async def test_clamp_and_unknown_value_counted(h: Harness) -> None:
    resp = await h.envoy.check({"x-smg-priority": "system", "x-smg-tenant": "auth:plain"})
    assert resp.dynamic_metadata.fields["class"].string_value == "default"
    assert h.sample("smg_scheduler_clamp_total", tenant="auth:plain", requested_class="system",
                    effective_class="default") == 1
    await h.envoy.log((admission_id(resp), "end"))
    resp = await h.envoy.check({"x-smg-priority": "system", "x-smg-tenant": "auth:gold"})
    assert resp.dynamic_metadata.fields["class"].string_value == "system"
    await h.envoy.log((admission_id(resp), "end"))
    resp = await h.envoy.check({"x-smg-priority": "urgent", "x-smg-tenant": "auth:gold"})
    assert resp.dynamic_metadata.fields["class"].string_value == "default"
    assert h.sample("smg_scheduler_unknown_priority_value_total", tenant="auth:gold") == 1
    await h.envoy.log((admission_id(resp), "end"))


async def test_cancel_while_queued_is_client_cancelled(h: Harness) -> None:
    first = await h.envoy.check({})
    call = h.envoy.check({})
    await asyncio.sleep(0.05)
    assert h.app.pools[DEFAULT_POOL].controller.core.snapshot().classes[
        next(iter(h.app.pools[DEFAULT_POOL].controller.core.snapshot().classes))].queue_depth == 0
    call.cancel()
    for _ in range(100):
        if h.sample("smg_scheduler_admit_total",
                    **{"class": "default", "outcome": "client_cancelled"}) == 1:
            break
        await asyncio.sleep(0.01)
    assert h.sample("smg_scheduler_admit_total",
                    **{"class": "default", "outcome": "client_cancelled"}) == 1
    await h.envoy.log((admission_id(first), "end"))
    assert h.inflight == 0
    snap = h.app.pools[DEFAULT_POOL].controller.snapshot()
    assert snap.classes[next(iter(snap.classes))].queue_depth == 0


async def test_forged_and_duplicate_completions_change_nothing(h: Harness) -> None:
    resp = await h.envoy.check({})
    aid = admission_id(resp)
    await h.envoy.log(("f" * 32, "end"), ("", "end"))  # unknown id; entry without metadata
    assert h.inflight == 1
    assert h.sample("smg_sidecar_completion_unmatched_total", reason="unknown") == 1
    await h.envoy.log((aid, "end"), (aid, "end"))
    assert h.inflight == 0
    assert h.sample("smg_sidecar_completion_unmatched_total", reason="already_released") == 1
    assert h.sample("smg_sidecar_released_total", **{"class": "default",
                                                      "reason": "completed"}) == 1


async def test_lease_expires_and_periodic_entries_renew(tmp_path: Path) -> None:
    h = await start(tmp_path, "--admission-lease-secs", "0.3")
    try:
        renewed = admission_id(await h.envoy.check({"x-smg-priority": "bulk"}))
        h.app.pools[DEFAULT_POOL].controller.set_capacity(2)
        lost = admission_id(await h.envoy.check({"x-smg-priority": "bulk"}))
        for _ in range(4):
            await asyncio.sleep(0.15)
            await h.envoy.log((renewed, "periodic"))
        assert h.app.pools[DEFAULT_POOL].controller.core.is_admitted(renewed)
        assert not h.app.pools[DEFAULT_POOL].controller.core.is_admitted(lost)
        assert h.sample("smg_sidecar_lease_expired_total", **{"class": "bulk"}) == 1
        await h.envoy.log((lost, "end"))  # a late completion for a reclaimed lease
        assert h.sample("smg_sidecar_completion_unmatched_total", reason="already_released") == 1
        await h.envoy.log((renewed, "end"))
        assert h.inflight == 0
    finally:
        await h.envoy.close()
        await h.app.stop()


async def test_rate_limit_sheds_with_queue_full(tmp_path: Path) -> None:
    h = await start(tmp_path, "--max-concurrent-requests", "2",
                    "--rate-limit-tokens-per-second", "0.001", "--worker-capacity-override", "8")
    try:
        ids = [admission_id(await h.envoy.check({})) for _ in range(2)]
        resp = await h.envoy.check({})
        check_deny(resp, 429, "scheduler_queue_full", "2")
        assert h.sample("smg_http_rate_limit_total", result="rejected") == 1
        assert h.sample("smg_http_rate_limit_total", result="allowed") == 2
        for aid in ids:
            await h.envoy.log((aid, "end"))
    finally:
        await h.envoy.close()
        await h.app.stop()


async def test_legacy_rate_limit_sheds_as_the_contract_says(tmp_path: Path) -> None:
    settings = parse_settings([
        "--grpc-listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0",
        "--max-concurrent-requests", "4", "--rate-limit-tokens-per-second", "0.001"])
    app = await build_runtime(settings)
    await app.serve()
    envoy = EnvoyStandIn(app.grpc_port)
    try:
        ids = [admission_id(await envoy.check({})) for _ in range(4)]
        for aid in ids:
            await envoy.log((aid, "end"))
        # the flag table: "shed = 429 scheduler_queue_full", whichever path admits
        check_deny(await envoy.check({}), 429, "scheduler_queue_full", "2")
        assert app.metrics.registry.get_sample_value(
            "smg_http_rate_limit_total", {"result": "rejected"}) == 1
    finally:
        await envoy.close()
        await app.stop()


async def test_legacy_path_codes(tmp_path: Path) -> None:
    settings = parse_settings([
        "--grpc-listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0",
        "--max-concurrent-requests", "1", "--queue-size", "1", "--queue-timeout-secs", "0.3"])
    app = await build_runtime(settings)
    await app.serve()
    envoy = EnvoyStandIn(app.grpc_port)
    try:
        first = await envoy.check({"x-smg-priority": "system"})
        assert first.status.code == 0
        queued = asyncio.ensure_future(envoy.check({}))
        await asyncio.sleep(0.05)
        check_deny(await envoy.check({}), 429, "admission_queue_full", "2")
        check_deny(await queued, 503, "admission_queue_timeout", "2")
        assert app.metrics.registry.get_sample_value(
            "smg_sidecar_admission_mode", {"mode": "legacy"}) == 1
        await envoy.log((admission_id(first), "end"))
        assert app.pools[DEFAULT_POOL].controller.core.snapshot().inflight == 0
    finally:
        await envoy.close()
        await app.stop()


@pytest.mark.parametrize(
    ("source", "kw", "tenant"),
    [
        ("principal", {"principal": "spiffe://mesh/ns/acme/sa/app"}, "spiffe://mesh/ns/acme/sa/app"),
        ("principal", {}, "anonymous"),
        ("jwt:jwt_payload.tenant", {"jwt_payload": {"tenant": "auth:gold"}}, "auth:gold"),
        ("jwt:jwt_payload.tenant", {"jwt_payload": {"tenant": 7}}, "anonymous"),
        ("jwt:jwt_payload.tenant", {}, "anonymous"),
        ("jwt:jwt_payload.tenant", {"jwt_payload": {"tenant": " auth:gold"}}, " auth:gold"),
        ("jwt:jwt_payload.tenant", {"jwt_payload": {"tenant": "x" * 1025}}, "anonymous"),
        ("header:x-smg-tenant", {}, "anonymous"),
    ],
)
async def test_tenant_sources(tmp_path: Path, source: str, kw: dict[str, object],
                              tenant: str) -> None:
    h = await start(tmp_path, "--tenant-source", source)
    try:
        # With principal/jwt sources, a tenant header is just another header.
        resp = await h.envoy.check({"x-smg-tenant": "auth:gold"} if source != "header:x-smg-tenant"
                                   else {}, **kw)
        assert resp.dynamic_metadata.fields["tenant"].string_value == tenant
        await h.envoy.log((admission_id(resp), "end"))
    finally:
        await h.envoy.close()
        await h.app.stop()


async def test_admin_http_endpoints(h: Harness) -> None:
    from devtools.httpclient import get as http_get

    async def get(path: str) -> tuple[int, str]:
        status, body = await http_get(f"http://127.0.0.1:{h.app.http_port}{path}", 5)
        return status, body.decode()

    assert await get("/healthz") == (200, "ok\n")
    assert await get("/readyz") == (200, "ready\n")
    status, text = await get("/metrics")
    assert status == 200
    for name in ("smg_scheduler_inflight", "smg_scheduler_queue_depth",
                 "smg_scheduler_queue_size_limit", "smg_scheduler_utilization",
                 "smg_scheduler_class_capacity_pressure", "smg_scheduler_admit_total",
                 "smg_sidecar_capacity", "smg_http_rate_limit_total"):
        assert f"\n{name}" in text, name
    assert (await get("/nope"))[0] == 404


async def test_grpc_health_service(h: Harness) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    stub = health_pb2_grpc.HealthStub(h.envoy.channel)
    for service in ("", "envoy.service.auth.v3.Authorization"):
        resp = await stub.Check(health_pb2.HealthCheckRequest(service=service))
        assert resp.status == health_pb2.HealthCheckResponse.SERVING


def test_admin_port_binds_loopback_by_default() -> None:
    from sidecar.config import parse_settings

    assert parse_settings([]).http_listen.startswith("127.0.0.1:")
    assert parse_settings([]).grpc_listen.startswith("127.0.0.1:")


@pytest.mark.parametrize("tenant", ["anonymous", "auth:acme", "", "t" * 256, "\x00x"])
def test_allow_template_equals_full_build(tenant: str) -> None:
    from sidecar import codec
    from sidecar.admission import new_admission_id

    for cls in ("system", "bulk"):
        aid = new_admission_id()
        assert codec.encode_allow(aid, cls, tenant) == codec.build_allow(aid, cls, tenant)
        assert codec.encode_allow(aid, cls, tenant) == codec.build_allow(aid, cls, tenant)
    assert codec.encode_allow("short", "bulk", tenant) == codec.build_allow("short", "bulk",
                                                                             tenant)
    for preemptible in (True, False):
        aid = new_admission_id()
        assert (codec.encode_allow(aid, "system", tenant, preemptible)
                == codec.build_allow(aid, "system", tenant, preemptible))


def test_allow_says_not_preemptible_only_when_asked() -> None:
    from envoy.service.auth.v3 import external_auth_pb2

    from sidecar import codec
    from sidecar.admission import new_admission_id

    def metadata(preemptible: bool) -> dict[str, object]:
        data = codec.encode_allow(new_admission_id(), "system", "t", preemptible)
        md = external_auth_pb2.CheckResponse.FromString(data).dynamic_metadata
        return {k: v.WhichOneof("kind") and getattr(v, v.WhichOneof("kind"))
                for k, v in md.fields.items()}

    # Absent means preemptible: an Envoy matcher that predates the key opens a stream.
    assert codec.PREEMPTIBLE_KEY not in metadata(True)
    assert metadata(False)[codec.PREEMPTIBLE_KEY] is False


def test_access_log_entry_carries_the_allows_preemptible_flag() -> None:
    from envoy.data.accesslog.v3 import accesslog_pb2
    from envoy.service.accesslog.v3 import als_pb2
    from envoy.service.auth.v3 import external_auth_pb2

    from sidecar import codec
    from sidecar.admission import new_admission_id

    def logged(preemptible: bool) -> codec.LogEntry:
        allow = external_auth_pb2.CheckResponse.FromString(
            codec.encode_allow(new_admission_id(), "system", "t", preemptible))
        msg = als_pb2.StreamAccessLogsMessage()
        cp = msg.http_logs.log_entry.add().common_properties
        cp.access_log_type = accesslog_pb2.DownstreamEnd
        # Envoy copies ext_authz's dynamic metadata into the entry as it stands.
        cp.metadata.filter_metadata[codec.AUTHZ_NAMESPACE].CopyFrom(allow.dynamic_metadata)
        [entry] = codec.decode_access_logs(msg.SerializeToString())
        return entry

    assert logged(True).preemptible is True
    assert logged(False).preemptible is False


def test_preemptible_classes_are_those_below_a_preempting_class() -> None:
    from dataclasses import replace

    from sidecar.classes import PriorityClass as P
    from sidecar.config import BUILTIN_CLASSES
    from sidecar.scheduler import preemptible_classes

    def with_preemptors(*preemptors: P) -> frozenset[P]:
        return preemptible_classes({c: replace(x, can_preempt=c in preemptors)
                                    for c, x in BUILTIN_CLASSES.items()})

    # built-in: system and interactive preempt, so only system is never a victim
    assert preemptible_classes(BUILTIN_CLASSES) == {P.INTERACTIVE, P.DEFAULT, P.BULK}
    assert with_preemptors() == frozenset()
    assert with_preemptors(P.INTERACTIVE) == {P.DEFAULT, P.BULK}
    assert with_preemptors(P.DEFAULT) == {P.BULK}
    assert with_preemptors(P.BULK) == frozenset()  # nothing below bulk


async def test_periodic_entry_adopts_a_stream_of_a_previous_process(h: Harness) -> None:
    old = "a" * 32
    await h.envoy.log((old, "periodic"), cls="bulk")
    assert h.inflight == 1
    assert h.sample("smg_sidecar_adopted_total", **{"class": "bulk"}) == 1
    # the admit counter is this process's decisions only
    assert h.sample("smg_scheduler_admit_total", **{"class": "bulk", "outcome": "admitted"}) == 0
    await h.envoy.log((old, "periodic"), cls="bulk")  # a renewal now, not a second adoption
    assert h.sample("smg_sidecar_adopted_total", **{"class": "bulk"}) == 1
    await h.envoy.log((old, "end"), cls="bulk")
    assert h.inflight == 0
    await h.envoy.log((old, "periodic"), cls="bulk")  # ended here: never re-adopted
    assert h.inflight == 0
    await h.envoy.log(("b" * 32, "periodic"), cls="nonsense")  # no class, no adoption
    assert h.inflight == 0


async def test_ext_proc_rejects_garbage_and_answers_unexpected_messages(h: Harness) -> None:
    import grpc
    from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

    process = h.envoy.channel.stream_stream(
        "/envoy.service.ext_proc.v3.ExternalProcessor/Process",
        request_serializer=lambda b: b, response_deserializer=ep.ProcessingResponse.FromString)
    call = process(iter([b"\xff\xff\xff"]))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in call:
            pass
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    body = ep.ProcessingRequest(request_body=ep.HttpBody(body=b"x", end_of_stream=True))
    replies = [r async for r in process(iter([body.SerializeToString()]))]
    assert [r.WhichOneof("response") for r in replies] == ["request_body"]
