"""Pools around admission controllers a test or benchmark made (no sidecar around them).

The services keyed by an admission id (the access log, ext_proc) and the Check handler
take :class:`sidecar.pools.Pools`; these build one around controllers a test made, each
pool on a fixed capacity (an override monitor that never probes anything).
"""

from __future__ import annotations

from collections.abc import Mapping

from sidecar.admission import AdmissionService
from sidecar.capacity import CapacityReading
from sidecar.config import DEFAULT_POOL
from sidecar.health import CapacityMonitor
from sidecar.metrics import Metrics, NullPoolRecorder, NullRecorder, PoolRecorder, Recorder
from sidecar.pools import Pool, Pools
from sidecar.priority_yaml import PriorityConfig


def pool(name: str, controller: AdmissionService, *, capacity: int | None = None,
         metrics: PoolRecorder | None = None, labelled: bool = True,
         config: PriorityConfig | None = None) -> Pool:
    """``controller`` as pool ``name``, whose workers report ``capacity`` (default: the
    controller's own)."""
    cap = controller.snapshot().capacity if capacity is None else capacity
    monitor = CapacityMonitor(worker_urls=(), envoy_admin_url=None, envoy_cluster="workers",
                              interval=60.0, timeout=1.0, fallback=cap, override=cap,
                              on_change=lambda _r: None)
    return Pool(name, controller=controller, monitor=monitor,
                reading=CapacityReading(cap, "override", 0, 0),
                config=config if config is not None else PriorityConfig(),
                metrics=metrics if metrics is not None else NullPoolRecorder(),
                labelled=labelled)


def pools(controllers: Mapping[str, AdmissionService],
          metrics: Metrics | Recorder | None = None) -> Pools:
    """One pool per controller (the default pool's must be there). With :class:`Metrics`
    each pool records under its own name."""
    rec: Recorder = metrics if metrics is not None else NullRecorder()
    labelled = len(controllers) > 1
    return Pools({name: pool(name, c, labelled=labelled,
                             metrics=metrics.pool(name) if isinstance(metrics, Metrics)
                             else None)
                  for name, c in controllers.items()}, rec)


def single(controller: AdmissionService, metrics: Metrics | Recorder | None = None) -> Pools:
    """``controller`` as the sidecar's only pool, the default one."""
    return pools({DEFAULT_POOL: controller}, metrics)
