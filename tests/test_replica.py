"""The replica's pure core (sidecar.coordination.replica) on a fake clock: every legal move
of the mode table, every illegal one refused, and what each mode lets the local core hold;
the stage and acknowledgement tables of one held admission."""

from __future__ import annotations

import itertools

import pytest

from sidecar.classes import PriorityClass
from sidecar.coordination.ledger import Arrival, ArriveStatus, FleetStatus, Holding
from sidecar.coordination.ledger import Event as Notification
from sidecar.coordination.outbox import Adopt, MarkFirstByte, MarkPreemptible, Release
from sidecar.coordination.replica import (
    ACKS,
    LOCAL,
    STAGES,
    TRANSITIONS,
    Ack,
    Answered,
    Arrived,
    Count,
    Expire,
    Fault,
    GoLocal,
    Grant,
    Held,
    HoldLocal,
    IllegalStage,
    IllegalTransition,
    LocalAdopt,
    LocalCarry,
    LocalFirstByte,
    LocalRelease,
    Mode,
    Registered,
    Replica,
    Return,
    Seen,
    Send,
    Stage,
    Stop,
    Trigger,
    View,
    next_mode,
)
from sidecar.scheduler.lifecycle import (
    Admission,
    Admitted,
    Outcome,
    Preempted,
    Rejected,
    Released,
    ReleaseReason,
    ReleaseResult,
)
from tests.clock import FakeClock

INTERVAL = 1.0
VIEW = View(capacity=8, live_replicas=2, inflight=4, held=2)  # share 4, limit 4
NEWER = View(capacity=8, live_replicas=2, inflight=6, held=1)  # limit 1 + 1 = 2


def _replica(clock: FakeClock | None = None) -> tuple[Replica, FakeClock]:
    clock = clock or FakeClock()
    return Replica(interval=INTERVAL, clock=clock), clock


def _drive(r: Replica, clock: FakeClock, trigger: Trigger) -> None:
    """Fire ``trigger`` through the public method that means it."""
    if trigger is Trigger.REGISTERED:
        r.registered(VIEW)
    elif trigger is Trigger.FLEET_SETTLING:
        r.fleet_settling()
    elif trigger is Trigger.LEDGER_LOST:
        r.ledger_lost()
    elif trigger is Trigger.RESYNC_SENT:
        r.resync_sent()
    elif trigger is Trigger.RESYNC_FAILED:
        r.resync_failed()
    elif trigger is Trigger.RESYNC_HELD:
        r.resync_answered(known=False, settling=0.0, held=1, view=NEWER)
    else:
        assert trigger is Trigger.RESYNC_BACK
        # Answered twice an interval apart: the second one returns.
        if r.mode is Mode.RESYNCING:
            r.resync_answered(known=True, settling=0.0, held=1, view=NEWER)
            if r.mode is Mode.OK:
                return
            r.resync_sent()
        clock.advance(INTERVAL)
        r.resync_answered(known=True, settling=0.0, held=1, view=NEWER)


# A path from STARTING to every mode, through legal moves only.
_PATHS: dict[Mode, list[Trigger]] = {
    Mode.STARTING: [],
    Mode.OK: [Trigger.REGISTERED],
    Mode.DEGRADED: [Trigger.REGISTERED, Trigger.LEDGER_LOST],
    Mode.RESYNCING: [Trigger.REGISTERED, Trigger.LEDGER_LOST, Trigger.RESYNC_SENT],
    Mode.SETTLING: [Trigger.FLEET_SETTLING],
}


def _in(mode: Mode) -> tuple[Replica, FakeClock]:
    r, clock = _replica()
    for t in _PATHS[mode]:
        _drive(r, clock, t)
    assert r.mode is mode
    return r, clock


def test_the_table_covers_every_mode_and_only_local_modes_keep_a_local_core() -> None:
    assert {m for m, _ in TRANSITIONS} == set(Mode)
    assert {Mode.DEGRADED, Mode.RESYNCING, Mode.SETTLING} == LOCAL
    # Every mode can be left, and OK can be reached again from every local mode.
    for m in LOCAL:
        seen, todo = {m}, [m]
        while todo:
            cur = todo.pop()
            for (frm, _), to in TRANSITIONS.items():
                if frm is cur and to not in seen:
                    seen.add(to)
                    todo.append(to)
        assert Mode.OK in seen


@pytest.mark.parametrize(("mode", "trigger"), sorted(TRANSITIONS, key=str))
def test_every_legal_move_lands_where_the_table_says(mode: Mode, trigger: Trigger) -> None:
    r, clock = _in(mode)
    if trigger is Trigger.RESYNC_BACK:
        # The first answer only starts the interval; one a whole interval later returns.
        r.resync_answered(known=True, settling=0.0, held=1, view=NEWER)
        clock.advance(INTERVAL)
        r.resync_sent()
        assert r.mode is Mode.RESYNCING
        r.resync_answered(known=True, settling=0.0, held=1, view=NEWER)
    else:
        _drive(r, clock, trigger)
    assert r.mode is TRANSITIONS[mode, trigger]
    assert r.local is (r.mode in LOCAL)


@pytest.mark.parametrize(("mode", "trigger"),
                         [(m, t) for m, t in itertools.product(Mode, Trigger)
                          if (m, t) not in TRANSITIONS])
