"""Through a real Envoy: ext_proc streams only for admitted, preemptible requests.

ext_authz's own 429/503 local replies used to open an ext_proc stream at their
response headers, so a 429 flood cost two RPCs per request. Envoy now skips the
ext_proc filter unless ext_authz's dynamic metadata holds an admission id.
"""

from __future__ import annotations

import pytest

from devtools.httpclient import request
from tests.conftest import StackFactory, assert_denied, complete_held, settle, until
from tests.test_e2e import hold, inflight_is

pytestmark = pytest.mark.e2e

PRIORITY = """
classes:
  system: {reserved_floor: 0}
  interactive: {reserved_floor: 0, reserved_per_slot: 0.0}
  default: {reserved_per_slot: 0.0, queue_size: 0}
"""
STREAMS = 'smg_sidecar_ext_proc_streams_total{admitted="%s"}'


async def test_a_denied_request_opens_no_ext_proc_stream(make_stack: StackFactory) -> None:
    stack = await make_stack(priority_yaml=PRIORITY, workers=1, max_running_requests=1)
    busy = await hold(stack, "busy")  # the one slot
    m = await until(stack, inflight_is("default", 1))
    assert m[STREAMS % "true"] == 1  # the admitted request has its stream
    for _ in range(10):
        assert_denied(await request(stack.listen_port), 429, "scheduler_queue_full", "2")
    await complete_held(stack, busy, "busy")
    m = await settle(stack)
    assert m['smg_scheduler_admit_total{class="default",outcome="rejected_queue_full"}'] == 10
    assert m[STREAMS % "false"] == 0  # none for the ten local replies
    assert m[STREAMS % "true"] == 1


async def test_a_class_nothing_can_preempt_opens_no_ext_proc_stream_once_periodic_entries_come(
        make_stack: StackFactory) -> None:
    # System and interactive preempt (built-in); every class allowed to everyone.
    stack = await make_stack(priority_yaml=PRIORITY, flush_interval_secs=0.2,
                             sidecar_args=["--priority-scheduler-default-max-class", "system"])
    periodic = 'smg_sidecar_envoy_feature{feature="periodic_access_log",state="present"}'
    # Until Envoy is seen sending periodic entries the ext_proc stream is the only sign that
    # it runs a request, so even a class nobody can preempt gets one.
    first = await hold(stack, "first", "system")
    m = await until(stack, lambda m: m.get(periodic) == 1)  # the held request's entry
    assert m[STREAMS % "true"] == 1
    assert await stack.envoy_stat("http.ingress.ext_proc.streams_started") == 1
    await complete_held(stack, first, "first")
    await settle(stack)
    r = await request(stack.listen_port, headers={"x-smg-priority": "system"})
    assert r.status == 200
    m = await settle(stack)
    assert m['smg_sidecar_released_total{class="system",reason="completed"}'] == 2
    assert m[STREAMS % "true"] == 1  # nobody could stop it, periodic entries cover it: no stream
    assert await stack.envoy_stat("http.ingress.ext_proc.streams_started") == 1
    r = await request(stack.listen_port, headers={"x-smg-priority": "interactive"})
    assert r.status == 200  # system can preempt interactive: it gets its stream
    m = await settle(stack)
    assert m['smg_sidecar_released_total{class="interactive",reason="completed"}'] == 1
    assert m[STREAMS % "true"] == 2
    assert await stack.envoy_stat("http.ingress.ext_proc.streams_started") == 2
