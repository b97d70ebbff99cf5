"""Who may decide admission through the coordination server: credentials, server settings,
the library's integrity, and a second fleet under the same id.

Against a real valkey-server of this module's own (ACL users are created with ACL SETUSER;
the default user stays open so that the tests can set things up and look).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import ssl
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as redis
import yaml
from structlog.testing import capture_logs

from devtools.proc import die_with_parent
from devtools.valkey import ValkeyServer, free_port, server_binary
from sidecar.app import build_runtime
from sidecar.classes import PriorityClass
from sidecar.config import DEFAULT_POOL, ConfigError, parse_settings
from sidecar.coordination.credentials import (
    PASSWORD_ENV,
    redact_url,
    url_has_password,
    with_password,
)
from sidecar.coordination.ledger import (
    LIBRARY,
    LUA,
    FleetLedger,
    LibraryMismatch,
    LibraryState,
    library_state,
)
from sidecar.coordination.server import _load_every, check_server, check_server_at
from sidecar.coordination.server import main as server_main
from sidecar.metrics import Metrics
from sidecar.scheduler import BUILTIN_CLASSES

ROOT = Path(__file__).resolve().parent.parent
SECRET = "s3cr3t-Pa55/w@rd"  # "/" and "@" unencoded: the redaction must still hold


@pytest.fixture(scope="module")
def acl_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ValkeyServer]:
    server = ValkeyServer(tmp_path_factory.mktemp("valkey-acl"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
async def admin(acl_server: ValkeyServer) -> AsyncIterator[redis.Redis]:
    """The default user (unrestricted here): sets up users, loads, looks."""
    c = redis.Redis(port=acl_server.port, decode_responses=True)
    await c.flushall()
    await c.function_flush()
    try:
        yield c
    finally:
        await c.aclose()


def password_file(tmp_path: Path, text: str = SECRET + "\n") -> Path:
    p = tmp_path / "coordination-password"
    p.write_text(text)
    return p


BASE = ["--priority-scheduler-enabled"]


# ------------------------------------------------------------------ URLs and flags


@pytest.mark.parametrize(("url", "shown"), [
    ("redis://user:pw@host:6379/0", "redis://user:***@host:6379/0"),
    ("redis://:pw@host:6379", "redis://:***@host:6379"),
    ("redis://user@host", "redis://user@host"),
    ("rediss://u:p/w@rd@host:6380/1", "rediss://u:***@host:6380/1"),
    ("unix://u:pw@/run/valkey.sock?db=1", "unix://u:***@/run/valkey.sock?db=1"),
    ("redis://host/0?password=pw&db=1", "redis://host/0?password=***&db=1"),
    ("redis:u:pw@host", "***@host"),
    ("u:pw@host", "***@host"),
    ("redis://host:6379/0", "redis://host:6379/0"),
])
def test_redact_url(url: str, shown: str) -> None:
    assert redact_url(url) == shown
    assert "pw" not in redact_url(url, keep_user=False).replace("password", "")


def test_with_password_round_trips_through_the_client_parser() -> None:
    from redis.connection import parse_url
    for url in ("redis://app@h:1/0", "redis://h:1/0", "rediss://app@h:1", "unix:///tmp/s.sock"):
        assert not url_has_password(url)
        full = with_password(url, SECRET)
        opts = parse_url(full)
        assert opts["password"] == SECRET, full
        assert SECRET not in redact_url(full)


@pytest.mark.parametrize("url", [
    f"redis://app:{SECRET}@127.0.0.1:6379/0",
    f"redis://:{SECRET}@127.0.0.1:notaport/0",  # bad URL and a password: neither echoed
    f"rediss://app:{SECRET}@/0",
    f"redis://127.0.0.1/0?password={SECRET}",
    f"redis:app:{SECRET}@127.0.0.1",
    f"ftp://app:{SECRET}@127.0.0.1",
])
def test_a_password_in_the_url_is_refused_and_never_echoed(url: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_settings([*BASE, "--coordination-url", url])
    text = str(err.value)
    assert "--coordination-url" in text
    assert SECRET not in text and "s3cr3t" not in text and "w@rd" not in text


@pytest.mark.parametrize("url", ["redis://127.0.0.1:x/0", "redis:///0", "http://h"])
def test_bad_urls_without_password_still_name_the_flag(url: str) -> None:
    with pytest.raises(ConfigError, match="--coordination-url"):
        parse_settings([*BASE, "--coordination-url", url])


def test_password_from_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PASSWORD_ENV, raising=False)
    s = parse_settings([*BASE, "--coordination-url", "redis://app@127.0.0.1:6379/0",
                        "--coordination-password-file", str(password_file(tmp_path))])
    assert s.coordination_password == SECRET  # the final line break is no part of it
    assert SECRET not in repr(s)


def test_password_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PASSWORD_ENV, SECRET)
    s = parse_settings([*BASE, "--coordination-url", "redis://127.0.0.1:6379/0"])
    assert s.coordination_password == SECRET
    # Without coordination the variable means nothing.
    assert parse_settings(BASE).coordination_password is None


@pytest.mark.parametrize(("content", "reason"), [
    (None, "cannot read"), ("", "empty"), ("\n", "empty"), ("a\nb\n", "more than one line"),
])
def test_bad_password_file_is_a_startup_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, content: str | None,
        reason: str) -> None:
    monkeypatch.delenv(PASSWORD_ENV, raising=False)
    path = tmp_path / "pw"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError, match=f"--coordination-password-file.*{reason}"):
        parse_settings([*BASE, "--coordination-url", "redis://127.0.0.1:6379/0",
                        "--coordination-password-file", str(path)])


def test_password_file_and_environment_together_are_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PASSWORD_ENV, "other")
    with pytest.raises(ConfigError, match="give the password once") as err:
        parse_settings([*BASE, "--coordination-url", "redis://127.0.0.1:6379/0",
                        "--coordination-password-file", str(password_file(tmp_path))])
    assert "other" not in str(err.value)


def test_password_file_needs_a_url(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="requires --coordination-url"):
        parse_settings([*BASE, "--coordination-password-file", str(password_file(tmp_path))])


# ------------------------------------------------------------- the process, end to end


async def create_runtime_user(c: redis.Redis, user: str, fleet: str, password: str) -> None:
    """The shipped runtime user (k8s/base/valkey-acl.yaml) for ``fleet``: its fleet's keys,
    FCALL and the few reads the sidecar needs; no FUNCTION LOAD, no CONFIG SET, no FLUSHALL."""
    rules = [r.replace("{priority-gate}", f"{{{fleet}}}") for r in runtime_rules()]
    await c.execute_command("ACL", "SETUSER", user, "reset", "on", f">{password}", *rules)


def runtime_rules() -> list[str]:
    """The fleet runtime user's rules as k8s/base/valkey-acl.yaml ships them (one source:
    tests/test_k8s.py checks them against ledger.lua, this module runs a sidecar under them)."""
    acl = yaml.safe_load((ROOT / "k8s" / "base" / "valkey-acl.yaml").read_text())
    return list(acl["data"]["runtime-rules"].split())


def run_sidecar(tmp_path: Path, args: list[str], until: Callable[[set[str]], bool],
                seconds: float, env: dict[str, str] | None = None,
                deadline: float = 60.0) -> tuple[str, list[str]]:
    """Run ``python -m sidecar`` at debug level for at least ``seconds`` (its periodic
    paths log too) and until the events it logged satisfy ``until`` (or it exits, or
    ``deadline`` s pass: a loaded box may take seconds to start it), then SIGTERM; its
    output and argv as the OS shows it."""
    argv = [sys.executable, "-m", "sidecar", "--grpc-listen", f"127.0.0.1:{free_port()}",
            "--http-listen", f"127.0.0.1:{free_port()}", "--log-format", "json",
            "--log-level", "debug", *args]
    out = tmp_path / "sidecar.log"
    with out.open("wb") as f:
        proc = subprocess.Popen(die_with_parent(argv), stdout=f, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    try:
        start = time.monotonic()
        while proc.poll() is None and time.monotonic() < start + deadline and (
                time.monotonic() < start + seconds
                or not until({str(e.get("event")) for e in events(out.read_text())})):
            time.sleep(0.05)
        cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes().decode().split("\0") \
            if proc.poll() is None else []
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return out.read_text(), cmdline


def events(output: str) -> list[dict[str, Any]]:
    found = []
    for line in output.splitlines():
        try:
            found.append(json.loads(line))
        except ValueError:
            continue
    return found


@pytest.mark.parametrize("right", [True, False], ids=["right-password", "wrong-password"])
async def test_no_log_line_and_no_argv_holds_the_password(
        tmp_path: Path, acl_server: ValkeyServer, admin: redis.Redis,
        monkeypatch: pytest.MonkeyPatch, right: bool) -> None:
    monkeypatch.delenv(PASSWORD_ENV, raising=False)
    await create_runtime_user(admin, "fleet-a", "a", SECRET)
    await admin.function_load(LUA)  # the admin's job: the runtime user may not
    pw = password_file(tmp_path, (SECRET if right else SECRET + "-wrong") + "\n")
    # What the run must have logged by the time it is stopped (checked below).
    want = ({"started", "coordination_registered", "coordination_server_unchecked"} if right
            else {"started", "coordination_unreachable_at_startup"})
    output, cmdline = await asyncio.to_thread(run_sidecar, tmp_path, [
        "--priority-scheduler-enabled", "--worker-capacity-override", "4",
        "--coordination-url", f"redis://fleet-a@127.0.0.1:{acl_server.port}/0",
        "--coordination-password-file", str(pw), "--fleet-id", "a", "--replica-id", "r1",
        "--replica-ttl-secs", "1"], until=want.issubset, seconds=3.0)
    names = [e.get("event") for e in events(output)]
    assert "started" in names, output
    if right:
        assert "coordination_registered" in names, output
        # The shipped runtime user may not CONFIG GET: said, not fatal.
        assert [e.get("reason") for e in events(output)
                if e.get("event") == "coordination_server_unchecked"] == ["denied"], output
    else:
        assert "coordination_unreachable_at_startup" in names, output
    assert cmdline and not any("s3cr3t" in a for a in cmdline)
    assert "s3cr3t" not in output and SECRET not in output


def test_a_bad_url_with_a_password_exits_2_without_echoing_it(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "sidecar", "--priority-scheduler-enabled", "--coordination-url",
         f"redis://app:{SECRET}@127.0.0.1:notaport/0"],
        capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "--coordination-url" in proc.stderr
    assert "s3cr3t" not in proc.stderr + proc.stdout


# ------------------------------------------------------------------- server settings


async def test_server_check_warns_about_eviction_and_persistence(admin: redis.Redis) -> None:
    metrics = Metrics(tenant_top_n=4)
    before = await admin.config_get("maxmemory-policy")
    try:
        await admin.config_set("maxmemory-policy", "allkeys-lru")
        await admin.config_set("appendonly", "yes")
        with capture_logs() as logs:
            got = await check_server(admin, metrics)
        assert got == {"eviction": "risk", "persistence": "risk"}
        names = {e["event"] for e in logs}
        assert {"coordination_server_evicts", "coordination_server_persists"} <= names
        assert sample(metrics, "smg_sidecar_coordination_server_check",
                      check="eviction", result="risk") == 1
    finally:
        await admin.config_set("appendonly", "no")
        await admin.config_set("maxmemory-policy", before["maxmemory-policy"])
    with capture_logs() as logs:
        assert await check_server(admin, metrics) == {"eviction": "ok", "persistence": "ok"}
    assert not logs
    assert sample(metrics, "smg_sidecar_coordination_server_check",
                  check="eviction", result="risk") == 0


async def test_server_check_denied_says_it_could_not_check(
        acl_server: ValkeyServer, admin: redis.Redis) -> None:
    await admin.execute_command("ACL", "SETUSER", "nocfg", "reset", "on", ">pw",
                                "~pg:{a}*", "+@connection", "+ping")
    metrics = Metrics(tenant_top_n=4)
    with capture_logs() as logs:
        got = await check_server_at(f"redis://nocfg:pw@127.0.0.1:{acl_server.port}/0", 1.0,
                                    metrics)
    assert got == {"eviction": "unknown", "persistence": "unknown"}
    assert [e.get("reason") for e in logs if e["event"] == "coordination_server_unchecked"] \
        == ["denied"]
    assert sample(metrics, "smg_sidecar_coordination_server_check",
                  check="persistence", result="unknown") == 1


# ------------------------------------------------------------------------- library

EVIL = LUA.replace("redis.register_function", "-- replaced\nredis.register_function")


async def fleet_ledger(acl_server: ValkeyServer, user: str, password: str,
                       fleet: str = "a", replica: str = "r1") -> FleetLedger:
    c = redis.Redis(port=acl_server.port, username=user, password=password,
                    decode_responses=True)
    return FleetLedger(c, fleet, replica)


async def test_runtime_user_cannot_replace_the_library_or_touch_another_fleet(
        acl_server: ValkeyServer, admin: redis.Redis) -> None:
    await create_runtime_user(admin, "fleet-a", "a", "pa")
    await admin.function_load(LUA)
    led = await fleet_ledger(acl_server, "fleet-a", "pa")
    c = led.client
    try:
        await led.register(BUILTIN_CLASSES, 4)
        assert led.library_state is LibraryState.OK
        for cmd in (("FUNCTION", "LOAD", "REPLACE", EVIL), ("FUNCTION", "FLUSH"),
                    ("FUNCTION", "DELETE", LIBRARY), ("FLUSHALL",),
                    ("CONFIG", "SET", "maxmemory-policy", "allkeys-lru"),
                    ("HSET", "pg:{b}:cfg", "0", "x"), ("KEYS", "*")):
            with pytest.raises(redis.ResponseError, match=r"(?i)noperm|permission"):
                await c.execute_command(*cmd)
        # Its own fleet through the library: fine. Another fleet's keys, even via FCALL: no.
        other = FleetLedger(c, "b", "r1")
        with pytest.raises(redis.ResponseError, match=r"(?i)noperm|permission|ACL"):
            await other.register(BUILTIN_CLASSES, 4)
    finally:
        await c.aclose()


async def test_a_replaced_library_is_refused_and_the_replica_degrades(
        acl_server: ValkeyServer, admin: redis.Redis) -> None:
    await admin.function_load(LUA)
    led = FleetLedger(redis.Redis(port=acl_server.port, decode_responses=True), "a", "r1")
    try:
        await led.register(BUILTIN_CLASSES, 4)
        # Someone with FUNCTION LOAD puts other code under the public name.
        await admin.function_load(EVIL, replace=True)
        with capture_logs() as logs:
            assert await led.verify_library() is LibraryState.MISMATCH
        assert "coordination_library_mismatch" in {e["event"] for e in logs}
        with pytest.raises(LibraryMismatch):
            await led.heartbeat()
        # The admin loads the shipped code again: calls run again.
        assert await asyncio.to_thread(server_main, [
            "load", "--coordination-url", f"redis://127.0.0.1:{acl_server.port}/0"]) == 0
        assert await led.verify_library() is LibraryState.OK
        assert (await led.heartbeat()).capacity == 4
    finally:
        await led.client.aclose()


async def test_a_replaced_library_found_at_start_is_never_called(
        acl_server: ValkeyServer, admin: redis.Redis) -> None:
    await admin.function_load(EVIL)  # there first, under this version's name
    led = FleetLedger(redis.Redis(port=acl_server.port, decode_responses=True), "a", "r1")
    try:
        with pytest.raises(LibraryMismatch):
            await led.register(BUILTIN_CLASSES, 4)
        assert not await admin.exists("pg:{a}:replicas")  # its code never ran
        # Nor does a replica that finds it missing-then-present overwrite it.
        await admin.function_flush()
        await admin.function_load(EVIL)
        led2 = FleetLedger(redis.Redis(port=acl_server.port, decode_responses=True), "a", "r2")
        with pytest.raises(LibraryMismatch):
            await led2.load_library()
        assert (await library_state(admin)) is LibraryState.MISMATCH
        await led2.client.aclose()
    finally:
        await led.client.aclose()


async def test_the_watch_counts_a_mismatch_and_the_controller_degrades(
        tmp_path: Path, acl_server: ValkeyServer, admin: redis.Redis) -> None:
    await admin.function_load(LUA)
    settings = parse_settings([
        "--priority-scheduler-enabled", "--grpc-listen", "127.0.0.1:0",
        "--http-listen", "127.0.0.1:0", "--worker-capacity-override", "4",
        "--log-format", "json", "--coordination-url",
        f"redis://127.0.0.1:{acl_server.port}/0", "--fleet-id", "a", "--replica-id", "r1",
        "--replica-ttl-secs", "1"])
    app = await build_runtime(settings)
    await app.serve()
    try:
        fleet = app.pools[DEFAULT_POOL].fleet
        assert fleet is not None and fleet.state == "ok"
        await admin.function_load(EVIL, replace=True)

        def mismatches() -> float:
            return sample(app.metrics, "smg_sidecar_coordination_library_mismatch_total")

        # The watch counts the mismatch and the controller degrades. On a loaded box a
        # slow call can degrade it first: wait for both, not for the state alone.
        deadline = time.monotonic() + 30
        while not (fleet.state == "degraded" and mismatches() >= 1):
            assert time.monotonic() < deadline, \
                f"after 30 s: state {fleet.state}, {mismatches()} mismatches counted"
            await asyncio.sleep(0.05)
        assert sample(app.metrics, "smg_sidecar_coordination_library_state",
                      state="mismatch") == 1
        await admin.function_load(LUA, replace=True)
        deadline = time.monotonic() + 30
        while fleet.state != "ok":
            assert time.monotonic() < deadline, f"after 30 s: state {fleet.state}, not ok"
            await asyncio.sleep(0.05)
    finally:
        await app.stop()


# Other code under this version's name, as someone with FUNCTION LOAD REPLACE could put
# there: one that admits every request (and otherwise answers like ours), one that answers
# every call with an error, one whose replies have another shape.
GREEDY = LUA.replace("if queued == 0 and avail >= 1 then", "if true then", 1)
FAILING = LUA.replace("local function run(keys, argv)\n",
                      "local function run(keys, argv)\n"
                      "  if keys then return redis.error_reply('ERR not today') end\n", 1)
ODD = LUA.replace("return {gen, loss, taken, reply, redis.call('ZCARD', K_REPLICAS)}",
                  "return {gen, loss, taken, reply}", 1)
assert GREEDY != LUA and FAILING != LUA and ODD != LUA


async def test_a_library_swapped_after_start_is_refused_by_the_next_heartbeat(
        acl_server: ValkeyServer, admin: redis.Redis) -> None:
    # Every heartbeat verifies first (before: only the watch, every --replica-ttl-secs, so
    # a library swapped for less than that ran every call in between unnoticed).
    await admin.function_load(LUA)
    led = FleetLedger(redis.Redis(port=acl_server.port, decode_responses=True), "a", "r1")
    try:
        await led.register(BUILTIN_CLASSES, 1)
        await admin.function_load(GREEDY, replace=True)
        gen = int(await admin.get("pg:{a}:gen") or 0)
        with pytest.raises(LibraryMismatch):
            await led.heartbeat()
        assert int(await admin.get("pg:{a}:gen") or 0) == gen  # its code never ran
        assert led.library_state is LibraryState.MISMATCH
        await admin.function_load(LUA, replace=True)
        assert (await led.heartbeat()).capacity == 1  # the next heartbeat finds it back
        assert led.library_state is LibraryState.OK
    finally:
        await led.client.aclose()


async def test_a_new_connection_verifies_the_library_before_its_first_call(
        acl_server: ValkeyServer, admin: redis.Redis) -> None:
    await admin.function_load(LUA)
    led = FleetLedger(redis.Redis(port=acl_server.port, decode_responses=True), "a", "r1",
                      pipelined=True)
    try:
        await led.register(BUILTIN_CLASSES, 1)
        assert (await led.arrive("x", PriorityClass.BULK, "t")).status.value == "admitted"
        await admin.function_load(GREEDY, replace=True)
        await admin.execute_command("CLIENT", "KILL", "TYPE", "normal")  # not this one
        for _ in range(200):
            if led.connected is False:
                break
            await asyncio.sleep(0.01)
        assert led.connected is False, "the ledger's connection did not see the kill"
        with pytest.raises(LibraryMismatch):  # GREEDY would have admitted it past 1
            await led.arrive("y", PriorityClass.BULK, "t")
    finally:
        await led.aclose()
        await led.client.aclose()


@pytest.mark.parametrize("other", ["FAILING", "ODD"])
async def test_an_error_or_malformed_reply_verifies_the_library_at_once(
        acl_server: ValkeyServer, admin: redis.Redis, other: str) -> None:
    await admin.function_load(LUA)
    led = FleetLedger(redis.Redis(port=acl_server.port, decode_responses=True), "a", "r1")
    seen: list[LibraryState] = []
    led.on_library = seen.append
    try:
        await led.register(BUILTIN_CLASSES, 1)
        await admin.function_load({"FAILING": FAILING, "ODD": ODD}[other], replace=True)
        with pytest.raises(LibraryMismatch):
            await led.arrive("x", PriorityClass.BULK, "t")
        assert seen[-1] is LibraryState.MISMATCH
    finally:
        await led.client.aclose()


async def test_a_library_swapped_for_less_than_a_ttl_is_counted_and_refused(
        tmp_path: Path, acl_server: ValkeyServer, admin: redis.Redis) -> None:
    # The bound: a swap is found by the next heartbeat (every 0.3 x --replica-ttl-secs),
    # or at once by a call it answers oddly; here it lasts one heartbeat interval and a
    # call timeout, half the watch's period, and no request comes meanwhile.
    ttl = 4.0
    bound = 0.3 * ttl + ttl / 5  # a heartbeat interval and a call timeout
    await admin.function_load(LUA)
    settings = parse_settings([
        "--priority-scheduler-enabled", "--grpc-listen", "127.0.0.1:0",
        "--http-listen", "127.0.0.1:0", "--worker-capacity-override", "4",
        "--log-format", "json", "--coordination-url",
        f"redis://127.0.0.1:{acl_server.port}/0", "--fleet-id", "a", "--replica-id", "r1",
        "--replica-ttl-secs", str(ttl)])
    app = await build_runtime(settings)
    await app.serve()
    try:
        fleet = app.pools[DEFAULT_POOL].fleet
        assert fleet is not None and fleet.state == "ok"
        mismatches = sample(app.metrics, "smg_sidecar_coordination_library_mismatch_total")
        await admin.function_load(GREEDY, replace=True)
        t0 = time.monotonic()
        found = None
        while time.monotonic() - t0 < bound:
            if sample(app.metrics, "smg_sidecar_coordination_library_mismatch_total") \
                    > mismatches:
                found = time.monotonic() - t0
                break
            await asyncio.sleep(0.01)
        await admin.function_load(LUA, replace=True)
        print(f"library swapped for {time.monotonic() - t0:.2f} s: counted after "
              f"{found} s (bound {bound:.2f} s, the watch's period {ttl} s)")
        assert found is not None, f"a swap of {bound:.2f} s went unnoticed"
        assert fleet.state == "degraded"  # refused: its calls went nowhere
        deadline = time.monotonic() + 3 * ttl
        while fleet.state != "ok" and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert fleet.state == "ok"
        assert sample(app.metrics, "smg_sidecar_coordination_library_state", state="ok") == 1
    finally:
        await app.stop()


def sample(metrics: Metrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def test_the_shipped_acl_script_makes_a_server_with_only_those_users(tmp_path: Path) -> None:
    """k8s/base/valkey-acl.yaml's make-acl.sh, run as the init container runs it, gives a
    valkey-server (as k8s/base/valkey.yaml starts it) the admin, runtime and health users,
    and nothing for an unauthenticated client."""
    acl = yaml.safe_load((ROOT / "k8s" / "base" / "valkey-acl.yaml").read_text())["data"]
    (tmp_path / "sec").mkdir()
    (tmp_path / "rules").mkdir()
    (tmp_path / "acl").mkdir()
    (tmp_path / "sec" / "admin-password").write_text("admin-pw\n")
    (tmp_path / "sec" / "runtime-password").write_text(SECRET + "\n")
    (tmp_path / "rules" / "runtime-rules").write_text(acl["runtime-rules"])
    script = (acl["make-acl.sh"].replace("/run/secrets/valkey", str(tmp_path / "sec"))
              .replace("/etc/valkey-acl", str(tmp_path / "rules"))
              .replace("/acl/", str(tmp_path / "acl") + "/"))
    subprocess.run(["sh", "-c", script], check=True, timeout=30)
    users_acl = (tmp_path / "acl" / "users.acl").read_text()
    assert SECRET not in users_acl and "admin-pw" not in users_acl
    port = free_port()
    log = (tmp_path / "valkey.log").open("wb")
    proc = subprocess.Popen(die_with_parent([
        server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
        "--appendonly", "no", "--dir", str(tmp_path), "--aclfile",
        str(tmp_path / "acl" / "users.acl"), "--protected-mode", "yes"]),
        stdout=log, stderr=subprocess.STDOUT)
    log.close()
    try:
        import redis as sync_redis

        def client(**kw: Any) -> sync_redis.Redis:
            return sync_redis.Redis(port=port, decode_responses=True, socket_timeout=2, **kw)

        deadline = time.monotonic() + 10
        while True:
            try:
                client(username="health", password="-").ping()
                break
            except sync_redis.ConnectionError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise
                time.sleep(0.05)
        with pytest.raises((sync_redis.ResponseError, sync_redis.AuthenticationError)):
            client().get("pg:{priority-gate}:x")  # default user: off
        admin = client(username="admin", password="admin-pw")
        admin.function_load(LUA)
        runtime = client(username="priority-gate", password=SECRET)
        with pytest.raises(sync_redis.ResponseError, match=r"(?i)noperm|permission"):
            runtime.function_load(LUA, replace=True)
        with pytest.raises(sync_redis.ResponseError, match=r"(?i)noperm|permission"):
            runtime.get("pg:{other}:x")
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


# ---------------------------------------------------------- one fleet id, two deployments


async def start(tmp_path: Path, port: int, replica: str, capacity: int,
                priority: str = "") -> Any:
    cfg = tmp_path / f"priority-{replica}.yaml"
    cfg.write_text(priority)
    app = await build_runtime(parse_settings([
        "--priority-scheduler-enabled", "--priority-scheduler-config", str(cfg),
        "--grpc-listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0",
        "--worker-capacity-override", str(capacity), "--log-format", "json",
        "--coordination-url", f"redis://127.0.0.1:{port}/0", "--fleet-id", "shared",
        "--replica-id", replica, "--replica-ttl-secs", "1"]))
    await app.serve()
    return app


async def test_a_second_deployment_with_the_same_fleet_id_is_logged_and_counted(
        tmp_path: Path, acl_server: ValkeyServer, admin: redis.Redis) -> None:
    await admin.function_load(LUA)
    with capture_logs() as logs:
        # Deployment A: two replicas alike (same classes, same capacity source).
        a1 = await start(tmp_path, acl_server.port, "a1", 8)
        a2 = await start(tmp_path, acl_server.port, "a2", 8)
        try:
            await asyncio.sleep(3.5)  # three checks
            assert sample(a1.metrics, "smg_sidecar_fleet_collision_total", kind="config") == 0
            assert sample(a1.metrics, "smg_sidecar_fleet_collision_total",
                          kind="capacity_source") == 0
            # Deployment B, started by mistake with A's fleet id: other workers, other
            # classes. The fleet's capacity silently became B's 2: now it is reported.
            b = await start(tmp_path, acl_server.port, "b1", 2,
                            "classes:\n  bulk:\n    queue_size: 7\n")
            try:
                def all_counted() -> bool:
                    return all(sample(app.metrics, "smg_sidecar_fleet_collision_total",
                                      kind=kind) >= 1
                               for app in (a1, a2, b) for kind in ("config", "capacity_source"))

                deadline = time.monotonic() + 10
                while time.monotonic() < deadline and not all_counted():
                    await asyncio.sleep(0.1)
                for app in (a1, a2, b):
                    for kind in ("config", "capacity_source"):
                        assert sample(app.metrics, "smg_sidecar_fleet_collision_total",
                                      kind=kind) == 1, (app.settings.replica_id, kind)
                await asyncio.sleep(2.5)  # reported once, not every check
                assert sample(a1.metrics, "smg_sidecar_fleet_collision_total",
                              kind="config") == 1
            finally:
                await b.stop()
        finally:
            await a1.stop()
            await a2.stop()
    found = [e for e in logs if e["event"] == "fleet_collision"]
    assert {(e["replica"], e["kind"]) for e in found} == {
        (r, k) for r in ("a1", "a2", "b1") for k in ("config", "capacity_source")}
    assert all(len(e["values"]) == 2 and e["log_level"] == "error" for e in found)


async def test_the_loader_loads_again_and_checks_the_server_as_admin(
        acl_server: ValkeyServer, admin: redis.Redis) -> None:
    before = await admin.config_get("maxmemory-policy")
    await admin.config_set("maxmemory-policy", "volatile-lru")
    try:
        url = f"redis://127.0.0.1:{acl_server.port}/0"
        with capture_logs() as logs:
            task = asyncio.ensure_future(_load_every(url, 0.1))
            try:
                deadline = time.monotonic() + 10
                while await library_state(admin) is not LibraryState.OK:
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.05)
                await admin.function_flush()  # the server lost its data: loaded again
                while await library_state(admin) is not LibraryState.OK:
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.05)
            finally:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        names = [e["event"] for e in logs]
        assert names.count("ledger_library_loaded") == 1  # a change is logged, not each load
        assert "coordination_server_evicts" in names
    finally:
        await admin.config_set("maxmemory-policy", before["maxmemory-policy"])


# ---------------------------------------------------------------------------- TLS


def make_certs(d: Path) -> None:
    """A CA and a server certificate for 127.0.0.1 (openssl CLI)."""
    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True, timeout=60)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem",
        "-days", "2", "-subj", "/CN=priority-gate test CA")
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "srv.key", "-out", "srv.csr",
        "-subj", "/CN=127.0.0.1")
    (d / "ext").write_text("subjectAltName=IP:127.0.0.1\n")
    run("x509", "-req", "-in", "srv.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
        "-CAcreateserial", "-out", "srv.pem", "-days", "2", "-extfile", "ext")


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl CLI not installed")
async def test_rediss_with_a_password_file_and_a_private_ca(
        tmp_path: Path, acl_server: ValkeyServer, admin: redis.Redis,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """rediss:// as documented: the server's certificate checked against ssl_ca_certs, the
    runtime user's password from the file. (The test server has no TLS build: a TLS proxy
    in front of it stands in for a TLS-enabled server.)"""
    monkeypatch.delenv(PASSWORD_ENV, raising=False)
    await asyncio.to_thread(make_certs, tmp_path)
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(tmp_path / "srv.pem", tmp_path / "srv.key")
    tls_connections = 0

    async def pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            while data := await r.read(65536):
                w.write(data)
                await w.drain()
        except (ConnectionError, ssl.SSLError):
            pass
        finally:
            w.close()

    async def proxy(cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        nonlocal tls_connections
        tls_connections += 1
        sr, sw = await asyncio.open_connection("127.0.0.1", acl_server.port)
        await asyncio.gather(pipe(cr, sw), pipe(sr, cw))

    tls = await asyncio.start_server(proxy, "127.0.0.1", 0, ssl=ctx)
    port = tls.sockets[0].getsockname()[1]
    await create_runtime_user(admin, "fleet-t", "t", SECRET)
    await admin.function_load(LUA)
    pw = password_file(tmp_path)
    base = ["--priority-scheduler-enabled", "--grpc-listen", "127.0.0.1:0",
            "--http-listen", "127.0.0.1:0", "--worker-capacity-override", "4",
            "--log-format", "json", "--fleet-id", "t", "--replica-id", "r1",
            "--coordination-password-file", str(pw), "--coordination-url"]
    try:
        app = await build_runtime(parse_settings([
            *base, f"rediss://fleet-t@127.0.0.1:{port}/0?ssl_ca_certs={tmp_path / 'ca.pem'}"]))
        try:
            fleet = app.pools[DEFAULT_POOL].fleet
            assert fleet is not None and fleet.state == "ok"
            assert await admin.exists("pg:{t}:replicas") and tls_connections >= 1
        finally:
            await app.stop()
        # Without the CA the certificate is refused: the replica starts degraded, no share.
        with capture_logs() as logs:
            app = await build_runtime(parse_settings([*base, f"rediss://fleet-t@127.0.0.1:{port}/0"]))
        try:
            fleet = app.pools[DEFAULT_POOL].fleet
            assert fleet is not None and fleet.state == "degraded"
            assert any(e["event"] == "coordination_unreachable_at_startup" for e in logs)
            assert SECRET not in repr(logs)
        finally:
            await app.stop()
    finally:
        tls.close()
        await tls.wait_closed()
