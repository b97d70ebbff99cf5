from __future__ import annotations

import asyncio
import inspect
import os
import time
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from hypothesis import HealthCheck, settings

from devtools.fleet import wait_for
from devtools.httpclient import Exchange, Response, chat_body, request
from devtools.stack import Stack, StackConfig
from tests import logtails, tiers

StackFactory = Callable[..., Awaitable[Stack]]
Metrics = dict[str, float]

# Property tests without their own ``max_examples`` run this many examples, whichever
# files are collected with them (``HYPOTHESIS_PROFILE=long`` for the long runs).
settings.register_profile("ci", max_examples=2000, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("long", max_examples=20000, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=300, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# ------------------------------------------------------------------ the suite's harness
# Tiers (tests/tiers.py): every test that can start a child process is marked `external`;
# `make check` runs the others. Failure reports (tests/logtails.py): a failed test's
# report ends with the tails of its child processes' logs and the fake workers' journal.


def pytest_configure(config: pytest.Config) -> None:
    tiers.install()
    tiers.popen_hooks.append(logtails.record)


def pytest_unconfigure(config: pytest.Config) -> None:
    tiers.uninstall()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    tiers.classify(config, items)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    logtails.begin_test()
    tiers.set_current(item)
    try:
        return (yield)
    finally:
        tiers.set_current(None)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    try:
        report: pytest.TestReport = yield
    except Exception as exc:
        # pytest could not render the failure (seen: CPython 3.11.7's "AST constructor
        # recursion depth mismatch" from its source lookup), which stops the whole run
        # with an INTERNALERROR and no name. Report it plainly and go on.
        plain = ("".join(traceback.format_exception(call.excinfo.value))
                 if call.excinfo is not None else "")
        report = pytest.TestReport(
            item.nodeid, item.location, {k: 1 for k in item.keywords}, "failed",
            f"pytest could not render this failure ({exc!r}); the exception:\n{plain}",
            call.when, duration=call.duration, start=call.start, stop=call.stop,
            user_properties=item.user_properties)
    violation = tiers.violation(item)
    if violation is not None and report.when == "call" and report.passed:
        # the test swallowed the failure its Popen raised: it fails all the same
        report.outcome = "failed"
        report.longrepr = violation
    if report.failed:
        report.sections.extend(logtails.sections())
    return report


# The end-to-end helpers shared by the test modules live here rather than in devtools:
# they are assertions (pytest rewrites them in conftest, so failures show the values), and
# devtools is the stack itself, used by the demo and the benchmarks too.


async def settle(stack: Stack, timeout: float = 20.0) -> dict[str, float]:
    """Wait until the sidecar reports nothing in flight and nothing queued."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        m = await stack.metrics()
        inflight = sum(v for k, v in m.items() if k.startswith("smg_scheduler_inflight{"))
        depth = sum(v for k, v in m.items() if k.startswith("smg_scheduler_queue_depth{"))
        if inflight == 0 and depth == 0:
            return m
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"not settled: inflight={inflight} queued={depth}")
        await asyncio.sleep(0.05)


def describe(cond: Callable[..., object]) -> str:
    """A condition as its source says it (a lambda's line), else its name."""
    try:
        return " ".join(inspect.getsource(cond).split())
    except (OSError, TypeError):
        return getattr(cond, "__qualname__", repr(cond))


async def until(stack: Stack, cond: Callable[[Metrics], bool], timeout: float = 15.0) -> Metrics:
    """Poll the sidecar's metrics until ``cond(metrics)`` holds; return them."""
    deadline = time.monotonic() + timeout
    while True:
        m = await stack.metrics()
        if cond(m):
            return m
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {describe(cond)}; "
                                 f"last metrics: {m}")
        await asyncio.sleep(0.05)


def assert_denied(r: Response, status: int, code: str, retry_after: str | None) -> None:
    """A rejection as the contract has it: status, X-SMG-Error-Code, Retry-After, JSON body."""
    assert r.status == status, (r.status, r.body)
    assert r.headers["x-smg-error-code"] == code
    assert r.headers["content-type"] == "application/json"
    assert r.headers.get("retry-after") == retry_after
    body = r.json()
    assert body["error"]["code"] == code and body["error"]["param"] is None
    assert body["error"]["type"] in ("Too Many Requests", "Service Unavailable")
    assert body["error"]["message"]


async def assert_preempted(victim: Exchange) -> Response:
    """The victim's client got the contract's preemption answer (503, Retry-After: 1,
    X-SMG-Preempted: true) before any byte of the response; read with bounded waits."""
    await asyncio.wait_for(victim.read_head(), 10)
    r = Response(victim.status, victim.headers, await asyncio.wait_for(victim.read_body(), 10))
    assert_denied(r, 503, "scheduler_preempted", "1")
    assert r.headers["x-smg-preempted"] == "true"
    return r


async def complete_held(stack: Stack, ex: Exchange, gate: str) -> None:
    """Open ``gate``: the request held there is answered 200; then hang up."""
    stack.fleet.gates.open(gate)
    await ex.read_head()
    assert ex.status == 200
    await ex.close()


async def preempt_held_bulk(stack: Stack, preemptor: dict[str, str]) -> None:
    """A bulk request held at the stack's only worker (before any byte) is preempted by one
    sent with the ``preemptor`` headers: that one is admitted, the victim gets the 503."""
    victim = await Exchange.send(stack.listen_port, body=chat_body(),
                                 headers={"x-smg-priority": "bulk", "x-fake-gate": "never"})
    worker = stack.fleet.workers[0]
    await wait_for(lambda: worker.running == 1, 5)
    r = await request(stack.listen_port, headers=preemptor)
    assert r.status == 200
    try:
        await assert_preempted(victim)
    finally:
        await victim.close()


@pytest.fixture
async def make_stack(tmp_path: Path) -> AsyncIterator[StackFactory]:
    stacks: list[Stack] = []

    async def factory(**kw: Any) -> Stack:
        stack = Stack(StackConfig(**kw), workdir=tmp_path)
        stacks.append(stack)
        await stack.start()
        return stack

    yield factory
    try:
        for stack in stacks:
            if stack.sidecar is not None:
                # Every end-to-end test ends with no slot held and nothing queued.
                await settle(stack)
    finally:
        for stack in stacks:
            await stack.stop()


async def serve_on_loopback(app: web.Application) -> tuple[web.AppRunner, str]:
    """Serve ``app`` on a free loopback port: its runner (``cleanup()`` stops it) and base URL."""
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"