def test_every_illegal_move_is_refused_and_changes_nothing(mode: Mode,
                                                          trigger: Trigger) -> None:
    with pytest.raises(IllegalTransition):
        next_mode(mode, trigger)
    r, clock = _in(mode)
    if trigger in (Trigger.RESYNC_HELD, Trigger.RESYNC_BACK):
        with pytest.raises(IllegalTransition):
            r.resync_answered(known=True, settling=0.0, held=1, view=NEWER)
    else:
        with pytest.raises(IllegalTransition):
            _drive(r, clock, trigger)
    assert r.mode is mode


def test_losing_the_ledger_builds_the_local_core_once() -> None:
    r, _ = _in(Mode.OK)
    assert r.ledger_lost()  # OK → DEGRADED: the driver builds the local core
    assert not r.ledger_lost()  # already away
    r.resync_sent()
    assert not r.ledger_lost() and r.mode is Mode.RESYNCING  # the resync's answer decides
    r2, _ = _in(Mode.STARTING)
    assert r2.ledger_lost() and r2.view == View()  # never reached: no view, no share
    assert r2.degraded_limit(8) == 0


def test_degraded_keeps_the_last_view_and_its_limit_while_a_resync_is_in_flight() -> None:
    # A recovery resync from DEGRADED may hang until its call timeout (the server is
    # away): the local core keeps admitting within L meanwhile (the hung-server refusal:
    # it used to be 0 here for a call timeout out of every interval).
    r, _ = _in(Mode.DEGRADED)
    assert r.degraded_limit(8) == 4
    assert r.degraded_limit(2) == 1  # our own capacity, if smaller: min(2, 8) over 2
    r.resync_sent()
    assert r.mode is Mode.RESYNCING and r.degraded_limit(8) == 4 and r.recycle is None
    r.resync_failed()
    assert r.mode is Mode.DEGRADED and r.degraded_limit(8) == 4


def test_a_return_needs_a_whole_interval_of_answers_a_known_registration_and_a_settled_fleet(
) -> None:
    r, clock = _in(Mode.RESYNCING)
    assert r.resync_answered(known=True, settling=0.0, held=3, view=NEWER) is Mode.SETTLING
    assert r.recycle == 3 and r.degraded_limit(8) == 3 and r.view == VIEW  # recycle-only
    clock.advance(0.5 * INTERVAL)
    r.resync_sent()
    assert r.degraded_limit(8) == 0  # from SETTLING: nothing reused until the answer
    assert r.resync_answered(known=True, settling=0.0, held=2, view=NEWER) is Mode.SETTLING
    assert r.recycle == 2
    clock.advance(0.5 * INTERVAL)
    r.resync_sent()
    # A whole interval since the first answer, but the fleet still settles, or we are unknown.
    assert r.resync_answered(known=True, settling=0.3, held=2, view=NEWER) is Mode.SETTLING
    r.resync_sent()
    assert r.resync_answered(known=False, settling=0.0, held=2, view=NEWER) is Mode.SETTLING
    r.resync_sent()
    assert r.resync_answered(known=True, settling=0.0, held=2, view=NEWER) is Mode.OK
    assert r.recycle is None and r.view == NEWER and r.degraded_limit(8) == 2


def test_a_failed_resync_restarts_the_interval_and_drops_the_recycle_cap() -> None:
    r, clock = _in(Mode.RESYNCING)
    r.resync_answered(known=True, settling=0.0, held=1, view=NEWER)
    clock.advance(INTERVAL)
    r.resync_sent()
    r.resync_failed()  # the outage rule again
    assert r.mode is Mode.DEGRADED and r.recycle is None and r.degraded_limit(8) == 4
    r.resync_sent()
    # The first answer after the failure counts from now, not from the earlier one.
    assert r.resync_answered(known=True, settling=0.0, held=1, view=NEWER) is Mode.SETTLING
    clock.advance(INTERVAL)
    r.resync_sent()
    assert r.resync_answered(known=True, settling=0.0, held=1, view=NEWER) is Mode.OK


def test_starting_while_the_fleet_settles_reuses_nothing_and_keeps_no_view() -> None:
    r, clock = _in(Mode.SETTLING)
    assert r.recycle == 0 and r.view == View() and r.degraded_limit(8) == 0
    assert not r.ledger_lost() and r.mode is Mode.SETTLING
    r.resync_sent()
    r.resync_failed()
    assert r.degraded_limit(8) == 0  # no view: no share in an outage
    r.resync_sent()
    r.resync_answered(known=True, settling=0.0, held=0, view=VIEW)
    clock.advance(INTERVAL)
    r.resync_sent()
    assert r.resync_answered(known=True, settling=0.0, held=0, view=VIEW) is Mode.OK
    assert r.degraded_limit(8) == 4


def test_a_view_taken_just_after_the_switch_is_kept() -> None:
    # A heartbeat answered after another call degraded the replica: its view is newer.
    r, _ = _in(Mode.DEGRADED)
    r.seen(NEWER)
    assert r.view == NEWER and r.mode is Mode.DEGRADED


# ------------------------------------------------------------------ one held admission


