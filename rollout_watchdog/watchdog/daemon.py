"""The node daemon: one single-threaded main loop that supervises every engine of the node.

The loop waits on pidfds (one per process of every engine tree: exits are seen at once, paused or
not), the control socket, and the probe pool's wake-up pipe, and otherwise on its nearest timer.
All I/O that can hang (HTTP probes) runs on the probe pool; everything else the loop does is
bounded and quick (signals, /proc reads, a bind() per port, NVML queries).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import signal
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq

from rollout_watchdog.config import EngineConfig, NodeConfig
from rollout_watchdog.watchdog import policy
from rollout_watchdog.watchdog.engine import (
    AfterKill,
    EngineRuntime,
    Failure,
    KillJob,
    KillPhase,
    Pause,
)
from rollout_watchdog.watchdog.events import Event, EventLog
from rollout_watchdog.watchdog.gpu import GpuInspector, gpu_holders, make_inspector
from rollout_watchdog.watchdog.metrics import Metrics
from rollout_watchdog.watchdog.probe import ProbeResult, ProbeRunner
from rollout_watchdog.watchdog.process import (
    ProcKey,
    descendants,
    describe_exit,
    group_alive,
    is_alive,
    launch,
    open_pidfd,
    port_bindable,
    proc_key,
    signal_group,
    signal_proc,
    stop_signal_group,
)
from rollout_watchdog.watchdog.sdnotify import SystemdNotifier
from rollout_watchdog.watchdog.states import Cause, EngineState, check_transition

log = logging.getLogger("rollout_watchdog.watchdog")
S = EngineState
MAX_CONTROL_MESSAGE = 64 * 1024
# A probe thread stuck past its own HTTP timeout is given up on after this much slack.
PROBE_SLACK_S = 1.0
RELEASE_CHECK_INTERVAL_S = 0.05
DEFAULT_PAUSE_S = 600.0
# Exit code of a daemon told to go away and leave its engines running (SIGUSR2): the unit's
# RestartForceExitStatus restarts it, and the new daemon adopts them.
DETACH_EXIT_CODE = 75
# The daemon's own systemd handshake; an engine that inherited it could pose as the daemon.
SYSTEMD_ONLY_ENV = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")


class CommandError(Exception):
    """A control command that cannot be carried out; the message is the reply's reason."""


@dataclass
class Deferred:
    """A reply that waits for a condition: `poll()` returns the result once it is ready."""

    poll: Callable[[], dict[str, Any] | None]
    deadline: float                       # monotonic
    on_timeout: Callable[[], dict[str, Any]]


