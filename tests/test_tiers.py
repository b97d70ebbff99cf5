"""The suite's harness: the tier classifier (tests/tiers.py), its enforcement, and the
failure report's log tails (tests/logtails.py).

The classifier must call external everything that can start a process, through any
number of helpers, classes and fixtures, and must leave in-process code in the fast
tier. Sample code is compiled from text here, so that this module's own tests do not
refer to the spawning helpers they classify (which would make them external too).
"""

from __future__ import annotations

import importlib
import os
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from devtools.fleet import FakeWorker, Fleet, Journal
from devtools.httpclient import request
from devtools.stack import StackConfig
from tests import tiers

REPO = Path(__file__).resolve().parents[1]

SAMPLES = '''
import asyncio, functools, os, subprocess
from subprocess import run as imported_run

def direct():
    subprocess.run(["true"])

def by_import():
    imported_run(["true"])

async def by_asyncio():
    await asyncio.create_subprocess_exec("true")

def by_os():
    os.system("true")

def only_an_exception_class():
    try:
        pass
    except subprocess.TimeoutExpired:
        pass
    return os.environ.get("X")

def pure(x):
    return [y * 2 for y in range(x)]

def two_helpers_away():
    return one_helper_away()

def one_helper_away():
    return direct()

def in_a_lambda():
    return (lambda: direct())

class Server:
    def start(self):
        self.proc = subprocess.Popen(["true"])

class Derived(Server):
    pass

class Quiet:
    def start(self):
        return pure(3)

def uses_a_server():
    Server().start()

def uses_a_derived_server():
    Derived().start()

def fixture_like():
    server = Server()
    yield server

PARTIAL = functools.partial(direct)
INSTANCE = Server()

def through_a_partial():
    PARTIAL()

def through_an_instance():
    INSTANCE.start()

def ping():
    return pong()

def pong():
    return ping()

def ping_spawn():
    return pong_spawn()

def pong_spawn():
    direct()
    return ping_spawn()
'''


def samples() -> dict[str, Any]:
    namespace: dict[str, Any] = {"__name__": "tests.tier_samples"}
    exec(compile(SAMPLES, "tier_samples", "exec"), namespace)
    return namespace


@pytest.mark.parametrize("name", [
    "direct", "by_import", "by_asyncio", "by_os", "two_helpers_away", "one_helper_away",
    "in_a_lambda", "Server", "Derived", "uses_a_server", "uses_a_derived_server",
    "fixture_like", "through_a_partial", "through_an_instance", "ping_spawn", "PARTIAL",
])
def test_code_that_can_start_a_process_is_external(name: str) -> None:
    assert tiers.Classifier().spawns(samples()[name])


@pytest.mark.parametrize("name", ["only_an_exception_class", "pure", "Quiet", "ping"])
def test_code_that_cannot_start_a_process_is_in_process(name: str) -> None:
    assert not tiers.Classifier().spawns(samples()[name])


@pytest.mark.parametrize("where", [
    "devtools.stack:Stack", "devtools.stack:Replicas", "devtools.valkey:ValkeyServer",
    "tests.sidecar_proc:SidecarProcess", "devtools.llama:LlamaFleet"])
def test_the_harness_servers_are_external(where: str) -> None:
    # named, not imported: a test that refers to a server class is external itself
    module, _, name = where.partition(":")
    assert tiers.Classifier().spawns(getattr(importlib.import_module(module), name))


@pytest.mark.parametrize("thing", [Fleet, FakeWorker, StackConfig, Journal])
def test_the_in_process_harness_is_not(thing: type) -> None:
    assert not tiers.Classifier().spawns(thing)


@pytest.mark.parametrize("where", ["tests.conftest:make_stack",
                                   "tests.ledger_support:valkey_server"])
def test_the_shared_server_fixtures_are_external(where: str) -> None:
    module, _, name = where.partition(":")
    fixture = getattr(importlib.import_module(module), name)
    func = getattr(fixture, "_get_wrapped_function", lambda: fixture)()
    assert tiers.Classifier().spawns(func), fixture


def test_an_in_process_test_that_starts_a_program_fails_naming_it() -> None:
    """The enforcement: a Popen under a test not marked external raises pytest's
    failure (a BaseException, past ``except Exception``) and records the violation,
    so a test that swallows it fails all the same (conftest's makereport)."""
    item = SimpleNamespace(nodeid="tests/x.py::test_y", stash=pytest.Stash(),
                           get_closest_marker=lambda name: None)
    popen = __import__("subprocess").Popen  # hidden from the classifier
    tiers.set_current(item)  # type: ignore[arg-type]
    try:
        with pytest.raises(pytest.fail.Exception,
                           match=r"tests/x.py::test_y starts a child process \(true\)"):
            popen(["true"])
    finally:
        tiers.set_current(None)
    assert "mark it @pytest.mark.external" in (tiers.violation(item) or "")  # type: ignore[arg-type]