def test_every_stage_move_the_table_allows_and_none_other() -> None:
    for old, new in itertools.product(Stage, Stage):
        h = Held(PriorityClass.BULK, "t", 1.0, stage=old)
        if new in STAGES[old]:
            h.move(new)
            assert h.stage is new
        else:
            with pytest.raises(IllegalStage):
                h.move(new)
            assert h.stage is old
    assert STAGES[Stage.RELEASED] == frozenset()  # final
    assert all(Stage.RELEASED in STAGES[s] for s in Stage if s is not Stage.RELEASED)


def test_the_ledger_is_told_of_a_candidate_only_once_marked() -> None:
    h = Held(PriorityClass.BULK, "t", 1.0)
    assert h.holding("x") == Holding("x", PriorityClass.BULK, "t", False, False)
    h.move(Stage.PREEMPTIBLE)  # its mark still waits: a candidate only locally
    assert h.preemptible and not h.mark_sent
    assert not h.holding("x").preemptible
    h.move(Stage.MARKED)
    assert h.holding("x").preemptible and h.mark_sent
    h.move(Stage.STREAMING)
    assert h.holding("x") == Holding("x", PriorityClass.BULK, "t", True, False)
    assert not h.preemptible


def test_the_ack_timeout_runs_from_admission_restarts_and_stops_once_acknowledged() -> None:
    h = Held(PriorityClass.BULK, "t", 10.0)
    assert h.ack is Ack.UNACKNOWLEDGED and h.ack_expired(10.0) and not h.ack_expired(9.9)
    h.renew(15.0)  # a sign no liveness tracker vouches for: the timeout restarts
    assert not h.ack_expired(14.0) and h.ack_expired(15.0)
    h.acknowledge()
    assert h.acknowledged and not h.ack_expired(1e9)
    h.renew(20.0)  # acknowledged: nothing to restart
    assert h.acknowledged
    h.unacknowledge(30.0)  # its Envoy may be gone: the timeout runs again from now
    assert not h.acknowledged and not h.ack_expired(29.0) and h.ack_expired(30.0)
    assert ACKS[Ack.ACKNOWLEDGED] == {Ack.ACKNOWLEDGED, Ack.UNACKNOWLEDGED}


# ------------------------------------------------------------------ holdings: events → effects

BULK, SYSTEM = PriorityClass.BULK, PriorityClass.SYSTEM


def _ok() -> tuple[Replica, FakeClock]:
    return _in(Mode.OK)


def test_a_grant_answers_its_waiter_once_and_a_stray_grant_gives_the_slot_back() -> None:
    r, clock = _ok()
    r.waiter_arrived("w", BULK, "t")
    clock.advance(2.0)
    fx = r.notified(Notification("grant", "w", waited=1.5, starvation=True))
    count, grant = fx
    assert isinstance(count, Count) and isinstance(grant, Grant)
    (ev,) = count.events
    assert isinstance(ev, Admitted) and ev is grant.admitted
    assert ev.queued and ev.starvation and ev.waited == 1.5
    assert ev.admission.admitted_at == clock.now and "w" in r.held
    # Read twice (a list restored with an older copy): already held, nothing to do.
    assert r.notified(Notification("grant", "w")) == []
    # A grant nobody waits for any more (left, answered, moved locally): released.
    assert r.notified(Notification("grant", "gone")) == [
        Send(Release("gone", ReleaseReason.CANCELLED))]


def test_a_grant_while_away_from_the_ledger_is_given_back() -> None:
    r, _ = _ok()
    r.waiter_arrived("w", BULK, "t")
    r.ledger_lost()
    assert r.notified(Notification("grant", "w")) == [
        Send(Release("w", ReleaseReason.CANCELLED))]
    assert "w" not in r.held


def test_an_expiry_answers_its_waiter_once() -> None:
    r, _ = _ok()
    r.waiter_arrived("w", BULK, "t")
    count, expire = r.notified(Notification("expired", "w", waited=3.0))
    assert isinstance(count, Count) and expire == Expire("w", 3.0)
    (ev,) = count.events
    assert isinstance(ev, Rejected) and ev.outcome is Outcome.REJECTED_QUEUE_TIMEOUT
    assert r.notified(Notification("expired", "w", waited=3.0)) == []
    r.waiter_arrived("x", BULK, "t")
    r.waiter_gone("x")  # its requester left first
    assert r.notified(Notification("expired", "x")) == []


def test_a_preemption_ends_the_admission_and_stops_it() -> None:
    r, _ = _ok()
    r.admitted("a", BULK, "t", waited=0.0, queued=False)
    r.held["a"].move(Stage.PREEMPTIBLE)
    r.held["a"].move(Stage.MARKED)
    count, stop = r.notified(Notification("preempt", "a", by_class=SYSTEM))
    assert isinstance(count, Count) and stop == Stop("a", undelivered=True)
    pre, rel = count.events
    assert isinstance(pre, Preempted) and pre.by_class is SYSTEM
    assert isinstance(rel, Released) and rel.reason is ReleaseReason.PREEMPTED
    assert "a" not in r.held and "a" in r.ended
    assert r.notified(Notification("preempt", "a")) == []  # ended once
    # A release after it (Envoy's final entry for the 503) is a duplicate.
    assert r.release("a", ReleaseReason.COMPLETED) == (ReleaseResult.ALREADY_RELEASED, [])


