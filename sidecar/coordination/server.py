"""The coordination server as an operator deploys it: credentials, its settings, the library.

* **Credentials** (password file or environment, URLs printed redacted) are in
  :mod:`sidecar.coordination.credentials`.
* **Settings.** :func:`check_server` reads ``maxmemory-policy`` and the persistence settings
  once at start-up: an evicting policy can drop a ledger key (slots freed while in use), and
  RDB/AOF can bring back a stale copy after a restart (admissions long ended, or missing the
  ones made since). Risky settings are warned about and shown in
  ``smg_sidecar_coordination_server_check``; a user that may not run ``CONFIG GET`` gets an
  "could not check" instead of a failure.
* **Fleet id.** :func:`watch_fleet` notices a second deployment under the same fleet id
  (a second class config or capacity source among the live replicas).
* **Library.** The ledger client verifies the loaded library (compares it with this
  version's code, :meth:`FleetLedger.verify_library`) before its first call, before every
  registering call (each heartbeat), before the first call on a new connection, and
  whenever a reply is an error or malformed; :func:`watch_library` adds a check every so
  often and turns every check's result into the library metrics. A library replaced by
  someone else makes the replica degrade instead of obeying it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
from collections.abc import Mapping, Sequence
from typing import Any

import redis.asyncio as redis
from redis.exceptions import NoPermissionError, ResponseError

from sidecar import logs
from sidecar.capacity import CapacityReading
from sidecar.coordination.ledger import LIBRARY, LUA, FleetLedger, LibraryState
from sidecar.metrics import NullPoolRecorder, NullRecorder, PoolRecorder, Recorder

log = logs.get("sidecar.coordination")

# --------------------------------------------------------------------- server settings

CHECKS = ("eviction", "persistence")


def _config_values(reply: Any) -> dict[str, str]:
    if isinstance(reply, Mapping):
        return {str(k): str(v) for k, v in reply.items()}
    values = list(reply or ())
    return {str(k): str(v) for k, v in zip(values[::2], values[1::2], strict=False)}


async def check_server(client: redis.Redis, recorder: Recorder | None = None) -> dict[str, str]:
    """Warn about server settings that can break the ledger; ``{check: result}``.

    result ``ok``, ``risk`` or ``unknown`` (the server did not let us read them, or did not
    answer). Never raises: the checks only inform.
    """
    rec: Recorder = recorder if recorder is not None else NullRecorder()
    try:
        values = _config_values(await client.config_get(
            "maxmemory-policy", "save", "appendonly"))
    except (NoPermissionError, ResponseError) as exc:
        reason = "denied" if isinstance(exc, NoPermissionError) or "NOPERM" in str(exc) \
            else "error"
        log.warning("coordination_server_unchecked", reason=reason,
                    hint="could not read maxmemory-policy, save, appendonly (CONFIG GET); "
                         "make sure the server runs with maxmemory-policy noeviction and "
                         "without RDB/AOF persistence")
        return _record(rec, dict.fromkeys(CHECKS, "unknown"))
    except (redis.ConnectionError, TimeoutError, OSError) as exc:
        log.warning("coordination_server_unchecked", reason="unreachable",
                    error=type(exc).__name__)
        return _record(rec, dict.fromkeys(CHECKS, "unknown"))
    results: dict[str, str] = {}
    policy = values.get("maxmemory-policy")
    if policy is None:
        results["eviction"] = "unknown"
    elif policy.lower() != "noeviction":
        results["eviction"] = "risk"
        log.warning("coordination_server_evicts", maxmemory_policy=policy,
                    hint="an evicted ledger key frees slots still in use: set "
                         "maxmemory-policy noeviction on the coordination server")
    else:
        results["eviction"] = "ok"
    save, aof = values.get("save"), values.get("appendonly")
    if save is None and aof is None:
        results["persistence"] = "unknown"
    elif (save or "").strip() or (aof or "no").lower() == "yes":
        results["persistence"] = "risk"
        log.warning("coordination_server_persists", save=save, appendonly=aof,
                    hint="a restart can restore a stale ledger (admissions long ended, or "
                         "without those made since): run it with save \"\" and appendonly no")
    else:
        results["persistence"] = "ok"
    return _record(rec, results)


async def check_server_at(url: str, timeout: float,
                          recorder: Recorder | None = None) -> dict[str, str]:
    """:func:`check_server` on a connection of its own (closed again)."""
    client = redis.Redis.from_url(url, decode_responses=True, socket_timeout=timeout,
                                  socket_connect_timeout=timeout)
    try:
        async with asyncio.timeout(2 * timeout):
            return await check_server(client, recorder)
    except TimeoutError:
        log.warning("coordination_server_unchecked", reason="unreachable", error="TimeoutError")
        return _record(recorder if recorder is not None else NullRecorder(),
                       dict.fromkeys(CHECKS, "unknown"))
    finally:
        await client.aclose()


def _record(rec: Recorder, results: dict[str, str]) -> dict[str, str]:
    for check, result in results.items():
        rec.server_checked(check, result)
    return results


# --------------------------------------------------------------------------- library


async def watch_library(ledger: FleetLedger, interval: float,
                        recorder: Recorder | None = None) -> None:
    """Record every verification of the loaded library, and verify it every ``interval`` s
    as well (until cancelled).

    The ledger client verifies on its own paths too (each heartbeat, a new connection, an
    error or malformed reply: :meth:`FleetLedger._fcall`); each result reaches the metrics
    here, so a library replaced for less than ``interval`` is counted once a heartbeat
    finds it. Verification makes the ledger refuse every call while the server's library
    is not this version's code (the controller then degrades to its local share) and
    accept them again once it is. Errors reaching the server are the controller's
    business, not ours.
    """
    rec: Recorder = recorder if recorder is not None else NullRecorder()
    last: LibraryState | None = None

    def checked(state: LibraryState) -> None:
        nonlocal last
        if state is not last or state is LibraryState.MISMATCH:
            rec.library_checked(state.value)
        last = state

    ledger.on_library = checked
    if ledger.library_state is not None:
        checked(ledger.library_state)
    try:
        while True:
            await asyncio.sleep(interval)
            with contextlib.suppress(redis.RedisError, OSError, TimeoutError):
                await ledger.verify_library()
    finally:
        if ledger.on_library is checked:
            ledger.on_library = None


# ------------------------------------------------------------ one fleet id, one fleet


def capacity_source(reading: CapacityReading) -> str:
    """A short digest of where this replica's capacity comes from: the workers it counts
    (their URLs), or the fallback / override and its value. Replicas of one deployment
    agree on it (but for a moment while a worker comes or goes); two deployments under one
    fleet id, with their own worker pools, do not."""
    if reading.source == "workers":
        key = "workers " + " ".join(sorted(w.url for w in reading.workers))
    else:
        key = f"{reading.source} {reading.capacity}"
    return hashlib.sha256(key.encode()).hexdigest()[:12]


def _split_digests(digests: Sequence[str]) -> dict[str, frozenset[str]]:
    """The published "<config digest>@<capacity source>" values, by kind."""
    configs, sources = set(), set()
    for d in digests:
        cfg, at, src = d.partition("@")
        configs.add(cfg)
        if at:
            sources.add(src)
    return {"config": frozenset(configs), "capacity_source": frozenset(sources)}


async def watch_fleet(ledger: FleetLedger, interval: float,
                      recorder: PoolRecorder | None = None) -> None:
    """Every ``interval`` s, look for a second class config or capacity source among the
    live replicas of this fleet id (until cancelled).

    A second deployment started with the same ``--fleet-id`` lowers the fleet's capacity to
    the smaller report and overwrites its class settings, silently. Reported once per
    distinct set of values, and only once the same set was seen on two checks in a row,
    so that a worker coming up on one replica a poll before the other is not a collision.
    """
    rec: PoolRecorder = recorder if recorder is not None else NullPoolRecorder()
    previous: dict[str, frozenset[str]] = {}
    reported: dict[str, frozenset[str]] = {}
    while True:
        await asyncio.sleep(interval)
        try:
            snap = await ledger.snapshot()
        except (redis.RedisError, OSError, TimeoutError):
            continue  # unreachable or refused: the controller reports that
        for kind, values in _split_digests(snap.digests).items():
            if len(values) < 2:
                reported.pop(kind, None)
            elif values == previous.get(kind) and reported.get(kind) != values:
                reported[kind] = values
                rec.fleet_collision(kind)
                log.error("fleet_collision", kind=kind, values=sorted(values),
                          live_replicas=len(snap.replicas), replica=ledger.replica,
                          hint="replicas of this fleet id disagree on their class config or "
                               "their workers: another deployment with the same --fleet-id "
                               "(give it its own), or a rollout in progress")
            previous[kind] = values


# ------------------------------------------------------------------ the admin's command


async def load_library(url: str) -> str:
    """Load this version's library with ``REPLACE`` (the admin's job); its name."""
    client = redis.Redis.from_url(url, decode_responses=True)
    try:
        await client.function_load(LUA, replace=True)
    finally:
        await client.aclose()
    return LIBRARY


def main(argv: list[str] | None = None) -> int:
    """``python -m sidecar.coordination.server {load,print}``: the admin's side."""
    import argparse
    import sys

    from sidecar.config import ConfigError, check_coordination_url
    from sidecar.coordination.credentials import PASSWORD_ENV, read_password, with_password

    p = argparse.ArgumentParser(
        prog="python -m sidecar.coordination.server",
        description="load: load this version's ledger library (FUNCTION LOAD REPLACE, run "
                    "with the admin user); print: write its code on stdout")
    p.add_argument("action", choices=("load", "print"))
    p.add_argument("--coordination-url", metavar="URL", help="the server, as the sidecars "
                   "get it but with the admin user: redis://admin@HOST:PORT/0")
    p.add_argument("--coordination-password-file", metavar="FILE",
                   help=f"the admin's password (or ${PASSWORD_ENV})")
    p.add_argument("--every", type=float, default=None, metavar="SECS",
                   help="load again every SECS until stopped (a server restarted empty gets "
                        "it back, a replaced library is restored); default: once")
    ns = p.parse_args(argv)
    if ns.action == "print":
        sys.stdout.write(LUA)
        return 0
    try:
        if ns.coordination_url is None:
            raise ConfigError("--coordination-url is required for load")
        check_coordination_url(ns.coordination_url)
        password = (read_password(ns.coordination_password_file)
                    if ns.coordination_password_file else os.environ.get(PASSWORD_ENV))
    except (ConfigError, ValueError) as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    url = ns.coordination_url if not password else with_password(ns.coordination_url, password)
    if ns.every is not None:
        if not ns.every > 0:
            print("config error: --every must be > 0", file=sys.stderr)
            return 2
        logs.configure("json")
        asyncio.run(_load_every(url, ns.every))
        return 0
    try:
        name = asyncio.run(load_library(url))
    except redis.RedisError as exc:
        # redis-py's messages carry host and port, never the password.
        print(f"load failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print(f"loaded {name}")
    return 0


async def _load_every(url: str, interval: float) -> None:
    loaded: bool | None = None  # logged on a change only, not every interval
    while True:
        try:
            await load_library(url)
        except (redis.RedisError, OSError) as exc:
            if loaded is not False:
                log.warning("ledger_library_load_failed", error=f"{type(exc).__name__}: {exc}")
            loaded = False
        else:
            if loaded is not True:
                log.info("ledger_library_loaded", library=LIBRARY)
                # The sidecars' runtime user may not CONFIG GET: the admin checks instead,
                # each time the server (re)appears.
                await check_server_at(url, 2.0)
            loaded = True
        await asyncio.sleep(interval)


if __name__ == "__main__":
    raise SystemExit(main())
