"""Live configuration: apply a changed ``priority.yaml`` without a restart.

Kubernetes updates a mounted ConfigMap by swapping the ``..data`` symlink
atomically, so the watched path keeps its name while what it resolves to
changes. The watcher polls ``stat`` (following symlinks) and the content hash;
SIGHUP forces a check. A valid file takes effect for new decisions; an invalid
one is rejected whole: the old config stays, the error is logged with file,
key and reason, and counted.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable

from sidecar import logs
from sidecar.config import ConfigError, PriorityConfig, load_priority_config

log = logs.get("sidecar.reload")


def _stamp(path: str) -> tuple[int, int, int, str] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_ino, st.st_mtime_ns, st.st_size, os.path.realpath(path))


class ConfigWatcher:
    def __init__(self, path: str, current: PriorityConfig, *, interval: float,
                 apply: Callable[[PriorityConfig], None],
                 on_error: Callable[[ConfigError], None],
                 validate: Callable[[PriorityConfig], None] | None = None) -> None:
        self.path = path
        self.current = current
        self.interval = interval
        self._apply = apply
        self._on_error = on_error
        self._validate = validate
        self._stamp = _stamp(path)
        self._failed_digest: str | None = None

    def check(self, *, force: bool = False) -> bool:
        """Reload if the file changed (or ``force``); True if a new config was applied."""
        stamp = _stamp(self.path)
        if not force and stamp == self._stamp:
            return False
        self._stamp = stamp
        try:
            new = load_priority_config(self.path)
            if self._validate is not None:
                self._validate(new)
        except ConfigError as exc:
            log.error("config_reload_rejected", file=exc.file or self.path, key=exc.key,
                      reason=exc.reason, kept_sha256=self.current.digest)
            self._on_error(exc)
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

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                self.check()
            except Exception:  # never let one bad round stop the watcher
                log.exception("config_watch_failed")
