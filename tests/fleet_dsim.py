"""A deterministic simulation of a fleet under faults: the shipped controller, one seed, one
trace.

N real :class:`~sidecar.coordination.controller.FleetController` processes run in ONE
asyncio event loop whose clock is virtual (:class:`SimLoop`: its selector's ``select``
moves the clock to the next timer instead of sleeping). Every timer of the driver
(heartbeats, ticks, deferred marks, call timeouts, waiters' deadlines, the local
scheduler's) and every event of the simulation (arrivals, Envoy's entries, faults, the
server's answers) is a loop callback at a virtual instant: nothing runs on its own, and
the run is the same on every machine. The controllers are the production code, built by
:meth:`FleetController.open` over a real :class:`~sidecar.coordination.ledger.FleetLedger`,
pipelined as :meth:`FleetController.connect` builds it: its own ``_Pipelined`` connection
manager (one connection, calls answered in order, a stalled connection dropped by the
next call, reconnects under a connect timeout) runs over a simulated connection
(:class:`SimConn`); only the socket is simulated (:class:`SimClient`, :class:`SimEvents`):

* Each ``FCALL`` written on a connection runs on a real ``valkey-server`` (the test build
  of the library, ``now`` = the virtual clock) when :class:`DSim` chooses, one
  connection's commands in order, the processes' interleaved as drawn; replies come back
  in order, slow, or not at all (a lost reply stalls its connection, as on TCP, until
  ``_Pipelined`` drops it); the driver's call timeout may give up first; what a closed
  connection sent may still run later, its reply lost.
* The notification reader's blocking pop (``BLMPOP``) is answered when a call left
  notifications, after its block time on the server, or fails on the client's socket
  timeout while the server does not answer.
* Faults are server operations between steps: pause (calls and reads held), kill,
  restart empty, restart from an older snapshot, failover to a lagging copy, one key
  lost, replica kill, replica restart with the same id, partition of one replica, slow
  replies and reset connections of one replica, and a pod that comes back after its
  registration lapsed followed within a heartbeat interval by a server hang. Each draw
  takes the kind drawn least so far (ties by the RNG), so a short run sees all. A single
  call's reply may also be slow or lost; one that times out while the server is up is,
  for its replica, a partition of one call (a ``cut_off`` window, the partition bound).
* Envoy and the clients are the harness: each Check is a task awaiting the controller's
  ``admit`` (cancelled when its client leaves), streams end with ``release`` (sometimes
  twice, sometimes late), open their stop channel, reach their first byte through
  ``confirm_first_byte``/``mark_first_byte``, and Envoy's periodic entries call
  ``renew_or_adopt``.

Ground truth is the harness's own record (which admissions the clients were told they
hold and have not ended, which requests wait, which were refused, which ids Envoy showed
which process), never the controller's.

*Safety* (never more than), after every step (one iteration of the loop): Σ running ≤
capacity outside the reference's windows and within each window's bound
(:class:`Window`); the replicas' degraded shares sum to at most capacity; exactly-once
release; no waiter answered later than its queue timeout plus one call timeout. At the
end, after a quiet drain: admitted = released, the ledger holds nothing.

*Liveness* (admits what it may, within a bounded time), at the end of every instant (after
its last step: time does not pass within an instant, so a condition that outlasts a bound
is seen there as surely as after every step; each bound in ``docs/reference.md``, failure
modes, ``docs/design.md``, and :class:`Bounds`):

* **refused only at the limit**: a 429 from a replica in a local mode (degraded,
  resyncing, settling) comes only while what it counts is at its documented limit L
  (:func:`documented_limit`), including while a recovery resync hangs; a 429 from a replica
  that is ``ok`` comes only as the ledger's own answer;
* **no idle capacity while a request waits**, locally: a replica in a local mode below L
  admits a request waiting on it at once (one that came before it went local: within one
  call timeout, its arrive's), and at L a request that may preempt takes a lower-class
  candidate's slot (the scheduler's rule: the head of its queue, an admission made before
  it came); fleet-wide: with every replica ``ok`` and no window open, no slot idles longer
  than one call timeout plus a few hops while a request waits, outside the documented
  times a slot stays counted after its stream ended (a dead replica's until its
  registration lapses, one Envoy never showed its process until the ack timeout, one taken
  by a call whose answer was lost until its owner's next heartbeat drops it);
* **back to the ledger**: a replica that can reach the server again is ``ok`` within
  2 × ttl (the reference's bound) of the later of losing it and reaching it again;
* **nothing held that does not run** (a leak, outside the ack-timeout case above) and
  **nothing running uncounted** (a stream its process does not hold, outside a
  preemption the controller reported it could not deliver and a process that has not had
  Envoy's periodic entry since it started).

Determinism: every choice comes from one ``random.Random(seed)``, ids and incarnations
are counters, the loop runs callbacks in (time, order scheduled) order, and the trace
(every event, call, reply, answer, metric and log line) is hashed: the same seed gives the
same SHA-256 digest, also in another interpreter with another ``PYTHONHASHSEED``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import os
import random
import selectors
import shutil
import time
from collections import Counter, deque
from collections.abc import Callable, Coroutine, Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, Any

import redis
import structlog
from redis.exceptions import ResponseError

from devtools.valkey import ValkeyServer
from sidecar import logs
from sidecar.admission import Denied
from sidecar.classes import PriorityClass
from sidecar.coordination.controller import FleetController, call_timeout_for
from sidecar.coordination.ledger import TEST_LUA, FleetLedger, FleetStatus, degraded_limit
from sidecar.coordination.replica import LOCAL, Mode
from sidecar.metrics import NullPoolRecorder
from sidecar.scheduler import (
    Admitted,
    ClassSettings,
    Outcome,
    Preempted,
    Released,
    ReleaseResult,
)
from sidecar.tokens import Budget
from sidecar.tokens import Window as TokenWindow

FLEET = "sim"
PREFIX = f"pg:{{{FLEET}}}"
SYS, INT, DEF, BULK = (PriorityClass.SYSTEM, PriorityClass.INTERACTIVE,
                       PriorityClass.DEFAULT, PriorityClass.BULK)
TENANTS = ("t0", "t1", "t2")

SERVER_FAULTS = ("pause", "kill", "restart_empty", "rdb_restart", "stale_restore",
                 "failover", "lose_key")
REPLICA_FAULTS = ("replica_kill", "replica_restart", "partition", "slow_replies",
                  "drop_connections")
# A replica's pod dies, stays away until its registration lapsed (the others count one
# fewer), comes back, and the server hangs within a heartbeat interval of its first
# answer: the fleet's views disagree on N, the moment the share rule is for.
COMBINED_FAULTS = ("join_then_pause",)
DSIM_FAULTS = SERVER_FAULTS + REPLICA_FAULTS + COMBINED_FAULTS
# Token budgets (DSimConfig.tokens): the faults that keep the ledger's data, so that its
# token keys can be held to exact conservation (the data-loss faults reset budgets, which
# the reference documents; the admissions' ledger has its own repair, the budgets none).
TOKEN_FAULTS = ("pause", *REPLICA_FAULTS, *COMBINED_FAULTS)
TOKEN_WINDOW = TokenWindow("day", 86400)  # a run's virtual time stays in its first day

# Violations found and not yet fixed, each with a strict-xfail regression test in
# tests/test_fleet_dsim.py: a run counts them (stats known_*) and goes on, unless strict.
# None now: the one found (a caller that gave up on a shared connect, load or verification
# left that task's later failure unretrieved) is fixed in ledger.py (_shared).
KNOWN_FINDINGS: tuple[str, ...] = ()


class SimViolation(AssertionError):
    """A promise broken; the message carries the seed, the step and the recent steps."""


def classes() -> dict[PriorityClass, ClassSettings]:
    # Short queue timeouts, so that many waiters time out within a run; two classes that
    # may preempt, so that fleet-wide preemption is exercised. No reservations: a free
    # slot is every waiter's (what the liveness checks rely on).
    return {
        SYS: ClassSettings(0, 0.0, 4, 0.8, 5.0, True),
        INT: ClassSettings(0, 0.0, 6, 1.0, 5.0, True),
        DEF: ClassSettings(0, 0.0, 6, 1.2, 0.6, False),
        BULK: ClassSettings(0, 0.0, 8, 0.7, 0.5, False),
    }


QUEUE_TIMEOUT = {c: s.queue_timeout_secs for c, s in classes().items()}
CAN_PREEMPT = {c: s.can_preempt for c, s in classes().items()}


@dataclass
class Window:
    """A window the reference names, during which Σ running may exceed capacity by at
    most ``allowance``. Open while its fault lasts; once healed it closes when every
    replica is back to ``ok`` and the fleet has drained to capacity."""

    kind: str
    allowance: int
    opened: float
    healed: float | None = None
    who: str = ""  # a replica's fault: that replica


class CountingRecorder(NullPoolRecorder):
    """The metrics one controller instance reports, per admission id."""

    def __init__(self, note: Callable[[str], None] = lambda _: None) -> None:
        self.note = note
        self.admitted: Counter[str] = Counter()
        self.released: Counter[str] = Counter()
        self.preempted: Counter[str] = Counter()
        self.faults: Counter[str] = Counter()
        self.states: list[str] = []

    def on_events(self, events: Iterable[Any]) -> None:
        for e in events:
            if isinstance(e, Admitted):
                self.admitted[e.admission.id] += 1
                self.note(f"metrics: admitted {e.admission.id}"
                          f"{' (adopted)' if e.adopted else ''}")
            elif isinstance(e, Released):
                self.released[e.admission.id] += 1
                self.note(f"metrics: released {e.admission.id} {e.reason.value}")
            elif isinstance(e, Preempted):
                self.preempted[e.victim.id] += 1

    def coordination_fault(self, kind: str) -> None:
        self.faults[kind] += 1
        self.note(f"metrics: fault {kind}")

    def coordination_changed(self, state: str) -> None:
        self.states.append(state)
        self.note(f"metrics: state {state}")


@dataclass(frozen=True)
class DSimConfig:
    seed: int
    steps: int
    replicas: int = 3
    capacity: int = 6
    ttl: float = 1.0  # --replica-ttl-secs: call timeout 0.2 s, heartbeat every 0.3 s
    ack_timeout: float = 3.0
    max_clients: int = 24
    faults: tuple[str, ...] = DSIM_FAULTS
    fault_rate: float = 0.002  # per workload event (about one fault every second or two)
    periodic_every: float = 0.4
    mark_delay: float = 0.005
    drop_reply: float = 0.0005  # a reply lost on its way (the call times out)
    slow_call: float = 0.0005  # a call whose latency may pass the call timeout
    vary: bool = False  # the seed also draws the fleet: 2 to 4 replicas, capacity 4 to 9
    strict: bool = False  # a known finding (KNOWN_FINDINGS) fails the run too
    liveness: bool = True  # the liveness checks (off: a test of the safety checks alone)
    stream_life: float | None = None  # every stream runs this long (None: drawn)
    # The order of the fault kinds each run draws first (None: ties by the RNG); the CI
    # profile gives its seeds different offsets, so that together they draw every kind.
    fault_offset: int | None = None
    # Every request also reserves tokens in the ledger before its admit and settles them
    # (or cancels) in the background after, as sidecar.pools does, through the same
    # simulated connection, so the token operations meet every fault and reorder too.
    tokens: bool = False

    @functools.cached_property
    def call_timeout(self) -> float:
        return call_timeout_for(self.ttl)  # FleetController.connect's rule

    @functools.cached_property
    def interval(self) -> float:
        return 0.9 * self.ttl / 3  # the heartbeat interval (registration ttl / 3)


LATENCY = (0.0001, 0.003)  # one hop, either way, when nothing is slow


@dataclass(frozen=True)
class Bounds:
    """The liveness bounds the reference states, for one configuration (seconds)."""

    cfg: DSimConfig

    @property
    def local_wait(self) -> float:
        """A replica in a local mode below its limit admits a waiter at once (within the
        instant); one that came before it went local, within one call timeout (an arrive
        in flight gives up after one)."""
        return self.cfg.call_timeout + 1e-6

    @property
    def fleet_idle(self) -> float:
        """With every replica ok, a free slot goes to a waiter within one call timeout
        (the release's call, or the waiter's arrive) plus the notification's delivery
        and the client's wake-up: a few hops."""
        return self.cfg.call_timeout + 6 * LATENCY[1]

    @property
    def back_to_ledger(self) -> float:
        """A replica that can reach the server is ok again within 2 × ttl."""
        return 2 * self.cfg.ttl

    @property
    def dead_replica_slots(self) -> float:
        """A dead replica's admissions are given back once its registration lapsed (0.9
        ttl after its last heartbeat) and a replica with waiters reaped it (ttl/20)."""
        return self.cfg.ttl + self.cfg.call_timeout

    @property
    def unacknowledged(self) -> float:
        """An admission Envoy never showed its process runs (one taken over from a
        predecessor that ended while no process ran, or was granted to a Check that died
        with it) is held until the ack timeout, which the heartbeat checks every interval
        (the heartbeat's own call may take a call timeout)."""
        return self.cfg.ack_timeout + self.cfg.interval + self.cfg.call_timeout

    @property
    def orphan(self) -> float:
        """An admission made by a call whose answer was lost is dropped by its owner's
        next heartbeat once 4 call timeouts old (FleetController: the orphan age)."""
        return 4 * self.cfg.call_timeout + self.cfg.interval + 2 * self.cfg.call_timeout

    @property
    def leak(self) -> float:
        """An admission the controller holds whose stream ended (and no documented case
        covers) is a leak once it outlives one call timeout."""
        return self.cfg.call_timeout


