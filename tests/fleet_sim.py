"""A seeded simulation of a fleet under faults, trying hardest to break its promises.

N real :class:`~sidecar.coordination.controller.FleetController` replicas (one asyncio
loop) share a real ``valkey-server`` running the real ledger library. Each replica reaches
the server through its own fault-injecting TCP proxy (:class:`FaultProxy`). A seeded RNG
chooses every step: client arrivals (class, tenant, a bounded client deadline), final
access-log entries (sometimes sent twice), Envoy's periodic entries, stop channels, first
bytes, clients leaving, and faults (server pause, kill, restart empty, restart from an RDB
snapshot, a keyspace restored from an older copy, failover to a lagging copy, one ledger
key lost, replica kill, replica restart with the same id, partition, slow or dropped
replies of one replica).

Ground truth is the harness's own record (:class:`Truth`): which admissions the clients
were told they hold and have not ended. After every step :meth:`Sim.check` requires

* Σ running ≤ capacity, except inside the windows the reference names, each encoded with
  its own stated bound (:class:`Window`);
* exactly-once release: no controller answers ``released`` twice for one id, and its
  metrics see at most one admission and one release per id;
* no waiter outlives its class's queue timeout (plus the documented slack: one call
  timeout, the replica's own backstop for a waiter the ledger lost);

and at the end, after the faults stop and the fleet settles: admitted = released, the
ledger's in-flight is 0, every replica is ``ok``.

Real time, not simulated: the seed reproduces the sequence of choices, not the
interleaving with the server's replies, so a failure prints the seed and the last steps.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis.asyncio as redis

from devtools.valkey import ValkeyServer
from sidecar.admission import Denied
from sidecar.classes import PriorityClass
from sidecar.coordination.controller import FleetController
from sidecar.coordination.ledger import FleetLedger
from sidecar.metrics import NullPoolRecorder
from sidecar.scheduler import (
    Admitted,
    ClassSettings,
    Preempted,
    Released,
    ReleaseResult,
)
from tests.ledger_faults import copy_keyspace, restore_keyspace

FLEET = "sim"
SYS, INT, DEF, BULK = (PriorityClass.SYSTEM, PriorityClass.INTERACTIVE,
                       PriorityClass.DEFAULT, PriorityClass.BULK)
TENANTS = ("t0", "t1", "t2")

SERVER_FAULTS = ("pause", "kill", "restart_empty", "rdb_restart", "stale_restore",
                 "failover", "lose_key")
REPLICA_FAULTS = ("replica_kill", "replica_restart", "partition", "slow_replies",
                  "drop_connections")
ALL_FAULTS = SERVER_FAULTS + REPLICA_FAULTS


# Violations already found and reported, each with a strict-xfail regression test in
# tests/test_fleet_sim.py: the run counts them (stats known_*) and goes on.
KNOWN_FINDINGS: tuple[str, ...] = ()  # none open: the ones found so far are fixed


class SimViolation(AssertionError):
    """A promise broken; the message carries the seed, the step and the recent steps."""


# ---------------------------------------------------------------------------- proxy


class FaultProxy:
    """A TCP forwarder between one replica and the server that can delay, stall
    (blackhole: nothing forwarded either way until healed) or sever its connections."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.delay = 0.0  # added to every chunk, both ways
        self._open = asyncio.Event()
        self._open.set()
        self._server: asyncio.Server | None = None
        self._conns: set[tuple[asyncio.StreamWriter, asyncio.StreamWriter | None]] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self.port = 0

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    def blackhole(self) -> None:
        self._open.clear()

    def heal(self) -> None:
        self.delay = 0.0
        self._open.set()

    @property
    def blackholed(self) -> bool:
        return not self._open.is_set()

    def sever(self) -> None:
        """Close every connection now (a reset, a dead process, a switched upstream)."""
        for down, up in list(self._conns):
            down.transport.abort()
            if up is not None:
                up.transport.abort()
        self._conns.clear()

    async def aclose(self) -> None:
        self.sever()
        if self._server is not None:
            self._server.close()
        for t in list(self._tasks):
            t.cancel()
        for t in list(self._tasks):
            with contextlib.suppress(BaseException):
                await t

    def _spawn(self, coro: Any) -> None:
        t = asyncio.ensure_future(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        pair: tuple[asyncio.StreamWriter, asyncio.StreamWriter | None] = (writer, None)
        self._conns.add(pair)
        try:
            await self._open.wait()  # a blackholed path: the handshake never completes
            ur, uw = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        except (OSError, asyncio.CancelledError):
            writer.transport.abort()
            self._conns.discard(pair)
            return
        if pair not in self._conns:  # severed while connecting
            uw.transport.abort()
            writer.transport.abort()
            return
        self._conns.discard(pair)
        pair = (writer, uw)
        self._conns.add(pair)
        self._spawn(self._pump(reader, uw, pair))
        self._spawn(self._pump(ur, writer, pair))

    async def _pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter,
                    pair: tuple[asyncio.StreamWriter, asyncio.StreamWriter | None]) -> None:
        # Each chunk is delivered `delay` after it was read (latency, not throughput), in
        # order; while blackholed it is held, as TCP would retransmit it after the heal.
        loop = asyncio.get_running_loop()
        pending: deque[tuple[float, bytes]] = deque()
        more = asyncio.Event()
        done = False

        async def deliver() -> None:
            while True:
                while not pending:
                    if done:
                        return
                    more.clear()
                    await more.wait()
                due, data = pending[0]
                await self._open.wait()
                wait = due - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                    continue
                pending.popleft()
                dst.write(data)
                await dst.drain()

        sender = asyncio.ensure_future(deliver())
        try:
            while data := await src.read(65536):
                pending.append((loop.time() + self.delay, data))
                more.set()
            done = True
            more.set()
            await sender
        except (OSError, asyncio.CancelledError):
            pass
        finally:
            sender.cancel()
            for w in pair:
                if w is not None:
                    w.transport.abort()
            self._conns.discard(pair)