@pytest.mark.parametrize(("argv", "program"), [
    (["/usr/bin/envoy", "-c", "x"], "envoy"),
    ([sys.executable, "-I", "/r/devtools/proc.py", "1", "--", sys.executable, "-m",
      "sidecar", "--x"], "sidecar"),
    ([sys.executable, "-I", "/r/devtools/proc.py", "1", "--nofile=9", "--",
      "/v/valkey-server", "--port", "1"], "valkey-server"),
    ("ls -l", "ls -l"),
])
def test_the_program_is_named_past_the_launcher(argv: Any, program: str) -> None:
    assert tiers.program_of(argv) == program


def test_the_journal_keeps_what_came_since_a_count() -> None:
    journal = Journal(maxlen=3)
    journal.write("w1", "a")
    mark = journal.count
    for event in "bcde":
        journal.write("w1", event)
    lines = journal.since(mark)
    assert [ln.rsplit(" ", 1)[1] for ln in lines] == ["c", "d", "e"]  # bounded: b is gone
    assert journal.since(journal.count) == []


async def test_the_fake_workers_write_each_request_and_its_outcome() -> None:
    from devtools.fleet import JOURNAL

    mark = JOURNAL.count
    async with Fleet(1, service_time=0.0) as fleet:
        r = await request(fleet.workers[0].port, headers={"x-request-id": "rid-7"})
        assert r.status == 200
    text = "\n".join(JOURNAL.since(mark))
    assert "w1 listening on" in text
    assert "POST /v1/chat/completions id=rid-7" in text
    assert "id=rid-7 finished after" in text
    assert "w1 stopping" in text


INNER_CONFTEST = """
from tests.conftest import (pytest_collection_modifyitems, pytest_configure,
                            pytest_runtest_makereport, pytest_runtest_protocol,
                            pytest_unconfigure)
"""

INNER_TESTS = '''
import asyncio, importlib, subprocess, time

import aiohttp

from devtools.fleet import Fleet


def start_child(log):
    with log.open("ab") as out:
        return subprocess.Popen(["sh", "-c", "echo the-child-said-this; exec sleep 60"],
                                stdout=out, stderr=out)


async def one_request():
    async with Fleet(1, service_time=0.0) as fleet, aiohttp.ClientSession() as s:
        async with s.post(fleet.urls[0] + "/v1/chat/completions", data=b"{}",
                          headers={"x-request-id": "inner-1"}) as r:
            assert r.status == 200


def test_fails_with_a_child(tmp_path):
    log = tmp_path / "child.log"
    proc = start_child(log)
    try:
        deadline = time.monotonic() + 30
        while "the-child-said-this" not in log.read_text():
            assert time.monotonic() < deadline, "the child never wrote its line"
            time.sleep(0.02)
        asyncio.run(one_request())
        assert False, "the inner failure"
    finally:
        proc.kill()
        proc.wait()


def test_hides_its_child():
    popen = getattr(importlib.import_module("subprocess"), "Popen")
    try:
        popen(["true"]).wait()
    except BaseException:
        pass  # swallowed: the test must fail all the same


def test_in_process():
    assert True
'''


def test_a_failed_run_names_its_failures_and_shows_the_logs_of_what_it_ran(
        tmp_path: Path) -> None:
    """An inner pytest run with this suite's hooks and pyproject settings: the summary
    names each failure (-rfE), the failed test's report ends with its child's log and
    the fake workers' journal, a hidden Popen in an in-process test fails it, and
    ``-m 'not external'`` leaves out the test whose helper starts a process."""
    import subprocess

    (tmp_path / "conftest.py").write_text(INNER_CONFTEST)
    (tmp_path / "test_inner.py").write_text(textwrap.dedent(INNER_TESTS))
    env = {**os.environ, "PYTHONPATH": str(REPO), "SMG_LOG_TAIL_LINES": "5",
           "COLUMNS": "200"}
    base = [sys.executable, "-m", "pytest", "-c", str(REPO / "pyproject.toml"),
            "--rootdir", str(tmp_path), "-p", "no:cacheprovider", "test_inner.py"]

    run = subprocess.run(base, cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120)
    out = run.stdout + run.stderr
    assert run.returncode == 1, out
    assert "FAILED test_inner.py::test_fails_with_a_child - AssertionError: the inner failure" \
        in out
    assert "sh log, last 5 lines (exited" in out and "the-child-said-this" in out
    assert "fake workers' journal" in out and "POST /v1/chat/completions id=inner-1" in out
    assert "FAILED test_inner.py::test_hides_its_child" in out
    assert "starts a child process (true) but was classified in-process" in out
    assert "2 failed, 1 passed" in out

    fast = subprocess.run([*base, "-m", "not external"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    out = fast.stdout + fast.stderr
    assert "1 failed, 1 passed, 1 deselected" in out, out
