"""The life of one admission, written down once: its states, its records, its events.

Every request the sidecar sees is in exactly one of these states. The core
(:class:`~sidecar.scheduler.Scheduler`, :class:`~sidecar.scheduler.LegacyAdmission`)
moves it; each move is reported as an event (in brackets), or is the return
value of the call that made it. The asyncio adapter (``sidecar.admission``)
makes the calls named on the right.

=============  =====  ======  ===================================================================
state          slot?  victim  leaves by: call (what triggers it in the sidecar) → next state
=============  =====  ======  ===================================================================
*(new)*        no     no      ``arrive`` (ext_authz Check) → ADMITTED [Admitted] when a slot is
                              free or a victim was preempted for it; → QUEUED (the ``Queued``
                              decision) when its class queue has room (and its tenant is
                              under ``max_queued_per_tenant``); else →
                              rejected_queue_full [Rejected]. Given a wait budget, one that
                              would queue and whose predicted wait exceeds it is counted
                              [OverTarget] and, when enforced, → rejected_over_target
                              [Rejected] instead of QUEUED.
                              ``adopt`` (an access-log entry for a stream an earlier process
                              admitted) → STREAMING [Admitted, ``adopted``].
QUEUED         no     no      dispatch (inside ``release``, ``tick``, ``set_capacity``,
                              ``set_kv_capacity``, ``update_config``, ``mark_preemptible``,
                              ``arrive``, ``cancel``) → ADMITTED [Admitted, ``queued``]
                              (given a KV capacity, only once its tokens fit too);
                              its deadline passes → rejected_queue_timeout [Rejected];
                              ``cancel`` (the client left) → client_cancelled [Rejected].
ADMITTED       yes    no      ``mark_preemptible`` (its ext_proc stream opened: a channel to
                              stop it exists) → PREEMPTIBLE;
                              ``mark_first_byte`` (stream closed first) → STREAMING;
                              ``release`` → a released state [Released].
PREEMPTIBLE    yes    yes     ``mark_first_byte`` (response headers, or the stream closed) →
                              STREAMING; a higher class that may preempt arrives or heads its
                              queue with no free slot → preempted [Preempted, Released];
                              ``release`` → a released state [Released].
STREAMING      yes    no      ``release`` → a released state [Released].
released:      no     no      ``preempted`` (above), ``completed`` (the final access-log
                              entry, whatever ended the request), ``cancelled`` (the
                              client left in the instant it was admitted), ``lease_expired``
                              (no access-log entry within the lease, see :mod:`.leases`,
                              or the Envoy that asked died: :mod:`sidecar.liveness`).
                              Only lease_expired has a way back: ``adopt`` → STREAMING, for a
                              stream that kept running while its heartbeats were lost. Every
                              other end is final.
=============  =====  ======  ===================================================================

With ``Scheduler(preemptible_on_admit=True)`` (not the sidecar's mode) an
admission enters PREEMPTIBLE directly instead of ADMITTED.

The adapter's calls, by the arrow they drive: ``AdmissionController.admit`` →
``arrive`` (and ``cancel``, or ``release(cancelled)``, when the Check is
cancelled); ``open_stop_channel`` → ``mark_preemptible``; ``mark_first_byte``
and ``close_stop_channel`` → ``mark_first_byte``; ``release`` → ``release``;
``renew_or_adopt`` → a lease renewal, or ``adopt``; ``tick`` → the core's
``tick`` and ``release(lease_expired)`` for every lease due.

:data:`TRANSITIONS` is this table as data; the property tests check every
move the core makes against it. A slot is held exactly in ADMITTED,
PREEMPTIBLE and STREAMING, and every admission leaves them by exactly one
:class:`Released` event.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass

from sidecar.classes import PriorityClass


class State(enum.Enum):
    """Where one request is in its life (see the module table)."""

    NEW = "new"  # not seen yet: the core keeps no record of it
    QUEUED = "queued"
    ADMITTED = "admitted"
    PREEMPTIBLE = "preemptible"
    STREAMING = "streaming"
    REJECTED_QUEUE_FULL = "rejected_queue_full"
    REJECTED_OVER_TARGET = "rejected_over_target"
    REJECTED_QUEUE_TIMEOUT = "rejected_queue_timeout"
    CLIENT_CANCELLED = "client_cancelled"
    COMPLETED = "completed"
    CANCELLED = "cancelled"
    PREEMPTED = "preempted"
    LEASE_EXPIRED = "lease_expired"


HOLDS_A_SLOT = frozenset({State.ADMITTED, State.PREEMPTIBLE, State.STREAMING})
_RELEASED = frozenset({State.COMPLETED, State.CANCELLED, State.LEASE_EXPIRED})

TRANSITIONS: Mapping[State, frozenset[State]] = {
    State.NEW: frozenset({State.ADMITTED, State.PREEMPTIBLE, State.QUEUED,
                          State.REJECTED_QUEUE_FULL, State.REJECTED_OVER_TARGET,
                          State.STREAMING}),
    State.QUEUED: frozenset({State.ADMITTED, State.PREEMPTIBLE, State.REJECTED_QUEUE_TIMEOUT,
                             State.CLIENT_CANCELLED}),
    State.ADMITTED: frozenset({State.PREEMPTIBLE, State.STREAMING, *_RELEASED}),
    State.PREEMPTIBLE: frozenset({State.STREAMING, State.PREEMPTED, *_RELEASED}),
    State.STREAMING: _RELEASED,
    State.LEASE_EXPIRED: frozenset({State.STREAMING}),
    State.REJECTED_QUEUE_FULL: frozenset(),
    State.REJECTED_OVER_TARGET: frozenset(),
    State.REJECTED_QUEUE_TIMEOUT: frozenset(),
    State.CLIENT_CANCELLED: frozenset(),
    State.COMPLETED: frozenset(),
    State.CANCELLED: frozenset(),
    State.PREEMPTED: frozenset(),
}
"""Allowed moves: ``new in TRANSITIONS[old]``."""


class Outcome(enum.StrEnum):
    """How a decision ended: the ``outcome`` label of ``smg_scheduler_admit_total``."""

    ADMITTED = "admitted"
    REJECTED_QUEUE_FULL = "rejected_queue_full"
    REJECTED_QUEUE_TIMEOUT = "rejected_queue_timeout"
    PREEMPTED = "preempted"
    CLIENT_CANCELLED = "client_cancelled"
    # An extension, only with deadline_mode: enforce (docs/design.md, "Deadlines"): the
    # request would have queued past its class's time-to-first-token target.
    REJECTED_OVER_TARGET = "rejected_over_target"


class ReleaseReason(enum.StrEnum):
    """Why a slot was given back: the ``reason`` label of the released counter."""

    COMPLETED = "completed"
    CANCELLED = "cancelled"
    PREEMPTED = "preempted"
    LEASE_EXPIRED = "lease_expired"


LEASE_EXPIRED = ReleaseReason.LEASE_EXPIRED


class ReleaseResult(enum.StrEnum):
    """What a ``release`` call found."""

    RELEASED = "released"
    UNKNOWN = "unknown"
    ALREADY_RELEASED = "already_released"


@dataclass(slots=True, eq=False)
class Admission:
    """A request holding one slot (ADMITTED, PREEMPTIBLE or STREAMING)."""

    id: str
    cls: PriorityClass
    tenant: str
    admitted_at: float
    state: State = State.ADMITTED
    tokens: int = 0  # what it holds of the KV capacity (``admit_by_kv``): its estimate

    @property
    def first_byte(self) -> bool:
        """Past the point of preemption: its response started (or its stop channel closed)."""
        return self.state is State.STREAMING


@dataclass(slots=True, eq=False)
class Waiter:
    """A QUEUED request."""

    id: str
    cls: PriorityClass
    tenant: str
    enqueued_at: float
    deadline: float
    predicted: float | None = None  # its predicted wait when it queued (None: no estimate)
    ahead: int = 0  # waiters of its class in front of it when it queued
    cost: float = 1.0  # what serving it costs its tenant's turn: 1, or its tokens


# ----------------------------------------------------------------------------- events


@dataclass(frozen=True, slots=True)
class Admitted:
    """new/QUEUED (or lease_expired, when adopted) → a state that holds a slot."""

    admission: Admission
    waited: float
    queued: bool
    starvation: bool = False
    preempted: bool = False  # admitted by preempting a lower-class request
    adopted: bool = False  # admitted by an earlier process, found still streaming
    predicted: float | None = None  # the wait predicted when it queued (None: no estimate)


@dataclass(frozen=True, slots=True)
class Queued:
    """new → QUEUED (a decision only: returned by ``arrive``, never an event)."""

    waiter: Waiter


@dataclass(frozen=True, slots=True)
class Rejected:
    """new/QUEUED → rejected_queue_full, rejected_queue_timeout or client_cancelled."""

    id: str
    cls: PriorityClass
    tenant: str
    outcome: Outcome
    waited: float
    legacy: bool = False
    # The wait predicted for it (a timeout: when it queued; refused at intake: had it
    # queued at the tail; None: no estimate). Computed Retry-After hints come from it.
    predicted: float | None = None


@dataclass(frozen=True, slots=True)
class OverTarget:
    """An arrival whose predicted wait exceeds its wait budget (its class's target less the
    pool's time to first byte): refused (``enforced``) or only counted (shadow)."""

    id: str
    cls: PriorityClass
    tenant: str
    predicted: float
    budget: float
    enforced: bool


@dataclass(frozen=True, slots=True)
class Preempted:
    """PREEMPTIBLE → preempted; always followed by its :class:`Released`."""

    victim: Admission
    by_class: PriorityClass


@dataclass(frozen=True, slots=True)
class Released:
    """A slot given back: the one way out of ADMITTED, PREEMPTIBLE and STREAMING."""

    admission: Admission
    reason: ReleaseReason


Event = Admitted | Rejected | Preempted | Released | OverTarget
Decision = Admitted | Queued | Rejected


class EndedIds:
    """Bounded memory of ended admission ids and why they ended.

    Tells a duplicate completion from a stranger, and lets a stream whose lease
    was reclaimed (heartbeats lost, but it kept running) be adopted again: the
    one way back in the table.

    Bounded in count and in id characters (``max_chars``; the sidecar's own ids
    are 32): oldest forgotten first. Ids reach here only from this process's
    admissions and adoptions, and the codec refuses long ones, so in practice the
    count binds; the character budget keeps the bound one on bytes whatever the
    ids look like.
    """

    def __init__(self, maxlen: int = 100_000, max_chars: int = 4 * 1024 * 1024) -> None:
        self._ids: OrderedDict[str, ReleaseReason] = OrderedDict()
        self._maxlen = maxlen
        self._max_chars = max_chars
        self._chars = 0

    def add(self, id: str, reason: ReleaseReason) -> None:
        if id not in self._ids:
            self._chars += len(id)
        self._ids[id] = reason
        self._ids.move_to_end(id)  # re-ended (after a re-adoption): newest again
        while len(self._ids) > self._maxlen or (self._chars > self._max_chars
                                                 and len(self._ids) > 1):
            old, _ = self._ids.popitem(last=False)
            self._chars -= len(old)

    def __len__(self) -> int:
        return len(self._ids)

    @property
    def chars(self) -> int:
        """Characters of the ids remembered now."""
        return self._chars

    def __contains__(self, id: object) -> bool:
        return id in self._ids

    def adoptable(self, id: str) -> bool:
        """Never seen, or ended only because its lease expired."""
        return self._ids.get(id, LEASE_EXPIRED) == LEASE_EXPIRED