@dataclass
class _Parked:
    envelope: list[bytes]
    request_id: Any
    deferred: Deferred


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
        self.probes = ProbeRunner(max_workers=max(4, 2 * len(self.engines)))
        self.ctx = zmq.Context.instance()
        self.control: zmq.Socket | None = None
        self.poller = zmq.Poller()
        self.pidfds: dict[int, tuple[str, ProcKey]] = {}
        self.parked: list[_Parked] = []
        self._replies: list[list[bytes]] = []
        self.shutdown_requested: str | None = None     # "stop" or "detach"
        self.bad_messages = 0
        self._dirty = True
        self._next_notify = 0.0
        self._last_summary = ""
        self._sig_r, self._sig_w = os.pipe()

    # ------------------------------------------------------------------ lifecycle

    def run(self) -> int:
        """Run until SIGTERM/SIGINT (stop every engine) or SIGUSR2 (leave them running)."""
        self._setup()
        self._adopt_or_launch()
        self.notifier.ready()
        log.info("watching %d engine(s) on node %s", len(self.engines), self.node_id)
        try:
            while not self._finished():
                self.step()
        finally:
            self._teardown()
        return DETACH_EXIT_CODE if self.shutdown_requested == "detach" else 0

    def _setup(self) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        if self.inspector is None:
            self.inspector = make_inspector(self.config.gpu_check)
        self.control = bind_control(self.ctx, self.config.control)
        self.poller.register(self.control, zmq.POLLIN)
        self.poller.register(self.probes.wake_r, zmq.POLLIN)
        os.set_blocking(self._sig_r, False)
        os.set_blocking(self._sig_w, False)
        self.poller.register(self._sig_r, zmq.POLLIN)
        signal.set_wakeup_fd(self._sig_w)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR2):
            signal.signal(sig, self._on_signal)
        if self.config.metrics_port:
            self.metrics.start_server(self.config.metrics_port, self.config.metrics_host)

    def _on_signal(self, signum: int, frame: object) -> None:
        if self.shutdown_requested:
            return
        self.shutdown_requested = "detach" if signum == signal.SIGUSR2 else "stop"

    def _finished(self) -> bool:
        if not self.shutdown_requested:
            return False
        if self.shutdown_requested == "detach":
            return True
        return all(e.kill is None for e in self.engines.values())

    def _begin_shutdown(self) -> None:
        self.notifier.stopping()
        self._emit(None, "daemon_stopping", detail=f"{self.shutdown_requested} requested")
        if self.shutdown_requested == "stop":
            for engine in self.engines.values():
                if engine.external:
                    continue
                if engine.kill is not None:
                    engine.kill.after = AfterKill.STOP
                elif engine.state.running:
                    self._start_kill(engine, Cause.COMMANDED, "daemon stopping", AfterKill.STOP)
                elif engine.state == S.BACKOFF:
                    self._transition(engine, S.STOPPED, Cause.COMMANDED, "daemon stopping")

    def _teardown(self) -> None:
        if self.shutdown_requested == "stop":
            # A clean stop leaves nothing to adopt: the next start launches every engine.
            self._save_state(clean=True)
        else:
            self._save_state()
        signal.set_wakeup_fd(-1)
        for fd in list(self.pidfds):
            os.close(fd)
        self.pidfds.clear()
        if self.control is not None:
            self.control.close(linger=0)
            path = ipc_path(self.config.control)
            if path and os.path.exists(path):
                os.unlink(path)
        self.probes.close()
        log.info("daemon exits (%s)", self.shutdown_requested or "done")

    # ------------------------------------------------------------------ the loop

    def step(self) -> None:
        """One loop iteration: wait for the next event or timer, then handle what is due."""
        now = time.monotonic()
        timeout = max(0.0, min(self._next_deadline(now) - now, 0.5))
        ready = dict(self.poller.poll(timeout * 1000))
        started = time.monotonic()
        if self._sig_r in ready:
            with contextlib.suppress(BlockingIOError):
                os.read(self._sig_r, 512)
        if self.shutdown_requested and not getattr(self, "_shutdown_started", False):
            self._shutdown_started = True
            self._begin_shutdown()
        for fd, (engine_id, key) in list(self.pidfds.items()):
            if fd in ready:
                self._on_exit(engine_id, key, fd)
        for result in self.probes.drain() if self.probes.wake_r in ready else ():
            self._on_probe_result(result)
        if self.control is not None and self.control in ready:
            self._serve_control()
        now = time.monotonic()
        self._sweep([e for e in self.engines.values()
                     if e.state.running and e.kill is None and now >= e.next_sweep], now)
        for engine in list(self.engines.values()):
            self._tick(engine, now)
        self._answer_parked(now)
        if self._dirty:
            self._save_state()
        self._flush_replies()  # after the save: an acknowledged command survives a crash
        self._notify_systemd(now)
        self.metrics.loop_iteration(time.monotonic() - started)

    def _next_deadline(self, now: float) -> float:
        deadlines = [now + 0.5]
        for e in self.engines.values():
            if e.state.running:
                deadlines.append(e.next_sweep)
                if e.probing and e.probe_started is None:
                    deadlines.append(e.next_probe)
                if e.probe_started is not None:
                    deadlines.append(e.probe_started + e.cfg.probe.health_timeout_s
                                     + PROBE_SLACK_S)
                if e.state == S.STARTING:
                    deadlines.append(e.launched_at + e.cfg.probe.startup_timeout_s)
            if e.kill is not None:
                deadlines.append(e.kill.deadline if e.kill.phase != KillPhase.RELEASE
                                 else e.kill.next_check)
            if e.backoff_until is not None:
                deadlines.append(e.backoff_until)
        deadlines.extend(p.deferred.deadline for p in self.parked)
        return min(deadlines)

    def _tick(self, engine: EngineRuntime, now: float) -> None:
        """Timers of one engine: sweeps, probes, deadlines, kill phases, backoff, pause expiry."""
        if engine.kill is not None:
            self._advance_kill(engine, now)
            return
        if engine.paused is not None and time.time() >= engine.paused.deadline:
            engine.paused = None
            self._emit(engine, "pause_expired", detail="deep probes resumed")
            self.metrics.set_paused(engine.id, False)
            self._dirty = True
        if engine.backoff_until is not None and now >= engine.backoff_until:
            self._launch(engine, Cause.BACKOFF_ELAPSED)
            return
        if not engine.state.running:
            return
        if engine.state == S.STARTING and not engine.cfg.probe.health_path:
            # Deep probes off (a multi-node follower answers a dummy /health): liveness only.
            self._become_healthy(engine, "deep probes off: watched by liveness alone")
        if engine.state == S.STARTING and now >= engine.launched_at + \
                engine.cfg.probe.startup_timeout_s:
            self._fail(engine, Cause.STARTUP_TIMEOUT,
                       f"not healthy {engine.cfg.probe.startup_timeout_s:g} s after launch",
                       engine.launched_at + engine.cfg.probe.startup_timeout_s)
            return
        if engine.probe_started is not None:
            limit = engine.probe_started + engine.cfg.probe.health_timeout_s + PROBE_SLACK_S
            if now >= limit:
                # The probe thread is stuck past its own timeout: judge it failed now; its late
                # result is ignored (the probe id moved on).
                self._on_probe_result(ProbeResult(
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
        saved = self._load_state()
        for engine in self.engines.values():
            record = saved.get(engine.id)
            if record is None:
                self._launch(engine, Cause.LAUNCHED)
            else:
                self._adopt(engine, record)
        for engine_id, record in saved.items():
            if engine_id not in self.engines and record.get("external"):
                self._adopt_external(engine_id, record)

    def _load_state(self) -> dict[str, dict[str, Any]]:
        from rollout_watchdog.watchdog.statefile import load_state

        data = load_state(self.state_path)
        if not data or not isinstance(data.get("engines"), dict):
            return {}
        return data["engines"]

    def _adopt(self, engine: EngineRuntime, record: dict[str, Any]) -> None:
        """Take over an engine recorded by a previous daemon: same process if it still runs (and
        is the same process: pid plus create time), otherwise recover it as a failure."""
        try:
            engine.incarnation = int(record["incarnation"])
            engine.restarts = int(record.get("restarts", 0))
            engine.relaunch_times = [float(t) for t in record.get("relaunch_times", [])]
            engine.consecutive_failures = int(record.get("consecutive_failures", 0))
            state = S(record["state"])
            main = ProcKey.from_json(record["main"]) if record.get("main") else None
            procs = {ProcKey.from_json(p): bool(fatal) for p, fatal in record.get("procs", [])}
            pause = record.get("paused")
            failure = record.get("last_failure")
            if failure:
                engine.last_failure = Failure(Cause(failure["cause"]), failure["detail"],
                                              float(failure["ts"]))
        except (KeyError, ValueError, TypeError) as exc:
            log.error("state of engine %s is unusable (%s): launching it fresh", engine.id, exc)
            self._launch(engine, Cause.LAUNCHED)
            return
        engine.state = state
        engine.state_since = float(record.get("state_since", time.time()))
        if state in (S.FAILED, S.STOPPED):
            self._emit(engine, "adopted", detail=f"kept {state} from the previous daemon")
            self._report_state(engine)
            return
        if state == S.BACKOFF:
            engine.deferred_waiting = bool(record.get("deferred_waiting"))
            if not engine.deferred_waiting:
                engine.backoff_until = time.monotonic()
            self._emit(engine, "adopted", detail="in backoff")
            self._report_state(engine)
            return
        engine.main = main
        if main is not None:
            procs.setdefault(main, True)
        engine.procs = procs
        now = time.monotonic()
        engine.launched_at = now - max(0.0, time.time() - float(record.get("launched_at", 0)))
        engine.next_sweep = now
        engine.next_probe = now
        if state in (S.HEALTHY, S.SUSPECT):
            engine.healthy_since = now
        if pause and float(pause["deadline"]) > time.time():
            engine.paused = Pause(float(pause["deadline"]), pause.get("source", "local"))
        alive = main is not None and is_alive(main)
        self._emit(engine, "adopted", detail=f"pid {main.pid} still running, kept in {state}"
                   if alive and main else "its main process is gone")
        self._report_state(engine)
        if state == S.STOPPING:
            engine.state = S.SUSPECT  # so that the kill starts from a running state
            self._start_kill(engine, Cause(record.get("kill_cause") or "commanded"),
                             "kill resumed after a daemon restart",
                             AfterKill(record.get("kill_after") or "recover"))
        # A process that died while the daemon was down counts as an exit seen now.
        for key in list(procs):
            self._watch(engine, key)
        if main is None and engine.state.running:
            self._fail(engine, Cause.EXITED, "no main process recorded", now)

    def _adopt_external(self, engine_id: str, record: dict[str, Any]) -> None:
        try:
            main = ProcKey.from_json(record["main"])
            self._register_external(engine_id, record["url"], main, adopted=True,
                                    incarnation=int(record["incarnation"]))
        except (KeyError, ValueError, TypeError, CommandError) as exc:
            log.warning("external engine %s not adopted: %s", engine_id, exc)

    def _launch(self, engine: EngineRuntime, cause: Cause) -> None:
        """Start a new incarnation with the same argv, env, ports and GPUs."""
        old = engine.state
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
        engine.next_sweep = now
        self._transition(engine, S.STARTING, cause, f"pid {popen.pid}")
        engine.next_probe = now + _probe_interval(engine)
        self._report_state(engine)
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
        if engine is not None and key in engine.procs:
            self._process_gone(engine, key)

    def _process_gone(self, engine: EngineRuntime, key: ProcKey) -> None:
        """An exit is fatal for the main process and for the processes the engine had when it
        became healthy; later arrivals (compile workers) may come and go."""
        engine.dead.add(key)
        if key == engine.main and engine.popen is not None:
            engine.returncode = engine.popen.poll()
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
        """Refresh the trees of these engines from one scan of the process table: new processes
        are watched (so a kill reaches them); a main process found gone without its exit event
        (not expected) still counts."""
        alive = []
        for engine in engines:
            engine.next_sweep = now + engine.cfg.probe.liveness_interval_s
            if engine.main is None:
                continue
            if is_alive(engine.main):
                alive.append(engine)
            elif engine.main not in engine.dead:
                engine.dead.add(engine.main)
                if engine.popen is not None:
                    engine.returncode = engine.popen.poll()
                self._fail(engine, Cause.EXITED, f"main process {engine.main.pid} is gone "
                           f"({describe_exit(engine.returncode)})", now)
        self._refresh_trees(alive)

    def _refresh_trees(self, engines: list[EngineRuntime]) -> None:
        if not engines:
            return
        trees = descendants([e.main.pid for e in engines if e.main is not None])
        for engine in engines:
            assert engine.main is not None
            for key in trees.get(engine.main.pid, []):
                if key not in engine.procs:
                    engine.procs[key] = False
                    self._watch(engine, key)
                    self._dirty = True

    # ------------------------------------------------------------------ deep probes

    def _start_probe(self, engine: EngineRuntime, now: float) -> None:
        engine.probe_id += 1
        engine.probe_started = now
        self.probes.submit(engine.id, engine.probe_id,
                           engine.cfg.url + engine.cfg.probe.health_path,
                           engine.cfg.probe.health_timeout_s)

    def _on_probe_result(self, result: ProbeResult) -> None:
        engine = self.engines.get(result.engine)
        if engine is None or result.probe_id != engine.probe_id or engine.probe_started is None:
            return  # a late answer to a probe already judged, or of an older incarnation
        engine.probe_started = None
        engine.next_probe = time.monotonic() + _probe_interval(engine)
        self.metrics.probe(engine.id, result.finished - result.started, result.ok)
        if not engine.state.running:
            return
        if engine.state == S.STARTING:
            if result.ok:
                self._become_healthy(engine, f"first passing probe ({result.detail})")
            return  # failures while starting are expected; the startup deadline rules
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

    def _become_healthy(self, engine: EngineRuntime, detail: str) -> None:
        """The processes in the tree now are the engine (schedulers, detokenizer): from here on
        the exit of any of them is fatal. Later arrivals are only tracked."""
        self._refresh_trees([engine])
        for key in engine.alive_procs():
            engine.procs[key] = True
        engine.healthy_since = time.monotonic()
        self._transition(engine, S.HEALTHY, Cause.PROBE_PASSED, detail)

    # ------------------------------------------------------------------ failure and kill

    def _fail(self, engine: EngineRuntime, cause: Cause, detail: str, evidence_at: float) -> None:
        """Declare the current incarnation failed and start cleaning it up."""
        engine.last_failure = Failure(cause, detail, time.time())
        self.metrics.detection(engine.id, str(cause), max(0.0, time.monotonic() - evidence_at))
        self._start_kill(engine, cause, detail, AfterKill.RECOVER)

    def _start_kill(self, engine: EngineRuntime, cause: Cause, detail: str,
                    after: AfterKill) -> None:
        """Begin the bounded kill: SIGCONT+SIGTERM to the group, then the grace period."""
        if engine.state.running:
            self._transition(engine, S.STOPPING, cause, detail)
        now = time.monotonic()
        engine.probe_started = None  # a probe still out is of no interest any more
        engine.backoff_until = None
        self._refresh_tree_if_alive(engine)
        grace = engine.cfg.restart.grace_s
        engine.kill = KillJob(cause, detail, after, KillPhase.TERM, now + grace)
        if grace > 0 and self._any_alive(engine):
            self._signal_term(engine)
            self.metrics.kill(engine.id, str(cause), "SIGTERM")
        self._advance_kill(engine, now)
        self._dirty = True

    def _refresh_tree_if_alive(self, engine: EngineRuntime) -> None:
        if engine.main is not None and is_alive(engine.main):
            self._refresh_trees([engine])

    def _signal_term(self, engine: EngineRuntime) -> None:
        if engine.main is None:
            return
        if engine.external and not _is_group_leader(engine.main.pid):
            for key in engine.alive_procs():
                signal_proc(key, signal.SIGCONT)
                signal_proc(key, signal.SIGTERM)
        else:
            stop_signal_group(engine.main.pid)

    def _any_alive(self, engine: EngineRuntime) -> bool:
        return any(is_alive(k) for k in engine.alive_procs())

    def _group_done(self, engine: EngineRuntime) -> bool:
        """The graceful part is over: nothing left in the engine's process group (processes
        that left the group, orphans, are not waited for: they get SIGKILL right away)."""
        if engine.main is None:
            return True
        if engine.external and not _is_group_leader(engine.main.pid):
            return not is_alive(engine.main)
        return not group_alive(engine.main.pid) and not is_alive(engine.main)

    def _advance_kill(self, engine: EngineRuntime, now: float) -> None:
        job = engine.kill
        assert job is not None
        if job.phase == KillPhase.TERM:
            if self._group_done(engine) and not self._any_alive(engine):
                self._enter_release(engine, now)
            elif now >= job.deadline or self._group_done(engine):
                self._sigkill_all(engine)
                job.phase = KillPhase.KILL
                job.deadline = now + engine.cfg.restart.kill_timeout_s
            else:
                return
        if job.phase == KillPhase.KILL:
            if self._any_alive(engine) or (engine.main and not engine.external
                                           and group_alive(engine.main.pid)):
                if now >= job.deadline:
                    survivors = ", ".join(str(k.pid) for k in engine.alive_procs()
                                          if is_alive(k))
                    self._finish_kill(engine, S.FAILED, Cause.UNKILLABLE,
                                      f"still alive {engine.cfg.restart.kill_timeout_s:g} s "
                                      f"after SIGKILL: {survivors or 'process group members'}")
                return
            self._enter_release(engine, now)
        if job.phase == KillPhase.RELEASE and now >= job.next_check:
            problems = self._release_problems(engine)
            if not problems:
                self._after_kill(engine)
            elif now >= job.deadline:
                cause = (Cause.GPU_NOT_RELEASED if any("GPU" in p for p in problems)
                         else Cause.PORT_NOT_RELEASED)
                self._finish_kill(engine, S.FAILED, cause, "; ".join(problems))
            else:
                if problems != job.problems:
                    log.debug("waiting for release: %s", "; ".join(problems),
                              extra={"engine": engine.id})
                job.problems = problems
                job.next_check = now + RELEASE_CHECK_INTERVAL_S

    def _sigkill_all(self, engine: EngineRuntime) -> None:
        """SIGKILL to the group and to every process ever seen in the tree, orphans that moved
        to their own session included."""
        assert engine.kill is not None
        if engine.main is not None and not engine.external:
            signal_group(engine.main.pid, signal.SIGKILL)
        sent = [k for k in engine.alive_procs() if signal_proc(k, signal.SIGKILL)]
        if sent or (engine.main is not None and not engine.external):
            self.metrics.kill(engine.id, str(engine.kill.cause), "SIGKILL")
        if sent:
            log.info("SIGKILL sent", extra={"engine": engine.id,
                                            "pids": [k.pid for k in sent]})

    def _enter_release(self, engine: EngineRuntime, now: float) -> None:
        assert engine.kill is not None
        if engine.popen is not None and engine.returncode is None:
            engine.returncode = engine.popen.poll()
        engine.kill.phase = KillPhase.RELEASE
        log.debug("processes gone, checking ports and GPUs", extra={"engine": engine.id})
        engine.kill.deadline = now + engine.cfg.restart.release_timeout_s
        engine.kill.next_check = now

    def _release_problems(self, engine: EngineRuntime) -> list[str]:
        """What still blocks a relaunch: ports in use, GPU compute processes."""
        if engine.external:
            return []  # its owner relaunches it, on whatever ports and GPUs it chooses
        problems = [f"port {p} is still in use" for p in engine.cfg.ports
                    if not port_bindable(p)]
        if engine.cfg.gpus and self.inspector is not None:
            try:
                holders = gpu_holders(self.inspector, engine.cfg.gpus,
                                      {k.pid for k in engine.procs},
                                      shared=engine.cfg.restart_policy == "deferred")
            except Exception as exc:  # an NVML error must not kill the loop
                holders = {}
                log.warning("GPU check failed: %s", exc, extra={"engine": engine.id})
            problems += [f"GPU {gpu} still has compute process(es) {sorted(pids)}"
                         for gpu, pids in holders.items()]
        return problems

    def _finish_kill(self, engine: EngineRuntime, state: EngineState, cause: Cause,
                     detail: str) -> None:
        engine.kill = None
        engine.last_failure = Failure(cause, detail, time.time())
        self._transition(engine, state, cause, detail)
        self._report_state(engine)

    def _after_kill(self, engine: EngineRuntime) -> None:
        """The old incarnation is gone and its resources are free: decide what comes next."""
        job = engine.kill
        assert job is not None
        engine.kill = None
        exit_note = describe_exit(engine.returncode)
        if job.after == AfterKill.STOP:
            self._transition(engine, S.STOPPED, job.cause, f"{job.detail}; {exit_note}")
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
        now_wall = time.time()
        restart = engine.cfg.restart
        if policy.budget_exhausted(engine.relaunch_times, now_wall, restart):
            self._transition(engine, S.FAILED, cause,
                             f"restart budget exhausted: {restart.max_restarts} relaunch(es) "
                             f"within {restart.window_s:g} s; `reset` to try again")
            return
        engine.consecutive_failures += 1
        if engine.cfg.restart_policy == "deferred":
            engine.deferred_waiting = True
            self._transition(engine, S.BACKOFF, cause,
                             "deferred: cleaned up, relaunched on `restart` or at the next refit")
            return
        delay = policy.backoff_delay(engine.consecutive_failures, restart, self.rng)
        engine.backoff_until = time.monotonic() + delay
        self._transition(engine, S.BACKOFF, cause, f"relaunch in {delay:.2f} s")
        engine.relaunch_times = [t for t in engine.relaunch_times
                                 if now_wall - t < restart.window_s] + [now_wall + delay]
        engine.restarts += 1
        self.metrics.restart(engine.id, str(cause))
        if delay == 0:
            self._launch(engine, Cause.BACKOFF_ELAPSED)

    # ------------------------------------------------------------------ commands

    def pause(self, ids: list[str], deadline_s: float, source: str = "local") -> Deferred:
        """Pause deep probes; the answer comes once no probe of those engines is in flight, so
        no probe can overlap a release_memory_occupation that follows."""
        deadline = time.time() + deadline_s
        for engine_id in ids:
            engine = self.engines[engine_id]
            fresh = engine.paused is None
            engine.paused = Pause(deadline, source)
            if fresh:
                self._emit(engine, "paused", detail=f"deep probes paused for {deadline_s:g} s")
            self.metrics.set_paused(engine_id, True)
        self._dirty = True

        def ready() -> dict[str, Any] | None:
            inflight = [i for i in ids if self.engines[i].probe_started is not None]
            return None if inflight else {"paused": ids, "deadline": deadline}

        def late() -> dict[str, Any]:
            inflight = [i for i in ids if self.engines[i].probe_started is not None]
            raise CommandError(f"pause recorded, but probes of {', '.join(inflight)} are still "
                               "in flight; ask again to wait for them")

        longest = max((self.engines[i].cfg.probe.health_timeout_s for i in ids), default=0.0)
        return Deferred(ready, time.monotonic() + longest + PROBE_SLACK_S + 1.0, late)

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

    def restart(self, engine_id: str) -> str:
        engine = self.engines[engine_id]
        if engine.external:
            raise CommandError(f"engine {engine_id} is external: its owner restarts it")
        if engine.kill is not None:
            engine.kill.after = AfterKill.RESTART
            return "relaunch after the kill in progress"
        if engine.state.running:
            self._start_kill(engine, Cause.COMMANDED, "restart commanded", AfterKill.RESTART)
            return "killing, then relaunching"
        self._launch(engine, Cause.COMMANDED)
        return "relaunched"

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
        if engine.state == S.FAILED and not engine.external:
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
        if existing is not None and existing.state.running:
            raise CommandError(f"engine {engine_id} is registered and {existing.state}; "
                               "unregister it first")
        incarnation = existing.incarnation if existing else 0
        self._register_external(engine_id, url, key, adopted=False, incarnation=incarnation)
        return f"registered, incarnation {self.engines[engine_id].incarnation}"

    def _register_external(self, engine_id: str, url: str, key: ProcKey, *, adopted: bool,
                           incarnation: int) -> None:
        if not is_alive(key):
            raise CommandError(f"process {key.pid} is gone")
        cfg = EngineConfig(id=engine_id, url=url.rstrip("/"), command=(),
                           probe=self.config.probe, restart=self.config.restart)
        engine = EngineRuntime(cfg=cfg, external=True)
        engine.incarnation = incarnation - 1 if adopted else incarnation
        engine.new_incarnation()
        engine.main = key
        engine.procs = {key: True}
        now = time.monotonic()
        engine.launched_at = now
        engine.next_sweep = now
        engine.next_probe = now
        self.engines[engine_id] = engine
        self._watch(engine, key)
        self._refresh_trees([engine])
        self._transition(engine, S.STARTING, Cause.ADOPTED if adopted else Cause.LAUNCHED,
                         f"external pid {key.pid}")
        self._report_state(engine)

    def unregister(self, engine_id: str) -> str:
        engine = self.engines.get(engine_id)
        if engine is None or not engine.external:
            raise CommandError(f"no external engine {engine_id}")
        if engine.kill is not None:
            raise CommandError(f"engine {engine_id} is being killed; try again when it is "
                               "stopped")
        for fd, (eid, _) in list(self.pidfds.items()):
            if eid == engine_id:
                self._unwatch(fd)
        del self.engines[engine_id]
        self.metrics.remove_engine(engine_id)
        self._emit(None, "unregistered", detail=engine_id)
        self._dirty = True
        return "unregistered"

    # ------------------------------------------------------------------ reporting

    def status(self) -> dict[str, Any]:
        return {"node_id": self.node_id, "boot_id": self.boot_id,
                "engines": [self._engine_status(e) for e in self.engines.values()]}

    def _engine_status(self, e: EngineRuntime) -> dict[str, Any]:
        running = e.state.running or e.state == S.STOPPING
        next_launch = None
        if e.backoff_until is not None:
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
        }

    def _transition(self, engine: EngineRuntime, new: EngineState, cause: Cause,
                    detail: str) -> None:
        old = engine.state
        check_transition(old, new)
        engine.state = new
        engine.state_since = time.time()
        if new != S.HEALTHY:
            engine.healthy_since = None if new != S.SUSPECT else engine.healthy_since
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
        if summary != self._last_summary:
            self._last_summary = summary
            self.notifier.status(f"{len(self.engines)} engine(s): {summary}")

    def _save_state(self, *, clean: bool = False) -> None:
        from rollout_watchdog.watchdog.statefile import save_state

        engines = {} if clean else {e.id: self._engine_record(e) for e in self.engines.values()}
        if save_state(self.state_path, {"node_id": self.node_id, "engines": engines}):
            self._dirty = False

    def _engine_record(self, e: EngineRuntime) -> dict[str, Any]:
        return {
            "state": str(e.state), "state_since": e.state_since, "incarnation": e.incarnation,
            "restarts": e.restarts, "relaunch_times": e.relaunch_times,
            "consecutive_failures": e.consecutive_failures,
            "main": e.main.to_json() if e.main else None,
            "procs": [[k.to_json(), fatal] for k, fatal in e.procs.items() if k not in e.dead],
            "launched_at": time.time() - (time.monotonic() - e.launched_at),
            "paused": {"deadline": e.paused.deadline, "source": e.paused.source}
            if e.paused else None,
            "last_failure": e.last_failure.to_json() if e.last_failure else None,
            "deferred_waiting": e.deferred_waiting,
            "kill_cause": str(e.kill.cause) if e.kill else None,
            "kill_after": str(e.kill.after.value) if e.kill else None,
            "external": e.external, "url": e.cfg.url,
        }

    # ------------------------------------------------------------------ control socket

    def _serve_control(self) -> None:
        from rollout_watchdog.watchdog.commands import dispatch

        assert self.control is not None
        for _ in range(100):  # bounded per iteration so engines are never starved
            try:
                frames = self.control.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            envelope, payload = split_envelope(frames)
            if envelope is None:
                self._bad_message("malformed frames")
                continue
            request_id = None
            try:
                request = decode_request(payload)
                request_id = request.get("id")
                result = dispatch(self, request["cmd"], request.get("args") or {})
            except CommandError as exc:
                self._reply(envelope, request_id, error=str(exc))
                continue
            except ValueError as exc:
                self._bad_message(str(exc))
                self._reply(envelope, request_id, error=str(exc))
                continue
            if isinstance(result, Deferred):
                self.parked.append(_Parked(envelope, request_id, result))
            else:
                self._reply(envelope, request_id, result=result)

    def _answer_parked(self, now: float) -> None:
        still = []
        for parked in self.parked:
            try:
                result = parked.deferred.poll()
                if result is None and now >= parked.deferred.deadline:
                    result = parked.deferred.on_timeout()
            except CommandError as exc:
                self._reply(parked.envelope, parked.request_id, error=str(exc))
                continue
            if result is None:
                still.append(parked)
            else:
                self._reply(parked.envelope, parked.request_id, result=result)
        self.parked = still

    def _reply(self, envelope: list[bytes], request_id: Any, *, result: Any = None,
               error: str | None = None) -> None:
        body = {"v": 1, "id": request_id, "status": "error" if error else "ok",
                "reason": error, "result": result}
        self._replies.append([*envelope, json.dumps(body).encode()])

    def _flush_replies(self) -> None:
        assert self.control is not None
        for frames in self._replies:
            try:
                self.control.send_multipart(frames, zmq.NOBLOCK)
            except zmq.ZMQError as exc:  # the client went away; nothing to do
                log.debug("control reply dropped: %s", exc)
        self._replies.clear()

    def _bad_message(self, why: str) -> None:
        self.bad_messages += 1
        self.metrics.bad_control_message()
        log.warning("bad control message: %s", why)


def _probe_interval(engine: EngineRuntime) -> float:
    """While starting, probe at least every second: boot completion should be seen quickly."""
    interval = engine.cfg.probe.health_interval_s
    return min(interval, 1.0) if engine.state == S.STARTING else interval


def _is_group_leader(pid: int) -> bool:
    try:
        return os.getpgid(pid) == pid
    except ProcessLookupError:
        return False


def ipc_path(endpoint: str) -> str | None:
    return endpoint[len("ipc://"):] if endpoint.startswith("ipc://") else None


def bind_control(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    """Bind the control ROUTER; an ipc socket is made 0600 (only root or the daemon's user can
    kill engines through it), and a stale socket file of a dead daemon is replaced."""
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_CONTROL_MESSAGE)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
    path = ipc_path(endpoint)
    if path:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        if os.path.exists(path):
            if _socket_in_use(path):
                sock.close()
                raise RuntimeError(f"control socket {path} is in use: is another daemon "
                                   "running?")
            os.unlink(path)
        old_umask = os.umask(0o177)
        try:
            sock.bind(endpoint)
        finally:
            os.umask(old_umask)
        os.chmod(path, 0o600)
    else:
        sock.bind(endpoint)
    return sock


def _socket_in_use(path: str) -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(path)
        return True
    except OSError:
        return False
    finally:
        probe.close()


def split_envelope(frames: list[bytes]) -> tuple[list[bytes] | None, bytes]:
    """ROUTER frames: [identity, payload] from a DEALER, [identity, b"", payload] from a REQ."""
    if len(frames) == 2:
        return frames[:1], frames[1]
    if len(frames) == 3 and frames[1] == b"":
        return frames[:2], frames[2]
    return None, b""


def decode_request(payload: bytes) -> dict[str, Any]:
    try:
        request = json.loads(payload)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"not a JSON request: {exc}") from None
    if not isinstance(request, dict) or not isinstance(request.get("cmd"), str):
        raise ValueError("a request is a JSON object with a string 'cmd'")
    if request.get("v", 1) != 1:
        raise ValueError(f"unsupported protocol version {request.get('v')!r} (this daemon "
                         "speaks 1)")
    if not isinstance(request.get("args", {}), dict):
        raise ValueError("'args' must be a JSON object")
    return request


def engine_ids(daemon: Daemon, args: dict[str, Any]) -> list[str]:
    """The engines a command names: `engine` (one id) or `all: true`."""
    if args.get("all"):
        return list(daemon.engines)
    engine = args.get("engine")
    if not isinstance(engine, str):
        raise CommandError("name an engine ('engine') or all engines ('all': true)")
    if engine not in daemon.engines:
        known = ", ".join(daemon.engines) or "none"
        raise CommandError(f"no engine {engine!r} on this node (engines: {known})")
    return [engine]
