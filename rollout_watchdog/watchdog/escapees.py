"""The containment sweep: what left an engine's tree, and cgroups of launches that are over.

It exists apart from the supervisor because it is a sweep over the host, not a decision about
one engine: the daemon runs it after each scan of the process table, and a kill runs it before
its SIGKILL (so that the kill reaches an escapee too). It gets the engines' records, the tracker,
the OS calls and the event publisher passed in, and keeps only which escapees it has already
reported.
"""

from __future__ import annotations

import logging
import signal

from rollout_watchdog.common.states import EngineState
from rollout_watchdog.watchdog.cgroup import CgroupError, CgroupManager
from rollout_watchdog.watchdog.containment import parse_marker
from rollout_watchdog.watchdog.engine import EngineRuntime
from rollout_watchdog.watchdog.process import ProcessOps, ProcKey, ProcStat
from rollout_watchdog.watchdog.publish import Publisher
from rollout_watchdog.watchdog.tracker import ProcessTracker

log = logging.getLogger("rollout_watchdog.watchdog")
S = EngineState


class EscapeeSweep:
    def __init__(self, engines: dict[str, EngineRuntime], tracker: ProcessTracker,
                 ops: ProcessOps, publisher: Publisher) -> None:
        self.engines = engines
        self.tracker = tracker
        self.ops = ops
        self.publisher = publisher
        self._killed: set[ProcKey] = set()
        # False while adoption restores the engines one by one: an engine not restored yet has
        # no marker, so its live processes would look like a finished incarnation's (a kill
        # that adoption resumes looks for escapees before the next engine is restored).
        self.ready = True

    def take_in(self, table: dict[int, ProcStat]) -> bool:
        """Processes of this node's engines that left their trees: one of a current
        incarnation is taken back into it (so the kill reaches it); one of an incarnation that
        is over (an escape before the kill, an older copy a crashed daemon never recorded: the
        newest is adopted, adoption.py) is killed with its descendants. True if any was taken
        in."""
        if not self.ready:
            return False
        taken = False
        self._killed &= {s.key for s in table.values()}
        for stat, marker in self.tracker.escapees(table):
            subtree = [stat.key, *self.ops.descendants([stat.pid], table)[stat.pid]]
            owner = next((e for e in self.engines.values() if e.marker == marker
                          and (e.state.running or e.state == S.STOPPING)), None)
            if owner is not None:
                for key in subtree:
                    if key not in owner.procs:
                        owner.procs[key] = False
                        self.tracker.watch(owner, key)
                taken = True
                continue
            killed = [k.pid for k in subtree if self.ops.signal_proc(k, signal.SIGKILL)]
            if stat.key in self._killed:
                continue  # said once; the signal is sent again while it lingers
            self._killed.add(stat.key)
            parsed = parse_marker(marker)
            self.publisher.emit(self.engines.get(parsed.engine_id) if parsed else None,
                                "escapee_killed",
                                detail=f"SIGKILL to pid(s) {killed}: marked {marker}, an "
                                       "incarnation that is over")
        return taken

    def clean_cgroups(self, cgroups: CgroupManager | None) -> None:
        """Engine cgroups of launches that are over: killed if anything is left in them
        (a copy a crashed daemon never recorded), removed once empty."""
        if cgroups is None:
            return
        current = {e.cgroup for e in self.engines.values() if e.cgroup}
        try:
            leftovers = [p for p in cgroups.existing() if str(p) not in current]
        except CgroupError as exc:
            log.warning("cannot look for leftover engine cgroups: %s", exc)
            return
        for path in leftovers:
            if not self.ops.cgroup_remove(path) and self.ops.cgroup_kill(path):
                self.publisher.emit(None, "escapee_killed",
                                    detail=f"cgroup.kill of {path}: a launch that is over")
