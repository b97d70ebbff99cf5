"""Live configuration: apply a changed ``priority.yaml`` without a restart.

Kubernetes updates a mounted ConfigMap by swapping the ``..data`` symlink
atomically, so the watched path keeps its name while what it resolves to
changes. The watcher polls ``stat`` (following symlinks); SIGHUP forces a
check. A valid file takes effect for new decisions; an invalid one is rejected
whole: the old config stays, the error is logged (``config_reload_rejected``)
with file, key and reason, and counted.

**Replace the file atomically.** Write a temporary file in the same directory
and ``rename`` it over ``priority.yaml`` (``mv``, an editor's safe write, the
ConfigMap ``..data`` swap). A file written in place (``cat > priority.yaml``)
passes through half-written states, and a half that happens to be valid YAML
would be a valid, wrong config. So the watcher acts on a change only when it
reads the same bytes (and the same ``stat``) twice in a row, one poll apart; a
change therefore takes effect one poll interval after it is seen. SIGHUP reads
at once and again ``min(interval, 0.5 s)`` later, and acts only if both reads
agree; otherwise the next polls decide. A writer that stalls longer than that
mid-write can still be read half-written: that is what atomic replacement is for.

Reading and parsing run in a worker thread, one at a time, under
:data:`RELOAD_DEADLINE_SECS`: the event loop keeps admitting meanwhile. The
parse itself is bounded (size cap, no aliases, depth cap; see
:mod:`sidecar.priority_yaml`), so a thread that outlives its deadline still ends; until
it does, no second parse starts and the change is picked up by a later poll.
A parse over its deadline is rejected like an invalid file.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from sidecar import logs
from sidecar.priority_yaml import (
    ConfigError,
    PriorityConfig,
    parse_priority_file,
    read_config_file,
)

log = logs.get("sidecar.reload")

RELOAD_DEADLINE_SECS = 10.0
"""Longest a reload may take to read and parse. The largest file the loader's
caps allow parses in about 2 s on a busy core (30 MB of memory); real ones
are a few KiB and take milliseconds."""
SIGHUP_SETTLE_SECS = 0.5
"""SIGHUP's second read comes this long after the first (or one poll interval, if shorter)."""

_T = TypeVar("_T")
Stamp = tuple[int, int, int, str]


def _stamp(path: str) -> Stamp | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_ino, st.st_mtime_ns, st.st_size, os.path.realpath(path))


@dataclass(frozen=True, slots=True)
class _Sighting:
    """One read of the file; two equal sightings in a row mean the write is finished."""

    stamp: Stamp | None
    digest: str  # of the bytes read, or of the read error
    data: bytes = field(default=b"", compare=False)
    error: ConfigError | None = field(default=None, compare=False)


class _Busy(Exception):
    """The previous read or parse outlived its deadline and is still running."""


class ConfigWatcher:
    def __init__(self, path: str, current: PriorityConfig, *, interval: float,
                 apply: Callable[[PriorityConfig], None],
                 on_error: Callable[[ConfigError], None],
                 validate: Callable[[PriorityConfig], None] | None = None,
                 deadline: float = RELOAD_DEADLINE_SECS) -> None:
        self.path = path
        self.current = current
        self.interval = interval
        self.deadline = deadline
        self._apply = apply
        self._on_error = on_error
        self._validate = validate
        self._stamp = _stamp(path)
        self._seen: _Sighting | None = None  # a change seen once, not yet acted on
        self._lock = asyncio.Lock()
        self._worker: asyncio.Future[Any] | None = None
        self._wake = asyncio.Event()

    def request_check(self) -> None:
        """SIGHUP: check now instead of at the next poll (a signal handler cannot await)."""
        self._wake.set()

    async def check(self, *, force: bool = False) -> bool:
        """Reload if the file changed and reads the same twice (``force``: check now).

        True if a new config was applied.
        """
        async with self._lock:
            try:
                return await self._check(force)
            except _Busy:
                log.warning("config_reload_busy", file=self.path, deadline_secs=self.deadline,
                            hint="the previous parse is still running; a later poll retries")
                return False

    async def _check(self, force: bool) -> bool:
        if self._worker is not None and not self._worker.done():
            raise _Busy
        stamp = _stamp(self.path)
        if not force and stamp == self._stamp and self._seen is None:
            return False
        seen = await self._read(stamp)
        if seen != self._seen:  # first sighting of this content: wait for a second
            self._seen = seen
            if not force:
                return False
            await asyncio.sleep(min(self.interval, SIGHUP_SETTLE_SECS))
            seen = await self._read(_stamp(self.path))
            if seen != self._seen:
                self._seen = seen
                return False
        self._seen = None
        self._stamp = seen.stamp
        try:
            if seen.error is not None:
                raise seen.error
            new = await self._off_loop(parse_priority_file, seen.data, self.path)
            if self._validate is not None:
                self._validate(new)
        except ConfigError as exc:
            self._reject(exc)
            return False
        if new.digest == self.current.digest:
            return False
        old = self.current
        try:
            self._apply(new)
        except Exception as exc:  # validated above, so this is a bug: say so, keep going
            log.exception("config_apply_failed", file=self.path)
            self._on_error(ConfigError(f"could not apply: {exc}", file=self.path))
            return False
        self.current = new
        log.info("config_reloaded", file=self.path, sha256=new.digest, previous_sha256=old.digest)
        return True

    def _reject(self, exc: ConfigError) -> None:
        log.error("config_reload_rejected", file=exc.file or self.path, key=exc.key,
                  reason=exc.reason, kept_sha256=self.current.digest)
        self._on_error(exc)

    async def _read(self, stamp: Stamp | None) -> _Sighting:
        try:
            data = await self._off_loop(read_config_file, self.path)
        except ConfigError as exc:
            return _Sighting(stamp, "error:" + str(exc), error=exc)
        return _Sighting(stamp, hashlib.sha256(data).hexdigest(), data=data)

    async def _off_loop(self, fn: Callable[..., _T], *args: object) -> _T:
        """``fn(*args)`` in a worker thread, at most one at a time, within the deadline."""
        if self._worker is not None and not self._worker.done():
            raise _Busy
        worker: asyncio.Future[_T] = asyncio.ensure_future(asyncio.to_thread(fn, *args))
        # Once past its deadline nobody awaits it; its late outcome is dropped here.
        worker.add_done_callback(lambda f: f.cancelled() or f.exception())
        self._worker = worker
        try:
            # shield: a timeout or a cancelled watcher must not lose track of the
            # thread, which cannot be stopped and still counts as busy.
            return await asyncio.wait_for(asyncio.shield(worker), self.deadline)
        except TimeoutError:
            raise ConfigError(f"not read and parsed within the {self.deadline:g}s reload "
                              "deadline", file=self.path) from None
        except ConfigError:
            raise
        except Exception as exc:  # the parser is bounded; anything else is still a bad file
            raise ConfigError(f"cannot be parsed ({type(exc).__name__})",
                              file=self.path) from None

    async def run(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.interval)
            force = self._wake.is_set()
            self._wake.clear()
            try:
                await self.check(force=force)
            except Exception:  # never let one bad round stop the watcher
                log.exception("config_watch_failed")