# ---------------------------------------------------------------------------- truth


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


@dataclass
class Stream:
    """One admitted request as Envoy and its client see it."""

    aid: str
    replica: str
    cls: PriorityClass
    tenant: str
    admitted_at: float
    channel: asyncio.Future[None] | None = None
    first_byte: bool = False


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


@dataclass
class SimConfig:
    seed: int
    steps: int
    replicas: int = 3
    capacity: int = 6
    ttl: float = 1.0  # --replica-ttl-secs: call timeout 0.2 s, heartbeat every 1/3 s
    ack_timeout: float = 3.0  # --admission-lease-secs
    max_clients: int = 24
    faults: tuple[str, ...] = ALL_FAULTS
    fault_rate: float = 0.004  # per step
    time_budget: float | None = None  # stop stepping after this many seconds
    periodic_every: float = 0.4  # Envoy's periodic access-log entries (flush interval)

    @property
    def call_timeout(self) -> float:
        return max(0.05, min(1.0, self.ttl / 5))  # FleetController.connect's rule


def classes() -> dict[PriorityClass, ClassSettings]:
    # Short queue timeouts, so that many waiters time out within a run; two classes that
    # may preempt, so that fleet-wide preemption is exercised.
    return {
        SYS: ClassSettings(0, 0.0, 4, 0.8, 5.0, True),
        INT: ClassSettings(0, 0.0, 6, 1.0, 5.0, True),
        DEF: ClassSettings(0, 0.0, 6, 1.2, 0.6, False),
        BULK: ClassSettings(0, 0.0, 8, 0.7, 0.5, False),
    }


def seed_from_env(default: int) -> int:
    raw = os.environ.get("SIM_SEED")
    return int(raw) if raw else default


@dataclass
class Slot:
    """One replica id: its proxy, its current process (None while down), its clients."""

    name: str
    proxy: FaultProxy
    ctrl: FleetController | None = None
    recorder: CountingRecorder = field(default_factory=CountingRecorder)
    recorders: list[CountingRecorder] = field(default_factory=list)
    released_ok: Counter[str] = field(default_factory=Counter)  # this process's answers
    clients: set[asyncio.Task[None]] = field(default_factory=set)
    fault: str | None = None  # a replica fault in progress
    starting: bool = False