def documented_limit(ctrl: FleetController, own_capacity: int) -> int:
    """What a replica in a local mode may hold, as the reference states it (stated here on
    its own, from the replica's view, not taken from the controller's limit):
    L = max(0, min(floor(C/N), h + floor((C − H)/N))) from its last view of the ledger, N
    the largest live count of that view and of every reply since; 0 while another replica
    may not count it yet; while settling, at most what it held when the resync was
    answered (only slots freed since are reused)."""
    core = ctrl.core
    v = core.view
    limit = degraded_limit(min(v.capacity, own_capacity), core.live_replicas, v.inflight,
                           v.held)
    if core.recycle is not None:
        return min(limit, core.recycle)
    if not core.heard:
        return 0
    return limit


# ---------------------------------------------------------------------------- the loop


class _VirtualSelector(selectors.SelectSelector):
    """Never waits: ``select(timeout)`` moves the loop's virtual clock on by ``timeout``
    (to the next timer) and reports no I/O (the simulation does none on the loop)."""

    def __init__(self) -> None:
        super().__init__()
        self.loop: SimLoop | None = None

    def select(self, timeout: float | None = None) -> list[Any]:
        loop = self.loop
        assert loop is not None
        loop.before_select(timeout)
        return []


class SimLoop(asyncio.SelectorEventLoop):
    """An event loop on a virtual clock: ``time()`` is :attr:`now`, and one iteration
    (``_run_once``: every callback ready at one instant) is one step of the simulation;
    ``on_step`` runs between two steps, ``on_instant`` before the clock moves on."""

    def __init__(self) -> None:
        selector = _VirtualSelector()
        super().__init__(selector)
        selector.loop = self
        self.now = 0.0
        self.on_step: Callable[[], None] = lambda: None
        self.on_instant: Callable[[], None] = lambda: None

    def time(self) -> float:
        return self.now

    def before_select(self, timeout: float | None) -> None:
        self.on_step()
        if timeout is None:
            raise RuntimeError("simulation deadlock: nothing scheduled and nothing ready")
        if timeout > 0:
            self.on_instant()
            self.now += timeout


# ---------------------------------------------------------------------------- the server


class Server:
    """The real valkey-server and what the simulation does to it (all synchronous)."""

    def __init__(self, workdir: Path) -> None:
        self.proc = ValkeyServer(workdir)
        self.proc.start()
        self.c = redis.Redis(port=self.proc.port, decode_responses=True)
        self.raw = redis.Redis(port=self.proc.port, decode_responses=False)
        self.c.function_load(TEST_LUA, replace=True)
        self.up = True
        self.paused = False
        self.lives = 0  # server processes so far (a restart or failover is a new one)
        # Ground truth for the outage bound's part (a): the admissions each call made, by
        # the call's generation, within one copy of the data (``copies`` counts the wipes
        # and restores: generations start again or go back there).
        self.copies = 0
        self.made: list[tuple[int, int]] = []
        self._adm: set[str] = set()

    def run(self, kind: str, args: tuple[Any, ...], now: float,
            names: list[str]) -> tuple[Any, list[int]]:
        """Run one command; for an FCALL also the length of each replica's notification
        list (same round trip), so that the readers know when to read."""
        if kind == "load":
            self.c.function_load(args[0], replace=True)
            return "OK", []
        argv = list(args)
        argv[4] = repr(float(now))  # fn 1 prefix op NOW ...: the server's clock is ours
        p = self.c.pipeline(transaction=False)
        p.fcall(*argv)
        for n in names:
            p.llen(f"{PREFIX}:ev:{n}")
        p.hkeys(f"{PREFIX}:adm")
        out = p.execute(raise_on_error=False)
        ids = set(out[-1]) if isinstance(out[-1], list) else set()
        made, self._adm = len(ids - self._adm), ids
        if made and isinstance(out[0], list) and out[0] and isinstance(out[0][0], int):
            self.made.append((out[0][0], made))
        return out[0], [int(x) for x in out[1:-1]]

    def made_after(self, generation: int) -> int:
        """Admissions the ledger made (ids new in its admission records) in calls after
        ``generation``, in this copy of the data."""
        return sum(n for g, n in self.made if g > generation)

    def _new_copy(self) -> None:
        self.copies += 1
        self.made = []
        self._adm = set(self.c.hkeys(f"{PREFIX}:adm"))

    def pop_events(self, name: str, count: int) -> list[str]:
        raw = self.c.lpop(f"{PREFIX}:ev:{name}", count)
        return [] if raw is None else [str(r) for r in raw]

    def admissions(self) -> dict[str, str]:
        """The ledger's admission records: id → its record (owner first)."""
        return dict(self.c.hgetall(f"{PREFIX}:adm"))

    def copy(self) -> dict[bytes, bytes]:
        keys = sorted(k for k in self.raw.keys(f"{PREFIX}:*") if isinstance(k, bytes))
        out: dict[bytes, bytes] = {}
        for k in keys:
            v = self.raw.dump(k)
            if v is not None:
                out[k] = v
        return out

    def wipe(self) -> None:
        """A new server process without data: no keys, no library."""
        self.raw.flushall()
        self.raw.function_flush()
        self.lives += 1
        self._new_copy()

    def restore(self, copy: dict[bytes, bytes], *, new_process: bool) -> None:
        p = self.raw.pipeline(transaction=True)
        now = self.raw.keys(f"{PREFIX}:*")
        if now:
            p.delete(*now)
        for k, v in copy.items():
            p.restore(k, 0, v, replace=True)
        p.execute()
        self._new_copy()
        if new_process:
            # Another server process wrote the copy: its run id is not ours (ledger.lua,
            # check_server), and the library's Lua state is new.
            self.lives += 1
            if self.raw.exists(f"{PREFIX}:server"):
                self.raw.set(f"{PREFIX}:server", f"previous{self.lives}")
            self.c.function_load(TEST_LUA, replace=True)

    def close(self) -> None:
        self.c.close()
        self.raw.close()
        self.proc.stop()


# ---------------------------------------------------------------------------- the clients


LATE = 0.8  # a command on a connection its client closed still runs (it was sent)


@dataclass(eq=False)
class Call:
    """One command a process sent on one of its connections."""

    conn: SimConn
    op: str
    kind: str
    args: tuple[Any, ...]
    sent: float
    fut: asyncio.Future[Any] | None = None  # a client call's own answer (else: read)
    ran: bool = False
    dropped: bool = False  # the server will never run it (its connection is gone)
    delivered: bool = False  # its reply reached the client's socket
    reply: Any = None
    due: float = 0.0  # when the server reads it (after the calls before it)

    @property
    def proc(self) -> Proc:
        return self.conn.proc


class SimConn:
    """One connection of a process to the server, as redis-py's is to
    :class:`~sidecar.coordination.ledger._Pipelined` (``connect``, ``pack_command``,
    ``send_packed_command``, ``read_response``, ``disconnect``): the commands sent on it
    run in order; their replies come back in order, and once one is lost none after it
    arrives (TCP); closed by its client, what it sent may still run (replies lost)."""

    def __init__(self, *, sim: DSim, proc: Proc, **_: Any) -> None:
        self.sim = sim
        self.proc = proc
        self.pipe: deque[Call] = deque()  # sent, not run yet
        self.unread: deque[Call] = deque()  # sent, reply not read yet, in order
        self.last_exec = 0.0
        self.last_reply = 0.0
        self.closed = False
        self.stalled = False  # a reply was lost: nothing more arrives
        self.error: BaseException | None = None
        self.wake: asyncio.Future[None] | None = None
        self.shake: asyncio.Future[None] | None = None
        proc.conns.append(self)

    async def connect(self) -> None:
        await self.sim.handshake(self)

    def pack_command(self, *args: Any) -> list[tuple[Any, ...]]:
        return [args]

    async def send_packed_command(self, data: list[tuple[Any, ...]],
                                  check_health: bool = True) -> None:
        if self.error is not None:
            raise self.error
        for args in data:
            self.sim.send_on(self, args)

    async def read_response(self, timeout: float | None = None, **_: Any) -> Any:
        while True:
            if self.error is not None:
                raise self.error
            if self.unread and self.unread[0].delivered:
                reply = self.unread.popleft().reply
                if isinstance(reply, ResponseError):
                    raise reply
                return reply
            self.wake = self.sim.loop.create_future()
            await self.wake

    async def disconnect(self, nowait: bool = False) -> None:
        self.sim.close_conn(self, ConnectionError("closed by the client"), by_client=True)

    def poke(self) -> None:
        if self.wake is not None and not self.wake.done() and not self.sim.loop.is_closed():
            self.wake.set_result(None)


class SimPool:
    """What _Pipelined takes from the client's connection pool."""

    connection_class = SimConn

    def __init__(self, sim: DSim, proc: Proc, call_timeout: float) -> None:
        # As FleetController.connect builds it: both timeouts the call timeout.
        self.connection_kwargs = {"socket_timeout": call_timeout,
                                  "socket_connect_timeout": call_timeout,
                                  "sim": sim, "proc": proc}


@dataclass(eq=False)
class Reader:
    """The notification reader's blocking pop, as the simulation serves it."""

    fut: asyncio.Future[Any]
    sent: float
    block: float
    count: int
    at_server: bool = False  # arrived: blocked on the server until events or its block time
    wanted: bool = False  # a read is scheduled


class SimClient:
    """What FleetLedger uses of a redis client, pipelined as in production: its pool (for
    _Pipelined's own connection), and ``function_load`` on another connection."""

    def __init__(self, sim: DSim, proc: Proc) -> None:
        self._sim = sim
        self._proc = proc
        self.connection_pool = SimPool(sim, proc, sim.cfg.call_timeout)

    def function_load(self, code: str, replace: bool = False) -> asyncio.Future[Any]:
        return self._sim.send(self._proc, "load", (code,))

    async def aclose(self, close_connection_pool: bool = False) -> None:
        return None


class SimEvents:
    """The notification reader's own connection: a blocking pop the simulation serves."""

    def __init__(self, sim: DSim, proc: Proc) -> None:
        self._sim = sim
        self._proc = proc

    def blmpop(self, timeout: float, numkeys: int, *keys: str, direction: str = "LEFT",
               count: int = 1) -> asyncio.Future[Any]:
        return self._sim.block_read(self._proc, timeout, count)

    async def aclose(self) -> None:
        return None


class SimLedger(FleetLedger):
    """FleetLedger as shipped; it also notes the generation of the last status a resync
    or registration answered (the view's age, for the outage bound's part (a))."""

    status_gen = 0
    _last_gen = 0

    def _unwrap(self, raw: Any) -> Any:
        self._last_gen = int(raw[0])
        return super()._unwrap(raw)

    async def resync(self, *args: Any, **kw: Any) -> FleetStatus:
        status = await super().resync(*args, **kw)
        self.status_gen = self._last_gen
        return status

    async def register(self, *args: Any, **kw: Any) -> FleetStatus:
        status = await super().register(*args, **kw)
        self.status_gen = self._last_gen
        return status


class CheckingRecorder(CountingRecorder):
    """CountingRecorder that fails the run at once when one process's metrics count an id
    admitted or released twice (exactly-once release, checked as it happens)."""

    def __init__(self, sim: DSim, name: str) -> None:
        super().__init__(lambda what: sim.say(f"{name} {what}"))
        self._sim = sim
        self._name = name

    def on_events(self, events: Iterable[Any]) -> None:
        events = list(events)
        super().on_events(events)
        for e in events:
            if isinstance(e, Admitted) and self.admitted[e.admission.id] > 1:
                self._sim.fail(f"{self._name}'s metrics counted {e.admission.id} admitted "
                               f"{self.admitted[e.admission.id]} times")
            elif isinstance(e, Released) and self.released[e.admission.id] > 1:
                self._sim.fail(f"{self._name}'s metrics counted {e.admission.id} released "
                               f"{self.released[e.admission.id]} times")


