"""The refit lock: one holder at a time, a lease, a fencing token (pure logic).

A trainer takes the lock for the length of a refit and renews its lease in the background. The
lock is released when the holder says so, when the lease runs out, or when the holder has gone
silent for `holder_timeout_s` (its connection is gone: a live holder renews every second).

Each acquisition gets a fencing token that is never handed out again, also across coordinator
restarts with no state dir or a state file moved away: the pair (the coordinator's epoch, a
counter), the epoch drawn at random when the lock is made. The wire token is that pair and a
secret drawn for each lease (so that one who held an earlier token cannot tell the next) as an
opaque string, known to its holder only (a refusal names the holder, never its token); a
refit-scoped call must carry both the token and the holder's name, so a holder whose lease
ended and who acts late is told so, never mistaken for the current holder.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass, field
from typing import Any

from rollout_watchdog.refit_bridge.weights import Unfinished

MIN_LEASE_S = 1.0
MAX_LEASE_S = 3600.0
HOLDER_TIMEOUT_S = 5.0   # a holder renews every second (client.RENEW_EVERY_S)


class LockHeld(Exception):
    """Someone else holds the lock."""

    def __init__(self, lease: Lease, now: float) -> None:
        self.lease = lease
        self.expires_in_s = max(0.0, lease.expires - now)
        super().__init__(f"the refit lock is held by {lease.holder} (refit #{lease.number} "
                         f"to version {lease.version!r}, lease ends in "
                         f"{self.expires_in_s:.1f} s unless renewed)")


class Fenced(Exception):
    """A refit-scoped call whose token is not the current holder's."""


@dataclass
class Lease:
    token: str           # "EPOCH-NUMBER-SECRET": opaque to clients, shown to its holder only
    number: int          # the counter half: names the refit in logs and refusals
    holder: str
    version: str
    lease_s: float
    expires: float       # monotonic
    heard: float         # monotonic: the holder's last call
    members: list[tuple[str, str, int]]   # (node, engine, incarnation) the refit updates
    # The owner tag of the deep-probe pause this refit put on the nodes (pause_owner_of its
    # token): its resume lifts that pause only (a finish_generation pause, untagged, stays
    # until prepare_for_generation).
    pause_owner: str
    # The members as last listed to the holder (their objects, in page order): the pages of
    # one listing all come from it (service.py, refit_members).
    listing: list[dict[str, Any]] = field(default_factory=list)
    committed: bool = False
    # Committed without a release: the members whose generation its holder continues next
    # (the coordinator does, should the lease end before the holder releases it).
    continuing: list[tuple[str, str, int]] = field(default_factory=list)
    aborted: bool = False
    # Until the acquisition is answered (after its pause, and once what it lists is on disk)
    # the holder has no token to renew with: the lease is held, its clock starts with the
    # answer (`granted`).
    granting: bool = True
    taken: float = 0.0   # monotonic: when the lock was taken (the refit's duration starts)

    def unfinished(self) -> Unfinished:
        return Unfinished(self.number, self.holder, self.version, self.pause_owner,
                          self.committed, list(self.continuing))

    def granted(self, now: float) -> None:
        self.granting = False
        self.heard = now
        self.expires = now + self.lease_s


def token_problem(token: object) -> str | None:
    """What is wrong with a token a client sends back (None: it has a token's form)."""
    if not isinstance(token, str) or len(token) > 200:
        return f"must be a token (a string of at most 200 characters), got {str(token)[:40]!r}"
    parts = token.split("-")
    if not (len(parts) == 3 and parts[1].isdecimal() and all(parts)):
        return f"must be a token as refit_acquire gave it, got {token[:40]!r}"
    return None


def pause_owner_of(token: str) -> str:
    """The owner tag of a lease's deep-probe pause: derived from its token, so a coordinator
    restarted without state lifts a lost lease's pause when its holder asks (refit_putback),
    and nobody without the token can name it."""
    return f"refit-{hashlib.blake2b(token.encode(), digest_size=6).hexdigest()}"


