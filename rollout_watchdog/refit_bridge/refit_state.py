"""A refit's state, made explicit (as torch elastic's rendezvous keeps its own): one phase, the
failures heard by the guard thread, owned by `RefitGuard` behind one lock and read as
snapshots, and the translation of whatever ended a refit into the error its caller gets. Also
the process's registry of weight-update groups (as Ray's GroupManager keeps collective groups).

Pure logic: no I/O, no threads of its own.
"""

from __future__ import annotations

import enum
import itertools
import os
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar, cast

from rollout_watchdog.common import protocol
from rollout_watchdog.common.commands import Kind, choice, number
from rollout_watchdog.common.errors import (
    CommandRefused,
    EngineLost,
    LeaseLost,
    RefitTimeout,
    RolloutWatchdogError,
    UpdateRefused,
)
from rollout_watchdog.refit_bridge.lock import MAX_LEASE_S, MIN_LEASE_S

if TYPE_CHECKING:
    from rollout_watchdog.refit_bridge.group import WeightUpdateGroup

Member = tuple[str, str, int]   # (node_id, engine, incarnation)


class Phase(enum.Enum):
    """Where a refit is (the moves allowed are NEXT's)."""

    NEW = 0          # built, not entered
    ACQUIRING = 1    # waiting for the lock
    HELD = 2         # the lock and the members are known; nothing done to the members
    UPDATING = 3     # generation paused on the members; an update is under way (or failed)
    UPDATED = 4      # an update went out whole: every member was sent the version
    COMMITTING = 5   # the commit is under way (the guard renews the lease to the release)
    COMMITTED = 6    # recorded at the coordinator (generation continued, then released)
    ABORTED = 7      # ended without a commit

    @property
    def generation_paused(self) -> bool:
        return self in (Phase.UPDATING, Phase.UPDATED)


NEXT: dict[Phase, tuple[Phase, ...]] = {
    Phase.NEW: (Phase.ACQUIRING,),
    Phase.ACQUIRING: (Phase.HELD, Phase.ABORTED),
    Phase.HELD: (Phase.UPDATING, Phase.COMMITTING, Phase.ABORTED),
    Phase.UPDATING: (Phase.UPDATED, Phase.ABORTED),
    Phase.UPDATED: (Phase.UPDATING, Phase.COMMITTING, Phase.ABORTED),   # another update
    Phase.COMMITTING: (Phase.COMMITTED, Phase.ABORTED),
    Phase.COMMITTED: (),
    Phase.ABORTED: (),
}


@dataclass(frozen=True)
class Snapshot:
    """The refit's phase and failures at one moment (copies: safe to read anywhere)."""

    phase: Phase
    lost: dict[Member, str] = field(default_factory=dict)   # member -> why, in order heard
    lease_lost: str | None = None
    expired: bool = False
    guard_failed: str | None = None

    @property
    def failed(self) -> bool:
        return bool(self.lost or self.lease_lost or self.expired or self.guard_failed)