def test_a_preemption_the_first_byte_reply_already_delivered_is_not_undelivered() -> None:
    r, _ = _ok()
    r.admitted("a", BULK, "t", waited=0.0, queued=False)
    h = r.held["a"]
    for st in (Stage.PREEMPTIBLE, Stage.MARKED, Stage.CONFIRMING, Stage.STOPPED):
        h.move(st)
    assert h.first_byte  # listed so: never a candidate again
    *_, stop = r.preempted("a", SYSTEM)
    assert stop == Stop("a", undelivered=False)


def test_while_away_the_local_core_decides_and_the_mirror_follows_its_events() -> None:
    r, clock = _ok()
    r.admitted("a", BULK, "t", waited=0.0, queued=False)
    r.ledger_lost()
    assert r.release("a", ReleaseReason.COMPLETED) == (
        ReleaseResult.RELEASED, [LocalRelease("a", ReleaseReason.COMPLETED)])
    assert "a" in r.held  # until the local core's Released event
    r.local_released("a", ReleaseReason.COMPLETED)
    assert "a" not in r.held and r.held == {}
    assert r.preempted("a", SYSTEM) == []
    # An arrive that the ledger answered after the switch: carried into the local core.
    _, fx = r.admitted("late", BULK, "t", waited=0.0, queued=False)
    assert fx[0] == LocalCarry("late", BULK, "t", clock.now, streaming=False)
    r.local_admitted(Admission("loc", BULK, "t", clock.now))
    assert set(r.held) == {"late", "loc"}
    assert r.preempted("late", SYSTEM) == [LocalRelease("late", ReleaseReason.PREEMPTED),
                                           Stop("late", undelivered=True)]


def test_a_release_in_ok_is_counted_and_sent_once() -> None:
    r, _ = _ok()
    r.admitted("a", BULK, "t", waited=0.0, queued=False)
    result, (count, send) = r.release("a", ReleaseReason.COMPLETED)
    assert result is ReleaseResult.RELEASED
    assert isinstance(count, Count) and send == Send(Release("a", ReleaseReason.COMPLETED))
    assert r.release("a", ReleaseReason.COMPLETED) == (ReleaseResult.ALREADY_RELEASED, [])
    assert r.release("b", ReleaseReason.COMPLETED) == (ReleaseResult.UNKNOWN, [])


def test_adoption_only_of_what_did_not_end_here_and_into_the_right_place() -> None:
    r, _ = _ok()
    fx = r.adopted("s", BULK, "t")
    assert fx is not None and fx[-1] == Send(Adopt(Holding("s", BULK, "t", True, False)))
    assert r.held["s"].first_byte and r.held["s"].acknowledged
    r.release("s", ReleaseReason.COMPLETED)
    assert r.adopted("s", BULK, "t") is None  # completed here: never back
    r.admitted("e", BULK, "t", waited=0.0, queued=False)
    r.release("e", ReleaseReason.LEASE_EXPIRED)
    r.ledger_lost()
    fx = r.adopted("e", BULK, "t")  # expired only: the one way back
    assert fx is not None and fx[-1] == LocalAdopt("e", BULK, "t")


def test_a_takeover_holds_the_predecessors_admissions_unacknowledged() -> None:
    r, clock = _ok()
    r.admitted("mine", BULK, "t", waited=0.0, queued=False)
    fx = r.taken_over([Holding("mine", BULK, "t"), Holding("p", BULK, "t", True),
                       Holding("q", SYSTEM, "u")])
    assert fx[-1] == Fault("taken_over")
    assert sum(isinstance(f, Count) for f in fx) == 2
    assert r.held["p"].stage is Stage.STREAMING and r.held["q"].stage is Stage.ADMITTED
    assert not r.held["p"].acknowledged and r.held["p"].ack_expired(clock.now)


def test_an_id_the_ledger_ended_is_stopped_if_it_can_be_else_counted_again() -> None:
    r, _ = _ok()
    for aid in ("stoppable", "running"):
        r.admitted(aid, BULK, "t", waited=0.0, queued=False)
    fx = r.ended_but_held(["stoppable", "running", "unknown"],
                          can_stop=lambda aid: aid == "stoppable")
    assert fx[0] == Fault("ended_but_running_stopped", "stoppable")
    assert fx[-1] == Send(Adopt(Holding("running", BULK, "t")))
    assert "stoppable" not in r.held and "running" in r.held


def test_the_return_marks_what_opened_while_away_and_resends_every_first_byte() -> None:
    r, clock = _ok()
    for aid in ("adm", "pre", "marked", "streaming"):
        r.admitted(aid, BULK, "t", waited=0.0, queued=False)
    r.held["marked"].move(Stage.PREEMPTIBLE)
    r.held["marked"].move(Stage.MARKED)
    r.held["streaming"].move(Stage.STREAMING)
    r.ledger_lost()
    r.held["pre"].move(Stage.PREEMPTIBLE)  # opened while away
    call = r.heartbeat()
    assert call.recovery and r.mode is Mode.RESYNCING
    listed = list(call.holdings)
    assert not next(h for h in listed if h.id == "pre").preemptible  # not told yet
    # The first answer: "marked" was preempted in the ledger meanwhile (its slot is the
    # preemptor's: the local core does not give it again).
    fx = r.recovery_answered(FleetStatus(True, 8, 1, 3, refused=("marked",)), listed)
    assert fx[:2] == [LocalRelease("marked", ReleaseReason.PREEMPTED, reuse=False),
                      Stop("marked", undelivered=True)]  # reported if it cannot be stopped
    assert fx[-1] == HoldLocal(None) and r.mode is Mode.SETTLING
    assert r.recycle == 3 and "marked" not in r.held  # recycle counted without it
    r.local_released("marked", ReleaseReason.PREEMPTED)  # the local core's event follows
    r.local_released("adm", ReleaseReason.COMPLETED)  # ends while the next resync flies
    clock.advance(INTERVAL)
    listed = list(r.heartbeat().holdings)
    status = FleetStatus(True, 8, 1, 3, by_class={BULK: 3})
    fx = r.recovery_answered(status, [*listed, Holding("adm", BULK, "t")])
    assert r.mode is Mode.OK
    i = fx.index(Return())
    assert fx[:i] == [Seen({BULK: 3}, 1), Seen({BULK: 3}, 1)]
    assert fx[i + 1:] == [Send(Release("adm", ReleaseReason.COMPLETED)),
                          Send(MarkPreemptible("pre")), Send(MarkFirstByte("streaming"))]
    assert r.held["pre"].stage is Stage.MARKED


