"""The trainer's hold on the coordinator's refit lock: every lock call one refit makes, under its
holder name and fencing token, and what a refusal of them means.

It exists apart from `refit.py` because a refit's job is the order of its steps (acquire, pause,
update, commit or abort), while talking to the lock is a job of its own: taking it (waiting
while a live holder has it), listing the members a page at a time, and turning a refusal for
the token into `LeaseLost` (recorded in the refit's guard) wherever it comes from. Called from
the refit's own thread; the guard thread renews through `call` too.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rollout_watchdog.common import protocol
from rollout_watchdog.common.errors import CommandRefused, LeaseLost, RolloutWatchdogError
from rollout_watchdog.common.states import EngineState
from rollout_watchdog.refit_bridge.member_pages import collect, field_of
from rollout_watchdog.refit_bridge.refit_state import RefitGuard, lock_held

if TYPE_CHECKING:
    from rollout_watchdog.refit_bridge.client import FleetClient

log = logging.getLogger(__name__)
LOCK_RETRY_S = 0.5
# The coordinator saves the lease, pauses the fleet (waiting for in-flight probes up to 30 s),
# saves the members it lists then, and only then answers: each save may take up to 10 s.
ACQUIRE_TIMEOUT_S = 55.0
CALL_TIMEOUT_S = 10.0     # one control call to the coordinator
# The lock's calls that carry the holder's token: a refusal of one by a coordinator before
# protocol 1.2 (no code) can only be a fenced token, for the calls a refit makes.
TOKEN_CALLS = ("refit_members", "refit_renew", "refit_commit", "refit_abort", "refit_release")


class LockHolder:
    """One refit's hold on the lock: its holder name, and the token once acquired."""

    def __init__(self, client: FleetClient, version: str, holder: str, state: RefitGuard
                 ) -> None:
        self.client, self.version, self.holder = client, version, holder
        self._state = state
        self.token: Any = None   # the fencing token, opaque: sent back as it came

    def acquire(self, lease_s: float, pause_s: float, deadline: float, timeout_s: float
                ) -> dict[str, Any]:
        """Take the lock (deep probes paused fleet-wide for `pause_s`), waiting while a live
        holder has it, until `deadline` (monotonic; `timeout_s` names it in the error). The
        coordinator's first answer: the token is kept, the members are `members()`'."""
        while True:
            left = deadline - time.monotonic()
            try:
                _, result = self.client.call("refit_acquire", {
                    "holder": self.holder, "version": self.version, "lease_s": lease_s,
                    "deadline_s": pause_s, "paged": True},
                    timeout_s=max(0.1, min(ACQUIRE_TIMEOUT_S, left)))   # (a late wake-up)
                if not isinstance(result, dict):
                    raise CommandRefused(f"the coordinator's answer to refit_acquire is not "
                                         f"an object: {str(result)[:80]}")
                self.token = field_of(result, "token", object, "refit_acquire")   # opaque
                return result
            except CommandRefused as exc:
                if not lock_held(exc):
                    raise
                if time.monotonic() + LOCK_RETRY_S >= deadline:
                    raise CommandRefused(f"no refit lock within {timeout_s:g} s: "
                                         f"{exc.reason}", code=protocol.LOCK_HELD,
                                         result=exc.result) from None
            time.sleep(LOCK_RETRY_S)

    def members(self, first: dict[str, Any], cmd: str) -> list[dict[str, Any]]:
        """Every member of the listing whose first page `first` is, the others fetched
        (protocol 1.3; a coordinator before it sends them all at once)."""
        return collect(first, cmd, lambda cursor: self.call(
            "refit_members", {"paged": True, "after": cursor}))

    def relaunched_members(self, relaunched: list[list[str]], timeout_s: float
                           ) -> list[dict[str, Any]]:
        """The members listed again once the deferred engines the acquisition relaunched are
        healthy (or `timeout_s` has passed: the refit goes on without them)."""
        wanted = {(n, e) for n, e in relaunched}
        try:
            self.client.wait_until(
                lambda view: all(v.state == EngineState.HEALTHY for v in view
                                 if (v.node_id, v.id) in wanted), max(0.1, timeout_s))
        except TimeoutError as exc:
            log.warning("refit %r: relaunched engines not healthy in time, going on without "
                        "them: %s", self.version, exc)
        return self.members(self.call("refit_members", {"paged": True}), "refit_members")

    def call(self, cmd: str, args: dict[str, Any], timeout_s: float | None = None
             ) -> dict[str, Any]:
        """One lock call with the holder and token; a refusal for the token is `LeaseLost`
        (recorded in the guard, but for a renewal: the guard thread records its own)."""
        try:
            _, result = self.client.call(cmd, {**args, "holder": self.holder,
                                               "token": self.token},
                                         timeout_s=timeout_s or CALL_TIMEOUT_S)
        except CommandRefused as exc:
            if exc.code == protocol.LEASE_LOST or (exc.code is None and cmd in TOKEN_CALLS
                                                   and exc.result is None):
                if cmd != "refit_renew":
                    self._state.fenced(exc.reason)
                raise LeaseLost(exc.reason) from None
            raise
        return result if isinstance(result, dict) else {}

    def confirm(self) -> None:
        """Renew the lease from the refit's own thread, before it touches the members: a
        refusal is `LeaseLost`, recorded in the guard (the guard thread's own renewals may not
        have run yet: a holder stopped past its lease resumes all its threads at once)."""
        try:
            self.call("refit_renew", {})
        except LeaseLost as exc:
            self._state.fenced(str(exc))
            raise

    def renewer(self, timeout_s: float) -> Callable[[], dict[str, Any]]:
        """The guard thread's renewal: one `refit_renew` call within `timeout_s`."""
        return lambda: self.call("refit_renew", {}, timeout_s=timeout_s)

    def release(self) -> None:
        """Let the lock go (a failure is logged: the lease ends by itself)."""
        try:
            self.call("refit_release", {})
        except RolloutWatchdogError as exc:
            log.error("refit %r: lock not released (its lease will end): %s", self.version,
                      exc)


__all__ = ["LockHolder"]
