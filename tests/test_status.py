"""The status page (/status, /status.json): what it shows is what happened.

Pure parts first (the rate window, URLs without user-info, the oldest wait in a core's
snapshot, shadow's summary against the counter it mirrors). Then whole sidecars over
real gRPC and the real admin port: random traffic (seed printed) whose outcomes the
client counts itself, and the page read back and compared with that count and with
``/metrics`` fetched at the same moment (the page read again after, unchanged, shows
nothing moved in between). Secrets, escaping, bounds, pools, shadow mode, reloads and a
fleet's ledger are each checked on the page. The browser test is in
tests/test_status_browser.py.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from html import escape
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
import redis.asyncio as redis
from prometheus_client.parser import text_string_to_metric_families
from structlog.testing import capture_logs

from devtools.fleet import Fleet
from devtools.httpclient import get as http_get
from devtools.valkey import ValkeyServer
from sidecar import logs as sidecar_logs
from sidecar.app import Runtime, build_runtime
from sidecar.capacity import CapacityReading, WorkerCapacity
from sidecar.classes import HIGH_TO_LOW, PriorityClass
from sidecar.codec import POOL_KEY
from sidecar.config import DEFAULT_POOL, parse_settings
from sidecar.coordination.credentials import PASSWORD_ENV
from sidecar.metrics import Metrics
from sidecar.scheduler import ClassSettings, LegacyAdmission, Scheduler
from sidecar.shadow import ShadowCore
from sidecar.status import MAX_TENANTS, MAX_WORKERS, RateWindow, public_url
from tests.clock import FakeClock
from tests.grpc_client import EnvoyStandIn, admission_id, check_request, headers_of

S, I, D, B = (PriorityClass.SYSTEM, PriorityClass.INTERACTIVE, PriorityClass.DEFAULT,
              PriorityClass.BULK)
CLASSES = [c.label for c in HIGH_TO_LOW]
CODES = {"scheduler_queue_full": "rejected_queue_full",
         "scheduler_queue_timeout": "rejected_queue_timeout"}
# Long timeouts and leases: nothing moves while the page and /metrics are read.
PRIORITY = """
classes:
  system: {reserved_floor: 1, queue_size: 2, queue_timeout_secs: 120}
  interactive: {reserved_floor: 0, reserved_per_slot: 0.0, queue_size: 2,
                queue_timeout_secs: 120}
  default: {reserved_per_slot: 0.0, queue_size: 2, queue_timeout_secs: 120}
  bulk: {queue_size: 3, queue_timeout_secs: 120}
