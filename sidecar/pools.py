"""Pools: the unit of admission. Every request goes through one.

A pool is a set of workers with a capacity of its own (several models behind one
gateway), and everything admission does is done once per pool: its class queues,
reservations, starvation aging, preemption (only ever within the pool), tenant
limits, leases, the legacy fallback, capacity readings, the fleet ledger
(``--coordination-url``), edge shedding and shadow mode. A sidecar without named pools
has exactly one, :data:`DEFAULT_POOL`; ``--worker-urls POOL=URL`` adds named ones.

:class:`Pool` is one pool: its capacity monitor and reading, its admission service (an
in-process :class:`~sidecar.admission.AdmissionController` over its own core, or a
:class:`~sidecar.coordination.controller.FleetController` over its own ledger), its
shadow and edge switch when those are on, its class table in force and its metrics.
:class:`Pools` holds them all and routes by admission id.

Routing. Envoy's route names the pool (ext_authz per-route ``context_extensions``, key
:data:`POOL_KEY`); a route that names none belongs to the default pool, and a sidecar
with only the default pool takes every route (so the Envoy side of a pools roll-out can
land before the sidecar's: :meth:`Pools.for_route`). Every later message about an
admission (access-log entries, ext_proc, liveness) carries only its id, so the id carries
the pool: ``<pool>.<32 hex>`` for a named pool, the plain 32 hex digits for the default
pool. An id naming no pool here (a pool removed across a restart) is unknown.

With ``--coordination-url`` each pool's ledger is its own in the fleet
(``pg:{fleet}:pool:<pool>``; the default pool keeps the fleet's ``pg:{fleet}``):
docs/design.md, "Pools in a fleet".
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterator, Mapping
from typing import TYPE_CHECKING

from sidecar import logs
from sidecar.admission import AdmissionController, AdmissionService, new_admission_id
from sidecar.capacity import CapacityReading
from sidecar.classes import PriorityClass
from sidecar.codec import POOL_KEY, LogEntry
from sidecar.config import DEFAULT_POOL
from sidecar.coordination import server
from sidecar.deadlines import Deadlines
from sidecar.edge import ShedController
from sidecar.health import CapacityMonitor
from sidecar.limiter import INTERVAL, AdaptiveLimit
from sidecar.metrics import PoolRecorder, Recorder
from sidecar.priority_yaml import PriorityConfig, unreserved_preemptors
from sidecar.scheduler import (
    Admitted,
    ClassSettings,
    ReleaseReason,
    ReleaseResult,
    preemptible_classes,
    without_preemption,
)
from sidecar.shadow import ShadowCore
from sidecar.tokens import (
    Allowed,
    Budget,
    OverBudget,
    Remaining,
    RequestFacts,
    Reservation,
    Stage,
    TokenBook,
    TokenSettings,
    estimate,
    settle_amount,
)

if TYPE_CHECKING:
    from sidecar.coordination.controller import FleetController

SEPARATOR = "."  # never in a pool name nor in the hex part of an id

# Engines that cannot stop a request whose client went away while they are busy:
# llama.cpp's server notices a closed connection only after one second without a result
# of *any* task, which another stream, a /metrics or /slots request never lets pass. A
# preempted victim runs to its end there, so preempting frees no slot: the preemptor
# would wait in the engine's own queue while the engine runs one more than its capacity
# (docs/reference.md, Engines). While a worker counted runs one, the pool's classes do not
# preempt.
CANNOT_CANCEL_ENGINES = frozenset({"llamacpp"})

__all__ = [
    "CANNOT_CANCEL_ENGINES",
    "DEFAULT_POOL",
    "POOL_KEY",
    "BudgetDenied",
    "ContextDenied",
    "Pool",
    "Pools",
    "id_factory",
    "pool_of",
    "uncancellable_workers",
]

log = logs.get("sidecar.pools")

# Token accounting (sidecar.tokens): how often a pool looks for reservations whose
# admission ended without a final access-log entry (an Envoy that died, a lease that ran
# out). One found is marked; still without an entry at the next look, its estimate is
# charged as used. So such a reservation holds its tenant's tokens 1 to 2 intervals.
TOKEN_SWEEP_SECS = 5.0
# Ids charged at their estimate, remembered so that a final entry arriving after all is
# counted (settle_late) rather than unknown.
CHARGED_MEMORY = 4096
# With --coordination-url: how long a settle or cancel waits for the ledger, and how often
# one it did not take is sent again (1 s apart) before it is left to the replica's reaping.
# (A Check waits for its reservation at most the controller's call timeout.)
LEDGER_TOKEN_TIMEOUT = 1.0
LEDGER_TOKEN_RETRIES = 60


class BudgetDenied(Exception):
    """The request does not fit its tenant's token budget (sidecar.tokens.OverBudget)."""

    def __init__(self, verdict: OverBudget) -> None:
        super().__init__(verdict.window)
        self.verdict = verdict


