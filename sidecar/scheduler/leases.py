"""Leases: how a slot whose completion never arrives is reclaimed, and which slots no
timer may reclaim.

Each admission in flight is in one of two states, and this table is the one place that
says which:

==============  ======  ===========================================================
state           timer?  leaves by → next state
==============  ======  ===========================================================
under a lease   yes     ``renew`` (a periodic entry) → under a lease, due later;
                        ``hold`` (Envoy runs it and its owner is watched,
                        :mod:`sidecar.liveness`) → held by its owner; its expiry →
                        released as ``lease_expired`` (``pop_expired``); ``drop`` (it
                        ended) → gone
held by its     no      ``lease_again`` (its owner may have been replaced) → under a
owner                   lease from then; ``drop`` → gone. ``renew`` changes nothing:
                        only its end, a preemption or its owner's death frees it
==============  ======  ===========================================================

``grant`` puts a new (or adopted) admission under a lease. A lease not renewed within
its time to live is due, and the adapter releases its admission with reason
``lease_expired`` (the lifecycle table's way out for a lost completion). Pure: the
caller passes the time in.
"""

from __future__ import annotations

from collections import OrderedDict


class Leases:
    """Expiry times by admission id, earliest first, and the admissions held by their
    owner (no expiry)."""

    def __init__(self, ttl: float) -> None:
        self.ttl = ttl
        # Expiry order equals renewal order (expiry = now + a fixed TTL), so an
        # OrderedDict with move_to_end keeps the earliest expiry at the front.
        self._expiry: OrderedDict[str, float] = OrderedDict()
        self._held: set[str] = set()

    def grant(self, id: str, now: float) -> None:
        """Under a lease, due at ``now + ttl`` (a new or adopted admission)."""
        self._held.discard(id)
        self._expiry[id] = now + self.ttl
        self._expiry.move_to_end(id)

    def renew(self, id: str, now: float) -> bool:
        """Push the expiry to ``now + ttl``; True as well for an admission held by its
        owner (nothing to push); False if ``id`` is in neither state."""
        if id in self._held:
            return True
        if id not in self._expiry:
            return False
        self._expiry[id] = now + self.ttl
        self._expiry.move_to_end(id)
        return True

    def hold(self, id: str) -> None:
        """Held by its owner from now: no timer reclaims it."""
        self._expiry.pop(id, None)
        self._held.add(id)

    def lease_again(self, id: str, now: float) -> bool:
        """Held by its owner → under a lease due at ``now + ttl``; False if not held."""
        if id not in self._held:
            return False
        self.grant(id, now)
        return True

    def unleased(self, id: str) -> bool:
        """Held by its owner (no timer)."""
        return id in self._held

    def drop(self, id: str) -> None:
        """The admission ended: its lease, or its hold, goes with it."""
        self._expiry.pop(id, None)
        self._held.discard(id)

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
        """In flight: under a lease or held by its owner."""
        return id in self._expiry or id in self._held

    def __len__(self) -> int:
        """Admissions in flight: under a lease or held by their owner."""
        return len(self._expiry) + len(self._held)
