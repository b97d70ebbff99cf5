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
from sidecar.responses import (
    REPLIES,
    Rejection,
    for_denial,
    over_budget,
    past_context,
    reply,
)
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
    # An extension (tenants with token budgets only), worded and timed per refusal
    # (over_budget, below): not a row serialised once.
    Rejection.OVER_BUDGET: (429, "scheduler_token_budget_exceeded", {}),
    # An extension (tokens.refuse_past_context only), worded per refusal (past_context).
    Rejection.PAST_CONTEXT: (413, "scheduler_token_context_exceeded", {}),
}
REASON = {429: "Too Many Requests", 503: "Service Unavailable", 413: "Request Entity Too Large"}
PER_REFUSAL = (Rejection.OVER_BUDGET, Rejection.PAST_CONTEXT)
ROWS = [(r, cls) for r in Rejection if r not in PER_REFUSAL for cls in HIGH_TO_LOW]


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
    with pytest.raises(ValueError, match="over_budget"):
        reply(Rejection.OVER_BUDGET, PriorityClass.BULK)
    with pytest.raises(ValueError, match="past_context"):
        reply(Rejection.PAST_CONTEXT, PriorityClass.BULK)
    for r in Rejection:
        if r in PER_REFUSAL:
            continue
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


@pytest.mark.parametrize(("wait", "header"), [(0.0, "1"), (0.2, "1"), (1.0, "1"),
                                               (1.01, "2"), (59.5, "60"),
                                               (31 * 86400 - 0.5, str(31 * 86400))])
def test_an_over_budget_reply_carries_the_windows_retry_after(wait: float,
                                                              header: str) -> None:
    """The budget's own Retry-After, rounded up to whole seconds (at least 1), on the
    contract's JSON shape with the extension's code, decoded by the reference decoder."""
    resp = CheckResponse.FromString(codec.encode_deny(over_budget("minute", wait)))
    denied = resp.denied_response
    assert denied.status.code == 429
    headers = {h.header.key: h.header.value for h in denied.headers}
    assert headers == {"x-smg-error-code": "scheduler_token_budget_exceeded",
                       "content-type": "application/json", "retry-after": header}
    check_body(denied.body, Rejection.OVER_BUDGET)
    assert "'minute'" in json.loads(denied.body)["error"]["message"]


def test_an_over_budget_reply_says_when_a_request_can_never_fit() -> None:
    never = over_budget("day", 3600.0, never=True)
    assert "exceed" in never.message and "'day'" in never.message
    assert never.message != over_budget("day", 3600.0).message


def test_a_past_context_reply_names_both_figures_and_no_retry_after() -> None:
    """413 with the extension's code and no Retry-After (the same request never fits), on
    the contract's JSON shape, decoded by the reference decoder."""
    denied = CheckResponse.FromString(codec.encode_deny(past_context(9000, 4096))
                                      ).denied_response
    assert denied.status.code == 413
    assert {h.header.key: h.header.value for h in denied.headers} == {
        "x-smg-error-code": "scheduler_token_context_exceeded",
        "content-type": "application/json"}
    check_body(denied.body, Rejection.PAST_CONTEXT)
    message = json.loads(denied.body)["error"]["message"]
    assert "9000" in message and "4096" in message
