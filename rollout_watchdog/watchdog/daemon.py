"""The node daemon: builds the parts and runs the single-threaded main loop.

The loop waits on pidfds (one per process of every engine tree: exits are seen at once, paused
or not), the probe pool's wake-up pipe, a signal pipe and the sockets of its participants (the
control socket; later the agent), and otherwise on its nearest timer. All I/O that can hang
(HTTP probes) runs on the probe pool; everything else the loop does is bounded and quick
(signals, /proc reads, a bind() per port, NVML queries, a small file write).

The parts: the supervisor (every decision about an engine), the process tracker (pidfds, the
tree scan), adoption, the publisher (events to the log, metrics and file), and participants.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import random
import signal
import uuid
from collections.abc import Callable, Container, Iterator
from pathlib import Path
from typing import Any, Protocol

import zmq

from rollout_watchdog.common.clock import Clock
from rollout_watchdog.common.events import EventLog
from rollout_watchdog.common.limits import raise_nofile_limit
from rollout_watchdog.common.states import Cause, EngineState
from rollout_watchdog.config import NodeConfig
from rollout_watchdog.logs import dropped_log_lines
from rollout_watchdog.watchdog import adoption, launched, timers
from rollout_watchdog.watchdog.cgroup import CgroupError, CgroupManager, probe_delegated_root
from rollout_watchdog.watchdog.containment import reap_children, set_child_subreaper
from rollout_watchdog.watchdog.engine import AfterKill, EngineRuntime
from rollout_watchdog.watchdog.enginelog import LogRotator, engine_log_path
from rollout_watchdog.watchdog.gpu import GpuInspector, make_inspector
from rollout_watchdog.watchdog.metrics import Metrics
from rollout_watchdog.watchdog.previous_run import Anchor, read_previous
from rollout_watchdog.watchdog.probe import ProbeRunner
from rollout_watchdog.watchdog.process import ProcessOps, ProcKey, is_alive, proc_key
from rollout_watchdog.watchdog.publish import Publisher, log_event, metrics_subscriber
from rollout_watchdog.watchdog.sdnotify import SystemdNotifier
from rollout_watchdog.watchdog.statefile import (
    journal_anchor,
    load_state,
    make_reserve,
    save_state,
    set_journal_anchor,
)
from rollout_watchdog.watchdog.status import node_status
from rollout_watchdog.watchdog.supervisor import Supervisor
from rollout_watchdog.watchdog.tracker import ProcessTracker, pidfd_budget

log = logging.getLogger("rollout_watchdog.watchdog")
S = EngineState
# Exit code of a daemon told to go away and leave its engines running (SIGUSR2): the unit's
# RestartForceExitStatus restarts it, and the new daemon adopts them.
DETACH_EXIT_CODE = 75
# The longest the loop sleeps without looking at its timers (a safety net: every timer, the
# sweep and every socket wake it when due).
MAX_SLEEP_S = 1.0


class Participant(Protocol):
    """Something with sockets of its own that the loop serves: the control socket, the agent."""

    def pollables(self) -> list[Any]: ...
    def handle(self, ready: Container[Any]) -> None: ...
    def tick(self, now: float) -> None: ...
    def next_deadline(self) -> float | None: ...
    def after_save(self) -> None: ...
    def close(self) -> None: ...


ParticipantFactory = Callable[["Daemon"], Participant]


class Daemon:
    def __init__(self, config: NodeConfig, *, inspector: GpuInspector | None = None,
                 rng: random.Random | None = None, ops: ProcessOps | None = None,
                 clock: Clock | None = None,
                 participants: list[ParticipantFactory] | None = None) -> None:
        self.config = config
        self.node_id = config.node_id
        self.state_dir = Path(config.state_dir)
        self.state_path = self.state_dir / "state.json"
        self.clock = clock or Clock()
        self.ops = ops or ProcessOps()
        self.metrics = Metrics()
        self.events_path = self.state_dir / "events.jsonl"
        self.events = EventLog(self.events_path)
        self.publisher = Publisher(self.node_id, self.clock.wall)
        self.publisher.subscribe(self.events.append)
        self.publisher.subscribe(log_event)
        self.publisher.subscribe(metrics_subscriber(self.metrics))
        self.notifier = SystemdNotifier()
        # At most one probe per engine, each on a worker of its own: no engine's probe ever
        # waits behind another's.
        self.probes = ProbeRunner()
        self.poller = zmq.Poller()
        engines = {e.id: EngineRuntime(cfg=e) for e in config.engines}
        self.tracker = ProcessTracker(engines, self.poller, self.ops, self._process_gone)
        self.supervisor = Supervisor(
            config, publisher=self.publisher, events=self.events, probes=self.probes,
            tracker=self.tracker, ops=self.ops, clock=self.clock, inspector=inspector,
            rng=rng or random.Random(), boot_id=uuid.uuid4().hex)
        self.supervisor.save_now = self.save_state
        self.engines = engines
        self._participant_factories = participants or []
        self.participants: list[Participant] = []
        self.shutdown_requested: str | None = None     # "stop" or "detach"
        self._shutdown_started = False
        self._next_sweep = self.clock.monotonic() + self.sweep_interval
        self._next_notify = 0.0
        self._last_summary = ""
        self._sig_r, self._sig_w = os.pipe()
        self._lock_fd: int | None = None
        self._lifeline: ProcKey | None = None   # config.lifeline_pid, pinned by its start time
        self.log_rotator = LogRotator(
            [engine_log_path(self.state_dir, e.id) for e in config.engines],
            config.engine_log_max_bytes, config.engine_log_backups)
        self._child_exited = True  # SIGCHLD seen: orphans to reap

    @property
    def sweep_interval(self) -> float:
        """The shortest liveness interval of the node and its engines (launched ones too)."""
        return min([self.config.probe.liveness_interval_s]
                   + [e.cfg.probe.liveness_interval_s for e in self.engines.values()])

    @property
    def boot_id(self) -> str:
        return self.supervisor.boot_id

    def _process_gone(self, engine: EngineRuntime, key: Any) -> None:
        self.supervisor.process_gone(engine, key)

    # ------------------------------------------------------------------ lifecycle

    def run(self) -> int:
        """Run until SIGTERM/SIGINT (stop every engine) or SIGUSR2 (leave them running)."""
        self.setup()
        try:
            # the lifeline gone already: adopt what runs (to stop it), launch nothing
            self.supervisor.stopping = self.shutdown_requested == "stop"
            self.adopt_or_launch()
            self.save_state()
            self.notifier.ready()
            log.info("watching %d engine(s) on node %s", len(self.engines), self.node_id)
            while True:
                if self.shutdown_requested and not self._shutdown_started:
                    self.begin_shutdown()  # a signal may arrive anywhere in a step
                if self.finished():
                    break
                self.step()
        finally:
            self.teardown()
        return DETACH_EXIT_CODE if self.shutdown_requested == "detach" else 0

    def adopt_or_launch(self) -> None:
        """Adopt what the state file records, launch the rest (the `launch`ed engines
        included)."""
        launched.restore(self.supervisor.launched, self.config, self.engines)
        adoption.adopt_or_launch(self.supervisor, load_state(self.state_path))

    def setup(self) -> None:
        try:
            self.state_dir.mkdir(parents=True, exist_ok=True)
            self._lock_state_dir()
        except OSError as exc:   # (a full or read-only disk: named, one line)
            raise RuntimeError(f"cannot use state_dir {self.state_dir}: "
                               f"{exc.strerror or exc}") from exc
        self.supervisor.previous_run = read_previous(   # (before this run adds a line)
            Anchor.from_json(journal_anchor(self.state_path)), self.events_path,
            self.events.capacity)
        anchor = Anchor.of(self.boot_id, 0, self.events_path, 0)   # (this run's, from now)
        if anchor is not None:
            set_journal_anchor(self.state_path, anchor.to_json())
        if self.config.lifeline_pid is not None:
            self._lifeline = proc_key(self.config.lifeline_pid)
            self._check_lifeline()
        self._contain()
        if not make_reserve(self.state_path):
            log.warning("cannot set disk aside for the state file in %s", self.state_dir)
        self.log_rotator.start()
        if self.supervisor.inspector is None:
            self.supervisor.set_inspector(make_inspector(self.config.gpu_check))
        if self.config.metrics_port:
            address = f"{self.config.metrics_host}:{self.config.metrics_port}"
            try:
                self.metrics.start_server(self.config.metrics_port, self.config.metrics_host)
            except OSError as exc:
                raise RuntimeError(f"cannot serve metrics on {address}: {exc.strerror or exc}"
                                   ) from exc
        for factory in self._participant_factories:
            participant = factory(self)
            self.participants.append(participant)
            for pollable in participant.pollables():
                self.poller.register(pollable, zmq.POLLIN)
        self.poller.register(self.probes.wake_r, zmq.POLLIN)
        os.set_blocking(self._sig_r, False)
        os.set_blocking(self._sig_w, False)
        self.poller.register(self._sig_r, zmq.POLLIN)
        signal.set_wakeup_fd(self._sig_w)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR2):
            signal.signal(sig, self._on_signal)
        signal.signal(signal.SIGCHLD, self._on_child)

    def _contain(self) -> None:
        """Nothing of an incarnation may outlive it: descriptors to watch every process, the
        subreaper, and a cgroup per incarnation where one is delegated."""
        old, new = raise_nofile_limit()
        if new != old:
            log.info("open file limit raised from %d to %d", old, new)
        self.tracker.max_pidfds = pidfd_budget()
        if not set_child_subreaper():
            log.warning("cannot become a child subreaper: processes that leave an engine's tree "
                        "are found by their marker alone")
        mode = self.config.containment
        if mode == "subreaper" or (mode == "auto" and not os.environ.get("INVOCATION_ID")):
            return
        root, why = probe_delegated_root()
        try:
            if root is None:
                raise CgroupError(why)
            cgroups = CgroupManager(root, self.supervisor.state_tag)
            cgroups.prepare()
        except CgroupError as exc:
            if mode == "cgroup":
                raise RuntimeError(f"containment = \"cgroup\", but {exc}") from exc
            log.warning("no delegated cgroup v2 (%s): subreaper and marker in force", exc)
            return
        self.supervisor.cgroups = cgroups
        log.info("one cgroup per engine incarnation under %s", root)

    def _lock_state_dir(self) -> None:
        """One daemon per state dir: two would adopt, and then kill, each other's engines."""
        path = self.state_dir / "daemon.lock"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
            os.close(fd)
            raise RuntimeError(f"state_dir {self.state_dir} is in use by another daemon "
                               f"(pid {holder or '?'})") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock_fd = fd

    def _on_child(self, signum: int, frame: object) -> None:
        self._child_exited = True

    def _on_signal(self, signum: int, frame: object) -> None:
        if self.shutdown_requested:
            return
        self.shutdown_requested = "detach" if signum == signal.SIGUSR2 else "stop"

    def finished(self) -> bool:
        if not self._shutdown_started:
            return False
        if self.shutdown_requested == "detach":
            return True
        return all(e.kill is None for e in self.engines.values())

    def begin_shutdown(self) -> None:
        self._shutdown_started = True
        sup = self.supervisor
        sup.stopping = True
        self.notifier.stopping()
        sup.emit(None, "daemon_stopping", detail=f"{self.shutdown_requested} requested")
        if self.shutdown_requested != "stop":
            return
        for engine in self.engines.values():
            if engine.external:
                continue
            engine.backoff_until = None
            if engine.kill is not None:
                engine.kill.after = AfterKill.STOP
            elif engine.state.running:
                sup.start_kill(engine, Cause.COMMANDED, "daemon stopping", AfterKill.STOP)
            elif engine.state == S.BACKOFF:
                sup.transition(engine, S.STOPPED, Cause.COMMANDED, "daemon stopping")

    def teardown(self) -> None:
        # A stop that finished leaves nothing to adopt: the next start launches every engine.
        # One cut short (an error in the loop) leaves its kills in progress to the next daemon.
        self.save_state(clean=self.shutdown_requested == "stop" and self.finished())
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        set_child_subreaper(False)  # a daemon embedded in a process gives the duty back
        self.tracker.close()
        for participant in self.participants:
            participant.close()
        self.participants.clear()
        self.probes.close()
        self.log_rotator.stop()
        self.metrics.stop_server()
        log.info("daemon exits (%s)", self.shutdown_requested or "done")

    # ------------------------------------------------------------------ the loop

    def step(self) -> None:
        """One loop iteration: wait for the next event or timer, then handle what is due."""
        sup = self.supervisor
        now = self.clock.monotonic()
        timeout = max(0.0, min(self.next_deadline(now) - now, MAX_SLEEP_S))
        ready = dict(self.poller.poll(int(timeout * 1000)))
        started = self.clock.monotonic()
        self.tracker.new_turn()
        if self._sig_r in ready:
            with contextlib.suppress(BlockingIOError):
                os.read(self._sig_r, 512)
        if self.shutdown_requested and not self._shutdown_started:
            self.begin_shutdown()
            if self.shutdown_requested == "detach":
                return   # nothing more: a launch now would be a STOPPED the next daemon keeps
        with self._survive("exits"):
            self.tracker.handle(ready)
            self._reap()
        if self.probes.wake_r in ready:
            for result in self.probes.drain():
                self.metrics.probe(result.engine, result.finished - result.started, result.ok)
                with self._survive(f"probe result of {result.engine}"):
                    sup.on_probe_result(result)
        for participant in self.participants:
            with self._survive(f"{type(participant).__name__}"):
                participant.handle(ready)
        now = self.clock.monotonic()
        self.probes.expire(now)  # a probe past its deadline ends now, its socket closed
        with self._survive("the process table"):
            self.tracker.poll_unwatched(now)
            if now >= self._next_sweep:
                self._next_sweep = now + self.sweep_interval
                self._sweep()
        for engine in list(self.engines.values()):
            with self._survive(f"engine {engine.id}"):
                sup.tick(engine, now)
        for participant in self.participants:
            with self._survive(f"{type(participant).__name__}"):
                participant.tick(now)
        if sup.dirty:
            self.save_state()
        for participant in self.participants:
            with self._survive(f"{type(participant).__name__}"):
                participant.after_save()  # an acknowledged command survives a crash
        self._notify_systemd(now)
        self.metrics.loop_iteration(self.clock.monotonic() - started)

    @contextlib.contextmanager
    def _survive(self, what: str) -> Iterator[None]:
        """An error in one part of a turn (no file descriptor left, say, or a bug) is logged
        and that part is tried again next turn: it never ends the daemon, which would leave
        every engine unsupervised."""
        try:
            yield
        except OSError as exc:
            log.error("%s: %s; trying again next turn", what, exc)
        except Exception:  # a bug in one engine's handling must not end the others' watch
            log.exception("%s: unexpected error; trying again next turn", what)

    def _sweep(self) -> None:
        """One scan of the process table serves every engine: trees refreshed, escaped
        processes taken back or killed, leftover cgroups cleaned."""
        sup = self.supervisor
        self._check_lifeline()
        table = self.ops.process_table()
        if self.tracker.sweep([e for e in self.engines.values() if e.state.running], table):
            sup.dirty = True
        if sup.escapees.take_in(table):
            sup.dirty = True
        sup.escapees.clean_cgroups(sup.cgroups)
        self.log_rotator.paths = [engine_log_path(self.state_dir, e) for e in self.engines]
        self.log_rotator.check()
        self.metrics.set_log_lines_dropped(dropped_log_lines())
        self.metrics.set_event_log_write_errors(self.events.write_errors)

    def _check_lifeline(self) -> None:
        """`lifeline_pid` gone (a zombie counts as gone, as a reused pid does): stop every
        engine and exit, as on SIGTERM. Under Ray it is the raylet: nothing outlives its node."""
        if self.config.lifeline_pid is None or self.shutdown_requested:
            return
        if self._lifeline is None or not is_alive(self._lifeline):
            log.warning("lifeline process %d is gone: stopping every engine",
                        self.config.lifeline_pid)
            self.shutdown_requested = "stop"

    def _reap(self) -> None:
        """Reap the orphans that re-parented to the daemon (its subreaper duty), but not the
        engines' own main processes: their exit status is read, then reaped, by Popen. Only
        after a SIGCHLD: nothing else leaves a child to reap."""
        if not self._child_exited:
            return
        self._child_exited = False
        keep = {e.popen.pid for e in self.engines.values()
                if e.popen is not None and e.popen.returncode is None}
        reap_children(keep)

    def next_deadline(self, now: float) -> float:
        """The earliest moment the loop has something to do without an event."""
        deadlines = [now + MAX_SLEEP_S]
        deadlines.append(self._next_sweep)
        deadlines += [d for e in self.engines.values()
                      if (d := timers.next_deadline(e)) is not None]
        deadlines += [d for p in self.participants if (d := p.next_deadline()) is not None]
        for part in (self.tracker, self.probes):
            if (deadline := part.next_deadline()) is not None:
                deadlines.append(deadline)
        return min(deadlines)

    # ------------------------------------------------------------------ reporting

    def status(self) -> dict[str, Any]:
        return node_status(self.supervisor)

    def _notify_systemd(self, now: float) -> None:
        """WATCHDOG=1 only from here, so systemd restarts a daemon whose loop is stuck."""
        if now < self._next_notify:
            return
        self._next_notify = now + (self.notifier.watchdog_interval_s() or 5.0) / 2
        self.notifier.watchdog()
        counts: dict[str, int] = {}
        for e in self.engines.values():
            counts[str(e.state)] = counts.get(str(e.state), 0) + 1
        summary = ", ".join(f"{n} {s}" for s, n in sorted(counts.items())) or "no engines"
        if summary != self._last_summary and \
                self.notifier.status(f"{len(self.engines)} engine(s): {summary}"):
            self._last_summary = summary  # a dropped datagram is sent again next time

    def save_state(self, *, clean: bool = False) -> None:
        records = {} if clean else {e.id: adoption.record_of(e, self.clock)
                                    for e in self.engines.values()}
        anchor = Anchor.of(self.boot_id, self.events.last_seq, self.events_path,
                           self.events.write_errors)
        if save_state(self.state_path, self.node_id, records,
                      self.supervisor.incarnations.to_json(),
                      None if anchor is None else anchor.to_json()):
            self.supervisor.dirty = False

    def bad_message(self, why: str) -> None:
        self.metrics.bad_control_message()
        log.warning("bad control message: %s", why)
