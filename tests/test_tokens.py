"""sidecar/tokens.py: the estimate, the settlement and the budget book, on a fake clock;
then over loopback gRPC through the whole sidecar (Checks carrying what Envoy's filters
send, access-log entries carrying the usage), every figure against the test's own sums.
"""

from __future__ import annotations

import asyncio
import calendar
import datetime
import json
import math
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from envoy.data.accesslog.v3 import accesslog_pb2
from envoy.service.accesslog.v3 import als_pb2
from envoy.service.auth.v3 import external_auth_pb2
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar import codec
from sidecar.app import Runtime, build_runtime
from sidecar.config import DEFAULT_POOL, parse_settings
from sidecar.priority_yaml import ConfigError, parse_priority_config
from sidecar.tokens import (
    ABSURD_FACTOR,
    TRANSITIONS,
    Allowed,
    Budget,
    Estimate,
    IllegalMove,
    OverBudget,
    RequestFacts,
    Stage,
    TokenBook,
    TokenSettings,
    Usage,
    Window,
    estimate,
    settle_amount,
)
from tests.grpc_client import EnvoyStandIn, admission_id, check_request

DAY = 86400
T0 = calendar.timegm((2026, 3, 10, 12, 0, 0))  # a Tuesday noon, UTC


def ts(*when: int) -> float:
    return float(calendar.timegm((*when, *(0,) * (6 - len(when)))))


# --------------------------------------------------------------------------- windows