def test_an_admission_made_while_the_resync_flew_is_listed_again_before_any_return() -> None:
    # While the recovery resync hung, the local core admitted within L ("late"); the answer
    # comes with the list the resync carried, so the ledger does not count "late" yet:
    # no return (not even a whole interval later), SETTLING holding at most what the
    # ledger counts (the list's ids it kept), and a resync again at once, which lists it.
    r, clock = _ok()
    for aid in ("a", "b", "gone"):
        r.admitted(aid, BULK, "t", waited=0.0, queued=False)
    r.ledger_lost()
    listed = list(r.heartbeat().holdings)
    assert r.mode is Mode.RESYNCING and r.degraded_limit(8) == 4  # L, not 0
    r.local_admitted(Admission("late", BULK, "t", clock()))  # the resync hangs meanwhile
    r.local_released("a", ReleaseReason.COMPLETED)
    clock.advance(INTERVAL)
    fx = r.recovery_answered(FleetStatus(True, 8, 1, 3, refused=("gone",)), listed)
    assert r.mode is Mode.SETTLING and fx[-1] == HoldLocal(0.0)
    assert r.recycle == 2  # "a" and "b": the ledger counts them, "late" not
    assert not any(isinstance(f, Return | Send) for f in fx)
    assert fx[0] == LocalRelease("gone", ReleaseReason.PREEMPTED, reuse=False)
    r.local_released("gone", ReleaseReason.PREEMPTED)
    # The next resync (from SETTLING: nothing reused while it flies) lists "late".
    call = r.heartbeat()
    assert "late" in {h.id for h in call.holdings} and r.degraded_limit(8) == 0
    clock.advance(INTERVAL)
    fx = r.recovery_answered(FleetStatus(True, 8, 1, 2, by_class={BULK: 2}),
                             list(call.holdings))
    assert r.mode is Mode.OK and Return() in fx


def test_start_up_registers_or_settles_with_no_view() -> None:
    r, _ = _replica()
    status = FleetStatus(True, 8, 2, 1, by_class={BULK: 1})
    assert r.started(status) == [Seen({BULK: 1}, 2), Registered()]
    assert r.mode is Mode.OK and r.view == View(8, 2, 1, 0)
    r, _ = _replica()
    fx = r.started(FleetStatus(True, 8, 2, 1, settling=0.1))
    assert fx[1:] == [GoLocal("RuntimeError: fleet settling", announce=False),
                      HoldLocal(0.1)]
    assert r.mode is Mode.SETTLING and r.view == View() and r.degraded_limit(8) == 0
    r, _ = _replica()
    assert r.started(FleetStatus(True, 8, 2, 1, settling=5.0))[-1] == HoldLocal(None)



def test_only_what_envoy_never_showed_is_unacknowledged_past_the_cutoff() -> None:
    r, clock = _ok()
    for aid in ("old", "acked", "new"):
        r.admitted(aid, BULK, "t", waited=0.0, queued=False)
        if aid == "old":
            clock.advance(30.0)
    r.held["acked"].acknowledge()
    assert r.unacknowledged(clock.now - 30.0) == ["old"]


def test_a_heartbeat_is_a_steady_resync_while_ok_and_a_recovery_while_away() -> None:
    r, _ = _ok()
    r.admitted("a", BULK, "t", waited=0.0, queued=False)
    call = r.heartbeat()
    assert not call.recovery and call.holdings == (Holding("a", BULK, "t"),)
    assert r.mode is Mode.OK
    status = FleetStatus(True, 8, 2, 6, held=1, by_class={BULK: 6})
    assert r.heartbeat_answered(status, can_stop=lambda _: False) == [Seen({BULK: 6}, 2)]
    assert r.view == View(8, 2, 6, 1)
    # Unknown: an outage and a return.
    fx = r.heartbeat_answered(FleetStatus(False, 8, 2, 6), can_stop=lambda _: False)
    assert fx == [GoLocal("RuntimeError: registration lost")] and r.mode is Mode.DEGRADED
    assert r.view == View(8, 2, 6, 1)  # the view from before
    assert r.lost("again") == []  # already away
    call = r.heartbeat()
    assert call.recovery and r.mode is Mode.RESYNCING


