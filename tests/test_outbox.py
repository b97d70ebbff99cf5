"""The fleet driver's outbox (sidecar.coordination.outbox): what one flush sends, as pure
data: which ops go in the one ``multi`` call and in what order, what is left out, what goes
alone, and where the first-byte answers are among the replies."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sidecar.classes import PriorityClass
from sidecar.coordination.ledger import Holding
from sidecar.coordination.outbox import (
    Adopt,
    Flush,
    MarkFirstByte,
    MarkPreemptible,
    Op,
    Outbox,
    Register,
    Release,
    plan,
)
from sidecar.scheduler import ReleaseReason

DONE, GONE = ReleaseReason.COMPLETED, ReleaseReason.CANCELLED
H = Holding("s", PriorityClass.BULK, "t", first_byte=True)


def test_releases_then_one_candidate_mark_then_one_first_byte_mark_each() -> None:
    flush = plan([MarkFirstByte("f1"), Release("a", DONE), MarkPreemptible("p1"),
                  Release("b", GONE), MarkPreemptible("p2"), MarkFirstByte("f2")])
    assert flush.batch == (("release", ("a", "completed")), ("release", ("b", "cancelled")),
                           ("mark_preemptible", ("p1", "p2")),
                           ("mark_first_byte", ("f1",)), ("mark_first_byte", ("f2",)))
    assert flush.first_byte == ("f1", "f2")
    assert (flush.adopt, flush.register, flush.empty) == ((), False, False)


def test_a_mark_of_an_id_released_in_the_same_flush_is_left_out() -> None:
    flush = plan([MarkPreemptible("x"), MarkFirstByte("x"), Release("x", DONE),
                  MarkFirstByte("y")])
    assert flush.batch == (("release", ("x", "completed")), ("mark_first_byte", ("y",)))
    assert flush.first_byte == ("y",)
    # Only marks of released ids: nothing to send at all.
    assert plan([]).empty
    assert plan([MarkFirstByte("x"), MarkPreemptible("x")]).batch == (
        ("mark_preemptible", ("x",)), ("mark_first_byte", ("x",)))


def test_adoptions_go_alone_and_registrations_are_one() -> None:
    flush = plan([Register(), Adopt(H), Release("a", DONE), Register(),
                  Adopt(Holding("t", PriorityClass.DEFAULT, "u"))])
    assert flush.adopt == (H, Holding("t", PriorityClass.DEFAULT, "u"))
    assert flush.register
    assert flush.batch == (("release", ("a", "completed")),)
    only = plan([Register()])
    assert only.register and not only.batch and not only.empty


def test_the_first_byte_answers_are_the_batchs_last_replies() -> None:
    flush = plan([Release("a", DONE), MarkPreemptible("p"), MarkFirstByte("f1"),
                  MarkFirstByte("f2")])
    assert flush.first_byte_answers(["released", 1, 1, 0]) == [1, 0]
    assert plan([Release("a", DONE)]).first_byte_answers(["released"]) == []
    with pytest.raises(ValueError, match="3 replies to a batch of 4"):
        flush.first_byte_answers(["released", 1, 1])


def test_the_outbox_takes_everything_queued_in_order_and_empties() -> None:
    box = Outbox()
    assert not box and len(box) == 0
    box.push(Release("a", DONE))
    box.push(MarkFirstByte("b"))
    assert box and len(box) == 2
    assert box.take() == Flush((("release", ("a", "completed")),
                                ("mark_first_byte", ("b",))), ("b",))
    assert not box
    box.push(Register())
    box.push(Release("a", DONE))
    assert box.clear()  # a reload's registration was dropped: the driver sends it again
    assert not box and box.take().empty
    box.push(Release("a", DONE))
    assert not box.clear()  # nothing of the class settings lost


ids = st.sampled_from(["a", "b", "c", "d"])
ops: st.SearchStrategy[Op] = st.one_of(
    st.builds(Release, ids, st.sampled_from(list(ReleaseReason))),
    st.builds(MarkPreemptible, ids), st.builds(MarkFirstByte, ids),
    st.builds(lambda i: Adopt(Holding(i, PriorityClass.BULK, "t")), ids),
    st.just(Register()))


@given(st.lists(ops, max_size=20))
def test_every_op_is_sent_once_in_its_place_or_left_out_for_a_reason(queued: list[Op]) -> None:
    flush = plan(queued)
    released = [op.id for op in queued if isinstance(op, Release)]
    # Every release, in order, first in the batch.
    assert [a[0] for n, a in flush.batch if n == "release"] == released
    assert flush.batch[:len(released)] == tuple(
        ("release", (op.id, str(op.reason))) for op in queued if isinstance(op, Release))
    # Every mark of an id not released with it, in order; none of one that was.
    pre = [op.id for op in queued if isinstance(op, MarkPreemptible) and op.id not in released]
    marks = [a for n, a in flush.batch if n == "mark_preemptible"]
    assert marks == ([tuple(pre)] if pre else [])
    fb = [op.id for op in queued if isinstance(op, MarkFirstByte) and op.id not in released]
    assert flush.first_byte == tuple(fb)
    assert flush.batch[len(flush.batch) - len(fb):] == tuple(
        ("mark_first_byte", (i,)) for i in fb) or not fb
    assert len(flush.batch) == len(released) + (1 if pre else 0) + len(fb)
    assert flush.adopt == tuple(op.holding for op in queued if isinstance(op, Adopt))
    assert flush.register == any(isinstance(op, Register) for op in queued)