"""
# Tenants whose names would break the HTML if they were not escaped.
HOSTILE = ['<script>alert("x")</script>', "a&b<i>", "'\"><img src=x onerror=alert(1)>"]


# ------------------------------------------------------------------------------ pure parts


def test_rate_window_rates_are_increases_over_the_window() -> None:
    w = RateWindow(window=60.0, step=5.0, min_secs=1.0)
    assert w.rates(0.0, {("k",): 5.0})(("k",)) is None  # nothing sampled yet
    w.observe(0.0, {("k",): 5.0})
    assert w.rates(0.5, {("k",): 6.0})(("k",)) is None  # too short to be a rate
    assert w.rates(10.0, {("k",): 25.0})(("k",)) == 2.0
    w.observe(3.0, {("k",): 100.0})  # within a step of the last sample: not kept
    for t in range(5, 200, 5):
        w.observe(float(t), {("k",): 10.0 * t, ("new",): float(t > 100) * 7})
    rate = w.rates(200.0, {("k",): 2000.0, ("new",): 7.0})
    assert rate(("k",)) == 10.0  # the base is the oldest sample inside the window
    assert rate(("new",)) == 0.0 and rate(("gone",)) == 0.0
    assert w.covered(200.0) == 65.0 and RateWindow().covered(5.0) == 0.0
    w2 = RateWindow(window=60.0, step=5.0)
    w2.observe(0.0, {("c",): 50.0})
    assert w2.rates(10.0, {("c",): 10.0})(("c",)) == 0.0  # a reset counter: never negative


def test_public_url_drops_user_info_only() -> None:
    assert public_url("http://u:p%40ss@host:8000/v1?x=1") == "http://host:8000/v1?x=1"
    assert public_url("http://token@[::1]:9/") == "http://[::1]:9/"
    assert public_url("http://127.0.0.1:8080") == "http://127.0.0.1:8080"
    assert public_url("http://[bad") == "<unparsable url>"


CFG = {c: ClassSettings(0, 0.0, 3, 100.0, 1000.0, c in (S, I)) for c in PriorityClass}


@pytest.mark.parametrize("core", ["scheduler", "legacy"])
def test_snapshot_says_how_long_each_class_oldest_waiter_has_waited(core: str) -> None:
    clock = FakeClock()
    c = (Scheduler(CFG, 1, clock) if core == "scheduler" else
         LegacyAdmission(limit=1, queue_size=5, queue_timeout_secs=100.0, clock=clock))
    c.arrive("held", B, "t")
    assert all(s.oldest_wait == 0.0 for s in c.snapshot().classes.values())
    c.arrive("b1", B, "t")
    clock.advance(2.0)
    c.arrive("d1", D, "t")
    c.arrive("b2", B, "t")
    clock.advance(1.5)
    waits = {cls: s.oldest_wait for cls, s in c.snapshot().classes.items()}
    assert waits == {S: 0.0, I: 0.0, D: 1.5, B: 3.5}


def test_shadow_summary_totals_are_the_counters_and_its_line_names_the_refused() -> None:
    seed = random.randrange(1 << 30)
    print(f"seed={seed}")
    rng = random.Random(seed)
    clock = FakeClock()
    metrics = Metrics(tenant_top_n=32)
    armed: list[tuple[float, Any]] = []
    summary = sidecar_logs.ShadowSummary(sidecar_logs.get("t"), interval=60.0, clock=clock,
                                         schedule=lambda d, fn: armed.append((d, fn)))
    shadow = ShadowCore(Scheduler(CFG, 3, clock), clock, metrics.pool(DEFAULT_POOL),
                        summary=summary)
    live: list[str] = []
    for i in range(400):
        op = rng.random()
        if op < 0.55:
            aid = f"r{i}"
            shadow.arrive(aid, rng.choice(list(PriorityClass)), rng.choice(["a", "b", "c"]))
            live.append(aid)
            if rng.random() < 0.5:
                shadow.mark_preemptible(aid)
        elif op < 0.85 and live:
            shadow.release(live.pop(rng.randrange(len(live))))
        else:
            clock.advance(rng.uniform(0, 40))
            shadow.tick()
    counted = {(ls["class"], ls["outcome"]): int(v) for fam in metrics.registry.collect()
               if fam.name == "smg_sidecar_shadow_admit" for s in fam.samples
               for ls, v in [(s.labels, s.value)] if v}
    assert summary.totals == counted
    refused = {c: sum(n for (cl, o), n in counted.items() if cl == c
                      and o in ("rejected_queue_full", "rejected_queue_timeout"))
               for c in CLASSES}
    by_tenant: Counter[str] = Counter()
    for (c, _), n in summary.refused_by_tenant.items():
        by_tenant[c] += n
    assert {c: by_tenant[c] for c in CLASSES} == refused
    assert sum(refused.values()) > 0, "the run refused nothing: not a test of refusals"
    assert len(armed) == 1 and armed[0][0] == 60.0  # one flush armed for the interval
    with capture_logs() as lines:
        armed.pop()[1]()
        summary.flush()  # nothing since: no second line
    (line,) = lines
    assert line["event"] == "shadow_verdicts" and line["decided"] == sum(counted.values())
    for c in CLASSES:
        decided = refused[c] + counted.get((c, "admitted"), 0)
        assert line["would_refuse_pct"].get(c, 0.0) == (
            round(100 * refused[c] / decided, 3) if decided else 0.0)
    assert sum(line["top_refused_tenants"].values()) <= sum(refused.values())
    assert line["would_preempt"] == {c: n for (c, o), n in sorted(counted.items())
                                     if o == "preempted"}


# --------------------------------------------------------------------- a sidecar, in process


@dataclass
class Truth:
    """What the client saw, counted outside the sidecar."""

    outcomes: Counter[tuple[str, str]] = field(default_factory=Counter)  # (class, outcome)
    refused: Counter[tuple[str, str]] = field(default_factory=Counter)  # (class, tenant)
    released: Counter[str] = field(default_factory=Counter)
    pending: dict[str, list[tuple[float, asyncio.Task[Any]]]] = field(default_factory=dict)


class Sidecar:
    def __init__(self, app: Runtime) -> None:
        self.app = app
        self.envoy = EnvoyStandIn(app.grpc_port)
        self.tasks: list[asyncio.Future[None]] = []  # the traffic's Checks

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.app.http_port}"

    async def get(self, path: str) -> tuple[int, bytes]:
        return await http_get(self.base + path, 10.0)

    async def view(self) -> dict[str, Any]:
        status, body = await self.get("/status.json")
        assert status == 200, body
        doc: dict[str, Any] = json.loads(body)
        return doc

    async def metrics(self) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
        status, body = await self.get("/metrics")
        assert status == 200
        return {(s.name, frozenset(s.labels.items())): s.value
                for fam in text_string_to_metric_families(body.decode()) for s in fam.samples}

    async def same_moment(self) -> tuple[dict[str, Any], dict[Any, float]]:
        """The page and /metrics with nothing moving in between (the page read again
        after is the same but for its clock and rates)."""
        first = await self.view()
        m = await self.metrics()
        again = await self.view()
        assert _still(first) == _still(again), "something moved while reading"
        return first, m


def _still(view: dict[str, Any]) -> Any:
    """The view without what changes with time alone."""
    drop = {"generated_at", "uptime_secs", "rate_window_secs", "rates", "rate",
            "would_be_rates", "oldest_wait_secs"}

    def strip(x: Any) -> Any:
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items() if k not in drop}
        if isinstance(x, list):
            return [strip(v) for v in x]
        return x
    return strip(view)


@pytest.fixture
async def start(tmp_path: Path) -> AsyncIterator[Any]:
    started: list[Sidecar] = []

    async def factory(*args: str, priority: str = PRIORITY) -> Sidecar:
        cfg = tmp_path / "priority.yaml"
        cfg.write_text(priority)
        app = await build_runtime(parse_settings([
            "--priority-scheduler-enabled", "--priority-scheduler-config", str(cfg),
            "--grpc-listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0",
            "--log-format", "json", "--priority-scheduler-default-max-class", "system",
            "--admission-lease-secs", "300", *args]))
        await app.serve()
        started.append(Sidecar(app))
        return started[-1]

    yield factory
    for s in started:
        await s.envoy.close()
        await s.app.stop()


def metric(m: Mapping[tuple[str, frozenset[tuple[str, str]]], float], name: str,
           **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, ls), v in m.items() if n == name and want <= ls)


def assert_page_is_the_metrics(view: dict[str, Any], m: Mapping[Any, float],
                               pooled: bool) -> None:
    """Every number the page takes from a metric is that metric's value."""
    assert view["config"]["generation"] == metric(m, "smg_sidecar_config_generation")
    assert metric(m, "smg_sidecar_config_info", sha256=view["config"]["sha256"]) == 1
    for p in view["pools"]:
        pl = {"pool": p["name"]} if pooled else {}
        assert metric(m, "smg_sidecar_capacity", **pl) == p["capacity"]
        assert metric(m, "smg_sidecar_admission_mode", **pl, mode=p["mode"]) == 1
        assert metric(m, "smg_sidecar_capacity_source", **pl, source=p["capacity_source"]) == 1
        assert metric(m, "smg_sidecar_preemption_suspended", **pl) == p["preemption_suspended"]
        for c in p["classes"]:
            cl = {**pl, "class": c["class"]}
            assert metric(m, "smg_scheduler_inflight", **cl) == c["inflight"], c
            assert metric(m, "smg_scheduler_queue_depth", **cl) == c["queued"], c
            assert metric(m, "smg_scheduler_queue_size_limit", **cl) == c["queue_limit"], c
            assert metric(m, "smg_sidecar_reserved_slots", **cl) == c["reserved"], c
            for o, n in c["totals"].items():
                assert metric(m, "smg_scheduler_admit_total", **cl, outcome=o) == n, (c, o)
        for w in p["workers"]:
            assert metric(m, "smg_sidecar_worker_capacity", engine=w["engine"]) >= w["capacity"]
    rows = view["tenants_refused"]["top"]
    for r in rows:
        assert metric(m, "smg_sidecar_tenant_rejected_total", **{"class": r["class"]},
                      tenant=r["tenant"]) == r["total"], r
    if not view["tenants_refused"]["not_listed"]:
        assert sum(r["total"] for r in rows) == metric(m, "smg_sidecar_tenant_rejected_total")