# ---------------------------------------------------------------------------- one process


class Proc:
    """One sidecar process of a replica: its controller (once connected) and its
    connections to the server as the simulation sees them."""

    def __init__(self, sim: DSim, name: str, incarnation: int) -> None:
        self.name = name
        self.incarnation = incarnation
        self.alive = True
        self.ctrl: FleetController | None = None
        self.task: asyncio.Task[None] | None = None
        self.recorder = CheckingRecorder(sim, name)
        self.conns: list[SimConn] = []  # its connections still open or with calls to run
        self.client = SimClient(sim, self)
        self.events = SimEvents(sim, self)
        self.pool = SimConn(sim=sim, proc=self)  # the client pool's (function_load)
        self.reader: Reader | None = None
        self.slow = 0.0  # slow_replies: every hop takes this long
        self.ids = 0
        self.released_ok: Counter[str] = Counter()
        self.on_started: Callable[[Proc], None] | None = None
        # The newest view of the ledger, and (copy of the data, generation) of the reply
        # it came from: the outage bound's part (a) counts from the oldest view.
        self.view: Any = None
        self.view_at: tuple[int, int] | None = None
        # Liveness bookkeeping (harness side).
        self.local_since: float | None = None
        self.refusals_from_ledger: list[float] = []  # instants a 429 answer was delivered
        self.taken_at = 0.0  # when this process started (its takeover)
        self.signalled: set[str] = set()  # ids Envoy showed this process it runs

    def new_id(self) -> str:
        self.ids += 1
        return f"{self.name}i{self.incarnation}-{self.ids:06d}"


@dataclass
class DStream:
    aid: str
    replica: str
    cls: PriorityClass
    tenant: str
    admitted_at: float
    channel: asyncio.Future[None] | None = None
    first_byte: bool = False


@dataclass(eq=False)
class Req:
    """One client's Check: a task awaiting ``admit`` on one process."""

    rid: int
    proc: Proc
    cls: PriorityClass
    tenant: str
    arrived: float
    task: asyncio.Task[None] | None = None
    done: bool = False
    outcome: str = ""  # "admitted" or "denied <outcome>", once answered
    aid: str = ""  # admitted: its id
    # cfg.tokens: awaiting its token reservation (up to one call timeout, before admission:
    # not yet a waiter of the admission bounds, which count from its end).
    reserving: bool = False


@dataclass
class Slot:
    name: str
    proc: Proc | None = None
    incarnations: int = 0
    recorders: list[CountingRecorder] = field(default_factory=list)
    fault: str | None = None
    partitioned: bool = False


# ---------------------------------------------------------------------------- the world