class Sim:
    def __init__(self, cfg: SimConfig, workdir: Path) -> None:
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self.workdir = workdir
        self.server = ValkeyServer(workdir / "valkey")
        self.spare: ValkeyServer | None = None
        self.slots: list[Slot] = []
        self.running: dict[str, Stream] = {}
        self.ended: deque[tuple[str, str]] = deque(maxlen=200)  # (replica, aid) ended
        self.dead_with_pod: set[str] = set()  # streams that died with their replica
        self.windows: list[Window] = []
        self.preempting: deque[float] = deque()  # admitted by preemption, victim not seen
        self.waiters: dict[asyncio.Task[None], tuple[float, float, str]] = {}
        self.trace: deque[str] = deque(maxlen=60)
        self.full_trace: list[str] = []  # for the ids a failure names
        self.step = 0
        self.peak = 0
        self.peak_note = ""
        self._known_seen: set[tuple[str, str]] = set()
        self.stats: Counter[str] = Counter()
        self.server_fault: str | None = None
        self.copy: tuple[float, dict[bytes, bytes]] | None = None  # (taken at, keys)
        self.admitted_after_copy: set[str] = set()
        self.snapshot_at: float | None = None
        self._bg: set[asyncio.Task[Any]] = set()
        self._lag = 0.0  # the loop's recent lateness, added to the waiters' slack
        self._next_periodic = 0.0
        self.failure: SimViolation | None = None
        self.t0 = 0.0

    # ------------------------------------------------------------------ helpers

    def now(self) -> float:
        return asyncio.get_running_loop().time()

    def say(self, what: str) -> None:
        line = f"#{self.step} {self.now() - self.t0:7.3f}s {what}"
        self.trace.append(line)
        self.full_trace.append(line)

    def fail(self, what: str) -> None:
        if self.failure is not None:
            return
        recent = "\n  ".join(self.trace)
        ids = {w[:8] for w in what.replace("'", " ").replace(",", " ").split() if len(w) == 32}
        if ids:
            about = [line for line in self.full_trace if any(i in line for i in ids)]
            recent = "\n  ".join(about[-40:]) + "\n  ...\n  " + recent
        self.failure = SimViolation(
            f"fleet simulation seed={self.cfg.seed} (SIM_SEED={self.cfg.seed}) step "
            f"{self.step}: {what}\n  running={len(self.running)} capacity="
            f"{self.cfg.capacity} windows={[(w.kind, w.allowance) for w in self.windows]}\n"
            f"  last steps:\n  {recent}")
        out = os.environ.get("SIM_TRACE_DIR")
        if out:  # the whole run, for the ids the message names
            path = Path(out) / f"sim-{self.cfg.seed}.trace"
            path.write_text("\n".join([str(self.failure), *self.full_trace]) + "\n")

    def known(self, finding: str, what: str) -> None:
        """A violation already reported (KNOWN_FINDINGS), with its own strict-xfail
        regression test: counted and traced, fatal only with SIM_STRICT=1, so that the
        run goes on looking for new ones."""
        if os.environ.get("SIM_STRICT") == "1":
            self.fail(f"[{finding}] {what}")
            return
        if (finding, what) in self._known_seen:
            return  # the same case seen again at a later step
        self._known_seen.add((finding, what))
        if self.stats[f"known_{finding}"] == 0:
            print(f"fleet simulation seed {self.cfg.seed}: known finding {finding}: {what}")
        self.stats[f"known_{finding}"] += 1
        self.say(f"known finding {finding}: {what}")

    def spawn(self, coro: Any) -> asyncio.Task[Any]:
        t = asyncio.ensure_future(coro)
        self._bg.add(t)
        t.add_done_callback(self._bg_done)
        return t

    def _bg_done(self, t: asyncio.Task[Any]) -> None:
        self._bg.discard(t)
        if not t.cancelled() and t.exception() is not None:
            exc = t.exception()
            if isinstance(exc, SimViolation):
                self.fail(str(exc))
            else:
                self.fail(f"harness task failed: {type(exc).__name__}: {exc}")

    def up(self) -> list[Slot]:
        return [s for s in self.slots if s.ctrl is not None]

    def slot(self, name: str) -> Slot:
        return next(s for s in self.slots if s.name == name)

    def held_by(self, name: str) -> int:
        return sum(1 for s in self.running.values() if s.replica == name)

    # ------------------------------------------------------------------ set-up

    async def start(self) -> None:
        self.t0 = self.now()
        await asyncio.to_thread(self.server.start)
        for i in range(self.cfg.replicas):
            proxy = FaultProxy(self.server.port)
            await proxy.start()
            self.slots.append(Slot(f"r{i}", proxy))
        for s in self.slots:
            await self._start_process(s)
        self.spawn(self._lag_monitor())

    async def _start_process(self, s: Slot) -> None:
        s.recorder = CountingRecorder(lambda what, name=s.name: self.say(f"{name} {what}"))
        s.recorders.append(s.recorder)
        s.released_ok = Counter()
        # Bounded: connect tries the server once, within a call timeout or so.
        limit = 4 * self.cfg.call_timeout + 1.0
        try:
            ctrl = await asyncio.wait_for(FleetController.connect(
                s.proxy.url, fleet=FLEET, replica=s.name, ttl=self.cfg.ttl,
                classes=classes(), capacity=self.cfg.capacity,
                ack_timeout=self.cfg.ack_timeout, metrics=s.recorder), limit)
        except TimeoutError:
            raise SimViolation(f"{s.name}: FleetController.connect took over {limit} s") \
                from None
        except Exception as exc:
            raise SimViolation(f"{s.name}: FleetController.connect raised "
                               f"{type(exc).__name__}: {exc}") from exc
        ctrl.start()
        s.ctrl = ctrl
        self.say(f"{s.name} process up ({ctrl.state})")
        if any(w.kind in SERVER_FAULTS for w in self.windows):
            # Reference §9, server restarts empty, "not covered": a replica whose first
            # contact falls between the server's return and the first re-registration
            # admits against a ledger that may lack the others' admissions (up to C).
            self.heal(self.open_window("first_contact_in_return", self.cfg.capacity))

    async def _stop_process(self, s: Slot) -> None:
        """The process ends: nothing more reaches the server from it."""
        ctrl, s.ctrl = s.ctrl, None
        s.proxy.blackhole()
        s.proxy.sever()
        for t in list(s.clients):
            t.cancel()  # their Checks fail with the process
        if ctrl is not None:
            try:
                await asyncio.wait_for(ctrl.aclose(), 5.0)
            except TimeoutError:
                raise SimViolation(f"{s.name}: FleetController.aclose took over 5 s "
                                   "(its server path blackholed and severed)") from None
        for st in self.running.values():
            if st.replica == s.name:
                st.channel = None  # the ext_proc stream broke: runs on, unstoppable

    async def aclose(self) -> None:
        for t in list(self._bg):
            t.cancel()
        for s in self.slots:
            for t in list(s.clients):
                t.cancel()
        for t in [*self._bg, *(c for s in self.slots for c in s.clients)]:
            with contextlib.suppress(BaseException):
                await t
        for s in self.slots:
            if s.ctrl is not None:
                with contextlib.suppress(Exception):
                    await s.ctrl.aclose()
            await s.proxy.aclose()
        for srv in (self.server, self.spare):
            if srv is not None:
                await asyncio.to_thread(srv.stop)

    async def _lag_monitor(self) -> None:
        # The box is shared and slow: a waiter answered late because the loop itself was
        # late is not the controller's fault. Keep the worst recent lateness.
        while True:
            t = self.now()
            await asyncio.sleep(0.01)
            late = self.now() - t - 0.01
            self._lag = max(late, self._lag * 0.98)

    # ------------------------------------------------------------------ the run

    async def run(self) -> None:
        started = time.monotonic()
        print(f"fleet simulation: seed {self.cfg.seed} (SIM_SEED), {self.cfg.steps} steps, "
              f"{self.cfg.replicas} replicas, capacity {self.cfg.capacity}, "
              f"faults {','.join(self.cfg.faults) or 'none'}")
        for step in range(self.cfg.steps):
            self.step = step
            if self.cfg.time_budget is not None and \
                    time.monotonic() - started > self.cfg.time_budget:
                break
            await self.one_step()
            self.check()
            if self.failure is not None:
                raise self.failure
        self.stats["steps"] = self.step + 1
        await self.finish()
        if self.failure is not None:
            raise self.failure

    async def one_step(self) -> None:
        r = self.rng.random()
        if self.now() >= self._next_periodic:
            self.periodic_entries()
        # Faults from the first step: a fleet that is still starting (views of different N,
        # replicas the others have not heard of) is a case, not noise.
        if self.cfg.faults and r < self.cfg.fault_rate:
            await self.fault()
        elif r < 0.30:
            self.arrive()
        elif r < 0.42:
            self.end_stream()
        elif r < 0.45:
            self.duplicate_end()
        elif r < 0.52:
            self.open_channel()
        elif r < 0.60:
            self.first_byte()
        elif r < 0.62:
            self.client_leaves()
        else:
            # Time passes: the controllers' loops and the server run.
            await asyncio.sleep(self.rng.choice((0.0, 0.0, 0.001, 0.003)))

    # ------------------------------------------------------------------ clients

    def arrive(self) -> None:
        up = [s for s in self.up() if not s.starting]
        if not up or sum(len(s.clients) for s in self.slots) >= self.cfg.max_clients:
            return
        s = self.rng.choice(up)
        cls = self.rng.choices((SYS, INT, DEF, BULK), (1, 2, 4, 4))[0]
        tenant = self.rng.choice(TENANTS)
        t = asyncio.ensure_future(self._client(s, cls, tenant))
        s.clients.add(t)
        t.add_done_callback(s.clients.discard)
        qt = classes()[cls].queue_timeout_secs
        self.waiters[t] = (self.now(), qt, s.name)
        t.add_done_callback(lambda t: self.waiters.pop(t, None))
        self.stats["arrivals"] += 1

    async def _client(self, s: Slot, cls: PriorityClass, tenant: str) -> None:
        ctrl = s.ctrl
        assert ctrl is not None
        qt = classes()[cls].queue_timeout_secs
        arrived = self.now()
        # Envoy's ext_authz timeout: far past every wait the contract allows, so a hang
        # shows as an outlived waiter (check), not as a client giving up.
        try:
            adm = await asyncio.wait_for(ctrl.admit(cls, tenant), qt + 10 * self.cfg.call_timeout)
        except Denied as d:
            self.stats[f"denied_{d.outcome.value}"] += 1
            self._answered(arrived, qt, s.name, f"denied {d.outcome.value}")
            return
        except TimeoutError:
            self.fail(f"a {cls.label} waiter on {s.name} got no answer in "
                      f"{self.now() - arrived:.2f} s (queue timeout {qt} s)")
            return
        self._answered(arrived, qt, s.name, "admitted")
        aid = adm.admission.id
        if s.ctrl is not ctrl:
            self.dead_with_pod.add(aid)  # the process died as it answered
            return
        if aid in self.running:
            self.fail(f"{aid} admitted twice (running on {self.running[aid].replica})")
        self.running[aid] = Stream(aid, s.name, cls, tenant, self.now())
        if self.copy is not None:
            self.admitted_after_copy.add(aid)
        if adm.preempted:
            self.preempting.append(self.now())
        self.stats["admitted"] += 1
        self.say(f"{s.name} admitted {aid[:8]} {cls.label} waited {adm.waited:.3f}"
                 f"{' preempting' if adm.preempted else ''} (running {len(self.running)})")

    def _answered(self, arrived: float, qt: float, name: str, what: str) -> None:
        took = self.now() - arrived
        if took > qt + self.waiter_slack():
            self.fail(f"a waiter on {name} was answered ({what}) after {took:.3f} s, past its "
                      f"queue timeout {qt} s + slack {self.waiter_slack():.3f} s")

    def waiter_slack(self) -> float:
        # Documented: the replica answers a waiter the ledger lost one call timeout after
        # its queue timeout. Plus the loop's own lateness on this box, and a hop.
        return self.cfg.call_timeout + 2 * self._lag + 0.05

    def client_leaves(self) -> None:
        tasks = [t for s in self.slots for t in s.clients]
        if tasks:
            self.rng.choice(tasks).cancel()
            self.stats["client_cancelled"] += 1
            self.say("a waiting client left")

    # ------------------------------------------------------------------ Envoy's entries

    def _pick(self, pred: Callable[[Stream], bool]) -> Stream | None:
        live = [st for st in self.running.values()
                if pred(st) and self.slot(st.replica).ctrl is not None]
        return self.rng.choice(live) if live else None

    def end_stream(self) -> None:
        """The final access-log entry: the stream is over."""
        st = self._pick(lambda st: True)
        if st is None:
            return
        s = self.slot(st.replica)
        assert s.ctrl is not None
        del self.running[st.aid]
        self._release(s, st.aid, "end")
        self.ended.append((st.replica, st.aid))
        if self.rng.random() < 0.1:
            self._release(s, st.aid, "end again")  # Envoy retried the entry

    def duplicate_end(self) -> None:
        """A late or duplicated final entry for a stream long over."""
        if not self.ended:
            return
        name, aid = self.rng.choice(self.ended)
        s = self.slot(name)
        if s.ctrl is not None:
            self._release(s, aid, "late duplicate")

    def _release(self, s: Slot, aid: str, why: str) -> None:
        assert s.ctrl is not None
        result = s.ctrl.release(aid)
        self.say(f"{s.name} {why} {aid[:8]}: {result.value}")
        if result is ReleaseResult.RELEASED:
            s.released_ok[aid] += 1
            if s.released_ok[aid] > 1:
                self.fail(f"{s.name} answered 'released' {s.released_ok[aid]} times for {aid}")

    def periodic_entries(self) -> None:
        """Envoy's periodic entries name every running stream (with its class and tenant):
        a process that restarted adopts them, or acknowledges the ones it took over."""
        self._next_periodic = self.now() + self.cfg.periodic_every
        for st in list(self.running.values()):
            s = self.slot(st.replica)
            if s.ctrl is not None and not s.starting:
                s.ctrl.renew_or_adopt(st.aid, st.cls, st.tenant)

    def open_channel(self) -> None:
        st = self._pick(lambda st: st.channel is None and not st.first_byte)
        if st is None:
            return
        s = self.slot(st.replica)
        assert s.ctrl is not None
        ch = s.ctrl.open_stop_channel(st.aid)
        if ch is None:
            return
        st.channel = ch
        if ch.done():
            self._stopped(st, "at once")
        else:
            ch.add_done_callback(lambda _f, st=st: self._stopped(st, "stop channel"))

    def _stopped(self, st: Stream, how: str) -> None:
        """The 503 preemption reached the client: the worker's request is reset."""
        if self.running.get(st.aid) is not st or st.channel is None:
            return
        st.channel = None
        del self.running[st.aid]
        self.ended.append((st.replica, st.aid))
        self.spawn(self._final_entry_later(st))  # Envoy logs the 503'd request too
        if self.preempting:
            self.preempting.popleft()
        self.stats["preempted"] += 1
        self.say(f"{st.replica} stopped {st.aid[:8]} ({how})")

    async def _final_entry_later(self, st: Stream) -> None:
        await asyncio.sleep(self.rng.uniform(0.0, 0.05))
        s = self.slot(st.replica)
        if s.ctrl is not None and not s.starting:
            self._release(s, st.aid, "final entry of the stopped")

    def first_byte(self) -> None:
        st = self._pick(lambda st: not st.first_byte)
        if st is None:
            return
        s = self.slot(st.replica)
        assert s.ctrl is not None
        st.first_byte = True
        if st.channel is None or st.channel.done():
            s.ctrl.mark_first_byte(st.aid)
            return
        self.spawn(self._confirm(s, s.ctrl, st))

    async def _confirm(self, s: Slot, ctrl: FleetController, st: Stream) -> None:
        ch = st.channel
        ok = await ctrl.confirm_first_byte(st.aid)
        if s.ctrl is not ctrl or self.running.get(st.aid) is not st:
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

    async def fault(self) -> None:
        kinds = [k for k in self.cfg.faults
                 if (k in SERVER_FAULTS and self.server_fault is None)
                 or (k in REPLICA_FAULTS and self._replica_fault_ok())]
        if not kinds:
            return
        kind = self.rng.choice(kinds)
        self.stats[f"fault_{kind}"] += 1
        if kind in SERVER_FAULTS:
            self.say(f"fault {kind}")
            self.server_fault = kind
            self.spawn(self._server_fault(kind))
        else:
            candidates = [s for s in self.slots if s.fault is None and s.ctrl is not None]
            s = self.rng.choice(candidates)
            self.say(f"fault {kind} of {s.name}")
            s.fault = kind
            self.spawn(self._replica_fault(s, kind))

    def _replica_fault_ok(self) -> bool:
        # One replica at a time, and not while a server fault runs: a replica whose first
        # ever contact falls in a server's return is the documented uncovered case.
        return (all(s.fault is None for s in self.slots) and self.server_fault is None
                and any(s.ctrl is not None for s in self.slots))

    def outage_allowance(self) -> int:
        """The reference's bound after a server outage at this instant, beyond capacity:
        what the replicas hold beyond their shares, Σ max(0, h − s) (the remaining window,
        (b)). Each replica holds at most max(h, L) with L ≤ s, its share (floor(C ÷ N) from
        its newest reply, 0 while a replica registered before it may not count it yet), so
        the bound holds if and only if the shares sum to at most capacity: that is checked
        here, as a promise of its own (finding F1 was shares of 6 + 3 + 2 of 6). Except for
        a replica in a window of its own fault (a partition, slow or dropped replies, a
        restart): its registration may have lapsed, so the others no longer count it, and
        that window already allows its max(h, L) on top."""
        shares = {s.name: s.ctrl.share if s.ctrl is not None else 0 for s in self.slots}
        cut = {w.who for w in self.windows if w.who}
        counted = {n: v for n, v in shares.items() if n not in cut}
        if sum(counted.values()) > self.cfg.capacity:
            self.fail(f"the replicas' degraded shares {counted} sum past capacity "
                      f"{self.cfg.capacity} (all: {shares}, cut off: {sorted(cut)}): an "
                      "outage now reaches beyond the stated bound")
        return sum(max(0, self.held_by(n) - v) for n, v in shares.items())

    def open_window(self, kind: str, allowance: int, who: str = "") -> Window:
        w = Window(kind, allowance, self.now(), who=who)
        self.windows.append(w)
        self.say(f"window {kind} opens, allowance {allowance}")
        return w

    def heal(self, w: Window) -> None:
        w.healed = self.now()
        self.say(f"window {w.kind} healed")

    async def _server_fault(self, kind: str) -> None:
        srv = self.server
        ttl = self.cfg.ttl
        try:
            if kind == "pause":
                w = self.open_window(kind, self.outage_allowance())
                srv.pause()
                await asyncio.sleep(self.rng.uniform(0.05, 1.5 * ttl))
                srv.resume()
                self.heal(w)
            elif kind == "kill":
                w = self.open_window(kind, self.outage_allowance())
                await asyncio.to_thread(srv.kill)
                self._forget_snapshot()
                await asyncio.sleep(self.rng.uniform(0.05, 1.5 * ttl))
                await asyncio.to_thread(srv.start)
                self.heal(w)
            elif kind == "restart_empty":
                w = self.open_window(kind, self.outage_allowance())
                self._forget_snapshot()
                await asyncio.to_thread(srv.restart)
                self.heal(w)
            elif kind == "rdb_restart":
                # The RDB snapshot is taken now; the restart loading it comes later (an
                # older copy of every key, its registrations possibly still live).
                await self._client_cmd(lambda c: c.save())
                await asyncio.sleep(self.rng.uniform(0.0, 1.0 * ttl))
                w = self.open_window(kind, self.outage_allowance())
                await asyncio.to_thread(srv.restart)
                self._forget_snapshot()
                self.heal(w)
            elif kind == "stale_restore":
                await self._take_copy()
                await asyncio.sleep(self.rng.uniform(0.0, 1.0 * ttl))
                # Until a replica that saw a later state calls, the copy may lack the
                # admissions made since it was taken (reference, the generation).
                w = self.open_window(kind, self.outage_allowance() + self._since_copy())
                await restore_keyspace(srv, FLEET, self._drop_copy())
                self.heal(w)
            elif kind == "failover":
                await self._take_copy()  # what the asynchronous replica has
                await asyncio.sleep(self.rng.uniform(0.0, 0.5 * ttl))  # its lag
                w = self.open_window(kind, self.outage_allowance())
                await self._failover(self._drop_copy())
                self.heal(w)
            elif kind == "lose_key":
                w = self.open_window(kind, self.outage_allowance())
                keys = await self._client_cmd(lambda c: c.keys(f"pg:{{{FLEET}}}:*"))
                if keys:
                    key = self.rng.choice(sorted(keys))
                    self.say(f"DEL {key!r}")
                    await self._client_cmd(lambda c: c.delete(key))
                self.heal(w)
        finally:
            # The next server fault only after the fleet had time to come back.
            await asyncio.sleep(self.rng.uniform(0.0, 2 * ttl))
            self.server_fault = None

    async def _client_cmd(self, f: Callable[[redis.Redis], Any]) -> Any:
        c = redis.Redis(port=self.server.port, decode_responses=False, socket_timeout=5)
        try:
            return await f(c)
        finally:
            await c.aclose()

    def _forget_snapshot(self) -> None:
        # A later restart must come back empty unless it is the snapshot fault's own.
        with contextlib.suppress(FileNotFoundError):
            (self.server.workdir / "dump.rdb").unlink()

    async def _take_copy(self) -> None:
        keys = await copy_keyspace(self.server, FLEET)
        # A key deleted between KEYS and its DUMP is not in the copy.
        self.copy = (self.now(), {k: v for k, v in keys.items() if v is not None})
        self.admitted_after_copy = set()

    def _since_copy(self) -> int:
        return sum(1 for a in self.admitted_after_copy if a in self.running)

    def _drop_copy(self) -> dict[bytes, bytes]:
        assert self.copy is not None
        keys = self.copy[1]
        self.copy = None
        self.admitted_after_copy = set()
        return keys

    async def _failover(self, keys: dict[bytes, bytes]) -> None:
        """Promote another server process holding the lagging copy; the proxies switch to
        it (as a service address would) and the old primary goes away."""
        new = ValkeyServer(self.workdir / f"valkey-{self.step}")
        await asyncio.to_thread(new.start)
        if keys:
            await restore_keyspace(new, FLEET, keys)
        old, self.server = self.server, new
        for s in self.slots:
            s.proxy.upstream_port = new.port
            s.proxy.sever()
        await asyncio.to_thread(old.stop)

    async def _replica_fault(self, s: Slot, kind: str) -> None:
        ttl = self.cfg.ttl
        try:
            if kind == "replica_kill":
                # The pod is lost: its Envoy and its streams with it. A new pod with the
                # same name comes later (the ledger still counts the dead streams until
                # the registration lapses or the new process's ack timeout ends them).
                for st in [st for st in self.running.values() if st.replica == s.name]:
                    del self.running[st.aid]
                    self.dead_with_pod.add(st.aid)
                await self._stop_process(s)
                await asyncio.sleep(self.rng.uniform(0.05, 2 * ttl))
                await self._restart(s)
            elif kind == "replica_restart":
                # The sidecar container restarts; Envoy and its streams run on. Down
                # longer than the registration can outlive (0.9 ttl after a heartbeat up
                # to an interval + a call timeout old), its streams are uncounted until
                # Envoy's periodic entries adopt them again (reference §9, sidecar down).
                gap = self.rng.choice((self.rng.uniform(0.02, 0.25 * ttl),
                                       self.rng.uniform(0.25 * ttl, 2 * ttl)))
                long = gap > 0.9 * ttl - (ttl / 3 + self.cfg.call_timeout) - 0.05
                w = self.open_window(kind, self.held_by(s.name) if long else 0, s.name)
                await self._stop_process(s)
                await asyncio.sleep(gap)
                await self._restart(s)
                self.heal(w)
            elif kind in ("partition", "slow_replies", "drop_connections"):
                # Only this replica loses the server: reference §9, partition: capacity
                # plus max(h, L) for as long as it lasts (L ≤ floor(C ÷ N); what it held
                # past that drains after the ledger gave it away).
                share = s.ctrl.share if s.ctrl is not None else 0
                w = self.open_window(kind, max(self.held_by(s.name), share), s.name)
                if kind == "partition":
                    s.proxy.blackhole()
                    await asyncio.sleep(self.rng.uniform(0.1, 3 * ttl))
                    if self.rng.random() < 0.5:
                        s.proxy.sever()  # the connections did not survive it
                elif kind == "slow_replies":
                    s.proxy.delay = self.rng.choice((0.3, 1.0, 2.0)) * self.cfg.call_timeout
                    await asyncio.sleep(self.rng.uniform(0.1, 2 * ttl))
                else:
                    s.proxy.sever()
                s.proxy.heal()
                self.heal(w)
        finally:
            await asyncio.sleep(self.rng.uniform(0.0, ttl))
            s.fault = None

    async def _restart(self, s: Slot) -> None:
        s.proxy.heal()
        s.starting = True
        try:
            await self._start_process(s)
        finally:
            s.starting = False

    # ------------------------------------------------------------------ invariants

    def allowed(self) -> int:
        now = self.now()
        grace = 2 * self.cfg.ttl  # a preemption's stop reaches its owner within this
        while self.preempting and now - self.preempting[0] > grace:
            self.preempting.popleft()
        # A server fault's allowance is computed from what runs when it starts, which
        # already includes an earlier window's excess still draining: the largest holds.
        # A replica's fault adds its own on top of whatever the server's does.
        server = max((w.allowance for w in self.windows if w.kind in SERVER_FAULTS),
                     default=0)
        replica = sum(w.allowance for w in self.windows if w.kind not in SERVER_FAULTS)
        return self.cfg.capacity + server + replica + len(self.preempting)

    def check(self) -> None:
        n = len(self.running)
        if n > self.peak:
            self.peak = n
            self.peak_note = (f"{n} at {self.now() - self.t0:.3f}s, allowed {self.allowed()}: "
                              f"{[(w.kind, w.allowance) for w in self.windows]}, "
                              f"{len(self.preempting)} preempting")
        self._close_windows(n)
        if n > self.allowed():
            self.fail(f"{n} running > {self.allowed()} allowed (capacity "
                      f"{self.cfg.capacity}, open windows "
                      f"{[(w.kind, w.allowance) for w in self.windows]}, pending "
                      f"preemptions {len(self.preempting)})")
        if n > self.cfg.capacity:
            self.stats["steps_over_capacity_in_windows"] += 1
        now = self.now()
        slack = self.waiter_slack()
        for t, (arrived, qt, name) in list(self.waiters.items()):
            if not t.done() and now - arrived > qt + slack + 0.2:
                # (0.2: the answer may be on its way; _answered checks it exactly.)
                self.fail(f"a waiter on {name} still waits after {now - arrived:.3f} s, "
                          f"queue timeout {qt} s")
        for s in self.slots:
            for aid, c in s.recorder.admitted.items():
                if c > 1:
                    self.fail(f"{s.name}'s metrics counted {aid} admitted {c} times")
            for aid, c in s.recorder.released.items():
                if c > 1:
                    self.fail(f"{s.name}'s metrics counted {aid} released {c} times")

    def _close_windows(self, n: int) -> None:
        if not self.windows:
            return
        all_ok = all(s.ctrl is not None and s.ctrl.state == "ok" for s in self.slots)
        if not all_ok or n > self.cfg.capacity:
            return
        # A replica notices a fault at its next call: one heartbeat interval later at
        # most, plus that call's timeout. Until then "all ok" means nothing yet.
        notice = self.cfg.ttl / 3 + 2 * self.cfg.call_timeout
        now = self.now()
        for w in [w for w in self.windows
                  if w.healed is not None and now - w.healed > notice]:
            self.windows.remove(w)
            self.say(f"window {w.kind} closed")

    # ------------------------------------------------------------------ the end

    async def finish(self) -> None:
        """Faults stop, every stream ends, the fleet settles: nothing left anywhere."""
        deadline = self.now() + 15 * self.cfg.ttl + self.cfg.ack_timeout
        while self.server_fault is not None or any(s.fault for s in self.slots):
            if self.now() > deadline:
                self.fail("faults did not end")
                return
            await asyncio.sleep(0.05)
        for t in [t for s in self.slots for t in s.clients]:
            t.cancel()
        while any(s.clients for s in self.slots):
            await asyncio.sleep(0.01)
            if self.now() > deadline:
                self.fail("clients did not end")
                return
        # Envoy's last periodic entries, then every final entry.
        self.periodic_entries()
        await asyncio.sleep(0.05)
        for st in list(self.running.values()):
            s = self.slot(st.replica)
            if s.ctrl is not None:
                del self.running[st.aid]
                self._release(s, st.aid, "final")
        observer = FleetLedger(redis.Redis(port=self.server.port, decode_responses=True),
                               FLEET, "observer")
        try:
            last = ""
            while True:
                held = {s.name: len(s.ctrl.held) for s in self.slots if s.ctrl is not None}
                states = {s.name: s.ctrl.state for s in self.slots if s.ctrl is not None}
                try:
                    snap = await observer.snapshot()
                    inflight = snap.total_inflight
                except Exception as exc:
                    inflight = -1
                    last = repr(exc)
                settled = (inflight == 0 and not any(held.values())
                           and all(v == "ok" for v in states.values()))
                if settled:
                    break
                if self.now() > deadline:
                    ids = [a for s in self.slots if s.ctrl is not None for a in s.ctrl.held]
                    self.fail(f"never settled: ledger in flight {inflight}, held {held} "
                              f"{ids[:5]}, states {states} {last}")
                    return
                await asyncio.sleep(0.05)
        finally:
            await observer.client.aclose()
        # Each process that is still up released everything its metrics admitted (one that
        # died had no chance to: the ledger's reaping or its successor took over).
        for s in self.slots:
            rec = s.recorder
            unreleased = [a for a in rec.admitted if a not in rec.released]
            if s.ctrl is not None and unreleased:
                self.fail(f"{s.name}'s metrics admitted but never released: {unreleased[:5]} "
                          f"({len(unreleased)})")
        admitted = {a for s in self.slots for rec in s.recorders for a in rec.admitted}
        never = [a for s in self.slots for rec in s.recorders for a in rec.released
                 if a not in admitted]
        if never:
            self.fail(f"released but never admitted: {never[:5]}")
        self.stats["peak"] = self.peak


