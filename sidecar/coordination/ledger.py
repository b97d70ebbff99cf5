"""The fleet ledger's client: one async method per script operation, typed results.

N gateway replicas become one admission controller by sharing a ledger in a Valkey or Redis
server. Every decision is one atomic run of ``ledger.lua`` on the server (a
function library: ``FUNCTION LOAD`` once, ``FCALL`` per call), using the server's clock,
so the fleet admits exactly as one in-process :class:`Scheduler` would.

**Which text is the specification.** The contract's rules are written in
:mod:`sidecar.scheduler` (the in-process core). ``ledger.lua`` is a port of it: same
reservation rule on fleet capacity and fleet in-flight counts, same dispatch order
(timeouts, starved heads lowest class first, strict priority, queued preemption), same
queue inside a class (one FIFO, or weighted fair queuing between tenants with the same tags
and tie-breaks, and the per-tenant queue limit), same victim choice, same float arithmetic
on times and tags. Reservations are not ported at all: each
replica computes them with :func:`sidecar.scheduler.scaled_reservations` for the capacity
it reports, and the ledger uses those of the smallest report. The differential property
test (``tests/test_ledger_differential.py``) drives the core and the ledger with the same
random operations and requires identical decisions, so the two cannot drift. A rule
changes in ``sidecar/scheduler/`` first, then in the script.

**Slice-2 design notes** (how the admission controller will use this class):

* *Delivery.* A decision about a request that is not the caller's direct answer -- a
  queued request granted (``grant``), an admission preempted (``preempt``), a waiter
  timed out (``expired``) -- is pushed to its owner's list ``pg:{fleet}:ev:<replica>``.
  The owner reads it with :meth:`FleetLedger.next_events` (a blocking pop) on a dedicated
  connection. A list is kept until read, unlike pub/sub, so nothing is lost while the
  owner is briefly disconnected; a dead owner's list goes with its registration.
* *Timeouts.* The ledger expires waiters itself (deadlines stored at arrival, checked on
  every call); :meth:`FleetLedger.tick` returns when the next timer is due (relative, so
  no clock skew), and the owner calls it then. An owner that gives up on its own (client
  gone) calls :meth:`FleetLedger.cancel`; ``admitted`` back means the grant won the race
  and the owner must release it.
* *Liveness.* :meth:`FleetLedger.heartbeat` every ``ttl / 3`` or so refreshes the
  replica's registration and capacity report; its admissions need no per-request
  heartbeats. A replica that stops for ``ttl`` loses its admissions and waiters.
* *Degraded mode.* Every heartbeat (and resync, reregister) answers, from one atomic
  run, the fleet capacity, the live replicas, the fleet's admissions in flight and the
  caller's own, which is what a replica needs to admit locally within
  :func:`degraded_limit` while the server is unreachable. A heartbeat answering
  ``new`` (registration lapsed, or the server lost its data) is followed by
  :meth:`FleetLedger.reregister` with what the replica holds; it is idempotent and never
  double counts.
* *Round trips.* Only ``arrive`` is on a request's latency path. Off it, the owner sends
  its releases and marks through one outbox, each flush one ``multi`` call
  (:meth:`FleetLedger.batch`). The preemptible mark is deferred a few ms and dropped when
  the response starts first, so a short request costs arrive + release; a longer one adds
  the mark and a first-byte mark whose answer the response waits for (see
  ``FleetController.confirm_first_byte``).
* *Connections.* Many concurrent requests share a bounded
  ``redis.asyncio.BlockingConnectionPool`` (the default pool raises once it runs out);
  the blocking pop for notifications holds one more connection of its own.
* *Configuration.* The class settings (fair queuing, the per-tenant limit and the tenant
  weights included: :func:`encode_class`) are stored on :meth:`FleetLedger.register` (start,
  reload) with a digest per replica; :meth:`FleetLedger.snapshot` lists the distinct
  digests, so a mismatch between replicas can be reported.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import hashlib
import math
import re
import secrets
from collections import deque
from collections.abc import Callable, Coroutine, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, Literal, NoReturn, TypeVar

import redis.asyncio as redis
from redis.exceptions import NoPermissionError, ResponseError

from sidecar import logs
from sidecar.classes import HIGH_TO_LOW, PriorityClass
from sidecar.scheduler import ClassSettings, ReleaseReason, ReleaseResult, scaled_reservations
from sidecar.tokens import Budget, OverBudget

_SOURCE = resources.files("sidecar.coordination").joinpath("ledger.lua").read_text()
# The library and its function are named after the code: a server shared by replicas of
# two versions (a rolling upgrade) holds both, and each runs its own.
_DIGEST = hashlib.sha1(_SOURCE.encode()).hexdigest()[:16]
FUNCTION = f"pg_ledger_{_DIGEST}"
LIBRARY = f"pgledger_{_DIGEST}"
LUA = (f"#!lua name={LIBRARY}\n"
       + _SOURCE.replace("__FUNCTION__", FUNCTION).replace("__LIBRARY__", LIBRARY))

log = logs.get("sidecar.coordination")

# The test build: the same code with its caller-clock branch uncommented (ledger.lua, clock()),
# under names of its own. Only a FleetLedger given a ``clock`` (tests) loads and calls it;
# production never does, so no production function takes a caller's time.
TEST_LIBRARY = f"pgledger_test_{_DIGEST}"
TEST_FUNCTION = f"pg_ledger_test_{_DIGEST}"
TEST_LUA = (f"#!lua name={TEST_LIBRARY}\n"
            + _SOURCE.replace("--[[TEST_CLOCK", "").replace("TEST_CLOCK]]", "")
            .replace("__FUNCTION__", TEST_FUNCTION).replace("__LIBRARY__", TEST_LIBRARY))

# How long the ledger remembers ended ids (to tell a duplicate release from a stranger).
DEFAULT_REMEMBER_ENDED_SECS = 600.0

# The ranges ledger.lua accepts (its check_call() refuses anything else, changing nothing):
# a registration's ttl, a settling window and ended ids' memory up to a day; a time span
# (queue timeout, starvation threshold, an age) up to 1e9 s; counts (capacity,
# reservations, queue sizes, limits) up to 2**31 - 1. encode_class and the capacity report
# clamp to them: a larger value would act the same (1e9 s is 31 years) or is no capacity
# any worker has.
MAX_TTL_SECS = 86400.0
MAX_SPAN_SECS = 1e9
MAX_COUNT = 2**31 - 1

# The ops that register this replica (or re-register it): each verifies the library first.
_REGISTERING = frozenset({"heartbeat", "reregister", "adopt", "resync"})

_NAME = re.compile(r"^[^\s{}]+$")


def prefix(fleet: str, pool: str | None = None) -> str:
    """The key prefix of a fleet: its ``{fleet}`` hash tag puts every key in one slot.

    A named model pool's ledger lives under ``pg:{fleet}:pool:<pool>``: apart from the
    fleet's own (the default pool's) and every other pool's, yet in the fleet's slot and
    under its ACL key pattern (docs/design.md, "Pools in a fleet").
    """
    if not _NAME.match(fleet):
        raise ValueError(f"fleet id must be non-empty, without spaces or braces: {fleet!r}")
    if pool is None:
        return f"pg:{{{fleet}}}"
    if not _NAME.match(pool):
        raise ValueError(f"pool must be non-empty, without spaces or braces: {pool!r}")
    return f"pg:{{{fleet}}}:pool:{pool}"


def _num(x: float) -> str:
    return repr(float(x))


def _span(x: float) -> str:
    return _num(min(x, MAX_SPAN_SECS))


def _count(n: int) -> int:
    return max(0, min(int(n), MAX_COUNT))


def encode_class(c: ClassSettings) -> str:
    """One class as the ledger stores it: "floor share qsize timeout starve preempt fair
    limit", then (fair queuing only, where they act) the tenant weights.

    The limit is the one in force (``tenant_queue_limit``, "-" for none), as the core
    decides by it. Each weight is "<weight> <bytes> <tenant> ": the tenant's length in UTF-8
    bytes, so a tenant key may hold any character, spaces included. Sorted by tenant, so
    equal maps encode alike (the ledger re-sorts a fair queue when its weights change, as
    ``ClassQueues.configure`` does).
    """
    limit = c.tenant_queue_limit
    text = " ".join((str(_count(c.reserved_floor)), _num(min(c.reserved_per_slot, MAX_COUNT)),
                     str(_count(c.queue_size)), _span(c.queue_timeout_secs),
                     _span(c.starvation_threshold_secs),
                     "1" if c.can_preempt else "0", "1" if c.fair_queuing else "0",
                     "-" if limit is None else str(_count(limit))))
    if c.fair_queuing:
        for tenant, weight in sorted(c.tenant_weights.items()):
            text += f" {_num(weight)} {len(tenant.encode())} {tenant}"
    return text


def config_digest(classes: Mapping[PriorityClass, ClassSettings]) -> str:
    """A short digest of the class settings, equal on replicas configured alike."""
    text = "\n".join(f"{c.label} {encode_class(classes[c])}" for c in HIGH_TO_LOW)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# --------------------------------------------------------------------------- results


class ArriveStatus(enum.StrEnum):
    ADMITTED = "admitted"
    QUEUED = "queued"
    REJECTED_QUEUE_FULL = "rejected_queue_full"
    UNREGISTERED = "unregistered"  # the ledger does not know this replica: heartbeat first
    DUPLICATE = "duplicate"  # the id is already admitted or queued


@dataclass(frozen=True, slots=True)
class Arrival:
    status: ArriveStatus
    victim: str | None = None  # preempted to admit this one (its owner gets "preempt")
    victim_owner: str | None = None
    timeout: float | None = None  # queued: seconds until the ledger times it out


class CancelResult(enum.StrEnum):
    CANCELLED = "cancelled"  # it was queued and is gone
    ADMITTED = "admitted"  # a grant won the race: the owner holds a slot and must release it
    UNKNOWN = "unknown"  # expired, reaped, or never seen


@dataclass(frozen=True, slots=True)
class FleetStatus:
    """A heartbeat's answer: one consistent view of the fleet (one atomic script run)."""

    known: bool  # False: the ledger did not know this replica; reregister its holdings
    capacity: int
    live_replicas: int
    inflight: int  # the fleet's admissions in flight (H)
    held: int = 0  # this replica's admissions as the ledger counts them (h_i)
    by_class: Mapping[PriorityClass, int] = field(default_factory=dict)  # fleet, per class
    refused: tuple[str, ...] = ()  # reregister: ids that ended meanwhile (not added back)
    #   adopt: ids the ledger had ended, added back all the same (their streams run)
    # Seconds until the fleet has settled after a loss (resync's ``settle``): until then no
    # replica may return to admitting through the ledger. 0: settled.
    settling: float = 0.0
    # Other replicas that may not have heard of this one yet (none of the replies they are
    # known to have read came after its registration; or their registration lapsed within
    # a ttl): until 0, this replica takes no degraded share (sidecar.coordination.replica,
    # the remaining window).
    unheard: int = 0

    def degraded_share(self) -> int:
        """floor(capacity / live replicas): the most one replica may hold on its own."""
        return self.capacity // max(1, self.live_replicas)

    def degraded_limit(self, own_capacity: int | None = None) -> int:
        """Slots this replica may hold on its own if the server stops answering now.

        See :func:`degraded_limit` (the proof is in :mod:`sidecar.coordination.replica`).
        """
        cap = self.capacity if own_capacity is None else min(self.capacity, own_capacity)
        return degraded_limit(cap, self.live_replicas, self.inflight, self.held)


