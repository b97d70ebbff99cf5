"""Edge shedding: Envoy answers a flooded class's overflow itself, the sidecar steers it.

A shed Check costs the sidecar about what an admitted one does (the gRPC call is
most of it), so at 10x overload most of its CPU goes to saying no. With
``--edge-shed`` the sidecar drives a switch per class in Envoy's runtime, and a
route ahead of the catch-all answers that share of the class's requests with the
contract's ``429 scheduler_queue_full`` (same status, headers and body bytes as
the sidecar's own, :data:`EDGE_REPLIES`) before any Check. Three parts:

* **Switches (RTDS).** The sidecar serves ``RuntimeDiscoveryService/StreamRuntime``
  on its gRPC port: one runtime layer, :data:`LAYER`, with a key per class,
  ``smg.edge.shed.<class>`` = the share to shed in millionths. Envoy's bootstrap
  (``envoy/render.py --edge-shed``) layers it over a static layer where every
  key is 0. Every resource carries an xDS TTL (:data:`TTL_SECS`) and is sent
  again every control interval; an Envoy that hears nothing for a TTL (sidecar
  dead, stream broken, process stopped) drops the layer and the static 0
  applies: **a switch is off at most TTL_SECS after the sidecar last spoke**.
* **Which requests.** Only a class certain from the request alone may be shed
  before the tenant is known: ``x-smg-priority: bulk`` is bulk whatever the
  tenant, since the ceiling only clamps down (:data:`EDGE_CLASSES`). ``system``,
  ``interactive``, ``default``, other values and no header can all end up in
  another class by the tenant's ceiling, so they always reach Check.
* **Control loop** (:class:`ShedController`, every :data:`CONTROL_INTERVAL_SECS`).
  A class is shed only while its queue overflows: the Checks of that class the
  sidecar answered ``rejected_queue_full`` since the last tick. While it
  overflows, the target is the share that lets through what the queue absorbed,
  plus :data:`MARGIN`: the sidecar keeps seeing a little overflow (which is what
  keeps the switch on). The share rises to a higher target at once and moves
  half-way toward a lower one. An interval in which a Check of the class was
  admitted without queuing is room (the queue was empty and a slot free): the
  switch goes to 0 at that tick, so a request the contract would admit at once
  is shed for at most two intervals after the queue empties (one to see it, one
  to observe it) plus Envoy's reload. An interval with arrivals, none of them
  overflowing, all of them queued, means the queue took all that got through
  but was not empty: the next one lets through :data:`PROBE` times as many
  (with the margin) of all the class's arrivals, the Checks plus the edge's own
  sheds counted in that interval, and the switch goes to 0 once that is all of
  them (or when no edge sheds were counted). The sheds counted are trusted only as
  far as the share in force explains them: more than ``share / (1 - share)`` per
  Check let through never slows the let-through's growth below PROBE x (1 + MARGIN)
  per interval, so a forged or late count can delay a switch's fall to 0 by at most six
  intervals and never hold it on. So a flood whose queue has a moment
  of room is not let through whole (measured before: the share fell to 0 every
  0.5-1.5 s at 100x, each time ~400 Checks at once, ahead of interactive's);
  a queue that keeps room without emptying sees the let-through grow 2.5x per
  interval, from the 1 % of :data:`MAX_SHARE` to all in at most 6 intervals.
  Changes smaller than :data:`DEADBAND` are not sent. In a fleet (``--coordination-url``) the
  rejections are the ledger's, so the switch follows the fleet-wide queue as this
  replica's traffic meets it.
* **Counting.** Envoy writes one access-log entry per edge shed on a logger of
  its own (batched, :data:`SHED_LOG_NAME`), marked by gRPC metadata on its
  stream; the sidecar counts the entries that are what that logger sends (the edge
  route's name, :func:`route_name`, and its 429) into
  ``smg_scheduler_admit_total{class,outcome="rejected_queue_full"}``
  and ``smg_sidecar_edge_shed_total{class}`` and the ``rejections`` log line.
  A stream marked with a class that is not an edge class, or a pool this sidecar
  lacks, counts nothing. The port is not authenticated (docs/reference.md, "Who can
  call the gRPC port"): a caller can forge such entries and so raise those
  counters, but by the rule above not hold a switch on.
  The batch interval (:data:`SHED_LOG_FLUSH_SECS`) is well inside any scrape
  interval.
* **Pools.** Each pool has its own switches, control loop and logger: a pool's
  queue overflowing sheds only that pool's route. The default pool keeps the
  keys above; a named pool's key is ``smg.edge.shed.pool.<pool>.<class>``
  (:func:`runtime_key`), its edge route is ahead of its own route, and its
  logger's stream also carries :data:`POOL_MARK_KEY`.

docs/reference.md, "Edge shedding", has the operator's side.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Final

import grpc
from envoy.service.accesslog.v3 import als_pb2
from envoy.service.discovery.v3 import discovery_pb2
from envoy.service.runtime.v3 import rtds_pb2

from sidecar import codec, logs, responses
from sidecar.classes import PriorityClass
from sidecar.config import DEFAULT_POOL
from sidecar.metrics import PoolRecorder

RTDS_SERVICE = "envoy.service.runtime.v3.RuntimeDiscoveryService"
RUNTIME_TYPE_URL = "type.googleapis.com/envoy.service.runtime.v3.Runtime"
LAYER = "priority-gate-edge"
# Only a class the request alone decides: a bulk header stays bulk under any ceiling.
EDGE_CLASSES: Final = (PriorityClass.BULK,)
RUNTIME_KEY_PREFIX = "smg.edge.shed."
DENOMINATOR = 1_000_000  # the routes' runtime_fraction denominator: MILLION
# Resource TTL: an Envoy that hears nothing for this long goes back to the static 0.
TTL_SECS = 2.0
CONTROL_INTERVAL_SECS = 0.25  # also the refresh period: eight refreshes per TTL
MARGIN = 0.25  # let through this much more than the queue absorbed (keeps the signal)
# Toward a higher target the share jumps (a burst is shed from the next tick on); toward a
# lower one it moves this far per tick, so one quiet-looking interval does not undo it.
GAIN = 0.5
# After an interval whose arrivals all found room, let through this many times as many.
PROBE = 2.0
MAX_SHARE = 0.99  # a few requests always reach Check: the overflow signal needs them
DEADBAND = 0.01  # smaller changes are not sent
# The edge-shed access logger: its stream carries this gRPC metadata (Envoy's
# grpc_service initial_metadata), one logger per edge class.
SHED_LOG_NAME = "priority-gate-edge-shed"
STREAM_MARK_KEY = "x-smg-edge-shed"
POOL_MARK_KEY = "x-smg-edge-pool"  # a named pool's logger; absent: the default pool
SHED_LOG_FLUSH_SECS = 0.25
EDGE_TENANT = "<edge>"  # the rejections line's tenant for edge sheds (Envoy did not ask)

log = logs.get("sidecar.edge")


def runtime_key(cls: PriorityClass, pool: str = DEFAULT_POOL) -> str:
    """The switch's runtime key: the default pool's carries no pool, so a bootstrap
    without pools is what it was before pools existed."""
    if pool == DEFAULT_POOL:
        return RUNTIME_KEY_PREFIX + cls.label
    return f"{RUNTIME_KEY_PREFIX}pool.{pool}.{cls.label}"


def route_name(cls: PriorityClass, pool: str = DEFAULT_POOL) -> str:
    """The edge route's name (envoy/render.py, the k8s recipes): each shed's access-log
    entry carries it, and only entries that do are counted."""
    if pool == DEFAULT_POOL:
        return f"smg_edge_shed_{cls.label}"
    return f"smg_edge_shed_pool_{pool}_{cls.label}"


EDGE_REPLIES: Final[Mapping[PriorityClass, responses.Reply]] = {
    cls: responses.REPLIES[(responses.Rejection.QUEUE_FULL, cls)] for cls in EDGE_CLASSES}


@dataclass(slots=True)
class _ClassState:
    share: float = 0.0  # what Envoy was last told
    arrived: int = 0  # Checks of the class since the last tick
    overflow: int = 0  # of them, answered rejected_queue_full
    shed: int = 0  # answered by Envoy's edge route, counted since the last tick
    at_once: int = 0  # Checks of the class admitted without queuing since the last tick


@dataclass(slots=True)
class ShedController:
    """The share of each edge class's arrivals Envoy answers itself (module docstring)."""

    classes: Iterable[PriorityClass] = EDGE_CLASSES
    _state: dict[PriorityClass, _ClassState] = field(init=False)

    def __post_init__(self) -> None:
        self._state = {c: _ClassState() for c in self.classes}

    def arrived(self, cls: PriorityClass) -> None:
        s = self._state.get(cls)
        if s is not None:
            s.arrived += 1

    def overflowed(self, cls: PriorityClass) -> None:
        s = self._state.get(cls)
        if s is not None:
            s.overflow += 1

    def admitted_at_once(self, cls: PriorityClass) -> None:
        s = self._state.get(cls)
        if s is not None:
            s.at_once += 1

    def edge_shed(self, cls: PriorityClass, n: int) -> None:
        s = self._state.get(cls)
        if s is not None:
            s.shed += n

    def shares(self) -> dict[PriorityClass, float]:
        return {c: s.share for c, s in self._state.items()}

    def tick(self) -> bool:
        """Close an interval; True when a share changed (Envoy must be told)."""
        changed = False
        for s in self._state.values():
            new = self._next(s)
            s.arrived = s.overflow = s.shed = s.at_once = 0
            if new != s.share:
                s.share = new
                changed = True
        return changed

    @staticmethod
    def _next(s: _ClassState) -> float:
        if s.overflow == 0:
            if s.at_once:
                return 0.0  # the queue was empty with a slot free: room
            if s.arrived:
                # All that got through found room: let PROBE times as many through, of
                # all arrivals (Checks + the edge's own sheds); 0 once that is all of them.
                # The sheds count only as far as the share in force explains them: more
                # (forged on the unauthenticated port, or late) would hold the switch on.
                through = max(s.arrived / (s.arrived + s.shed), 1.0 - s.share)
                target = 1.0 - PROBE * (1.0 + MARGIN) * through
                return 0.0 if target < 2 * DEADBAND else round(target, 4)
            if s.share < 2 * DEADBAND:
                return 0.0
            # Nothing got through, so nothing is known: shed less until something does.
            return round(s.share * (1.0 - GAIN), 4)
        # Arrivals at the edge, estimated from what got through the share in force.
        total = s.arrived / max(1e-6, 1.0 - s.share)
        # A fleet's ledger may answer a Check in the interval after the one it arrived in.
        absorbed = max(0, s.arrived - s.overflow)
        target = min(MAX_SHARE, max(0.0, 1.0 - absorbed * (1.0 + MARGIN) / total))
        new = target if target > s.share else s.share + GAIN * (target - s.share)
        if abs(new - s.share) < DEADBAND:
            return s.share
        return round(new, 4)


