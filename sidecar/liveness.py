"""Which Envoy runs each admission, and whether that Envoy is still there (issue 12).

A slot held by a request Envoy still runs must never be reclaimed by a timer alone.
Envoy sends no heartbeat, but it keeps its gRPC access-log (ALS) stream open while idle
(measured, envoy/NOTES.md): opened lazily at a worker thread's first entry, closed only
when the connection or the process goes. So:

* **Owner.** Each admission records the Envoy that asked: the peer host (IP, no port) of
  its Check call. Envoy reaches the sidecar over several connections (per worker thread,
  and per cluster where ext_authz, ext_proc and the ALS use different ones), so the port
  names a connection, not an Envoy; the host is what all of
  one Envoy's connections share, and what meshes give without any configuration (a
  sidecar per pod sees loopback, a shared authz service sees each Envoy's pod IP). Two
  Envoys behind one IP count as one owner (see :class:`OwnerTable`).
* **Alive.** An owner is *watched* once one of its ALS streams opened, and *alive* while at
  least one is open. When its last stream closes it is *lost*; still lost ``grace`` seconds
  later it is *dead*: every admission it asked for before it was lost is released. Envoy
  killed (even SIGKILL) closes its sockets, so that is prompt; a host that vanished
  without a FIN is bounded by the gRPC server keepalive (``sidecar.authz``).
* **Acknowledged.** An admission Envoy showed it runs (its ext_proc stream opened, a
  periodic entry named it) while its owner is alive needs no per-request timer: it ends
  by its final access-log entry, a preemption, or its owner's death. The lease keeps only
  "Check answered, no sign from Envoy yet" and an owner never watched (no ALS stream
  ever: today's behaviour).
* **A gap.** An owner that comes back within the grace (its last stream closed, then one
  opened again) may be a new Envoy process behind the same IP, or the same one after a
  connection blip: the admissions acknowledged before the gap go back under the lease
  (periodic entries, if any, keep them), so a restart does not leak them. Envoy reopens a
  closed ALS stream only at its next entry, so a blip followed by no request ending
  within the grace reads as a death (docs/reference.md, "Leases and Envoy liveness").

:class:`OwnerTable` is the pure part (the caller passes the time in and applies what
its methods return); :class:`EnvoyLiveness` wires it to the admission service, the
gRPC hooks and a timer.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING
from urllib.parse import unquote

from sidecar import logs
from sidecar.metrics import NullRecorder, Recorder
from sidecar.scheduler import LEASE_EXPIRED, ReleaseResult

if TYPE_CHECKING:
    from sidecar.admission import AdmissionService

log = logs.get("sidecar.liveness")

UNIX_OWNER = "unix"
# The table forgets ended admissions it was not told about (a preemption, a lease
# expiry) once it holds this many more than are in flight.
PRUNE_SLACK = 1024


def owner_of(peer: str) -> str:
    """The owner key of a gRPC peer string: its host, without the port.

    ``ipv4:10.0.0.7:41234`` → ``10.0.0.7``; ``ipv6:[::1]:41234`` (or ``%5B::1%5D``) → ``::1``;
    any ``unix:`` peer → ``unix`` (one host: the sidecar's socket is only reachable locally).
    """
    scheme, _, rest = peer.partition(":")
    if scheme == "unix" or scheme == "unix-abstract":
        return UNIX_OWNER
    if scheme not in ("ipv4", "ipv6"):
        return peer
    host = unquote(rest).rpartition(":")[0] or unquote(rest)
    return host.strip("[]")


@dataclass(slots=True)
class _Tracked:
    owner: str
    admitted_at: float
    acked_at: float | None = None  # last time Envoy showed it runs it
    unleased: bool = False  # acknowledged while its owner was alive: no lease


@dataclass(slots=True)
class _Owner:
    streams: int = 0
    watched: bool = False
    lost_at: float | None = None  # last stream closed at; None while alive or never watched
    ids: dict[str, None] = field(default_factory=dict)  # insertion-ordered set


@dataclass(frozen=True, slots=True)
class Reopened:
    """What an owner's stream opening asks of the caller."""

    unlease: list[str]
    """Acknowledged while the owner was not alive: the owner is alive now, drop their lease."""
    relapse: list[str]
    """Acknowledged before a gap: back under the lease (a new process may have replaced it)."""


class OwnerTable:
    """Owners (by peer host) with their open ALS streams and the admissions they asked for."""

    def __init__(self, grace: float) -> None:
        self.grace = grace
        self._owners: dict[str, _Owner] = {}
        self._ids: dict[str, _Tracked] = {}

    # ------------------------------------------------------------------ admissions

    def admitted(self, aid: str, owner: str, now: float) -> None:
        """Check admitted ``aid`` for ``owner``."""
        self._ids[aid] = _Tracked(owner, now)
        self._owners.setdefault(owner, _Owner()).ids[aid] = None

    def acknowledge(self, aid: str, now: float) -> bool:
        """Envoy showed it runs ``aid``. True: its owner is alive, so it needs no lease
        (an owner not alive yet unleases it when its first stream opens)."""
        t = self._ids.get(aid)
        if t is None:
            return False
        t.acked_at = now
        if self._owners[t.owner].streams == 0:
            return False  # never watched, or lost: the lease stays until it is alive
        t.unleased = True
        return True

    def ended(self, aid: str) -> None:
        t = self._ids.pop(aid, None)
        if t is not None:
            o = self._owners.get(t.owner)
            if o is not None:
                o.ids.pop(aid, None)
                # Nothing left to know about it (no admissions, no stream, no grace
                # running): forgotten, so churning peers cannot grow the table.
                if not o.ids and o.streams == 0 and o.lost_at is None:
                    del self._owners[t.owner]

    def prune(self, holds: Callable[[str], bool]) -> int:
        """Forget every admission ``holds`` says has ended; returns how many."""
        gone = [aid for aid in self._ids if not holds(aid)]
        for aid in gone:
            self.ended(aid)
        # Owners with nothing left to track (pods that came and went): forgotten.
        for key in [k for k, o in self._owners.items()
                    if not o.ids and o.streams == 0 and o.lost_at is None]:
            del self._owners[key]
        return len(gone)

    def owner(self, aid: str) -> str | None:
        t = self._ids.get(aid)
        return None if t is None else t.owner

    def unleased(self, aid: str) -> bool:
        t = self._ids.get(aid)
        return t is not None and t.unleased

    # ------------------------------------------------------------------ streams

    def stream_opened(self, owner: str, now: float) -> Reopened:
        o = self._owners.setdefault(owner, _Owner())
        o.streams += 1
        if o.streams > 1:
            return Reopened([], [])
        lost_at, o.lost_at = o.lost_at, None
        o.watched = True
        unlease: list[str] = []
        relapse: list[str] = []
        for aid in o.ids:
            t = self._ids[aid]
            if t.acked_at is None:
                continue
            if lost_at is not None and t.acked_at <= lost_at:
                t.acked_at = None  # only a new sign from Envoy unleases it again
                if t.unleased:
                    t.unleased = False
                    relapse.append(aid)
            elif not t.unleased:  # acknowledged while not alive: alive now
                t.unleased = True
                unlease.append(aid)
        return Reopened(unlease, relapse)

    def stream_closed(self, owner: str, now: float) -> None:
        o = self._owners.get(owner)
        if o is None or o.streams == 0:
            return
        o.streams -= 1
        if o.streams == 0:
            o.lost_at = now

    def alive(self, owner: str) -> bool:
        o = self._owners.get(owner)
        return o is not None and o.streams > 0

    def watched(self, owner: str) -> bool:
        o = self._owners.get(owner)
        return o is not None and o.watched

    @property
    def open_streams(self) -> int:
        return sum(o.streams for o in self._owners.values())

    @property
    def alive_owners(self) -> int:
        return sum(1 for o in self._owners.values() if o.streams > 0)

    def __len__(self) -> int:
        return len(self._ids)

    # ------------------------------------------------------------------ death

    @staticmethod
    def _is_before(t: _Tracked, lost_at: float) -> bool:
        """Asked for before its owner was lost, and no sign from Envoy since."""
        return t.admitted_at <= lost_at and (t.acked_at is None or t.acked_at <= lost_at)

    def next_deadline(self) -> float | None:
        due = [o.lost_at + self.grace for o in self._owners.values() if o.lost_at is not None]
        return min(due) if due else None

    def pop_dead(self, now: float) -> list[tuple[str, list[str]]]:
        """Owners lost for ``grace`` or longer, with the admissions they asked for before.

        Those admissions are forgotten here; the caller releases them. Admissions that
        arrived while the owner was lost (a new process behind the same host, not yet
        watched) stay, under their lease.
        """
        dead: list[tuple[str, list[str]]] = []
        for key, o in list(self._owners.items()):
            if o.lost_at is None or o.lost_at + self.grace > now:
                continue
            lost_at = o.lost_at
            ids = [aid for aid in o.ids if self._is_before(self._ids[aid], lost_at)]
            for aid in ids:
                self.ended(aid)
            o.lost_at = None
            o.watched = False
            if not o.ids:
                del self._owners[key]
            dead.append((key, ids))
        return dead


class EnvoyLiveness:
    """The table wired to an admission service: unleases, relapses and releases.

    Hooks: ``admitted`` (Check, with its peer), ``acknowledged`` (ext_proc stream opened,
    periodic entry), ``ended`` (final entry), ``stream_opened``/``stream_closed`` (each
    ALS stream). A timer releases a dead owner's admissions as ``lease_expired``: the
    lease's one job is a slot with no owner left.
    """

    def __init__(self, controller: AdmissionService, *, grace: float,
                 metrics: Recorder | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.controller = controller
        self.table = OwnerTable(grace)
        self._metrics: Recorder = metrics if metrics is not None else NullRecorder()
        self._clock = clock
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: float | None = None
        self._closed = False

    def admitted(self, aid: str, peer: str) -> None:
        self.table.admitted(aid, owner_of(peer), self._clock())
        if len(self.table) > 2 * self.controller.lease_count + PRUNE_SLACK:
            self.table.prune(self.controller.holds)

    def acknowledged(self, aid: str, peer: str | None = None) -> None:
        """Envoy runs ``aid``. ``peer``: the stream that said so, owner of an ``aid`` no
        Check here asked for (adopted after a sidecar restart)."""
        if peer is not None and self.table.owner(aid) is None:
            if not self.controller.holds(aid):
                return
            self.table.admitted(aid, owner_of(peer), self._clock())
        if self.table.acknowledge(aid, self._clock()):
            self.controller.hold_without_lease(aid)

    def ended(self, aid: str) -> None:
        self.table.ended(aid)

    def stream_opened(self, peer: str) -> str:
        """An ALS stream opened; returns its owner key (pass it to :meth:`stream_closed`)."""
        owner = owner_of(peer)
        first = not self.table.watched(owner)
        r = self.table.stream_opened(owner, self._clock())
        for aid in r.unlease:
            self.controller.hold_without_lease(aid)
        for aid in r.relapse:
            self.controller.lease_again(aid)
        if first or r.relapse:
            log.info("envoy_owner_watched", owner=owner, unleased=len(r.unlease),
                     back_under_lease=len(r.relapse))
        self._report()
        return owner

    def stream_closed(self, owner: str) -> None:
        self.table.stream_closed(owner, self._clock())
        if not self.table.alive(owner):
            log.info("envoy_owner_streams_closed", owner=owner, grace_secs=self.table.grace)
        self._report()
        self._arm()

    def close(self) -> None:
        """Stopping: streams closed from now on release nothing."""
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _report(self) -> None:
        self._metrics.envoy_streams(self.table.open_streams, self.table.alive_owners)

    def _arm(self) -> None:
        due = self.table.next_deadline()
        if self._closed or due is None or (self._timer_at is not None and self._timer_at <= due):
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = due
        self._timer = asyncio.get_running_loop().call_later(
            max(0.0, due - self._clock()), self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._timer_at = None
        self.sweep()
        self._arm()

    def sweep(self) -> int:
        """Release the admissions of every owner dead by now; returns how many."""
        total = 0
        for owner, ids in self.table.pop_dead(self._clock()):
            released = 0
            for aid in ids:
                if (self.controller.holds(aid)
                        and self.controller.release(aid, LEASE_EXPIRED)
                        is ReleaseResult.RELEASED):
                    released += 1
            # A clean Envoy exit leaves nothing to release: not worth a warning.
            (log.warning if released else log.info)(
                "envoy_owner_lost", owner=owner, released=released,
                grace_secs=self.table.grace)
            self._metrics.owner_lost(released)
            total += released
        return total