class ContextDenied(Exception):
    """The request can never fit: its input estimate fits no worker slot's context
    (refuse_past_context, ``limit="slot"``), or its whole estimate exceeds the pool's KV
    capacity (admit_by_kv, ``limit="kv"``)."""

    def __init__(self, tokens: int, context: int, limit: str = "slot") -> None:
        super().__init__(f"{tokens} > {context}")
        self.tokens, self.context, self.limit = tokens, context, limit


def id_factory(pool: str) -> Callable[[], str]:
    """New admission ids that name ``pool`` (the default pool's are plain)."""
    if pool == DEFAULT_POOL:
        return new_admission_id
    prefix = pool + SEPARATOR
    return lambda: prefix + new_admission_id()


def pool_of(aid: str) -> str:
    name, sep, _ = aid.partition(SEPARATOR)
    return name if sep else DEFAULT_POOL


def uncancellable_workers(reading: CapacityReading) -> tuple[str, ...]:
    """The workers counted in ``reading`` whose engine cannot cancel a running request."""
    return tuple(sorted(w.url for w in reading.workers if w.engine in CANNOT_CANCEL_ENGINES))


class Pool:
    """One pool, complete from construction: its workers' capacity, its admission, and what
    follows from both (the class table in force, preemption suspended or not)."""

    def __init__(self, name: str, *, controller: AdmissionService, monitor: CapacityMonitor,
                 reading: CapacityReading, config: PriorityConfig, metrics: PoolRecorder,
                 labelled: bool, fleet: FleetController | None = None,
                 shadow: ShadowCore | None = None,
                 on_classes_changed: Callable[[], None] = lambda: None,
                 wall: Callable[[], float] = time.time,
                 limiter: AdaptiveLimit | None = None) -> None:
        self.name = name
        self.controller = controller
        self.monitor = monitor
        self.reading = reading
        self.metrics = metrics
        self.fleet = fleet
        self.shadow = shadow
        # Where the sidecar has named pools, every line about a pool names it.
        self.log = log.bind(pool=name) if labelled else log
        self.log_fields: dict[str, str] = {"pool": name} if labelled else {}
        # --edge-shed: this pool's switch, fed by its Checks (None: off, or legacy admission,
        # which answers admission_queue_full, a code the edge route never sends).
        self.edge: ShedController | None = None
        self._config = config
        self._on_classes_changed = on_classes_changed
        # Time-to-first-token targets (sidecar.deadlines). A fleet's ledger predicts no
        # waits: its pools measure, never budget.
        self.deadlines = Deadlines({} if fleet is not None else config.classes_for(name),
                                   config.deadline_mode)
        if fleet is not None and any(k.ttft_target_ms is not None
                                     for k in config.classes_for(name).values()):
            self.log.warning("ttft_targets_not_enforced_in_a_fleet",
                             reason="the fleet's ledger predicts no waits: targets are "
                                    "measured (smg_sidecar_ttft_seconds), never applied")
        # --adaptive-capacity: the pool's capacity tunes itself below its workers' (legacy
        # admission does not follow capacity: nothing to tune).
        self.limiter = None if controller.legacy else limiter
        if self.limiter is not None:
            self.limiter.set_ceiling(reading.capacity)
            controller.set_capacity(self.capacity)
            metrics.adaptive_limit(self.limiter.limit, "start", False)
        self.uncancellable = uncancellable_workers(reading)
        if self.uncancellable:
            self._preemption_suspended()
            controller.update_config(self.classes)  # built with the file's table
        metrics.preemption_suspended(bool(self.uncancellable))
        metrics.capacity_read(reading)
        if fleet is not None:
            # The fleet-id collision check compares what each replica's pool counts.
            fleet.ledger.identity = server.capacity_source(reading)
        else:
            # The saturation guard compares the engines' own counts with what this pool
            # holds (a fleet's ledger holds other replicas' admissions too: not compared).
            monitor.policy.held = lambda: self.controller.snapshot().inflight
        # From here on a new capacity reading also resizes admission.
        monitor.on_change = self.on_capacity
        # Token accounting (sidecar.tokens): None while the file sets no `tokens:` and no
        # budget. Budgets are on the wall clock (calendar windows).
        self._wall = wall
        self.tokens: TokenSettings | None = None
        self.book = TokenBook({})
        self._budget_verdicts: OrderedDict[str, OverBudget] = OrderedDict()  # --shadow
        self._charged: OrderedDict[str, None] = OrderedDict()
        self._sweep: asyncio.TimerHandle | None = None
        self._budgets: Mapping[str, tuple[Budget, ...]] = {}
        self._ledger_tasks: set[asyncio.Task[None]] = set()
        # tokens.admit_by_kv: the KV capacity admission is gated by (None: not gated), and
        # the state last said in the log.
        self.kv_capacity: int | None = None
        self._kv_said: tuple[str, int | None] = ("off", None)
        self._configure_tokens(config)
        metrics.tokens_started(self._remaining)

    @property
    def legacy(self) -> bool:
        return self.controller.legacy

    @property
    def capacity(self) -> int:
        """What admission counts: the workers' capacity, or the tuned limit below it."""
        cap = self.reading.capacity
        return cap if self.limiter is None else min(cap, self.limiter.limit)

    @property
    def classes(self) -> Mapping[PriorityClass, ClassSettings]:
        """The file's class table for this pool, without preemption while it is suspended."""
        classes = self._config.classes_for(self.name)
        return without_preemption(classes) if self.uncancellable else classes

    def preemptible(self) -> frozenset[PriorityClass]:
        """The classes whose requests can be preempted here (legacy admission: none)."""
        return frozenset() if self.legacy else preemptible_classes(self.classes)

    async def admit(self, cls: PriorityClass, tenant: str,
                    facts: RequestFacts | None = None) -> Admitted:
        """A Check of this pool's route: admitted, queued (awaited) or ``Denied``, within
        the wait budget its class's target leaves (sidecar.deadlines).

        With token accounting, ``facts`` (the request's size) is estimated and reserved
        against the tenant's budgets first: ``BudgetDenied`` when it does not fit (before
        it takes a place in a queue). The reservation is given back if the request is not
        admitted after all, and bound to its admission id if it is.
        """
        over_kv = False
        if facts is not None:
            self._check_context(cls, facts)
            over_kv = self._check_kv(cls, facts)
        if facts is None:
            reservation, shadowed = None, None
        elif self.fleet is not None:
            reservation, shadowed = await self._reserve_in_ledger(cls, tenant, facts)
        else:
            reservation, shadowed = self._reserve(cls, tenant, facts)
        try:
            # fair_queuing: tokens serves a class's tenants by these tokens, and
            # admit_by_kv holds them against the KV capacity (under --shadow, one that
            # enforcement would have refused holds none in the shadow).
            cost = 1.0 if reservation is None else float(reservation.estimate.total)
            admitted = await self.controller.admit(
                cls, tenant, wait_budget=self.deadlines.budget(cls),
                enforce=self.deadlines.enforce, cost=0.0 if over_kv else cost)
        except BaseException:
            if reservation is not None:
                self.book.cancel(reservation)
                self._ledger_cancel(reservation)
            raise
        if reservation is not None:
            aid = admitted.admission.id
            self.book.bind(reservation, aid)
            self.metrics.tokens_reserved(cls, reservation.estimate.total)
            if shadowed is not None:
                self._remember_verdict(aid, shadowed)
            self._arm_sweep()
        return admitted

    # ------------------------------------------------------------------ tokens

    def _configure_tokens(self, cfg: PriorityConfig) -> None:
        self.tokens = cfg.tokens_for(self.name)
        self._budgets = cfg.budgets if self.tokens is not None else {}
        # In a fleet the ledger keeps the budgets; the book here only follows each
        # reservation's stages (settle, cancel, the sweep).
        self.book.configure(self._budgets if self.fleet is None else {},
                            self.tokens or TokenSettings())
        if self.fleet is not None and any(c.fair_cost == "tokens"
                                          for c in cfg.classes_for(self.name).values()):
            self.log.warning("token_fairness_per_request_in_a_fleet",
                             reason="the fleet ledger's fair queuing counts requests: "
                                    "fair_queuing: tokens serves tenants by requests "
                                    "with --coordination-url")
        self._apply_kv()

    def _apply_kv(self) -> None:
        """``admit_by_kv``: gate admission by the KV capacity the counted workers report
        (the sum of those that report one), or say why nothing is gated. Follows every
        capacity reading and reload."""
        settings = self.tokens
        on = settings is not None and settings.admit_by_kv
        cap = self.reading.kv_tokens if on else None
        why = ""
        if on and self.legacy:
            cap, why = None, "legacy admission serves this pool: it does not gate by tokens"
        elif on and cap is None:
            why = ("the capacity is overridden (--worker-capacity-override): no worker is read"
                   if self.reading.source == "override" else
                   "no counted worker reports a KV capacity in tokens (an engine that does "
                   "not, a value that is not a size, or no worker counted)")
        self.kv_capacity = cap
        if isinstance(self.controller, AdmissionController):  # a fleet refuses the option
            self.controller.set_kv_capacity(cap)
        state = "off" if not on else "gated" if cap is not None else "ungated"
        self.metrics.kv_admission(state)
        if (state, cap) == self._kv_said:
            return
        self._kv_said = (state, cap)
        if state == "ungated":
            self.log.warning("kv_admission_ungated", reason=why,
                             effect="requests are admitted by slots alone",
                             workers=self.reading.healthy)
        elif state == "gated":
            self.log.info("kv_admission_gated", kv_tokens=cap,
                          unreported_workers=self.reading.kv_unreported,
                          workers=self.reading.healthy)
        else:
            self.log.info("kv_admission_off")

    def _check_kv(self, cls: PriorityClass, facts: RequestFacts) -> bool:
        """``admit_by_kv``: a request whose whole estimate exceeds the pool's KV capacity
        would wait for ever (nothing frees more than all of it): ``ContextDenied`` instead.
        --shadow counts it and refuses nothing (True: enforcement would have)."""
        settings, cap = self.tokens, self.kv_capacity
        if settings is None or cap is None:
            return False
        tokens = estimate(facts, settings).total
        if tokens <= cap:
            return False
        enforce = self.shadow is None
        self.metrics.kv_refused(cls, enforce)
        if enforce:
            raise ContextDenied(tokens, cap, limit="kv")
        return True

    def _check_context(self, cls: PriorityClass, facts: RequestFacts) -> None:
        """``refuse_past_context``: a request whose input estimate exceeds the most any
        worker slot holds would fail at the engine after taking a slot (and a budget's
        tokens): ``ContextDenied`` instead. Only where every worker reports its context;
        --shadow counts it and refuses nothing."""
        settings = self.tokens
        if settings is None or not settings.refuse_past_context:
            return
        context = self.reading.slot_context
        if context is None:
            return
        tokens = estimate(facts, settings).input
        if tokens <= context:
            return
        enforce = self.shadow is None
        self.metrics.token_context_refused(cls, enforce)
        if enforce:
            raise ContextDenied(tokens, context)

    def _reserve(self, cls: PriorityClass, tenant: str, facts: RequestFacts
                 ) -> tuple[Reservation | None, OverBudget | None]:
        """The request's reservation (None: token accounting is off), and under --shadow
        the refusal enforcement would have answered."""
        settings = self.tokens
        if settings is None:
            return None, None
        est = estimate(facts, settings)
        for why in est.fallbacks:
            self.metrics.token_fallback(why)
        # --shadow refuses nothing; budget_mode: shadow counts what it would refuse.
        enforce = settings.budget_mode == "enforce" and self.shadow is None
        verdict = self.book.reserve(tenant, est, cls.label, self._wall(), enforce=enforce)
        if isinstance(verdict, Allowed):
            return verdict.reservation, None
        self.metrics.token_budget_refused(cls, verdict.window, enforce)
        if verdict.reservation is None:
            raise BudgetDenied(verdict)
        return verdict.reservation, verdict if self.shadow is not None else None

    async def _reserve_in_ledger(self, cls: PriorityClass, tenant: str, facts: RequestFacts
                                 ) -> tuple[Reservation | None, OverBudget | None]:
        """The Check's reservation in the fleet's ledger (one call, only for a tenant with
        budgets), the book here following its stages."""
        settings, fleet = self.tokens, self.fleet
        if settings is None or fleet is None:
            return None, None
        est = estimate(facts, settings)
        for why in est.fallbacks:
            self.metrics.token_fallback(why)
        local = self.book.reserve(tenant, est, cls.label, self._wall())
        assert isinstance(local, Allowed)  # no budgets here: the ledger decides
        r = local.reservation
        budgets = self._budgets.get(tenant, ())
        if not budgets:
            return r, None
        enforce = settings.budget_mode == "enforce" and self.shadow is None
        if fleet.core.local:  # away from the ledger: admission does not wait for it
            self.metrics.token_fallback("ledger_unavailable")
            return r, None
        r.ledger_id = secrets.token_hex(16)
        try:
            verdict = await asyncio.wait_for(fleet.ledger.tok_reserve(
                r.ledger_id, tenant, est.total, budgets, enforce=enforce,
                reserve=settings.accounting == "reserve"), fleet.call_timeout)
        except asyncio.CancelledError:
            self.book.cancel(r)
            self._ledger_cancel(r)  # it may have been taken before the client left
            raise
        except Exception as exc:  # unreachable, slow, refused: admitted unreserved
            self.log.debug("token_ledger_unavailable", error=str(exc)[:200])
            self.metrics.token_fallback("ledger_unavailable")
            # The call may have run all the same (its reply lost): give it back. A cancel
            # that overtakes it makes the ledger refuse it if it comes later.
            self._ledger_cancel(r)
            r.ledger_id = ""
            return r, None
        if verdict is None:
            return r, None
        self.metrics.token_budget_refused(cls, verdict.window, enforce)
        if enforce:
            self.book.cancel(r)
            raise BudgetDenied(verdict)
        return r, verdict if self.shadow is not None else None

    def _ledger_send(self, what: str, make: Callable[[], Awaitable[object]]) -> None:
        """Send a settle or cancel to the ledger in the background, again every second
        while it fails (the ledger charges a reaped replica's reservations anyway)."""
        async def send() -> None:
            for _ in range(LEDGER_TOKEN_RETRIES):
                try:
                    await asyncio.wait_for(make(), LEDGER_TOKEN_TIMEOUT)
                    return
                except Exception as exc:
                    self.log.debug("token_ledger_retry", op=what, error=str(exc)[:200])
                await asyncio.sleep(1.0)
        task = asyncio.get_running_loop().create_task(send())
        self._ledger_tasks.add(task)
        task.add_done_callback(self._ledger_tasks.discard)

    def _ledger_cancel(self, r: Reservation) -> None:
        if self.fleet is not None and r.ledger_id:
            ledger, lid = self.fleet.ledger, r.ledger_id
            self._ledger_send("tok_cancel", lambda: ledger.tok_cancel(lid))

    def _ledger_settle(self, r: Reservation, used: int) -> None:
        if self.fleet is not None and r.ledger_id:
            ledger, lid = self.fleet.ledger, r.ledger_id
            budgets = self._budgets.get(r.tenant, ())
            self._ledger_send("tok_settle", lambda: ledger.tok_settle(lid, used, budgets))

    def _remaining(self) -> Iterator[Remaining]:
        """Each budgeted tenant's windows: the book's, or in a fleet what the ledger
        answered this replica's last accepted Check of the tenant."""
        if self.fleet is None:
            yield from self.book.remaining(self._wall())
            return
        for tenant, (reserved, used) in self.fleet.ledger.token_views.items():
            for b in self._budgets.get(tenant, ()):
                yield Remaining(tenant, b.window.name, b.tokens, used.get(b.window.name, 0),
                                reserved)

    def _remember_verdict(self, aid: str, verdict: OverBudget) -> None:
        self._budget_verdicts[aid] = verdict
        while len(self._budget_verdicts) > CHARGED_MEMORY:
            self._budget_verdicts.popitem(last=False)

    def take_budget_verdict(self, aid: str) -> OverBudget | None:
        """--shadow: the budget refusal enforcement would have answered ``aid``'s Check."""
        return self._budget_verdicts.pop(aid, None)

    def settle(self, entry: LogEntry) -> None:
        """A final access-log entry: the request's tokens replace its reservation (whether
        or not the entry released its slot: a preempted request's comes after)."""
        settings = self.tokens
        aid = entry.admission_id
        r = self.book.reservation(aid)
        if r is None:
            if aid in self._charged:  # charged at its estimate already: nothing changes
                del self._charged[aid]
                self.metrics.token_fallback("settle_late")
            return
        used, why = settle_amount(entry.usage, r.estimate, settings or TokenSettings())
        self.book.settle(aid, used, self._wall())
        self._ledger_settle(r, used)
        cls = PriorityClass.from_name(r.cls) or PriorityClass.DEFAULT
        if why is not None:
            self.metrics.token_fallback(why)
        self.metrics.tokens_settled(cls, used, r.estimate.total if why is None else None)

    def _arm_sweep(self) -> None:
        if self._sweep is None:
            self._sweep = asyncio.get_running_loop().call_later(TOKEN_SWEEP_SECS,
                                                                self.sweep_tokens)

    def sweep_tokens(self) -> None:
        """Reservations whose admission this pool no longer holds and whose final entry
        has not come: marked ENDED, then charged at their estimate a sweep later."""
        self._sweep = None
        now = self._wall()
        for aid, stage in self.book.open_ids():
            if self.controller.holds(aid):
                continue
            if stage is Stage.HELD:
                self.book.ended(aid)
            elif (r := self.book.charge(aid, now)) is not None:
                self._ledger_settle(r, r.estimate.total)
                self.metrics.token_fallback("charged_estimate")
                cls = PriorityClass.from_name(r.cls) or PriorityClass.DEFAULT
                self.metrics.tokens_settled(cls, r.estimate.total, None)
                self._charged[aid] = None
                while len(self._charged) > CHARGED_MEMORY:
                    self._charged.popitem(last=False)
        if self.book.open_ids():
            self._arm_sweep()

    def predicted_wait(self, cls: PriorityClass) -> float | None:
        """The wait an arrival of ``cls`` would have now (None: no estimate)."""
        return self.controller.predicted_wait(cls)

    def completed(self, entry: LogEntry) -> None:
        """A request of this pool ended (its final access-log entry): what it took."""
        cls = PriorityClass.from_name(entry.cls)
        if cls is None:
            return
        if entry.engine_ttfb_secs is not None:
            self.deadlines.observed(cls, entry.engine_ttfb_secs)
            if self.limiter is not None and entry.engine_secs is not None:
                self.limiter.sample(entry.engine_ttfb_secs, entry.engine_secs)
        self.metrics.completed(cls, entry.ttft_secs, entry.engine_ttfb_secs)

    def on_capacity(self, reading: CapacityReading) -> None:
        """A changed reading from this pool's workers: resizes this pool only."""
        self.reading = reading
        self.metrics.capacity_read(reading)
        if self.fleet is not None:  # published with the next heartbeat (watch_fleet)
            self.fleet.ledger.identity = server.capacity_source(reading)
        was, self.uncancellable = self.uncancellable, uncancellable_workers(reading)
        if bool(self.uncancellable) != bool(was):
            if self.uncancellable:
                self._preemption_suspended()
            else:
                self.log.info("preemption_resumed",
                              reason="no counted worker runs an engine that cannot cancel a "
                                     "running request")
            self.controller.update_config(self.classes)
            self.metrics.preemption_suspended(bool(self.uncancellable))
            self._on_classes_changed()
        if self.limiter is not None:
            t = self.limiter.set_ceiling(reading.capacity)
            self.metrics.adaptive_limit(t.limit, t.reason, t.changed)
        self.controller.set_capacity(self.capacity)
        self._apply_kv()

    async def tune(self) -> None:
        """--adaptive-capacity: one tuning step every interval (sidecar.limiter), with the
        most requests in flight during it (looked at ten times per interval)."""
        limiter = self.limiter
        if limiter is None:
            return
        while True:
            peak, used = 0, False
            for _ in range(10):
                await asyncio.sleep(INTERVAL / 10)
                snap = self.controller.snapshot()
                peak = max(peak, snap.inflight)
                used = used or snap.inflight >= limiter.limit or any(
                    c.queue_depth for c in snap.classes.values())
            t = limiter.tick(used=used, inflight=peak)
            self.metrics.adaptive_limit(t.limit, t.reason, t.changed)
            if t.changed:
                self.log.info("adaptive_limit_changed", limit=t.limit, reason=t.reason.value,
                              workers_capacity=self.reading.capacity, samples=t.samples,
                              engine_queued=None if t.queued is None else round(t.queued, 2))
                self.controller.set_capacity(self.capacity)

    def apply_config(self, cfg: PriorityConfig) -> None:
        """A valid new config: new class knobs for new decisions (queued requests keep
        their place; in-flight ones are untouched; reservations follow the live capacity)."""
        self._config = cfg
        self.controller.update_config(self.classes)
        self._configure_tokens(cfg)
        if self.uncancellable:
            self._warn_unreserved_preemptors()
        if self.fleet is None:
            self.deadlines.configure(cfg.classes_for(self.name), cfg.deadline_mode)
        if self.legacy:
            self.log.warning("config_reload_legacy_mode",
                             hint="class knobs apply only to the scheduler; tenant ceilings "
                                  "apply")

    def _preemption_suspended(self) -> None:
        r = self.reading
        self.log.warning("preemption_suspended", workers=list(self.uncancellable),
                         engines=sorted({w.engine for w in r.workers
                                         if w.engine in CANNOT_CANCEL_ENGINES}),
                         reason="the engine runs a preempted request to its end, so "
                                "preempting frees no slot; higher classes wait at the head "
                                "of their queue instead")
        self._warn_unreserved_preemptors()

    def _warn_unreserved_preemptors(self) -> None:
        """While preemption is suspended, a class that would preempt but reserves no slot
        at this capacity waits for a running request to end: said, with the fix."""
        unreserved = unreserved_preemptors(self._config.classes_for(self.name),
                                           self.reading.capacity)
        if unreserved:
            self.log.warning("preempting_class_without_reservation",
                             classes=[c.label for c in unreserved],
                             capacity=self.reading.capacity,
                             reason="preemption is suspended on these workers, so a request "
                                    "of these classes waits for a running request to finish",
                             hint="give each a reserved_floor of at least 1 in priority.yaml "
                                  "(docs/operations.md, Preemption on llama.cpp)")