def assert_top_tenants(shown: dict[str, Any], truth: Counter[tuple[str, str]],
                       seed: int) -> None:
    """The (class, tenant) pairs refused most, each with the client's count, at most
    MAX_TENANTS of them and the rest counted (all refused within the rate window, so the
    rate orders them as their totals do)."""
    rows = shown["top"]
    assert len(rows) == min(MAX_TENANTS, len(truth))
    assert shown["not_listed"] == len(truth) - len(rows)
    for r in rows:
        assert r["total"] == truth[(r["class"], r["tenant"])], (r, seed)
    assert sorted((r["total"] for r in rows), reverse=True) == sorted(
        truth.values(), reverse=True)[:len(rows)], seed


async def _traffic(s: Sidecar, rng: random.Random, truth: Truth, n: int,
                   tenants: list[str], pool: str = "") -> None:
    """``n`` Checks of random classes and tenants, some admitted ones ended at random; each
    outcome counted from the answer the client got."""
    held: list[str] = []

    async def one(cls: str, tenant: str) -> None:
        req = check_request({"x-smg-priority": cls, "x-smg-tenant": tenant})
        if pool:
            req.attributes.context_extensions[POOL_KEY] = pool
        task = asyncio.ensure_future(s.envoy._check(req))
        truth.pending.setdefault(cls, []).append((time.monotonic(), task))
        try:
            r = await task
        except asyncio.CancelledError:
            truth.outcomes[(cls, "client_cancelled")] += 1
            truth.refused[(cls, tenant)] += 1
            return
        finally:
            truth.pending[cls] = [(t, x) for t, x in truth.pending[cls] if x is not task]
        if r.status.code == grpc.StatusCode.OK.value[0]:
            truth.outcomes[(cls, "admitted")] += 1
            held.append(admission_id(r))
            return
        code = headers_of(r.denied_response.headers)["x-smg-error-code"]
        truth.outcomes[(cls, CODES[code])] += 1
        truth.refused[(cls, tenant)] += 1

    tasks = []
    for _ in range(n):
        tasks.append(asyncio.ensure_future(one(rng.choice(CLASSES), rng.choice(tenants))))
        await asyncio.sleep(0)
        if held and rng.random() < 0.3:
            aid = held.pop(rng.randrange(len(held)))
            await s.envoy.log((aid, "end"))
            truth.released[aid] += 1
    await asyncio.wait(tasks, timeout=0.5)  # the rest wait in their queues
    s.tasks.extend(tasks)


