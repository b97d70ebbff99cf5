"""The fleet driver's outbox as pure data: the ops it queues, and what one flush sends.

The replica's core (:mod:`sidecar.coordination.replica`) decides which ledger ops to send
(its ``Send`` effect carries one :data:`Op`); the driver
(:class:`~sidecar.coordination.controller.FleetController`) queues them here, in order,
and sends everything queued at once whenever it flushes. What one flush is made of is
decided by :func:`plan`, without I/O, so it is tested on its own (``tests/test_outbox.py``):

* **One pipelined ``multi`` call** (:meth:`~sidecar.coordination.ledger.FleetLedger.batch`)
  with, in this order, every :class:`Release` (in the order queued), one
  ``mark_preemptible`` naming every :class:`MarkPreemptible`, and one ``mark_first_byte``
  per :class:`MarkFirstByte` (a response may be waiting for its own answer:
  ``confirm_first_byte``). The first-byte answers are therefore the last replies of the
  call, one per id, in order (:meth:`Flush.first_byte_answers`). The order of releases
  and marks does not matter to the ledger (a mark of an ended id, or a preemptible mark
  after the first byte, changes nothing); the call keeps it anyway.
* A mark of an id released in the same flush is left out: it would change nothing.
* **One call per** :class:`Adopt` (each answers a status: what the ledger had ended), and
  **one** ``register`` however many :class:`Register` were queued (a reload stores the
  class settings in force when the flush runs; two reloads in one flush store the last).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import assert_never

from sidecar.coordination.ledger import Holding
from sidecar.scheduler import ReleaseReason


@dataclass(frozen=True, slots=True)
class Release:
    """End admission ``id`` in the ledger (exactly once fleet-wide: duplicates change
    nothing there)."""

    id: str
    reason: ReleaseReason


@dataclass(frozen=True, slots=True)
class MarkPreemptible:
    """``id``'s stop channel is open: a preemption candidate fleet-wide from now on."""

    id: str


@dataclass(frozen=True, slots=True)
class MarkFirstByte:
    """``id``'s response started (or is about to): never a victim from now on. Answered
    1 (still admitted) or 0 (the ledger had already preempted it)."""

    id: str


@dataclass(frozen=True, slots=True)
class Adopt:
    """Count a running stream in the ledger again, even one the ledger had ended."""

    holding: Holding


@dataclass(frozen=True, slots=True)
class Register:
    """Store the class settings in force (a hot reload) in the ledger."""


Op = Release | MarkPreemptible | MarkFirstByte | Adopt | Register
"""One ledger op the outbox carries."""

BatchOp = tuple[str, tuple[str, ...]]
"""One operation of a ``multi`` call: its name and arguments (FleetLedger.batch)."""


@dataclass(frozen=True, slots=True)
class Flush:
    """What one flush sends: ``batch`` as one ``multi`` call (none if empty), one
    ``adopt`` call per holding in ``adopt``, and one ``register`` if ``register``.
    ``first_byte``: the ids whose ``mark_first_byte`` answers end the batch's replies."""

    batch: tuple[BatchOp, ...] = ()
    first_byte: tuple[str, ...] = ()
    adopt: tuple[Holding, ...] = ()
    register: bool = False

    @property
    def empty(self) -> bool:
        """Nothing to send (every op queued was a mark of an id released with it)."""
        return not self.batch and not self.adopt and not self.register

    def first_byte_answers(self, replies: Sequence[object]) -> list[object]:
        """The first-byte marks' answers out of the batch's replies, in ``first_byte``
        order."""
        if len(replies) != len(self.batch):
            raise ValueError(f"{len(replies)} replies to a batch of {len(self.batch)}")
        return list(replies[len(replies) - len(self.first_byte):]) if self.first_byte else []


def plan(ops: Iterable[Op]) -> Flush:
    """One flush of ``ops`` (queued in this order): see the module docstring."""
    ops = list(ops)
    released = {op.id for op in ops if isinstance(op, Release)}
    releases: list[BatchOp] = []
    preemptible: list[str] = []
    first_byte: list[str] = []
    adopt: list[Holding] = []
    register = False
    for op in ops:
        match op:
            case Release(aid, reason):
                releases.append(("release", (aid, str(reason))))
            case MarkPreemptible(aid):
                if aid not in released:
                    preemptible.append(aid)
            case MarkFirstByte(aid):
                if aid not in released:
                    first_byte.append(aid)
            case Adopt(holding):
                adopt.append(holding)
            case Register():
                register = True
            case _:
                assert_never(op)
    batch = releases
    if preemptible:
        batch.append(("mark_preemptible", tuple(preemptible)))
    batch += [("mark_first_byte", (aid,)) for aid in first_byte]
    return Flush(tuple(batch), tuple(first_byte), tuple(adopt), register)


class Outbox:
    """The ops queued since the last flush, in order."""

    __slots__ = ("_ops",)

    def __init__(self) -> None:
        self._ops: deque[Op] = deque()

    def push(self, op: Op) -> None:
        self._ops.append(op)

    def take(self) -> Flush:
        """Everything queued, as one flush; the outbox is empty afterwards."""
        ops, self._ops = self._ops, deque()
        return plan(ops)

    def clear(self) -> bool:
        """Drop what is queued (the replica left the ledger: its return's resync covers
        what the ledger missed, except the class settings). True if a :class:`Register`
        was among them: the driver registers again on the return."""
        dropped = any(isinstance(op, Register) for op in self._ops)
        self._ops.clear()
        return dropped

    def __len__(self) -> int:
        return len(self._ops)

    def __bool__(self) -> bool:
        return bool(self._ops)
