"""``python -m bench.qos``: see bench/qos/__init__.py."""

from bench.qos import main

raise SystemExit(main())
