"""The alert rules (k8s/overlays/servicemonitor/prometheusrule.yaml) and their runbook.

The rules are checked by the real tool: ``promtool check rules`` on the resource's rule
groups and ``promtool test rules`` on prometheusrule.test.yaml (per alert, series that fire
it and series that must stay quiet). promtool comes from devtools/install-promtool.sh; without
it these tests skip, except under CI (``CI`` set), where they fail. Every metric, label and
label value a rule selects must be one the sidecar exports (its registry, the reference's
metric tables), and every alert's runbook_url must lead to its section of docs/operations.md.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.test_docs import CLASS_NAMES, _github_anchor, reference, table_rows
from tests.test_k8s import K8S, _exported_metric_names, _metric_names_in

ROOT = Path(__file__).resolve().parent.parent
OVERLAY = K8S / "overlays" / "servicemonitor"
RULE = OVERLAY / "prometheusrule.yaml"
RULE_TESTS = OVERLAY / "prometheusrule.test.yaml"
RULES_NAME = "priority-gate.rules.yaml"  # what prometheusrule.test.yaml's rule_files names
OPERATIONS = ROOT / "docs" / "operations.md"


def _rule_resource() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load(RULE.read_text(encoding="utf-8"))
    return doc


def _rules() -> list[dict[str, Any]]:
    return [r for g in _rule_resource()["spec"]["groups"] for r in g["rules"]]


def _alerts() -> list[dict[str, Any]]:
    return [r for r in _rules() if "alert" in r]


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() not in ("", "0", "false", "no")


@pytest.fixture(scope="module")
def promtool() -> str:
    found = os.environ.get("PROMTOOL") or shutil.which("promtool")
    if found is None and Path("/usr/local/bin/promtool").is_file():
        found = "/usr/local/bin/promtool"
    if found is None:
        if _in_ci():
            pytest.fail("CI must check the alert rules: no promtool "
                        "(run devtools/install-promtool.sh)")
        pytest.skip("no promtool: devtools/install-promtool.sh installs it")
    return found


def _write_rule_groups(directory: Path) -> Path:
    """The PrometheusRule's spec as a plain Prometheus rule file (what promtool reads)."""
    path = directory / RULES_NAME
    path.write_text(yaml.safe_dump(_rule_resource()["spec"], sort_keys=False), encoding="utf-8")
    return path


# ----------------------------------------------------------------------------- the resource


def test_rule_resource_is_in_the_overlay() -> None:
    doc = _rule_resource()
    assert doc["apiVersion"] == "monitoring.coreos.com/v1"
    assert doc["kind"] == "PrometheusRule"
    kustomization = yaml.safe_load((OVERLAY / "kustomization.yaml").read_text(encoding="utf-8"))
    assert RULE.name in kustomization["resources"]
    # the unit-test file is promtool's, not a manifest
    assert RULE_TESTS.name not in kustomization["resources"]


def test_every_alert_is_complete() -> None:
    alerts = _alerts()
    assert len(alerts) >= 10
    names = [a["alert"] for a in alerts]
    assert len(names) == len(set(names)), "duplicate alert names"
    for a in alerts:
        assert re.fullmatch(r"PriorityGate[A-Z][A-Za-z]+", a["alert"]), a["alert"]
        assert a["labels"]["severity"] in ("critical", "warning"), a["alert"]
        assert {"summary", "description", "runbook_url"} <= set(a["annotations"]), a["alert"]


def test_the_issue_list_is_covered() -> None:
    """The conditions operators asked to be alerted on, by the metric that shows each."""
    by_metric: dict[str, set[str]] = {}
    for a in _alerts():
        for name in _metric_names_in(a["expr"]):
            by_metric.setdefault(name, set()).add(a["alert"])
    for metric in ("smg_scheduler_admit_total",  # system shedding
                   "smg_scheduler_queue_wait_seconds_bucket",  # interactive wait
                   "smg_sidecar_capacity_source",  # capacity fallback
                   "smg_sidecar_coordination_state",  # coordination degraded
                   "smg_sidecar_config_reload_total",  # reload rejected
                   "smg_sidecar_lease_expired_total",  # leases
                   "smg_sidecar_envoy_owners_alive", "smg_sidecar_envoy_owner_lost_total"):
        assert metric in by_metric, f"no alert reads {metric}"


# --------------------------------------------------------------------------------- promtool


def test_promtool_check_rules(promtool: str, tmp_path: Path) -> None:
    rules = _write_rule_groups(tmp_path)
    out = subprocess.run([promtool, "check", "rules", str(rules)], capture_output=True,
                         text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(_rules())} rules found" in out.stdout, out.stdout


