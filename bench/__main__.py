"""``python -m bench``: every benchmark, in order."""

from bench import core

raise SystemExit(core.main([]))