def degraded_limit(capacity: int, live_replicas: int, fleet_inflight: int, held: int) -> int:
    """L = max(0, min(floor(C / N), h + floor((C − H) / N))) from one consistent view.

    C capacity, N live replicas (this one included), H the fleet's admissions in flight,
    h this replica's. Summed over the replicas of one view, max(h_i, L_i) ≤ C: each
    replica's new local admissions come out of an N-th of the free slots C − H.
    No view of the fleet (N < 1): no share at all.
    """
    if live_replicas < 1:
        return 0
    capacity = max(0, capacity)
    return max(0, min(capacity // live_replicas,
                      held + (capacity - fleet_inflight) // live_replicas))


@dataclass(frozen=True, slots=True)
class Holding:
    """An admission a replica holds, for :meth:`FleetLedger.reregister`."""

    id: str
    cls: PriorityClass
    tenant: str
    first_byte: bool = False
    preemptible: bool = False


@dataclass(frozen=True, slots=True)
class Event:
    """A notification from the owner's list."""

    kind: Literal["grant", "preempt", "expired"]
    id: str
    waited: float = 0.0  # grant, expired: seconds in the queue (server clock)
    starvation: bool = False  # grant by the starvation rule
    preempted: bool = False  # grant that preempted a lower-class admission
    by_class: PriorityClass | None = None  # preempt: the class that took the slot


def parse_event(raw: str) -> Event:
    kind, rest = raw.split(" ", 1)
    if kind == "grant":
        waited, flags, id = rest.split(" ", 2)
        return Event("grant", id, float(waited), starvation="s" in flags, preempted="p" in flags)
    if kind == "preempt":
        by, id = rest.split(" ", 1)
        return Event("preempt", id, by_class=PriorityClass(int(by)))
    if kind == "expired":
        waited, id = rest.split(" ", 1)
        return Event("expired", id, float(waited))
    raise ValueError(f"unknown ledger event {raw!r}")


@dataclass(frozen=True, slots=True)
class FleetSnapshot:
    capacity: int
    replicas: tuple[str, ...]
    inflight: Mapping[PriorityClass, int]
    queue_depth: Mapping[PriorityClass, int]
    reserved: Mapping[PriorityClass, int]
    digests: tuple[str, ...]  # distinct class-config digests of the live replicas
    now: float  # the ledger's clock

    @property
    def total_inflight(self) -> int:
        return sum(self.inflight.values())


def _window_args(budgets: Sequence[Budget]) -> list[str | int]:
    """A tenant's budgets as the library takes them: their count, then name, seconds (0:
    the calendar month) and amount of each."""
    out: list[str | int] = [len(budgets)]
    for b in budgets:
        out += [b.window.name, b.window.seconds, b.tokens]
    return out


# A tok_reserve's answer: None (reserved), or the refusal.
TokenVerdict = OverBudget | None


def _holding_args(h: Holding) -> list[str | int]:
    """One holding as reregister and resync take it: id cls first_byte preemptible tenant."""
    return [h.id, int(h.cls), "1" if h.first_byte else "0", "1" if h.preemptible else "0",
            h.tenant]


def _function_missing(exc: ResponseError) -> bool:
    return "function not found" in str(exc).lower()


# ------------------------------------------------------------------- the library itself


class LibraryState(enum.StrEnum):
    OK = "ok"  # this version's library is loaded, code identical
    MISSING = "missing"  # none under our name (a server without data): loaded on first call
    MISMATCH = "mismatch"  # a library under our name whose code differs: never used
    UNCHECKED = "unchecked"  # this user may not list libraries (FUNCTION LIST denied)


class LibraryMismatch(ConnectionError):
    """The server's library under this version's name is not this version's code.

    Raised by every call while so: the controller treats it like an unreachable server and
    admits within its local share. A ConnectionError so that no caller mistakes it for an
    answer of the ledger.
    """


class LibraryNotLoaded(ConnectionError):
    """The library is missing and this user may not load it (FUNCTION LOAD denied)."""


class ReplicaIdInUse(ConnectionError):
    """The ledger refused this process: a newer process registered under its replica id
    and took over its admissions (ledger.lua take_over()). Two live sidecars share the id
    (outside Kubernetes, two on one host with the default, the hostname); this one may not
    use the ledger again. A ConnectionError, so the controller degrades as when the server
    is unreachable, while the log says why (``coordination_replica_id_in_use``)."""


def _replica_id_in_use(exc: ResponseError) -> bool:
    return "replica_id_in_use" in str(exc)


def _library_code(reply: Any) -> str | None:
    """The code of the first library in a FUNCTION LIST ... WITHCODE reply (RESP2 or 3)."""
    for lib in reply or ():
        if isinstance(lib, Mapping):
            fields: dict[Any, Any] = dict(lib)
        else:
            items = list(lib)
            fields = dict(zip(items[::2], items[1::2], strict=False))
        fields = {(k.decode() if isinstance(k, bytes) else str(k)): v
                  for k, v in fields.items()}
        if fields.get("library_name") in (LIBRARY, LIBRARY.encode()):
            code = fields.get("library_code")
            return code.decode() if isinstance(code, bytes) else str(code)
    return None


async def library_state(client: redis.Redis) -> LibraryState:
    """Compare what the server holds under this version's library name with ``LUA``.

    The name is public (a digest of the code), so anyone who may ``FUNCTION LOAD REPLACE``
    could put other code under it; the comparison is what makes a replica notice.
    """
    try:
        reply = await client.function_list(library=LIBRARY, withcode=True)
    except NoPermissionError:
        return LibraryState.UNCHECKED
    except ResponseError as exc:
        if "noperm" in str(exc).lower():
            return LibraryState.UNCHECKED
        raise
    code = _library_code(reply)
    if code is None:
        return LibraryState.MISSING
    return LibraryState.OK if code == LUA else LibraryState.MISMATCH


def _per_class(values: Sequence[Any]) -> dict[PriorityClass, int]:
    return {PriorityClass(i): int(v) for i, v in enumerate(values)}


# ---------------------------------------------------------------------------- client



T_ = TypeVar("T_")


def _shared(coro: Coroutine[Any, Any, T_]) -> asyncio.Future[T_]:
    """A task several callers await through ``asyncio.shield``: one that gives up (its call
    timed out) leaves the task running, so its failure is retrieved here, never reported
    as "Task exception was never retrieved" (every caller still waiting gets it)."""
    task = asyncio.ensure_future(coro)
    task.add_done_callback(lambda t: t.cancelled() or t.exception())
    return task

class _Pipelined:
    """One connection on which calls are written as they come and answered in order.

    A server answers one connection's commands in order, so a FIFO of futures matches
    replies to callers: no connection is taken from and given back to a pool per call, the
    calls made in one event-loop turn leave in one write (one syscall, and one read for the
    server), and one replica's calls run in the order it made them. redis-py's connection
    does the rest (connecting, TLS, AUTH/HELLO, RESP encoding, the hiredis parser). No read
    timeout per call: the callers bound their own waits (a caller that gives up leaves its
    future cancelled, and its reply is read and dropped). A connection whose oldest
    unanswered call is older than the pool's ``socket_timeout`` is dropped by the next
    call, which connects afresh (a server that vanished without closing the connection).
    """

    def __init__(self, pool: redis.ConnectionPool) -> None:
        self._pool = pool
        self._conn: Any = None
        self._connecting: asyncio.Future[Any] | None = None
        self._waiting: deque[tuple[float, asyncio.Future[Any]]] = deque()  # (sent at, reply)
        kwargs = pool.connection_kwargs
        self._stall = float(kwargs.get("socket_timeout") or 5.0)
        self._connect_timeout = float(kwargs.get("socket_connect_timeout") or self._stall)
        self._out: list[bytes] = []
        self._reader: asyncio.Task[None] | None = None
        self._writer: asyncio.Task[None] | None = None
        self._closing: asyncio.Future[Any] | None = None

    async def call(self, *args: str | int) -> Any:
        loop = asyncio.get_running_loop()
        conn = self._conn
        if conn is not None and self._waiting and loop.time() - self._waiting[0][0] > self._stall:
            self._fail(conn, TimeoutError(f"no reply for {self._stall:g} s"))
            conn = None
        if conn is None:
            conn = await self._connect()
        fut: asyncio.Future[Any] = loop.create_future()
        self._waiting.append((loop.time(), fut))
        self._out += conn.pack_command(*args)
        if self._writer is None:
            self._writer = asyncio.ensure_future(self._write(conn))
        return await fut

    async def _connect(self) -> Any:
        if self._connecting is None or self._connecting.done():
            self._connecting = _shared(self._open())
        return await asyncio.shield(self._connecting)

    async def _open(self) -> Any:
        kwargs = {**self._pool.connection_kwargs, "socket_timeout": None}
        conn: Any = self._pool.connection_class(**kwargs)
        try:
            async with asyncio.timeout(self._connect_timeout):  # the handshake included
                await conn.connect()
        except BaseException:
            await conn.disconnect(nowait=True)
            raise
        self._conn = conn
        self._reader = asyncio.ensure_future(self._read(conn))
        return conn

    async def _write(self, conn: Any) -> None:
        # Started by the first call of a turn: by the time it runs, that turn's calls are
        # all buffered, and they go out in one write.
        try:
            while self._out and self._conn is conn:
                data, self._out = self._out, []
                await conn.send_packed_command(data, check_health=False)
        except Exception as exc:
            self._fail(conn, exc)
        finally:
            self._writer = None

    async def _read(self, conn: Any) -> None:
        try:
            while True:
                try:
                    reply = await conn.read_response(timeout=math.inf)
                except ResponseError as exc:
                    reply = exc
                _, fut = self._waiting.popleft()
                if fut.done():
                    continue  # its caller gave up; the call still ran
                if isinstance(reply, ResponseError):
                    fut.set_exception(reply)
                else:
                    fut.set_result(reply)
        except asyncio.CancelledError:
            self._fail(conn, ConnectionError("closed"))
            raise
        except Exception as exc:
            self._fail(conn, exc)

    def _fail(self, conn: Any, exc: BaseException) -> None:
        """The connection broke: fail what waits on it; the next call reconnects."""
        if self._conn is not conn:
            return
        self._conn = None
        self._out = []
        waiting, self._waiting = self._waiting, deque()
        for _, fut in waiting:
            if not fut.done():
                fut.set_exception(ConnectionError(f"ledger connection lost: {exc!r}"))
        if self._reader is not None and self._reader is not asyncio.current_task():
            self._reader.cancel()
        self._reader = None
        self._closing = asyncio.ensure_future(conn.disconnect(nowait=True))

    async def aclose(self) -> None:
        conn, reader = self._conn, self._reader
        if conn is not None:
            self._fail(conn, ConnectionError("closed"))
        for task in (reader, self._closing):
            if task is not None:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task


class FleetLedger:
    """One replica's handle on its fleet's ledger.

    ``client`` should decode responses (``decode_responses=True``). ``clock`` is for tests
    only: it makes every script use that time instead of the server's ``TIME``, through the
    test build of the library (``TEST_LUA``); the production library refuses a caller's
    clock.
    """

    def __init__(
        self,
        client: redis.Redis,
        fleet: str,
        replica: str,
        *,
        ttl: float = 10.0,
        remember_ended_secs: float = DEFAULT_REMEMBER_ENDED_SECS,
        clock: Callable[[], float] | None = None,
        pipelined: bool = False,
        pool: str | None = None,
    ) -> None:
        if not _NAME.match(replica):
            raise ValueError(f"replica id must be non-empty, without spaces or braces: {replica!r}")
        # The library refuses anything else (check_call()): said here, once, at start-up.
        if not (math.isfinite(ttl) and 0 < ttl <= MAX_TTL_SECS):
            raise ValueError(f"ledger ttl must be in (0, {MAX_TTL_SECS:g}] s, got {ttl!r}")
        if not (math.isfinite(remember_ended_secs)
                and 0 <= remember_ended_secs <= MAX_TTL_SECS):
            raise ValueError(f"remember_ended_secs must be in [0, {MAX_TTL_SECS:g}] s, "
                             f"got {remember_ended_secs!r}")
        self._client = client
        self._prefix = prefix(fleet, pool)
        self.pool = pool  # None: the fleet's own namespace (no pools, or the default pool)
        self.replica = replica
        self.ttl = ttl
        self._remember = remember_ended_secs
        self._clock = clock
        self._classes: Mapping[PriorityClass, ClassSettings] | None = None
        self._capacity = 0
        self._loading: asyncio.Future[Any] | None = None
        # The server's library as last verified (None: not yet); while it is not our code
        # every call raises _untrusted instead of running it.
        self._library: LibraryState | None = None
        self._verifying: asyncio.Future[LibraryState] | None = None
        self._untrusted: LibraryMismatch | None = None
        # Told of every verification's result (sidecar.coordination.server.watch_library
        # turns them into the library metrics).
        self.on_library: Callable[[LibraryState], None] | None = None
        # Refused as a retired incarnation (ReplicaIdInUse) by the last call: logged once.
        self._id_in_use = False
        # Published with the config digest ("<digest>@<identity>") so that replicas can tell
        # a second deployment under the same fleet id (sidecar.coordination.server).
        self.identity = ""
        self.calls = 0  # ledger calls sent (round trips; for tests and benchmarks)
        # Resyncs built so far: each carries the next number, so that one that runs after a
        # newer one of this process (late, on a connection given up on) changes nothing
        # (ledger.lua, stale_resync()). Per process, like the incarnation.
        self.resyncs = 0
        # Token budgets: each tenant's (reserved, settled per window) as the last accepted
        # tok_reserve of this replica saw it (the pool's gauges, sidecar.pools).
        self.token_views: dict[str, tuple[int, dict[str, int]]] = {}
        # The highest ledger generation acknowledged to us: a ledger found below it is an
        # older copy (ledger.lua, lose()). Per process, like the incarnation.
        self.generation = 0
        # This process: a restarted one with the same replica id takes over its
        # predecessor's admissions (ledger.lua, take_over()).
        self.incarnation = secrets.token_hex(8)
        # The settling window a call that finds a loss opens (the controller's).
        self.settle = 0.0
        # Told of a loss a call found (its cause), and of admissions taken over from a
        # predecessor process: the controller's handlers, run as the reply is read.
        self.on_loss: Callable[[str, int], None] | None = None
        self.on_takeover: Callable[[list[Holding]], None] | None = None
        # The live replica count of the newest reply (every reply carries it), and who is
        # told of it (the controller's core: the degraded share's N).
        self.live_replicas = 0
        self.on_live: Callable[[int], None] | None = None
        # pipelined: every call on one connection of our own (see _Pipelined), the client's
        # pool only for the load of the library.
        self._pipe = _Pipelined(client.connection_pool) if pipelined else None

    @property
    def client(self) -> redis.Redis:
        return self._client

    @property
    def events_key(self) -> str:
        return f"{self._prefix}:ev:{self.replica}"

    async def _call(self, op: str, *args: str | int) -> Any:
        raw = await self._call_raw(op, *args)
        try:
            return self._unwrap(raw)
        except (ValueError, TypeError, IndexError, KeyError) as exc:
            # Not the reply this version's library gives: perhaps not its code.
            await self._suspect()
            raise ResponseError(f"malformed ledger reply to {op}: {exc!r}") from exc

    def _unwrap(self, raw: Sequence[Any]) -> Any:
        """{generation, loss cause, taken over, reply, live replicas}: note all but the
        reply, return the reply."""
        gen, loss, taken, reply, live = raw
        if int(gen) >= self.generation:
            self.live_replicas = int(live)  # the newest reply's count (replies come in order)
            if self.on_live is not None:
                self.on_live(self.live_replicas)
        seen, self.generation = self.generation, max(self.generation, int(gen))
        if loss and self.on_loss is not None:
            self.on_loss(str(loss), seen)
        if taken and self.on_takeover is not None:
            self.on_takeover([
                Holding(str(taken[i]), PriorityClass(int(taken[i + 1])), str(taken[i + 3]),
                        first_byte=taken[i + 2] == "1")
                for i in range(0, len(taken), 4)])
        return reply

    async def _call_raw(self, op: str, *args: str | int) -> Any:
        now = "" if self._clock is None else _num(self._clock())
        self.calls += 1
        args = (self.generation, _num(self.settle), self.replica, self.incarnation, *args)
        verify = op in _REGISTERING
        try:
            reply = await self._fcall(op, now, *args, verify=verify)
        except ResponseError as exc:
            if not _function_missing(exc):
                await self._refused(exc)
            # First call on this server, or it restarted without its data: load, then retry.
            if self._clock is not None:
                await self._client.function_load(TEST_LUA, replace=True)
            else:
                await self.load_library()
            try:
                reply = await self._fcall(op, now, *args, verify=False)
            except ResponseError as exc:
                await self._refused(exc)
        self._id_in_use = False
        return reply

    async def _refused(self, exc: ResponseError) -> NoReturn:
        """An error reply. This version's library gives some (a bad argument, a retired
        incarnation), but so could other code under its name: the library is verified before
        the error is passed on (as LibraryMismatch if it is not ours)."""
        await self._suspect()
        if _replica_id_in_use(exc):
            if not self._id_in_use:
                self._id_in_use = True
                log.error("coordination_replica_id_in_use", replica=self.replica,
                          incarnation=self.incarnation,
                          hint="another live process registered with this --replica-id and "
                               "took over its admissions; this one admits within its "
                               "degraded share: give each sidecar its own --replica-id")
            raise ReplicaIdInUse(str(exc)) from exc
        raise exc

    async def _suspect(self) -> None:
        """Something the library answered could mean it is another library: verify it
        now (not at the next periodic check); raise LibraryMismatch if it is."""
        if self._clock is not None:
            return
        with contextlib.suppress(redis.RedisError, OSError, TimeoutError):
            await self.verify_library()
        if self._untrusted is not None:
            raise self._untrusted

    async def _fcall(self, *args: str | int, verify: bool = False) -> Any:
        # Verified before the first call, before a registering call (every heartbeat), and
        # before the first call on a new connection (the server may have restarted, or the
        # connection may lead elsewhere); a library replaced meanwhile is found by the next
        # of these, or by the first error or malformed reply it gives (_refused, _call).
        if self._clock is None and (verify or self._library is None or (
                self._pipe is not None and self._pipe._conn is None)):
            await self.verify_library()
        if self._untrusted is not None:
            raise self._untrusted
        fn = FUNCTION if self._clock is None else TEST_FUNCTION
        if self._pipe is not None:
            return await self._pipe.call("FCALL", fn, 1, self._prefix, *args)
        return await self._client.fcall(fn, 1, self._prefix, *args)

    async def aclose(self) -> None:
        """Close the pipelined connection, if any (the client is the caller's)."""
        if self._pipe is not None:
            await self._pipe.aclose()

    @property
    def connected(self) -> bool | None:
        """The pipelined connection is open; False once it saw EOF (or before its first
        call); None without one (calls use the client's pool)."""
        return None if self._pipe is None else self._pipe._conn is not None

    async def ping(self) -> None:
        """A PING on the connection calls use: reconnects a pipelined connection that saw
        EOF, and runs no ledger code (registers nothing)."""
        if self._pipe is not None:
            await self._pipe.call("PING")
        else:
            await self._client.ping()

    async def load_library(self) -> None:
        """Load the ledger's function library if the server has none under its name.

        Never REPLACE: a library already there is either ours (another replica loaded it)
        or someone else's code, which is verified and refused, not overwritten. A user
        that may not load (the runtime user of an ACL setup) needs the library preloaded
        by the admin user (``python -m sidecar.coordination.server load``).
        Calls that all find it missing at once (a restarted server) share one load.
        """
        if self._loading is None or self._loading.done():
            self._loading = _shared(self._load())
        await asyncio.shield(self._loading)

    async def _load(self) -> None:
        try:
            await self._client.function_load(LUA)
        except ResponseError as exc:
            text = str(exc).lower()
            if isinstance(exc, NoPermissionError) or "noperm" in text:
                if self._library is not LibraryState.MISSING:  # once, not every retry
                    log.error("coordination_library_not_loaded", library=LIBRARY,
                              hint="this user may not FUNCTION LOAD: load the library with "
                                   "the admin user (python -m sidecar.coordination.server "
                                   "load)")
                self._library = LibraryState.MISSING
                raise LibraryNotLoaded(
                    f"ledger library {LIBRARY} is not loaded and this user may not load it"
                ) from None
            if "already exists" not in text:
                raise
        self._library = None
        if await self.verify_library() is LibraryState.MISMATCH:
            assert self._untrusted is not None
            raise self._untrusted

    @property
    def library_state(self) -> LibraryState | None:
        """The server's library as last verified (None: not verified yet)."""
        return self._library

    async def verify_library(self) -> LibraryState:
        """Compare the server's library with this version's code; refuse calls on a mismatch.

        Logs a change of state once. Concurrent callers share one check.
        """
        if self._verifying is None or self._verifying.done():
            self._verifying = _shared(self._verify())
        return await asyncio.shield(self._verifying)

    async def _verify(self) -> LibraryState:
        state = await library_state(self._client)
        before, self._library = self._library, state
        if self.on_library is not None:
            self.on_library(state)
        if state is LibraryState.MISMATCH:
            self._untrusted = LibraryMismatch(
                f"the server's ledger library {LIBRARY} is not this version's code")
            log.error("coordination_library_mismatch", library=LIBRARY,
                      hint="someone replaced the ledger library: admitting within the local "
                           "share until the admin loads the shipped code again")
        else:
            if self._untrusted is not None:
                log.warning("coordination_library_restored", library=LIBRARY, state=state.value)
            self._untrusted = None
            if state is LibraryState.UNCHECKED and before is not LibraryState.UNCHECKED:
                log.warning("coordination_library_unchecked", library=LIBRARY,
                            hint="FUNCTION LIST is denied to this user: the loaded library "
                                 "cannot be compared with the shipped code")
        return state

    def _heartbeat_args(self, capacity: int, force: bool, settle: float) -> list[str | int]:
        if self._classes is None:
            raise RuntimeError("register() before heartbeat()")
        self._capacity = _count(capacity)
        reserved = scaled_reservations(self._classes, self._capacity)
        report = " ".join(str(_count(v))
                          for v in (self._capacity, *(reserved[c] for c in HIGH_TO_LOW)))
        return [
            self.replica, _num(self.ttl), report, "1" if force else "0",
            *(encode_class(self._classes[PriorityClass(i)]) for i in range(4)),
            config_digest(self._classes) + (f"@{self.identity}" if self.identity else ""),
            _num(self._remember), _num(settle),
        ]

    @staticmethod
    def _status(reply: Sequence[Any]) -> FleetStatus:
        # ("stale": a resync older than one already applied; its caller gave up on it, so
        # nobody reads this. Read, it would count as unknown: an outage and a return.)
        return FleetStatus(reply[0] == "ok", int(reply[1]), int(reply[2]), int(reply[3]),
                           int(reply[4]), _per_class(reply[5:9]), tuple(reply[11:]),
                           float(reply[9]), int(reply[10]))

    # ---------------------------------------------------------------- registration

    # ``settle`` on every registering call: > 0 from a running replica, so that finding it
    # unknown starts the fleet's settling window (FleetStatus.settling; the rule is in
    # ledger.lua, heartbeat()); 0 at a replica's first start.

    async def register(self, classes: Mapping[PriorityClass, ClassSettings],
                       capacity: int, settle: float = 0.0) -> FleetStatus:
        """Start or reload: store the class settings (they become the fleet's) and report."""
        self._classes = dict(classes)
        return self._status(await self._call(
            "heartbeat", *self._heartbeat_args(capacity, True, settle)))

    async def heartbeat(self, capacity: int | None = None, settle: float = 0.0) -> FleetStatus:
        """Stay registered and report capacity (the last one when None)."""
        cap = self._capacity if capacity is None else capacity
        return self._status(await self._call(
            "heartbeat", *self._heartbeat_args(cap, False, settle)))

    async def reregister(self, holdings: Iterable[Holding], capacity: int | None = None,
                         settle: float = 0.0) -> FleetStatus:
        """Heartbeat and add back what this replica holds (idempotent, never double counts)."""
        cap = self._capacity if capacity is None else capacity
        args = self._heartbeat_args(cap, False, settle)
        for h in holdings:
            args += _holding_args(h)
        return self._status(await self._call("reregister", *args))

    async def adopt(self, holdings: Iterable[Holding], capacity: int | None = None,
                    settle: float = 0.0) -> FleetStatus:
        """As :meth:`reregister`, for admissions Envoy reports running now: added back even
        if the ledger had ended them (their ids come back in ``refused``)."""
        cap = self._capacity if capacity is None else capacity
        args = self._heartbeat_args(cap, False, settle)
        for h in holdings:
            args += _holding_args(h)
        return self._status(await self._call("adopt", *args))

    async def resync(self, holdings: Iterable[Holding], capacity: int | None = None,
                     min_age: float = 0.0, waiting: Iterable[str] = (),
                     settle: float = 0.0, in_flight: Iterable[str] = ()) -> FleetStatus:
        """Heartbeat and make the ledger's view of this replica exactly ``holdings``.

        Adds back what it holds (as :meth:`reregister`) and drops any admission or waiter
        of this replica that it does not list and that is at least ``min_age`` seconds
        old (ended locally while the server was away, or decided by a call whose reply
        was never read). ``min_age`` > any call's time in flight keeps a fresh admission
        whose reply is still on its way. ``waiting``: this replica's waiters, kept as they are.
        ``in_flight``: arrivals whose reply it still waits for (after an outage, min_age 0):
        kept if the ledger admitted them, dropped if they are queued (their requesters have
        moved to the local queue). Each resync is numbered (:attr:`resyncs`): one the server
        runs only after a newer one of this process (late, on a connection given up on)
        changes nothing.
        """
        return self._status(await self._call("resync", *self._resync_args(
            holdings, capacity, min_age, waiting, settle, in_flight)))

    def _resync_args(self, holdings: Iterable[Holding], capacity: int | None = None,
                     min_age: float = 0.0, waiting: Iterable[str] = (),
                     settle: float = 0.0, in_flight: Iterable[str] = ()) -> list[str | int]:
        """A resync's arguments, numbered: the next in this process's order."""
        cap = self._capacity if capacity is None else capacity
        args = self._heartbeat_args(cap, False, settle)
        self.resyncs += 1
        args += [_num(min_age), self.resyncs]
        for h in holdings:
            args += _holding_args(h)
        for id in waiting:
            args += [id, -1, "0", "0", ""]
        for id in in_flight:
            args += [id, -2, "0", "0", ""]
        return args

    # ------------------------------------------------------------------- decisions

    async def arrive(self, id: str, cls: PriorityClass, tenant: str) -> Arrival:
        reply = await self._call("arrive", self.replica, id, int(cls), tenant)
        status = ArriveStatus(reply[0])
        if status is ArriveStatus.QUEUED:
            return Arrival(status, timeout=float(reply[1]))
        if len(reply) == 3:
            return Arrival(status, victim=reply[1], victim_owner=reply[2])
        return Arrival(status)

    # ----------------------------------------------------------------- token budgets

    async def tok_reserve(self, id: str, tenant: str, tokens: int,
                          budgets: Sequence[Budget], *, enforce: bool = True,
                          reserve: bool = True) -> TokenVerdict:
        """A request's Check against its tenant's budgets, fleet-wide (TokenBook.reserve on
        the server's clock): ``None`` when it fits (reserved), else the refusal (reserved
        all the same when not ``enforce``: ``reserved`` in the verdict says so)."""
        reply = await self._call("tok_reserve", self.replica, id, tenant, tokens,
                                 int(enforce), int(reserve), *_window_args(budgets))
        status = str(reply[0])
        if status == "ok":
            used = {}
            for cell in reply[2:]:
                name, _, n = str(cell).partition(" ")
                used[name] = int(n)
            self.token_views[tenant] = (int(reply[1]), used)
            return None
        if status not in ("refused", "counted"):  # duplicate, gone: not a Check's answer
            raise ResponseError(f"tok_reserve: {status}")
        return OverBudget(str(reply[1]), float(reply[2]), int(reply[3]), int(reply[4]),
                          int(reply[5]), reply[6] == "1")

    async def tok_settle(self, id: str, tokens: int, budgets: Sequence[Budget]) -> bool:
        """Its usage replaces its reservation; False: no open reservation by that id."""
        return str(await self._call("tok_settle", id, tokens, *_window_args(budgets))) == (
            "settled")

    async def tok_cancel(self, id: str) -> bool:
        return str(await self._call("tok_cancel", id)) == "cancelled"

    async def tok_view(self, *tenants: str) -> dict[str, tuple[int, dict[str, int]]]:
        """Per tenant: tokens reserved by its running requests, and settled per window."""
        rows = await self._call("tok_view", *tenants)
        out: dict[str, tuple[int, dict[str, int]]] = {}
        for tenant, row in zip(tenants, rows, strict=True):
            used = {}
            for cell in row[1:]:
                name, _, n = str(cell).partition(" ")
                used[name] = int(n)
            out[tenant] = (int(row[0]), used)
        return out

    async def release(self, id: str,
                      reason: ReleaseReason = ReleaseReason.COMPLETED) -> ReleaseResult:
        return ReleaseResult(await self._call("release", id, reason))

    async def cancel(self, id: str) -> CancelResult:
        return CancelResult(await self._call("cancel", id))

    async def mark_preemptible(self, *ids: str) -> int:
        return int(await self._call("mark_preemptible", *ids))

    async def mark_first_byte(self, *ids: str) -> int:
        return int(await self._call("mark_first_byte", *ids))

    async def tick(self) -> float | None:
        """Let time act (timeouts, starvation); seconds until the next timer, or None."""
        reply = await self._call("tick")
        return None if reply == "" else float(reply)

    async def snapshot(self) -> FleetSnapshot:
        cap, replicas, inflight, depth, reserved, digests, now = await self._call("snapshot")
        return FleetSnapshot(int(cap), tuple(sorted(replicas)), _per_class(inflight),
                             _per_class(depth), _per_class(reserved), tuple(digests), float(now))

    async def batch(self, ops: Sequence[tuple[str, Sequence[str | int]]]) -> list[Any]:
        """Run several request-path operations (arrive, release, cancel, the marks, tick) in
        one call: one round trip, one run of the library, each operation decided in order as
        the same calls one by one would be. Replies in order; the first error is raised after
        all ran. For the owner's outbox (releases and marks).
        """
        argv: list[str | int] = []
        for op, args in ops:
            argv += [len(args) + 1, op, *args]
        replies = await self._call("multi", *argv)
        for r in replies:
            if isinstance(r, list) and r and r[0] == "!error":
                raise ResponseError(str(r[1]))
        return list(replies)

    # ------------------------------------------------------------------ notifications

    async def next_events(self, timeout: float, max_events: int = 256,
                          client: redis.Redis | None = None) -> list[Event]:
        """Wait up to ``timeout`` s for this replica's notifications; take up to ``max_events``.

        A blocking pop holds its connection: pass a dedicated ``client`` in production.
        """
        c = client if client is not None else self._client
        reply = await c.blmpop(timeout, 1, self.events_key, direction="LEFT", count=max_events)
        if reply is None:
            return []
        return [parse_event(str(raw)) for raw in reply[1]]

    async def take_events(self) -> list[Event]:
        """Take every pending notification without waiting."""
        raw = await self._client.lpop(self.events_key, 1 << 20)
        return [] if raw is None else [parse_event(str(r)) for r in raw]
