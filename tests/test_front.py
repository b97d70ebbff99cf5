"""``devtools.front``: Envoy and the sidecar in front of engines somebody else runs."""

from __future__ import annotations

import pytest

from devtools.fleet import Fleet
from devtools.front import ExternalWorkers, build, parse_args, serve
from devtools.httpclient import request
from tests.conftest import settle, until

pytestmark = pytest.mark.e2e


async def test_fronts_given_worker_urls_with_their_own_capacity() -> None:
    async with Fleet(2, max_running_requests=3, engine="tgi") as fleet:
        # One by IP, one by name: names are resolved once for Envoy's static cluster.
        urls = [fleet.urls[0], fleet.urls[1].replace("127.0.0.1", "localhost")]
        args = parse_args(["--worker-urls", *urls, "--free-ports", "--exit-after-ready"])
        stack = build(args)
        try:
            await serve(stack, args)
            await until(stack, lambda m: m.get("smg_sidecar_capacity") == 6, timeout=10)
            r = await request(stack.listen_port, headers={"x-smg-priority": "bulk"})
            assert r.status == 200, r.body
            assert sum(w.started for w in fleet.workers) == 1
            await settle(stack)
        finally:
            await stack.stop()


async def test_refuses_to_start_when_no_worker_answers() -> None:
    async with Fleet(1) as fleet:
        fleet.workers[0].healthy = False
        workers = ExternalWorkers(fleet.urls)
        with pytest.raises(RuntimeError, match="no worker answered 200 on /health"):
            await workers.start()


@pytest.mark.parametrize("url", ["ftp://127.0.0.1:1", "http://127.0.0.1:8080/v1", "127.0.0.1"])
def test_a_worker_url_must_be_an_http_base_url(url: str) -> None:
    with pytest.raises(ValueError, match="worker URL must be http://HOST:PORT"):
        ExternalWorkers([url])