class DSim:
    def __init__(self, cfg: DSimConfig, workdir: Path,
                 script: Callable[[DSim], Coroutine[Any, Any, None]] | None = None) -> None:
        self.script = script
        self.result: Any = None  # what a script found
        self.rng = random.Random(cfg.seed)
        if cfg.vary:
            cfg = replace(cfg, replicas=self.rng.choice((2, 3, 4)),
                          capacity=self.rng.choice((4, 6, 7, 9)))
        self.cfg = cfg
        self.bounds = Bounds(cfg)
        self.workdir = workdir
        self.loop = SimLoop()
        self.loop.on_step = self._step
        self.loop.on_instant = self._instant
        self.loop.set_exception_handler(self._unhandled)
        self.server: Server | None = None
        self.step = 0
        self.digest = hashlib.sha256()
        self.trace: deque[str] = deque(maxlen=100)
        # SIM_TRACE_DIR: the whole trace, written as it goes (a long run's would not fit in
        # memory), kept as DIR/dsim-SEED.trace when the run fails, removed when it passes.
        out = os.environ.get("SIM_TRACE_DIR")
        self.trace_path = Path(out) / f"dsim-{cfg.seed}.trace" if out else None
        self.full: IO[str] | None = None
        if self.trace_path is not None:
            self.full = self.trace_path.with_suffix(".part").open("w", encoding="utf-8")
        self.slots: list[Slot] = []
        self.running: dict[str, DStream] = {}
        self.ended: deque[tuple[str, str]] = deque(maxlen=200)
        self.reqs: dict[int, Req] = {}
        self.rids = 0
        self.windows: list[Window] = []
        self.preempting: deque[float] = deque()
        self.stats: Counter[str] = Counter()
        self.server_fault: str | None = None
        self.copy: dict[bytes, bytes] | None = None
        self.admitted_after_copy: set[str] = set()
        self.peak = 0
        self.failure: SimViolation | None = None
        self.quiet = False  # the drain at the end: no workload, no faults
        self.load = 1.0  # the share of arrival draws that arrive (load_phase)
        self._known_now: set[str] = set()  # known findings in progress (counted once)
        self.calls = 0
        self.done: asyncio.Future[None] | None = None
        # Liveness bookkeeping: when each documented reason for a slot to stay counted
        # after its stream ended (or for a replica to stay away) last held, per replica.
        self.stopped_pending: dict[str, float] = {}  # preempted, final entry on its way
        self.ended_at: dict[str, float] = {}  # when each stream the clients ran ended
        self.reachable_since: dict[str, float] = {}
        self.fleet_exempt_until = 0.0
        self.fleet_starved_since: float | None = None
        self.refusals: list[tuple[Req, bool, int, int]] = []  # to check at the instant's end
        self.closing = False
        # Preemptions the controller could not deliver, by the tag its warning names them by
        # (logs.id_tag: info and warning lines carry no admission id).
        self.undelivered: set[str] = set()
        self._seq = 0
        # Token budgets (cfg.tokens), the harness's own record: per request its tokens and
        # what it used, what each reserve and settle answered; the background sends.
        self.tok_tokens: dict[int, tuple[int, int]] = {}  # rid -> (estimate, used)
        self.tok_tenant: dict[int, str] = {}
        self.tok_proc: dict[int, Proc] = {}  # the process that reserved it
        # Per tenant: the reserves sent whose reservation may be held or charged (not
        # refused, not given back by an answered cancel).
        self.tok_sent: dict[str, set[int]] = {t: set() for t in TENANTS}
        self.tok_reserved: set[int] = set()  # reserve answered: it holds a reservation
        self.tok_settled: dict[int, bool] = {}  # settle answered: True (settled) or False
        self.tok_served: Counter[str] = Counter()  # served under reservations, per tenant
        self.tok_over: Counter[str] = Counter()  # of which past their estimates
        self.tok_of_aid: dict[str, int] = {}
        self.tok_tasks: set[asyncio.Task[None]] = set()

    # ------------------------------------------------------------------ trace

    def say(self, what: str) -> None:
        line = f"{self.loop.now:.6f} {what}"
        self.digest.update(line.encode())
        self.digest.update(b"\n")
        self.trace.append(f"#{self.step} {line}")
        if self.full is not None:
            self.full.write(f"#{self.step} {line}\n")

    def fail(self, what: str) -> None:
        if self.failure is not None:
            return
        recent = "\n  ".join(self.trace)
        modes = [(s.name, s.proc.ctrl.mode.value if s.proc and s.proc.ctrl else None)
                 for s in self.slots]
        self.failure = SimViolation(
            f"deterministic fleet simulation seed={self.cfg.seed} (SIM_SEED={self.cfg.seed}"
            f"{', SIM_VARY=1' if self.cfg.vary else ''}) step {self.step} at "
            f"{self.loop.now:.6f} s: {what}\n  running={len(self.running)} "
            f"capacity={self.cfg.capacity} windows="
            f"{[(w.kind, w.allowance) for w in self.windows]}\n  running: "
            f"{[(st.aid, round(st.admitted_at, 6)) for st in self.running.values()]}\n"
            f"  modes: {modes}\n  last steps:\n  {recent}")
        if self.full is not None and self.trace_path is not None:
            self.full.close()
            self.full = None
            part = self.trace_path.with_suffix(".part")
            with self.trace_path.open("w", encoding="utf-8") as f, part.open(
                    encoding="utf-8") as whole:
                f.write(f"{self.failure}\n")
                shutil.copyfileobj(whole, f)
            part.unlink()
        if self.done is not None and not self.done.done():
            self.done.set_result(None)

    def _unhandled(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        task = context.get("future")
        if (context.get("message") == "Task exception was never retrieved"
                and isinstance(task, asyncio.Task)
                and task.get_coro().__qualname__ == "_Pipelined._open"
                and "connect_unretrieved" in KNOWN_FINDINGS and not self.cfg.strict):
            self.stats["known_connect_unretrieved"] += 1
            return
        self.fail(f"unhandled in the loop: {context.get('message')} "
                  f"{type(exc).__name__ if exc else ''}: {exc}")

    def _log(self, logger: Any, method: str, event: dict[str, Any]) -> Any:
        """structlog processor: every log line of the controllers goes into the trace."""
        name = event.pop("event", "")
        if name == "preemption_delivery_failed":
            # The reference's "preemption cannot be delivered": its response runs on,
            # its slot given away (counted: smg_sidecar_preemption_delivery_failed_total).
            tag = event.get("admission_tag")
            if tag is None:  # the exemption below would silently stop matching
                self.fail(f"preemption_delivery_failed names no admission_tag: {event}")
            self.undelivered.add(str(tag))
        rest = " ".join(f"{k}={event[k]}" for k in sorted(event))
        self.say(f"log {method} {name} {rest}")
        raise structlog.DropEvent

    # ------------------------------------------------------------------ events

    def at(self, t: float, who: str, what: str, fn: Callable[[], None]) -> None:
        self.loop.call_at(t, self._event, who, what, fn)

    def _event(self, who: str, what: str, fn: Callable[[], None]) -> None:
        self.say(f"[{who}] {what}")
        fn()

    def spawn(self, coro: Coroutine[Any, Any, Any], what: str) -> asyncio.Task[Any]:
        task = self.loop.create_task(coro)
        task.add_done_callback(lambda t: self._task_done(t, what))
        return task

    def _task_done(self, t: asyncio.Task[Any], what: str) -> None:
        if not t.cancelled() and t.exception() is not None:
            exc = t.exception()
            self.fail(f"{what} raised {type(exc).__name__}: {exc}")

    @property
    def now(self) -> float:
        return self.loop.now

    # ------------------------------------------------------------------ ledger calls

    def latency(self, proc: Proc | None = None, *, may_be_slow: bool = False) -> float:
        if proc is not None and proc.slow > 0:
            return proc.slow
        r = self.rng.random()
        if may_be_slow and r < self.cfg.slow_call:
            return self.rng.uniform(0.05, 0.4)  # may pass the call timeout
        return self.rng.uniform(*LATENCY)

    def _reachable(self, proc: Proc) -> bool:
        srv = self.server
        assert srv is not None
        return (srv.up and not srv.paused and proc.alive
                and not self.slot(proc.name).partitioned)

    def handshake(self, conn: SimConn) -> asyncio.Future[None]:
        """A new connection's handshake: refused at once while the server is down, held
        while it cannot be reached (the caller's connect timeout gives up), else a hop."""
        fut: asyncio.Future[None] = self.loop.create_future()
        proc = conn.proc
        srv = self.server
        assert srv is not None
        self.say(f"{proc.name} connects")
        if not proc.alive:
            fut.set_exception(ConnectionError("process ended"))
        elif not srv.up:
            self.at(self.now + 0.0005, proc.name, "connection refused",
                    lambda: fut.done() or fut.set_exception(ConnectionError("refused")))
        else:
            conn.shake = fut
            self.at(self.now + self.latency(proc), proc.name, "handshake",
                    lambda: self._shake(conn))
        return fut

    def _shake(self, conn: SimConn) -> None:
        fut = conn.shake
        if fut is None or fut.done() or conn.closed or not self._reachable(conn.proc):
            return  # held (release_held completes it), or given up
        conn.shake = None
        fut.set_result(None)

    def send(self, proc: Proc, kind: str, args: tuple[Any, ...]) -> asyncio.Future[Any]:
        """A client call on the process's pool connection (``function_load``)."""
        fut: asyncio.Future[Any] = self.loop.create_future()
        if not proc.alive or not self.server or not self.server.up:
            self.at(self.now + 0.0005, proc.name, "refused",
                    lambda: fut.done() or fut.set_exception(ConnectionError("refused")))
            return fut
        self._send(proc.pool, kind, args, fut)
        return fut

    def send_on(self, conn: SimConn, args: tuple[Any, ...]) -> None:
        """A command _Pipelined wrote on ``conn``: ``FCALL fn 1 prefix op now ...``."""
        assert args[0] == "FCALL"
        c = self._send(conn, "fcall", args[1:], None)
        conn.unread.append(c)

    def _send(self, conn: SimConn, kind: str, args: tuple[Any, ...],
              fut: asyncio.Future[Any] | None) -> Call:
        op = str(args[3]) if kind == "fcall" else "load"
        c = Call(conn, op, kind, args, self.now, fut)
        proc = conn.proc
        self.calls += 1
        self.say(f"{proc.name} call {op}")
        conn.pipe.append(c)
        t = c.due = max(self.now + self.latency(proc, may_be_slow=True), conn.last_exec)
        conn.last_exec = t
        self.at(t, proc.name, f"run {op}", lambda: self._run(c))
        self.at(self.now + self.cfg.call_timeout, proc.name, f"{op} due back",
                lambda: self._overdue(c))
        return c

    def _overdue(self, c: Call) -> None:
        """One call timeout after it was sent: its caller gives up now if no reply came.
        On a slow or lost reply, the server up, that is a partition of one call."""
        proc = c.proc
        if c.delivered or not proc.alive or proc.slow or not self._reachable(proc):
            return
        self.say(f"{proc.name} {c.op}: no reply within the call timeout")
        self.cut_off(proc, f"{c.op} timed out")

    def cut_off(self, proc: Proc, kind: str) -> None:
        """A call timed out on a slow or lost reply, the server up: for this replica a
        partition of one call (the reference's partition bound, max(h, L)). One window
        per replica; a later one renews it."""
        self.stats["cut_off"] += 1
        ctrl = proc.ctrl
        share = ctrl.share if ctrl is not None else 0
        allowance = max(self.held_by(proc.name), share)
        self.reachable_since[proc.name] = self.now  # away from the ledger from here
        for w in self.windows:
            if w.kind == "cut_off" and w.who == proc.name:
                w.allowance = max(w.allowance, allowance)
                w.healed = self.now
                return
        w = self.open_window("cut_off", allowance, proc.name)
        self.say(f"{proc.name} {kind}")
        self.heal(w)

    def _run(self, c: Call) -> None:
        conn = c.conn
        if c.ran or c.dropped:
            return
        if not self._reachable(c.proc):
            return  # held: runs when the path or the server is back (release_held)
        if not conn.pipe or conn.pipe[0] is not c:
            return  # an earlier call on this connection has not run yet
        conn.pipe.popleft()
        self._execute(c)
        # The next call on this connection, if it was due already (it waited for this one).
        if conn.pipe and conn.pipe[0].due <= self.now:
            nxt = conn.pipe[0]
            self.at(self.now, c.proc.name, f"run {nxt.op}", lambda: self._run(nxt))

    def _execute(self, c: Call) -> None:
        c.ran = True
        reply = c.reply = self._on_server(c)
        conn = c.conn
        late = (conn.closed or (c.fut is not None and c.fut.done())
                or self.now - c.sent > self.cfg.call_timeout)
        self.say(f"{c.proc.name} ran {c.op}{' (late)' if late else ''}: {_short(reply)}")
        if late:
            # Its caller gave up (or will have by the reply); it ran all the same (e.g. an
            # arrive: an orphan admission until the owner's next heartbeat drops it).
            self.fleet_exempt(self.bounds.orphan, f"{c.op} ran after its caller gave up")
        if conn.closed:
            return
        proc = c.proc
        if self.rng.random() < self.cfg.drop_reply:
            self.say(f"{proc.name} reply of {c.op} lost: nothing more on that connection")
            conn.stalled = True
            self.fleet_exempt(self.bounds.orphan, f"reply of {c.op} lost")
            return
        t = max(self.now + self.latency(proc), conn.last_reply)
        conn.last_reply = t
        self.at(t, proc.name, f"reply {c.op}", lambda: self._deliver(c))

    def _on_server(self, c: Call) -> Any:
        """Run one command now; wake the readers of the notifications it left."""
        srv = self.server
        assert srv is not None
        try:
            reply, lens = srv.run(c.kind, c.args, self.now, [s.name for s in self.slots])
        except ResponseError as exc:
            return exc
        for s, n in zip(self.slots, lens, strict=False):
            if n and s.proc is not None:
                self.want_read(s.proc)
        return reply

    def _deliver(self, c: Call) -> None:
        conn = c.conn
        if conn.closed or conn.stalled:
            return
        c.delivered = True
        reply = c.reply
        if c.op == "arrive" and isinstance(reply, list) and len(reply) > 3 \
                and isinstance(reply[3], list) and reply[3][:1] == ["rejected_queue_full"]:
            c.proc.refusals_from_ledger.append(self.now)
        if c.fut is None:
            conn.poke()
        elif not c.fut.done():
            if isinstance(reply, BaseException):
                c.fut.set_exception(reply)
            else:
                c.fut.set_result(reply)

    def close_conn(self, conn: SimConn, exc: BaseException, *, by_client: bool) -> None:
        """The connection ends: by its client (what it sent may still run, its replies
        are lost), or by the server side (a reset: nothing more runs)."""
        if conn.closed:
            return
        conn.closed = True
        conn.error = exc
        self.say(f"{conn.proc.name} connection closed ({exc})")
        for c in list(conn.pipe):
            if not by_client or self.rng.random() >= LATE:
                c.dropped = True
            if c.fut is not None and not c.fut.done() and not self.loop.is_closed():
                c.fut.set_exception(exc)
        conn.pipe = deque(c for c in conn.pipe if not c.dropped)
        conn.unread.clear()
        if conn.shake is not None and not conn.shake.done() and not self.loop.is_closed():
            conn.shake.set_exception(exc)
        conn.poke()
        if not conn.pipe and conn in conn.proc.conns:
            conn.proc.conns.remove(conn)

    def release_held(self, proc: Proc) -> None:
        """The path to the server is back: what every connection sent runs now, in order;
        handshakes held complete; a blocked notification read goes on."""
        for conn in list(proc.conns):
            if conn.pipe:
                first = conn.pipe[0]
                first.due = self.now + self.latency()
                conn.last_exec = max(conn.last_exec, first.due)
                self.at(first.due, proc.name, f"run {first.op}", lambda c=first: self._run(c))
            if conn.shake is not None and not conn.shake.done():
                self.at(self.now + self.latency(), proc.name, "handshake",
                        lambda c=conn: self._shake(c))
            if conn.closed and not conn.pipe:
                proc.conns.remove(conn)
        r = proc.reader
        if r is not None and not r.fut.done():
            self._schedule_read(proc, r)

    def drop_connections(self, proc: Proc, why: str) -> None:
        """Every connection of this process is reset: nothing it sent runs any more, its
        callers get the reset, and so does a blocked notification read."""
        for conn in list(proc.conns):
            self.close_conn(conn, ConnectionError(why), by_client=False)
        proc.pool = SimConn(sim=self, proc=proc)
        r, proc.reader = proc.reader, None
        if r is not None and not r.fut.done():
            self.at(self.now + 0.0005, proc.name, f"{why} read",
                    lambda: self._read_failed(r, ConnectionError(why)))

    # ------------------------------------------------------------------ notifications

    def block_read(self, proc: Proc, timeout: float, count: int) -> asyncio.Future[Any]:
        fut: asyncio.Future[Any] = self.loop.create_future()
        srv = self.server
        assert srv is not None
        r = Reader(fut, self.now, timeout, count)
        if not proc.alive:
            fut.set_exception(ConnectionError("process ended"))
            return fut
        if not srv.up:
            self.at(self.now + 0.0005, proc.name, "read refused",
                    lambda: self._read_failed(r, ConnectionError("connection refused")))
            return fut
        proc.reader = r
        self._schedule_read(proc, r)
        # The client's socket timeout: the block time plus a call timeout.
        self.at(self.now + timeout + self.cfg.call_timeout, proc.name, "read timeout",
                lambda: self._read_failed(r, TimeoutError("notifications: no reply")))
        return fut

    def _schedule_read(self, proc: Proc, r: Reader) -> None:
        if r.wanted:
            return
        r.wanted = True
        self.at(self.now + self.latency(proc), proc.name, "read notifications",
                lambda: self._read(proc, r))

    def want_read(self, proc: Proc) -> None:
        """A call left notifications for ``proc``: a pop blocked on the server takes them."""
        r = proc.reader
        if r is not None and r.at_server and not r.fut.done():
            self._schedule_read(proc, r)

    def _read(self, proc: Proc, r: Reader) -> None:
        r.wanted = False
        if r.fut.done() or proc.reader is not r:
            return
        if not self._reachable(proc):
            return  # held; the heal or resume reads again
        srv = self.server
        assert srv is not None
        raw = srv.pop_events(proc.name, r.count)
        if raw:
            self.say(f"{proc.name} notified {raw}")
            proc.reader = None
            t = self.now + self.latency(proc)
            self.at(t, proc.name, "notifications arrive",
                    lambda: r.fut.done() or r.fut.set_result([f"{PREFIX}:ev:{proc.name}", raw]))
            return
        if not r.at_server:
            r.at_server = True
            self.at(self.now + r.block, proc.name, "read block over",
                    lambda: self._block_over(proc, r))

    def _block_over(self, proc: Proc, r: Reader) -> None:
        if r.fut.done() or proc.reader is not r or not self._reachable(proc):
            return
        proc.reader = None
        self.at(self.now + self.latency(proc), proc.name, "nothing to read",
                lambda: r.fut.done() or r.fut.set_result(None))

    def _read_failed(self, r: Reader, exc: BaseException) -> None:
        if not r.fut.done():
            r.fut.set_exception(exc)

    # ------------------------------------------------------------------ helpers

    def slot(self, name: str) -> Slot:
        for s in self.slots:
            if s.name == name:
                return s
        raise KeyError(name)

    def held_by(self, name: str) -> int:
        return sum(1 for st in self.running.values() if st.replica == name)

    def up(self) -> list[Proc]:
        return [s.proc for s in self.slots if s.proc is not None and s.proc.ctrl is not None]

    def signal(self, name: str, aid: str) -> None:
        """Envoy shows ``name``'s process that it runs ``aid`` (an entry, a stream, a first
        byte): from here it holds it until its end (no ack timeout)."""
        proc = self.slot(name).proc
        if proc is not None:
            proc.signalled.add(aid)

    def ctrl(self, name: str) -> FleetController | None:
        proc = self.slot(name).proc
        return None if proc is None else proc.ctrl

    # ------------------------------------------------------------------ set-up

    def start(self) -> None:
        self.server = Server(self.workdir / "valkey")
        for i in range(self.cfg.replicas):
            self.slots.append(Slot(f"r{i}"))
        for s in self.slots:
            self.start_process(s)

    def start_process(self, s: Slot) -> Proc:
        s.incarnations += 1
        proc = s.proc = Proc(self, s.name, s.incarnations)
        s.recorders.append(proc.recorder)
        self.reachable_since[s.name] = self.now
        proc.task = self.spawn(self._connect(proc), f"{s.name} start")
        return proc

    async def _connect(self, proc: Proc) -> None:
        # As FleetController.connect builds it: pipelined (one connection of its own,
        # _Pipelined, over the simulated connection), registered for 0.9 ttl.
        ledger = SimLedger(proc.client, FLEET, proc.name,  # type: ignore[arg-type]
                           ttl=0.9 * self.cfg.ttl, clock=self.loop.time, pipelined=True)
        ledger.incarnation = f"{proc.name}i{proc.incarnation}"
        ctrl = await FleetController.open(
            ledger, proc.events,  # type: ignore[arg-type]
            fleet=FLEET, classes=classes(), capacity=self.cfg.capacity,
            call_timeout=self.cfg.call_timeout, ack_timeout=self.cfg.ack_timeout,
            metrics=proc.recorder, mark_delay=self.cfg.mark_delay, id_factory=proc.new_id)
        if not proc.alive:
            await ctrl.aclose()
            return
        ctrl.start()
        proc.ctrl = ctrl
        proc.taken_at = self.now
        self.say(f"{proc.name} process up ({ctrl.mode.value})")
        if proc.on_started is not None:
            proc.on_started(proc)
        if any(w.kind in SERVER_FAULTS for w in self.windows):
            # The reference's "not covered" case of a server that restarts empty: a
            # replica whose first contact falls between the server's return and the
            # first re-registration admits against a ledger that may lack the others'
            # admissions (up to C), and its share is the whole fleet's (N = 1) beside the
            # others' older ones, so it is left out of the shares' sum while this lasts.
            self.heal(self.open_window("first_contact_in_return", self.cfg.capacity,
                                       proc.name))

    def stop_process(self, s: Slot) -> None:
        """The process ends (SIGKILL): nothing more reaches the server from it."""
        proc, s.proc = s.proc, None
        if proc is None:
            return
        proc.alive = False
        self.say(f"{s.name} process ends")
        for conn in list(proc.conns):  # what it sent and the server has not read: gone
            self.close_conn(conn, ConnectionError("process ended"), by_client=False)
        proc.reader = None
        for r in list(self.reqs.values()):
            if r.proc is proc:
                self.reqs.pop(r.rid, None)
                r.done = True
                if r.task is not None:
                    r.task.cancel()  # its Check fails with the process
        if proc.task is not None and not proc.task.done():
            proc.task.cancel()
        if proc.ctrl is not None:
            self.spawn(proc.ctrl.aclose(), f"{s.name} aclose")
        for st in self.running.values():
            if st.replica == s.name:
                st.channel = None  # the ext_proc stream broke: runs on, unstoppable

    def pod_dies(self, s: Slot) -> None:
        """The pod is lost: its Envoy and its streams with it (the ledger counts them until
        the registration lapses, or a new process takes them over until its ack timeout)."""
        dead = [st for st in self.running.values() if st.replica == s.name]
        for st in dead:
            del self.running[st.aid]
            self.ended_at[st.aid] = self.now
        self.stop_process(s)
        for st in dead:  # served so far (counted whole), and nobody left to settle it
            self._tok_stream_ended(st.aid)
        self.fleet_exempt(self.bounds.dead_replica_slots, f"{s.name} died")

    def close(self) -> None:
        self.closing = True
        loop = self.loop
        try:
            if not loop.is_closed():
                # Rounds: a task cancelled here may start another (a reconnect) on its way
                # out, which would otherwise be closed with the loop before its first step.
                for _ in range(10):
                    tasks = [t for t in asyncio.all_tasks(loop) if not t.done()]
                    if not tasks:
                        break
                    for t in tasks:
                        t.cancel()
                    loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
                loop.close()
        finally:
            if self.server is not None:
                self.server.close()
            if self.full is not None and self.trace_path is not None:
                self.full.close()
                self.full = None
                self.trace_path.with_suffix(".part").unlink()

    # ------------------------------------------------------------------ the run

    def run(self) -> None:
        t0 = time.monotonic()
        with _logs_into(self._log):
            self.loop.run_until_complete(self._main())
        self.stats["steps"] = self.step
        self.stats["calls"] = self.calls
        self.stats["peak"] = self.peak
        self.stats["wall_ms"] = int(1000 * (time.monotonic() - t0))
        if self.failure is not None:
            raise self.failure

    async def _main(self) -> None:
        self.done = self.loop.create_future()
        self.at(self.cfg.periodic_every, "sim", "periodic", self.periodic)
        if self.script is not None:
            # A scripted case: the script starts the processes and drives the clients;
            # the checks run after every step all the same.
            self.server = Server(self.workdir / "valkey")
            self.slots = [Slot(f"r{i}") for i in range(self.cfg.replicas)]
            scripted = self.spawn(self.script(self), "the script")
            await asyncio.wait([scripted, self.done], return_when=asyncio.FIRST_COMPLETED)
            if not scripted.done():
                scripted.cancel()
        else:
            self.start()
            self.at(0.0, "sim", "workload", self.workload)
            self.load_phase()
            await self.done
        if self.failure is None:
            await self.finish()
        self.closing = True
        for s in self.slots:
            if s.proc is not None and s.proc.ctrl is not None:
                await s.proc.ctrl.aclose()

    def _step(self) -> None:
        """Between two steps (iterations of the loop): count, check."""
        self.step += 1
        if self.failure is not None or self.closing:
            return
        self.check()
        if self.step >= self.cfg.steps and self.done is not None and not self.done.done():
            self.done.set_result(None)

    def _instant(self) -> None:
        """The clock is about to move on: what happened at this instant is complete (a
        request admitted by this instant's last step is running), so the liveness checks
        run here. Time does not pass within an instant, so a condition that outlasts a
        bound is seen at an instant's end as surely as after every step."""
        if self.failure is not None or self.closing or not self.cfg.liveness:
            return
        if self.refusals:
            refusals, self.refusals = self.refusals, []
            for r, local, limit, held in refusals:
                self._check_refusal(r, local, limit, held)
        self.check_liveness()

    # ------------------------------------------------------------------ workload

    def workload(self) -> None:
        if self.quiet:
            return
        self.at(self.now + self.rng.uniform(0.0, 0.004), "sim", "workload", self.workload)
        r = self.rng.random()
        if self.cfg.faults and r < self.cfg.fault_rate:
            self.fault()
        elif r < 0.15:
            if self.rng.random() < self.load:
                self.arrive()
        elif r < 0.30:
            pass  # time passes
        elif r < 0.33:
            self.end_stream()  # besides each stream's own end (answer)
        elif r < 0.36:
            self.duplicate_end()
        elif r < 0.46:
            self.open_channel()
        elif r < 0.58:
            self.first_byte()
        elif r < 0.61:
            self.client_leaves()

    def load_phase(self) -> None:
        """The offered load changes every few seconds: idle, moderate, saturated. A fleet
        with free slots is where an outage's local shares matter (L = h + (C − H) / N)."""
        if self.quiet:
            return
        self.load = self.rng.choice((0.05, 0.3, 1.0))
        self.say(f"load {self.load}")
        self.at(self.now + self.rng.uniform(1.0, 4.0), "sim", "load", self.load_phase)

    def periodic(self) -> None:
        # Envoy's periodic entries go on while streams run, the drain's included (a process
        # that restarted during it adopts them by the next one, as the checks assume).
        if not self.quiet or self.running:
            self.at(self.now + self.cfg.periodic_every, "sim", "periodic", self.periodic)
        self.periodic_entries()

    def periodic_entries(self) -> None:
        for st in list(self.running.values()):
            ctrl = self.ctrl(st.replica)
            if ctrl is not None:
                self.signal(st.replica, st.aid)
                ctrl.renew_or_adopt(st.aid, st.cls, st.tenant)

    def arrive(self) -> None:
        up = self.up()
        if not up or len(self.reqs) >= self.cfg.max_clients:
            return
        proc = self.rng.choice(up)
        cls = self.rng.choices((SYS, INT, DEF, BULK), (1, 2, 4, 4))[0]
        tenant = self.rng.choice(TENANTS)
        self.request(proc, cls, tenant)

    def request(self, proc: Proc, cls: PriorityClass, tenant: str) -> Req:
        """A client sends a Check to ``proc``: its task awaits ``admit``."""
        self.rids += 1
        r = Req(self.rids, proc, cls, tenant, self.now)
        self.reqs[r.rid] = r
        self.stats["arrivals"] += 1
        self.say(f"{proc.name} request {r.rid} {cls.label} {tenant}")
        r.task = self.spawn(self._client(r), f"request {r.rid}")
        return r

    # ------------------------------------------------------------------ scripted cases

    async def until(self, cond: Callable[[], bool], secs: float, what: str) -> None:
        """Wait (virtual time) until ``cond``; a failure of the run after ``secs``."""
        deadline = self.now + secs
        while not cond():
            if self.now > deadline:
                self.fail(f"waited {secs} s for: {what}")
                raise SimViolation(what)
            await asyncio.sleep(0.001)

    async def process_up(self, name: str) -> Proc:
        """Start ``name``'s process and wait until it is connected."""
        proc = self.start_process(self.slot(name))
        await self.until(lambda: proc.ctrl is not None, 5.0, f"{name} connected")
        return proc

    async def answered(self, r: Req, secs: float) -> str:
        """``r``'s answer within ``secs``, or "" (it still waits: its client leaves)."""
        deadline = self.now + secs
        while not r.outcome and self.now <= deadline:
            await asyncio.sleep(0.001)
        if not r.outcome:
            self.leave(r)
        return r.outcome

    def leave(self, r: Req) -> None:
        """``r``'s client leaves (its Check is cancelled)."""
        if r.done:
            return
        self.reqs.pop(r.rid, None)
        r.done = True
        self.stats["client_cancelled"] += 1
        self.say(f"{r.proc.name} client of request {r.rid} left")
        assert r.task is not None
        r.task.cancel()

    def pause_server(self) -> Window:
        """SIGSTOP: calls and reads are held until :meth:`resume_server`."""
        srv = self.server
        assert srv is not None
        w = self.open_window("pause", self.outage_allowance(whole=True))
        srv.paused = True
        return w

    def resume_server(self, w: Window) -> None:
        self._resume()
        self.heal(w)

    def partition(self, name: str) -> Window:
        """Only ``name`` loses the server until :meth:`heal_partition`."""
        s = self.slot(name)
        ctrl = self.ctrl(name)
        share = ctrl.share if ctrl is not None else 0
        w = self.open_window("partition", max(self.held_by(name), share), name)
        s.partitioned = True
        return w

    def heal_partition(self, name: str, w: Window) -> None:
        s = self.slot(name)
        s.partitioned = False
        if s.proc is not None:
            self.release_held(s.proc)
        self.reachable_since[name] = self.now
        self.heal(w)

    def waiting(self) -> list[Req]:
        """The requests waiting for admission (not those still reserving their tokens)."""
        return [r for r in self.reqs.values() if not r.reserving]

    def stream(self, aid: str) -> DStream:
        return self.running[aid]

    async def _client(self, r: Req) -> None:
        ctrl = r.proc.ctrl
        assert ctrl is not None
        if self.cfg.tokens:
            r.reserving = True
            self.tok_tenant[r.rid], self.tok_proc[r.rid] = r.tenant, r.proc
            if not await self._tok_reserve(ctrl, r):
                return
            r.reserving, r.arrived = False, self.now
        try:
            adm = await ctrl.admit(r.cls, r.tenant)
        except Denied as d:
            self._tok_send(r.proc, "cancel", r.rid)
            self.answer(r, f"denied {d.outcome.value}", None, d.outcome)
            return
        except asyncio.CancelledError:
            self._tok_send(r.proc, "cancel", r.rid)
            return  # its client left, or the process died
        if self.cfg.tokens:
            self.tok_of_aid[adm.admission.id] = r.rid
        self.answer(r, "admitted", adm)

    # ------------------------------------------------------------------ token budgets

    def tok_amount(self, tenant: str) -> int:
        """Each tenant's budget (one day window, never rolled over within a run): t0's is
        spent early in the run, t1's about at its end, t2's never."""
        return {"t0": self.cfg.steps // 20, "t1": self.cfg.steps // 3}.get(tenant, 10**9)

    def tok_budgets(self, tenant: str) -> tuple[Budget, ...]:
        return (Budget(TOKEN_WINDOW, self.tok_amount(tenant)),)

    def tok_bound(self, tenant: str) -> int:
        """What the ledger may count for ``tenant`` now, at most (the harness's own
        record): a settled request its use, any other whose reservation may have been
        made (sent, and not given back by an answered cancel) its estimate (held, or
        charged at it when its replica went), or its use where that is more."""
        total = 0
        for rid in self.tok_sent[tenant]:
            est, used = self.tok_tokens[rid]
            total += used if self.tok_settled.get(rid) else max(est, used)
        return total

    async def _tok_reserve(self, ctrl: FleetController, r: Req) -> bool:
        """The Check's reservation (Pool._reserve_in_ledger's calls); False: the client
        left meanwhile, or its tenant's budget refused it. A replica deciding locally does
        not wait for the ledger; no answer within a call timeout: admitted unreserved, and
        the reservation cancelled in the background (its call may still run). A refusal
        is held to the harness's count (the liveness twin of the budget): it must not fit
        even what the ledger may count at most."""
        est = self.rng.randint(1, 400)
        # Usage above the estimate (a prompt with more tokens than its bytes suggest) on
        # one request in ten: the documented bound's error term.
        used = (self.rng.randint(est, est + est // 2) if self.rng.random() < 0.1
                else self.rng.randint(0, est))
        self.tok_tokens[r.rid] = (est, used)
        if ctrl.core.local:
            self.stats["tok_unreserved_local"] += 1
            return True
        self.tok_sent[r.tenant].add(r.rid)
        try:
            over = await asyncio.wait_for(ctrl.ledger.tok_reserve(
                f"tok{r.rid}", r.tenant, est, self.tok_budgets(r.tenant)),
                self.cfg.call_timeout)
        except asyncio.CancelledError:
            self._tok_send(r.proc, "cancel", r.rid)
            return False
        except Exception as exc:
            self.say(f"{r.proc.name} tok_reserve {r.rid} failed: {type(exc).__name__}")
            self.stats["tok_unreserved_failed"] += 1
            self._tok_send(r.proc, "cancel", r.rid)
            return True
        if over is None:
            self.tok_reserved.add(r.rid)
            self.stats["tok_reserved"] += 1
            return True
        # Refused: nothing held (the ledger reserves nothing for a refusal it enforces).
        self.tok_sent[r.tenant].discard(r.rid)
        may = self.tok_bound(r.tenant)
        amount = self.tok_amount(r.tenant)
        self.stats["tok_refused"] += 1
        if self.cfg.liveness and may + est <= amount:
            self.fail(f"tok_reserve {r.rid} ({r.tenant}, {est} tokens) refused ({over}) "
                      f"though at most {may} of its {amount} can be counted: a tenant under "
                      f"its budget is refused")
        self.answer(r, "denied token_budget", None)
        return False

    def _tok_send(self, proc: Proc, op: str, rid: int) -> None:
        """A settle or cancel sent in the background, again every 0.1 s while it fails
        (Pool._ledger_send), until it has an answer or its process is gone."""
        ctrl = proc.ctrl
        tenant = self.tok_tenant.get(rid, "")
        if (not self.cfg.tokens or rid in self.tok_settled or ctrl is None
                or rid not in self.tok_sent.get(tenant, ())):
            return  # no reservation it may hold (Pool: no ledger id)
        self.tok_settled[rid] = False  # pending; its answer below

        async def go() -> None:
            while proc.alive:
                try:
                    if op == "settle":
                        ok = await asyncio.wait_for(ctrl.ledger.tok_settle(
                            f"tok{rid}", self.tok_tokens[rid][1], self.tok_budgets(tenant)),
                            self.cfg.call_timeout)
                    else:
                        ok = await asyncio.wait_for(ctrl.ledger.tok_cancel(f"tok{rid}"),
                                                    self.cfg.call_timeout)
                except Exception:
                    await asyncio.sleep(0.1)
                    continue
                self.say(f"tok_{op} {rid}: {ok}")
                if op == "settle":
                    self.tok_settled[rid] = ok
                elif ok:  # given back: nothing of it is counted
                    self.tok_sent[tenant].discard(rid)
                return
        task = asyncio.ensure_future(go())
        self.tok_tasks.add(task)
        task.add_done_callback(self.tok_tasks.discard)

    def _tok_stream_ended(self, aid: str) -> None:
        """Its worker served it: counted; settled by the process that reserved it (a
        successor does not know its reservation: charged with the takeover)."""
        rid = self.tok_of_aid.pop(aid, None)
        if rid is None:
            return
        est, used = self.tok_tokens[rid]
        if rid in self.tok_reserved:
            # Served under a reservation: the workers' count the budget bounds.
            tenant = self.tok_tenant[rid]
            self.tok_served[tenant] += used
            self.tok_over[tenant] += max(0, used - est)
            amount = self.tok_amount(tenant)
            if self.tok_served[tenant] > amount + self.tok_over[tenant]:
                self.fail(f"{tenant} served {self.tok_served[tenant]} tokens under "
                          f"reservations, past its budget {amount} + the estimates' error "
                          f"{self.tok_over[tenant]}")
            self._tok_send(self.tok_proc[rid], "settle", rid)

    def tok_check(self) -> None:
        """After the drain: no reservation left (every one settled, cancelled, or charged
        with its reaped or taken-over replica), and each tenant's use is its settled
        requests' use plus at most the estimates of those it holds nobody settled."""
        srv = self.server
        assert srv is not None
        for t in TENANTS:
            settled = sum(self.tok_tokens[rid][1] for rid in self.tok_sent[t]
                          if self.tok_settled.get(rid))
            most = self.tok_bound(t)
            fields = {(k.decode() if isinstance(k, bytes) else k): int(v)
                      for k, v in srv.c.hgetall(f"{PREFIX}:tok:{t}").items()
                      if k in (b"r", b"u:day", "r", "u:day")}
            reserved, used = fields.get("r", 0), fields.get("u:day", 0)
            self.say(f"tokens {t}: reserved {reserved}, used {used}, settled {settled}, at "
                     f"most {most}, served under reservations {self.tok_served[t]} of "
                     f"{self.tok_amount(t)}")
            if reserved != 0:
                self.fail(f"{t}: {reserved} tokens still reserved after the drain (a leak)")
            if not settled <= used <= most:
                self.fail(f"{t}: tokens used {used} outside [{settled}, {most}] (the settled "
                          f"requests' use; their use or estimate with those charged unsettled)")

    def answer(self, r: Req, what: str, adm: Admitted | None,
               outcome: Outcome | None = None) -> None:
        """The process answered request ``r`` (the client hears it now)."""
        if r.done:
            if adm is not None:
                self.fail(f"request {r.rid} admitted ({adm.admission.id}) after it ended")
            return
        r.done = True
        proc = r.proc
        self.reqs.pop(r.rid, None)
        qt = QUEUE_TIMEOUT[r.cls]
        took = self.now - r.arrived
        self.say(f"{proc.name} request {r.rid} {what} after {took:.6f}")
        r.outcome = what
        if took > qt + self.cfg.call_timeout + 1e-9:
            self.fail(f"a waiter on {proc.name} was answered ({what}) after {took:.6f} s, "
                      f"past its queue timeout {qt} s + one call timeout")
        if adm is None:
            self.stats[what.replace(" ", "_")] += 1
            if outcome is Outcome.REJECTED_QUEUE_FULL and self.cfg.liveness:
                self._refused(r)
            return
        aid = r.aid = adm.admission.id
        if aid in self.running:
            self.fail(f"{aid} admitted twice (running on {self.running[aid].replica})")
        st = self.running[aid] = DStream(aid, proc.name, r.cls, r.tenant, self.now)
        # Most responses are short; some stream for seconds (longer than a heartbeat
        # interval, a ttl, an outage), so a victim that is never stopped shows.
        life = self.cfg.stream_life
        if life is None:
            life = (self.rng.expovariate(1 / 0.05) if self.rng.random() < 0.7
                    else self.rng.uniform(0.3, 3.0))
        self.at(self.now + life, proc.name, "stream ends", lambda: self._ends(st))
        if self.copy is not None:
            self.admitted_after_copy.add(aid)
        if adm.preempted:
            self.preempting.append(self.now)
        self.stats["admitted"] += 1

    def client_leaves(self) -> None:
        if not self.reqs:
            return
        self.leave(self.reqs[self.rng.choice(sorted(self.reqs))])

    def _pick(self, pred: Callable[[DStream], bool]) -> DStream | None:
        live = [st for st in self.running.values()
                if pred(st) and self.ctrl(st.replica) is not None]
        return self.rng.choice(live) if live else None

    def _release(self, ctrl: FleetController, proc: Proc, aid: str, why: str) -> None:
        result = ctrl.release(aid)
        self.say(f"{proc.name} {why} {aid}: {result.value}")
        if result is ReleaseResult.RELEASED:
            proc.released_ok[aid] += 1
            if proc.released_ok[aid] > 1:
                self.fail(f"{proc.name} answered 'released' {proc.released_ok[aid]} times "
                          f"for {aid}")

    def end_stream(self) -> None:
        st = self._pick(lambda st: True)
        if st is None:
            return
        proc = self.slot(st.replica).proc
        assert proc is not None and proc.ctrl is not None
        del self.running[st.aid]
        self._release(proc.ctrl, proc, st.aid, "end")
        self._tok_stream_ended(st.aid)
        self.ended.append((st.replica, st.aid))
        self.ended_at[st.aid] = self.now
        if self.rng.random() < 0.1:
            self._release(proc.ctrl, proc, st.aid, "end again")

    def _ends(self, st: DStream) -> None:
        """The response is over: Envoy sends its final entry to the sidecar of its pod, or
        to nobody while that sidecar is down (its successor's ack timeout ends it)."""
        if self.running.get(st.aid) is not st:
            return
        del self.running[st.aid]
        self.ended.append((st.replica, st.aid))
        self.ended_at[st.aid] = self.now
        self._tok_stream_ended(st.aid)
        proc = self.slot(st.replica).proc
        if proc is None or proc.ctrl is None:
            self.say(f"{st.replica} stream {st.aid} ended, its sidecar down")
            return
        self._release(proc.ctrl, proc, st.aid, "end")
        if self.rng.random() < 0.1:
            self._release(proc.ctrl, proc, st.aid, "end again")

    def duplicate_end(self) -> None:
        if not self.ended:
            return
        name, aid = self.rng.choice(list(self.ended))
        proc = self.slot(name).proc
        if proc is not None and proc.ctrl is not None:
            self._release(proc.ctrl, proc, aid, "late duplicate")

    def open_channel(self) -> None:
        st = self._pick(lambda st: st.channel is None and not st.first_byte)
        if st is not None:
            self.open_channel_of(st)

    def open_channel_of(self, st: DStream) -> None:
        """Its ext_proc stream opens: a stop channel on its replica's process."""
        ctrl = self.ctrl(st.replica)
        assert ctrl is not None
        self.signal(st.replica, st.aid)
        ch = ctrl.open_stop_channel(st.aid)
        self.say(f"{st.replica} stop channel of {st.aid}: {ch is not None}")
        if ch is None:
            return
        st.channel = ch
        if ch.done():
            self._stopped(st, "at once")
        else:
            ch.add_done_callback(lambda _f, st=st: self._stopped(st, "stop channel"))

    def _stopped(self, st: DStream, how: str) -> None:
        if self.running.get(st.aid) is not st or st.channel is None:
            return
        st.channel = None
        del self.running[st.aid]
        self.ended.append((st.replica, st.aid))
        self.ended_at[st.aid] = self.now
        if self.preempting:
            self.preempting.popleft()
        self.stats["preempted"] += 1
        self.say(f"{st.replica} stopped {st.aid} ({how})")
        proc = self.slot(st.replica).proc
        self.stopped_pending[st.aid] = self.now

        def final() -> None:
            self.stopped_pending.pop(st.aid, None)
            self._tok_stream_ended(st.aid)
            p = self.slot(st.replica).proc
            if p is not None and p is proc and p.ctrl is not None:
                self._release(p.ctrl, p, st.aid, "final entry of the stopped")

        self.at(self.now + self.rng.uniform(0.0, 0.05), st.replica, "final entry", final)

    def first_byte(self) -> None:
        st = self._pick(lambda st: not st.first_byte)
        if st is None:
            return
        proc = self.slot(st.replica).proc
        assert proc is not None and proc.ctrl is not None
        st.first_byte = True
        self.say(f"{proc.name} first byte of {st.aid}")
        self.signal(st.replica, st.aid)
        if st.channel is None or st.channel.done():
            proc.ctrl.mark_first_byte(st.aid)
            return
        self.spawn(self._confirm(proc, proc.ctrl, st), f"confirm {st.aid}")

    async def _confirm(self, proc: Proc, ctrl: FleetController, st: DStream) -> None:
        ch = st.channel
        ok = await ctrl.confirm_first_byte(st.aid)
        if self.slot(st.replica).proc is not proc or self.running.get(st.aid) is not st:
            return
        if not ok:
            self._stopped(st, "first byte refused")
            return
        if ch is not None and ch.done():
            self._stopped(st, "stop channel")
            return
        st.channel = None  # past its first byte: no longer stoppable
        ctrl.mark_first_byte(st.aid)

    # ------------------------------------------------------------------ faults

    def fault(self) -> None:
        kinds = [k for k in self.cfg.faults
                 if ((k in SERVER_FAULTS and self.server_fault is None)
                 or (k in REPLICA_FAULTS and self._replica_fault_ok())
                 or (k in COMBINED_FAULTS and self._replica_fault_ok()))]
        if not kinds:
            return
        # The least drawn so far (ties by the RNG, or in the configured rotation): every
        # kind comes up in a short run.
        fewest = min(self.stats[f"fault_{k}"] for k in kinds)
        least = [k for k in kinds if self.stats[f"fault_{k}"] == fewest]
        off = self.cfg.fault_offset
        if off is None:
            kind = self.rng.choice(least)
        else:
            n = len(self.cfg.faults)
            kind = min(least, key=lambda k: (self.cfg.faults.index(k) - off) % n)
        self.stats[f"fault_{kind}"] += 1
        if kind in SERVER_FAULTS:
            self.say(f"fault {kind}")
            self.server_fault = kind
            self.server_fault_start(kind)
        else:
            s = self.rng.choice([s for s in self.slots if s.proc is not None])
            self.say(f"fault {kind} of {s.name}")
            s.fault = kind
            if kind in COMBINED_FAULTS:
                self.server_fault = kind
                self.join_then_pause(s)
            else:
                self.replica_fault(s, kind)

    def join_then_pause(self, s: Slot) -> None:
        ttl = self.cfg.ttl
        self.pod_dies(s)

        def paused_after_join(proc: Proc) -> None:
            def pause() -> None:
                srv = self.server
                assert srv is not None
                w = self.open_window("pause", self.outage_allowance(whole=True))
                srv.paused = True

                def resume() -> None:
                    self._resume()
                    self.heal(w)
                    self._later(0.0, 2 * ttl, "server fault over", self._server_fault_over)

                    def over() -> None:
                        s.fault = None

                    self._later(0.0, ttl, "replica fault over", over)

                self._later(0.3 * ttl, 1.5 * ttl, "resume", resume)

            self._later(0.0, self.cfg.interval, "pause after the join", pause)

        def restart() -> None:
            proc = self.start_process(s)
            proc.on_started = paused_after_join

        self._later(1.0 * ttl, 2.0 * ttl, f"{s.name} restarts", restart)

    def _replica_fault_ok(self) -> bool:
        return (all(s.fault is None for s in self.slots) and self.server_fault is None
                and any(s.proc is not None and s.proc.ctrl is not None for s in self.slots))

    def holds_now(self, name: str) -> int:
        """h of the outage bound: what ``name`` holds as the fault hits, its streams and the
        admissions the ledger made for it (the server's records), one id once. An
        admission whose answer (a grant, an arrive's reply) is on its way is the
        replica's already: it holds it when it goes local (the long profile, seed 1011:
        a grant decided just before a restore from a snapshot and read just after)."""
        ids = {st.aid for st in self.running.values() if st.replica == name}
        srv = self.server
        if srv is not None and srv.up:
            ids |= {aid for aid, rec in srv.admissions().items()
                    if rec.split(" ", 1)[0] == name}
        return len(ids)

    def shares(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for s in self.slots:
            ctrl = s.proc.ctrl if s.proc is not None else None
            out[s.name] = ctrl.share if ctrl is not None else 0
        return out

    def check_shares(self) -> None:
        """The shares of the replicas not cut off sum to at most capacity: the promise the
        outage bound rests on (the remaining window: no clock involved), so checked after
        every step, not only when an outage starts."""
        shares = self.shares()
        cut = {w.who for w in self.windows if w.who}
        counted = {n: v for n, v in shares.items() if n not in cut}
        if sum(counted.values()) <= self.cfg.capacity:
            return
        self.fail(f"the replicas' degraded shares {counted} sum past capacity "
                  f"{self.cfg.capacity} (all: {shares}, cut off: {sorted(cut)}): an outage "
                  "now reaches beyond the stated bound")

    def known(self, finding: str, what: str) -> None:
        """A violation already reported: counted once per episode and traced; fatal only
        in a strict run (its regression test)."""
        if self.cfg.strict:
            self.fail(f"[{finding}] {what}")
            return
        if finding in self._known_now:
            return
        self._known_now.add(finding)
        self.stats[f"known_{finding}"] += 1
        self.say(f"known finding {finding}: {what}")

    def outage_allowance(self, whole: bool = False) -> int:
        """(b) Σ max(0, h − s). ``whole``: every replica loses the server now (pause,
        kill, restart empty), and the reference's bound is the smaller of (b) and (a),
        the admissions the ledger made after the oldest of the replicas' views (counted
        from the server's admission records)."""
        self.check_shares()
        b = sum(max(0, self.holds_now(n) - v) for n, v in self.shares().items())
        if not whole:
            return b
        srv = self.server
        assert srv is not None
        ats = [s.proc.view_at for s in self.slots if s.proc is not None]
        if not ats or any(at is None or at[0] != srv.copies for at in ats):
            return b  # a view from another copy of the data (or none): (a) says nothing
        a = srv.made_after(min(at[1] for at in ats if at is not None))
        if a < b:
            self.stats["outage_bound_a_smaller"] += 1
        return min(a, b)

    def open_window(self, kind: str, allowance: int, who: str = "") -> Window:
        w = Window(kind, allowance, self.now, who=who)
        self.windows.append(w)
        self.stats["windows"] += 1
        self.say(f"window {kind} opens, allowance {allowance}")
        return w

    def heal(self, w: Window) -> None:
        w.healed = self.now
        self.say(f"window {w.kind} healed")

    def fleet_exempt(self, secs: float, why: str) -> None:
        """A documented reason for a slot to stay counted after its stream ended (or
        never to run), for ``secs``: the fleet-wide idle check waits that long."""
        until = self.now + secs
        if until > self.fleet_exempt_until:
            self.fleet_exempt_until = until
            self.say(f"idle check waits until {until:.6f}: {why}")

    def _later(self, lo: float, hi: float, what: str, fn: Callable[[], None]) -> None:
        self.at(self.now + self.rng.uniform(lo, hi), "fault", what, fn)

    def _resume(self) -> None:
        srv = self.server
        assert srv is not None
        srv.paused = False
        for s in self.slots:
            self.reachable_since[s.name] = self.now
            if s.proc is not None:
                self.release_held(s.proc)

    def server_fault_start(self, kind: str) -> None:
        srv = self.server
        assert srv is not None
        ttl = self.cfg.ttl

        def done() -> None:
            self._later(0.0, 2 * ttl, "server fault over", self._server_fault_over)

        if kind == "pause":
            w = self.open_window(kind, self.outage_allowance(whole=True))
            srv.paused = True

            def resume() -> None:
                self._resume()
                self.heal(w)
                done()

            self._later(0.05, 1.5 * ttl, "resume", resume)
        elif kind in ("kill", "restart_empty"):
            w = self.open_window(kind, self.outage_allowance(whole=True))
            self._server_down()

            def back() -> None:
                srv.wipe()
                srv.up = True
                for s in self.slots:
                    self.reachable_since[s.name] = self.now
                self.heal(w)
                done()

            if kind == "kill":
                self._later(0.05, 1.5 * ttl, "server back empty", back)
            else:
                back()
        elif kind in ("rdb_restart", "failover", "stale_restore"):
            copy = srv.copy()  # the snapshot, the lagging replica, the older copy
            self.copy = copy
            self.admitted_after_copy = set()
            hi = 0.5 * ttl if kind == "failover" else ttl

            def restore() -> None:
                extra = (sum(1 for a in self.admitted_after_copy if a in self.running)
                         if kind == "stale_restore" else 0)
                w = self.open_window(kind, self.outage_allowance() + extra)
                if kind != "stale_restore":
                    self._server_down()
                srv.restore(copy, new_process=kind != "stale_restore")
                srv.up = True
                self.copy = None
                self.admitted_after_copy = set()
                for s in self.slots:
                    self.reachable_since[s.name] = self.now
                    if s.proc is not None:
                        self.want_read(s.proc)
                self.heal(w)
                done()

            self._later(0.0, hi, f"{kind} restore", restore)
        elif kind == "lose_key":
            w = self.open_window(kind, self.outage_allowance())
            keys = sorted(srv.raw.keys(f"{PREFIX}:*"))
            if keys:
                key = self.rng.choice(keys)
                self.say(f"DEL {key!r}")
                srv.raw.delete(key)
            for s in self.slots:
                self.reachable_since[s.name] = self.now
            self.heal(w)
            done()

    def _server_down(self) -> None:
        srv = self.server
        assert srv is not None
        srv.up = False
        srv.paused = False
        for s in self.slots:
            if s.proc is not None:
                self.drop_connections(s.proc, "connection reset")

    def _server_fault_over(self) -> None:
        self.server_fault = None

    def replica_fault(self, s: Slot, kind: str) -> None:
        ttl = self.cfg.ttl

        def over() -> None:
            s.fault = None

        def restart() -> None:
            self.start_process(s)
            self._later(0.0, ttl, "replica fault over", over)

        if kind == "replica_kill":
            self.pod_dies(s)
            self._later(0.05, 2 * ttl, f"{s.name} restarts", restart)
        elif kind == "replica_restart":
            gap = self.rng.choice((self.rng.uniform(0.02, 0.25 * ttl),
                                   self.rng.uniform(0.25 * ttl, 2 * ttl)))
            long = gap > 0.9 * ttl - (ttl / 3 + self.cfg.call_timeout) - 0.05
            w = self.open_window(kind, self.held_by(s.name) if long else 0, s.name)
            self.stop_process(s)

            def back() -> None:
                restart()
                self.heal(w)

            self.at(self.now + gap, "fault", f"{s.name} restarts", back)
        elif kind in ("partition", "slow_replies", "drop_connections"):
            # Only this replica loses the server: the reference's partition bound,
            # capacity plus max(h, L) for as long as it lasts.
            proc = s.proc
            assert proc is not None
            share = proc.ctrl.share if proc.ctrl is not None else 0
            w = self.open_window(kind, max(self.held_by(s.name), share), s.name)

            def heal() -> None:
                s.partitioned = False
                p = s.proc
                if p is not None:
                    p.slow = 0.0
                    self.release_held(p)
                self.reachable_since[s.name] = self.now
                self.heal(w)
                self._later(0.0, ttl, "replica fault over", over)

            if kind == "partition":
                s.partitioned = True
                self._later(0.1, 3 * ttl, f"{s.name} partition heals", heal)
            elif kind == "slow_replies":
                proc.slow = self.rng.choice((0.3, 1.0, 2.0)) * self.cfg.call_timeout
                self.say(f"{s.name} every hop takes {proc.slow:.3f} s")
                self._later(0.1, 2 * ttl, f"{s.name} replies fast again", heal)
            else:
                self.drop_connections(proc, "connection reset")
                heal()

    # ------------------------------------------------------------------ safety

    def allowed(self) -> int:
        # A preemption's victim runs until its stop arrives: a notification read, a few ms
        # here. Within a window (its owner cut off, the server away) 2 ttl.
        grace = 2 * self.cfg.ttl if self.windows else 2 * self.cfg.call_timeout
        while self.preempting and self.now - self.preempting[0] > grace:
            self.preempting.popleft()
        server = max((w.allowance for w in self.windows if w.kind in SERVER_FAULTS),
                     default=0)
        server = max(server, max((w.allowance for w in self.windows
                                  if w.kind == "first_contact_in_return"), default=0))
        replica = sum(w.allowance for w in self.windows
                      if w.kind not in SERVER_FAULTS and w.kind != "first_contact_in_return")
        return self.cfg.capacity + server + replica + len(self.preempting)

    def check(self) -> None:
        n = len(self.running)
        self.peak = max(self.peak, n)
        self._close_windows(n)
        if n > self.allowed():
            self.fail(f"{n} running > {self.allowed()} allowed (capacity {self.cfg.capacity},"
                      f" open windows {[(w.kind, w.allowance) for w in self.windows]}, "
                      f"pending preemptions {len(self.preempting)})")
            return
        if n > self.cfg.capacity:
            self.stats["steps_over_capacity_in_windows"] += 1
        if self.windows:
            self.stats["steps_in_windows"] += 1
        srv = self.server
        for s in self.slots:
            proc = s.proc
            if proc is None or proc.ctrl is None:
                continue
            view = proc.ctrl.core.view
            if view is not proc.view and srv is not None:
                ledger = proc.ctrl.ledger
                assert isinstance(ledger, SimLedger)
                proc.view, proc.view_at = view, (srv.copies, ledger.status_gen)
        self.check_shares()
        for r in self.reqs.values():
            qt = QUEUE_TIMEOUT[r.cls]
            if self.now - r.arrived > qt + self.cfg.call_timeout + 1e-9:
                self.fail(f"request {r.rid} on {r.proc.name} still waits after "
                          f"{self.now - r.arrived:.6f} s, queue timeout {qt} s")
                return

    def _close_windows(self, n: int) -> None:
        if not self.windows:
            return
        all_ok = all(s.proc is not None and s.proc.ctrl is not None
                     and not s.proc.ctrl.core.local for s in self.slots)
        if not all_ok or n > self.cfg.capacity:
            return
        notice = self.cfg.ttl / 3 + 2 * self.cfg.call_timeout
        for w in [w for w in self.windows
                  if w.healed is not None and self.now - w.healed > notice]:
            self.windows.remove(w)
            self.say(f"window {w.kind} closed")

    # ------------------------------------------------------------------ liveness

    def _refused(self, r: Req) -> None:
        """A 429: checked once this instant is over (what the same instant admitted is
        counted by then)."""
        proc = r.proc
        ctrl = proc.ctrl
        if ctrl is None:
            return
        proc.refusals_from_ledger = [t for t in proc.refusals_from_ledger if t >= self.now]
        if proc.refusals_from_ledger:
            proc.refusals_from_ledger.pop(0)
            return  # the ledger's own answer (delivered at this instant): it was full
        local = ctrl.core.local
        limit = documented_limit(ctrl, self.cfg.capacity) if local else -1
        self.refusals.append((r, local, limit, self.effective_held(proc)))

    def _check_refusal(self, r: Req, local: bool, limit: int, held_then: int) -> None:
        proc = r.proc
        if not proc.alive:
            return
        if not local:
            self.fail(f"{proc.name} answered request {r.rid} 429 on its own while the "
                      "ledger decides (no refusal from the ledger)")
            return
        held = max(held_then, self.effective_held(proc))
        if held < limit:
            self._below_limit(proc)(
                f"{proc.name} refused request {r.rid} ({r.cls.label}, 429) in a local mode "
                f"while it runs {held} of its documented limit {limit}")

    def _below_limit(self, proc: Proc) -> Callable[[str], None]:
        """How a replica found refusing below its limit is reported: a failure, or the
        known finding while a recovery resync is in flight (KNOWN_FINDINGS)."""
        ctrl = proc.ctrl
        if ctrl is not None and ctrl.mode is Mode.RESYNCING and \
                "resync_refuses" in KNOWN_FINDINGS:
            return lambda what: self.known("resync_refuses", what)
        return self.fail

    def _victim_for(self, proc: Proc, waiters: list[Req], limit: int) -> str:
        """A lower-class candidate on ``proc`` that the head of a class's queue may preempt
        (the scheduler's rule: only the head, and only an admission made before it
        queued), as text ("" if none). Only a queue whose every request came after the
        replica went local, so that the head is the one that came first."""
        since = proc.local_since if proc.local_since is not None else self.now
        for cls in (SYS, INT, DEF, BULK):
            if not CAN_PREEMPT[cls]:
                continue
            queued = [r for r in self.waiting() if r.proc is proc and r.cls is cls]
            if not queued or any(r.arrived <= since for r in queued):
                continue
            r = min(queued, key=lambda r: (r.arrived, r.rid))
            if r not in waiters:
                continue
            for st in self.running.values():
                if (st.replica == proc.name and st.cls < r.cls and st.channel is not None
                        and not st.channel.done() and not st.first_byte
                        and st.admitted_at <= r.arrived):
                    return (f"runs its limit {limit} and request {r.rid} ({r.cls.label}) "
                            f"may preempt {st.aid} ({st.cls.label}, stop channel open)")
        return ""

    def effective_held(self, proc: Proc) -> int:
        """What a replica counts against its limit, from the harness's record: what runs
        on it, plus what it may still hold for a documented reason (a stream stopped as
        preempted whose final entry is on its way; one Envoy never showed this process,
        held until the ack timeout)."""
        held = self.held_by(proc.name)
        ctrl = proc.ctrl
        if ctrl is None:
            return held
        for aid in ctrl.held:
            st = self.running.get(aid)
            if st is not None and st.replica == proc.name:
                continue
            if aid in self.stopped_pending or aid not in proc.signalled:
                held += 1
        return held

    def check_liveness(self) -> None:
        now = self.now
        b = self.bounds
        all_ok = True
        for s in self.slots:
            proc = s.proc
            if proc is None or proc.ctrl is None:
                all_ok = False
                continue
            ctrl = proc.ctrl
            core = ctrl.core
            local = core.mode in LOCAL
            if local:
                all_ok = False
                if proc.local_since is None:
                    proc.local_since = now
            else:
                proc.local_since = None
                if core.mode is not Mode.OK:
                    all_ok = False
            # Nothing held that does not run (outside the documented cases).
            for aid in ctrl.held:
                st = self.running.get(aid)
                if st is not None and st.replica == s.name:
                    continue
                if aid in self.stopped_pending:
                    continue
                h = ctrl.held[aid]
                if aid not in proc.signalled:
                    # Envoy never showed this process it runs: the ack timeout ends it.
                    if now - h.admitted_at > b.unacknowledged:
                        self.fail(f"{s.name} still holds {aid} ({h!r}) "
                                  f"{now - h.admitted_at:.3f} s after it took it, though "
                                  "Envoy never showed it runs (released within the ack "
                                  f"timeout: {b.unacknowledged} s)")
                        return
                    continue
                ended = self.ended_at.get(aid, h.admitted_at)
                if now - ended > b.leak:
                    self.fail(f"{s.name} holds {aid} ({h!r}) {now - ended:.3f} s after its "
                              "stream ended")
                    return
            # Nothing runs uncounted: a stream its replica's process does not hold (its
            # slot may be given away), outside the documented cases: a process that has
            # not had Envoy's periodic entry since it started (it adopts them then), and
            # a preemption the controller reported it could not deliver.
            if now - proc.taken_at > self.cfg.periodic_every + 1e-6:
                for st in self.running.values():
                    if (st.replica == s.name and st.aid not in ctrl.held
                            and logs.id_tag(st.aid) not in self.undelivered):
                        self.fail(f"{st.aid} runs on {s.name} uncounted: its process does "
                                  "not hold it")
                        return
            # Back to the ledger within the bound once the server is reachable again.
            if local and self._reachable(proc) and not proc.slow:
                since = max(proc.local_since or now, self.reachable_since.get(s.name, 0.0))
                if now - since > b.back_to_ledger:
                    self.fail(f"{s.name} is still {core.mode.value} {now - since:.3f} s after "
                              f"the server was reachable again (bound {b.back_to_ledger} s)")
                    return
            # A local replica below its limit admits a request waiting on it at once (the
            # local core decides synchronously); at its limit, a waiting request that may
            # preempt takes the slot of a lower-class candidate running there (stop
            # channel open, before its first byte, admitted before the request came), as
            # the scheduler's rule says. A request that came before the replica went
            # local may still wait for its arrive at the ledger: one call timeout.
            if local:
                since = proc.local_since or now
                waiters = [r for r in self.waiting() if r.proc is proc and (
                    r.arrived > since or now - r.arrived > b.local_wait)]
                starving = ""
                if waiters:
                    held = self.effective_held(proc)
                    limit = documented_limit(ctrl, self.cfg.capacity)
                    if held < limit:
                        starving = f"runs {held} of its documented limit {limit}"
                    elif held == limit:
                        starving = self._victim_for(proc, waiters, limit)
                if starving:
                    waited = max(now - r.arrived for r in waiters)
                    self._below_limit(proc)(
                        f"{s.name} ({core.mode.value}) leaves a request waiting "
                        f"({waited:.3f} s) while it {starving}")
                    if self.failure is not None:
                        return
        # Fleet-wide: every replica ok, no window, a free slot and a request waiting.
        checked = all_ok and not self.windows and now >= self.fleet_exempt_until
        if checked:
            self.stats["instants_fleet_idle_checked"] += 1
        # What the replicas count: what runs, and what they may still hold for a
        # documented reason (effective_held); a slot beyond that is free.
        counted = (sum(self.effective_held(s.proc) for s in self.slots if s.proc is not None)
                   if checked and self.waiting() else self.cfg.capacity)
        if counted < self.cfg.capacity:
            if self.fleet_starved_since is None:
                self.fleet_starved_since = now
            elif now - self.fleet_starved_since > b.fleet_idle:
                waits = sorted((round(now - r.arrived, 3), r.rid, r.proc.name)
                               for r in self.waiting())
                self.fail(f"a slot idles {now - self.fleet_starved_since:.3f} s (running "
                          f"{len(self.running)}, counted {counted} of {self.cfg.capacity}, "
                          f"every replica ok) while requests wait: {waits[-5:]}")
        else:
            self.fleet_starved_since = None

    # ------------------------------------------------------------------ the end

    async def finish(self) -> None:
        """Faults stop, clients leave, every stream ends, the fleet settles."""
        self.quiet = True
        self.say("drain")
        limit = self.now + 30 * self.cfg.ttl

        async def until(cond: Callable[[], bool], what: str) -> bool:
            while not cond():
                if self.failure is not None:
                    return False
                if self.now > limit:
                    self.fail(f"the drain never reached: {what}")
                    return False
                await asyncio.sleep(0.05)
            return True

        if not await until(lambda: self.server_fault is None
                           and all(s.fault is None and s.proc is not None
                                   and s.proc.ctrl is not None for s in self.slots),
                           "faults over"):
            return
        for r in list(self.reqs.values()):
            self.reqs.pop(r.rid, None)
            r.done = True
            assert r.task is not None
            r.task.cancel()
        self.periodic_entries()
        for st in list(self.running.values()):
            proc = self.slot(st.replica).proc
            assert proc is not None and proc.ctrl is not None
            del self.running[st.aid]
            self._release(proc.ctrl, proc, st.aid, "final")
            self._tok_stream_ended(st.aid)
        if not await until(self._settled, "nothing held anywhere"):
            nodes = {s.name: (s.proc.ctrl.mode.value, len(s.proc.ctrl.held))
                     for s in self.slots if s.proc is not None and s.proc.ctrl is not None}
            self.say(f"not settled: {nodes}")
            return
        for s in self.slots:
            for rec in s.recorders:
                for aid, c in rec.admitted.items():
                    if c > 1:
                        self.fail(f"{s.name}'s metrics counted {aid} admitted {c} times")
                for aid, c in rec.released.items():
                    if c > 1:
                        self.fail(f"{s.name}'s metrics counted {aid} released {c} times")
            proc = s.proc
            assert proc is not None
            rec = proc.recorder
            unreleased = [a for a in rec.admitted if a not in rec.released]
            if unreleased:
                self.fail(f"{s.name}'s metrics admitted but never released: {unreleased[:5]}")
        admitted = {a for s in self.slots for rec in s.recorders for a in rec.admitted}
        never = [a for s in self.slots for rec in s.recorders for a in rec.released
                 if a not in admitted]
        if never:
            self.fail(f"released but never admitted: {never[:5]}")
        if self.cfg.tokens:
            # The background sends finish (or give up with their process), then every
            # replica heartbeats on: a reaped one's reservations are charged by then.
            if not await until(lambda: not self.tok_tasks, "token sends done"):
                return
            await asyncio.sleep(3 * self.cfg.ttl)
            self.tok_check()

    def _settled(self) -> bool:
        ctrls = [s.proc.ctrl for s in self.slots if s.proc is not None]
        if not all(c is not None and not c.core.local and not c.held and not c.waiting
                   for c in ctrls):
            return False
        srv = self.server
        assert srv is not None
        inflight = srv.c.hvals(f"{PREFIX}:inflight")
        return sum(int(v) for v in inflight) == 0 and srv.c.hlen(f"{PREFIX}:adm") == 0


def _short(reply: Any) -> str:
    text = repr(reply)
    return text if len(text) <= 300 else text[:300] + "..."


@contextlib.contextmanager
def _logs_into(processor: Callable[[Any, str, dict[str, Any]], Any]) -> Iterator[None]:
    """Every structlog line goes to ``processor`` (the trace) instead of stderr."""
    old = structlog.get_config()
    structlog.configure(processors=[processor],
                        wrapper_class=structlog.make_filtering_bound_logger(0),
                        cache_logger_on_first_use=False)
    try:
        yield
    finally:
        structlog.configure(**old)


def simulate(cfg: DSimConfig, workdir: Path,
             script: Callable[[DSim], Coroutine[Any, Any, None]] | None = None) -> DSim:
    sim = DSim(cfg, workdir, script)
    try:
        sim.run()
    finally:
        sim.close()
    return sim


def stats_line(sim: DSim, secs: float) -> str:
    st = sim.stats
    faults = {k[6:]: v for k, v in sorted(st.items()) if k.startswith("fault_")}
    known = {k: v for k, v in sorted(st.items()) if k.startswith("known_")}
    return (f"seed {sim.cfg.seed} ({sim.cfg.replicas} replicas, capacity "
            f"{sim.cfg.capacity}): {st['steps']} steps in {secs:.1f} s "
            f"({st['steps'] / max(secs, 1e-9):,.0f} steps/s), {sim.now:.1f} s simulated, "
            f"{st['calls']} ledger calls, {st['admitted']} admitted, {st['preempted']} "
            f"preempted, peak {sim.peak}/{sim.cfg.capacity}, {st['steps_in_windows']} steps "
            f"inside windows ({st['steps_over_capacity_in_windows']} over capacity), "
            f"faults {faults}, {f'known findings {known}, ' if known else ''}"
            f"digest {sim.digest.hexdigest()[:16]}")


if __name__ == "__main__":
    # python -m tests.fleet_dsim SEED STEPS [vary]: one run, its digest and rate.
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        t0 = time.monotonic()
        done = simulate(DSimConfig(seed=int(sys.argv[1]), steps=int(sys.argv[2]),
                                   vary=len(sys.argv) > 3 and sys.argv[3] == "vary"), Path(d))
        print(stats_line(done, time.monotonic() - t0))
