"""The one adapter between the sidecar and the Envoy API message library.

The hot path (Check, access-log entries, ext_proc) uses ``xds-protos`` — the
grpc project's protobuf (upb) build of the Envoy API — because it decodes a
Check in microseconds where ``envoy-data-plane`` (betterproto2, pydantic) takes
~0.5 ms; see docs/performance.md for the measured figures. Everything else in
the sidecar sees plain Python values (:class:`CheckView`, :class:`LogEntry`),
so the library could be swapped here alone. ``envoy-data-plane`` stays the
project's reference decoder: the conformance tests decode every response this
module builds with it and check the fields.

It only encodes: what a denial says is :mod:`sidecar.responses`. Responses
that do not depend on the request (every denial, ext_proc CONTINUE) are
serialised once at start-up and reused as bytes.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from dataclasses import dataclass, field

from envoy.config.core.v3 import base_pb2
from envoy.data.accesslog.v3 import accesslog_pb2
from envoy.service.accesslog.v3 import als_pb2
from envoy.service.auth.v3 import external_auth_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc_pb2
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2
from google.rpc import code_pb2, status_pb2

from sidecar.responses import WAIT_HINT_HEADER, Reply
from sidecar.tokens import RequestFacts, Usage

AUTHZ_NAMESPACE = "envoy.filters.http.ext_authz"
JWT_NAMESPACE = "envoy.filters.http.jwt_authn"
ADMISSION_ID_KEY = "admission_id"
# Set (to false) only on an allow whose class no class above may preempt: Envoy's
# ext_proc matcher then opens no stream for it, and the access log tells the
# configuration detector not to expect one. Absent means preemptible, so an Envoy
# or sidecar that predates the key keeps opening a stream for every admission.
PREEMPTIBLE_KEY = "preemptible"
# The sidecar's ids are 32 hex characters (admission.new_admission_id); anything
# longer in a caller's message is not one of ours and is treated as absent, so a
# caller of the gRPC port cannot make the sidecar store or log big strings.
MAX_ADMISSION_ID_LEN = 64
# Tenant keys (Check) and the tenant / class fields of access-log entries.
MAX_TENANT_LEN = 1024
MAX_CLASS_LEN = 32
ADMISSION_ID_HEADER = "x-smg-admission-id"
POOL_KEY = "smg-pool"  # ext_authz per-route context extension: the route's pool
EFFECTIVE_CLASS_HEADER = "x-smg-effective-class"
# Token accounting (sidecar.tokens): what Envoy's json_to_metadata filter read from the
# request body (forwarded to the Check), and what its Lua filter read from the response's
# usage block (carried by the access log). envoy/envoy.yaml.tmpl, block "tokens".
REQUEST_NAMESPACE = "priority-gate.request"
USAGE_NAMESPACE = "priority-gate.usage"
# Set by Envoy on a Check whose body was cut at with_request_body's max_request_bytes.
PARTIAL_BODY_HEADER = "x-envoy-auth-partial-body"
_USAGE_FIELDS = ("prompt_tokens", "completion_tokens", "total_tokens")
_MAX_USAGE_CHARS = 32  # a usage count is a few digits; anything longer is not one

_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
_END = accesslog_pb2.DownstreamEnd
_PERIODIC = accesslog_pb2.DownstreamPeriodic
_NOT_SET = accesslog_pb2.NotSet


@dataclass(frozen=True, slots=True)
class CheckView:
    """What the admission decision needs from a CheckRequest."""

    headers: Mapping[str, str]
    principal: str
    filter_metadata: Mapping[str, struct_pb2.Struct]
    # The route's ext_authz context extension naming its pool (sidecar.pools), if any.
    pool: str | None = None
    # The request body, where Envoy sends it (with_request_body), and its size as Envoy
    # says (-1: unknown).
    body: bytes | None = None
    size: int = -1

    def metadata_string(self, namespace: str, *path: str) -> str | None:
        """A string at ``path`` inside a metadata namespace, or ``None``.

        Walks the Struct directly: no conversion of the whole payload, so odd
        values elsewhere in it (NaN, deep nesting) cannot get in the way.
        """
        ns = self.filter_metadata.get(namespace)
        if ns is None:
            return None
        value: struct_pb2.Value | None = None
        fields = ns.fields
        for i, key in enumerate(path):
            if key not in fields:
                return None
            value = fields[key]
            if i < len(path) - 1:
                if value.WhichOneof("kind") != "struct_value":
                    return None
                fields = value.struct_value.fields
        if value is None or value.WhichOneof("kind") != "string_value":
            return None
        out: str = value.string_value
        return out

    def metadata_scalar(self, namespace: str, key: str) -> object:
        """A top-level number (float), string or bool in a metadata namespace; None if
        absent or of another kind."""
        ns = self.filter_metadata.get(namespace)
        if ns is None or key not in ns.fields:
            return None
        value = ns.fields[key]
        kind = value.WhichOneof("kind")
        if kind == "number_value":
            return float(value.number_value)
        if kind == "string_value":
            return str(value.string_value)
        if kind == "bool_value":
            return bool(value.bool_value)
        return None


def token_facts(view: CheckView) -> RequestFacts:
    """What the Check says about the request's size (sidecar.tokens judges it): the body
    when Envoy sent it whole, else the content-length (or Envoy's size) and the
    max_tokens json_to_metadata read."""
    raw = view.metadata_scalar(REQUEST_NAMESPACE, "max_completion_tokens")
    if raw is None:
        raw = view.metadata_scalar(REQUEST_NAMESPACE, "max_tokens")
    body = view.body
    if body is not None and view.headers.get(PARTIAL_BODY_HEADER) != "true":
        return RequestFacts(length=len(body), body=body, max_tokens=raw)
    length: int | None = None
    text = view.headers.get("content-length")
    if text is not None and text.isascii() and text.isdigit() and len(text) <= 15:
        length = int(text)
    elif view.size >= 0:
        length = view.size
    return RequestFacts(length=length, max_tokens=raw)


def decode_check(data: bytes) -> CheckView:
    req = external_auth_pb2.CheckRequest.FromString(data)
    attrs = req.attributes
    http = attrs.request.http
    headers: Mapping[str, str]
    if http.headers:
        headers = http.headers
    else:
        # Envoy sends header_map instead when encode_raw_headers is on.
        headers = {h.key.lower(): h.raw_value.decode("utf-8", "replace")
                   for h in http.header_map.headers}
    ext = attrs.context_extensions
    body: bytes | None = None
    if http.raw_body:
        body = http.raw_body
    elif http.body:
        body = http.body.encode()
    return CheckView(headers=headers, principal=attrs.source.principal,
                     filter_metadata=attrs.metadata_context.filter_metadata,
                     pool=ext.get(POOL_KEY, None), body=body, size=http.size)


def _header(key: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=key, value=value),
                                      append_action=_OVERWRITE)


_ID_MARK = "\x00" * 32  # stands in for the 32-hex-digit id in cached templates
_ALLOW_TEMPLATES: dict[tuple[str, str, bool, int], bytes] = {}
_ALLOW_TEMPLATE_LIMIT = 4096


def encode_allow(admission_id: str, effective_class: str, tenant: str,
                 preemptible: bool = True) -> bytes:
    """OK, the admission id in dynamic metadata (trusted: the access log and the
    ext_proc filter read it there) and in headers to the worker (for its logs).

    The message differs per request only in the id, so it is serialised once
    per (class, tenant, id length) with a marker of the id's length and the
    marker is replaced; an id has the same encoded length as its marker (a
    pool's ids are longer than the default 32: sidecar.pools).
    """
    n = len(admission_id)
    if not len(_ID_MARK) <= n <= MAX_ADMISSION_ID_LEN:  # a short run of NULs is not unique
        return build_allow(admission_id, effective_class, tenant, preemptible)
    mark = _ID_MARK if n == len(_ID_MARK) else "\x00" * n
    key = (effective_class, tenant, preemptible, n)
    template = _ALLOW_TEMPLATES.get(key)
    if template is None:
        template = build_allow(mark, effective_class, tenant, preemptible)
        if len(_ALLOW_TEMPLATES) < _ALLOW_TEMPLATE_LIMIT:
            _ALLOW_TEMPLATES[key] = template
    return template.replace(mark.encode(), admission_id.encode())


def build_allow(admission_id: str, effective_class: str, tenant: str,
                preemptible: bool = True) -> bytes:
    """The allow response built field by field (the reference for the template)."""
    md = struct_pb2.Struct()
    md.fields[ADMISSION_ID_KEY].string_value = admission_id
    md.fields["class"].string_value = effective_class
    md.fields["tenant"].string_value = tenant
    if not preemptible:
        md.fields[PREEMPTIBLE_KEY].bool_value = False
    resp = external_auth_pb2.CheckResponse(
        status=status_pb2.Status(code=code_pb2.OK),
        dynamic_metadata=md,
        ok_response=external_auth_pb2.OkHttpResponse(
            headers=[_header(ADMISSION_ID_HEADER, admission_id),
                     _header(EFFECTIVE_CLASS_HEADER, effective_class)],
        ),
    )
    out: bytes = resp.SerializeToString()
    return out


def encode_unheld_allow(effective_class: str, tenant: str) -> bytes:
    """OK without an admission: nothing holds a slot, so there is no id for the access
    log or ext_proc to name (both let such a request pass; ``preemptible: false``, so
    Envoy opens no stream). --shadow only: a route naming a pool the sidecar lacks."""
    md = struct_pb2.Struct()
    md.fields["class"].string_value = effective_class
    md.fields["tenant"].string_value = tenant
    md.fields[PREEMPTIBLE_KEY].bool_value = False
    out: bytes = external_auth_pb2.CheckResponse(
        status=status_pb2.Status(code=code_pb2.OK),
        dynamic_metadata=md,
        ok_response=external_auth_pb2.OkHttpResponse(
            headers=[_header(EFFECTIVE_CLASS_HEADER, effective_class)]),
    ).SerializeToString()
    return out


# --shadow (sidecar.shadow): the would-be answer, in the metadata for Envoy's access log
# (%DYNAMIC_METADATA(envoy.filters.http.ext_authz:shadow_outcome)%) and as a header to
# the worker. The code is set only for a would-be rejection.
SHADOW_OUTCOME_KEY = "shadow_outcome"
SHADOW_CODE_KEY = "shadow_code"
SHADOW_HEADER = "x-smg-shadow-outcome"
_SHADOW_SUFFIXES: dict[tuple[str, str], bytes] = {}


def shadow_suffix(outcome: str, code: str = "") -> bytes:
    """Bytes to append to an encoded allow to add the would-be answer to it.

    Protobuf merges concatenated messages (map entries and repeated headers are
    added), so the allow's own template is left as it is. A handful of (outcome,
    code) pairs exist: each is serialised once.
    """
    key = (outcome, code)
    out = _SHADOW_SUFFIXES.get(key)
    if out is None:
        md = struct_pb2.Struct()
        md.fields[SHADOW_OUTCOME_KEY].string_value = outcome
        if code:
            md.fields[SHADOW_CODE_KEY].string_value = code
        out = external_auth_pb2.CheckResponse(
            dynamic_metadata=md,
            ok_response=external_auth_pb2.OkHttpResponse(
                headers=[_header(SHADOW_HEADER, outcome)]),
        ).SerializeToString()
        if len(_SHADOW_SUFFIXES) < 64:
            _SHADOW_SUFFIXES[key] = out
    return out


def wait_hint_suffix(waited_ms: int) -> bytes:
    """Bytes to append to an encoded allow (protobuf merges them, as ``shadow_suffix``):
    the ``--overload-hints`` header telling the client how long it waited queued."""
    out: bytes = external_auth_pb2.CheckResponse(
        ok_response=external_auth_pb2.OkHttpResponse(
            response_headers_to_add=[_header(WAIT_HINT_HEADER, str(waited_ms))]),
    ).SerializeToString()
    return out


def encode_deny(reply: Reply) -> bytes:
    """A Check denial: Envoy sends ``reply`` to the client as it stands."""
    resp = external_auth_pb2.CheckResponse(
        # PERMISSION_DENIED: any non-OK status denies; Envoy sends denied_response.
        status=status_pb2.Status(code=code_pb2.PERMISSION_DENIED),
        denied_response=external_auth_pb2.DeniedHttpResponse(
            status=http_status_pb2.HttpStatus(code=reply.status),
            headers=[_header(k, v) for k, v in reply.headers],
            body=reply.body,
        ),
    )
    out: bytes = resp.SerializeToString()
    return out


# ------------------------------------------------------------------ access log (ALS)


@dataclass(frozen=True, slots=True)
class LogEntry:
    admission_id: str
    final: bool  # False: a periodic entry of a stream still in progress
    cls: str  # effective class, as the Check put it in the metadata
    tenant: str
    response_code: int
    # How long the request had lived when the entry was written, and the wall-clock time it
    # ended (final entries; 0.0 when Envoy did not say): configuration detection only.
    lived_secs: float = 0.0
    ended_at: float = 0.0
    # False when the allow said no class above may preempt it (no ext_proc stream expected).
    preemptible: bool = True
    # --shadow: the would-be outcome the allow carried ("" without --shadow).
    shadow_outcome: str = ""
    # Final entries, where Envoy measured them (None otherwise): the client's time to
    # first byte (from Envoy receiving the request: queue wait included), and the
    # engine's (from the request reaching the worker to the first byte back).
    ttft_secs: float | None = None
    engine_ttfb_secs: float | None = None
    # From the request reaching the worker to its last byte back (None: not measured).
    engine_secs: float | None = None
    # Final entries: the response's usage block as Envoy's Lua filter read it, and the
    # body bytes Envoy counted each way (sidecar.tokens settles on them).
    usage: Usage = field(default_factory=Usage)


def _usage(cp: accesslog_pb2.AccessLogCommon, entry: accesslog_pb2.HTTPAccessLogEntry
           ) -> Usage:
    ns = cp.metadata.filter_metadata.get(USAGE_NAMESPACE)
    raw: list[str | None] = [None, None, None]
    if ns is not None:
        for i, key in enumerate(_USAGE_FIELDS):
            v = ns.fields.get(key)
            if v is None:
                continue
            kind = v.WhichOneof("kind")
            if kind == "string_value":
                raw[i] = v.string_value[:_MAX_USAGE_CHARS]
            elif kind == "number_value":
                n = v.number_value
                raw[i] = str(int(n)) if n == n and abs(n) < 1e15 and n == int(n) else "nan"
            else:
                raw[i] = "invalid"
    return Usage(raw[0], raw[1], raw[2], request_bytes=entry.request.request_body_bytes,
                 response_bytes=entry.response.response_body_bytes)


def decode_access_logs(data: bytes) -> list[LogEntry]:
    """Entries that carry our admission id; others (denied requests) are skipped."""
    msg = als_pb2.StreamAccessLogsMessage.FromString(data)
    out: list[LogEntry] = []
    for entry in msg.http_logs.log_entry:
        cp = entry.common_properties
        ns = cp.metadata.filter_metadata.get(AUTHZ_NAMESPACE)
        if ns is None:
            continue
        fields = ns.fields
        aid_value = fields.get(ADMISSION_ID_KEY)
        if (aid_value is None or not aid_value.string_value
                or len(aid_value.string_value) > MAX_ADMISSION_ID_LEN):
            continue
        kind = cp.access_log_type
        if kind not in (_END, _PERIODIC, _NOT_SET):
            continue  # upstream-side entry types are not ours to act on
        cls_value = fields.get("class")
        tenant_value = fields.get("tenant")
        preemptible_value = fields.get(PREEMPTIBLE_KEY)
        shadow_value = fields.get(SHADOW_OUTCOME_KEY)
        cls = cls_value.string_value if cls_value is not None else ""
        tenant = tenant_value.string_value if tenant_value is not None else ""
        out.append(LogEntry(
            admission_id=aid_value.string_value,
            final=kind != _PERIODIC,
            cls=cls if len(cls) <= MAX_CLASS_LEN else "",  # no class: never adopted
            tenant=tenant if len(tenant) <= MAX_TENANT_LEN else "",
            response_code=entry.response.response_code.value,
            lived_secs=_lived_secs(cp),
            ended_at=_ended_at(cp),
            preemptible=preemptible_value is None or preemptible_value.bool_value,
            shadow_outcome=shadow_value.string_value[:MAX_CLASS_LEN]
            if shadow_value is not None else "",
            ttft_secs=_secs(cp, "time_to_first_downstream_tx_byte"),
            engine_ttfb_secs=_engine_ttfb(cp),
            usage=_usage(cp, entry) if kind != _PERIODIC else Usage(),
            engine_secs=_engine_secs(cp),
        ))
    return out


def _secs(cp: accesslog_pb2.AccessLogCommon, name: str) -> float | None:
    if not cp.HasField(name):
        return None
    d = getattr(cp, name)
    return float(d.seconds + d.nanos / 1e9)


def _since_sent(cp: accesslog_pb2.AccessLogCommon, name: str) -> float | None:
    """From the last byte of the request sent upstream to the instant ``name``; None
    where either is missing or they are out of order."""
    sent = _secs(cp, "time_to_last_upstream_tx_byte")
    then = _secs(cp, name)
    if sent is None or then is None or then < sent:
        return None
    return then - sent


def _engine_secs(cp: accesslog_pb2.AccessLogCommon) -> float | None:
    """From the last byte of the request sent upstream to the last byte back."""
    return _since_sent(cp, "time_to_last_upstream_rx_byte")


def _engine_ttfb(cp: accesslog_pb2.AccessLogCommon) -> float | None:
    """From the last byte of the request sent upstream to the first byte back."""
    return _since_sent(cp, "time_to_first_upstream_rx_byte")


def _lived_secs(cp: accesslog_pb2.AccessLogCommon) -> float:
    if cp.HasField("duration"):
        return float(cp.duration.ToTimedelta().total_seconds())
    if cp.HasField("time_to_last_downstream_tx_byte"):
        return float(cp.time_to_last_downstream_tx_byte.ToTimedelta().total_seconds())
    return 0.0


def _ended_at(cp: accesslog_pb2.AccessLogCommon) -> float:
    if not cp.HasField("start_time") or not cp.HasField("time_to_last_downstream_tx_byte"):
        return 0.0
    start = cp.start_time.ToDatetime(tzinfo=datetime.UTC).timestamp()
    return float(start + cp.time_to_last_downstream_tx_byte.ToTimedelta().total_seconds())


ALS_RESPONSE: bytes = als_pb2.StreamAccessLogsResponse().SerializeToString()


# ------------------------------------------------------------------------- ext_proc


@dataclass(frozen=True, slots=True)
class ProcessingEvent:
    kind: str  # the ProcessingRequest oneof: "request_headers", "response_headers", ...
    admission_id: str | None


def decode_processing_request(data: bytes) -> ProcessingEvent:
    req = ext_proc_pb2.ProcessingRequest.FromString(data)
    kind = req.WhichOneof("request")
    aid: str | None = None
    if kind is None:
        return ProcessingEvent("other", None)
    if kind == "request_headers":
        ns = req.metadata_context.filter_metadata.get(AUTHZ_NAMESPACE)
        if ns is not None and ADMISSION_ID_KEY in ns.fields:
            aid = ns.fields[ADMISSION_ID_KEY].string_value or None
            if aid is not None and len(aid) > MAX_ADMISSION_ID_LEN:
                aid = None  # not ours: the request passes unwatched
        return ProcessingEvent("request_headers", aid)
    return ProcessingEvent(kind, None)


CONTINUE_REQUEST_HEADERS: bytes = ext_proc_pb2.ProcessingResponse(
    request_headers=ext_proc_pb2.HeadersResponse()).SerializeToString()


_CONTINUE: dict[str, bytes] = {
    kind: ext_proc_pb2.ProcessingResponse(**{kind: cls()}).SerializeToString()
    for kind, cls in (("request_headers", ext_proc_pb2.HeadersResponse),
                      ("response_headers", ext_proc_pb2.HeadersResponse),
                      ("request_body", ext_proc_pb2.BodyResponse),
                      ("response_body", ext_proc_pb2.BodyResponse),
                      ("request_trailers", ext_proc_pb2.TrailersResponse),
                      ("response_trailers", ext_proc_pb2.TrailersResponse))
}


def continue_for(kind: str) -> bytes:
    """The "carry on unchanged" answer to a message of ``kind``."""
    return _CONTINUE.get(kind, CONTINUE_REQUEST_HEADERS)


def encode_immediate(reply: Reply) -> bytes:
    """An unsolicited ext_proc answer: Envoy sends ``reply`` and resets the upstream."""
    headers = [
        base_pb2.HeaderValueOption(
            header=base_pb2.HeaderValue(key=k, raw_value=v.encode()), append_action=_OVERWRITE)
        for k, v in reply.headers
    ]
    resp = ext_proc_pb2.ProcessingResponse(
        immediate_response=ext_proc_pb2.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=reply.status),
            headers=ext_proc_pb2.HeaderMutation(set_headers=headers),
            body=reply.body.encode(),
            details=reply.code,
        )
    )
    out: bytes = resp.SerializeToString()
    return out