async def simulate(cfg: SimConfig, workdir: Path) -> Sim:
    sim = Sim(cfg, workdir)
    try:
        await sim.start()
        await sim.run()
    finally:
        await sim.aclose()
    return sim


async def outage_after_growth(workdir: Path) -> int:
    """Three replicas start one after the other and every path to the server hangs before
    the first one's next heartbeat: how many each admits on its own, in total."""
    sim = Sim(SimConfig(seed=0, steps=0, faults=()), workdir)
    await sim.start()
    admitted = 0
    try:
        for s in sim.slots:
            s.proxy.blackhole()  # the server hangs, as every replica sees it
        for s in sim.slots:
            assert s.ctrl is not None
            for _ in range(sim.cfg.capacity):
                try:
                    await asyncio.wait_for(s.ctrl.admit(DEF, "t0"),
                                           0.05 + 2 * sim.cfg.call_timeout)
                except (Denied, TimeoutError):
                    break
                admitted += 1
    finally:
        for s in sim.slots:
            s.proxy.heal()
        await sim.aclose()
    return admitted


async def shares_after_growth(workdir: Path) -> dict[str, Any]:
    """Three replicas start one after the other: each one's degraded share as it starts
    (the first has the fleet to itself; the later ones none until the earlier ones have
    read a reply that counts them), and the seconds until every share is floor(C ÷ 3)."""
    sim = Sim(SimConfig(seed=0, steps=0, faults=()), workdir)
    await sim.start()
    try:
        first = [s.ctrl.share if s.ctrl is not None else -1 for s in sim.slots]
        t0 = sim.now()
        want = sim.cfg.capacity // sim.cfg.replicas
        while not all(s.ctrl is not None and s.ctrl.share == want for s in sim.slots):
            if sim.now() - t0 > 5 * sim.cfg.ttl:
                break
            await asyncio.sleep(0.01)
        return {"first": first, "after": [s.ctrl.share if s.ctrl is not None else -1
                                          for s in sim.slots],
                "secs": sim.now() - t0}
    finally:
        await sim.aclose()


