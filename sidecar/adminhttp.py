"""The admin HTTP endpoint: ``/metrics``, ``/healthz``, ``/readyz``, and the status page
``/status`` (HTML) and ``/status.json`` (:mod:`sidecar.status`) (aiohttp).

GET and HEAD only (405 for other methods on these paths, 404 elsewhere);
keep-alive, so a Prometheus scrape reuses its connection.

Bounded, because kubelet and Prometheus must keep getting answers when something
else floods the port (``k8s/`` also ships a NetworkPolicy for it):

* at most :data:`MAX_CONNECTIONS` connections at once. A new connection over the
  cap evicts the oldest one that has not sent a complete request (a stalled or
  idle client), so a real probe gets in even during a flood; when every
  connection is mid-request the new one is closed instead;
* a connection must deliver a complete request within
  :data:`REQUEST_DEADLINE_SECS` of being accepted, and the next one within
  :data:`IDLE_SECS` of the last response, or it is closed (slow-loris);
* an accept that fails for lack of file descriptors or memory (``EMFILE``,
  ``ENFILE``, ``ENOBUFS``, ``ENOMEM``; when the process limit is below the cap,
  or something else holds the descriptors) closes the oldest stalled admin
  connection, so asyncio's retry a second later finds a descriptor, and is logged
  once per interval with a count, not once per event with a traceback.

Every connection closed by these rules is counted in
``smg_sidecar_admin_connections_dropped_total{reason}`` (``over_cap``,
``deadline``, ``exhausted``).
"""

from __future__ import annotations

import asyncio
import errno
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Protocol

from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from sidecar import logs
from sidecar.metrics import NullRecorder, Recorder

MAX_CONNECTIONS = 64
REQUEST_DEADLINE_SECS = 5.0
IDLE_SECS = 30.0
# Errors of a process out of descriptors or memory: a storm, not a bug.
EXHAUSTION_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})

log = logs.get("sidecar.admin")
# The status page is read by people and by curl: it must never be cached, framed, or
# run anything (it has no script; the policy makes sure nothing injected would run).
STATUS_HEADERS = {
    "Cache-Control": "no-store",
    "X-Content-Type-Options": "nosniff",
    "Content-Security-Policy": "default-src 'none'; style-src 'unsafe-inline'; "
                               "frame-ancestors 'none'",
}


class StatusSource(Protocol):
    """What serves the status page (:class:`sidecar.status.StatusPage`)."""

    def json(self) -> bytes: ...
    def html(self) -> str: ...


class _BoundedServer(web.Server):
    """aiohttp's low-level server with a connection cap and request deadlines."""

    def __init__(self, handler: Callable[[web.BaseRequest], Any], *, recorder: Recorder,
                 max_connections: int, request_deadline: float, idle: float,
                 **kwargs: Any) -> None:
        super().__init__(handler, **kwargs)
        self._recorder = recorder
        self._max = max_connections
        self._request_deadline = request_deadline
        self._idle = idle
        # Connections with no complete request yet (since accept or their last
        # response), oldest first, each with the timer that closes it.
        self._waiting: OrderedDict[RequestHandler, asyncio.TimerHandle] = OrderedDict()
        self._dropped_log = logs.Throttled(log, "admin_connections_dropped")

    def connection_made(self, handler: RequestHandler, transport: asyncio.Transport) -> None:
        super().connection_made(handler, transport)
        if len(self._connections) > self._max:
            victim = next(iter(self._waiting), handler)
            self._drop(victim, "over_cap")
            if victim is handler:
                return
        self._wait(handler, self._request_deadline)

    def connection_lost(self, handler: RequestHandler, exc: BaseException | None = None) -> None:
        timer = self._waiting.pop(handler, None)
        if timer is not None:
            timer.cancel()
        super().connection_lost(handler, exc)

    def request_started(self, handler: RequestHandler) -> None:
        timer = self._waiting.pop(handler, None)
        if timer is not None:
            timer.cancel()

    def request_finished(self, handler: RequestHandler) -> None:
        if handler in self._connections:
            self._wait(handler, self._idle)

    def drop_oldest_stalled(self) -> bool:
        """Out of descriptors: close the oldest connection with no complete request."""
        victim = next(iter(self._waiting), None)
        if victim is None:
            return False
        self._drop(victim, "exhausted")
        return True

    def _wait(self, handler: RequestHandler, secs: float) -> None:
        self._waiting[handler] = self._loop.call_later(secs, self._drop, handler, "deadline")

    def _drop(self, handler: RequestHandler, reason: str) -> None:
        timer = self._waiting.pop(handler, None)
        if timer is not None:
            timer.cancel()
        transport = self._connections.get(handler)
        if transport is not None:
            transport.abort()  # frees the descriptor now, no lingering close
        self._recorder.admin_dropped(reason)
        self._dropped_log.event(reason=reason, connections=len(self._connections),
                                max_connections=self._max)


