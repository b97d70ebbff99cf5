"""The dashboard and the alert rules, checked against what real sidecars export.

Two sidecar processes run (``python -m sidecar``) with traffic over real gRPC: one without
named pools (real fake workers, one refusing its probes, ``--edge-shed``), one with pools
and ``--shadow``. Their ``/metrics`` are scraped, and every expression of
k8s/dashboard.json and k8s/overlays/servicemonitor/prometheusrule.yaml is checked:

* ``promtool check rules`` parses every dashboard expression (as a recording rule, with
  Grafana's variables filled in), so a panel's PromQL is valid;
* every metric an expression names is a family a sidecar exported, and every label it
  selects on or groups by is a label of that metric's series (or a label Prometheus adds
  to a target: instance, job, namespace, pod);
* ``promtool test rules``, fed the scraped series, evaluates ``absent(selector)`` for
  every selector: empty means the selector matches series the sidecars really export, as
  Prometheus' own engine matches them (regexes and all). Once with the variables at All
  and once with one instance and one named pool, so a pooled panel really filters by pool.

A selector whose metric only a fleet exports (``--coordination-url``) or that counts only
on a fault is checked by name and documented labels only (docs/reference.md): listed in
:data:`NOT_SCRAPED`, and a listed one that does show up fails the test (the list stays
true).
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from envoy.data.accesslog.v3 import accesslog_pb2
from envoy.service.accesslog.v3 import als_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from google.protobuf import struct_pb2
from prometheus_client.parser import text_string_to_metric_families

from devtools.fleet import Fleet
from devtools.httpclient import get as http_get
from sidecar import codec
from sidecar.classes import PriorityClass
from sidecar.codec import POOL_KEY
from sidecar.edge import STREAM_MARK_KEY, route_name
from tests import test_alerts
from tests.grpc_client import EnvoyStandIn, admission_id, check_request
from tests.sidecar_proc import SidecarProcess
from tests.test_alerts import _MATCHER, _SELECTOR, _rules
from tests.test_docs import reference, table_rows
from tests.test_k8s import _dashboard_exprs
from tests.test_metrics import documented

promtool = test_alerts.promtool  # the same fixture: a skip without promtool, a failure in CI

# Labels Prometheus adds to every scraped series (or the Operator's relabelling does).
TARGET_LABELS = frozenset({"instance", "job", "namespace", "pod", "le"})
# Series that neither sidecar below exports: a fleet's (valkey), or a fault's counter.
NOT_SCRAPED = frozenset({
    "smg_sidecar_coordination_state", "smg_sidecar_fleet_collision_total",
    "smg_sidecar_fleet_inflight",
})
PRIORITY = """
classes:
  system: {reserved_floor: 0, queue_size: 1, queue_timeout_secs: 30}
  interactive: {reserved_floor: 0, reserved_per_slot: 0.0, queue_size: 1,
                queue_timeout_secs: 30, starvation_threshold_secs: 0.2}
  default: {reserved_per_slot: 0.0, queue_size: 1, queue_timeout_secs: 30,
            starvation_threshold_secs: 0.2}
  bulk: {queue_size: 1, queue_timeout_secs: 30, starvation_threshold_secs: 0.2}
tenant_policies:
  t1: {max_class: default}
  t2: {budgets: {day: 300}}
