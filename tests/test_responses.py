"""responses.py: the contract's Responses table, row by row, as the client receives it.

The expected rows are written out here from the contract, not derived from the
module; both senders' encodings (ext_authz denial, ext_proc immediate response)
are decoded with envoy-data-plane, the project's reference decoder.
"""

from __future__ import annotations

import json

import pytest
from envoy_data_plane.envoy.service.auth.v3 import CheckResponse
from envoy_data_plane.envoy.service.ext_proc.v3 import ProcessingResponse

from sidecar import codec
from sidecar.classes import HIGH_TO_LOW, PriorityClass
from sidecar.responses import REPLIES, Rejection, for_denial, reply
from sidecar.scheduler import Outcome

# rejection -> (status, code, extra headers), as the contract's table says
CONTRACT: dict[Rejection, tuple[int, str, dict[str, str]]] = {
    Rejection.QUEUE_FULL: (429, "scheduler_queue_full", {"retry-after": "2"}),
    Rejection.RATE_LIMITED: (429, "scheduler_queue_full", {"retry-after": "2"}),
    # The sidecar's overload shed takes the contract's shed row (docs/reference.md, "Rejections").
    Rejection.OVERLOADED: (429, "scheduler_queue_full", {"retry-after": "2"}),
    Rejection.QUEUE_TIMEOUT: (503, "scheduler_queue_timeout", {"retry-after": "2"}),
    Rejection.PREEMPTED: (503, "scheduler_preempted",
                          {"retry-after": "1", "x-smg-preempted": "true"}),
    Rejection.LEGACY_QUEUE_FULL: (429, "admission_queue_full", {"retry-after": "2"}),
    Rejection.UNKNOWN_POOL: (429, "scheduler_queue_full", {"retry-after": "2"}),
    Rejection.LEGACY_QUEUE_TIMEOUT: (503, "admission_queue_timeout", {"retry-after": "2"}),
    # An extension (deadline_mode: enforce only), beside the contract's codes.
    Rejection.OVER_TARGET: (429, "scheduler_over_target", {"retry-after": "2"}),
}
REASON = {429: "Too Many Requests", 503: "Service Unavailable"}
ROWS = [(r, cls) for r in Rejection for cls in HIGH_TO_LOW]


def expected_headers(r: Rejection) -> dict[str, str]:
    _, code, extra = CONTRACT[r]
    return {"x-smg-error-code": code, "content-type": "application/json", **extra}


def check_body(body: str, r: Rejection) -> None:
    status, code, _ = CONTRACT[r]
    message = json.loads(body)["error"]["message"]
    assert isinstance(message, str) and message
    # byte for byte: key order, no spaces, null param
    prefix = f'{{"error":{{"type":"{REASON[status]}","code":"{code}","message":'
    assert body == prefix + json.dumps(message) + ',"param":null}}'


def test_the_set_of_rejections_is_the_contracts() -> None:
    assert set(Rejection) == set(CONTRACT)
    assert set(REPLIES) == set(ROWS)
    assert all(REPLIES[(r, cls)] == reply(r, cls) for r, cls in ROWS)


@pytest.mark.parametrize(("r", "cls"), ROWS)
def test_denied_http_response(r: Rejection, cls: PriorityClass) -> None:
    resp = CheckResponse.FromString(codec.encode_deny(reply(r, cls)))
    assert resp.status.code != 0  # any non-OK status denies
    denied = resp.denied_response
    assert denied.status.code == CONTRACT[r][0]
    assert {h.header.key: h.header.value for h in denied.headers} == expected_headers(r)
    assert len(denied.headers) == len(expected_headers(r))  # no duplicates
    check_body(denied.body, r)


@pytest.mark.parametrize(("r", "cls"), ROWS)
def test_ext_proc_immediate_response(r: Rejection, cls: PriorityClass) -> None:
    resp = ProcessingResponse.FromString(codec.encode_immediate(reply(r, cls))).immediate_response
    assert resp.status.code == CONTRACT[r][0]
    assert {o.header.key: o.header.raw_value.decode() for o in resp.headers.set_headers} == \
        expected_headers(r)
    check_body(resp.body.decode(), r)
    assert resp.details == CONTRACT[r][1]


def test_class_queue_messages_name_the_class_and_nothing_else_does() -> None:
    for r in Rejection:
        messages = {reply(r, cls).message for cls in HIGH_TO_LOW}
        if r in (Rejection.QUEUE_FULL, Rejection.QUEUE_TIMEOUT, Rejection.OVER_TARGET):
            for cls in HIGH_TO_LOW:
                assert f"'{cls.label}'" in reply(r, cls).message
            with pytest.raises(ValueError):
                reply(r)
        else:
            assert messages == {reply(r).message}


@pytest.mark.parametrize("legacy", [False, True])
def test_every_refusal_the_controller_can_raise_has_a_row(legacy: bool) -> None:
    assert for_denial(Outcome.REJECTED_QUEUE_FULL, legacy=legacy, rate_limited=True) \
        is Rejection.RATE_LIMITED
    assert for_denial(Outcome.REJECTED_QUEUE_FULL, legacy=legacy, rate_limited=False) \
        is (Rejection.LEGACY_QUEUE_FULL if legacy else Rejection.QUEUE_FULL)
    assert for_denial(Outcome.REJECTED_QUEUE_TIMEOUT, legacy=legacy, rate_limited=False) \
        is (Rejection.LEGACY_QUEUE_TIMEOUT if legacy else Rejection.QUEUE_TIMEOUT)
    # A client that went away is counted, never answered: there is no 499 to send.
    for outcome in (Outcome.CLIENT_CANCELLED, Outcome.ADMITTED, Outcome.PREEMPTED):
        with pytest.raises(ValueError):
            for_denial(outcome, legacy=legacy, rate_limited=False)
