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
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from types import TracebackType
from typing import TYPE_CHECKING, Any

from rollout_watchdog.common.errors import (
    CommandRefused,
    CoordinatorUnavailable,
    EngineLost,
    LeaseLost,
    RolloutWatchdogError,
)
from rollout_watchdog.refit_bridge import engine_calls
from rollout_watchdog.refit_bridge.rendezvous import master_address_for
from rollout_watchdog.refit_bridge.views import EngineView, FleetEvent
from rollout_watchdog.refit_bridge.weights import check_version

if TYPE_CHECKING:
    import torch

    from rollout_watchdog.refit_bridge.client import FleetClient
    from rollout_watchdog.refit_bridge.group import GroupMember, WeightUpdateGroup

log = logging.getLogger(__name__)
Member = tuple[str, str, int]
RENEW_EVERY_S = 1.0       # the coordinator takes a holder silent for 5 s for gone
LOCK_RETRY_S = 0.5
ACQUIRE_TIMEOUT_S = 40.0  # the fleet-wide pause waits for in-flight probes (up to 30 s)
CALL_TIMEOUT_S = 10.0     # one control call to the coordinator or an engine
GUARD_POLL_S = 0.1
# Deep probes paused by the lock come back by themselves this long after the refit's deadline
# (a safety net, should nothing resume them): never before the refit has ended its way.
PAUSE_MARGIN_S = 60.0
# After an abort: a member whose /server_info is not answered this long is stuck in the
# collective (a gloo peer freed by the teardown answers within half a second).
ABORT_GRACE_S = 1.0
# In-flight requests are aborted (they end with finish_reason "abort", as slime does): the
# cache flush after an update needs an empty queue, which `retract` does not give.
PAUSE_MODE = "abort"


