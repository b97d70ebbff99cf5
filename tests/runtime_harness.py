"""A whole sidecar built in process (``build_runtime``, loopback gRPC) beside one fake
worker: for tests that send Checks without Envoy and read the pool's state and metrics
directly. ``Runtimes`` starts them and stops every one, and its worker, at the end."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Generic, TypeVar

from envoy.service.auth.v3 import external_auth_pb2

from devtools.fleet import FakeWorker
from sidecar.app import Runtime, build_runtime
from sidecar.config import DEFAULT_POOL, parse_settings
from sidecar.pools import Pool
from sidecar.scheduler import Snapshot
from tests.grpc_client import EnvoyStandIn, check_request


class Harness:
    def __init__(self, app: Runtime, worker: FakeWorker) -> None:
        self.app = app
        self.worker = worker
        self.envoy = EnvoyStandIn(app.grpc_port)

    @property
    def pool(self) -> Pool:
        return self.app.pools[DEFAULT_POOL]

    def snapshot(self) -> Snapshot:
        return self.pool.controller.snapshot()

    def sample(self, name: str, **labels: str) -> float:
        v = self.app.metrics.registry.get_sample_value(name, labels)
        return 0.0 if v is None else v

    async def check(self, headers: Mapping[str, str]) -> external_auth_pb2.CheckResponse:
        resp: external_auth_pb2.CheckResponse = await self.envoy._check(
            check_request(dict(headers)))
        return resp

    async def until(self, cond: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + 15.0
        while not cond():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            await asyncio.sleep(0.02)


H = TypeVar("H", bound=Harness)


def past_context(resp: external_auth_pb2.CheckResponse) -> str:
    """``resp`` is the 413 ``scheduler_token_context_exceeded`` (a prompt that fits no slot,
    or a request larger than the pool's KV capacity): status, headers (no Retry-After) and
    body; returns the body's message for the caller's own figures."""
    denied = resp.denied_response
    assert denied.status.code == 413
    headers = {x.header.key: x.header.value for x in denied.headers}
    assert headers == {"x-smg-error-code": "scheduler_token_context_exceeded",
                       "content-type": "application/json"}  # no Retry-After
    body = json.loads(denied.body)["error"]
    assert body["code"] == "scheduler_token_context_exceeded"
    return str(body["message"])


class Runtimes(Generic[H]):
    def __init__(self, tmp_path: Path, harness: Callable[[Runtime, FakeWorker], H]) -> None:
        self.tmp_path = tmp_path
        self.harness = harness
        self.made: list[H] = []
        self.workers: list[FakeWorker] = []

    async def start(self, worker: FakeWorker, priority_yaml: str, *extra: str,
                    slots: int) -> H:
        """Start ``worker`` and a sidecar in front of it with ``priority_yaml``; returns
        once the sidecar has read the worker's ``slots``."""
        await worker.start()
        self.workers.append(worker)
        cfg = self.tmp_path / f"priority{len(self.made)}.yaml"
        cfg.write_text(priority_yaml)
        app = await build_runtime(parse_settings([
            "--priority-scheduler-enabled", "--priority-scheduler-config", str(cfg),
            "--grpc-listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0",
            "--worker-urls", worker.url, "--worker-engine", worker.engine,
            "--health-interval-secs", "0.2", "--log-format", "json", *extra]))
        await app.serve()
        h = self.harness(app, worker)
        self.made.append(h)
        await h.until(lambda: app.pools[DEFAULT_POOL].reading.capacity == slots,
                      f"the worker's {slots} slots to be read")
        return h

    async def close(self) -> None:
        for h in self.made:
            await h.envoy.close()
            await h.app.stop()
        for w in self.workers:
            await w.stop()
