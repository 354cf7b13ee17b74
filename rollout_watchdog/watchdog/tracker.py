"""The process tracker: which processes belong to which engine, and when they exit.

One pidfd per process of every engine tree, registered with the loop's poller, so an exit is
seen at once, paused or not. A periodic sweep of the process table finds processes born since
(so a kill reaches them). Where no pidfd can be had (no file descriptor left), the process is
polled instead; an exit is never inferred from an error.
"""

from __future__ import annotations

import errno
import logging
import os
import resource
from collections.abc import Callable, Container
from typing import Any

import zmq

from rollout_watchdog.common.states import EngineState
from rollout_watchdog.watchdog.engine import EngineRuntime
from rollout_watchdog.watchdog.policy import ENGINE_PROCESS_PREFIX
from rollout_watchdog.watchdog.process import ProcessOps, ProcKey, ProcStat

log = logging.getLogger(__name__)
# How often a process without a pidfd is polled for its exit.
POLL_INTERVAL_S = 0.05

OnGone = Callable[[EngineRuntime, ProcKey], None]


def pidfd_budget() -> int:
    """How many pidfds the tracker may hold: the open-file limit, less a quarter of it (at
    least 128) kept for sockets, files and probes."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 1 << 20
    return max(0, soft - max(128, soft // 4))


class ProcessTracker:
    def __init__(self, engines: dict[str, EngineRuntime], poller: zmq.Poller, ops: ProcessOps,
                 on_gone: OnGone) -> None:
        self.engines = engines
        self.poller = poller
        self.ops = ops
        self.on_gone = on_gone
        self.pidfds: dict[int, tuple[str, ProcKey]] = {}
        # Pidfds never take the descriptors the daemon needs for everything else (its
        # sockets, files, probes): past this many, processes are polled instead.
        self.max_pidfds = pidfd_budget()
        self.polled: dict[ProcKey, str] = {}       # processes watched without a pidfd
        self.next_poll = 0.0
        self._live_groups: set[int] | None = None
        # This node's markers ("node:statedir-hash/"), set by the supervisor. Until then, none:
        # "" would match every marker on the host, every other daemon's engines included.
        self.marker_prefix = ""
        self._unmarked: set[ProcKey] = set()       # processes looked at: no marker of ours

    def new_turn(self) -> None:
        """Forget what was cached for the previous loop turn."""
        self._live_groups = None

    def live_groups(self) -> set[int]:
        """Live process groups, scanned at most once per loop turn."""
        if self._live_groups is None:
            self._live_groups = self.ops.live_process_groups()
        return self._live_groups

    def watch(self, engine: EngineRuntime, key: ProcKey) -> None:
        """Watch a process of the engine; one already gone counts as an exit seen now."""
        try:
            if len(self.pidfds) >= self.max_pidfds:
                raise OSError(errno.EMFILE, f"{self.max_pidfds} pidfds open: the rest of the "
                              "open-file limit is kept for the daemon's own use")
            fd = self.ops.open_pidfd(key)
        except OSError as exc:
            if not self.polled:
                log.warning("cannot open a pidfd (%s): watching pid %d by polling",
                            exc.strerror or exc, key.pid, extra={"engine": engine.id})
            self.polled[key] = engine.id
            return
        if fd is None:
            self.on_gone(engine, key)
            return
        self.pidfds[fd] = (engine.id, key)
        self.poller.register(fd, zmq.POLLIN)

    def watch_all(self, engine: EngineRuntime) -> None:
        incarnation = engine.incarnation
        for key in list(engine.procs):
            if engine.incarnation != incarnation:
                return  # a failure seen meanwhile already led to a relaunch
            self.watch(engine, key)

    def unwatch_engine(self, engine_id: str) -> None:
        for fd, (owner, _) in list(self.pidfds.items()):
            if owner == engine_id:
                self._unwatch(fd)
        for key, owner in list(self.polled.items()):
            if owner == engine_id:
                del self.polled[key]

    def _unwatch(self, fd: int) -> None:
        self.pidfds.pop(fd, None)
        self.poller.unregister(fd)
        os.close(fd)

    def handle(self, ready: Container[Any]) -> None:
        """The exits the poller reported."""
        for fd, (engine_id, key) in list(self.pidfds.items()):
            if fd in ready:
                self._unwatch(fd)
                self._gone(engine_id, key)

    def poll_unwatched(self, now: float) -> None:
        """Processes without a pidfd: a look at each, every POLL_INTERVAL_S."""
        if not self.polled or now < self.next_poll:
            return
        self.next_poll = now + POLL_INTERVAL_S
        for key, engine_id in list(self.polled.items()):
            try:
                alive = self.ops.is_alive(key)
            except OSError:
                continue  # cannot tell now: look again later
            if not alive:
                del self.polled[key]
                self._gone(engine_id, key)

    def next_deadline(self) -> float | None:
        return self.next_poll if self.polled else None

    def _gone(self, engine_id: str, key: ProcKey) -> None:
        engine = self.engines.get(engine_id)
        if engine is not None:
            self.on_gone(engine, key)

    def sweep(self, engines: list[EngineRuntime], table: dict[int, ProcStat]) -> bool:
        """Refresh the trees of the running engines from one scan of the process table: new
        processes are watched (so a kill reaches them); a main process found gone without its
        exit event (not expected) still counts. A main process that reads as a zombie while its
        pidfd is watched is left to the pidfd: the leader of a multi-threaded process is a
        zombie before its other threads have exited, and its exit status can be read (and its
        pidfd polls readable) only once they have. True if a new process was found."""
        alive = []
        watched = {key for _, key in self.pidfds.values()}
        for engine in engines:
            if engine.main is None:
                continue
            stat = table.get(engine.main.pid)
            if stat is not None and stat.alive and stat.key == engine.main:
                alive.append(engine)
            elif stat is not None and stat.key == engine.main and engine.main in watched:
                continue   # exiting: its pidfd says when its status can be read
            elif engine.main not in engine.dead:
                self.on_gone(engine, engine.main)
        found = self.refresh(alive, table)
        for engine in alive:
            if engine.state in (EngineState.HEALTHY, EngineState.SUSPECT):
                found |= self._named_fatal(engine, table)
        return found

    @staticmethod
    def _named_fatal(engine: EngineRuntime, table: dict[int, ProcStat]) -> bool:
        """A process that took one of the engine's own names after it turned healthy (a
        scheduler renames itself once it runs) is fatal from then on."""
        named = [k for k, fatal in engine.procs.items() if not fatal
                 and (stat := table.get(k.pid)) is not None and stat.key == k
                 and stat.comm.startswith(ENGINE_PROCESS_PREFIX)]
        for key in named:
            engine.procs[key] = True
        return bool(named)

    def refresh(self, engines: list[EngineRuntime],
                table: dict[int, ProcStat] | None = None) -> bool:
        """Take in the processes now in the engines' trees; True if any was new."""
        roots = [e for e in engines if e.main is not None]
        if not roots:
            return False
        trees = self.ops.descendants([e.main.pid for e in roots if e.main is not None], table)
        found = False
        for engine in roots:
            assert engine.main is not None
            for key in trees.get(engine.main.pid, []):
                if key not in engine.procs:
                    engine.procs[key] = False
                    self.watch(engine, key)
                    found = True
        return found

    def escapees(self, table: dict[int, ProcStat]) -> list[tuple[ProcStat, str]]:
        """Processes outside every engine tree we know that carry a marker of this node (they
        left a tree: a double fork, a new session, a parent that died), each with its marker.
        A process is looked at once in its life: unmarked ones are remembered as such, but not
        one whose environment reads empty (caught mid-exec, it would escape for good).
        With no prefix set, none: nothing is provably this node's, and every escapee is killed."""
        if not self.marker_prefix:
            return []
        known: set[ProcKey] = set()
        for engine in self.engines.values():
            known.update(engine.procs)
        found, present = [], set()
        for stat in table.values():
            key = stat.key
            if not stat.alive or key in known:
                continue
            present.add(key)
            if key in self._unmarked:
                continue
            marker = self.ops.read_marker(stat.pid)
            if marker and marker.startswith(self.marker_prefix):
                found.append((stat, marker))
            elif marker != "" or stat.kernel_thread:
                self._unmarked.add(key)
        self._unmarked &= present
        return found

    def take_in_group(self, engine: EngineRuntime) -> None:
        """The main process exited: children it forked since the last sweep are still in its
        group. Take them in, so that the kill reaches them. Where the main process is our
        unreaped child, its pid (so its group id) cannot have been reused and the whole group
        is the engine's; for an adopted engine, only members that carry the incarnation's
        marker, or a group that a known live process of the engine is in, are taken."""
        assert engine.main is not None
        pgid = engine.main.pid
        table = self.ops.process_table()
        members = [s for s in table.values() if s.pgrp == pgid and s.alive]
        ours = (engine.popen is not None and engine.popen.returncode is None) or any(
            s.key in engine.procs and s.key not in engine.dead for s in members)
        for stat in members:
            if stat.key in engine.procs:
                continue
            if ours or (engine.marker and self.ops.read_marker(stat.pid) == engine.marker):
                engine.procs[stat.key] = False
                self.watch(engine, stat.key)
        if engine.popen is not None:
            engine.returncode = engine.popen.poll()

    def close(self) -> None:
        for fd in list(self.pidfds):
            os.close(fd)
        self.pidfds.clear()
        self.polled.clear()