async def _settled(s: Sidecar, *truths: Truth) -> None:
    """Every Check still open is queued (none is still on its way in)."""
    deadline = time.monotonic() + 20
    while True:
        queued = sum(p.controller.snapshot().classes[c].queue_depth
                     for p in s.app.pools for c in HIGH_TO_LOW)
        if queued == sum(len(v) for t in truths for v in t.pending.values()):
            return
        assert time.monotonic() < deadline, "the open Checks never all reached a queue"
        await asyncio.sleep(0.02)


async def test_the_page_shows_what_the_client_saw_and_what_metrics_say(start: Any) -> None:
    seed = random.randrange(1 << 30)
    print(f"seed={seed}")
    rng = random.Random(seed)
    s = await start("--worker-capacity-override", "4")
    truth = Truth()
    tenants = ["acme", "globex", *HOSTILE]
    await _traffic(s, rng, truth, 60, tenants)
    await _settled(s, truth)
    before = time.monotonic()
    view, m = await s.same_moment()
    after = time.monotonic()
    assert_page_is_the_metrics(view, m, pooled=False)
    (p,) = view["pools"]
    assert (p["name"], p["mode"], p["capacity"], p["capacity_source"]) == (
        DEFAULT_POOL, "scheduler", 4, "override")
    assert p["fallback"] is None and not p["preemption_suspended"]
    admitted = Counter({c: n for (c, o), n in truth.outcomes.items() if o == "admitted"})
    for c in p["classes"]:
        cls = c["class"]
        for o in ("admitted", "rejected_queue_full"):
            assert c["totals"][o] == truth.outcomes[(cls, o)], (cls, o, seed)
        pending = truth.pending.get(cls, [])
        assert c["queued"] == len(pending), (cls, seed)
        if pending:  # the oldest waiter queued after it was sent and before we settled
            oldest_sent = min(t for t, _ in pending)
            assert before - oldest_sent - 0.5 <= c["oldest_wait_secs"] <= after - oldest_sent
        else:
            assert c["oldest_wait_secs"] == 0.0
    ended = sum(truth.released.values())
    assert all(n == 1 for n in truth.released.values())
    assert sum(c["inflight"] for c in p["classes"]) == sum(admitted.values()) - ended
    assert_top_tenants(view["tenants_refused"], truth.refused, seed)
    assert sum(truth.refused.values()) > 0, "nothing refused: not a test of refusals"

    # Clients leave while queued: cancelled, by tenant, on the page and in the metrics.
    for tasks in list(truth.pending.values()):
        for _, t in tasks:
            t.cancel()
    await asyncio.wait(s.tasks, timeout=10)
    deadline = time.monotonic() + 10
    while sum(c["queued"] for c in (await s.view())["pools"][0]["classes"]):
        assert time.monotonic() < deadline, "cancelled Checks still queued"
        await asyncio.sleep(0.02)
    view, m = await s.same_moment()
    assert_page_is_the_metrics(view, m, pooled=False)
    for c in view["pools"][0]["classes"]:
        assert c["totals"]["client_cancelled"] == truth.outcomes[(c["class"],
                                                                  "client_cancelled")]
    assert_top_tenants(view["tenants_refused"], truth.refused, seed)
    rows = view["tenants_refused"]["top"]

    # The HTML: every tenant name escaped, never raw; no script; the numbers shown.
    status, body = await s.get("/status")
    html = body.decode()
    assert status == 200 and "<script" not in html and "<img" not in html
    assert any(r["tenant"] in HOSTILE for r in rows), "no hostile tenant shown: no test"
    for r in rows:
        assert f"<td>{escape(r['tenant'], quote=True)}</td>" in html, r
    assert 'http-equiv="refresh"' in html
    for c in view["pools"][0]["classes"]:
        assert f"<td>{c['class']}</td>" in html