class RuntimeServer:
    """SotW RTDS for one layer: the current shares, with a TTL, to every open stream.
    Shares are keyed by (pool, class); one layer carries every pool's switches."""

    def __init__(self, pools: Mapping[str, PoolRecorder]) -> None:
        self._recorders = dict(pools)
        self._streams: set[asyncio.Queue[bytes]] = set()
        self._version = itertools.count(1)
        self._nonce = itertools.count(1)
        names = tuple(pools)
        # The default pool's keys carry no pool (a bootstrap without pools is unchanged),
        # and neither do its log lines when it is the only one.
        self._pooled = names != (DEFAULT_POOL,)
        self._shares: dict[tuple[str, PriorityClass], float] = {
            (p, c): 0.0 for p in names for c in EDGE_CLASSES}
        self._current = self._encode()
        # Per message of a stream anyone reaching the port may open: one line per 10 s.
        self._decode_failed_log = logs.Throttled(log, "rtds_decode_failed")
        self._rejected_log = logs.Throttled(log, "rtds_rejected")
        self._unknown_log = logs.Throttled(log, "rtds_unknown_subscription")

    @property
    def streams(self) -> int:
        return len(self._streams)

    def publish(self, shares: Mapping[tuple[str, PriorityClass], float], *,
                changed: bool) -> None:
        """Send the shares (again) to every Envoy; a refresh when nothing changed."""
        if changed:
            # Info only when a class's switch goes on or off; each step at debug.
            flips = {self._name(k): v for k, v in shares.items()
                     if (v > 0) != (self._shares.get(k, 0.0) > 0)}
            self._shares = dict(shares)
            self._current = self._encode()
            if flips:
                log.info("edge_shed_switched", shares=flips)
            elif logs.debug_enabled():
                log.debug("edge_shed_changed",
                          shares={self._name(k): v for k, v in shares.items()})
        for (pool, cls), share in self._shares.items():
            self._recorders[pool].edge_share(cls, share)
        for q in self._streams:
            _offer(q, self._current)

    def _encode(self) -> bytes:
        version = str(next(self._version))
        rt = rtds_pb2.Runtime(name=LAYER)
        # A FractionalPercent map: a plain integer would be read as a percentage and
        # anything above 100 as "always" (measured with Envoy 1.40: everything shed).
        rt.layer.update({runtime_key(c, p): {"numerator": round(v * DENOMINATOR),
                                             "denominator": "MILLION"}
                         for (p, c), v in self._shares.items()})
        res = discovery_pb2.Resource(name=LAYER, version=version)
        res.ttl.FromNanoseconds(int(TTL_SECS * 1e9))
        res.resource.Pack(rt)
        resp = discovery_pb2.DiscoveryResponse(version_info=version, type_url=RUNTIME_TYPE_URL)
        resp.resources.add().Pack(res)
        out: bytes = resp.SerializeToString()
        return out

    def _name(self, key: tuple[str, PriorityClass]) -> str:
        """A switch in log lines: the class, with its pool where there are pools."""
        return f"{key[0]}/{key[1].label}" if self._pooled else key[1].label

    def _with_nonce(self, data: bytes) -> bytes:
        # The nonce is the only per-send field: appended as its own field, no re-encode.
        nonce: bytes = discovery_pb2.DiscoveryResponse(
            nonce=str(next(self._nonce))).SerializeToString()
        return data + nonce

    async def stream_runtime(self, requests: AsyncIterator[bytes],
                             context: grpc.aio.ServicerContext[bytes, bytes]
                             ) -> AsyncIterator[bytes]:
        q: asyncio.Queue[bytes] = asyncio.Queue(maxsize=1)
        reader = asyncio.ensure_future(self._read(requests, q))
        try:
            while True:
                data = await q.get()
                yield self._with_nonce(data)
        finally:
            self._streams.discard(q)
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader

    async def _read(self, requests: AsyncIterator[bytes], q: asyncio.Queue[bytes]) -> None:
        async for data in requests:
            try:
                req = discovery_pb2.DiscoveryRequest.FromString(data)
            except Exception as exc:  # a malformed message is logged, not fatal
                self._decode_failed_log.event(error=str(exc)[:200])
                continue
            if req.HasField("error_detail"):
                self._rejected_log.event(message=req.error_detail.message[:200],
                                         version=req.version_info[:64])
            if q not in self._streams:  # the first request: send what is in force now
                if req.type_url != RUNTIME_TYPE_URL or LAYER not in req.resource_names:
                    self._unknown_log.event(type_url=req.type_url[:200],
                                            resources=[r[:64] for r in
                                                       list(req.resource_names)[:4]])
                self._streams.add(q)
                _offer(q, self._current)