class RefitGuard:
    """Owns a refit's phase, its failures and the group it aborts, behind one lock. The
    caller's thread and the guard thread both write; `snapshot()` is what either reads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # Under _lock:
        self._phase = Phase.NEW
        self._lost: dict[Member, str] = {}
        self._seen: set[Member] = set()   # lost as their watchdog saw them go (they die first)
        self._lease_lost: str | None = None
        self._expired = False
        self._guard_failed: str | None = None
        self._group: WeightUpdateGroup | None = None   # the group a failure aborts

    def snapshot(self) -> Snapshot:
        with self._lock:
            # Who their watchdog saw go comes first: a member's death breaks the collective,
            # and the survivors' calls may fail (and be lost too) before the death is heard.
            lost = sorted(self._lost.items(), key=lambda item: item[0] not in self._seen)
            return Snapshot(self._phase, dict(lost), self._lease_lost, self._expired,
                            self._guard_failed)

    @property
    def phase(self) -> Phase:
        with self._lock:
            return self._phase

    def advance(self, to: Phase) -> Phase:
        """Move to `to` (RuntimeError for a move NEXT does not allow); the phase before."""
        with self._lock:
            before = self._phase
            if to not in NEXT[before]:
                raise RuntimeError(f"a refit does not go from {before.name} to {to.name}")
            self._phase = to
            return before

    # ---- failures: each returns the group to abort (outside the lock), if any

    def lose(self, members: Iterable[tuple[Member, str]], *, seen: bool = False
             ) -> WeightUpdateGroup | None:
        """Members lost, with why; `seen`: their watchdog saw them go (the fleet's events)."""
        with self._lock:
            for member, why in members:
                self._lost.setdefault(member, why)
                if seen:
                    self._seen.add(member)
            return self._to_abort()

    def lose_lease(self, why: str) -> WeightUpdateGroup | None:
        with self._lock:
            if self._phase in (Phase.COMMITTING, Phase.COMMITTED):   # the commit's own answer
                return None                                          # says how it went
            self._lease_lost = self._lease_lost or why
            return self._to_abort()

    def expire(self) -> WeightUpdateGroup | None:
        with self._lock:
            self._expired = True
            return self._to_abort()

    def fenced(self, why: str) -> None:
        """A call of the refit's own thread was refused for its token: the lease is lost, in
        any phase (unlike a renewal's late answer, this one is about this very call)."""
        with self._lock:
            self._lease_lost = self._lease_lost or why

    def fail_guard(self, why: str) -> WeightUpdateGroup | None:
        with self._lock:
            self._guard_failed = self._guard_failed or why
            return self._to_abort()

    def attach(self, group: WeightUpdateGroup | None) -> WeightUpdateGroup | None:
        """The group in use from now on (None: none); itself when a failure was heard before
        it existed, to be aborted at once."""
        with self._lock:
            self._group = group
            return self._to_abort() if self._lost or self._lease_lost or self._expired \
                or self._guard_failed else None

    def detach(self) -> WeightUpdateGroup | None:
        """Take the group away (the abort tears it down); it was the one in use."""
        with self._lock:
            group, self._group = self._group, None
            return group

    def _to_abort(self) -> WeightUpdateGroup | None:
        if self._phase is Phase.COMMITTED:
            return None
        return self._group


def failure_of(snap: Snapshot, version: str, timeout_s: float, also: str = ""
               ) -> RolloutWatchdogError | None:
    """The error a refit raises for what its guard heard (None: nothing); `also` is added to
    an EngineLost's detail. A lost member comes first: the retry goes without it."""
    if snap.lost:
        return EngineLost(list(snap.lost), "; ".join(dict.fromkeys(
            [*snap.lost.values(), *([also] if also else [])])))
    if snap.lease_lost:
        return LeaseLost(snap.lease_lost)
    if snap.guard_failed:
        return RolloutWatchdogError(snap.guard_failed)
    if snap.expired:
        return RefitTimeout(f"refit {version!r} ran past its {timeout_s:g} s")
    return None


BACKENDS = ("nccl", "gloo")   # the weight-update group's (torch.distributed's names)
ARGUMENTS: dict[str, Kind] = {
    "lease_s": number(MIN_LEASE_S, maximum=MAX_LEASE_S),   # the lock's range (lock.py)
    "timeout_s": number(0.0, above=True), "backend": choice(*BACKENDS),
    "bucket_bytes": number(1.0)}


def check_arguments(**given: object) -> None:
    """A refit's arguments (ARGUMENTS), checked before anything is sent: a ValueError naming
    the one that is wrong, never a later error of another type."""
    for name, value in given.items():
        try:
            ARGUMENTS[name](value)
        except ValueError as exc:
            raise ValueError(f"{name} {exc}") from None


def lock_held(exc: CommandRefused) -> bool:
    """The refusal of an acquisition says another holder has the lock: its code, or, from a
    coordinator before protocol 1.2, the holder its result names."""
    return exc.code == protocol.LOCK_HELD or (exc.code is None and isinstance(exc.result, dict)
                                              and "holder" in exc.result)


T = TypeVar("T")


def not_empty(items: Iterable[T]) -> Iterable[T]:
    """`items`, still lazy (its first item taken and put back); ValueError when it has none
    (an exhausted generator): found before the members are paused for an update."""
    rest = iter(items)
    first = next(rest, _NONE)
    if first is _NONE:
        raise ValueError("update_weights got no tensors")
    return itertools.chain([cast(T, first)], rest)


_NONE = object()
_PUBLIC = RolloutWatchdogError.__module__   # errors.py: the contract's types


def translate(exc: BaseException, snap: Snapshot, version: str, timeout_s: float
              ) -> BaseException:
    """The error the `with fleet.refit()` block raises for `exc`, which ended it: one of the
    contract's types (errors.py) for anything of ours, the caller's own error untouched.

    - Not an Exception (KeyboardInterrupt, SystemExit): untouched, whatever was heard.
    - The caller's own error (not one of ours): untouched, unless a member was lost meanwhile
      (then EngineLost: the retry goes without it). The lease or the deadline never replace
      it: what the caller's code raised says more than what happened around it.
    - A lost member or the lost lease, as the guard heard them (failure_of), win: the group's
      own errors (GroupAborted, a member's failed call) are their consequences, and they say
      what to do (retry). The deadline or a failed guard win over internal errors only: a
      contract error the caller's thread got (the coordinator's silence, say) says more.
    - A group's failure (GroupMemberFailed) whose members answered with an error, none gone:
      UpdateRefused naming every member that refused (the gone ones are lost already).
    - Any other error of ours: RolloutWatchdogError with its text (never an internal type).
    """
    if not isinstance(exc, Exception):
        return exc
    heard = failure_of(snap, version, timeout_s, str(exc))
    if not isinstance(exc, RolloutWatchdogError):
        return heard if heard is not None and snap.lost else exc
    public = type(exc).__module__ == _PUBLIC
    if heard is not None and not (public and not snap.lost and not snap.lease_lost):
        return exc if public and isinstance(exc, type(heard)) else heard
    if public:
        return exc
    refused = getattr(exc, "refused", None)
    if isinstance(refused, dict) and refused:
        return UpdateRefused(refused)
    return RolloutWatchdogError(str(exc))


class GroupRegistry:
    """The weight-update groups of this process, one per coordinator address: a group outlives
    its refit (rebuilt only when the membership changes) and belongs to the process that built
    it, so a forked child starts with none. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pid = os.getpid()                            # under _lock
        self._groups: dict[str, WeightUpdateGroup] = {}    # under _lock

    def get(self, key: str) -> WeightUpdateGroup | None:
        with self._lock:
            self._forked()
            return self._groups.get(key)

    def put(self, key: str, group: WeightUpdateGroup) -> None:
        with self._lock:
            self._forked()
            self._groups[key] = group

    def discard(self, key: str, group: WeightUpdateGroup) -> bool:
        """Forget `group` if it is the one kept for `key` (a newer one stays); whether it was."""
        with self._lock:
            self._forked()
            if self._groups.get(key) is not group:
                return False
            del self._groups[key]
            return True

    def _forked(self) -> None:
        if self._pid != os.getpid():
            self._pid, self._groups = os.getpid(), {}


GROUPS = GroupRegistry()