class Refit:
    """One refit; see the module docstring. Built by `FleetClient.refit()`."""

    def __init__(self, client: FleetClient, version: str, *, lease_s: float = 30.0,
                 timeout_s: float = 600.0, backend: str = "nccl",
                 master_address: str | None = None, pause_mode: str = PAUSE_MODE) -> None:
        check_version(version)
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        self.client, self.version, self.lease_s = client, version, lease_s
        self.timeout_s, self.backend, self.pause_mode = timeout_s, backend, pause_mode
        self._master_address = master_address
        self.master_address = master_address or "127.0.0.1"
        self.holder = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.engines: list[EngineView] = []
        self._by_key: dict[tuple[str, str], EngineView] = {}
        self.token: str | None = None   # opaque: echoed with the holder on every call
        self.deadline = 0.0
        self.committed = False
        self.released = False   # the commit releases the lock too
        self._committing = False
        self._lost: dict[Member, str] = {}     # member -> why
        self._lease_lost: str | None = None
        self._expired = False
        self._group: WeightUpdateGroup | None = None
        self._aborted = False
        self._version_sent = False
        self._guard_failed: str | None = None
        self._paused = False
        self._stop = threading.Event()
        self._guard: threading.Thread | None = None
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ the block

    def __enter__(self) -> Refit:
        if self.deadline:
            raise RuntimeError("a Refit is entered once: call fleet.refit() for the next one")
        self.deadline = time.monotonic() + self.timeout_s
        self._start_guard()
        try:
            result = self._acquire()
            self.token = result["token"]
            members = result["members"]
            if result.get("relaunched"):
                members = self._wait_for_relaunched(result["relaunched"])
            engines = [EngineView.from_json(m["node_id"], True, {**m, "state": "healthy"})
                       for m in members]
            self._by_key = {(e.node_id, e.id): e for e in engines}
            self.engines = engines
            if self._master_address is None:
                self.master_address = master_address_for(
                    self.client.address, [str(e.url) for e in engines])
        except BaseException:
            self._stop_guard()
            self._finish()
            raise
        log.info("refit %r: lock taken (token %s), %d engine(s)", self.version, self.token,
                 len(self.engines))
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
                    translated = self._translate(failure)
                    if translated is failure:
                        raise
                    raise translated from failure
            else:
                self._abort(str(exc) or type(exc).__name__)
        finally:
            self._finish()
        if exc is not None:
            translated = self._translate(exc)
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
        if not self._paused:
            self._paused = True   # first: whatever fails, the members are continued
            self._each("pause_generation", lambda url: engine_calls.post(
                url, "/pause_generation", {"mode": self.pause_mode}, self._call_timeout()))
        group = self._ensure_group()
        kwargs: dict[str, Any] = {"weight_version": self.version, "flattened": flattened,
                                  "keep_session": True}   # one session a refit: the commit ends it
        if bucket_bytes is not None:
            kwargs["bucket_bytes"] = bucket_bytes
        group.update_weights(named_tensors, **kwargs)
        self._version_sent = True   # with the last bucket: every member reports it now
        self._check()

    def commit(self) -> None:
        """Commit now (leaving the block does it otherwise): set the version on every member,
        continue their generation, read the version back, record it at the coordinator and
        release the lock (one call). For frameworks that moved the weights
        themselves (e.g. CUDA IPC to colocated engines) this is the whole of the refit."""
        if self.committed:
            return
        self._check()
        timeout = self._call_timeout()
        if not self._version_sent:   # the weights came another way (CUDA IPC, say)
            self._each("update_weight_version", lambda url: engine_calls.post(
                url, "/update_weight_version",
                {"new_version": self.version, "abort_all_requests": False}, timeout))
        paused, self._paused = self._paused, False
        group = self._group if self._version_sent else None
        in_group = {m.url: m for m in group.members} if group is not None else {}
        reported: dict[str, str | None] = {}
        unanswered: set[str] = set()   # gone or hung: not asked to destroy their side

        def close(url: str) -> None:   # one round trip: session ended, generation continued,
            failed: RolloutWatchdogError | None = None   # the version read back
            try:
                if group is not None and url in in_group:
                    try:
                        group.end_session(in_group[url])
                    except RolloutWatchdogError as exc:
                        failed = exc
                if paused:
                    self._continue(url, timeout)
                if failed is not None:
                    raise failed
                reported[url] = engine_calls.weight_version(url, timeout)
            except engine_calls.EngineCallError as exc:
                if not exc.answered:
                    unanswered.add(url)
                raise

        errors = engine_calls.on_each([str(e.url) for e in self.engines], close)
        wrong: list[tuple[EngineView, str]] = []
        for engine in self.engines:
            url = str(engine.url)
            if url in errors:
                wrong.append((engine, errors[url]))
            elif reported.get(url) != self.version:
                wrong.append((engine, f"reports weight_version {reported.get(url)!r}"))
        ok = [e for e in self.engines if e not in {w for w, _ in wrong}]
        self._check()   # a death or the deadline during the checks: no commit
        with self._lock:
            self._committing = True   # the guard's renewals stop: this call releases the lock
        result = self._call("refit_commit", {
            "version": self.version, "release": True,
            "members": [[e.node_id, e.id, e.incarnation] for e in ok]})
        self.committed = True
        self.released = "released" in result   # (a coordinator before `release` ignores it)
        if wrong and group is not None:   # not reused with a member in an unknown state
            set_cached_group(self.client, None)
            group.destroy(skip=[in_group[u] for u in unanswered if u in in_group])
        if wrong:
            for engine, why in wrong:
                self._lost[_member(engine)] = why
            raise EngineLost(list(self._lost), "; ".join(
                f"{e.name}: {why}" for e, why in wrong) + " (the others committed)")

    # ------------------------------------------------------------------ the lock

    def _acquire(self) -> dict[str, Any]:
        while True:
            left = self.deadline - time.monotonic()
            try:
                _, result = self.client.call("refit_acquire", {
                    "holder": self.holder, "version": self.version, "lease_s": self.lease_s,
                    "deadline_s": self.timeout_s + PAUSE_MARGIN_S},
                    timeout_s=min(ACQUIRE_TIMEOUT_S, left))
                return dict(result)
            except CommandRefused as exc:
                if "refit lock is held" not in exc.reason:
                    raise
                if time.monotonic() + LOCK_RETRY_S >= self.deadline:
                    raise CommandRefused(f"no refit lock within {self.timeout_s:g} s: "
                                         f"{exc.reason}") from None
            time.sleep(LOCK_RETRY_S)

    def _wait_for_relaunched(self, relaunched: list[list[str]]) -> list[dict[str, Any]]:
        """Deferred engines the refit relaunched join once healthy (or at the deadline)."""
        wanted = {(n, e) for n, e in relaunched}
        try:
            self.client.wait_until(
                lambda view: all(v.state == "healthy" for v in view
                                 if (v.node_id, v.id) in wanted),
                max(0.1, self.deadline - time.monotonic() - CALL_TIMEOUT_S))
        except TimeoutError as exc:
            log.warning("refit %r: relaunched engines not healthy in time, going on without "
                        "them: %s", self.version, exc)
        return list(self._call("refit_members", {})["members"])

    def _call(self, cmd: str, args: dict[str, Any], timeout_s: float | None = None
              ) -> dict[str, Any]:
        try:
            _, result = self.client.call(cmd, {**args, "holder": self.holder,
                                               "token": self.token},
                                         timeout_s=timeout_s or CALL_TIMEOUT_S)
        except CommandRefused as exc:
            if exc.reason.startswith("lease lost"):
                raise LeaseLost(exc.reason) from None
            raise
        return result if isinstance(result, dict) else {}

    # ------------------------------------------------------------------ the group

    def _ensure_group(self) -> WeightUpdateGroup:
        from rollout_watchdog.refit_bridge import group as groups
        members = [groups.GroupMember(e.node_id, e.id, e.incarnation, str(e.url),
                                      e.tp_size or engine_calls.tp_size(str(e.url),
                                                                        self._call_timeout()))
                   for e in self.engines]
        cached = cached_group(self.client)
        if cached is not None and cached.members == members and cached.backend == self.backend \
                and not cached.aborted and (cached is self._group or not cached.in_session):
            self._group = cached
            return cached
        if cached is not None:
            cached.destroy()
        set_cached_group(self.client, None)
        group = groups.WeightUpdateGroup(
            members, master_address=self.master_address, backend=self.backend,
            http_timeout_s=CALL_TIMEOUT_S,
            init_timeout_s=max(1.0, self.deadline - time.monotonic()))
        with self._lock:
            self._group = group
        if self._lost or self._expired or self._lease_lost:   # heard before the group existed
            self._abort_group("the refit failed before its group was built")
        group.build()
        set_cached_group(self.client, group)
        return group

    # ------------------------------------------------------------------ the guard thread

    def _start_guard(self) -> None:
        ready = threading.Event()
        self._guard = threading.Thread(target=self._run_guard, args=(ready,),
                                       name="rollout-watchdog-refit-guard", daemon=True)
        self._guard.start()
        ready.wait(CALL_TIMEOUT_S)

    def _stop_guard(self) -> None:
        self._stop.set()
        if self._guard is not None:
            self._guard.join(CALL_TIMEOUT_S)
            self._guard = None

    def _run_guard(self, ready: threading.Event) -> None:
        """Renew the lease, follow members' events, watch the deadline; abort the group when
        any of them says the refit cannot complete. A failure of the guard itself aborts the
        refit too (nothing would watch it any more)."""
        try:
            with self.client.events(resume=True, idle_s=GUARD_POLL_S) as stream:
                ready.set()
                self._guard_loop(stream)
        except Exception as exc:   # noqa: BLE001 - reported through _check()
            log.exception("refit %r: the guard thread failed", self.version)
            self._guard_failed = f"the refit's guard thread failed: {exc}"
            self._abort_group(self._guard_failed)
        finally:
            ready.set()

    def _guard_loop(self, stream: Iterable[FleetEvent]) -> None:
        early: list[FleetEvent] = []   # heard before the members were known
        next_renew = time.monotonic() + RENEW_EVERY_S
        while not self._stop.is_set():
            for event in stream:   # ends after GUARD_POLL_S without an event
                if not self._by_key:
                    early.append(event)
                else:
                    for queued in early:
                        self._heard(queued)
                    early.clear()
                    self._heard(event)
                if self._stop.is_set() or time.monotonic() >= next_renew:
                    break          # the timers below are due even in a stream of events
            now = time.monotonic()
            if now >= self.deadline and not self._expired:
                self._expired = True
                self._abort_group(f"the refit's deadline of {self.timeout_s:g} s passed")
            if self.token is not None and now >= next_renew and not self._committing:
                next_renew = now + RENEW_EVERY_S
                self._renew()

    def _heard(self, event: FleetEvent) -> None:
        engine = self._by_key.get((event.node_id, str(event.engine)))
        if engine is None:
            return
        gone = event.kind == "state" and event.to not in ("healthy", "suspect") \
            and event.incarnation == engine.incarnation
        replaced = event.incarnation is not None and event.incarnation > engine.incarnation
        if gone or replaced:
            why = f"{event.kind} {event.to or ''} ({event.cause or event.detail})".strip()
            self._lost.setdefault(_member(engine), why)
            self._abort_group(f"{engine.name} (incarnation {engine.incarnation}): {why}")

    def _renew(self) -> None:
        try:
            self._call("refit_renew", {}, timeout_s=RENEW_EVERY_S)
        except LeaseLost as exc:
            with self._lock:
                if self._committing:   # answered after the commit released the lock: the
                    return             # commit's own answer says how it went
            self._lease_lost = str(exc)
            self._abort_group(str(exc))
        except CoordinatorUnavailable as exc:   # its lease may still hold: try again
            log.warning("refit %r: lease not renewed: %s", self.version, exc)

    def _abort_group(self, why: str, group: WeightUpdateGroup | None = None) -> None:
        with self._lock:
            group = group or self._group
            if group is None or self.committed or self._aborted:
                return
            self._aborted = True
        log.warning("refit %r: aborting the weight-update group: %s", self.version, why)
        group.abort(why)
        set_cached_group(self.client, None)

    # ------------------------------------------------------------------ the end

    def _check(self) -> None:
        if self._guard_failed:
            raise RolloutWatchdogError(self._guard_failed)
        if self._lost:
            raise EngineLost(list(self._lost), "; ".join(self._lost.values()))
        if self._lease_lost:
            raise LeaseLost(self._lease_lost)
        if self._expired or time.monotonic() >= self.deadline:
            raise TimeoutError(f"refit {self.version!r} ran past its {self.timeout_s:g} s")

    def _translate(self, exc: BaseException) -> BaseException:
        """The error the block raises: EngineLost naming every member the refit lost (dead,
        or wedged in the collective), with what went wrong; else the error itself."""
        if isinstance(exc, (EngineLost, LeaseLost)):
            return exc
        if self._lost:
            return EngineLost(list(self._lost), "; ".join(dict.fromkeys(
                [*self._lost.values(), str(exc)])))
        if self._lease_lost:
            return LeaseLost(self._lease_lost)
        return exc

    def _abort(self, reason: str) -> None:
        """Tear the group down, tell the coordinator (members stale, wedged ones restarted)."""
        wedged: list[Member] = []
        with self._lock:
            group, self._group = self._group, None
        if group is not None:
            self._abort_group("the refit failed", group)
            wedged = self._wedged([m for m in group.members if (
                m.node_id, m.engine, m.incarnation) not in self._lost])
            group.destroy(skip=[m for m in group.members
                                if (m.node_id, m.engine, m.incarnation) in self._lost])
            set_cached_group(self.client, None)
        self._continue_generation()
        if self.token is None or self._lease_lost:
            return
        try:
            self._call("refit_abort", {
                "members": [[e.node_id, e.id, e.incarnation] for e in self.engines],
                "wedged": [list(m) for m in wedged], "reason": reason[:400]})
        except RolloutWatchdogError as exc:
            log.error("refit %r: the coordinator did not record the abort (its lease will "
                      "end and do it): %s", self.version, exc)

    def _wedged(self, candidates: list[GroupMember]) -> list[Member]:
        """Once the group is torn down, the members (not known lost) that take no further
        control call: still blocked in the collective (a gloo peer is usually freed by the
        teardown, but one waiting on a dead peer in gloo's tree is not; an NCCL one waits out
        its timeout). They are lost and restarted by their watchdogs; members that are gone
        are lost too. Those that answer are only stale."""
        state: dict[str, str] = {}
        engine_calls.on_each([m.url for m in candidates], lambda url: state.__setitem__(
            url, engine_calls.responsiveness(url, ABORT_GRACE_S)))
        wedged = []
        for m in candidates:
            member = (m.node_id, m.engine, m.incarnation)
            if state.get(m.url) == "stuck":
                wedged.append(member)
                self._lost.setdefault(member, "its update call did not complete and it takes "
                                              "no control call (wedged in the collective)")
            elif state.get(m.url) == "gone":
                self._lost.setdefault(member, "gone (its server refuses connections)")
        return wedged

    def _finish(self) -> None:
        """Release the lock. The guard thread is told to stop and not waited for: it ends
        within GUARD_POLL_S, and past a commit or an abort it can change nothing."""
        self._stop.set()
        self._guard = None
        if self.token is not None and not self._lease_lost and not self.released:
            try:
                self._call("refit_release", {})
            except RolloutWatchdogError as exc:
                log.error("refit %r: lock not released (its lease will end): %s",
                          self.version, exc)

    def _continue_generation(self) -> None:
        """Let the members that are not lost generate again (a wedged one would not answer)."""
        if self._paused:
            self._paused = False
            timeout = self._call_timeout()
            members = [str(e.url) for e in self.engines if _member(e) not in self._lost]
            engine_calls.on_each(members, lambda url: self._continue(url, timeout))

    def _continue(self, url: str, timeout_s: float) -> None:
        """Continue generation on one member; a failure is logged (the member is not lost for
        it: its weights are what counts)."""
        try:
            engine_calls.post(url, "/continue_generation", {}, timeout_s)
        except RolloutWatchdogError as exc:
            log.warning("refit %r: continue_generation: %s", self.version, exc)

    def _each(self, what: str, call: Callable[[str], Any]) -> None:
        """Run `call(url)` on every member concurrently; one that fails is lost."""
        errors = engine_calls.on_each([str(e.url) for e in self.engines], call)
        for engine in self.engines:
            error = errors.get(str(engine.url))
            if error is not None:
                self._lost.setdefault(_member(engine), f"{what}: {error}")
        self._check()

    def _call_timeout(self) -> float:
        return max(0.1, min(CALL_TIMEOUT_S, self.deadline - time.monotonic()))


def _member(engine: EngineView) -> Member:
    return (engine.node_id, engine.id, engine.incarnation)


def cached_group(client: FleetClient) -> WeightUpdateGroup | None:
    """The group of the client's last refit: it outlives a refit (rebuilt only when the
    membership changes) and belongs to this process, so it is never pickled with the client."""
    group: WeightUpdateGroup | None = client.weight_group
    return group


def set_cached_group(client: FleetClient, group: WeightUpdateGroup | None) -> None:
    client.weight_group = group


__all__ = ["Refit"]