async def partition_past_share(workdir: Path) -> int:
    """r0 legally holds 4 of 6 (its share is 2) when only its path to the server is cut;
    its registration lapses and r1 takes the slots the ledger freed while r0's streams run
    on: how many run at once."""
    sim = Sim(SimConfig(seed=0, steps=0, faults=()), workdir)
    await sim.start()
    try:
        r0, r1, _ = sim.slots
        assert r0.ctrl is not None and r1.ctrl is not None
        deadline = sim.now() + 3.0
        while not all(getattr(s.ctrl, "live_replicas", 3) == 3 for s in sim.slots):
            assert sim.now() < deadline, "views never reached N = 3"
            await asyncio.sleep(0.02)
        for _ in range(4):
            await r0.ctrl.admit(DEF, "t0")
        r0.proxy.blackhole()
        await asyncio.sleep(1.5 * sim.cfg.ttl)  # its registration lapses (0.9 ttl)
        others = 0
        for _ in range(sim.cfg.capacity):
            try:
                await asyncio.wait_for(r1.ctrl.admit(DEF, "t0"), 0.5)
            except (Denied, TimeoutError):
                break
            others += 1
        return 4 + others
    finally:
        for s in sim.slots:
            s.proxy.heal()
        await sim.aclose()


SCENARIOS: dict[str, Callable[[Path], Any]] = {
             "outage_after_growth": outage_after_growth,
             "shares_after_growth": shares_after_growth,
             "partition_past_share": partition_past_share}

