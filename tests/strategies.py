"""Hypothesis strategies the scheduler and ledger property tests share: one class's
settings, a whole class table, a class.

No profile is loaded here (test_scheduler_properties owns the suite's), so importing this
changes no module's example counts.
"""

from __future__ import annotations

from hypothesis import strategies as st

from sidecar.classes import PriorityClass
from sidecar.scheduler import ClassSettings

class_config = st.builds(
    ClassSettings,
    reserved_floor=st.integers(0, 4),
    reserved_per_slot=st.sampled_from([0.0, 0.1, 0.25, 0.5]),
    queue_size=st.integers(0, 4),
    queue_timeout_secs=st.sampled_from([0.5, 1.0, 3.0, 10.0]),
    starvation_threshold_secs=st.sampled_from([0.5, 2.0, 5.0]),
    can_preempt=st.booleans(),
)
configs = st.fixed_dictionaries({c: class_config for c in PriorityClass})
classes = st.sampled_from(list(PriorityClass))

# Fairness between tenants: several tenants (keys with a space and non-ASCII characters,
# as a tenant key may hold any), fair queuing on or off, per-tenant limits that bind or
# not, weights whose turns cost inexact floats (1/3) and tie (1/0.5 = 2 turns of 1).
tenants = st.sampled_from(["A", "B", "t t", "é ü"])
weight_maps = st.sampled_from([{}, {"A": 3.0}, {"B": 0.5, "t t": 2.0},
                               {"A": 1.5, "é ü": 0.25, "B": 1.0}])
tenant_class_config = st.builds(
    ClassSettings,
    reserved_floor=st.integers(0, 4),
    reserved_per_slot=st.sampled_from([0.0, 0.1, 0.25, 0.5]),
    queue_size=st.integers(0, 6),
    queue_timeout_secs=st.sampled_from([0.5, 1.0, 3.0, 10.0]),
    starvation_threshold_secs=st.sampled_from([0.5, 2.0, 5.0]),
    can_preempt=st.booleans(),
    fair_queuing=st.booleans(),
    max_queued_per_tenant=st.none() | st.integers(1, 4),
    tenant_weights=weight_maps,
)