async def test_pools_each_their_own_section_with_their_own_series(start: Any) -> None:
    seed = random.randrange(1 << 30)
    print(f"seed={seed}")
    rng = random.Random(seed)
    s = await start("--worker-urls", "http://127.0.0.1:9", "big=http://127.0.0.1:9",
                    "--worker-capacity-override", "3")
    truths = {DEFAULT_POOL: Truth(), "big": Truth()}
    for name, truth in truths.items():
        await _traffic(s, rng, truth, 30, ["acme", "globex"], pool=name)
    await _settled(s, *truths.values())
    view, m = await s.same_moment()
    assert [p["name"] for p in view["pools"]] == [DEFAULT_POOL, "big"]
    assert_page_is_the_metrics(view, m, pooled=True)
    for p in view["pools"]:
        truth = truths[p["name"]]
        for c in p["classes"]:
            assert c["totals"]["admitted"] == truth.outcomes[(c["class"], "admitted")], seed
            assert c["queued"] == len(truth.pending.get(c["class"], [])), seed
    for truth in truths.values():
        for tasks in truth.pending.values():
            for _, t in tasks:
                t.cancel()
    await asyncio.wait(s.tasks, timeout=10)


async def test_shadow_verdicts_on_the_page_are_the_shadow_counters(start: Any) -> None:
    s = await start("--worker-capacity-override", "2", "--shadow",
                    priority=PRIORITY.replace("reserved_floor: 1", "reserved_floor: 0"))
    calls = []
    for i in range(12):  # nothing is refused or waits: each allow carries its verdict
        tenant = "noisy" if i % 3 else "quiet"
        calls.append(await s.envoy.check({"x-smg-priority": "bulk", "x-smg-tenant": tenant}))
    assert all(c.status.code == 0 for c in calls)
    verdicts = Counter(c.dynamic_metadata.fields["shadow_outcome"].string_value for c in calls)
    # 2 would be admitted, 3 queued (bulk's queue), the rest refused as the queue was full.
    assert verdicts == {"admitted": 2, "queued": 3, "rejected_queue_full": 7}
    view, m = await s.same_moment()
    assert view["modes"]["shadow"] is True
    shadow = view["pools"][0]["shadow"]
    bulk = next(c for c in shadow["classes"] if c["class"] == "bulk")
    for o, n in bulk["would_be"].items():
        assert metric(m, "smg_sidecar_shadow_admit_total", **{"class": "bulk"},
                      outcome=o) == n, o
    assert bulk["would_be"]["rejected_queue_full"] == 7 and bulk["would_be"]["admitted"] == 2
    assert bulk["would_be_queued"] == 3 == metric(m, "smg_sidecar_shadow_queue_depth",
                                                  **{"class": "bulk"})
    assert bulk["real_admitted"] == 12 and bulk["real_inflight"] == 12
    assert bulk["would_refuse_pct"] == round(100 * 7 / 9, 3)
    refused = {t["tenant"]: t["would_refuse"] for t in shadow["refused_tenants"]}
    noisy = sum(1 for i in range(12) if i % 3 and i >= 5)  # calls 5.. are past the queue
    assert refused == {"noisy": noisy, "quiet": 7 - noisy}
    status, body = await s.get("/status")
    assert status == 200 and b"SHADOW MODE" in body and b"77.778%" in body