"""


@dataclass
class Scrape:
    instance: str
    text: str
    families: set[str] = field(default_factory=set)  # sample names a family may have
    series: list[tuple[str, dict[str, str], float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"),
                    "gauge": ("",), "unknown": ("",)}
        for fam in text_string_to_metric_families(self.text):
            self.families.update(fam.name + s for s in suffixes.get(fam.type, ("",)))
            for s in fam.samples:
                self.series.append((s.name, dict(s.labels), s.value))


def request_headers(aid: str) -> bytes:
    """The ext_proc message Envoy sends first for an admitted request (its id in the
    ext_authz metadata)."""
    r = ep.ProcessingRequest(request_headers=ep.HttpHeaders())
    md = struct_pb2.Struct()
    md.update({codec.ADMISSION_ID_KEY: aid})
    r.metadata_context.filter_metadata[codec.AUTHZ_NAMESPACE].CopyFrom(md)
    return bytes(r.SerializeToString())


def _burst(envoy: EnvoyStandIn, pools: tuple[str, ...]) -> list[Any]:
    """Checks of every class from two tenants (t1's capped at default: clamps) per pool."""
    calls = []
    for pool in pools:
        for cls in ("system", "interactive", "default", "bulk"):
            for i in range(4):
                req = check_request({"x-smg-priority": cls, "x-smg-tenant": f"t{i % 2}"})
                if pool:
                    req.attributes.context_extensions[POOL_KEY] = pool
                calls.append(envoy._check(req))
    return calls


async def _preempt(envoy: EnvoyStandIn, capacity: int, *, shadow: bool = False,
                   pool: str = "") -> None:
    """Fill the capacity with bulk, open one's ext_proc stream (it may be preempted), and
    send a system request: the bulk one is preempted (in shadow mode, would have been)."""
    def req(cls: str) -> Any:
        r = check_request({"x-smg-priority": cls, "x-smg-tenant": "t0"})
        if pool:
            r.attributes.context_extensions[POOL_KEY] = pool
        return envoy._check(r)

    held = [await req("bulk") for _ in range(capacity)]
    assert all(r.status.code == 0 for r in held)
    outgoing: asyncio.Queue[bytes | None] = asyncio.Queue()

    async def requests() -> AsyncIterator[bytes]:
        while (m := await outgoing.get()) is not None:
            yield m

    stream = envoy.channel.stream_stream(
        "/envoy.service.ext_proc.v3.ExternalProcessor/Process",
        request_serializer=lambda b: b, response_deserializer=ep.ProcessingResponse.FromString,
    )(requests())
    await outgoing.put(request_headers(admission_id(held[0])))
    assert (await asyncio.wait_for(stream.read(), 10)).WhichOneof("response") == \
        "request_headers"
    assert (await req("system")).status.code == 0
    if not shadow:
        assert (await asyncio.wait_for(stream.read(), 10)).WhichOneof("response") == \
            "immediate_response", "the bulk request was not preempted"
    await outgoing.put(None)
    stream.cancel()
    await envoy.log(*((admission_id(r), "end") for r in held))


async def _events(envoy: EnvoyStandIn, p: SidecarProcess) -> None:
    """What counts only on events: lease expiries (1 s leases), the starvation rule (a
    slot freed by one while heads have aged), an unknown completion, an adoption, and an
    edge shed counted from Envoy's edge logger stream."""
    deadline = asyncio.get_running_loop().time() + 20
    while True:
        m = await p.metrics()
        if (any(k.startswith("smg_sidecar_lease_expired_total{") and v for k, v in m.items())
                and any(k.startswith("smg_scheduler_starvation_promotion_total{") and v
                        for k, v in m.items())):
            break
        assert asyncio.get_running_loop().time() < deadline, \
            "no lease expiry and starvation promotion within 20 s"
        await asyncio.sleep(0.1)
    while any(k.startswith("smg_scheduler_inflight{") and v
              for k, v in (await p.metrics()).items()):  # every lease expired: room
        assert asyncio.get_running_loop().time() < deadline, "leases never all expired"
        await asyncio.sleep(0.1)
    await envoy.log(("0" * 32, "end"))  # an id nobody admitted: unmatched
    await envoy.log(("1" * 32, "periodic"), cls="bulk")  # a stream from before: adopted
    msg = als_pb2.StreamAccessLogsMessage()
    msg.identifier.node.id = "test"
    entry = msg.http_logs.log_entry.add()  # as Envoy's edge logger writes a shed
    entry.common_properties.route_name = route_name(PriorityClass.BULK)
    entry.response.response_code.value = 429
    await envoy.channel.stream_unary(
        "/envoy.service.accesslog.v3.AccessLogService/StreamAccessLogs",
        request_serializer=als_pb2.StreamAccessLogsMessage.SerializeToString,
        response_deserializer=als_pb2.StreamAccessLogsResponse.FromString,
    )(iter([msg]), metadata=((STREAM_MARK_KEY, "bulk"),))


async def _tokens(envoy: EnvoyStandIn) -> None:
    """A budgeted tenant's request settled by its usage (the estimate's error), then one
    its budget refuses: the token series the alerts select on."""
    def req() -> Any:
        return envoy._check(check_request({"x-smg-tenant": "t2", "content-length": "100"}))

    first = await req()  # 25 input + 256 default output tokens: fits 300
    assert first.status.code == 0
    msg = als_pb2.StreamAccessLogsMessage()
    e = msg.http_logs.log_entry.add()
    e.common_properties.access_log_type = accesslog_pb2.DownstreamEnd
    e.common_properties.metadata.filter_metadata[codec.AUTHZ_NAMESPACE].fields[
        codec.ADMISSION_ID_KEY].string_value = admission_id(first)
    e.common_properties.metadata.filter_metadata[codec.USAGE_NAMESPACE].update(
        {"total_tokens": "60"})
    e.response.response_code.value = 200
    await envoy._als(iter([msg]))
    deadline = asyncio.get_running_loop().time() + 10
    while (refused := await req()).status.code == 0:  # 60 + 281 > 300, once settled
        await envoy.log((admission_id(refused), "end"))
        assert asyncio.get_running_loop().time() < deadline, "t2 never refused"
        await asyncio.sleep(0.05)
    assert refused.denied_response.status.code == 429


async def _scrape(p: SidecarProcess) -> str:
    status, body = await http_get(f"http://127.0.0.1:{p.http_port}/metrics", 5.0)
    assert status == 200
    return body.decode()


async def _collect(tmp: Path) -> list[Scrape]:
    (tmp / "priority.yaml").write_text(PRIORITY)
    fleet = Fleet(2, max_running_requests=2)
    fleet.workers[1].capacity_status = 401  # a refused probe: its series
    await fleet.start()
    common = ["--priority-scheduler-enabled", "--priority-scheduler-config",
              str(tmp / "priority.yaml"), "--priority-scheduler-default-max-class", "system"]
    plain = SidecarProcess([
        *common, "--worker-urls", *fleet.urls, "--health-interval-secs", "0.2", "--edge-shed",
        "--admission-lease-secs", "2", "--rate-limit-tokens-per-second", "1000",
        "--max-concurrent-requests", "64"], tmp / "plain.log")
    pooled = SidecarProcess([
        *common, "--worker-urls", "http://127.0.0.1:9", "big=http://127.0.0.1:9",
        "--worker-capacity-override", "2", "--shadow"], tmp / "pooled.log")
    envoys: list[EnvoyStandIn] = []
    calls: list[Any] = []
    try:
        await plain.start()
        await pooled.start()
        envoys = [EnvoyStandIn(plain.grpc_port), EnvoyStandIn(pooled.grpc_port)]
        capacity = int((await plain.metrics())["smg_sidecar_capacity"])
        await _preempt(envoys[0], capacity)
        await _preempt(envoys[1], 2, shadow=True, pool="big")
        calls += _burst(envoys[0], ("",)) + _burst(envoys[1], ("", "big"))
        await _events(envoys[0], plain)
        await _tokens(envoys[0])
        calls += _burst(envoys[0], ("",))  # queued at the scrape: the per-tenant depth
        deadline = asyncio.get_running_loop().time() + 20
        while not ("smg_sidecar_worker_probe_refused{" in (text := await _scrape(plain))
                   and "smg_sidecar_tenant_queue_depth{" in text):
            assert asyncio.get_running_loop().time() < deadline, \
                "no refused probe or no queued tenant in the scrape within 20 s"
            await asyncio.sleep(0.1)
        return [Scrape("a", text), Scrape("b", await _scrape(pooled))]
    finally:
        for c in calls:
            c.cancel()
        for e in envoys:
            await e.close()
        plain.stop()
        pooled.stop()
        await fleet.stop()


@pytest.fixture(scope="module")
def scrapes(tmp_path_factory: pytest.TempPathFactory) -> list[Scrape]:
    return asyncio.run(_collect(tmp_path_factory.mktemp("scrapes")))


def _fill(expr: str, instance: str = ".*", pool: str = ".*") -> str:
    """``expr`` as Prometheus gets it from Grafana: variables filled in, and a variable's
    ``label_values(metric, label)`` as the query Grafana sends for it."""
    expr = re.sub(r"^label_values\((.+),\s*(\w+)\)$", r"group by (\2) (\1)", expr.strip())
    return (expr.replace("$instance", instance).replace("$pool", pool)
            .replace("$__rate_interval", "1m"))


def _exprs() -> list[tuple[str, str]]:
    """(where, expression) of every panel, variable query and alert rule."""
    return ([(f"dashboard #{i}", e) for i, e in enumerate(_dashboard_exprs())]
            + [(r.get("alert") or r.get("record") or "rule", r["expr"]) for r in _rules()])


def _names_in(expr: str) -> set[str]:
    bare = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    bare = re.sub(r"\{[^}]*\}", "", bare)
    return set(re.findall(r"\bsmg_[a-z0-9_]+", bare))


_GROUPING = re.compile(r"\b(?:by|without|on|ignoring)\s*\(([^)]*)\)")


def _labels_of(scrapes: list[Scrape]) -> dict[str, set[str]]:
    """Each metric's labels: those of its scraped series (with ``pool`` where
    sidecar.metrics marks it (pool), as the pooled sidecar may have had no sample), else
    the documented ones."""
    seen: dict[str, set[str]] = {}
    for s in scrapes:
        for name, labels, _ in s.series:
            seen.setdefault(name, set()).update(labels)
    names = set().union(*(s.families for s in scrapes))
    return {n: (seen[n] | (_documented_labels(n) & {"pool"})) if n in seen
            else _documented_labels(n) for n in names}


def _pooled() -> set[str]:
    """The series sidecar.metrics marks (pool): they carry ``pool`` where pools exist."""
    process, pool, gauges = documented()
    return {n for table in (process, pool) for row in table.values()
            for n, pooled in row.items() if pooled} | gauges


def _documented_labels(name: str) -> set[str]:
    """A metric's labels per docs/reference.md (with ``pool`` where sidecar.metrics marks
    it), for a series no scrape here had a sample of."""
    base = re.sub(r"_(bucket|sum|count)$", "", name)
    pool = {"pool"} if base in _pooled() or f"{base}_total" in _pooled() else set()
    for row in table_rows(reference()):
        if row[0] == f"`{base}`":
            return set(re.findall(r"`([a-z_]+)`", row[2])) | pool
    return pool


# ---------------------------------------------------------------------------- the checks


def test_the_scrapes_cover_the_dashboards_new_panels(scrapes: list[Scrape]) -> None:
    """The series the state panels read are really there, not only declared."""
    names = {n for s in scrapes for n, _, _ in s.series}
    for want in ("smg_sidecar_admission_mode", "smg_sidecar_admission_fallback",
                 "smg_sidecar_shadow_inflight", "smg_sidecar_preemption_suspended",
                 "smg_sidecar_worker_capacity", "smg_sidecar_worker_probe_refused",
                 "smg_sidecar_tenant_rejected_total", "smg_sidecar_shadow_admit_total",
                 "smg_sidecar_edge_shed_share"):
        assert want in names, f"no sidecar exported {want}"
    pooled = [labels for n, labels, _ in scrapes[1].series if n == "smg_sidecar_admission_mode"]
    assert {ls["pool"] for ls in pooled} == {"default", "big"}


def test_every_expression_names_exported_metrics_and_their_labels(
        scrapes: list[Scrape]) -> None:
    families = set().union(*(s.families for s in scrapes))
    labels = _labels_of(scrapes)
    checked = 0
    for where, expr in _exprs():
        names = _names_in(expr)
        unknown = sorted(names - families)
        assert not unknown, f"{where}: no sidecar exports {unknown}: {expr}"
        known = set(TARGET_LABELS)
        for n in names:
            known |= labels[n]
        for name, matchers in _SELECTOR.findall(expr):
            have = labels[name] | TARGET_LABELS
            for label, _, _ in _MATCHER.findall(matchers):
                assert label in have, f"{where}: {name} has no label {label!r}: {expr}"
                checked += 1
        for group in _GROUPING.findall(expr):
            for label in filter(None, (g.strip() for g in group.split(","))):
                assert label in known, f"{where}: no metric here has label {label!r}: {expr}"
                checked += 1
    assert checked > 100


def test_promtool_parses_every_dashboard_expression(promtool: str, tmp_path: Path) -> None:
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:panel_{i}", "expr": _fill(e)}
        for i, e in enumerate(_dashboard_exprs())]}]}
    path = tmp_path / "dashboard.rules.yaml"
    path.write_text(yaml.safe_dump(rules, sort_keys=False))
    out = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True,
                         text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(rules['groups'][0]['rules'])} rules found" in out.stdout