def number_of(token: str) -> int:
    """The counter half of a token (`token_problem` found nothing wrong with it)."""
    return int(token.split("-")[1])


class RefitLock:
    def __init__(self, next_token: int = 1, holder_timeout_s: float = HOLDER_TIMEOUT_S,
                 epoch: str | None = None) -> None:
        self.next_token = next_token   # the counter; persisted with a state dir (for the logs)
        self.granted_here = False      # whether a holder got a token from this start on
        self.epoch = epoch or secrets.token_hex(8)   # fresh at every start: tokens never repeat
        self.holder_timeout_s = holder_timeout_s
        self.lease: Lease | None = None

    def acquire(self, holder: str, version: str, lease_s: float, now: float) -> Lease:
        """Take the lock; raises LockHeld (with the holder) or ValueError (a bad lease)."""
        if not MIN_LEASE_S <= lease_s <= MAX_LEASE_S:
            raise ValueError(f"lease_s must be between {MIN_LEASE_S:g} and {MAX_LEASE_S:g} s, "
                             f"got {lease_s:g}")
        if self.lease is not None:
            raise LockHeld(self.lease, now)
        token = f"{self.epoch}-{self.next_token}-{secrets.token_hex(8)}"
        self.lease = Lease(token, self.next_token, holder, version, lease_s, now + lease_s, now,
                           [], pause_owner_of(token), taken=now)
        self.next_token += 1
        return self.lease

    def restore(self, saved: Unfinished, members: list[tuple[str, str, int]], now: float
                ) -> Lease:
        """The lease that was held when the coordinator stopped, held again (its token died
        with that coordinator: no holder can renew it, and `expire` never ends it) until the
        service ends it once its nodes are back."""
        self.lease = Lease(f"{self.epoch}-{saved.number}-{secrets.token_hex(8)}", saved.number,
                           saved.holder, saved.version, 0.0, now, now, list(members),
                           saved.pause_owner, committed=saved.committed,
                           continuing=list(saved.continuing), granting=True, taken=now)
        return self.lease

    def hold_for(self, holder: str, token: str, version: str,
                 members: list[tuple[str, str, int]], now: float) -> Lease:
        """A lease of an earlier start that its holder lost (`token`: the one it was given),
        held again for its members as `restore` does; its pause owner is that lease's."""
        return self.restore(Unfinished(number_of(token), holder, version,
                                       pause_owner_of(token), False, []), members, now)

    def ended_lease(self, token: object) -> str | None:
        """Why this lock knows how the lease of `token` (not the current one) ended, or was
        taken over since (None: its token is of an earlier start, and nothing was granted
        since this one)."""
        if isinstance(token, str) and token.startswith(f"{self.epoch}-"):
            return "its lease ended at this coordinator, which put its members back"
        if self.granted_here:
            return ("a later refit took the lock since this coordinator started: its holder "
                    "put them back")
        return None

    def grant(self, lease: Lease, now: float) -> None:
        """`lease`'s token is answered: its holder may act from now on."""
        lease.granted(now)
        self.granted_here = True

    def check(self, token: object, holder: object, now: float) -> Lease:
        """The current lease if `token` and `holder` are its own (the holder is heard);
        raises Fenced, naming the current holder but never its token."""
        lease = self.lease
        if lease is None or token != lease.token or holder != lease.holder:
            held = (f"the lock is now held by {lease.holder} (refit #{lease.number})"
                    if lease is not None else "nobody holds the lock")
            if not isinstance(holder, str) or not holder:
                why = "the call names no holder (a refit call carries 'holder' and 'token')"
            else:
                why = f"{holder} with token {str(token)[:40]!r} is not the current holder"
            raise Fenced(f"lease lost: {why} ({held})")
        lease.heard = now
        return lease

    def renew(self, token: object, holder: object, now: float) -> Lease:
        lease = self.check(token, holder, now)
        lease.expires = now + lease.lease_s
        return lease

    def release(self, token: object, holder: object, now: float) -> Lease:
        lease = self.check(token, holder, now)
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
