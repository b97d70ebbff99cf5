"""The lease home the pure owner table (:class:`sidecar.liveness.OwnerTable`) is given in
its own tests: a real :class:`~sidecar.scheduler.leases.Leases`, as an admission service
holding every admission the table asks about (it asks only about those it was told of).
"""

from __future__ import annotations

from sidecar.scheduler.leases import Leases


class AllHeld:
    def __init__(self, ttl: float = 10.0) -> None:
        self.leases = Leases(ttl)
        self.now = 0.0  # when a relapse's lease starts: the table tests read no expiry

    def unleased(self, aid: str) -> bool:
        return self.leases.unleased(aid)

    def hold_without_lease(self, aid: str) -> bool:
        self.leases.hold(aid)
        return True

    def lease_again(self, aid: str) -> bool:
        return self.leases.lease_again(aid, self.now)
