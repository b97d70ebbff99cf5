"""Health-driven capacity.

The worker set comes from ``--worker-urls`` or from Envoy's admin API
(``/clusters?format=json``: only hosts Envoy will route to, so admission and
routing agree, outlier ejection included). Each worker is probed: ``GET
/health`` for liveness and ``GET /server_info`` for ``max_running_requests``
(64 when a healthy worker does not report it). Capacity is the sum over healthy
workers; with none healthy, the fallback capacity applies.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import aiohttp

from sidecar import logs

DEFAULT_WORKER_CAPACITY = 64

log = logs.get("sidecar.health")


@dataclass(frozen=True, slots=True)
class CapacityReading:
    capacity: int
    source: str  # "workers" | "fallback" | "override"
    healthy: int
    total: int


PROBE_BODY_LIMIT = 64 << 10  # /health, /server_info: a few hundred bytes in practice
CLUSTERS_BODY_LIMIT = 16 << 20  # Envoy's /clusters JSON grows with the number of hosts


async def http_get(session: aiohttp.ClientSession, url: str, timeout: float,
                   limit: int = PROBE_BODY_LIMIT) -> tuple[int, bytes]:
    """GET ``url``: the status and at most ``limit`` bytes of body, within ``timeout`` s.

    A longer body is cut at ``limit`` (a JSON body then fails to parse: ValueError).
    Raises aiohttp.ClientError, OSError, TimeoutError or ValueError.
    """
    async with asyncio.timeout(timeout), session.get(url) as resp:
        body = bytearray()
        while len(body) < limit and (data := await resp.content.read(limit - len(body))):
            body += data
        return resp.status, bytes(body)


def new_session() -> aiohttp.ClientSession:
    """A session for probes: keep-alive to each worker, no proxy from the environment."""
    return aiohttp.ClientSession(headers={"Accept": "application/json"}, trust_env=False)


async def probe_worker(session: aiohttp.ClientSession, base_url: str,
                       timeout: float) -> int | None:
    """The worker's capacity if healthy, else ``None``."""
    base = base_url.rstrip("/")
    try:
        status, _ = await http_get(session, f"{base}/health", timeout)
    except (aiohttp.ClientError, OSError, TimeoutError, ValueError):
        return None
    if status != 200:
        return None
    try:
        status, body = await http_get(session, f"{base}/server_info", timeout)
        if status == 200:
            info = json.loads(body)
            value = info.get("max_running_requests") if isinstance(info, dict) else None
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    except (aiohttp.ClientError, OSError, TimeoutError, ValueError):
        pass
    return DEFAULT_WORKER_CAPACITY


def routable_hosts(clusters_json: object, cluster: str) -> list[str]:
    """Base URLs of the hosts Envoy would route to in ``cluster``."""
    out: list[str] = []
    if not isinstance(clusters_json, dict):
        return out
    for status in clusters_json.get("cluster_statuses", []):
        if not isinstance(status, dict) or status.get("name") != cluster:
            continue
        for host in status.get("host_statuses", []):
            sock = host.get("address", {}).get("socket_address", {})
            addr, port = sock.get("address"), sock.get("port_value")
            if not addr or not port:
                continue
            hs = host.get("health_status", {})
            failed = any(v is True for k, v in hs.items() if k != "eds_health_status")
            eds = hs.get("eds_health_status")
            if failed or eds not in (None, "HEALTHY"):
                continue
            out.append(f"http://{addr}:{port}")
    return out


class CapacityMonitor:
    """Polls the workers and reports capacity changes."""

    def __init__(
        self,
        *,
        worker_urls: Sequence[str],
        envoy_admin_url: str | None,
        envoy_cluster: str,
        interval: float,
        timeout: float,
        fallback: int,
        override: int | None,
        on_change: Callable[[CapacityReading], None],
    ) -> None:
        self.worker_urls = list(worker_urls)
        self.envoy_admin_url = envoy_admin_url
        self.envoy_cluster = envoy_cluster
        self.interval = interval
        self.timeout = timeout
        self.fallback = fallback
        self.override = override
        self.on_change = on_change
        self.last: CapacityReading | None = None
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        """Created on first use: aiohttp sessions belong to the running event loop."""
        if self._session is None:
            self._session = new_session()
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _workers(self) -> list[str]:
        if self.envoy_admin_url is None:
            return self.worker_urls
        url = self.envoy_admin_url.rstrip("/") + "/clusters?format=json"
        try:
            status, body = await http_get(self.session, url, self.timeout,
                                           CLUSTERS_BODY_LIMIT)
            if status == 200:
                return routable_hosts(json.loads(body), self.envoy_cluster)
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as exc:
            log.warning("envoy_admin_unreachable", url=url, error=str(exc))
        return []

    async def read(self) -> CapacityReading:
        if self.override is not None:
            return CapacityReading(self.override, "override", 0, 0)
        urls = await self._workers()
        results = await asyncio.gather(*(probe_worker(self.session, u, self.timeout) for u in urls))
        healthy = [r for r in results if r is not None]
        if not healthy:
            return CapacityReading(self.fallback, "fallback", 0, len(urls))
        return CapacityReading(sum(healthy), "workers", len(healthy), len(urls))

    async def poll_once(self) -> CapacityReading:
        reading = await self.read()
        if reading != self.last:
            log.info("capacity_changed", capacity=reading.capacity, source=reading.source,
                     healthy_workers=reading.healthy, workers=reading.total,
                     previous=self.last.capacity if self.last else None)
            self.last = reading
            self.on_change(reading)
        return reading

    async def run(self) -> None:
        if self.override is not None:
            return
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.poll_once()
            except Exception:  # keep polling whatever one round did
                log.exception("capacity_poll_failed")