def test_promtool_unit_tests(promtool: str, tmp_path: Path) -> None:
    _write_rule_groups(tmp_path)
    shutil.copy(RULE_TESTS, tmp_path / RULE_TESTS.name)
    out = subprocess.run([promtool, "test", "rules", RULE_TESTS.name], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout, out.stdout


def _sources(group: dict[str, Any]) -> set[tuple[str, str]]:
    """(namespace, pod) of a test group's input series."""
    found = set()
    for s in group["input_series"]:
        labels = dict(re.findall(r'(\w+)="([^"]*)"', s["series"]))
        found.add((labels["namespace"], labels["pod"]))
    return found


def test_every_alert_has_a_firing_and_a_quiet_case() -> None:
    doc = yaml.safe_load(RULE_TESTS.read_text(encoding="utf-8"))
    assert doc["rule_files"] == [RULES_NAME]
    fires: set[str] = set()
    quiet: set[str] = set()
    for group in doc["tests"]:
        for case in group.get("alert_rule_test", []):
            fired = [e["exp_labels"] for e in case.get("exp_alerts") or []]
            if fired:
                fires.add(case["alertname"])
            # quiet: no alert at all, or inputs (by namespace/pod) that none of the alerts is for
            if any(not any(f["namespace"] == ns and f.get("pod", pod) == pod for f in fired)
                   for ns, pod in _sources(group)):
                quiet.add(case["alertname"])
    names = {a["alert"] for a in _alerts()}
    assert names <= fires, f"alerts never shown to fire: {sorted(names - fires)}"
    assert names <= quiet, f"alerts never shown to stay quiet: {sorted(names - quiet)}"


# ------------------------------------------------------------------- metrics the rules read


_SELECTOR = re.compile(r"\b(smg_[a-z0-9_]+)\s*\{([^}]*)\}")
_MATCHER = re.compile(r'(\w+)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"')


def _metric_rows() -> dict[str, list[str]]:
    return {m.group(1): row for row in table_rows(reference())
            if (m := re.fullmatch(r"`(smg_[a-z0-9_]+)`", row[0]))}


def _base_name(name: str) -> str:
    return re.sub(r"_(bucket|sum|count)$", "", name)


def test_rules_read_only_exported_metrics() -> None:
    exported = _exported_metric_names()
    used: set[str] = set()
    for rule in _rules():
        used |= _metric_names_in(rule["expr"])
    assert used, "no metric found in the rules"
    unknown = sorted(used - exported)
    assert not unknown, f"rules read metrics the sidecar does not export: {unknown}"


def test_rule_selectors_use_documented_labels_and_values() -> None:
    """Each ``metric{label="value"}`` names a label of that metric (its row in the
    reference's "Metrics" tables) and, where the reference enumerates the values, one of those."""
    rows = _metric_rows()
    checked = 0
    for rule in _rules():
        for name, matchers in _SELECTOR.findall(rule["expr"]):
            row = rows.get(_base_name(name))
            assert row is not None, f"{name}: no metric row in docs/reference.md"
            labels_cell = row[2]
            for label, op, value in _MATCHER.findall(matchers):
                if label == "le":
                    continue
                assert f"`{label}`" in labels_cell, f"{name} has no label {label}"
                values = value.split("|") if op in ("=~", "!~") else [value]
                allowed = set(CLASS_NAMES) if label == "class" else \
                    set(re.findall(r"`([^`]+)`", labels_cell)) - {label}
                for v in values:
                    assert v in allowed, f"{name}{{{label}}}: {v!r} is not one of {allowed}"
                checked += 1
    assert checked >= 10


def test_selector_scan() -> None:
    expr = 'rate(smg_scheduler_admit_total{class="system", outcome=~"a|b"}[5m])'
    assert _SELECTOR.findall(expr) == [("smg_scheduler_admit_total",
                                        'class="system", outcome=~"a|b"')]
    assert _MATCHER.findall('class="system", outcome=~"a|b"') == [
        ("class", "=", "system"), ("outcome", "=~", "a|b")]


# ------------------------------------------------------------------------------ the runbook


def _operations_anchors() -> set[str]:
    text = OPERATIONS.read_text(encoding="utf-8")
    return {_github_anchor(h) for h in re.findall(r"^#{1,6} (.+)$", text, re.M)}


def test_every_alert_links_its_runbook_section() -> None:
    anchors = _operations_anchors()
    for a in _alerts():
        url = a["annotations"]["runbook_url"]
        path, _, anchor = url.partition("#")
        assert path == "docs/operations.md", url
        assert anchor == _github_anchor(a["alert"]), f"{a['alert']}: {url}"
        assert anchor in anchors, f"{a['alert']}: docs/operations.md has no section {anchor}"


def test_every_runbook_section_is_an_alert() -> None:
    text = OPERATIONS.read_text(encoding="utf-8")
    sections = set(re.findall(r"^### (PriorityGate\w+)$", text, re.M))
    assert sections == {a["alert"] for a in _alerts()}


def test_operations_page_links_resolve() -> None:
    ref_anchors = {_github_anchor(h) for h in re.findall(r"^#{1,6} (.+)$", reference(), re.M)}
    own = _operations_anchors()
    text = OPERATIONS.read_text(encoding="utf-8")
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    assert targets
    for target in targets:
        assert not target.startswith(("http://", "https://")), target
        path, _, anchor = target.partition("#")
        resolved = (OPERATIONS.parent / path).resolve() if path else OPERATIONS
        assert resolved.exists(), f"docs/operations.md: broken link {target}"
        if anchor and resolved == ROOT / "docs" / "reference.md":
            assert anchor in ref_anchors, f"docs/operations.md: broken anchor {target}"
        if anchor and resolved == OPERATIONS:
            assert anchor in own, f"docs/operations.md: broken anchor {target}"


def test_readme_links_the_operations_page() -> None:
    assert "(docs/operations.md)" in (ROOT / "README.md").read_text(encoding="utf-8")
