"""Which of the Envoy settings the sidecar relies on are actually in force.

Meshes (Istio, Envoy Gateway) generate the Envoy config; neither sets the access-log flush
interval nor unbuffered access logs, and ext_proc needs an extra EnvoyFilter /
EnvoyExtensionPolicy. Each is inferred from what arrives, said once in the log with its
consequence, and exported as ``smg_sidecar_envoy_feature{feature,state}``:

* ``periodic_access_log``: a periodic entry arrived (present), or a request that outlived the
  lease ended with none ever seen (absent: such streams lose their slot to the lease).
* ``unbuffered_access_log``: absent once entries arrive batched (several in one message) or a
  final entry arrives late (``LATE_SECS`` after its request ended): releases lag the buffer.
* ``ext_proc``: present once a stream opens for an admitted request; absent once
  ``EXT_PROC_SAMPLE`` admitted requests ended with none ever opened (no preemption).
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum

from sidecar import logs
from sidecar.metrics import Recorder

log = logs.get("sidecar.envoy_features")

LATE_SECS = 0.5  # buffer_size_bytes 0 delivers within ~1 ms; the default buffer flushes at 1 s
EXT_PROC_SAMPLE = 3


class Feature(Enum):
    PERIODIC_ACCESS_LOG = "periodic_access_log"
    UNBUFFERED_ACCESS_LOG = "unbuffered_access_log"
    EXT_PROC = "ext_proc"


class State(Enum):
    UNKNOWN = "unknown"
    PRESENT = "present"
    ABSENT = "absent"


STATES = tuple(s.value for s in State)

_CONSEQUENCE = {
    Feature.PERIODIC_ACCESS_LOG: "no periodic access-log entries: a stream longer than "
    "--admission-lease-secs loses its slot to the lease (over-admission); set the HCM "
    "access_log_options.access_log_flush_interval",
    Feature.UNBUFFERED_ACCESS_LOG: "access-log entries arrive batched: releases lag up to the "
    "buffer flush (1 s by default); set common_config.buffer_size_bytes: 0",
    Feature.EXT_PROC: "no ext_proc streams for admitted requests: no preemption and no "
    "first-byte signal; add the ext_proc filter after ext_authz",
}


class FeatureDetector:
    def __init__(self, metrics: Recorder, *, lease_secs: float,
                 wall_clock: Callable[[], float]) -> None:
        self._metrics = metrics
        self._lease_secs = lease_secs
        self._wall_clock = wall_clock
        self._state = dict.fromkeys(Feature, State.UNKNOWN)
        self._ended_without_ext_proc = 0
        for f in Feature:
            metrics.envoy_feature(f.value, State.UNKNOWN.value)

    def state(self, feature: Feature) -> State:
        return self._state[feature]

    def _set(self, feature: Feature, state: State, **detail: float) -> None:
        if self._state[feature] is state:
            return
        self._state[feature] = state
        self._metrics.envoy_feature(feature.value, state.value)
        if state is State.ABSENT:
            log.warning("envoy_feature_absent", feature=feature.value,
                        consequence=_CONSEQUENCE[feature], **detail)
        else:
            log.info("envoy_feature_present", feature=feature.value)

    def access_log_message(self, entries: int) -> None:
        """One StreamAccessLogsMessage carrying ``entries`` of our entries."""
        if entries > 1:
            self._set(Feature.UNBUFFERED_ACCESS_LOG, State.ABSENT, entries_in_message=entries)

    def periodic_entry(self) -> None:
        self._set(Feature.PERIODIC_ACCESS_LOG, State.PRESENT)

    def final_entry(self, *, lived_secs: float, ended_at: float,
                    preemptible: bool = True) -> None:
        if ended_at > 0:
            late = self._wall_clock() - ended_at
            if late > LATE_SECS:
                self._set(Feature.UNBUFFERED_ACCESS_LOG, State.ABSENT, late_secs=round(late, 3))
        if (lived_secs > self._lease_secs
                and self._state[Feature.PERIODIC_ACCESS_LOG] is not State.PRESENT):
            self._set(Feature.PERIODIC_ACCESS_LOG, State.ABSENT, lived_secs=lived_secs)
        # A request admitted as not preemptible gets no stream by design.
        if preemptible and self._state[Feature.EXT_PROC] is State.UNKNOWN:
            self._ended_without_ext_proc += 1
            if self._ended_without_ext_proc >= EXT_PROC_SAMPLE:
                self._set(Feature.EXT_PROC, State.ABSENT,
                          admitted_requests=self._ended_without_ext_proc)

    def ext_proc_stream(self) -> None:
        """An ext_proc stream opened for an admitted request."""
        self._set(Feature.EXT_PROC, State.PRESENT)
