"""Configuration detection: each inference, its metric and its one log line."""

from __future__ import annotations

import pytest
import structlog

from sidecar.envoy_features import EXT_PROC_SAMPLE, Feature, FeatureDetector, State
from sidecar.metrics import Metrics
from tests.clock import FakeClock

LEASE = 30.0


def gauge(m: Metrics, feature: str) -> dict[str, float]:
    out = {}
    for family in m.registry.collect():
        if family.name == "smg_sidecar_envoy_feature":
            for s in family.samples:
                if s.labels["feature"] == feature:
                    out[s.labels["state"]] = s.value
    return out


@pytest.fixture
def setup() -> tuple[FeatureDetector, Metrics, FakeClock]:
    m = Metrics(tenant_top_n=10)
    clock = FakeClock(1_000_000.0)
    return FeatureDetector(m, lease_secs=LEASE, wall_clock=clock), m, clock


def test_everything_starts_unknown(setup: tuple[FeatureDetector, Metrics, FakeClock]) -> None:
    d, m, _ = setup
    for f in Feature:
        assert d.state(f) is State.UNKNOWN
        assert gauge(m, f.value) == {"unknown": 1, "present": 0, "absent": 0}


def test_long_request_without_periodic_entries_is_reported_once(
        setup: tuple[FeatureDetector, Metrics, FakeClock]) -> None:
    d, m, clock = setup
    d.final_entry(lived_secs=LEASE - 1, ended_at=clock())
    assert d.state(Feature.PERIODIC_ACCESS_LOG) is State.UNKNOWN  # short: proves nothing
    with structlog.testing.capture_logs() as logs:
        d.final_entry(lived_secs=LEASE + 1, ended_at=clock())
        d.final_entry(lived_secs=LEASE + 5, ended_at=clock())
    assert d.state(Feature.PERIODIC_ACCESS_LOG) is State.ABSENT
    assert gauge(m, "periodic_access_log") == {"unknown": 0, "present": 0, "absent": 1}
    absent = [e for e in logs if e["event"] == "envoy_feature_absent"
              and e["feature"] == "periodic_access_log"]
    assert len(absent) == 1 and "--admission-lease-secs" in absent[0]["consequence"]
    d.periodic_entry()
    assert gauge(m, "periodic_access_log") == {"unknown": 0, "present": 1, "absent": 0}


def test_periodic_entries_seen_first_means_present(
        setup: tuple[FeatureDetector, Metrics, FakeClock]) -> None:
    d, _, clock = setup
    d.periodic_entry()
    d.final_entry(lived_secs=LEASE * 3, ended_at=clock())
    assert d.state(Feature.PERIODIC_ACCESS_LOG) is State.PRESENT


def test_batched_or_late_entries_mean_buffered(
        setup: tuple[FeatureDetector, Metrics, FakeClock]) -> None:
    d, m, clock = setup
    d.access_log_message(1)
    d.final_entry(lived_secs=0.1, ended_at=clock() - 0.01)
    assert d.state(Feature.UNBUFFERED_ACCESS_LOG) is State.UNKNOWN
    d.final_entry(lived_secs=0.1, ended_at=clock() - 0.9)  # the 1 s buffer flush
    assert gauge(m, "unbuffered_access_log")["absent"] == 1
    d2 = FeatureDetector(Metrics(tenant_top_n=10), lease_secs=LEASE, wall_clock=clock)
    d2.access_log_message(3)
    assert d2.state(Feature.UNBUFFERED_ACCESS_LOG) is State.ABSENT


def test_ext_proc_absent_after_a_sample_then_present(
        setup: tuple[FeatureDetector, Metrics, FakeClock]) -> None:
    d, m, clock = setup
    for _ in range(EXT_PROC_SAMPLE - 1):
        d.final_entry(lived_secs=0.1, ended_at=clock())
    assert d.state(Feature.EXT_PROC) is State.UNKNOWN
    d.final_entry(lived_secs=0.1, ended_at=clock())
    assert gauge(m, "ext_proc")["absent"] == 1
    d.ext_proc_stream()
    assert gauge(m, "ext_proc") == {"unknown": 0, "present": 1, "absent": 0}


def test_requests_admitted_as_not_preemptible_do_not_count_as_missing_streams(
        setup: tuple[FeatureDetector, Metrics, FakeClock]) -> None:
    d, _, clock = setup
    for _ in range(EXT_PROC_SAMPLE * 2):
        d.final_entry(lived_secs=0.1, ended_at=clock(), preemptible=False)
    assert d.state(Feature.EXT_PROC) is State.UNKNOWN  # Envoy skips those by design
    for _ in range(EXT_PROC_SAMPLE):
        d.final_entry(lived_secs=0.1, ended_at=clock())
    assert d.state(Feature.EXT_PROC) is State.ABSENT


def test_ext_proc_seen_first_is_never_reported_absent(
        setup: tuple[FeatureDetector, Metrics, FakeClock]) -> None:
    d, _, clock = setup
    d.ext_proc_stream()
    for _ in range(EXT_PROC_SAMPLE * 2):
        d.final_entry(lived_secs=0.1, ended_at=clock())
    assert d.state(Feature.EXT_PROC) is State.PRESENT
