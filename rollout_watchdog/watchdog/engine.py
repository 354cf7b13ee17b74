"""The runtime record of one supervised engine: its spec plus everything the daemon knows about
the current incarnation. Plain data; the daemon drives it."""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from rollout_watchdog.common.states import Cause, EngineState
from rollout_watchdog.config import EngineConfig
from rollout_watchdog.watchdog.process import ProcKey


class AfterKill(str, Enum):
    """What a kill sequence leads to once the processes are gone and the resources released."""

    RECOVER = "recover"    # a failure: relaunch after backoff, or wait, or fail (budget)
    RESTART = "restart"    # commanded restart: relaunch at once, no budget used
    STOP = "stop"          # commanded stop


class KillPhase(str, Enum):
    TERM = "term"          # SIGTERM sent to the group, waiting out the grace period
    KILL = "kill"          # SIGKILL sent to everything ever seen, waiting for the processes
    RELEASE = "release"    # processes gone, waiting for ports and GPUs to be released


@dataclass
class KillJob:
    cause: Cause
    detail: str
    after: AfterKill
    phase: KillPhase = KillPhase.TERM
    deadline: float = 0.0           # monotonic: end of the current phase
    next_check: float = 0.0         # monotonic: the next look (at most the deadline)
    problems: list[str] = field(default_factory=list)


@dataclass
class Pause:
    """Deep probes paused until `expires` (monotonic: a step of the wall clock neither ends a
    pause early nor keeps it late); `deadline` is the same moment on the wall clock, for
    display and for the state file."""

    deadline: float                 # wall clock
    expires: float                  # monotonic
    # Who paused (`owner` of each pause command, "" untagged), each until when: (deadline,
    # expires). A resume naming an owner lifts that owner's part only, and the pause then lasts
    # as long as the longest part left: an orphan's part (a refit whose holder died) lapses at
    # its own deadline, not at a later refit's. Empty (adopted after a restart): any resume
    # lifts it.
    owners: dict[str, tuple[float, float]] = field(default_factory=dict)

    def add(self, owner: str, deadline: float, expires: float) -> None:
        """`owner` pauses until `expires` (never shortening its own part, or the pause)."""
        if owner not in self.owners or self.owners[owner][1] < expires:
            self.owners[owner] = (deadline, expires)
        if self.expires < expires:
            self.deadline, self.expires = deadline, expires

    def keep_only(self, owners: set[str]) -> bool:
        """Lift every part but those of `owners`; whether any is left (the pause then ends
        with the longest part left)."""
        self.owners = {o: part for o, part in self.owners.items() if o in owners}
        if self.owners:
            self.deadline, self.expires = max(self.owners.values(), key=lambda p: p[1])
        return bool(self.owners)


@dataclass
class Failure:
    cause: Cause
    detail: str
    ts: float

    def to_json(self) -> dict[str, Any]:
        return {"cause": str(self.cause), "detail": self.detail, "ts": self.ts}


@dataclass
class EngineRuntime:
    cfg: EngineConfig
    external: bool = False
    launched: bool = False      # by the `launch` command (its spec kept in launched.json)
    state: EngineState = EngineState.STOPPED
    state_since: float = field(default_factory=time.time)
    incarnation: int = 0
    restarts: int = 0
    relaunch_times: list[float] = field(default_factory=list)     # wall clock
    consecutive_failures: int = 0
    last_failure: Failure | None = None
    # the current incarnation's processes
    marker: str = ""            # in the environment of every process of this incarnation
    cgroup: str = ""            # its cgroup, where the daemon runs with a delegated one
    main: ProcKey | None = None
    popen: subprocess.Popen[bytes] | None = None
    returncode: int | None = None
    procs: dict[ProcKey, bool] = field(default_factory=dict)      # every process seen -> fatal?
    dead: set[ProcKey] = field(default_factory=set)
    launched_at: float = 0.0                                      # monotonic
    healthy_since: float | None = None                            # monotonic
    # (incarnation, tp_size) from the engine's /server_info (engine_info.py); (0, 0): not read
    server_tp_size: tuple[int, int] = (0, 0)
    # deep probes
    probe_id: int = 0
    probe_started: float | None = None                            # monotonic, None: not waiting
    # Probe requests still on the wire, judged or not (a judged-late one may still be running);
    # kept across incarnations: a pause must not be acknowledged while any is out.
    probes_out: set[int] = field(default_factory=set)
    next_probe: float = 0.0
    probe_failures: int = 0
    last_probe: str = ""                                          # what the last probe saw
    progress_tokens: float | None = None      # the token counter when it last moved
    progress_since: float = 0.0               # monotonic: since when it has not moved
    first_failure_at: float | None = None                         # monotonic
    paused: Pause | None = None
    # recovery
    kill: KillJob | None = None
    backoff_until: float | None = None                            # monotonic; None: not waiting
    deferred_waiting: bool = False
    restart_requested: bool = False   # `restart` during a failure's cleanup: relaunch at once

    @property
    def id(self) -> str:
        return self.cfg.id

    @property
    def tp_size(self) -> int | None:
        """Its ranks in a weight-update group: the config's, else what its /server_info said
        for this incarnation (engine_info.py), else None (not read yet)."""
        if self.cfg.tp_size is not None:
            return self.cfg.tp_size
        incarnation, size = self.server_tp_size
        return size if incarnation == self.incarnation else None

    @property
    def origin(self) -> str:
        """Where the engine came from: "config", "launched" (at run time) or "registered"
        (someone else's process)."""
        return "registered" if self.external else "launched" if self.launched else "config"

    @property
    def probing(self) -> bool:
        """Whether deep probes run. A `starting` engine is probed even under a pause (one
        given to the node or the fleet while it booted): its first passing probe is how it
        becomes healthy, and its startup deadline counts from the launch, pause or not;
        from `healthy` on, the pause holds."""
        if not (self.cfg.probe.health_path and self.state.running):
            return False
        return self.paused is None or self.state == EngineState.STARTING

    def alive_procs(self) -> list[ProcKey]:
        return [k for k in self.procs if k not in self.dead]

    def new_incarnation(self, number: int) -> None:
        """Become incarnation `number` (Incarnations.next: never one handed out before) and
        forget the previous processes; a relaunch starts with probes active (a pause belongs
        to the incarnation it was given to)."""
        self.incarnation = number
        self.marker = ""
        self.cgroup = ""
        self.main = None
        self.popen = None
        self.returncode = None
        self.procs = {}
        self.dead = set()
        self.healthy_since = None
        self.probe_started = None
        self.probe_failures = 0
        self.last_probe = ""
        self.progress_tokens = None
        self.first_failure_at = None
        self.paused = None
        self.kill = None
        self.backoff_until = None
        self.deferred_waiting = False
        self.restart_requested = False
