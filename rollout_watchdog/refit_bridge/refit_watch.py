"""The refit's guard thread: renews the lease every second, follows the fleet's events and
watches the deadline, and tells the refit's `RefitGuard` what it heard (a member lost, the
lease lost, the deadline passed, itself failed); the guard hands back the group to abort, which
this thread aborts at once, freeing a trainer blocked in a collective.

Threads: the refit's thread calls `renewing()` once the lock is taken and `hold()` once the
members are known, handing them over (Events order both before this thread acts on them);
everything else here is this thread's own. The thread waits in its event stream's poll, which
also polls the thread's end of a pipe (`agent.pipe`, as the coordinator's hub does): `stop()`
and `renewing()` go down it and wake the thread at once; otherwise it sleeps until an event
or its next timer (the lease's renewal, the refit's deadline).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import zmq

from rollout_watchdog.agent.pipe import STOP, Pipe
from rollout_watchdog.common.errors import (
    CommandRefused,
    CoordinatorUnavailable,
    LeaseLost,
    RolloutWatchdogError,
)
from rollout_watchdog.common.states import EngineState
from rollout_watchdog.refit_bridge.refit_state import Phase, RefitGuard
from rollout_watchdog.refit_bridge.stream import EventStream
from rollout_watchdog.refit_bridge.views import EngineView, FleetEvent

if TYPE_CHECKING:
    from rollout_watchdog.refit_bridge.client import FleetClient
    from rollout_watchdog.refit_bridge.group import WeightUpdateGroup

log = logging.getLogger(__name__)
RENEW_EVERY_S = 1.0       # the coordinator takes a holder silent for 5 s for gone
RENEW = b"RENEW"          # down the pipe: the lock is taken, renew its lease from now on
START_TIMEOUT_S = 10.0    # the thread's subscription is made before the lock is asked for
MIN_WAIT_S = 0.001
AbortGroup = Callable[["WeightUpdateGroup | None", str], None]


class RefitWatch:
    """The guard thread of one refit (see the module docstring)."""

    def __init__(self, client: FleetClient, version: str, state: RefitGuard, deadline: float,
                 timeout_s: float, renew: Callable[[], object], abort_group: AbortGroup) -> None:
        self.client, self.version, self.state = client, version, state
        self.deadline, self.timeout_s = deadline, timeout_s
        self._renew_call, self._abort_group = renew, abort_group
        self._pipe: Pipe | None = None
        self._ready = threading.Event()  # the thread follows the events
        self._renewing = threading.Event()   # the lock is taken: renew its lease
        self._held = threading.Event()   # set once _by_key holds the members
        self._by_key: dict[tuple[str, str], EngineView] = {}
        self._thread = threading.Thread(target=self._run, name="rollout-watchdog-refit-guard",
                                        daemon=True)

    def start(self) -> None:
        """Start; returns once the thread follows the events (so none of the refit is missed)."""
        try:
            self._pipe = Pipe(zmq.Context.instance(), "refit-guard")   # the thread closes it
            self._thread.start()
        except (RuntimeError, zmq.ZMQError) as exc:   # out of threads or file descriptors
            raise RolloutWatchdogError(f"the refit's guard thread cannot start: {exc}") from exc
        self._ready.wait(START_TIMEOUT_S)

    def renewing(self) -> None:
        """The lock is taken: renew its lease from now on (the thread wakes to do it)."""
        self._renewing.set()
        if self._pipe is not None:
            self._pipe.send(RENEW)

    def hold(self, engines: list[EngineView]) -> None:
        """These are the members to watch (events heard before are checked now)."""
        self._by_key = {(e.node_id, e.id): e for e in engines}
        self._held.set()

    def stop(self, wait: bool) -> None:
        """Stop: STOP down the pipe wakes the thread, which ends at once; with `wait`, until it
        ended (at most START_TIMEOUT_S). Past a commit or an abort it can change nothing."""
        if self._pipe is not None:
            self._pipe.send(STOP)
        if wait and self._thread.is_alive():
            self._thread.join(START_TIMEOUT_S)

    def _run(self) -> None:
        """Any failure of the thread itself aborts the refit (nothing would watch it)."""
        assert self._pipe is not None
        try:
            with self.client.events(resume=True, idle_s=RENEW_EVERY_S,
                                    wake=self._pipe.end) as stream:
                self._ready.set()
                self._loop(stream, self._pipe)
        except Exception as exc:   # noqa: BLE001 - reported through the guard
            log.exception("refit %r: the guard thread failed", self.version)
            why = f"the refit's guard thread failed: {exc}"
            self._abort_group(self.state.fail_guard(why), why)
        finally:
            self._pipe.close()
            self._ready.set()

    def _loop(self, stream: EventStream, pipe: Pipe) -> None:
        """Until STOP comes down the pipe: the timers that are due, then the events until the
        next timer (or a command down the pipe)."""
        early: list[FleetEvent] = []   # heard before the members were known
        next_renew = time.monotonic() + RENEW_EVERY_S
        expired = False
        while STOP not in pipe.receive():
            now = time.monotonic()
            if now >= self.deadline and not expired:
                expired = True
                self._abort_group(self.state.expire(),
                                  f"the refit's deadline of {self.timeout_s:g} s passed")
            if self._renewing.is_set() and now >= next_renew \
                    and self.state.phase is not Phase.ABORTED:   # (to the release)
                next_renew = now + RENEW_EVERY_S
                self._renew()
            due = self._due(next_renew, expired)
            stream.idle_s = None if due is None else max(MIN_WAIT_S, due - time.monotonic())
            for event in stream:   # ends at `due` without an event, at once on a command
                if not self._held.is_set():
                    early.append(event)
                else:
                    for queued in early:
                        self._heard(queued)
                    early.clear()
                    self._heard(event)
                if due is not None and time.monotonic() >= due:
                    break          # the timers are due even in a stream of events

    def _due(self, next_renew: float, expired: bool) -> float | None:
        """When the next timer is due: the lease's renewal while this thread renews it, the
        refit's deadline until it passed (None: neither; a command down the pipe wakes it)."""
        timers = [] if expired else [self.deadline]
        if self._renewing.is_set() and self.state.phase is not Phase.ABORTED:
            timers.append(next_renew)
        return min(timers, default=None)

    def _heard(self, event: FleetEvent) -> None:
        engine = self._by_key.get((event.node_id, str(event.engine)))
        if engine is None:
            return
        gone = event.kind == "state" \
            and event.to not in (EngineState.HEALTHY, EngineState.SUSPECT) \
            and event.incarnation == engine.incarnation
        replaced = event.incarnation is not None and event.incarnation > engine.incarnation
        if gone or replaced:
            why = f"{event.kind} {event.to or ''} ({event.cause or event.detail})".strip()
            member = (engine.node_id, engine.id, engine.incarnation)
            self._abort_group(self.state.lose([(member, why)], seen=True),
                              f"{engine.name} (incarnation {engine.incarnation}): {why}")

    def _renew(self) -> None:
        try:
            self._renew_call()
        except LeaseLost as exc:
            self._abort_group(self.state.lose_lease(str(exc)), str(exc))
        except (CoordinatorUnavailable, CommandRefused) as exc:   # its lease may still hold
            log.warning("refit %r: lease not renewed: %s", self.version, exc)
