"""Command-line entry point: parse, validate, then hand over to the app.

A configuration error prints one line on stderr and exits 2 before anything
listens; ``--check-config FILE`` validates a priority.yaml and exits 0/1.
"""

from __future__ import annotations

import resource
import sys
from collections.abc import Sequence

from sidecar import logs
from sidecar.classes import parse_default_max_class
from sidecar.config import (
    ConfigError,
    build_parser,
    capacity_verdict,
    format_class_table,
    load_priority_config,
    settings_from_args,
)
from sidecar.priority_yaml import preemption_warnings, starvation_warnings

# An unlimited hard limit cannot be the soft one (the kernel caps it at nr_open).
NOFILE_CEILING = 1 << 20


def raise_nofile_limit() -> tuple[int, int]:
    """Soft RLIMIT_NOFILE up to the hard limit; returns (before, after).

    Containers often start with a soft limit of 1,024 under a far higher hard one;
    every queued request, admin connection and probe costs a descriptor.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = NOFILE_CEILING if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            return soft, soft
        return soft, target
    return soft, soft


def main(argv: Sequence[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    if ns.check_config is not None:
        try:
            cfg = load_priority_config(ns.check_config)
        except ConfigError as exc:
            print(f"priority-sidecar: config error: {exc}", file=sys.stderr)
            return 1
        print(f"{ns.check_config}: OK (sha256 {cfg.digest})")
        default_max, _ = parse_default_max_class(ns.priority_scheduler_default_max_class)
        print(format_class_table(cfg, default_max))
        # Warnings: the file is still valid.
        for warning in [*starvation_warnings(cfg), *preemption_warnings(cfg)]:
            print(f"priority-sidecar: warning: {warning}", file=sys.stderr)
        if ns.check_capacity is None:
            return 0
        fits, verdict = capacity_verdict(cfg, ns.check_capacity, ns.max_concurrent_requests)
        print(verdict)
        return 0 if fits else 1
    if ns.check_capacity is not None:
        print("priority-sidecar: config error: --check-capacity needs --check-config FILE",
              file=sys.stderr)
        return 2
    try:
        settings = settings_from_args(ns)
    except ConfigError as exc:
        print(f"priority-sidecar: config error: {exc}", file=sys.stderr)
        return 2
    from sidecar.app import run  # imported late: --help and config errors stay fast

    logs.configure(settings.logging.log_format, settings.logging.log_level)
    before, after = raise_nofile_limit()
    logs.get("sidecar").info("nofile_limit", soft_before=before, soft=after,
                             hard=resource.getrlimit(resource.RLIMIT_NOFILE)[1])
    return run(settings)
