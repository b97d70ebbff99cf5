"""The admin HTTP endpoint: ``/metrics``, ``/healthz``, ``/readyz`` (aiohttp).

GET and HEAD only (aiohttp answers 405 for other methods on these paths and 404
elsewhere); keep-alive, so a Prometheus scrape reuses its connection.
"""

from __future__ import annotations

from collections.abc import Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest


class AdminServer:
    def __init__(self, registry: CollectorRegistry, ready: Callable[[], bool]) -> None:
        self.registry = registry
        self.ready = ready
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        # No access log: a scrape every few seconds is noise, and it costs per request.
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)

    async def start(self, host: str, port: int) -> int:
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        address = self._runner.addresses[0]
        bound: int = address[1]
        return bound

    async def stop(self) -> None:
        await self._runner.cleanup()

    async def _metrics(self, request: web.Request) -> web.Response:
        body = generate_latest(self.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _healthz(self, request: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def _readyz(self, request: web.Request) -> web.Response:
        if self.ready():
            return web.Response(text="ready\n")
        return web.Response(status=503, text="not ready\n")