class AdminServer:
    def __init__(self, registry: CollectorRegistry, ready: Callable[[], bool],
                 recorder: Recorder | None = None, *, max_connections: int = MAX_CONNECTIONS,
                 request_deadline: float = REQUEST_DEADLINE_SECS,
                 idle: float = IDLE_SECS) -> None:
        self.registry = registry
        self.ready = ready
        self._recorder = recorder if recorder is not None else NullRecorder()
        self._limits = (max_connections, request_deadline, idle)
        self._routes: dict[str, Callable[[], web.Response]] = {
            "/metrics": self._metrics, "/healthz": self._healthz, "/readyz": self._readyz,
            "/status": self._status_html, "/status.json": self._status_json}
        self._status: StatusSource | None = None  # until the runtime is built
        self._server: _BoundedServer | None = None
        self._runner: web.ServerRunner | None = None
        self._exhausted_log = logs.Throttled(log, "resource_exhausted")

    def serve_status(self, page: StatusSource) -> None:
        """The runtime is built: ``/status`` and ``/status.json`` show it."""
        self._status = page

    async def start(self, host: str, port: int) -> int:
        max_connections, request_deadline, idle = self._limits
        self._server = _BoundedServer(
            self._handle, recorder=self._recorder, max_connections=max_connections,
            request_deadline=request_deadline, idle=idle,
            # aiohttp's own idle close: ours (IDLE_SECS) decides first.
            keepalive_timeout=idle + 1)
        # No access log: a scrape every few seconds is noise, and it costs per request.
        self._runner = web.ServerRunner(self._server, access_log=None, shutdown_timeout=1.0)
        await self._runner.setup()
        loop = asyncio.get_running_loop()
        if loop.get_exception_handler() is None:
            loop.set_exception_handler(self._loop_exception)
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        address = self._runner.addresses[0]
        bound: int = address[1]
        return bound

    async def stop(self) -> None:
        # The handler stays installed: asyncio's accept retry, scheduled after an
        # EMFILE, may still fire once on the closed socket (see _loop_exception).
        if self._runner is not None:
            await self._runner.cleanup()

    def _loop_exception(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        """asyncio reports a failed accept here, with a traceback, once per attempt."""
        exc = context.get("exception")
        if isinstance(exc, OSError) and exc.errno in EXHAUSTION_ERRNOS:
            # Free a descriptor for the next accept (asyncio retries within 1 s): a
            # stalled admin connection is worth less than a probe or a scrape.
            if self._server is not None:
                self._server.drop_oldest_stalled()
            self._exhausted_log.event(error=errno.errorcode.get(exc.errno or 0, "?"),
                                      detail=str(context.get("message", "")))
            return
        if isinstance(exc, ValueError) and "_start_serving" in repr(context.get("handle")):
            # asyncio's accept retry (scheduled 1 s after an EMFILE) ran after the
            # server closed its socket (fd -1): nothing is left to serve, nothing lost.
            log.debug("accept_retry_after_close")
            return
        loop.default_exception_handler(context)

    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        server = self._server
        assert server is not None
        server.request_started(request.protocol)
        try:
            route = self._routes.get(request.path)
            if route is None:
                return web.Response(status=404, text="not found\n")
            if request.method not in ("GET", "HEAD"):
                return web.Response(status=405, text="method not allowed\n",
                                    headers={"Allow": "GET, HEAD"})
            return route()
        finally:
            server.request_finished(request.protocol)

    def _metrics(self) -> web.Response:
        body = generate_latest(self.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    def _healthz(self) -> web.Response:
        return web.Response(text="ok\n")

    def _readyz(self) -> web.Response:
        if self.ready():
            return web.Response(text="ready\n")
        return web.Response(status=503, text="not ready\n")

    def _status_html(self) -> web.Response:
        if self._status is None:
            return web.Response(status=503, text="starting\n", headers=STATUS_HEADERS)
        return web.Response(text=self._status.html(), content_type="text/html",
                            headers=STATUS_HEADERS)

    def _status_json(self) -> web.Response:
        if self._status is None:
            return web.Response(status=503, text="starting\n", headers=STATUS_HEADERS)
        return web.Response(body=self._status.json(), content_type="application/json",
                            headers=STATUS_HEADERS)
