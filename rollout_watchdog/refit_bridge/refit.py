"""`with fleet.refit(version) as refit:` - one weight refit, in the trainer (rank 0).

Entering takes the refit lock (waiting while a live holder has it, within `timeout_s`); the
coordinator pauses deep probes fleet-wide and names the members: the healthy engines of
reachable nodes. A guard thread renews the lease every second, follows the fleet's events, and
watches the overall deadline. `update_weights()` (re)builds the weight-update group when the
membership changed since the last refit (`group.py`) and broadcasts. Leaving the block commits:
the version is set on every member and read back, the coordinator records it (and admits new
incarnations to the router). An exception aborts: the group is torn down, every member is
stale until a later refit commits, and the members whose calls never completed at the deadline
are restarted by their watchdogs (`refit_wedged`).

A trainer blocked inside a collective can only be freed from its own process: when the guard
hears that a member died (the node watchdog reports it within milliseconds), or when the
deadline passes, it aborts the group from its thread; the blocked call then raises, and the
refit raises `EngineLost` naming the member(s).

Every error out of the block is one of the contract's (errors.py; docs/refit.md lists which
raises when): the group's own errors are internal and translated (refit_state.translate).

Threads: the caller's thread runs the block; the guard thread (refit_watch.py) renews, follows
and watches. What both touch is the `RefitGuard` (phase, failures, the group a failure aborts:
under its lock, read as snapshots) and the `LockHolder` (lock_holder.py: every call to the lock,
which the guard renews through); the token is set before `RefitWatch.renewing()` and the
members handed over by `RefitWatch.hold()`, once each. Everything else is the caller's
thread's only. The weight-update group outlives the refit in `refit_state.GROUPS`.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from collections.abc import Callable, Iterable
from types import TracebackType
from typing import TYPE_CHECKING, Any

from rollout_watchdog.common import protocol
from rollout_watchdog.common.errors import (
    CommandRefused,
    EngineLost,
    NoMembers,
    RefitTimeout,
    RolloutWatchdogError,
)
from rollout_watchdog.common.states import EngineState
from rollout_watchdog.refit_bridge import engine_calls, member_teardown
from rollout_watchdog.refit_bridge.group_member import GroupMember, GroupMemberFailed
from rollout_watchdog.refit_bridge.lock_holder import CALL_TIMEOUT_S, LockHolder
from rollout_watchdog.refit_bridge.member_teardown import member
from rollout_watchdog.refit_bridge.refit_state import (
    GROUPS,
    Member,
    Phase,
    RefitGuard,
    check_arguments,
    failure_of,
    not_empty,
    translate,
)
from rollout_watchdog.refit_bridge.refit_watch import RENEW_EVERY_S, RefitWatch
from rollout_watchdog.refit_bridge.rendezvous import free_port, master_address_for
from rollout_watchdog.refit_bridge.views import EngineView
from rollout_watchdog.refit_bridge.weights import check_version

if TYPE_CHECKING:
    import torch

    from rollout_watchdog.refit_bridge.client import FleetClient
    from rollout_watchdog.refit_bridge.group import WeightUpdateGroup

log = logging.getLogger(__name__)
# Deep probes paused by the lock come back by themselves this long after the refit's deadline
# (a safety net, should nothing resume them): never before the refit has ended its way.
PAUSE_MARGIN_S = 60.0
# The refit's own work must end this long before its `timeout_s` (a quarter of it, for a short
# one): an abort at that deadline (the group torn down, the wedged told apart within
# member_teardown.ABORT_GRACE_S, the coordinator told, the probes resumed) then ends within
# `timeout_s`, which bounds the whole refit (DESIGN).
TEARDOWN_RESERVE_S = 3.0
# In-flight requests are aborted (they end with finish_reason "abort", as slime does): the
# cache flush after an update needs an empty queue, which `retract` does not give.
PAUSE_MODE = "abort"


class Refit:
    """One refit; see the module docstring. Built by `FleetClient.refit()`."""

    def __init__(self, client: FleetClient, version: str, *, lease_s: float = 30.0,
                 timeout_s: float = 600.0, backend: str = "nccl",
                 master_address: str | None = None, pause_mode: str = PAUSE_MODE) -> None:
        check_version(version)
        check_arguments(lease_s=lease_s, timeout_s=timeout_s, backend=backend)
        if master_address is not None:   # (the group listens there, later: refused now)
            free_port(master_address)
        self.client, self.version, self.lease_s = client, version, lease_s
        self.timeout_s, self.backend, self.pause_mode = timeout_s, backend, pause_mode
        self._master_address = master_address
        self.master_address = master_address or "127.0.0.1"
        self.deadline = 0.0
        self._state = RefitGuard()   # shared with the guard thread
        # The caller's thread only (the guard thread renews through the lock too):
        self._lock = LockHolder(client, version, f"{socket.gethostname()}:{os.getpid()}:"
                                                 f"{uuid.uuid4().hex[:8]}", self._state)
        self.engines: list[EngineView] = []
        self._compact = False   # commit with `members_except` (a coordinator of 1.3)
        self._group: WeightUpdateGroup | None = None
        self._watch: RefitWatch | None = None
        self._paused_at_commit = False   # the members' generation was paused when it began

    @property
    def token(self) -> Any:
        """The lock's fencing token once acquired (opaque: sent back as it came)."""
        return self._lock.token

    @property
    def phase(self) -> Phase:
        return self._state.phase

    @property
    def committed(self) -> bool:
        return self._state.phase is Phase.COMMITTED

    # ------------------------------------------------------------------ the block

    def __enter__(self) -> Refit:
        if self._state.phase is not Phase.NEW:
            raise RuntimeError("a Refit is entered once: call fleet.refit() for the next one")
        self._state.advance(Phase.ACQUIRING)
        self.deadline = time.monotonic() + self.timeout_s - min(TEARDOWN_RESERVE_S,
                                                                 self.timeout_s / 4)
        self._watch = RefitWatch(self.client, self.version, self._state, self.deadline,
                                 self.timeout_s, self._lock.renewer(RENEW_EVERY_S),
                                 self._abort_group)
        try:
            self._watch.start()
            result = self._lock.acquire(self.lease_s, self.timeout_s + PAUSE_MARGIN_S,
                                        self.deadline, self.timeout_s)
            self._compact = "next" in result   # the coordinator pages: it speaks 1.3
            self._watch.renewing()
            members = self._lock.members(result, "refit_acquire")
            if result.get("relaunched"):
                members = self._lock.relaunched_members(
                    result["relaunched"], self.deadline - time.monotonic() - CALL_TIMEOUT_S)
            engines = [EngineView.from_json(m["node_id"], True,
                                            {**m, "state": EngineState.HEALTHY.value})
                       for m in members]
            if not engines:
                raise NoMembers(f"refit {self.version!r}: no engine to update (no healthy "
                                "engine on a reachable node with a URL of its own); the lock is "
                                "released and nothing changed")
            self.engines = engines
            if self._master_address is None:
                self.master_address = master_address_for(
                    self.client.address, [str(e.url) for e in engines])
            self._state.advance(Phase.HELD)
            self._watch.hold(engines)
        except BaseException as exc:
            self._watch.stop(wait=True)
            self._state.advance(Phase.ABORTED)
            self._finish()
            self._reraise(exc)
            raise
        # (never the token in a log: it is its holder's alone)
        log.info("refit %r: lock taken, %d engine(s)", self.version, len(self.engines))
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        try:
            if exc is None:
                try:
                    self.commit()
                except BaseException as failure:
                    if not self.committed:
                        self._abort(str(failure) or type(failure).__name__)
                    self._reraise(failure)
                    raise
            elif not self.committed:   # (an error after an explicit commit() aborts nothing)
                self._abort(str(exc) or type(exc).__name__)
        finally:
            self._finish()
        if exc is not None:
            self._reraise(exc)

    def _reraise(self, exc: BaseException) -> None:
        """Raise the contract's error for `exc` if it is not that already (else return, and
        the caller lets `exc` go on)."""
        translated = translate(exc, self._state.snapshot(), self.version, self.timeout_s)
        if translated is not exc:
            raise translated from exc

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *,
                       bucket_bytes: int | None = None, flattened: bool = False) -> None:
        """Broadcast `named_tensors` (in that order) to every member over the weight-update
        group, built first if the membership changed since the last refit."""
        if self.committed:
            raise RuntimeError(f"refit {self.version!r} is committed: update_weights() comes "
                               "before commit()")
        self._check()
        if self._state.phase is Phase.UPDATING:
            raise RolloutWatchdogError(f"refit {self.version!r}: an earlier update_weights() "
                                       "failed; leave the block and refit again")
        # A bad argument is refused before anything is sent (docs/refit.md): the members are
        # not paused for it, and the refit can go on with a call that is right.
        if bucket_bytes is not None:
            check_arguments(bucket_bytes=bucket_bytes)
        named_tensors = not_empty(named_tensors)
        if self._state.advance(Phase.UPDATING) is Phase.HELD:   # first: whatever fails,
            self._each("pause_generation", lambda url: engine_calls.post(   # the members are
                url, "/pause_generation", {"mode": self.pause_mode},      # continued
                self._call_timeout()))
        kwargs: dict[str, Any] = {"weight_version": self.version, "flattened": flattened,
                                  "keep_session": True}   # one session a refit: the commit ends it
        if bucket_bytes is not None:
            kwargs["bucket_bytes"] = bucket_bytes
        try:
            group = self._ensure_group()
            group.update_weights(named_tensors, **kwargs)
        except GroupMemberFailed as exc:   # the gone are lost; the refusals are translated
            self._state.lose(((m.node_id, m.engine, m.incarnation), f"gone: {exc.detail}")
                             for m in exc.gone)
            raise
        self._state.advance(Phase.UPDATED)   # the version went with the last bucket
        self._check()

    def commit(self) -> None:
        """Commit now (leaving the block does it otherwise): set the version on every member,
        read it back, record it at the coordinator, continue the members' generation and
        release the lock, in that order (docs/refit.md): no engine generates with weights the
        fleet has not committed. For frameworks that moved the weights themselves (e.g. CUDA
        IPC to colocated engines) this is the whole of the refit."""
        if self.committed:
            return
        self._check()
        before = self._state.phase
        if before is Phase.UPDATING:
            raise RolloutWatchdogError(f"refit {self.version!r}: an update_weights() call "
                                       "failed, so there is nothing whole to commit")
        # Fenced first: a holder that stalled past its lease (its guard thread stalled with it,
        # so nothing was heard) touches no member, which may be the next holder's by now.
        self._lock.confirm()
        timeout = self._call_timeout()
        if before is not Phase.UPDATED:   # the weights came another way (CUDA IPC, say)
            self._each("update_weight_version", lambda url: engine_calls.post(
                url, "/update_weight_version",
                {"new_version": self.version, "abort_all_requests": False}, timeout))
        group = self._group if before is Phase.UPDATED else None
        in_group = {m.url: m for m in group.members} if group is not None else {}
        reported: dict[str, str | None] = {}
        unanswered: set[str] = set()   # gone or hung: not asked to destroy their side

        def close(url: str) -> None:   # one round trip: session ended, the version read back
            try:
                if group is not None and url in in_group:
                    group.end_session(in_group[url])
                reported[url] = engine_calls.weight_version(url, timeout)
            except engine_calls.EngineCallError as exc:
                if not exc.answered:
                    unanswered.add(url)
                raise

        urls = [str(e.url) for e in self.engines]
        errors = engine_calls.on_each(urls, close)
        wrong: list[tuple[EngineView, str]] = []
        for engine in self.engines:
            url = str(engine.url)
            if url in errors:
                wrong.append((engine, errors[url]))
            elif reported.get(url) != self.version:
                wrong.append((engine, f"reports weight_version {reported.get(url)!r}"))
        ok = [e for e in self.engines if e not in {w for w, _ in wrong}]
        if not ok:   # never a commit with no member: the fleet's version would be no engine's
            raise self._lost(wrong, "every member: nothing committed")
        self._check()   # a death or the deadline during the checks: no commit
        self._paused_at_commit = before.generation_paused   # (an abort continues them)
        self._state.advance(Phase.COMMITTING)   # the guard renews on, until the release
        not_saved: CommandRefused | None = None
        try:   # (a 1.3 coordinator: the compact form)
            answer = self._lock.call("refit_commit", {"version": self.version, **(
                {"members_except": [list(member(engine)) for engine, _ in wrong]}
                if self._compact else {"members": [list(member(e)) for e in ok]})})
        except CommandRefused as exc:
            gone = member_teardown.gone_at_commit(ok, exc.result)
            if gone:   # every member stopped or relaunched meanwhile
                raise self._lost(wrong + gone, "nothing committed") from None
            if exc.code != protocol.NOT_SAVED:
                raise
            not_saved, answer = exc, {}   # it took effect; a restarted coordinator would not
        gone = member_teardown.gone_at_commit(ok, answer)   # know it
        wrong += gone
        unanswered |= {str(e.url) for e, _ in gone}   # (a new process has no side to destroy)
        self._committed(before, urls)
        if wrong and group is not None:   # not reused with a member in an unknown state
            GROUPS.discard(self.client.address, group)
            group.destroy(skip=[in_group[u] for u in unanswered if u in in_group])
        if not_saved is not None:
            raise not_saved
        if wrong:
            raise self._lost(wrong, "the others committed")

    def _committed(self, before: Phase, urls: list[str]) -> None:
        """The coordinator recorded the commit: generation continued on every member, then
        the lock released (a holder that dies in between leaves that to the coordinator,
        which continues the members of a committed lease that ends unreleased)."""
        self._state.advance(Phase.COMMITTED)
        if before.generation_paused:
            self._continue_generation(set(urls))
        self._lock.release()

    def _lost(self, wrong: list[tuple[EngineView, str]], outcome: str) -> EngineLost:
        """The members that failed their read-back are lost: the error that names them."""
        self._state.lose((member(engine), why) for engine, why in wrong)
        return EngineLost(list(self._state.snapshot().lost), "; ".join(
            f"{e.name}: {why}" for e, why in wrong) + f" ({outcome})")

    # ------------------------------------------------------------------ the group

    def _ensure_group(self) -> WeightUpdateGroup:
        from rollout_watchdog.refit_bridge import group as groups
        sizes = {str(e.url): e.tp_size for e in self.engines if e.tp_size}
        timeout = self._call_timeout()
        self._each("server_info", lambda url: sizes.__setitem__(
            url, engine_calls.tp_size(url, timeout)),
            [str(e.url) for e in self.engines if not e.tp_size])
        members = [GroupMember(e.node_id, e.id, e.incarnation, str(e.url), sizes[str(e.url)],
                               _process(e)) for e in self.engines]
        key = self.client.address
        cached = GROUPS.get(key)
        if cached is not None and cached.members == members and cached.backend == self.backend \
                and not cached.aborted and (cached is self._group or not cached.in_session):
            group = cached
        else:
            if cached is not None:
                GROUPS.discard(key, cached)
                cached.destroy()
            group = groups.WeightUpdateGroup(
                members, master_address=self.master_address, backend=self.backend,
                http_timeout_s=CALL_TIMEOUT_S,
                init_timeout_s=max(1.0, self.deadline - time.monotonic()))
        self._group = group
        # A failure heard before the group was in use aborts it now: its calls raise at once.
        self._abort_group(self._state.attach(group), "the refit failed before its group was "
                                                      "in use")
        if group is not cached:
            group.build()
            GROUPS.put(key, group)
        return group

    # ------------------------------------------------------------------ the end

    def _abort_group(self, group: WeightUpdateGroup | None, why: str) -> None:
        """Abort `group` (what the guard handed out for a failure; None: nothing to do). Any
        number of times, from either thread: the group's abort is idempotent."""
        if group is None or group.aborted:
            return
        log.warning("refit %r: aborting the weight-update group: %s", self.version, why)
        group.abort(why)
        GROUPS.discard(self.client.address, group)

    def _check(self) -> None:
        error = failure_of(self._state.snapshot(), self.version, self.timeout_s)
        if error is None and time.monotonic() >= self.deadline:
            error = RefitTimeout(f"refit {self.version!r} ran past its {self.timeout_s:g} s")
        if error is not None:
            raise error

    def _abort(self, reason: str) -> None:
        """Tear the group down, end the members' sessions and continue their generation (those
        that answer), tell the coordinator (members stale, wedged ones restarted)."""
        before = self._state.advance(Phase.ABORTED)
        paused = before.generation_paused or (before is Phase.COMMITTING
                                              and self._paused_at_commit)
        group = self._state.detach()
        self._group = None
        if self._state.snapshot().lease_lost:   # the members may be the next holder's now:
            self._abort_group(group, "the lease was lost")   # only this side is torn down
            if group is not None:
                group.destroy(skip=group.members)
            if paused:   # (the lease's end put them back, unless the coordinator restarted
                member_teardown.ask_put_back(   # since: then it does, asked to)
                    self.client, self._lock.holder, self._lock.token, self.version,
                    self.engines, self._call_timeout())
            return
        wedged: list[Member] = []
        to_continue: set[str] = set()
        if group is not None or paused:
            self._abort_group(group, "the refit failed")
            to_continue, wedged = self._responsive(group)
        if group is not None:
            group.destroy(skip=[m for m in group.members if m.url not in to_continue])
        if paused:
            self._continue_generation(to_continue)
        if self.token is None:
            return
        try:
            self._lock.call("refit_abort", {   # (no members: every member of the listing)
                "wedged": [list(m) for m in wedged], "reason": reason[:400]})
        except RolloutWatchdogError as exc:
            log.error("refit %r: the coordinator did not record the abort (its lease will "
                      "end and do it): %s", self.version, exc)

    def _responsive(self, group: WeightUpdateGroup | None) -> tuple[set[str], list[Member]]:
        """Once the group (if any) is torn down: the URLs of the members to continue, and the
        wedged (member_teardown.responsive); the wedged and the gone are lost."""
        found = member_teardown.responsive(
            self.engines, set() if group is None else {m.url for m in group.members},
            self._state.snapshot().lost)
        self._state.lose([(m, member_teardown.WEDGED) for m in found.wedged])
        self._state.lose([(m, member_teardown.GONE) for m in found.gone])
        return found.to_continue, found.wedged

    def _finish(self) -> None:
        """Release the lock. The guard thread is told to stop and not waited for: the pipe
        wakes it and it ends at once, and past a commit or an abort it can change nothing."""
        if self._watch is not None:
            self._watch.stop(wait=False)
        snap = self._state.snapshot()
        if self.token is not None and not snap.lease_lost and snap.phase is not Phase.COMMITTED:
            self._lock.release()

    def _continue_generation(self, urls: set[str]) -> None:
        member_teardown.continue_generation(urls, self.version, self._call_timeout())

    def _each(self, what: str, call: Callable[[str], Any], urls: list[str] | None = None
              ) -> None:
        """Run `call(url)` on every member (or those of `urls`) concurrently; one that fails is
        lost."""
        errors = engine_calls.on_each([str(e.url) for e in self.engines]
                                      if urls is None else urls, call)
        self._state.lose((member(e), f"{what}: {errors[str(e.url)]}") for e in self.engines
                         if str(e.url) in errors)
        self._check()

    def _call_timeout(self) -> float:
        return max(0.1, min(CALL_TIMEOUT_S, self.deadline - time.monotonic()))


def _process(engine: EngineView) -> str | None:
    """The identity of the member's main process (None from a coordinator or node that does
    not say): part of the group's membership, so that a new process gets a new group."""
    process = engine.raw.get("process")
    return process if isinstance(process, str) else None


__all__ = ["Refit"]
