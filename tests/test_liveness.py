"""Envoy liveness: owners, their streams, and what a timer may reclaim.

The table is pure (fake clock); :class:`EnvoyLiveness` is driven over a real
:class:`AdmissionController` on the same clock, so "no timer alone" is checked against
the controller's real leases.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from google.protobuf import struct_pb2
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar import codec
from sidecar.admission import AdmissionController
from sidecar.app import build_runtime
from sidecar.classes import PriorityClass
from sidecar.config import DEFAULT_POOL, parse_settings
from sidecar.liveness import UNIX_OWNER, EnvoyLiveness, OwnerTable, owner_of
from sidecar.metrics import NullRecorder
from sidecar.scheduler import ClassSettings, Leases, ReleaseResult, Scheduler
from tests.clock import FakeClock
from tests.grpc_client import EnvoyStandIn, admission_id
from tests.lease_home import AllHeld

GRACE = 5.0
LEASE = 10.0
D = PriorityClass.DEFAULT
CFG = {c: ClassSettings(0, 0.0, 2, 5.0, 100.0, False) for c in PriorityClass}
A, B = "ipv4:10.0.0.1:40001", "ipv4:10.0.0.2:40001"


@pytest.mark.parametrize(("peer", "owner"), [
    ("ipv4:127.0.0.1:54321", "127.0.0.1"),
    ("ipv4:10.1.2.3:1", "10.1.2.3"),
    ("ipv6:[::1]:54321", "::1"),
    ("ipv6:%5B::1%5D:54321", "::1"),
    ("ipv6:[fe80::1%25eth0]:9", "fe80::1%eth0"),
    ("unix:/tmp/pg/grpc.sock", UNIX_OWNER),
    ("unix:", UNIX_OWNER),
])
def test_owner_is_the_peer_host_without_the_port(peer: str, owner: str) -> None:
    assert owner_of(peer) == owner


def test_connections_of_one_host_are_one_owner() -> None:
    # Check, ext_proc and ALS reach the sidecar over different connections (ports).
    assert owner_of("ipv4:10.0.0.1:40001") == owner_of("ipv4:10.0.0.1:51999")


# ----------------------------------------------------------------------------- the table


def test_acknowledged_while_alive_needs_no_lease_and_dies_with_its_owner() -> None:
    t = OwnerTable(GRACE, leases=AllHeld())
    assert t.stream_opened("e1", 0.0).unlease == []
    t.admitted("x", "e1", 1.0)
    assert t.acknowledge("x", 1.1)
    assert t.unleased("x")
    t.stream_closed("e1", 100.0)
    assert t.next_deadline() == 105.0
    assert t.pop_dead(104.9) == []
    assert t.pop_dead(105.0) == [("e1", ["x"])]
    assert len(t) == 0 and t.next_deadline() is None


def test_an_owner_never_watched_keeps_the_lease_until_its_first_stream() -> None:
    t = OwnerTable(GRACE, leases=AllHeld())
    t.admitted("x", "e1", 1.0)
    t.admitted("y", "e1", 1.0)
    assert not t.acknowledge("x", 2.0)  # no ALS stream yet: the lease stays
    assert not t.unleased("x")
    r = t.stream_opened("e1", 3.0)
    assert r.unlease == ["x"] and r.relapse == []  # y was never acknowledged
    assert t.unleased("x") and not t.unleased("y")


def test_one_of_several_streams_closing_is_not_a_death() -> None:
    t = OwnerTable(GRACE, leases=AllHeld())
    t.stream_opened("e1", 0.0)
    t.stream_opened("e1", 0.0)  # a second worker thread
    t.admitted("x", "e1", 1.0)
    t.acknowledge("x", 1.0)
    t.stream_closed("e1", 2.0)
    assert t.alive("e1") and t.next_deadline() is None
    assert t.pop_dead(1000.0) == []
    assert t.open_streams == 1 and t.alive_owners == 1


def test_killing_one_envoy_frees_only_its_admissions() -> None:
    t = OwnerTable(GRACE, leases=AllHeld())
    for owner, aid in (("e1", "x"), ("e2", "y")):
        t.stream_opened(owner, 0.0)
        t.admitted(aid, owner, 1.0)
        t.acknowledge(aid, 1.0)
    t.stream_closed("e1", 10.0)
    assert t.pop_dead(15.0) == [("e1", ["x"])]
    assert t.owner("y") == "e2" and t.unleased("y")


def test_a_gap_within_the_grace_puts_earlier_admissions_back_under_the_lease() -> None:
    t = OwnerTable(GRACE, leases=AllHeld())
    t.stream_opened("e1", 0.0)
    t.admitted("old", "e1", 1.0)
    t.acknowledge("old", 1.0)
    t.stream_closed("e1", 10.0)  # the process died, or a blip
    t.admitted("new", "e1", 11.0)  # a Check during the gap: a live Envoy asked
    assert not t.acknowledge("new", 11.5)  # no stream yet: lease stays
    r = t.stream_opened("e1", 12.0)
    assert r.relapse == ["old"] and r.unlease == ["new"]
    assert not t.unleased("old") and t.unleased("new")
    assert t.pop_dead(1000.0) == []  # came back: nobody is dead
    assert t.acknowledge("old", 13.0)  # a new sign from Envoy (periodic entry) keeps it


def test_admissions_asked_for_while_the_owner_was_lost_survive_its_death() -> None:
    t = OwnerTable(GRACE, leases=AllHeld())
    t.stream_opened("e1", 0.0)
    t.admitted("old", "e1", 1.0)
    t.stream_closed("e1", 10.0)
    t.admitted("new", "e1", 12.0)  # a new process behind the same host, no stream yet
    assert t.pop_dead(15.0) == [("e1", ["old"])]
    assert t.owner("new") == "e1" and not t.watched("e1")


def test_prune_forgets_what_ended_elsewhere() -> None:
    t = OwnerTable(GRACE, leases=AllHeld())
    for aid in ("a", "b", "c"):
        t.admitted(aid, "e1", 0.0)
    t.admitted("d", "e2", 0.0)
    assert t.prune(lambda aid: aid == "b") == 3
    assert len(t) == 1 and t.owner("b") == "e1"
    assert not t.watched("e2") and "e2" not in t._owners  # an owner with nothing left



def test_churning_peers_leave_no_owner_behind() -> None:
    t = OwnerTable(GRACE, leases=AllHeld())
    for i in range(1000):  # a shared service: each request from another pod IP
        t.admitted(f"r{i}", f"10.0.{i // 256}.{i % 256}", float(i))
        t.ended(f"r{i}")
    assert len(t) == 0 and not t._owners
    t.admitted("w", "e1", 0.0)
    t.stream_opened("e1", 0.0)
    t.ended("w")
    assert t.alive("e1") and t.watched("e1")  # one with a stream open is kept

OPS = st.lists(st.one_of(
    st.tuples(st.just("admit"), st.sampled_from(["e1", "e2"])),
    st.tuples(st.just("ack"), st.integers(0, 30)),
    st.tuples(st.just("open"), st.sampled_from(["e1", "e2"])),
    st.tuples(st.just("close"), st.sampled_from(["e1", "e2"])),
    st.tuples(st.just("end"), st.integers(0, 30)),
    st.tuples(st.just("wait"), st.floats(0.0, 8.0)),
), min_size=10, max_size=60)  # hypothesis favours short lists: most had < 10 ops


@settings(max_examples=300, deadline=None)
@given(OPS)
def test_only_an_owner_silent_for_the_grace_loses_admissions_and_then_all_of_them(
        ops: list[tuple[str, object]]) -> None:
    """Against a model: what pop_dead returns is exactly the admissions asked for (and not
    acknowledged since) before their owner's last stream closed, once it stayed closed
    for the grace; nothing of an owner with a stream open is ever returned."""
    t = OwnerTable(GRACE, leases=AllHeld())
    now = 0.0
    streams = {"e1": 0, "e2": 0}
    lost_at: dict[str, float] = {}
    live: dict[str, tuple[str, float, float | None]] = {}  # aid -> owner, admitted, acked
    ids = (f"id{i}" for i in itertools.count())
    order: list[str] = []
    for op, arg in ops:
        if op == "admit":
            aid = next(ids)
            order.append(aid)
            t.admitted(aid, str(arg), now)
            live[aid] = (str(arg), now, None)
        elif op in ("ack", "end") and order:
            aid = order[int(str(arg)) % len(order)]
            if aid in live:
                if op == "ack":
                    owner, at, _ = live[aid]
                    t.acknowledge(aid, now)
                    live[aid] = (owner, at, now)
                else:
                    t.ended(aid)
                    del live[aid]
        elif op == "open":
            t.stream_opened(str(arg), now)
            streams[str(arg)] += 1
            lost_at.pop(str(arg), None)
        elif op == "close" and streams[str(arg)] > 0:
            t.stream_closed(str(arg), now)
            streams[str(arg)] -= 1
            if streams[str(arg)] == 0:
                lost_at[str(arg)] = now
        elif op == "wait":
            now += float(str(arg))
        dead = dict(t.pop_dead(now))
        for owner in ("e1", "e2"):
            gone = owner in lost_at and lost_at[owner] + GRACE <= now
            expected = sorted(
                aid for aid, (o, at, acked) in live.items()
                if gone and o == owner and at <= lost_at[owner]
                and (acked is None or acked <= lost_at[owner]))
            assert sorted(dead.get(owner, [])) == expected
            if streams[owner] > 0:
                assert owner not in dead
            if gone:
                del lost_at[owner]
                for aid in expected:
                    del live[aid]


# ----------------------------------------------------------------- over a real controller


class Lost(NullRecorder):
    def __init__(self) -> None:
        self.lost: list[int] = []
        self.streams: list[tuple[int, int]] = []

    def owner_lost(self, released: int) -> None:
        self.lost.append(released)

    def envoy_streams(self, open_streams: int, alive_owners: int) -> None:
        self.streams.append((open_streams, alive_owners))


async def make() -> tuple[AdmissionController, EnvoyLiveness, FakeClock, Lost]:
    clock = FakeClock()
    ids = (f"id{i}" for i in itertools.count())
    ctl = AdmissionController(Scheduler(CFG, 4, clock), lease_secs=LEASE, clock=clock,
                              id_factory=lambda: next(ids))
    rec = Lost()
    return ctl, EnvoyLiveness(ctl, grace=GRACE, metrics=rec, clock=clock), clock, rec


async def admit(ctl: AdmissionController, lv: EnvoyLiveness, peer: str) -> str:
    aid = (await ctl.admit(D, "t")).admission.id
    lv.admitted(aid, peer)
    return aid


async def test_an_acknowledged_stream_outlives_many_leases_and_ends_with_its_envoy() -> None:
    ctl, lv, clock, rec = await make()
    owner = lv.stream_opened(A)
    aid = await admit(ctl, lv, A)
    lv.acknowledged(aid)  # its ext_proc stream opened
    assert ctl.lease_count == 1  # still counted in flight (the adoption bound)
    clock.advance(10 * LEASE)
    ctl.tick()
    assert ctl.holds(aid)  # no timer alone reclaimed it
    assert ctl.renew_or_adopt(aid)  # a periodic entry is a renewal, not an adoption
    lv.stream_closed(owner)  # SIGKILL: its streams close
    clock.advance(GRACE - 0.01)
    assert lv.sweep() == 0 and ctl.holds(aid)
    clock.advance(0.01)
    assert lv.sweep() == 1
    assert not ctl.holds(aid) and ctl.lease_count == 0
    assert rec.lost == [1]
    assert rec.streams[-1] == (0, 0)
    assert ctl.release(aid) is ReleaseResult.ALREADY_RELEASED  # its late final entry
    ctl.close()


async def test_without_any_access_log_stream_the_lease_still_reclaims() -> None:
    ctl, lv, clock, _ = await make()
    aid = await admit(ctl, lv, A)
    lv.acknowledged(aid)
    clock.advance(LEASE)
    ctl.tick()
    assert not ctl.holds(aid)  # today's behaviour: no liveness signal at all
    ctl.close()


async def test_an_admission_envoy_never_acknowledged_keeps_its_lease() -> None:
    ctl, lv, clock, _ = await make()
    lv.stream_opened(A)
    aid = await admit(ctl, lv, A)  # the client left just as Check answered
    clock.advance(LEASE)
    ctl.tick()
    assert not ctl.holds(aid)
    ctl.close()


async def test_a_stream_opening_later_unleases_what_was_acknowledged_before() -> None:
    ctl, lv, clock, _ = await make()
    aid = await admit(ctl, lv, A)
    lv.acknowledged(aid)  # the first request of a fresh Envoy: no ALS stream yet
    clock.advance(LEASE / 2)
    lv.stream_opened("ipv4:10.0.0.1:40999")  # same host, another connection
    clock.advance(10 * LEASE)
    ctl.tick()
    assert ctl.holds(aid)
    ctl.close()


async def test_two_envoys_on_one_sidecar_lose_only_their_own_slots() -> None:
    ctl, lv, clock, _ = await make()
    oa, _ = lv.stream_opened(A), lv.stream_opened(B)
    xa, xb = await admit(ctl, lv, A), await admit(ctl, lv, B)
    lv.acknowledged(xa)
    lv.acknowledged(xb)
    lv.stream_closed(oa)
    clock.advance(GRACE)
    assert lv.sweep() == 1
    assert not ctl.holds(xa) and ctl.holds(xb)
    ctl.close()


async def test_a_replaced_envoy_puts_earlier_slots_back_under_the_lease() -> None:
    ctl, lv, clock, _ = await make()
    owner = lv.stream_opened(A)
    aid = await admit(ctl, lv, A)
    lv.acknowledged(aid)
    lv.stream_closed(owner)
    clock.advance(1.0)
    lv.stream_opened(A)  # back within the grace: maybe a new process
    clock.advance(LEASE)
    ctl.tick()
    assert not ctl.holds(aid)  # the lease, not a leak
    ctl.close()


async def test_an_adopted_stream_is_owned_by_the_envoy_that_logged_it() -> None:
    ctl, lv, clock, _ = await make()
    owner = lv.stream_opened(A)
    assert ctl.renew_or_adopt("elsewhere", D, "t")  # admitted by an earlier process
    lv.acknowledged("elsewhere", A)
    clock.advance(10 * LEASE)
    ctl.tick()
    assert ctl.holds("elsewhere")
    lv.stream_closed(owner)
    clock.advance(GRACE)
    assert lv.sweep() == 1 and not ctl.holds("elsewhere")
    ctl.close()


def test_the_lease_table_keeps_under_a_lease_and_held_without_one() -> None:
    leases = Leases(LEASE)
    leases.grant("a", 0.0)
    leases.grant("b", 1.0)
    leases.hold("a")
    assert leases.unleased("a") and not leases.unleased("b")
    assert leases.next_expiry() == 1.0 + LEASE  # a has no timer
    assert leases.pop_expired(1000.0) == ["b"]
    assert leases.renew("a", 5.0)  # a periodic entry: nothing to push, still in flight
    assert "a" in leases and len(leases) == 1 and leases.next_expiry() is None
    assert leases.lease_again("a", 20.0) and not leases.unleased("a")
    assert leases.next_expiry() == 20.0 + LEASE
    assert not leases.lease_again("a", 21.0)  # under a lease already
    leases.hold("a")
    leases.drop("a")
    assert len(leases) == 0 and "a" not in leases and not leases.unleased("a")


async def test_held_without_a_lease_is_kept_by_the_controller_alone() -> None:
    """The table keeps no copy: what it reads is the controller's lease table, whoever
    changed it last."""
    ctl, lv, _, _ = await make()
    lv.stream_opened(A)
    aid = await admit(ctl, lv, A)
    assert not ctl.unleased(aid) and not lv.table.unleased(aid)
    lv.acknowledged(aid)
    assert ctl.unleased(aid) and lv.table.unleased(aid) and ctl.lease_count == 1
    assert ctl.lease_again(aid)
    assert not ctl.unleased(aid) and not lv.table.unleased(aid)
    assert ctl.hold_without_lease(aid) and lv.table.unleased(aid)
    assert not ctl.hold_without_lease("stranger") and not ctl.unleased("stranger")
    ctl.release(aid)
    assert not ctl.unleased(aid) and ctl.lease_count == 0
    ctl.close()


async def test_closed_liveness_releases_nothing_at_shutdown() -> None:
    ctl, lv, _, _ = await make()
    owner = lv.stream_opened(A)
    aid = await admit(ctl, lv, A)
    lv.acknowledged(aid)
    lv.close()
    lv.stream_closed(owner)  # the server stopping closes every stream
    assert lv._timer is None
    ctl.close()


# ------------------------------------------------------------ a whole sidecar over gRPC


async def test_over_grpc_a_slot_outlives_its_lease_and_returns_when_its_envoy_dies(
        tmp_path: Path) -> None:
    """The in-process runtime over loopback gRPC: Check, ext_proc and a held ALS stream
    (the stand-in plays Envoy); the stream reset plays SIGKILL."""
    lease, grace = 0.3, 0.5
    settings = parse_settings([
        "--priority-scheduler-enabled", "--grpc-listen", "127.0.0.1:0",
        "--http-listen", "127.0.0.1:0", "--worker-capacity-override", "4",
        "--admission-lease-secs", str(lease), "--envoy-owner-grace-secs", str(grace),
        "--log-format", "json"])
    app = await build_runtime(settings)
    await app.serve()
    envoy = EnvoyStandIn(app.grpc_port)

    def sample(name: str, **labels: str) -> float:
        v = app.metrics.registry.get_sample_value(name, labels)
        return 0.0 if v is None else v

    try:
        stream = envoy.open_log_stream()
        await eventually(lambda: sample("smg_sidecar_envoy_access_log_streams") == 1)
        resp = await asyncio.wait_for(envoy.check({"x-smg-priority": "default"}), 5)
        aid = admission_id(resp)
        await ext_proc_to_first_byte(envoy, aid)
        await asyncio.sleep(4 * lease)  # the condition under test is the passage of time
        assert app.pools[DEFAULT_POOL].controller.holds(aid)
        assert sample("smg_sidecar_lease_expired_total", **{"class": "default"}) == 0
        stream.cancel()  # the Envoy is gone
        ctl = app.pools[DEFAULT_POOL].controller
        took = await eventually(lambda: not ctl.holds(aid), timeout=grace + 2)
        assert took >= grace * 0.9
        assert sample("smg_sidecar_lease_expired_total", **{"class": "default"}) == 1
        assert sample("smg_sidecar_released_total", **{"class": "default",
                                                        "reason": "lease_expired"}) == 1
        assert sample("smg_sidecar_envoy_owner_lost_total") == 1
        assert sample("smg_sidecar_envoy_owner_released_total") == 1
        assert sample("smg_sidecar_envoy_owners_alive") == 0
        assert sample("smg_scheduler_inflight", **{"class": "default"}) == 0
    finally:
        await envoy.close()
        await asyncio.wait_for(app.stop(), 15)


async def ext_proc_to_first_byte(envoy: EnvoyStandIn, aid: str) -> None:
    process = envoy.channel.stream_stream(
        "/envoy.service.ext_proc.v3.ExternalProcessor/Process",
        request_serializer=ep.ProcessingRequest.SerializeToString,
        response_deserializer=ep.ProcessingResponse.FromString)
    first = ep.ProcessingRequest(request_headers=ep.HttpHeaders())
    md = struct_pb2.Struct()
    md.update({codec.ADMISSION_ID_KEY: aid})
    first.metadata_context.filter_metadata[codec.AUTHZ_NAMESPACE].CopyFrom(md)
    msgs = [first, ep.ProcessingRequest(response_headers=ep.HttpHeaders())]
    call = process(iter(msgs))
    kinds = [m.WhichOneof("response") async for m in call]
    # Response headers (the first byte) end the stream without an answer: Envoy continues.
    assert kinds == ["request_headers"]


async def eventually(cond: Callable[[], bool], timeout: float = 5.0) -> float:
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"not reached within {timeout} s")
        await asyncio.sleep(0.005)
    return time.monotonic() - t0