@pytest.mark.parametrize(("name", "now", "start", "end"), [
    ("minute", ts(2026, 3, 10, 12, 0, 59), ts(2026, 3, 10, 12, 0), ts(2026, 3, 10, 12, 1)),
    ("hour", ts(2026, 3, 10, 12, 59, 59), ts(2026, 3, 10, 12), ts(2026, 3, 10, 13)),
    ("day", ts(2026, 3, 10, 23, 59, 59), ts(2026, 3, 10), ts(2026, 3, 11)),
    ("week", ts(2026, 3, 10, 12), ts(2026, 3, 9), ts(2026, 3, 16)),  # Monday to Monday
    ("week", ts(2026, 3, 9), ts(2026, 3, 9), ts(2026, 3, 16)),
    ("month", ts(2024, 2, 29, 23, 59, 59), ts(2024, 2, 1), ts(2024, 3, 1)),  # leap year
    ("month", ts(2026, 2, 14), ts(2026, 2, 1), ts(2026, 3, 1)),
    ("month", ts(2026, 12, 31, 23), ts(2026, 12, 1), ts(2027, 1, 1)),
    ("10m", ts(2026, 3, 10, 12, 19, 59), ts(2026, 3, 10, 12, 10), ts(2026, 3, 10, 12, 20)),
    ("6h", ts(2026, 3, 10, 13), ts(2026, 3, 10, 12), ts(2026, 3, 10, 18)),
    ("31d", ts(2026, 3, 10), 31 * DAY * (ts(2026, 3, 10) // (31 * DAY)),
     31 * DAY * (ts(2026, 3, 10) // (31 * DAY) + 1)),
])
def test_a_window_period_holds_now_and_starts_where_the_calendar_says(
        name: str, now: float, start: float, end: float) -> None:
    w = Window.parse(name)
    assert w is not None
    assert w.period(now) == (start, end)
    assert start <= now < end


@pytest.mark.parametrize("text", ["fortnight", "1s", "59s", "0m", "32d", "745h", "1w", "M",
                                  "", " minute", "Minute", 60, None, "1.5h", "-1h", "01m"])
def test_anything_else_is_not_a_window(text: object) -> None:
    assert Window.parse(text) is None


def test_consecutive_periods_tile_the_time_line() -> None:
    rnd = random.Random(7)
    for name in ("minute", "hour", "day", "week", "month", "7m", "25h", "3d"):
        w = Window.parse(name)
        assert w is not None
        now = float(T0)
        for _ in range(30):
            start, end = w.period(now)
            assert w.period(end) [0] == end and w.period(end - 1e-3)[0] == start
            now = end + rnd.random() * (end - start) * 0.5


# -------------------------------------------------------------------------- estimate

S = TokenSettings(default_max_tokens=100, max_output_tokens=1000, bytes_per_token=4.0)


def body(**fields: object) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                       **fields}).encode()


@pytest.mark.parametrize(("facts", "output", "fallbacks"), [
    (RequestFacts(length=400, max_tokens=77.0), 77, ()),
    (RequestFacts(length=400, max_tokens=None), 100, ("max_tokens_missing",)),
    (RequestFacts(length=400, max_tokens=1e12), 1000, ("max_tokens_clamped",)),
    (RequestFacts(length=400, max_tokens=-5.0), 100, ("max_tokens_invalid",)),
    (RequestFacts(length=400, max_tokens=0.0), 100, ("max_tokens_invalid",)),
    (RequestFacts(length=400, max_tokens=7.5), 100, ("max_tokens_invalid",)),
    (RequestFacts(length=400, max_tokens=math.nan), 100, ("max_tokens_invalid",)),
    (RequestFacts(length=400, max_tokens=math.inf), 100, ("max_tokens_invalid",)),
    (RequestFacts(length=400, max_tokens="77"), 100, ("max_tokens_invalid",)),
    (RequestFacts(length=400, max_tokens=True), 100, ("max_tokens_invalid",)),
    (RequestFacts(length=None, max_tokens=10.0), 10, ("no_length",)),
])
def test_the_estimate_from_envoys_fields(facts: RequestFacts, output: int,
                                         fallbacks: tuple[str, ...]) -> None:
    est = estimate(facts, S)
    assert est.output == output
    assert est.input == (0 if facts.length is None else math.ceil(facts.length / 4))
    assert est.fallbacks == fallbacks


@pytest.mark.parametrize(("raw", "output", "fallbacks"), [
    (body(max_tokens=50), 50, ()),
    (body(max_tokens=50, max_completion_tokens=70), 70, ()),  # the newer name wins
    (body(max_completion_tokens=10**12), 1000, ("max_tokens_clamped",)),
    (body(max_tokens="lots"), 100, ("max_tokens_invalid",)),
    (body(max_tokens=-1), 100, ("max_tokens_invalid",)),
    (body(max_tokens=None), 100, ("max_tokens_missing",)),
    (body(), 100, ("max_tokens_missing",)),
    (b"not json at all", 100, ("not_json",)),
    (b"[1, 2, 3]", 100, ("not_json",)),
    (b'{"max_tokens": 5', 100, ("not_json",)),
    (b"[" * 100_000, 100, ("not_json",)),  # deeper than the parser goes
])
def test_the_estimate_from_a_body_sent_with_the_check(raw: bytes, output: int,
                                                      fallbacks: tuple[str, ...]) -> None:
    est = estimate(RequestFacts(length=len(raw), body=raw, max_tokens=999.0), S)
    assert (est.input, est.output, est.fallbacks) == (math.ceil(len(raw) / 4), output,
                                                       fallbacks)


# ------------------------------------------------------------------------ settlement

EST = Estimate(input=100, output=50)


@pytest.mark.parametrize(("usage", "amount", "reason"), [
    (Usage("90", "40", "130"), 130, None),
    (Usage("90", "40", None), 130, None),
    (Usage(None, None, "77"), 77, None),
    (Usage("0", "0", "0"), 0, None),
    (Usage("-90", "40", "130"), None, "usage_invalid"),
    (Usage("nan", "40", None), None, "usage_invalid"),
    (Usage("1.5", "40", None), None, "usage_invalid"),
    (Usage("1e5", "40", None), None, "usage_invalid"),
    (Usage("90", "40", "1000"), None, "usage_invalid"),  # contradicts itself
    (Usage("90", None, None), None, "usage_invalid"),  # half a block, no total
    (Usage("null", None, None), None, "usage_invalid"),
    (Usage(None, None, str(ABSURD_FACTOR * 150 + 1)), None, "usage_absurd"),
    (Usage(None, None, str(ABSURD_FACTOR * 150)), ABSURD_FACTOR * 150, None),
    (Usage(), None, "usage_missing"),
])
def test_usage_is_believed_only_when_it_is_a_consistent_count(
        usage: Usage, amount: int | None, reason: str | None) -> None:
    with_bytes = Usage(usage.prompt, usage.completion, usage.total, request_bytes=401,
                       response_bytes=10_000)
    got, why = settle_amount(with_bytes, EST, S)
    assert why == reason
    # Without a believable usage: the request's bytes, and the response's bytes but never
    # more output than was reserved for it.
    assert got == (amount if amount is not None else math.ceil(401 / 4) + 50)


def test_without_usage_a_short_response_is_charged_its_bytes() -> None:
    got, why = settle_amount(Usage(request_bytes=40, response_bytes=81), EST, S)
    assert (got, why) == (10 + 21, "usage_missing")


# -------------------------------------------------------------------------- the book

MINUTE = Window("minute", 60)
HOUR = Window("hour", 3600)


def book(*budgets: Budget, mode: str = "reserve") -> TokenBook:
    return TokenBook({"t": budgets}, TokenSettings(accounting=mode))


def test_the_table_names_every_move_and_nothing_else() -> None:
    b = book(Budget(MINUTE, 1000))
    v = b.reserve("t", Estimate(10, 10), "bulk", T0)
    assert isinstance(v, Allowed)
    r = v.reservation
    b.ended("x")  # no open reservation by that id: nothing moves
    with pytest.raises(IllegalMove):
        b._move(r, "settle")  # PENDING has no settle
    b.bind(r, "a")
    with pytest.raises(IllegalMove):
        b.cancel(r)
    with pytest.raises(IllegalMove):
        b.bind(r, "again")
    assert b.settle("a", 5, T0) is r and r.stage is Stage.SETTLED
    assert b.settle("a", 5, T0) == "unknown"  # once only
    for (stage, _), nxt in TRANSITIONS.items():
        assert stage not in {Stage.SETTLED, Stage.CANCELLED, Stage.CHARGED}
        assert nxt in Stage


def test_refused_over_settled_use_retries_at_the_end_of_the_period() -> None:
    b = book(Budget(MINUTE, 1000), Budget(HOUR, 5000))
    now = float(T0 + 15)
    v = b.reserve("t", Estimate(500, 400), "bulk", now)
    assert isinstance(v, Allowed)
    b.bind(v.reservation, "a")
    # While it runs, another does not fit: only its reservation is in the way.
    over = b.reserve("t", Estimate(100, 100), "bulk", now)
    assert isinstance(over, OverBudget) and over.retry_after == 1.0 and not over.never
    assert (over.window, over.used, over.reserved) == ("minute", 0, 900)
    b.settle("a", 950, now)
    over = b.reserve("t", Estimate(30, 30), "bulk", now + 1)
    assert isinstance(over, OverBudget) and over.retry_after == pytest.approx(44.0)
    # A request larger than the whole window never fits.
    never = b.reserve("t", Estimate(3000, 3000), "bulk", now)
    assert isinstance(never, OverBudget) and never.never
    assert never.window == "hour" and never.retry_after == pytest.approx(3600 - 15)
    # The next minute has room again; the hour remembers.
    v = b.reserve("t", Estimate(30, 30), "bulk", now + 45)
    assert isinstance(v, Allowed)
    got = {(r.window, r.used, r.reserved) for r in b.remaining(now + 45)}
    assert got == {("minute", 0, 60), ("hour", 950, 60)}


def test_a_tenant_without_budgets_is_never_refused_and_holds_nothing() -> None:
    b = book(Budget(MINUTE, 1))
    v = b.reserve("someone-else", Estimate(10**6, 10**6), "bulk", T0)
    assert isinstance(v, Allowed) and v.reservation.reserved == 0
    assert b.reserved_total() == 0


def test_shadow_reserves_and_reports_but_refuses_nothing() -> None:
    b = book(Budget(MINUTE, 10))
    v = b.reserve("t", Estimate(10, 10), "bulk", T0, enforce=False)
    assert isinstance(v, OverBudget) and v.reservation is not None
    assert b.reserved_total() == 20


def test_a_reload_keeps_use_and_reservations_and_a_lost_budget_gives_back_exactly() -> None:
    b = book(Budget(MINUTE, 1000), Budget(HOUR, 5000))
    r1 = b.reserve("t", Estimate(100, 100), "bulk", T0)
    r2 = b.reserve("t", Estimate(50, 50), "bulk", T0)
    assert isinstance(r1, Allowed) and isinstance(r2, Allowed)
    b.bind(r1.reservation, "a")
    b.settle("a", 150, T0)
    b.configure({"t": (Budget(HOUR, 6000),)}, TokenSettings())  # minute gone, hour raised
    assert [(w.window, w.limit, w.used, w.reserved) for w in b.remaining(T0)] == [
        ("hour", 6000, 150, 100)]
    b.configure({}, TokenSettings())  # every budget gone while r2 is pending
    b.cancel(r2.reservation)
    b.configure({"t": (Budget(HOUR, 6000),)}, TokenSettings())
    assert b.reserved_total() == 0  # nothing negative, nothing left over


def test_settle_only_sees_only_what_was_settled() -> None:
    b = book(Budget(MINUTE, 100), mode="settle_only")
    held = []
    for _ in range(10):  # a burst: nothing settles before every Check is decided
        v = b.reserve("t", Estimate(40, 40), "bulk", T0)
        assert isinstance(v, Allowed)
        held.append(v.reservation)
    assert b.reserved_total() == 0
    for i, r in enumerate(held):
        b.bind(r, str(i))
        b.settle(str(i), 80, T0)
    assert isinstance(b.reserve("t", Estimate(1, 1), "bulk", T0), OverBudget)


def test_an_admission_that_ended_without_its_entry_is_charged_its_estimate() -> None:
    b = book(Budget(MINUTE, 1000))
    v = b.reserve("t", Estimate(100, 200), "bulk", T0)
    assert isinstance(v, Allowed)
    b.bind(v.reservation, "a")
    assert b.charge("a", T0) is None  # only from ENDED
    b.ended("a")
    late = b.reserve("t", Estimate(1, 1), "bulk", T0)
    assert isinstance(late, Allowed)
    # A final entry while ENDED settles for real (a preempted request's comes late).
    b2 = book(Budget(MINUTE, 1000))
    v2 = b2.reserve("t", Estimate(100, 200), "bulk", T0)
    assert isinstance(v2, Allowed)
    b2.bind(v2.reservation, "a")
    b2.ended("a")
    assert b2.settle("a", 7, T0) is v2.reservation
    assert [w.used for w in b2.remaining(T0)] == [7]
    # Still none a sweep later: the estimate counts.
    assert b.charge("a", T0) is v.reservation
    assert [(w.used, w.reserved) for w in b.remaining(T0)] == [(300, 2)]
    assert b.settle("a", 1, T0) == "unknown"


# ------------------------------------------------------ the bound, on random bursts


@dataclass
class Req:
    est: Estimate
    actual: int


@st.composite
def schedules(draw: st.DrawFn) -> tuple[int, str, list[tuple[str, int]], list[Req]]:
    """A budget, an accounting mode, a random interleaving of arrivals ("a", i) and
    completions ("c", i) of requests whose actual use differs from the estimate, with the
    clock moving across minute periods."""
    n = draw(st.integers(1, 40))
    reqs = [Req(Estimate(draw(st.integers(0, 300)), draw(st.integers(0, 300))),
                draw(st.integers(0, 700))) for _ in range(n)]
    order: list[tuple[str, int]] = []
    pending = list(range(n))
    running: list[int] = []
    while pending or running:
        if pending and (not running or draw(st.booleans())):
            i = pending.pop(0)
            order.append(("a", i))
            running.append(i)
        else:
            i = running.pop(draw(st.integers(0, len(running) - 1)))
            order.append(("c", i))
    return draw(st.integers(0, 3000)), draw(st.sampled_from(["reserve", "settle_only"])), \
        order, reqs


@settings(max_examples=300, deadline=None)
@given(schedules(), st.lists(st.floats(0, 40), min_size=1, max_size=80))
def test_concurrent_requests_overshoot_by_no_more_than_their_estimates_error(
        sched: tuple[int, str, list[tuple[str, int]], list[Req]], steps: list[float]) -> None:
    """Ground truth kept here, per period: what was settled, what runs, what was
    admitted. Safety (reserve): at every admission the period's settled use plus every
    running request's estimate plus its own fits the budget, so the period's use never
    passes the budget by more than the estimate errors of the requests running at its
    last admission. Liveness: a refusal only where that sum would not fit. In settle_only
    only settled use counts (the overshoot the e2e test shows)."""
    budget, mode, order, reqs = sched
    b = TokenBook({"t": (Budget(MINUTE, budget),)}, TokenSettings(accounting=mode))
    now = float(T0)
    period = MINUTE.period(now)
    settled = 0  # this period's settled use, by the test's own sum
    running: dict[int, Req] = {}
    admitted_here: list[int] = []
    errors_at_last_admission = 0
    for step, (kind, i) in enumerate(order):
        now += steps[step % len(steps)]
        if MINUTE.period(now) != period:
            # What still runs was checked against an earlier period; its whole use may
            # land in this one before anything here is admitted.
            period, settled, admitted_here = MINUTE.period(now), 0, []
            errors_at_last_admission = sum(x.actual for x in running.values())
        r = reqs[i]
        if kind == "a":
            pending = sum(x.est.total for x in running.values()) if mode == "reserve" else 0
            fits = settled + pending + r.est.total <= budget
            v = b.reserve("t", r.est, "bulk", now)
            assert isinstance(v, Allowed) == fits, (settled, pending, r.est.total, budget)
            if fits:
                assert isinstance(v, Allowed)
                b.bind(v.reservation, str(i))
                running[i] = r
                admitted_here.append(i)
                errors_at_last_admission = sum(max(0, x.actual - x.est.total)
                                               for x in running.values())
            else:
                assert isinstance(v, OverBudget)
                assert v.retry_after >= 1.0 and v.retry_after <= period[1] - now + 1.0
        elif i in running:
            del running[i]
            assert b.settle(str(i), r.actual, now) is not None
            settled += r.actual
        # The book agrees with the test's own sums at every step.
        rows = list(b.remaining(now))
        assert [(w.used, w.reserved) for w in rows] == [
            (settled, sum(x.est.total for x in running.values()) if mode == "reserve" else 0)]
        if mode == "reserve" and not running:
            assert settled <= budget + errors_at_last_admission


# ------------------------------------------------------------------- the YAML


@pytest.mark.parametrize(("text", "key", "reason"), [
    ("tenant_policies: {a: {budgets: {fortnight: 5}}}", "tenant_policies.a.budgets.fortnight",
     "unknown window"),
    ("tenant_policies: {a: {budgets: {minute: -1}}}", "tenant_policies.a.budgets.minute",
     "between 0 and"),
    ("tenant_policies: {a: {budgets: {minute: 1.5}}}", "tenant_policies.a.budgets.minute",
     "must be an integer"),
    ("tenant_policies: {a: {budgets: {minute: '10'}}}", "tenant_policies.a.budgets.minute",
     "must be an integer"),
    ("tenant_policies: {a: {budgets: {minute: 10, 1m: 5}}}", "tenant_policies.a.budgets.1m",
     "the same window as 'minute'"),
    ("tenant_policies: {a: {budgets: {}}}", "tenant_policies.a.budgets", "non-empty mapping"),
    ("tenant_policies: {a: {budgets: [10]}}", "tenant_policies.a.budgets", "non-empty mapping"),
    ("tenant_policies: {a: {budgets: {" + ", ".join(f"{i}m: 1" for i in range(1, 10))
     + "}}}", "tenant_policies.a.budgets", "more than 8 windows"),
    ("tokens: {accounting: lazy}", "tokens.accounting", "one of: reserve, settle_only"),
    ("tokens: {budget_mode: soft}", "tokens.budget_mode", "one of: enforce, shadow"),
    ("tokens: {max_tokens: 5}", "tokens.max_tokens", "unknown key"),
    ("tokens: {default_max_tokens: 0}", "tokens.default_max_tokens", "between 1 and"),
    ("tokens: {default_max_tokens: 70000}", "tokens.default_max_tokens", "between 1 and"),
    ("tokens: {bytes_per_token: -2}", "tokens.bytes_per_token", "between 0.1 and 1000"),
    ("tokens: 7", "tokens", "mapping"),
    ("pools: {big: {tokens: {bytes_per_token: .inf}}}", "pools.big.tokens.bytes_per_token",
     "finite"),
])
def test_a_bad_budget_or_token_section_names_file_key_and_reason(text: str, key: str,
                                                                 reason: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_priority_config(text, "/etc/pg/priority.yaml")
    assert err.value.file == "/etc/pg/priority.yaml" and err.value.key == key
    assert reason in err.value.reason, err.value.reason


def test_token_accounting_is_on_where_the_file_asks_and_per_pool() -> None:
    assert parse_priority_config("classes: {}").tokens_for(DEFAULT_POOL) is None
    cfg = parse_priority_config(
        "tenant_policies: {a: {budgets: {minute: 10, month: 1000000}}}\n"
        "pools: {big: {tokens: {default_max_tokens: 9}}}")
    assert cfg.tokens_for(DEFAULT_POOL) == TokenSettings()
    assert cfg.tokens_for("big") == TokenSettings(default_max_tokens=9)
    assert [b.window.name for b in cfg.budgets["a"]] == ["minute", "month"]


# --------------------------------------------------------- over gRPC, whole sidecar

PRIORITY = """
tokens: {default_max_tokens: 100}
tenant_policies:
  acme: {budgets: {day: 1000}}
"""


class Harness:
    def __init__(self, app: Runtime, envoy: EnvoyStandIn) -> None:
        self.app = app
        self.envoy = envoy

    def sample(self, name: str, **labels: str) -> float:
        v = self.app.metrics.registry.get_sample_value(name, labels)
        return 0.0 if v is None else v

    async def check(self, tenant: str, length: int, max_tokens: object = None,
                    body: bytes | None = None) -> external_auth_pb2.CheckResponse:
        req = check_request({"x-smg-tenant": tenant, "content-length": str(length)})
        if max_tokens is not None:
            req.attributes.metadata_context.filter_metadata[
                codec.REQUEST_NAMESPACE].update({"max_tokens": max_tokens})
        if body is not None:
            req.attributes.request.http.raw_body = body
        resp: external_auth_pb2.CheckResponse = await self.envoy._check(req)
        return resp

    async def end(self, aid: str, usage: dict[str, object] | None = None,
                  req_bytes: int = 0, resp_bytes: int = 0) -> None:
        msg = als_pb2.StreamAccessLogsMessage()
        e = msg.http_logs.log_entry.add()
        cp = e.common_properties
        cp.access_log_type = accesslog_pb2.DownstreamEnd
        cp.metadata.filter_metadata[codec.AUTHZ_NAMESPACE].fields[
            codec.ADMISSION_ID_KEY].string_value = aid
        if usage is not None:
            cp.metadata.filter_metadata[codec.USAGE_NAMESPACE].update(usage)
        e.request.request_body_bytes = req_bytes
        e.response.response_body_bytes = resp_bytes
        e.response.response_code.value = 200
        await self.envoy._als(iter([msg]))

    def left(self) -> float:
        return self.sample("smg_sidecar_token_budget_remaining", tenant="acme", window="day")


@pytest.fixture
async def h(tmp_path: Path) -> AsyncIterator[Harness]:
    cfg = tmp_path / "priority.yaml"
    cfg.write_text(PRIORITY)
    app = await build_runtime(parse_settings([
        "--priority-scheduler-enabled", "--priority-scheduler-config", str(cfg),
        "--grpc-listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0",
        "--worker-capacity-override", "100", "--log-format", "json"]))
    await app.serve()
    harness = Harness(app, EnvoyStandIn(app.grpc_port))
    yield harness
    await harness.envoy.close()
    await app.stop()


def _denied(resp: external_auth_pb2.CheckResponse) -> tuple[int, dict[str, str], dict]:  # type: ignore[type-arg]
    d = resp.denied_response
    return (d.status.code, {o.header.key: o.header.value for o in d.headers},
            json.loads(d.body))


def _seconds_to_midnight() -> float:
    now = datetime.datetime.now(datetime.UTC)
    nxt = (now + datetime.timedelta(days=1)).replace(hour=0, minute=0, second=0, microsecond=0)
    return (nxt - now).total_seconds()


async def test_over_grpc_reserve_settle_refuse_with_the_windows_retry_after(h: Harness) -> None:
    if _seconds_to_midnight() < 30:
        pytest.skip("too close to the day window's end")  # its period would turn over
    # 400 bytes and max_tokens 100: 100 + 100 reserved. Usage settles it for 150.
    r1 = await h.check("acme", 400, 100.0)
    assert r1.status.code == 0
    assert h.left() == 800  # reserved while it runs
    await h.end(admission_id(r1), {"prompt_tokens": "110", "completion_tokens": "40",
                                   "total_tokens": "150"})
    assert h.left() == 850
    # A lying block (negative): the bytes Envoy logged (400 / 4 + min(100, 88 / 4)).
    r2 = await h.check("acme", 400, 100.0)
    await h.end(admission_id(r2), {"prompt_tokens": "-5", "completion_tokens": "9"},
                req_bytes=400, resp_bytes=88)
    assert h.left() == 850 - 122
    assert h.sample("smg_sidecar_token_fallback_total", reason="usage_invalid") == 1
    # 728 left: three of 200 fit (reserved at once), the fourth does not: Retry-After 1 s
    # (only running requests' reservations are in the way).
    held = [await h.check("acme", 400, 100.0) for _ in range(3)]
    assert all(r.status.code == 0 for r in held)
    status, headers, doc = _denied(await h.check("acme", 400, 100.0))
    assert status == 429 and headers["x-smg-error-code"] == "scheduler_token_budget_exceeded"
    assert headers["retry-after"] == "1" and headers["content-type"] == "application/json"
    assert doc["error"]["code"] == "scheduler_token_budget_exceeded" and "'day'" in doc[
        "error"]["message"]
    for r in held:  # no usage at all: charged their bytes, at most what was reserved
        await h.end(admission_id(r), None, req_bytes=400, resp_bytes=100_000)
    assert h.left() == 728 - 600
    # Now settled use alone leaves no room: Retry-After is the day's end.
    status, headers, _ = _denied(await h.check("acme", 400, 100.0))
    assert status == 429
    assert abs(int(headers["retry-after"]) - _seconds_to_midnight()) <= 2
    # Other tenants have no budget: never refused, never counted in acme's.
    assert (await h.check("beta", 10**9, 10**6)).status.code == 0
    assert h.sample("smg_sidecar_token_budget_refused_total", window="day", action="refused",
                    **{"class": "default"}) == 2
    assert h.sample("smg_sidecar_tenant_rejected_total", tenant="acme", outcome="over_budget",
                    **{"class": "default"}) == 2
    assert h.sample("smg_sidecar_token_fallback_total", reason="usage_missing") == 3
    assert h.sample("smg_sidecar_token_budget_exhausted", window="day") == 0
    assert h.app.pools[DEFAULT_POOL].book.reserved_total() == 0  # beta's counts nowhere


async def _harness(tmp_path: Path, text: str, *extra: str) -> Harness:
    cfg = tmp_path / "priority.yaml"
    cfg.write_text(text)
    app = await build_runtime(parse_settings([
        "--priority-scheduler-enabled", "--priority-scheduler-config", str(cfg),
        "--grpc-listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0",
        "--worker-capacity-override", "100", "--log-format", "json",
        "--config-poll-secs", "0.1", *extra]))
    await app.serve()
    return Harness(app, EnvoyStandIn(app.grpc_port))


SMALL = "tokens: {{budget_mode: {mode}}}\ntenant_policies:\n  acme: {{budgets: {{day: 300}}}}\n"


@pytest.mark.parametrize("how", ["budget_mode", "--shadow"])
async def test_shadow_admits_everything_and_reports_what_budgets_would_refuse(
        tmp_path: Path, how: str) -> None:
    if _seconds_to_midnight() < 30:
        pytest.skip("too close to the day window's end")
    mode = "shadow" if how == "budget_mode" else "enforce"
    h = await _harness(tmp_path, SMALL.format(mode=mode),
                       *(("--shadow",) if how == "--shadow" else ()))
    try:
        resps = [await h.check("acme", 400, 100.0) for _ in range(3)]  # 200 tokens each
        assert all(r.status.code == 0 for r in resps)
        assert h.sample("smg_sidecar_token_budget_refused_total", window="day",
                        action="counted", **{"class": "default"}) == 2
        assert h.sample("smg_sidecar_token_budget_refused_total", window="day",
                        action="refused", **{"class": "default"}) == 0
        if how == "--shadow":  # the would-be answer rides on the allow, for the access log
            md = [r.dynamic_metadata.fields for r in resps]
            assert [m["shadow_outcome"].string_value for m in md] == [
                "admitted", "over_budget", "over_budget"]
            assert md[1]["shadow_code"].string_value == "scheduler_token_budget_exceeded"
        assert h.left() == 300 - 600  # reserved all the same: the gauge shows the overshoot
        for r in resps:
            await h.end(admission_id(r), {"total_tokens": "100"})
        assert h.left() == 0
    finally:
        await h.envoy.close()
        await h.app.stop()


async def test_a_bad_budget_on_reload_is_refused_and_the_old_budgets_stay(
        tmp_path: Path) -> None:
    if _seconds_to_midnight() < 30:
        pytest.skip("too close to the day window's end")
    h = await _harness(tmp_path, SMALL.format(mode="enforce"))
    try:
        r = await h.check("acme", 400, 100.0)
        await h.end(admission_id(r), {"total_tokens": "150"})
        (tmp_path / "priority.yaml").write_text(
            "tenant_policies:\n  acme: {budgets: {day: -5}}\n")
        for _ in range(100):
            if h.sample("smg_sidecar_config_reload_total", result="error") >= 1:
                break
            await asyncio.sleep(0.05)
        assert h.sample("smg_sidecar_config_reload_total", result="error") >= 1
        assert h.left() == 150  # the old budget, and what was used under it
        assert (await h.check("acme", 400, 100.0)).status.code != 0  # 150 + 200 > 300
        # A good reload raising the amount keeps the day's use.
        (tmp_path / "priority.yaml").write_text(
            "tenant_policies:\n  acme: {budgets: {day: 1000}}\n")
        for _ in range(100):
            if h.sample("smg_sidecar_config_reload_total", result="ok") >= 1:
                break
            await asyncio.sleep(0.05)
        assert h.left() == 850
    finally:
        await h.envoy.close()
        await h.app.stop()
