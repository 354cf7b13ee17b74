"""The node daemon: one single-threaded main loop that supervises every engine of the node.

The loop waits on pidfds (one per process of every engine tree: exits are seen at once, paused or
not), the control socket, and the probe pool's wake-up pipe, and otherwise on its nearest timer.
All I/O that can hang (HTTP probes) runs on the probe pool; everything else the loop does is
bounded and quick (signals, /proc reads, a bind() per port, NVML queries, a small file write).
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import logging
import os
import random
import signal
import time
import uuid
from pathlib import Path
from typing import Any

import zmq

from rollout_watchdog.config import EngineConfig, NodeConfig, url_port
from rollout_watchdog.watchdog import kill, policy
from rollout_watchdog.watchdog.commands import dispatch
from rollout_watchdog.watchdog.control import CommandError, ControlServer, Deferred
from rollout_watchdog.watchdog.engine import AfterKill, EngineRuntime, Failure, KillJob, Pause
from rollout_watchdog.watchdog.events import Event, EventLog
from rollout_watchdog.watchdog.gpu import GpuInspector, make_inspector
from rollout_watchdog.watchdog.metrics import Metrics
from rollout_watchdog.watchdog.probe import MAX_CONNECT_S, ProbeResult, ProbeRunner
from rollout_watchdog.watchdog.process import (
    ProcKey,
    ProcStat,
    descendants,
    describe_exit,
    is_alive,
    launch,
    live_process_groups,
    open_pidfd,
    peek_exit,
    proc_key,
    process_table,
    read_stat,
)
from rollout_watchdog.watchdog.sdnotify import SystemdNotifier
from rollout_watchdog.watchdog.statefile import EngineRecord, load_state, save_state
from rollout_watchdog.watchdog.states import Cause, EngineState, check_transition

log = logging.getLogger("rollout_watchdog.watchdog")
S = EngineState
# A probe thread stuck past its own HTTP timeout is judged failed after this much slack.
PROBE_SLACK_S = 1.0
# Exit code of a daemon told to go away and leave its engines running (SIGUSR2): the unit's
# RestartForceExitStatus restarts it, and the new daemon adopts them.
DETACH_EXIT_CODE = 75
# The daemon's own systemd handshake; an engine that inherited it could pose as the daemon.
SYSTEMD_ONLY_ENV = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")


class Daemon:
    def __init__(self, config: NodeConfig, *, inspector: GpuInspector | None = None,
                 rng: random.Random | None = None) -> None:
        self.config = config
        self.node_id = config.node_id
        self.state_dir = Path(config.state_dir)
        self.state_path = self.state_dir / "state.json"
        self.boot_id = uuid.uuid4().hex
        self.engines: dict[str, EngineRuntime] = {
            e.id: EngineRuntime(cfg=e) for e in config.engines}
        self.events = EventLog(self.state_dir / "events.jsonl")
        self.metrics = Metrics()
        self.notifier = SystemdNotifier()
        self.inspector = inspector
        self.rng = rng or random.Random()
        # Threads start on demand; the bound only has to cover two probes out per engine
        # (one judged late, one current), registered engines included.
        self.probes = ProbeRunner(max_workers=256)
        self.ctx = zmq.Context.instance()
        self.control: ControlServer | None = None
        self.poller = zmq.Poller()
        self.pidfds: dict[int, tuple[str, ProcKey]] = {}
        self.shutdown_requested: str | None = None     # "stop" or "detach"
        self._shutdown_started = False
        self.sweep_interval = min([config.probe.liveness_interval_s]
                                  + [e.probe.liveness_interval_s for e in config.engines])
        self._next_sweep = 0.0
        self._probe_ids = itertools.count(1)
        self._live_groups: set[int] | None = None
        self._dirty = True
        self._next_notify = 0.0
        self._last_summary = ""
        self._sig_r, self._sig_w = os.pipe()
        self.killing = kill.KillContext(self.metrics, inspector, self._groups_now,
                                        lambda engine: self._refresh_trees([engine]))

    # ------------------------------------------------------------------ lifecycle

    def run(self) -> int:
        """Run until SIGTERM/SIGINT (stop every engine) or SIGUSR2 (leave them running)."""
        self._setup()
        try:
            self._adopt_or_launch()
            self._save_state()
            self.notifier.ready()
            log.info("watching %d engine(s) on node %s", len(self.engines), self.node_id)
            while True:
                if self.shutdown_requested and not self._shutdown_started:
                    self._begin_shutdown()  # a signal may arrive anywhere in a step
                if self._finished():
                    break
                self.step()
        finally:
            self._teardown()
        return DETACH_EXIT_CODE if self.shutdown_requested == "detach" else 0

    def _setup(self) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self._lock_state_dir()
        if self.inspector is None:
            self.inspector = make_inspector(self.config.gpu_check)
            self.killing.inspector = self.inspector
        if self.config.metrics_port:
            address = f"{self.config.metrics_host}:{self.config.metrics_port}"
            try:
                self.metrics.start_server(self.config.metrics_port, self.config.metrics_host)
            except OSError as exc:
                raise RuntimeError(f"cannot serve metrics on {address}: {exc.strerror or exc}"
                                   ) from None
        self.control = ControlServer(self.ctx, self.config.control, self._dispatch,
                                     self._bad_message)
        self.poller.register(self.control.socket, zmq.POLLIN)
        self.poller.register(self.probes.wake_r, zmq.POLLIN)
        os.set_blocking(self._sig_r, False)
        os.set_blocking(self._sig_w, False)
        self.poller.register(self._sig_r, zmq.POLLIN)
        signal.set_wakeup_fd(self._sig_w)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR2):
            signal.signal(sig, self._on_signal)

    def _lock_state_dir(self) -> None:
        """One daemon per state dir: two would adopt, and then kill, each other's engines."""
        path = self.state_dir / "daemon.lock"
        self._lock_fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self._lock_fd, 32, 0).decode(errors="replace").strip()
            os.close(self._lock_fd)
            raise RuntimeError(f"state_dir {self.state_dir} is in use by another daemon "
                               f"(pid {holder or '?'})") from None
        os.ftruncate(self._lock_fd, 0)
        os.pwrite(self._lock_fd, f"{os.getpid()}\n".encode(), 0)

    def _on_signal(self, signum: int, frame: object) -> None:
        if self.shutdown_requested:
            return
        self.shutdown_requested = "detach" if signum == signal.SIGUSR2 else "stop"

    def _finished(self) -> bool:
        if not self._shutdown_started:
            return False
        if self.shutdown_requested == "detach":
            return True
        return all(e.kill is None for e in self.engines.values())

    def _begin_shutdown(self) -> None:
        self._shutdown_started = True
        self.notifier.stopping()
        self._emit(None, "daemon_stopping", detail=f"{self.shutdown_requested} requested")
        if self.shutdown_requested != "stop":
            return
        for engine in self.engines.values():
            if engine.external:
                continue
            engine.backoff_until = None
            if engine.kill is not None:
                engine.kill.after = AfterKill.STOP
            elif engine.state.running:
                self._start_kill(engine, Cause.COMMANDED, "daemon stopping", AfterKill.STOP)
            elif engine.state == S.BACKOFF:
                self._transition(engine, S.STOPPED, Cause.COMMANDED, "daemon stopping")

    def _teardown(self) -> None:
        # A clean stop leaves nothing to adopt: the next start launches every engine.
        self._save_state(clean=self.shutdown_requested == "stop")
        signal.set_wakeup_fd(-1)
        for fd in list(self.pidfds):
            os.close(fd)
        self.pidfds.clear()
        if self.control is not None:
            self.control.close()
        self.probes.close()
        log.info("daemon exits (%s)", self.shutdown_requested or "done")

    # ------------------------------------------------------------------ the loop

    def step(self) -> None:
        """One loop iteration: wait for the next event or timer, then handle what is due."""
        now = time.monotonic()
        timeout = max(0.0, min(self._next_deadline(now) - now, 0.5))
        ready = dict(self.poller.poll(timeout * 1000))
        started = time.monotonic()
        self._live_groups = None
        if self._sig_r in ready:
            with contextlib.suppress(BlockingIOError):
                os.read(self._sig_r, 512)
        if self.shutdown_requested and not self._shutdown_started:
            self._begin_shutdown()
        for fd, (engine_id, key) in list(self.pidfds.items()):
            if fd in ready:
                self._on_exit(engine_id, key, fd)
        if self.probes.wake_r in ready:
            for result in self.probes.drain():
                self._on_probe_result(result)
        if self.control is not None and self.control.socket in ready:
            self.control.serve()
        now = time.monotonic()
        if now >= self._next_sweep:
            self._next_sweep = now + self.sweep_interval
            self._sweep([e for e in self.engines.values() if e.state.running], now)
        for engine in list(self.engines.values()):
            self._tick(engine, now)
        if self.control is not None:
            self.control.answer_parked(now)
        if self._dirty:
            self._save_state()
        if self.control is not None:
            self.control.flush()  # after the save: an acknowledged command survives a crash
        self._notify_systemd(now)
        self.metrics.loop_iteration(time.monotonic() - started)

    def _groups_now(self) -> set[int]:
        """Live process groups, scanned at most once per loop turn."""
        if self._live_groups is None:
            self._live_groups = live_process_groups()
        return self._live_groups

    def _next_deadline(self, now: float) -> float:
        deadlines = [now + 0.5]
        for e in self.engines.values():
            if e.state.running:
                deadlines.append(self._next_sweep)
                if e.probing and e.probe_started is None:
                    deadlines.append(e.next_probe)
                if e.probe_started is not None:
                    deadlines.append(e.probe_started + e.cfg.probe.health_timeout_s
                                     + PROBE_SLACK_S)
                if e.state == S.STARTING:
                    deadlines.append(e.launched_at + e.cfg.probe.startup_timeout_s)
            if e.kill is not None:
                deadlines.append(e.kill.next_check if e.kill.phase == kill.KillPhase.RELEASE
                                 else e.kill.deadline)
            if e.backoff_until is not None and e.state == S.BACKOFF:
                deadlines.append(e.backoff_until)
        if self.control is not None and (parked := self.control.next_deadline()) is not None:
            deadlines.append(parked)
        return min(deadlines)

    def _tick(self, engine: EngineRuntime, now: float) -> None:
        """Timers of one engine: kill phases, backoff, pause expiry, probes, deadlines."""
        if engine.kill is not None:
            self._advance_kill(engine, now)
            return
        if engine.paused is not None and time.time() >= engine.paused.deadline:
            engine.paused = None
            self._emit(engine, "pause_expired", detail="deep probes resumed")
            self.metrics.set_paused(engine.id, False)
            self._dirty = True
        if engine.state == S.BACKOFF and engine.backoff_until is not None \
                and now >= engine.backoff_until:
            self._launch(engine, Cause.BACKOFF_ELAPSED)
            return
        if not engine.state.running:
            return
        if engine.state == S.STARTING and not engine.cfg.probe.health_path:
            # Deep probes off (a multi-node follower answers a dummy /health): liveness only.
            self._become_healthy(engine, "deep probes off: watched by liveness alone")
        startup_deadline = engine.launched_at + engine.cfg.probe.startup_timeout_s
        if engine.state == S.STARTING and now >= startup_deadline:
            last = f"; last probe: {engine.last_probe}" if engine.last_probe else ""
            self._fail(engine, Cause.STARTUP_TIMEOUT,
                       f"not healthy {engine.cfg.probe.startup_timeout_s:g} s after launch{last}",
                       startup_deadline)
            return
        if engine.probe_started is not None:
            if now >= engine.probe_started + engine.cfg.probe.health_timeout_s + PROBE_SLACK_S:
                # The probe thread is stuck past its own timeout: judge it failed now. Its late
                # result is ignored (the probe id moved on).
                self._judge_probe(engine, ProbeResult(
                    engine.id, engine.probe_id, False,
                    f"no answer within {engine.cfg.probe.health_timeout_s:g} s",
                    engine.probe_started, now))
        elif engine.probing and now >= engine.next_probe:
            self._start_probe(engine, now)
        if (engine.state == S.HEALTHY and engine.consecutive_failures
                and engine.healthy_since is not None
                and now - engine.healthy_since >= engine.cfg.restart.stable_s):
            engine.consecutive_failures = 0
            self._dirty = True

    # ------------------------------------------------------------------ launching and adoption

    def _adopt_or_launch(self) -> None:
        saved = load_state(self.state_path)
        records = saved.engines if saved else {}
        if saved and not saved.same_boot:
            log.warning("the state file is from before a reboot: no recorded process is alive")
        for engine in self.engines.values():
            record = self._parse_record(engine.id, records.get(engine.id))
            if record is None:
                self._launch(engine, Cause.LAUNCHED)
            else:
                self._adopt(engine, record, same_boot=saved is not None and saved.same_boot)
        for engine_id, raw in records.items():
            if engine_id in self.engines or not (saved and saved.same_boot):
                continue
            record = self._parse_record(engine_id, raw)
            if record is not None and (record.state.running or record.state == S.STOPPING):
                self._adopt_unconfigured(engine_id, record)

    def _parse_record(self, engine_id: str, raw: Any) -> EngineRecord | None:
        if raw is None:
            return None
        try:
            return EngineRecord.from_json(raw)
        except ValueError as exc:
            log.error("the saved state of engine %s is unusable (%s): starting it fresh",
                      engine_id, exc)
            return None

    def _adopt(self, engine: EngineRuntime, record: EngineRecord, *, same_boot: bool) -> None:
        """Take over an engine recorded by a previous daemon: the same processes if they still
        run (the same processes: pid plus create time), else its death is an exit seen now."""
        engine.incarnation = record.incarnation
        engine.restarts = record.restarts
        engine.relaunch_times = record.relaunch_times
        engine.consecutive_failures = record.consecutive_failures
        engine.last_failure = record.last_failure
        engine.state = record.state
        engine.state_since = record.state_since or time.time()
        if record.state in (S.FAILED, S.STOPPED, S.BACKOFF):
            engine.deferred_waiting = record.deferred_waiting
            if record.state == S.BACKOFF and not record.deferred_waiting:
                engine.backoff_until = time.monotonic()
            self._emit(engine, "adopted", detail=f"kept {record.state} from the previous daemon")
            self._report_state(engine)
            return
        now = time.monotonic()
        if same_boot:
            engine.main = record.main
            engine.procs = dict(record.procs)
        engine.launched_at = now - max(0.0, time.time() - record.launched_at)
        engine.next_probe = now
        if record.state in (S.HEALTHY, S.SUSPECT):
            engine.healthy_since = now
        if record.paused is not None and record.paused.deadline > time.time():
            engine.paused = record.paused
        alive = engine.main is not None and is_alive(engine.main)
        self._emit(engine, "adopted", detail=(
            f"pid {engine.main.pid} still running, kept in {record.state}"
            if alive and engine.main else "its main process is gone"))
        self._report_state(engine)
        if record.state == S.STOPPING:  # resume the kill the previous daemon had begun
            self._watch_all(engine)
            self._start_kill(engine, record.kill_cause or Cause.COMMANDED,
                             "kill resumed after a daemon restart",
                             record.kill_after or AfterKill.RECOVER)
            return
        # A process that died while the daemon was down is an exit seen now.
        self._watch_all(engine)
        if engine.main is None and engine.state.running:
            self._fail(engine, Cause.EXITED, "its processes did not survive a reboot"
                       if not same_boot else "no main process recorded", now)

    def _watch_all(self, engine: EngineRuntime) -> None:
        incarnation = engine.incarnation
        for key in list(engine.procs):
            if engine.incarnation != incarnation:
                return  # a failure seen meanwhile already led to a relaunch
            self._watch(engine, key)

    def _adopt_unconfigured(self, engine_id: str, record: EngineRecord) -> None:
        """An engine the state file knows but the config does not: an external one is watched
        again; one removed from the config is stopped, not left running unwatched."""
        engine = EngineRuntime(cfg=self._unconfigured_engine(engine_id, record.url),
                               external=record.external)
        self.engines[engine_id] = engine
        if record.external:  # watched exactly as before: state, pause, kill in progress
            self._adopt(engine, record, same_boot=True)
            return
        engine.state, engine.incarnation = S.STOPPING, record.incarnation
        engine.main, engine.procs = record.main, dict(record.procs)
        self._emit(engine, "removed_from_config", detail="stopping it")
        self._watch_all(engine)
        self._start_kill(engine, Cause.COMMANDED, "removed from the config", AfterKill.STOP)

    def _unconfigured_engine(self, engine_id: str, url: str) -> EngineConfig:
        """The spec of an engine the config does not list (external, or removed): the node's
        probe and restart settings, and no command: the daemon never launches it."""
        return EngineConfig(id=engine_id, url=url.rstrip("/"), command=(),
                            probe=self.config.probe, restart=self.config.restart)

    def _launch(self, engine: EngineRuntime, cause: Cause) -> None:
        """Start a new incarnation with the same argv, env, ports and GPUs."""
        old = engine.state
        engine.backoff_until = None
        if self.shutdown_requested == "stop":
            if old != S.STOPPED:
                self._transition(engine, S.STOPPED, Cause.COMMANDED, "daemon stopping")
            return
        engine.new_incarnation()
        env = {k: v for k, v in os.environ.items() if k not in SYSTEMD_ONLY_ENV}
        if engine.cfg.gpus and "CUDA_VISIBLE_DEVICES" not in engine.cfg.env:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in engine.cfg.gpus)
        env.update(engine.cfg.env)
        log_path = self.state_dir / "logs" / f"{engine.id}.log"
        try:
            popen = launch(engine.cfg.command, env, log_path, engine.cfg.cwd)
        except OSError as exc:
            engine.last_failure = Failure(Cause.LAUNCH_FAILED, str(exc), time.time())
            self._emit(engine, "launch_failed", cause=Cause.LAUNCH_FAILED, detail=str(exc))
            if old != S.FAILED:
                self._transition(engine, S.FAILED, Cause.LAUNCH_FAILED, str(exc))
            return
        now = time.monotonic()
        engine.popen = popen
        engine.main = proc_key(popen.pid) or ProcKey(popen.pid, 0.0)
        engine.procs = {engine.main: True}
        engine.launched_at = now
        self._transition(engine, S.STARTING, cause, f"pid {popen.pid}")
        engine.next_probe = now + _probe_interval(engine)
        self._report_state(engine)
        self._save_state()  # a daemon crash from here on must find this process to adopt
        self._watch(engine, engine.main)

    def _watch(self, engine: EngineRuntime, key: ProcKey) -> None:
        """Watch a process of the engine; one already gone counts as an exit seen now."""
        fd = open_pidfd(key)
        if fd is None:
            self._process_gone(engine, key)
            return
        self.pidfds[fd] = (engine.id, key)
        self.poller.register(fd, zmq.POLLIN)

    def _unwatch(self, fd: int) -> None:
        self.pidfds.pop(fd, None)
        self.poller.unregister(fd)
        os.close(fd)

    # ------------------------------------------------------------------ liveness

    def _on_exit(self, engine_id: str, key: ProcKey, fd: int) -> None:
        self._unwatch(fd)
        engine = self.engines.get(engine_id)
        if engine is not None:
            self._process_gone(engine, key)

    def _process_gone(self, engine: EngineRuntime, key: ProcKey) -> None:
        """An exit is fatal for the main process and for the processes the engine had when it
        became healthy; later arrivals (compile workers) may come and go."""
        if key not in engine.procs:
            return  # a process of an earlier incarnation
        engine.dead.add(key)
        if key == engine.main and engine.popen is not None:
            engine.returncode = peek_exit(key.pid)  # not reaped yet: see _take_in_group
            if not engine.state.running:  # already being killed: reach its children too
                self._take_in_group(engine)
        if not engine.state.running:
            return
        if key == engine.main:
            self._fail(engine, Cause.EXITED,
                       f"main process {key.pid} exited ({describe_exit(engine.returncode)})",
                       time.monotonic())
        elif engine.procs[key]:
            self._fail(engine, Cause.EXITED, f"process {key.pid} of the engine tree exited",
                       time.monotonic())

    def _sweep(self, engines: list[EngineRuntime], now: float) -> None:
        """Refresh the trees of the running engines from one scan of the process table: new
        processes are watched (so a kill reaches them); a main process found gone without its
        exit event (not expected) still counts."""
        if not engines:
            return
        table = process_table()
        alive = []
        for engine in engines:
            if engine.main is None:
                continue
            stat = table.get(engine.main.pid)
            if stat is not None and stat.alive and stat.key == engine.main:
                alive.append(engine)
            elif engine.main not in engine.dead:
                self._process_gone(engine, engine.main)
        self._refresh_trees(alive, table)

    def _refresh_trees(self, engines: list[EngineRuntime],
                       table: dict[int, ProcStat] | None = None) -> None:
        roots = [e for e in engines if e.main is not None]
        if not roots:
            return
        trees = descendants([e.main.pid for e in roots if e.main is not None], table)
        for engine in roots:
            assert engine.main is not None
            for key in trees.get(engine.main.pid, []):
                if key not in engine.procs:
                    engine.procs[key] = False
                    self._watch(engine, key)
                    self._dirty = True

    # ------------------------------------------------------------------ deep probes

    def _start_probe(self, engine: EngineRuntime, now: float) -> None:
        engine.probe_id = next(self._probe_ids)  # unique across re-registrations
        engine.probe_started = now
        engine.probes_out.add(engine.probe_id)
        progress = engine.cfg.probe.progress_path
        self.probes.submit(engine.id, engine.probe_id,
                           engine.cfg.url + engine.cfg.probe.health_path,
                           engine.cfg.probe.health_timeout_s,
                           engine.cfg.url + progress if progress else None)

    def _on_probe_result(self, result: ProbeResult) -> None:
        engine = self.engines.get(result.engine)
        if engine is None:
            return
        engine.probes_out.discard(result.probe_id)
        self.metrics.probe(engine.id, result.finished - result.started, result.ok)
        self._judge_probe(engine, result)

    def _judge_probe(self, engine: EngineRuntime, result: ProbeResult) -> None:
        if result.probe_id != engine.probe_id or engine.probe_started is None:
            return  # a late answer to a probe already judged, or of an older incarnation
        engine.probe_started = None
        engine.next_probe = time.monotonic() + _probe_interval(engine)
        if not engine.state.running:
            return
        engine.last_probe = result.detail
        if engine.state == S.STARTING:
            if result.ok:
                self._become_healthy(engine, f"first passing probe ({result.detail})")
            return  # failures while starting are expected; the startup deadline rules
        if result.progress is not None and self._stalled(engine, result):
            return
        verdict = policy.judge_probe(result.ok, engine.probe_failures,
                                     engine.cfg.probe.failure_threshold)
        engine.probe_failures = verdict.failures
        if result.ok:
            engine.first_failure_at = None
            if engine.state == S.SUSPECT:
                self._transition(engine, S.HEALTHY, Cause.PROBE_PASSED, result.detail)
            return
        if engine.first_failure_at is None:
            engine.first_failure_at = result.started
        detail = (f"probe {verdict.failures}/{engine.cfg.probe.failure_threshold} failed: "
                  f"{result.detail}")
        if verdict.declare_failed:
            self._fail(engine, Cause.PROBE_FAILED, detail, engine.first_failure_at)
        elif engine.state == S.HEALTHY:
            self._transition(engine, S.SUSPECT, Cause.PROBE_FAILED, detail)

    def _stalled(self, engine: EngineRuntime, result: ProbeResult) -> bool:
        """The progress probe: a token counter that does not move while requests run means a
        stuck engine, even one whose health probe still passes."""
        assert result.progress is not None
        tokens, running = result.progress.tokens, result.progress.running
        if engine.progress_tokens is None or tokens != engine.progress_tokens or running == 0:
            engine.progress_tokens, engine.progress_since = tokens, result.finished
            return False
        stuck_s = result.finished - engine.progress_since
        if stuck_s < engine.cfg.probe.progress_timeout_s:
            return False
        self._fail(engine, Cause.STALLED, f"token counter stuck at {tokens:g} for "
                   f"{stuck_s:.0f} s with {running:g} request(s) running", engine.progress_since)
        return True

    def _become_healthy(self, engine: EngineRuntime, detail: str) -> None:
        """The processes in the tree now are the engine (schedulers, detokenizer): from here on
        the exit of any of them is fatal. Later arrivals are only tracked."""
        self._refresh_trees([engine])
        for key in engine.alive_procs():
            engine.procs[key] = True
        engine.healthy_since = time.monotonic()
        self._transition(engine, S.HEALTHY, Cause.PROBE_PASSED, detail)

    # ------------------------------------------------------------------ failure and recovery

    def _fail(self, engine: EngineRuntime, cause: Cause, detail: str, evidence_at: float) -> None:
        """Declare the current incarnation failed and start cleaning it up."""
        engine.last_failure = Failure(cause, detail, time.time())
        self.metrics.detection(engine.id, str(cause), max(0.0, time.monotonic() - evidence_at))
        self._start_kill(engine, cause, detail, AfterKill.RECOVER)

    def _start_kill(self, engine: EngineRuntime, cause: Cause, detail: str,
                    after: AfterKill) -> None:
        if engine.state.running:
            self._transition(engine, S.STOPPING, cause, detail)
        if engine.popen is not None and engine.main in engine.dead:
            self._take_in_group(engine)
        now = time.monotonic()
        engine.probe_started = None  # a probe still out is of no interest any more
        engine.backoff_until = None
        if engine.main is not None and is_alive(engine.main):
            self._refresh_trees([engine])
        job = KillJob(cause, detail, after, deadline=now + engine.cfg.restart.grace_s)
        self._dirty = True
        self._kill_outcome(engine, kill.begin(engine, job, self.killing, now))

    def _take_in_group(self, engine: EngineRuntime) -> None:
        """Our main process exited: children it forked since the last sweep are still in its
        group. Take them in before reaping it (an unreaped child pins its pid, and so its group
        id, against reuse), so that the kill reaches them."""
        assert engine.main is not None and engine.popen is not None
        for stat in process_table().values():
            if stat.pgrp == engine.main.pid and stat.alive and stat.key not in engine.procs:
                engine.procs[stat.key] = False
                self._watch(engine, stat.key)
        engine.returncode = engine.popen.poll()

    def _advance_kill(self, engine: EngineRuntime, now: float) -> None:
        assert engine.kill is not None
        waiting_for = engine.kill.problems
        outcome = kill.advance(engine, self.killing, now)
        if outcome == kill.Outcome.PENDING and engine.kill.problems != waiting_for:
            self._emit(engine, "release_pending", detail="waiting for "
                       + "; ".join(engine.kill.problems))
        self._kill_outcome(engine, outcome)

    def _kill_outcome(self, engine: EngineRuntime, outcome: kill.Outcome) -> None:
        job = engine.kill
        if outcome == kill.Outcome.PENDING or job is None:
            return
        engine.kill = None
        self._dirty = True
        if outcome != kill.Outcome.DONE:
            detail = "; ".join(job.problems)
            engine.last_failure = Failure(outcome.cause, detail, time.time())
            self._transition(engine, S.FAILED, outcome.cause, detail)
        elif job.after == AfterKill.STOP:
            self._transition(engine, S.STOPPED, job.cause,
                             f"{job.detail}; {describe_exit(engine.returncode)}")
            if not engine.cfg.command and not engine.external:  # removed from the config
                self._forget(engine, "removed", "stopped, and no longer in the config")
                return
        elif job.after == AfterKill.RESTART:
            self._launch(engine, Cause.COMMANDED)
        elif engine.external:
            self._transition(engine, S.STOPPED, job.cause,
                             "external engine cleaned up: its restart is left to its owner")
            self._emit(engine, "owner_restart_needed", cause=job.cause, detail=job.detail)
        else:
            self._recover(engine, job.cause)
        self._report_state(engine)

    def _recover(self, engine: EngineRuntime, cause: Cause) -> None:
        """After a failure: relaunch after the backoff, wait (deferred), or give up (budget)."""
        restart = engine.cfg.restart
        if self._budget_exhausted(engine, cause):
            return
        engine.consecutive_failures += 1
        if engine.restart_requested:
            self._count_relaunch(engine, cause, time.time())
            self._launch(engine, Cause.COMMANDED)
            return
        if engine.cfg.restart_policy == "deferred":
            engine.deferred_waiting = True
            self._transition(engine, S.BACKOFF, cause,
                             "deferred: cleaned up, relaunched on `restart` or at the next refit")
            return
        delay = policy.backoff_delay(engine.consecutive_failures, restart, self.rng)
        engine.backoff_until = time.monotonic() + delay
        self._transition(engine, S.BACKOFF, cause, f"relaunch in {delay:.2f} s")
        self._count_relaunch(engine, cause, time.time() + delay)
        if delay == 0:
            self._launch(engine, Cause.BACKOFF_ELAPSED)

    def _budget_exhausted(self, engine: EngineRuntime, cause: Cause) -> bool:
        restart = engine.cfg.restart
        if not policy.budget_exhausted(engine.relaunch_times, time.time(), restart):
            return False
        engine.deferred_waiting = False
        self._transition(engine, S.FAILED, cause,
                         f"restart budget exhausted: {restart.max_restarts} relaunch(es) "
                         f"within {restart.window_s:g} s; `reset` to try again")
        return True

    def _count_relaunch(self, engine: EngineRuntime, cause: Cause, at: float) -> None:
        """A relaunch after a failure: it uses the restart budget."""
        window = engine.cfg.restart.window_s
        engine.relaunch_times = [t for t in engine.relaunch_times if at - t < window] + [at]
        engine.restarts += 1
        self.metrics.restart(engine.id, str(cause))

    # ------------------------------------------------------------------ commands

    def _dispatch(self, cmd: str, args: dict[str, Any]) -> dict[str, Any] | Deferred:
        if self.shutdown_requested and cmd in ("restart", "reset", "register"):
            raise CommandError("the daemon is stopping")
        return dispatch(self, cmd, args)

    def pause(self, ids: list[str], deadline_s: float, wait_s: float | None = None,
              source: str = "local") -> Deferred:
        """Pause deep probes; the answer comes once no probe request of those engines is on the
        wire, so no probe can overlap a release_memory_occupation that follows."""
        deadline = time.time() + deadline_s
        for engine_id in ids:
            engine = self.engines[engine_id]
            fresh = engine.paused is None
            engine.paused = Pause(deadline, source)
            engine.progress_tokens = None  # paused generation is not a stall
            if fresh:
                self._emit(engine, "paused", detail=f"deep probes paused for {deadline_s:g} s")
            self.metrics.set_paused(engine_id, True)
        self._dirty = True

        def inflight() -> list[str]:
            return [i for i in ids if (e := self.engines.get(i)) is not None and e.probes_out]

        def ready() -> dict[str, Any] | None:
            return None if inflight() else {"paused": ids, "deadline": deadline}

        def late() -> dict[str, Any]:
            raise CommandError(f"pause recorded, but probes of {', '.join(inflight())} are "
                               "still in flight; ask again to wait for them")

        if wait_s is None:
            wait_s = max((self.engines[i].cfg.probe.health_timeout_s for i in ids), default=0.0)
            wait_s += MAX_CONNECT_S + PROBE_SLACK_S
        return Deferred(ready, time.monotonic() + wait_s, late)

    def resume(self, ids: list[str]) -> list[str]:
        resumed = []
        for engine_id in ids:
            engine = self.engines[engine_id]
            if engine.paused is not None:
                engine.paused = None
                engine.next_probe = time.monotonic()
                self._emit(engine, "resumed", detail="deep probes resumed")
                self.metrics.set_paused(engine_id, False)
                resumed.append(engine_id)
        self._dirty = True
        return resumed

    def _launchable(self, engine: EngineRuntime) -> None:
        if engine.external:
            raise CommandError(f"engine {engine.id} is external: its owner relaunches it")
        if not engine.cfg.command:
            raise CommandError(f"engine {engine.id} is not in the config any more")

    def restart(self, engine_id: str) -> str:
        engine = self.engines[engine_id]
        self._launchable(engine)
        if engine.kill is not None:
            if engine.kill.after == AfterKill.RECOVER:
                # It follows a failure: relaunched at once but within the restart budget.
                engine.restart_requested = True
            else:
                engine.kill.after = AfterKill.RESTART
            return "relaunch after the kill in progress"
        if engine.state.running:
            self._start_kill(engine, Cause.COMMANDED, "restart commanded", AfterKill.RESTART)
            return "killing, then relaunching"
        self._check_released(engine)
        if engine.deferred_waiting:
            # The relaunch a deferred engine waited for: it follows a failure, so it uses the
            # restart budget (a crash-looping colocated engine must end in `failed` too).
            cause = engine.last_failure.cause if engine.last_failure else Cause.COMMANDED
            if self._budget_exhausted(engine, cause):
                return "restart budget exhausted: failed; `reset` to try again"
            self._count_relaunch(engine, cause, time.time())
        self._launch(engine, Cause.COMMANDED)
        return "relaunched"

    def _check_released(self, engine: EngineRuntime) -> None:
        """Before a commanded launch of an engine that is down: its ports and GPUs must be
        free (a stop skips this check, as nothing was to be relaunched then)."""
        problems = kill.release_problems(engine, self.inspector)
        if problems:
            raise CommandError(f"engine {engine.id} not relaunched: " + "; ".join(problems))

    def stop(self, engine_id: str) -> str:
        engine = self.engines[engine_id]
        if engine.kill is not None:
            engine.kill.after = AfterKill.STOP
            return "stopping"
        if engine.state.running:
            self._start_kill(engine, Cause.COMMANDED, "stop commanded", AfterKill.STOP)
            return "stopping"
        if engine.state in (S.BACKOFF, S.FAILED):
            engine.backoff_until = None
            engine.deferred_waiting = False
            self._transition(engine, S.STOPPED, Cause.COMMANDED, "stop commanded")
        return "stopped"

    def reset(self, engine_id: str) -> str:
        engine = self.engines[engine_id]
        engine.relaunch_times = []
        engine.consecutive_failures = 0
        self._dirty = True
        if engine.state == S.FAILED:
            self._launchable(engine)
            self._check_released(engine)
            self._launch(engine, Cause.RESET)
            return "restart budget cleared; relaunched"
        return f"restart budget cleared (engine is {engine.state})"

    def register(self, engine_id: str, url: str, pid: int) -> str:
        """Watch an engine started by someone else (a Ray actor): probed and killed like ours,
        never relaunched."""
        key = proc_key(pid)
        if key is None:
            raise CommandError(f"no process with pid {pid}")
        existing = self.engines.get(engine_id)
        if existing is not None and not existing.external:
            raise CommandError(f"engine {engine_id} is in the config; pick another id")
        if existing is not None and existing.kill is not None:
            raise CommandError(f"engine {engine_id} is being stopped; register it again once "
                               "it is stopped")
        if existing is not None and existing.state.running:
            raise CommandError(f"engine {engine_id} is already registered ({existing.state}); "
                               "unregister it first")
        if key.pid in _protected_pids():
            raise CommandError(f"pid {pid} is init, this daemon or one of its ancestors: "
                               "never an engine")
        for other in self.engines.values():
            if other.id == engine_id:
                continue
            if key in other.procs and key not in other.dead:
                raise CommandError(f"pid {pid} is already watched as part of engine {other.id}")
            if url_port(url) in other.cfg.ports or url.rstrip("/") == other.cfg.url:
                raise CommandError(f"{url} is engine {other.id}'s address")
        incarnation = existing.incarnation + 1 if existing else 1
        engine = EngineRuntime(cfg=self._unconfigured_engine(engine_id, url), external=True,
                               incarnation=incarnation, main=key, procs={key: True},
                               launched_at=time.monotonic(), next_probe=time.monotonic())
        self.engines[engine_id] = engine
        self._transition(engine, S.STARTING, Cause.LAUNCHED, f"external pid {key.pid}")
        self._report_state(engine)
        self._watch(engine, key)
        if engine.state.running:
            self._refresh_trees([engine])
        return f"registered, incarnation {engine.incarnation}"

    def unregister(self, engine_id: str) -> str:
        engine = self.engines.get(engine_id)
        if engine is None or not engine.external:
            raise CommandError(f"no external engine {engine_id}")
        if engine.kill is not None:
            raise CommandError(f"engine {engine_id} is being killed; try again when it is "
                               "stopped")
        self._forget(engine, "unregistered", "no longer watched (not killed)")
        return "unregistered"

    def _forget(self, engine: EngineRuntime, kind: str, detail: str) -> None:
        for fd, (engine_id, _) in list(self.pidfds.items()):
            if engine_id == engine.id:
                self._unwatch(fd)
        del self.engines[engine.id]
        self.metrics.remove_engine(engine.id)
        self._emit(engine, kind, detail=detail)
        self._dirty = True

    # ------------------------------------------------------------------ reporting

    def status(self) -> dict[str, Any]:
        return {"node_id": self.node_id, "boot_id": self.boot_id,
                "engines": [self._engine_status(e) for e in self.engines.values()]}

    def _engine_status(self, e: EngineRuntime) -> dict[str, Any]:
        running = (e.state.running or e.state == S.STOPPING) and e.main not in e.dead
        next_launch = None
        if e.backoff_until is not None and e.state == S.BACKOFF:
            next_launch = time.time() + max(0.0, e.backoff_until - time.monotonic())
        return {
            "id": e.id, "state": str(e.state), "paused": e.paused is not None,
            "pid": e.main.pid if e.main and running else None,
            "incarnation": e.incarnation, "restarts": e.restarts, "url": e.cfg.url,
            "last_failure": e.last_failure.to_json() if e.last_failure else None,
            "since": e.state_since, "external": e.external,
            "restart_policy": e.cfg.restart_policy, "deferred_waiting": e.deferred_waiting,
            "next_launch": next_launch,
            "pause_deadline": e.paused.deadline if e.paused else None,
            "gpus": list(e.cfg.gpus), "ports": list(e.cfg.ports),
            "kill": {"phase": e.kill.phase.value, "waiting_for": e.kill.problems}
            if e.kill else None,
        }

    def _transition(self, engine: EngineRuntime, new: EngineState, cause: Cause,
                    detail: str) -> None:
        old = engine.state
        check_transition(old, new)
        engine.state = new
        engine.state_since = time.time()
        if new not in (S.HEALTHY, S.SUSPECT):
            engine.healthy_since = None
        self._emit(engine, "state", from_=str(old), to=str(new), cause=cause, detail=detail)
        self.metrics.set_state(engine.id, str(new))
        self._dirty = True

    def _report_state(self, engine: EngineRuntime) -> None:
        self.metrics.set_state(engine.id, str(engine.state))
        self.metrics.set_incarnation(engine.id, engine.incarnation)

    def _emit(self, engine: EngineRuntime | None, kind: str, *, from_: str | None = None,
              to: str | None = None, cause: Cause | None = None,
              detail: str | None = None) -> None:
        event = Event(ts=time.time(), node_id=self.node_id, engine=engine.id if engine else None,
                      incarnation=engine.incarnation if engine else None, kind=kind,
                      from_=from_, to=to, cause=str(cause) if cause else None, detail=detail)
        self.events.append(event)
        who = f"{event.engine}#{event.incarnation}" if engine else "daemon"
        what = f"{from_} -> {to}" if kind == "state" else kind
        log.info("%s %s%s%s", who, what, f" [{cause}]" if cause else "",
                 f": {detail}" if detail else "",
                 extra={k: v for k, v in (("engine", event.engine), ("kind", kind),
                                          ("incarnation", event.incarnation),
                                          ("cause", event.cause)) if v is not None})

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

    def _save_state(self, *, clean: bool = False) -> None:
        records = {} if clean else {e.id: _record(e) for e in self.engines.values()}
        if save_state(self.state_path, self.node_id, records):
            self._dirty = False

    def _bad_message(self, why: str) -> None:
        self.metrics.bad_control_message()
        log.warning("bad control message: %s", why)


def _record(e: EngineRuntime) -> EngineRecord:
    return EngineRecord(
        state=e.state, incarnation=e.incarnation, state_since=e.state_since,
        restarts=e.restarts, relaunch_times=e.relaunch_times,
        consecutive_failures=e.consecutive_failures, main=e.main,
        procs={k: fatal for k, fatal in e.procs.items() if k not in e.dead},
        launched_at=time.time() - (time.monotonic() - e.launched_at), paused=e.paused,
        last_failure=e.last_failure, deferred_waiting=e.deferred_waiting,
        kill_cause=e.kill.cause if e.kill else None, kill_after=e.kill.after if e.kill else None,
        external=e.external, url=e.cfg.url)


def _protected_pids() -> set[int]:
    """Processes that must never be treated as an engine: killing one kills the node, or us."""
    pids = {0, 1}
    pid = os.getpid()
    while pid > 1 and pid not in pids:
        pids.add(pid)
        stat = read_stat(pid)
        pid = stat.ppid if stat else 0
    return pids


def _probe_interval(engine: EngineRuntime) -> float:
    """While starting, probe at least every second: boot completion should be seen quickly."""
    interval = engine.cfg.probe.health_interval_s
    return min(interval, 1.0) if engine.state == S.STARTING else interval