def test_a_deferred_mark_leaves_only_for_a_candidate_before_its_first_byte_while_ok() -> None:
    r, _ = _ok()
    for aid in ("pre", "streaming", "plain"):
        r.admitted(aid, BULK, "t", waited=0.0, queued=False)
    r.held["pre"].move(Stage.PREEMPTIBLE)
    r.held["streaming"].move(Stage.PREEMPTIBLE)
    r.held["streaming"].move(Stage.STREAMING)
    assert r.mark_due("pre") == [Send(MarkPreemptible("pre"))]
    assert r.mark_due("pre") == []  # sent once
    assert r.mark_due("streaming") == [] and r.mark_due("plain") == []
    assert r.mark_due("gone") == []
    r.admitted("away", BULK, "t", waited=0.0, queued=False)
    r.held["away"].move(Stage.PREEMPTIBLE)
    r.ledger_lost()
    assert r.mark_due("away") == []  # the return marks it


def test_what_an_arrive_reply_means() -> None:
    r = Replica(interval=INTERVAL, clock=FakeClock(), replica="me")
    r.registered(VIEW)
    r.admitted("mine", BULK, "t", waited=0.0, queued=False)
    r.waiter_arrived("a", SYSTEM, "t")
    verdict, adm, fx = r.arrive_answered(
        "a", SYSTEM, "t", Arrival(ArriveStatus.ADMITTED, victim="mine", victim_owner="me"))
    assert verdict is Arrived.ADMITTED and adm is not None and adm.preempted
    assert Stop("mine", undelivered=True) in fx and "mine" not in r.held and "a" in r.held
    verdict, adm, fx = r.arrive_answered(
        "b", SYSTEM, "t", Arrival(ArriveStatus.ADMITTED, victim="x", victim_owner="other"))
    assert verdict is Arrived.ADMITTED and not any(isinstance(f, Stop) for f in fx)
    verdict, adm, fx = r.arrive_answered("c", BULK, "t",
                                         Arrival(ArriveStatus.REJECTED_QUEUE_FULL))
    assert verdict is Arrived.REJECTED and adm is None
    (count,) = fx
    assert isinstance(count, Count)
    assert r.arrive_answered("d", BULK, "t", Arrival(ArriveStatus.QUEUED, timeout=1.0)) == (
        Arrived.QUEUED, None, [])
    verdict, _, fx = r.arrive_answered("e", BULK, "t", Arrival(ArriveStatus.UNREGISTERED))
    assert verdict is Arrived.MOVED and fx == [GoLocal("RuntimeError: arrive answered "
                                                       "unregistered")]


def test_a_data_loss_degrades_a_repaired_key_is_only_counted() -> None:
    r, _ = _ok()
    assert r.data_loss("counters_lost") == [Fault("counters_lost")] and r.mode is Mode.OK
    assert r.data_loss("stale_copy") == [
        Fault("stale_copy"), GoLocal("RuntimeError: ledger data loss: stale_copy")]
    assert r.mode is Mode.DEGRADED


def test_the_first_byte_reaches_the_ledger_only_when_it_may_hold_a_candidate() -> None:
    r, _ = _ok()
    for aid in ("plain", "pre", "marked", "confirm", "refused"):
        r.admitted(aid, BULK, "t", waited=0.0, queued=False)
    assert r.stop_opened("pre") and r.held["pre"].acknowledged
    for aid in ("marked", "confirm", "refused"):
        r.stop_opened(aid)
        r.mark_due(aid)
    assert r.first_byte("plain") == [] and r.first_byte("pre") == []
    assert r.first_byte("marked") == [Send(MarkFirstByte("marked"))]
    assert r.first_byte("marked") is None and not r.stop_opened("marked")
    assert r.confirming("plain") is None  # past its first byte already
    assert r.confirming("confirm") == [Send(MarkFirstByte("confirm"))]
    assert r.held["confirm"].stage is Stage.CONFIRMING
    r.confirmed("confirm", True)
    assert r.held["confirm"].stage is Stage.STREAMING
    r.confirming("refused")
    r.confirmed("refused", False)
    assert r.held["refused"].stage is Stage.STOPPED
    r.ledger_lost()
    r.admitted("away", BULK, "t", waited=0.0, queued=False)
    assert r.first_byte("away") == [LocalFirstByte("away")]


def test_with_a_liveness_tracker_a_sign_only_restarts_the_ack_timeout() -> None:
    r, clock = _ok()
    r.liveness_decides = True
    r.admitted("a", BULK, "t", waited=0.0, queued=False)
    clock.advance(10.0)
    r.stop_opened("a")
    assert not r.held["a"].acknowledged and r.held["a"].unacked_since == clock.now


def test_a_timeout_or_a_client_leaving_is_counted_for_the_waiter() -> None:
    r, _ = _ok()
    r.waiter_arrived("w", BULK, "t")
    (count,) = r.timed_out("w", BULK, "t", 2.0)
    assert isinstance(count, Count)
    (ev,) = count.events
    assert isinstance(ev, Rejected) and ev.outcome is Outcome.REJECTED_QUEUE_TIMEOUT
    assert r.notified(Notification("grant", "w")) == [
        Send(Release("w", ReleaseReason.CANCELLED))]
    (count,) = r.client_left("x", BULK, "t", 1.0)
    assert isinstance(count, Count)
    (ev,) = count.events
    assert isinstance(ev, Rejected) and ev.outcome is Outcome.CLIENT_CANCELLED


