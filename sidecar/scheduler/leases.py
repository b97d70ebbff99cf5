"""Leases: how a slot whose completion never arrives is reclaimed.

Every admission holds a lease until Envoy acknowledges it while its access-log
stream is open (then :mod:`sidecar.liveness` covers it); periodic access-log
entries renew it and the final one releases the slot. A lease not renewed within its time to live is
due, and the adapter releases its admission with reason ``lease_expired`` (the
lifecycle table's way out for a lost completion). Pure: the caller passes the
time in.
"""

from __future__ import annotations

from collections import OrderedDict


class Leases:
    """Expiry times by admission id, earliest first."""

    def __init__(self, ttl: float) -> None:
        self.ttl = ttl
        # Expiry order equals renewal order (expiry = now + a fixed TTL), so an
        # OrderedDict with move_to_end keeps the earliest expiry at the front.
        self._expiry: OrderedDict[str, float] = OrderedDict()

    def grant(self, id: str, now: float) -> None:
        """A new admission (or an adopted one): due at ``now + ttl``."""
        self._expiry[id] = now + self.ttl
        self._expiry.move_to_end(id)

    def renew(self, id: str, now: float) -> bool:
        """Push the expiry to ``now + ttl``; False if ``id`` holds no lease."""
        if id not in self._expiry:
            return False
        self._expiry[id] = now + self.ttl
        self._expiry.move_to_end(id)
        return True

    def drop(self, id: str) -> None:
        """The admission ended: its lease goes with it."""
        self._expiry.pop(id, None)

    def next_expiry(self) -> float | None:
        return next(iter(self._expiry.values()), None)

    def pop_expired(self, now: float) -> list[str]:
        """Take out every lease due at ``now`` or earlier, earliest first."""
        due: list[str] = []
        expiry = self._expiry
        while expiry:
            id, at = next(iter(expiry.items()))
            if at > now:
                break
            del expiry[id]
            due.append(id)
        return due

    def __contains__(self, id: object) -> bool:
        return id in self._expiry

    def __len__(self) -> int:
        return len(self._expiry)