async def test_reloads_and_the_config_in_force(start: Any, tmp_path: Path) -> None:
    s = await start("--worker-capacity-override", "4")
    view = await s.view()
    cfg = view["config"]
    assert cfg["path"] == str(tmp_path / "priority.yaml") and cfg["last_reload"] is None
    assert cfg["generation"] == 1
    (tmp_path / "priority.yaml").write_text(PRIORITY + "  ghost: {}\n")
    assert not await s.app.reload_now()
    view = await s.view()
    last = view["config"]["last_reload"]
    assert last["result"] == "error" and "ghost" in last["error"]
    assert view["config"]["reloads_failed"] == 1 and view["config"]["generation"] == 1
    (tmp_path / "priority.yaml").write_text(PRIORITY.replace("queue_size: 3", "queue_size: 9"))
    assert await s.app.reload_now()
    view, m = await s.same_moment()
    assert_page_is_the_metrics(view, m, pooled=False)
    last = view["config"]["last_reload"]
    assert last["result"] == "ok" and last["sha256"] == view["config"]["sha256"]
    assert view["config"]["generation"] == 2
    bulk = next(c for c in view["pools"][0]["classes"] if c["class"] == "bulk")
    assert bulk["queue_limit"] == 9


async def test_bounded_in_size_whatever_the_tenants_and_workers(start: Any) -> None:
    s = await start("--worker-capacity-override", "1", "--priority-scheduler-tenant-metric-top-n",
                    "2000", priority=PRIORITY.replace("queue_size: 3", "queue_size: 0")
                    .replace("reserved_floor: 1", "reserved_floor: 0"))
    held = await s.envoy.check({"x-smg-priority": "bulk", "x-smg-tenant": "first"})
    assert held.status.code == 0
    await asyncio.gather(*(s.envoy.check({"x-smg-priority": "bulk", "x-smg-tenant": f"t{i}"})
                           for i in range(300)))
    pool = s.app.pools[DEFAULT_POOL]
    many = tuple(WorkerCapacity(f"http://10.0.{i // 250}.{i % 250}:8000", "vllm", 1)
                 for i in range(150))
    pool.on_capacity(CapacityReading(150, "workers", healthy=150, total=150, workers=many))
    view = await s.view()
    p = view["pools"][0]
    assert len(p["workers"]) == MAX_WORKERS and p["workers_not_listed"] == 150 - MAX_WORKERS
    tenants = view["tenants_refused"]
    assert len(tenants["top"]) == MAX_TENANTS and tenants["not_listed"] == 300 - MAX_TENANTS
    _, body = await s.get("/status.json")
    _, page = await s.get("/status")
    assert len(body) < 64 * 1024 and len(page) < 96 * 1024, (len(body), len(page))


async def test_read_only_and_no_secret_on_the_page(start: Any, tmp_path: Path) -> None:
    secret_key = "sk-WORKER-KEY-0123456789"
    (tmp_path / "worker.key").write_text(secret_key + "\n")
    fleet = Fleet(2, max_running_requests=2)
    await fleet.start()
    try:
        urls = [u.replace("http://", "http://admin:url-PASSWORD-42@") for u in fleet.urls]
        # The key in a header of its own: aiohttp refuses user-info and an Authorization
        # header together.
        s = await start("--worker-urls", *urls, "--worker-auth-file",
                        str(tmp_path / "worker.key"), "--worker-auth-header", "x-api-key",
                        "--worker-auth-allow-http", "--health-interval-secs", "0.2")
        held = await s.envoy.check({"x-smg-priority": "default", "x-smg-tenant": "acme"})
        aid = admission_id(held)
        for path in ("/status", "/status.json"):
            status, body = await s.get(path)
            text = body.decode()
            assert status == 200
            for secret in (secret_key, "url-PASSWORD-42", aid):
                assert secret not in text, (path, secret)
        view = await s.view()
        assert sorted(w["url"] for w in view["pools"][0]["workers"]) == sorted(fleet.urls)
        for method in ("POST", "PUT", "DELETE"):
            async with (aiohttp.ClientSession() as c,
                        c.request(method, s.base + "/status") as r):
                assert r.status == 405
        status, _ = await s.get("/status.json?x=1")  # a query changes nothing
        assert status == 200
        await s.envoy.log((aid, "end"))
    finally:
        await fleet.stop()