def test_a_first_byte_answer_and_what_no_answer_or_an_unknown_replica_means() -> None:
    r, _ = _ok()
    assert r.first_bytes_answered(["a", "b"], [1, "0"]) == [Answered("a", True),
                                                           Answered("b", False)]
    assert r.first_bytes_answered(["a"], None) == [Answered("a", True)]  # call failed
    assert r.mode is Mode.OK
    # An adoption or reload in the same flush found this replica unknown: the responses go.
    assert r.first_bytes_answered(["a"], None, registration_lost=True) == [
        Answered("a", True), GoLocal("RuntimeError: registration lost")]
    assert r.mode is Mode.DEGRADED


def test_an_adoption_the_ledger_had_ended_is_counted_again_and_reported() -> None:
    r, _ = _ok()
    status = FleetStatus(True, 8, 1, 1, refused=("s",))
    assert r.adopt_answered(status) == [Fault("ended_but_running_readded", "s")]


def test_a_start_up_register_that_itself_found_a_loss_settles_already_local() -> None:
    # The ledger reports the loss while the register's reply is read: lost() first.
    r, _ = _replica()
    assert r.lost("RuntimeError: ledger data loss: stale_copy", announce=False) == [
        GoLocal("RuntimeError: ledger data loss: stale_copy", announce=False)]
    fx = r.started(FleetStatus(True, 8, 2, 1, settling=0.1))
    assert fx[1:] == [HoldLocal(0.1)]  # no second GoLocal: the local core exists
    assert r.mode is Mode.SETTLING and r.degraded_limit(8) == 0
    r, _ = _replica()
    r.lost("x")
    assert r.started(FleetStatus(True, 8, 2, 1)) == [Seen({}, 2)]
    assert r.mode is Mode.DEGRADED and r.view == View()  # no view from that ledger


def test_what_this_process_ended_is_not_taken_over_again() -> None:
    # A restored older copy still shows the predecessor holding an admission this process
    # took over and released since: not held again (the next resync drops it there).
    r, _ = _ok()
    r.taken_over([Holding("x", BULK, "t", True)])
    r.release("x", ReleaseReason.COMPLETED)
    assert r.taken_over([Holding("x", BULK, "t", True)]) == [Fault("taken_over")]
    assert "x" not in r.held
    r.admitted("e", BULK, "t", waited=0.0, queued=False)
    r.release("e", ReleaseReason.LEASE_EXPIRED)  # expired only: may still run
    r.taken_over([Holding("e", BULK, "t", True)])
    assert "e" in r.held


# ------------------------------------------------------------------ the share's N


def _started(n: int, unheard: int, capacity: int = 6) -> Replica:
    """A replica whose start-up register answered ``n`` live, ``unheard`` of them earlier
    registrations not yet known to count it (what ledger.lua's fleet_reply reports)."""
    r, _ = _replica()
    r.live_seen(n)  # the envelope of that same reply
    r.started(FleetStatus(False, capacity, n, 0, unheard=unheard))
    return r


def test_replicas_started_one_after_the_other_share_at_most_capacity_in_an_outage() -> None:
    # The fleet simulation's finding: r0 registered alone (N = 1), r1 (N = 2), r2 (N = 3),
    # and the server hung before r0's next heartbeat: 6 + 3 + 2 = 11 of 6 from each
    # replica's own N. r1 and r2 registered after r0 read its last reply: no share yet.
    fleet = [_started(1, 0), _started(2, 1), _started(3, 2)]
    for r in fleet:
        r.lost("TimeoutError")
    assert [r.share(6) for r in fleet] == [6, 0, 0]
    assert sum(r.degraded_limit(6) for r in fleet) == 6
    assert [r.heard for r in fleet] == [True, False, False]


def test_every_reply_brings_the_live_count_and_the_share_follows_it() -> None:
    # The earlier replica learns N from any reply (an arrive's included), not only from
    # its next heartbeat; the newcomers take their shares once a status says every
    # replica registered before them has read such a reply.
    fleet = [_started(1, 0), _started(2, 1), _started(3, 2)]
    fleet[0].live_seen(3)  # r0's next reply, whatever it answered
    assert fleet[0].share(6) == 2 and fleet[0].live_replicas == 3
    for r in fleet[1:]:
        r.live_seen(3)
        r.heartbeat_answered(FleetStatus(True, 6, 3, 0, unheard=0), can_stop=lambda _: False)
    assert [r.share(6) for r in fleet] == [2, 2, 2]
    for r in fleet:
        r.lost("TimeoutError")
    assert sum(r.degraded_limit(6) for r in fleet) == 6
    # A later status that says someone may not count us again (our registration lapsed
    # and was made again, or its record was lost): no share until they do.
    r = fleet[1]
    r.resync_sent()
    r.recovery_answered(FleetStatus(False, 6, 3, 0, unheard=1), [])
    assert r.mode is Mode.SETTLING and not r.heard
    r.resync_sent()
    r.resync_failed()
    assert r.mode is Mode.DEGRADED and r.degraded_limit(6) == 0 and r.share(6) == 0