def _selectors(expr: str) -> Iterator[str]:
    """Each ``metric{matchers}`` (or bare metric) of ``expr``, as written."""
    for m in re.finditer(r"\b(smg_[a-z0-9_]+)\s*(\{[^}]*\})?", expr):
        yield m.group(1) + (m.group(2) or "")


def _series_line(name: str, labels: dict[str, str]) -> str:
    body = ",".join(f'{k}={json.dumps(v)}' for k, v in sorted(labels.items()))
    return f"{name}{{{body}}}"


@pytest.mark.parametrize(("instance", "pool"), [(".*", ".*"), ("b", "big")],
                         ids=["all", "one_named_pool"])
def test_every_selector_matches_real_series_in_promtool(
        promtool: str, tmp_path: Path, scrapes: list[Scrape], instance: str,
        pool: str) -> None:
    scraped = {n for s in scrapes for n, _, _ in s.series}
    pooled_names = {n for n, _, _ in scrapes[1].series}
    input_series = []
    for s in scrapes:
        for name, labels, value in s.series:
            if value != value:  # NaN (an empty summary): not a value promtool reads
                continue
            full = {**labels, "instance": s.instance, "job": "priority-gate",
                    "namespace": "ns", "pod": f"pod-{s.instance}"}
            input_series.append({"series": _series_line(name, full),
                                 "values": f"{value:g}+1x20" if name.endswith("_total")
                                 else f"{value:g}x20"})
    tests: list[dict[str, Any]] = []
    seen: set[str] = set()
    for _, expr in _exprs():
        for sel in _selectors(_fill(expr, instance, pool)):
            name = sel.partition("{")[0]
            if name in NOT_SCRAPED:
                assert name not in scraped, f"{name} is exported: drop it from NOT_SCRAPED"
                continue
            if sel in seen:
                continue
            if pool != ".*" and ("pool=~" not in sel or name not in pooled_names):
                continue  # one pool chosen: what it adds is the pool matcher on b's series
            seen.add(sel)
            tests.append({"expr": f"absent({sel})", "eval_time": "10m", "exp_samples": []})
    assert len(tests) > (40 if pool == ".*" else 15)
    doc = {"rule_files": [], "evaluation_interval": "1m", "tests": [
        {"interval": "1m", "input_series": input_series, "promql_expr_test": tests}]}
    (tmp_path / "reality.test.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    out = subprocess.run([promtool, "test", "rules", "reality.test.yaml"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, (out.stdout + out.stderr)[-6000:]