async def test_headers_keep_the_page_inert(start: Any) -> None:
    s = await start("--worker-capacity-override", "1")
    async with aiohttp.ClientSession() as c:
        for path, ctype in (("/status", "text/html"), ("/status.json", "application/json")):
            async with c.get(s.base + path) as r:
                assert r.status == 200
                assert r.headers["Content-Type"].startswith(ctype)
                assert r.headers["Cache-Control"] == "no-store"
                assert r.headers["X-Content-Type-Options"] == "nosniff"
                assert "default-src 'none'" in r.headers["Content-Security-Policy"]
                assert "script-src" not in r.headers["Content-Security-Policy"]


# ------------------------------------------------------------------------ a fleet's ledger


@pytest.fixture(scope="module")
def valkey(tmp_path_factory: pytest.TempPathFactory) -> Any:
    server = ValkeyServer(tmp_path_factory.mktemp("valkey-status"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


async def test_a_fleets_ledger_on_the_page_without_its_password(
        start: Any, valkey: ValkeyServer, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    secret = "ledger-PASSWORD-77"
    monkeypatch.delenv(PASSWORD_ENV, raising=False)
    admin = redis.Redis(port=valkey.port, decode_responses=True)
    await admin.execute_command("ACL", "SETUSER", "fleet", "reset", "on", f">{secret}",
                                "~*", "&*", "+@all")
    await admin.aclose()
    (tmp_path / "pw").write_text(secret + "\n")
    s = await start("--worker-capacity-override", "4", "--coordination-url",
                    f"redis://fleet@127.0.0.1:{valkey.port}/0", "--coordination-password-file",
                    str(tmp_path / "pw"), "--fleet-id", "status-test", "--replica-id", "r1",
                    "--replica-ttl-secs", "2")
    deadline = time.monotonic() + 20
    while (view := await s.view())["pools"][0]["fleet"]["live_replicas"] < 1:
        assert time.monotonic() < deadline, "the replica never saw itself in the ledger"
        await asyncio.sleep(0.1)
    fleet = view["pools"][0]["fleet"]
    assert fleet["state"] == "ok" and fleet["fleet_capacity"] == 4
    assert view["fleet"]["fleet_id"] == "status-test" and view["modes"]["coordination"] == "fleet"
    for path in ("/status", "/status.json"):
        _, body = await s.get(path)
        assert secret.encode() not in body and b"redis://" not in body
    m = await s.metrics()
    assert metric(m, "smg_sidecar_live_replicas") == fleet["live_replicas"]


async def test_before_the_runtime_is_built_the_page_says_starting() -> None:
    from prometheus_client import CollectorRegistry

    from sidecar.adminhttp import AdminServer

    admin = AdminServer(CollectorRegistry(), lambda: False)
    port = await admin.start("127.0.0.1", 0)
    try:
        for path in ("/status", "/status.json"):
            status, body = await http_get(f"http://127.0.0.1:{port}{path}", 5.0)
            assert (status, body) == (503, b"starting\n")
    finally:
        await admin.stop()


def test_the_tenant_rejection_series_are_capped_like_every_tenant_label() -> None:
    m = Metrics(tenant_top_n=2)
    for i in range(6):
        for _ in range(i + 1):
            m.tenant_rejected(B, f"t{i}", "rejected_queue_full")
    m.tenant_rejected(S, "t0", "rate_limited")
    got = {(s.labels["class"], s.labels["tenant"], s.labels["outcome"]): s.value
           for fam in m.registry.collect() if fam.name == "smg_sidecar_tenant_rejected"
           for s in fam.samples}
    assert got == {("bulk", "t0", "rejected_queue_full"): 1.0,
                   ("bulk", "t1", "rejected_queue_full"): 2.0,
                   ("bulk", "other", "rejected_queue_full"): 3.0 + 4 + 5 + 6,
                   ("system", "t0", "rate_limited"): 1.0}