def test_settling_reuses_its_own_slots_even_before_the_others_count_it() -> None:
    # Recycle-only holds what the ledger counts for this replica: safe whoever counts it.
    r, _ = _in(Mode.RESYNCING)
    r.recovery_answered(FleetStatus(True, 8, 2, 3, held=3, unheard=1),
                        [Holding(f"h{i}", BULK, "t") for i in range(3)])
    assert r.mode is Mode.SETTLING and not r.heard
    assert r.recycle == 0 and r.degraded_limit(8) == 0  # held nothing here: nothing to reuse
    for i in range(3):
        r.admitted(f"h{i}", BULK, "t", waited=0.0, queued=False)
    r.resync_sent()
    r.recovery_answered(FleetStatus(True, 8, 2, 3, held=3, unheard=1),
                        [Holding(f"h{i}", BULK, "t") for i in range(3)])
    assert r.recycle == 3 and r.degraded_limit(8) == 3


def test_a_registration_made_again_by_a_flush_takes_no_share_until_counted() -> None:
    r, _ = _ok()
    assert r.heard and r.share(8) == 4
    r.first_bytes_answered([], None, registration_lost=True)
    assert r.mode is Mode.DEGRADED and not r.heard and r.degraded_limit(8) == 0
    r.adopt_answered(FleetStatus(True, 8, 2, 0, unheard=0))
    assert r.heard and r.degraded_limit(8) == 4


def test_a_reply_from_a_ledger_that_lost_its_data_does_not_raise_the_share() -> None:
    # After a restart empty the first replies count only the replicas re-registered so
    # far: N dips. The view's N holds until the next view (found by tests/test_fleet.py:
    # a local admission past capacity while the fleet re-registered).
    r, _ = _ok()  # view: C 8, N 2
    r.live_seen(1)
    r.lost("RuntimeError: arrive answered unregistered")
    assert r.live_replicas == 2 and r.share(8) == 4 and r.degraded_limit(8) == 4
    r.resync_sent()
    r.recovery_answered(FleetStatus(True, 8, 1, 0), [])  # held: SETTLING, old view kept
    assert r.live_replicas == 2


def test_a_count_read_since_the_view_holds_when_a_ledger_that_lost_its_data_counts_fewer(
        ) -> None:
    # Found by the long profile (seed 1004, step 413,236): r0's view counted 2 (r2 joined
    # after its last heartbeat); back from a server pause, still settling, it read a reply
    # counting 3, and r2 took its share of C/3 once r0 had read one; then the server
    # restarted empty and r0's first reply counted 1. Taking the newest reply's count, N
    # fell back to the view's 2: shares 3 + 2 + 2 of 6. N now only grows until the next
    # view.
    r, clock = _ok()  # view: C 8, N 2
    r.lost("TimeoutError")
    r.resync_sent()
    r.live_seen(3)  # the recovery resync's envelope: r2 joined
    r.recovery_answered(FleetStatus(True, 8, 3, 0), [])  # back less than an interval ago
    assert r.mode is Mode.SETTLING and r.live_replicas == 3 and r.share(8) == 2
    r.live_seen(1)  # a server restarted empty: only r0 registered again so far
    r.data_loss("stale_copy")
    r.resync_sent()
    r.recovery_answered(FleetStatus(False, 8, 1, 0, settling=0.8), [])
    assert r.live_replicas == 3 and r.share(8) == 2 and r.degraded_limit(8) == 0
    # The next view (back to ok, the fleet settled) is the count from then on: a replica
    # that left is no longer counted.
    r.resync_sent()
    clock.advance(INTERVAL)
    r.live_seen(2)
    r.recovery_answered(FleetStatus(True, 8, 2, 0), [])
    assert r.mode is Mode.OK and r.live_replicas == 2 and r.share(8) == 4


def test_a_status_answered_while_the_fleet_settles_takes_a_share_away_never_gives_one(
        ) -> None:
    # Found by the long profile (SIM_VARY=1, seed 2014): r0 registered after r1 and r2 last
    # read a reply (no share), and the server restarted empty before their next heartbeat.
    # r0's first call found the loss alone in the new ledger: "none has not heard", and r0
    # took C/3 beside r1 and r2 still dividing by 2: 3 + 4 + 4 of 9.
    late = _started(3, 2, capacity=9)
    assert not late.heard
    late.lost("TimeoutError")
    late.resync_sent()
    late.recovery_answered(FleetStatus(False, 9, 1, 0, settling=0.8, unheard=0), [])
    assert late.mode is Mode.SETTLING and not late.heard and late.share(9) == 0
    # A replica every other one counted keeps its share through the window (they still
    # divide by a count that includes it), but loses it when a status says one has not
    # heard of it.
    known = _started(2, 0, capacity=9)
    known.lost("TimeoutError")
    known.resync_sent()
    known.recovery_answered(FleetStatus(False, 9, 1, 0, settling=0.8, unheard=0), [])
    assert known.heard and known.share(9) == 4
    known.resync_sent()
    known.recovery_answered(FleetStatus(True, 9, 2, 0, settling=0.5, unheard=1), [])
    assert not known.heard and known.share(9) == 0
    # Settled, the ledger's count is the whole fleet's again: it gives the share back.
    for r in (late, known):
        r.resync_sent()
        r.live_seen(3)  # (the reply's envelope, as the driver reports it)
        r.recovery_answered(FleetStatus(True, 9, 3, 0, unheard=0), [])
        assert r.heard and r.share(9) == 3