class EdgeShed:
    """The controllers (one per pool), the RTDS server and the shed counter, run every
    interval. ``pools``: every pool's name (the default pool's included) and recorder."""

    def __init__(self, pools: Mapping[str, PoolRecorder],
                 rejections: Callable[[str, str, str], None]) -> None:
        self.controllers = {p: ShedController() for p in pools}
        self.server = RuntimeServer(pools)
        self._recorders = dict(pools)
        self._rejections = rejections
        self._unknown_pool_log = logs.Throttled(log, "edge_shed_unknown_pool")
        self._bad_class_log = logs.Throttled(log, "edge_shed_unknown_class")
        self._decode_failed_log = logs.Throttled(log, "edge_shed_decode_failed")
        self._not_edge_log = logs.Throttled(log, "edge_shed_entries_not_counted")

    async def run(self) -> None:
        while True:
            await asyncio.sleep(CONTROL_INTERVAL_SECS)
            changed = False
            for c in self.controllers.values():
                changed = c.tick() or changed
            self.server.publish({(p, cls): v for p, c in self.controllers.items()
                                 for cls, v in c.shares().items()}, changed=changed)

    def shed_counted(self, cls: PriorityClass, n: int, pool: str = DEFAULT_POOL) -> None:
        controller = self.controllers.get(pool)
        if controller is None:  # a logger naming a pool this sidecar does not have
            self._unknown_pool_log.event(pool=pool[:64], entries=n)
            return
        controller.edge_shed(cls, n)
        self._recorders[pool].edge_shed(cls, n)
        for _ in range(n):
            self._rejections(cls.label, "rejected_queue_full", EDGE_TENANT)

    def access_logs(self, completion: Callable[[AsyncIterator[bytes],
                                                grpc.aio.ServicerContext[bytes, bytes]],
                                               Awaitable[bytes]]
                    ) -> Callable[[AsyncIterator[bytes], grpc.aio.ServicerContext[bytes, bytes]],
                                  Awaitable[bytes]]:
        """The ALS handler: edge-shed streams are counted here, the rest go to ``completion``."""

        async def handler(requests: AsyncIterator[bytes],
                          context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
            mark = _stream_mark(context, STREAM_MARK_KEY)
            if mark is None:
                return await completion(requests, context)
            cls = PriorityClass.from_name(mark)
            pool = _stream_mark(context, POOL_MARK_KEY) or DEFAULT_POOL
            if cls not in EDGE_CLASSES:  # no edge route sheds it: not Envoy's logger
                self._bad_class_log.event(mark=mark[:32], pool=pool[:64])
                return await _drain(requests)
            assert cls is not None
            edge_route = route_name(cls, pool)
            status = EDGE_REPLIES[cls].status
            async for data in requests:
                try:
                    entries = als_pb2.StreamAccessLogsMessage.FromString(data).http_logs.log_entry
                    n = sum(1 for e in entries
                            if e.common_properties.route_name == edge_route
                            and e.response.response_code.value == status)
                except Exception as exc:
                    self._decode_failed_log.event(error=str(exc)[:200])
                    continue
                if n < len(entries):  # what Envoy's edge logger never sends: not counted
                    self._not_edge_log.event(cls=cls.label, pool=pool[:64],
                                             entries=len(entries), not_counted=len(entries) - n,
                                             route=edge_route[:128])
                if n:
                    self.shed_counted(cls, n, pool)
            return codec.ALS_RESPONSE

        return handler


async def _drain(requests: AsyncIterator[bytes]) -> bytes:
    """Read a stream to its end without acting on it (closing it early would only make a
    misconfigured Envoy reconnect at once)."""
    async for _ in requests:
        pass
    return codec.ALS_RESPONSE


def _offer(q: asyncio.Queue[bytes], data: bytes) -> None:
    """Make ``data`` the one message a slow stream sends next: a state it has not sent
    yet is replaced, never queued behind (only the newest matters)."""
    if not q.empty():
        q.get_nowait()
    q.put_nowait(data)


def _stream_mark(context: grpc.aio.ServicerContext[bytes, bytes], mark: str) -> str | None:
    for key, value in context.invocation_metadata() or ():
        if key == mark:
            return value if isinstance(value, str) else value.decode(errors="replace")
    return None
