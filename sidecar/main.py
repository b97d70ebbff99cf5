"""Command-line entry point: parse, validate, then hand over to the app.

A configuration error prints one line on stderr and exits 2 before anything
listens; ``--check-config FILE`` validates a priority.yaml and exits 0/1.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from sidecar.classes import parse_default_max_class
from sidecar.config import (
    ConfigError,
    build_parser,
    format_class_table,
    load_priority_config,
    settings_from_args,
)


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
        return 0
    try:
        settings = settings_from_args(ns)
    except ConfigError as exc:
        print(f"priority-sidecar: config error: {exc}", file=sys.stderr)
        return 2
    from sidecar.app import run  # imported late: --help and config errors stay fast

    return run(settings)