if __name__ == "__main__":
    # The tests run the simulation and the scenarios whose replicas are cut off in a child
    # interpreter: one that ran them trips CPython 3.11's AST recursion check when pytest
    # later renders a traceback (an INTERNALERROR instead of the violation's message).
    #   python -m tests.fleet_sim run DIR SEED STEPS BUDGET|none all|none
    #   python -m tests.fleet_sim SCENARIO DIR
    # Prints one RESULT line (JSON), or VIOLATION and the message (exit 1).
    import json
    import sys
    import tempfile

    workdir = Path(tempfile.mkdtemp(dir=sys.argv[2]))
    if sys.argv[1] == "run":
        cfg = SimConfig(seed=int(sys.argv[3]), steps=int(sys.argv[4]),
                        time_budget=None if sys.argv[5] == "none" else float(sys.argv[5]),
                        faults=ALL_FAULTS if sys.argv[6] == "all" else ())
        try:
            done = asyncio.run(simulate(cfg, workdir))
        except SimViolation as exc:
            print("VIOLATION " + json.dumps(str(exc)), flush=True)
            sys.exit(1)
        print("RESULT " + json.dumps({"stats": dict(done.stats), "peak": done.peak,
                                      "peak_note": done.peak_note,
                                      "windows": len(done.windows)}), flush=True)
    else:
        print("RESULT " + json.dumps(asyncio.run(SCENARIOS[sys.argv[1]](workdir))),
              flush=True)
