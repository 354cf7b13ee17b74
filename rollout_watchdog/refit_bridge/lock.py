"""The refit lock: one holder at a time, a lease, a fencing token (pure logic).

A trainer takes the lock for the length of a refit and renews its lease in the background. The
lock is released when the holder says so, when the lease runs out, or when the holder has gone
silent for `holder_timeout_s` (its connection is gone: a live holder renews every second). Each
acquisition gets a new fencing token, larger than every token before it, also across
coordinator restarts (the coordinator persists `next_token`): a holder whose lease ended and who
acts late is told so by its token, never mistaken for the current holder.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MIN_LEASE_S = 1.0
MAX_LEASE_S = 3600.0
HOLDER_TIMEOUT_S = 5.0   # a holder renews every second (client.RENEW_EVERY_S)


class LockHeld(Exception):
    """Someone else holds the lock."""

    def __init__(self, lease: Lease, now: float) -> None:
        self.lease = lease
        self.expires_in_s = max(0.0, lease.expires - now)
        super().__init__(f"the refit lock is held by {lease.holder} (token {lease.token}, "
                         f"refit to version {lease.version!r}, lease ends in "
                         f"{self.expires_in_s:.1f} s unless renewed)")


class Fenced(Exception):
    """A refit-scoped call whose token is not the current holder's."""


@dataclass
class Lease:
    token: int
    holder: str
    version: str
    lease_s: float
    expires: float       # monotonic
    heard: float         # monotonic: the holder's last call
    members: list[tuple[str, str, int]]   # (node, engine, incarnation) the refit updates
    committed: bool = False
    # Nodes whose deep probes the lock paused (and resumes at its end); nodes already paused
    # (finish_generation before the refit) stay paused until prepare_for_generation.
    paused_nodes: list[str] = field(default_factory=list)
    # Until the acquisition's pause is answered the holder has no token to renew with: the
    # lease is held, its clock starts with the answer (`granted`).
    granting: bool = True

    def granted(self, now: float) -> None:
        self.granting = False
        self.heard = now
        self.expires = now + self.lease_s


class RefitLock:
    def __init__(self, next_token: int = 1, holder_timeout_s: float = HOLDER_TIMEOUT_S) -> None:
        self.next_token = next_token
        self.holder_timeout_s = holder_timeout_s
        self.lease: Lease | None = None

    def acquire(self, holder: str, version: str, lease_s: float, now: float) -> Lease:
        """Take the lock; raises LockHeld (with the holder) or ValueError (a bad lease)."""
        if not MIN_LEASE_S <= lease_s <= MAX_LEASE_S:
            raise ValueError(f"lease_s must be between {MIN_LEASE_S:g} and {MAX_LEASE_S:g} s, "
                             f"got {lease_s:g}")
        if self.lease is not None:
            raise LockHeld(self.lease, now)
        self.lease = Lease(self.next_token, holder, version, lease_s, now + lease_s, now, [])
        self.next_token += 1
        return self.lease

    def check(self, token: object, now: float) -> Lease:
        """The current lease if `token` is its token (the holder is heard); raises Fenced."""
        lease = self.lease
        if lease is None or token != lease.token:
            held = (f"the lock is now held by {lease.holder} (token {lease.token})"
                    if lease is not None else "nobody holds the lock")
            raise Fenced(f"lease lost: token {token!r} is not the current holder's ({held})")
        lease.heard = now
        return lease

    def renew(self, token: object, now: float) -> Lease:
        lease = self.check(token, now)
        lease.expires = now + lease.lease_s
        return lease

    def release(self, token: object, now: float) -> Lease:
        lease = self.check(token, now)
        self.lease = None
        return lease

    def expire(self, now: float) -> tuple[Lease, str] | None:
        """End a lease that ran out or whose holder went silent: (the lease, why)."""
        lease = self.lease
        if lease is None or lease.granting:
            return None
        if now >= lease.expires:
            why = f"its lease of {lease.lease_s:g} s ran out"
        elif now - lease.heard >= self.holder_timeout_s:
            why = f"its holder was silent for {self.holder_timeout_s:g} s (connection gone)"
        else:
            return None
        self.lease = None
        return lease, why

    def next_deadline(self) -> float | None:
        if self.lease is None or self.lease.granting:
            return None
        return min(self.lease.expires, self.lease.heard + self.holder_timeout_s)
