"""Strings from gRPC callers have length caps; adoption and ended-id memory are bounded.

Anyone in the pod who can reach the gRPC port can send access-log entries and
ext_proc streams; none of it may grow the sidecar's memory without bound or take
slots beyond the capacity.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from envoy.data.accesslog.v3 import accesslog_pb2
from envoy.service.accesslog.v3 import als_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

from sidecar import codec
from sidecar.config import DEFAULT_POOL
from sidecar.scheduler import ReleaseReason
from sidecar.scheduler.lifecycle import EndedIds
from tests.grpc_client import admission_id, check_request
from tests.test_authz import Harness, start


@pytest.fixture
async def h(tmp_path: Path) -> AsyncIterator[Harness]:
    harness = await start(tmp_path)  # capacity 1
    yield harness
    await harness.envoy.close()
    await harness.app.stop()


def als(aid: str, *, cls: str = "bulk", tenant: str = "t") -> bytes:
    msg = als_pb2.StreamAccessLogsMessage()
    e = msg.http_logs.log_entry.add()
    e.common_properties.access_log_type = accesslog_pb2.DownstreamPeriodic
    fields = e.common_properties.metadata.filter_metadata[codec.AUTHZ_NAMESPACE].fields
    fields[codec.ADMISSION_ID_KEY].string_value = aid
    fields["class"].string_value = cls
    fields["tenant"].string_value = tenant
    out: bytes = msg.SerializeToString()
    return out


def test_access_log_fields_over_their_caps_are_dropped() -> None:
    long_id = "a" * (codec.MAX_ADMISSION_ID_LEN + 1)
    assert codec.decode_access_logs(als(long_id)) == []  # not ours: skipped
    ok_id = "a" * codec.MAX_ADMISSION_ID_LEN
    [entry] = codec.decode_access_logs(als(ok_id, cls="b" * 10_000, tenant="t" * 10_000))
    assert (entry.admission_id, entry.cls, entry.tenant) == (ok_id, "", "")
    [entry] = codec.decode_access_logs(als(ok_id, tenant="t" * codec.MAX_TENANT_LEN))
    assert entry.tenant == "t" * codec.MAX_TENANT_LEN


def test_ext_proc_admission_id_over_the_cap_is_no_id() -> None:
    req = ep.ProcessingRequest(request_headers=ep.HttpHeaders())
    ns = req.metadata_context.filter_metadata[codec.AUTHZ_NAMESPACE]
    ns.fields[codec.ADMISSION_ID_KEY].string_value = "a" * (codec.MAX_ADMISSION_ID_LEN + 1)
    assert codec.decode_processing_request(req.SerializeToString()).admission_id is None
    ns.fields[codec.ADMISSION_ID_KEY].string_value = "a" * 32
    assert codec.decode_processing_request(req.SerializeToString()).admission_id == "a" * 32


async def test_a_long_tenant_key_is_anonymous(h: Harness) -> None:
    from sidecar.authz import MAX_TENANT_LEN, resolve_tenant

    view = codec.decode_check(check_request(
        {"x-smg-tenant": "x" * (MAX_TENANT_LEN + 1)}).SerializeToString())
    assert resolve_tenant(h.app.settings.tenant_source, view) == "anonymous"


async def test_adoptions_stop_at_the_capacity_and_are_counted(h: Harness) -> None:
    await h.envoy.log(("a" * 32, "periodic"), cls="bulk")
    assert h.inflight == 1  # capacity 1: the first adoption fits
    for i in range(50):  # a flood of made-up ids
        await h.envoy.log((f"{i:032x}", "periodic"), cls="default")
    assert h.inflight == 1
    assert h.app.pools[DEFAULT_POOL].controller.lease_count == 1
    assert h.sample("smg_sidecar_adopted_total", **{"class": "bulk"}) == 1
    assert h.sample("smg_sidecar_adopted_total", **{"class": "default"}) == 0
    assert h.sample("smg_sidecar_adoption_refused_total", **{"class": "default"}) == 50
    # The adopted stream is still renewed at the bound (a renewal is no adoption).
    await h.envoy.log(("a" * 32, "periodic"), cls="bulk")
    assert h.sample("smg_sidecar_adoption_refused_total", **{"class": "bulk"}) == 0
    await h.envoy.log(("a" * 32, "end"), cls="bulk")
    assert h.inflight == 0
    # Room again: the next real stream is adopted.
    await h.envoy.log(("c" * 32, "periodic"), cls="default")
    assert h.inflight == 1
    await h.envoy.log(("c" * 32, "end"), cls="default")


def test_ended_id_memory_is_bounded_in_characters_as_well_as_count() -> None:
    ended = EndedIds(maxlen=1000, max_chars=10_000)
    for i in range(100):
        ended.add(f"{i:04d}" + "x" * 996, ReleaseReason.COMPLETED)  # 1,000 characters each
    assert ended.chars <= 10_000 and len(ended) == 10
    assert "0099" + "x" * 996 in ended and "0000" + "x" * 996 not in ended
    for i in range(2000):
        ended.add(f"{i:032x}", ReleaseReason.COMPLETED)
    assert len(ended) == 10_000 // 32 and ended.chars == 32 * (10_000 // 32)
    by_count = EndedIds(maxlen=5)
    for i in range(10):
        by_count.add(str(i), ReleaseReason.COMPLETED)
    assert len(by_count) == 5 and "4" not in by_count and "9" in by_count
    ended.add("y" * 50_000, ReleaseReason.COMPLETED)  # one over the budget: only it stays
    assert len(ended) == 1 and ended.chars == 50_000


async def test_a_long_request_id_is_logged_cut(h: Harness) -> None:
    from structlog.testing import capture_logs

    from sidecar.authz import MAX_REQUEST_ID_LEN

    first = await h.envoy.check({"x-smg-priority": "bulk"})  # the only slot
    queued = h.envoy.check({"x-smg-priority": "bulk"})  # bulk's queue holds 2
    queued2 = h.envoy.check({"x-smg-priority": "bulk"})
    with capture_logs() as logs:
        shed = await h.envoy.check({"x-smg-priority": "bulk", "x-request-id": "r" * 100_000})
    assert shed.status.code != 0
    ids = [e["request_id"] for e in logs if e["event"] == "rejected" and e["request_id"]]
    assert ids and all(len(i) == MAX_REQUEST_ID_LEN + 1 for i in ids)
    # Per rejection at debug; at info the first one of an interval gives the summary line.
    assert {e["log_level"] for e in logs if e["event"] == "rejected"} == {"debug"}
    [summary] = [e for e in logs if e["event"] == "rejections"]
    assert summary["log_level"] == "info" and summary["total"] == 1
    assert summary["by_class_outcome"] == {"bulk/rejected_queue_full": 1}
    for q in (queued, queued2):
        assert (await q).status.code != 0  # timed out (0.3 s)
    await h.envoy.log((admission_id(first), "end"))


def test_throttled_logs_once_per_interval_with_the_count() -> None:
    from structlog.testing import capture_logs

    from sidecar import logs as sidecar_logs
    from tests.clock import FakeClock

    clock = FakeClock()
    throttled = sidecar_logs.Throttled(sidecar_logs.get("t"), "storm", interval=10.0,
                                       clock=clock)
    with capture_logs() as logs:
        for _ in range(1000):
            throttled.event()
        clock.advance(10.0)
        throttled.event(n=1)
    assert [(e["event"], e["suppressed_since_last"]) for e in logs] == [("storm", 0),
                                                                         ("storm", 999)]
