"""``python -m sidecar`` is the same as the ``priority-sidecar`` command."""

from sidecar.main import main

raise SystemExit(main())
