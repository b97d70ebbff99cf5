"""Fuzzing: hostile CheckRequests, access-log messages and YAML never escape as crashes.

CI runs 300 examples per property; ``make fuzz`` (FUZZ_EXAMPLES=10000) is the long run.
"""

from __future__ import annotations

import contextlib
import os

import yaml
from google.protobuf.message import DecodeError
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar import codec
from sidecar.authz import ANONYMOUS, MAX_TENANT_LEN, resolve_tenant
from sidecar.classes import PriorityClass, classify
from sidecar.config import ConfigError, TenantSource, parse_priority_config
from tests.grpc_client import check_request

CI = settings(max_examples=int(os.environ.get("FUZZ_EXAMPLES", "300")), deadline=None)
text = st.text(max_size=300)
header_names = st.sampled_from(["x-smg-priority", "x-smg-tenant", "x-other", "authorization"])
headers = st.dictionaries(st.one_of(header_names, st.text(min_size=1, max_size=20)), text,
                          max_size=8)
json_values = st.recursive(
    st.none() | st.booleans() | st.floats(allow_nan=False) | st.text(max_size=40),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=10), inner,
                                                                 max_size=3),
    max_leaves=10)
SOURCES = [TenantSource("header", "x-smg-tenant"), TenantSource("principal"),
           TenantSource("jwt", "jwt_payload.tenant")]


@CI
@given(headers=headers, principal=text,
       payload=st.none() | st.dictionaries(st.sampled_from(["tenant", "sub"]), json_values))
def test_any_check_request_classifies(headers: dict[str, str], principal: str,
                                      payload: dict[str, object] | None) -> None:
    data = check_request(headers, principal=principal, jwt_payload=payload).SerializeToString()
    view = codec.decode_check(data)
    for source in SOURCES:
        tenant = resolve_tenant(source, view)
        assert tenant == ANONYMOUS or (0 < len(tenant) <= MAX_TENANT_LEN)
        c = classify(view.headers.get("x-smg-priority"), tenant, PriorityClass.DEFAULT)
        assert c.effective <= c.requested and c.effective <= PriorityClass.DEFAULT


@CI
@given(st.binary(max_size=400))
def test_garbage_bytes_only_raise_decode_error(data: bytes) -> None:
    for decode in (codec.decode_check, codec.decode_access_logs,
                   codec.decode_processing_request):
        with contextlib.suppress(DecodeError):
            decode(data)  # type: ignore[operator]


@CI
@given(st.lists(st.tuples(st.text(max_size=40), st.sampled_from([0, 1, 4, 5, 6, 9, 99])),
                max_size=5))
def test_access_log_entries(entries: list[tuple[str, int]]) -> None:
    from envoy.service.accesslog.v3 import als_pb2

    msg = als_pb2.StreamAccessLogsMessage()
    for aid, kind in entries:
        e = msg.http_logs.log_entry.add()
        e.common_properties.access_log_type = kind
        e.common_properties.metadata.filter_metadata[codec.AUTHZ_NAMESPACE].fields[
            codec.ADMISSION_ID_KEY].string_value = aid
    out = codec.decode_access_logs(msg.SerializeToString())
    # empty ids and upstream-side entry types are skipped, never acted on
    assert all(e.admission_id for e in out)
    assert len(out) == sum(1 for aid, kind in entries if aid and kind in (0, 5, 6))


yaml_docs = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 5000) | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
        st.sampled_from(["classes", "tenant_policies", "system", "bulk", "default",
                         "interactive", "queue_size", "queue_timeout_secs", "max_class",
                         "reserved_floor", "reserved_per_slot", "can_preempt",
                         "starvation_threshold_secs", "acme", "typo"]), inner, max_size=5),
    max_leaves=25)


@CI
@given(yaml_docs)
def test_any_yaml_document_loads_or_fails_clearly(doc: object) -> None:
    text = yaml.safe_dump(doc)
    try:
        cfg = parse_priority_config(text, "fuzz.yaml")
    except ConfigError as exc:
        assert str(exc).startswith("fuzz.yaml")
        return
    for c in cfg.classes.values():
        assert c.queue_timeout_secs > 0 and c.starvation_threshold_secs > 0
        assert c.reserved_per_slot >= 0 and c.queue_size >= 0 and c.reserved_floor >= 0


@CI
@given(st.text(max_size=500))
def test_any_yaml_text_loads_or_fails_clearly(text: str) -> None:
    try:
        parse_priority_config(text, "fuzz.yaml")
    except ConfigError as exc:
        assert str(exc).startswith("fuzz.yaml")