class Pools:
    """Every pool, and what is keyed by an admission id, routed to the pool it names.

    The access log, ext_proc and Envoy liveness call these with an id alone; each call
    goes to the pool the id names (:func:`pool_of`). An id naming no pool here is unknown:
    counted as an unmatched completion, never renewed or adopted.
    """

    def __init__(self, pools: Mapping[str, Pool], metrics: Recorder) -> None:
        if DEFAULT_POOL not in pools:
            raise ValueError("the default pool is missing")
        self._pools = dict(pools)
        self._metrics = metrics

    def __getitem__(self, name: str) -> Pool:
        return self._pools[name]

    def __iter__(self) -> Iterator[Pool]:
        return iter(self._pools.values())

    def __len__(self) -> int:
        return len(self._pools)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._pools)

    def for_route(self, name: str) -> Pool | None:
        """The pool a Check's route names (``""``: none named, the default pool's). With
        the default pool alone every route is its own; else None for a pool not here."""
        if len(self._pools) == 1:
            return self._pools[DEFAULT_POOL]
        return self._pools.get(name or DEFAULT_POOL)

    def of(self, aid: str) -> Pool | None:
        """The pool an admission id names (None: no such pool here).

        Adoption's bound is that pool's capacity against that pool's leases (the sum over
        pools would let made-up ids naming a small pool fill it many times over).
        """
        return self._pools.get(pool_of(aid))

    def preemptible(self) -> frozenset[PriorityClass]:
        """One allow format for all pools: a class preemptible in any pool opens a stream."""
        out: frozenset[PriorityClass] = frozenset()
        for p in self._pools.values():
            out |= p.preemptible()
        return out

    # ---------------------------------------------------------------- keyed by id

    @property
    def lease_count(self) -> int:
        return sum(p.controller.lease_count for p in self._pools.values())

    def release(self, aid: str,
                reason: ReleaseReason = ReleaseReason.COMPLETED) -> ReleaseResult:
        p = self.of(aid)
        result = ReleaseResult.UNKNOWN if p is None else p.controller.release(aid, reason)
        if result is not ReleaseResult.RELEASED:
            self._metrics.completion_unmatched(result.value)
        return result

    def renew_or_adopt(self, aid: str, cls: PriorityClass | None = None,
                       tenant: str = "") -> bool:
        p = self.of(aid)
        return p is not None and p.controller.renew_or_adopt(aid, cls, tenant)

    def open_stop_channel(self, aid: str) -> asyncio.Future[None] | None:
        p = self.of(aid)
        return None if p is None else p.controller.open_stop_channel(aid)

    def holds(self, aid: str) -> bool:
        p = self.of(aid)
        return p is not None and p.controller.holds(aid)

    def hold_without_lease(self, aid: str) -> bool:
        p = self.of(aid)
        return p is not None and p.controller.hold_without_lease(aid)

    def lease_again(self, aid: str) -> bool:
        p = self.of(aid)
        return p is not None and p.controller.lease_again(aid)

    def unleased(self, aid: str) -> bool:
        p = self.of(aid)
        return p is not None and p.controller.unleased(aid)

    def mark_first_byte(self, aid: str) -> bool:
        p = self.of(aid)
        return p is not None and p.controller.mark_first_byte(aid)

    async def confirm_first_byte(self, aid: str) -> bool:
        # In process: True at once; a pool's fleet controller may wait for its ledger.
        p = self.of(aid)
        return True if p is None else await p.controller.confirm_first_byte(aid)

    def close_stop_channel(self, aid: str) -> None:
        p = self.of(aid)
        if p is not None:
            p.controller.close_stop_channel(aid)

    def preemption_undelivered(self, aid: str) -> None:
        """A preemption of ``aid`` whose 503 could not be written (counted by its pool)."""
        p = self.of(aid)
        if p is not None:
            p.metrics.preemption_undelivered()
