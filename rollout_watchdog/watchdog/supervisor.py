"""The per-engine supervisor: every decision about an engine, driven by the loop's events (an
exit, a probe result) and timers (`tick(engine, now)`), with every process operation going
through one `ProcessOps` and every clock reading through one `Clock`.

It owns the engines' runtime records (status.py describes them, escapees.py sweeps for what left
them); the daemon feeds it, the tracker tells it about exits, and the command layer calls its
public methods. Nothing here blocks: the kill is a sequence of phases (kill.py), probes run on the
probe pool.
"""

from __future__ import annotations

import logging
import os
import random
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rollout_watchdog.common.clock import Clock
from rollout_watchdog.common.events import EventLog
from rollout_watchdog.common.server_info import SERVER_INFO_PATH
from rollout_watchdog.common.states import Cause, EngineState, check_transition
from rollout_watchdog.config import EngineConfig, NodeConfig
from rollout_watchdog.watchdog import kill, policy
from rollout_watchdog.watchdog.cgroup import CgroupError, CgroupManager
from rollout_watchdog.watchdog.containment import (
    marker_node,
    marker_prefix,
    marker_value,
    state_tag,
    with_marker,
)
from rollout_watchdog.watchdog.engine import AfterKill, EngineRuntime, Failure, KillJob
from rollout_watchdog.watchdog.engine_env import engine_environment
from rollout_watchdog.watchdog.enginelog import open_engine_output
from rollout_watchdog.watchdog.escapees import EscapeeSweep
from rollout_watchdog.watchdog.gpu import GpuInspector
from rollout_watchdog.watchdog.incarnations import Incarnations
from rollout_watchdog.watchdog.launched import LAUNCHED_FILE, LaunchedSpecs
from rollout_watchdog.watchdog.previous_run import PreviousRun
from rollout_watchdog.watchdog.probe import ProbeResult, ProbeRunner
from rollout_watchdog.watchdog.process import ProcessOps, ProcKey, describe_exit, exit_fields
from rollout_watchdog.watchdog.publish import Publisher
from rollout_watchdog.watchdog.statefile import kernel_boot_id
from rollout_watchdog.watchdog.timers import Timer, due_timer
from rollout_watchdog.watchdog.tracker import ProcessTracker

log = logging.getLogger("rollout_watchdog.watchdog")
S = EngineState
# Timers one engine may fire in one tick; each firing changes what is due, so this is a bound
# against a bug, never reached in practice.
MAX_TIMERS_PER_TICK = 16


class Supervisor:
    def __init__(self, config: NodeConfig, *, publisher: Publisher, events: EventLog,
                 probes: ProbeRunner, tracker: ProcessTracker, ops: ProcessOps, clock: Clock,
                 inspector: GpuInspector | None, rng: random.Random, boot_id: str) -> None:
        self.config = config
        self.node_id = config.node_id
        self.boot_id = boot_id
        self.state_dir = Path(config.state_dir)
        self.state_tag = state_tag(self.state_dir)
        self.marker_node = marker_node(self.node_id, self.state_dir)
        # Set here, not when the daemon starts running: a sweep or a kill before that (an
        # embedded daemon, a test) must not look for escapees with no prefix at all.
        tracker.marker_prefix = marker_prefix(self.marker_node)
        self.engines: dict[str, EngineRuntime] = tracker.engines
        self.publisher = publisher
        self.events = events
        self.previous_run: PreviousRun | None = None   # (the daemon reads it: previous_run.py)
        self.probes = probes
        self.tracker = tracker
        self.ops = ops
        self.clock = clock
        self.rng = rng
        self.inspector = inspector
        self.cgroups: CgroupManager | None = None   # set where a cgroup v2 is delegated
        self.stopping = False          # the daemon is stopping: nothing is launched any more
        self.dirty = True              # the state file is behind
        self.save_now: Any = None      # set by the daemon: saves the state file at once
        self.status_parts: dict[str, Callable[[], Any]] = {}   # status.Reported
        # The incarnations handed out per engine id, kept in the state file, never forgotten
        self.incarnations = Incarnations()
        self.launched = LaunchedSpecs(self.state_dir / LAUNCHED_FILE)   # `launch`ed engines
        self.kernel_boot = kernel_boot_id()[:8]
        self._probe_ids = 0
        self.escapees = EscapeeSweep(self.engines, tracker, ops, publisher)
        self.killing = kill.KillContext(ops, inspector, tracker.live_groups,
                                        self._refresh_for_kill, self._signalled)

    # ------------------------------------------------------------------ events and state

    def emit(self, engine: EngineRuntime | None, kind: str, **fields: Any) -> None:
        self.publisher.emit(engine, kind, **fields)

    def transition(self, engine: EngineRuntime, new: EngineState, cause: Cause,
                   detail: str, **extra: Any) -> None:
        old = engine.state
        check_transition(old, new)
        engine.state = new
        engine.state_since = self.clock.wall()
        if new not in (S.HEALTHY, S.SUSPECT):
            engine.healthy_since = None
        self.emit(engine, "state", from_=str(old), to=str(new), cause=cause, detail=detail,
                  **extra)
        self.dirty = True

    def set_inspector(self, inspector: GpuInspector) -> None:
        self.inspector = inspector
        self.killing.inspector = inspector

    # ------------------------------------------------------------------ timers

    def tick(self, engine: EngineRuntime, now: float) -> None:
        """Fire every timer of the engine that is due at `now`."""
        for _ in range(MAX_TIMERS_PER_TICK):
            timer = due_timer(engine, now)
            if timer is None:
                return
            self._fire(engine, timer, now)

    def _fire(self, engine: EngineRuntime, timer: Timer, now: float) -> None:
        probe = engine.cfg.probe
        if timer == Timer.KILL:
            self.advance_kill(engine, now)
        elif timer == Timer.PAUSE_EXPIRY:
            engine.paused = None
            self.emit(engine, "pause_expired", detail="deep probes resumed")
            self.dirty = True
        elif timer == Timer.BACKOFF:
            self.launch(engine, Cause.BACKOFF_ELAPSED)
        elif timer == Timer.LIVENESS_ONLY:
            # Deep probes off (a multi-node follower answers a dummy /health): liveness only.
            self.become_healthy(engine, "deep probes off: watched by liveness alone")
        elif timer == Timer.STARTUP:
            last = f"; last probe: {engine.last_probe}" if engine.last_probe else ""
            self.fail(engine, Cause.STARTUP_TIMEOUT,
                      f"not healthy {probe.startup_timeout_s:g} s after launch{last}",
                      engine.launched_at + probe.startup_timeout_s)
        elif timer == Timer.PROBE_OVERDUE:
            # The probe's result did not come back in time: judge it failed now; its late
            # result is ignored (the probe id moved on).
            assert engine.probe_started is not None
            self.judge_probe(engine, ProbeResult(
                engine.id, engine.probe_id, False,
                f"no answer within {probe.health_timeout_s:g} s", engine.probe_started, now))
        elif timer == Timer.PROBE_DUE:
            self.start_probe(engine, now)
        elif timer == Timer.STABLE:
            engine.consecutive_failures = 0
            self.dirty = True

    # ------------------------------------------------------------------ launching

    def launch_when_released(self, engine: EngineRuntime, cause: Cause, detail: str) -> None:
        """Launch once the engine's ports and GPUs are free (a first launch too: a copy left
        running by a previous daemon must not answer for the new one)."""
        if not self.release_problems(engine):
            self.launch(engine, cause)
            return
        self.start_kill(engine, cause, detail, AfterKill.RESTART)

    def launch(self, engine: EngineRuntime, cause: Cause) -> None:
        """Start a new incarnation with the same argv, env, ports and GPUs."""
        old = engine.state
        engine.backoff_until = None
        if self.stopping:
            if old != S.STOPPED:
                self.transition(engine, S.STOPPED, Cause.COMMANDED, "daemon stopping")
            return
        engine.new_incarnation(self.next_incarnation(engine.id))
        try:
            popen = self._start_process(engine)
        except (OSError, ValueError, CgroupError) as exc:   # (ValueError: an env or argv no
            why = str(exc) if not isinstance(exc, ValueError) else (   # process can be given)
                f"its command, env or cwd cannot be given to a process: {exc}")
            engine.last_failure = Failure(Cause.LAUNCH_FAILED, why, self.clock.wall())
            self.emit(engine, "launch_failed", cause=Cause.LAUNCH_FAILED, detail=why)
            if old != S.FAILED:
                self.transition(engine, S.FAILED, Cause.LAUNCH_FAILED, why)
            return
        now = self.clock.monotonic()
        engine.popen = popen
        engine.main = self.ops.proc_key(popen.pid) or ProcKey(popen.pid, 0.0)
        engine.procs = {engine.main: True}
        engine.launched_at = now
        self.transition(engine, S.STARTING, cause, f"pid {popen.pid}")
        engine.next_probe = now + policy.probe_interval(engine.state, engine.cfg.probe)
        if self.save_now is not None:
            self.save_now()  # a daemon crash from here on must find this process to adopt
        self.tracker.watch(engine, engine.main)

    def _start_process(self, engine: EngineRuntime) -> subprocess.Popen[bytes]:
        """The engine's process: its environment carries the incarnation's marker, it starts
        in its own cgroup where one is delegated, and its output goes to the engine log."""
        env = engine_environment(os.environ, engine.cfg)
        engine.marker = marker_value(self.marker_node, engine.id, engine.incarnation,
                                     self.boot_id[:12])
        env = with_marker(env, engine.marker)
        command = list(engine.cfg.command)
        if self.cgroups is not None:
            path = self.cgroups.create(engine.id, engine.incarnation, self.boot_id[:12])
            engine.cgroup = str(path)
            command = self.cgroups.command(path, command, env)
        output = open_engine_output(self.config, engine.id)
        try:
            return self.ops.launch(command, env, output, engine.cfg.cwd)
        finally:
            os.close(output)

    def next_incarnation(self, engine_id: str) -> int:
        """The number of a new process of `engine_id`: every launch and registration takes
        it here, so none is ever handed out twice on this node (incarnations.py)."""
        self.dirty = True
        return self.incarnations.next(engine_id)

    def unconfigured_engine(self, engine_id: str, url: str) -> EngineConfig:
        """The spec of an engine the config does not list (external, or removed): the node's
        probe and restart settings, and no command: the daemon never launches it."""
        return EngineConfig(id=engine_id, url=url.rstrip("/"), command=(),
                            probe=self.config.probe, restart=self.config.restart)

    def track(self, engine: EngineRuntime) -> None:
        """Watch the processes of an engine someone else launched (registered)."""
        assert engine.main is not None
        self.tracker.watch(engine, engine.main)
        if engine.state.running:
            self.tracker.refresh([engine])

    def forget(self, engine: EngineRuntime, kind: str, detail: str) -> None:
        self.tracker.unwatch_engine(engine.id)
        del self.engines[engine.id]
        self.emit(engine, kind, detail=detail)
        self.dirty = True

    # ------------------------------------------------------------------ liveness

    def process_gone(self, engine: EngineRuntime, key: ProcKey) -> None:
        """An exit is fatal for the main process and for the processes the engine had when it
        became healthy; later arrivals (compile workers) may come and go."""
        if key not in engine.procs:
            return  # a process of an earlier incarnation
        engine.dead.add(key)
        if engine.kill is not None:  # what a kill waits for: look again at once
            engine.kill.next_check = min(engine.kill.next_check, self.clock.monotonic())
        if key == engine.main:
            if engine.popen is not None:
                engine.returncode = self.ops.peek_exit(key.pid)  # not reaped yet
            if not engine.state.running:  # already being killed: reach its children too
                self.tracker.take_in_group(engine)
        fatal = engine.procs[key]
        if not fatal:
            del engine.procs[key]  # a helper that ended: nothing of it is left to kill
            engine.dead.discard(key)
        if not engine.state.running:
            return
        now = self.clock.monotonic()
        if key == engine.main:
            self.fail(engine, Cause.EXITED,
                      f"main process {key.pid} exited ({describe_exit(engine.returncode)})", now,
                      **exit_fields(engine.returncode))
        elif fatal:
            main = engine.main
            if main is not None and main not in engine.dead and self.ops.has_exited(main):
                # The main process is dying too (its children die with it: PDEATHSIG, a closed
                # pipe): its own exit, seen next, is the cause and says how.
                return
            self.fail(engine, Cause.EXITED, f"process {key.pid} of the engine tree exited", now)

    def _refresh_for_kill(self, engine: EngineRuntime) -> None:
        """Before SIGKILL, and again once every known process is gone: whatever the engine
        forked since, and whatever escaped its tree (a process can no longer fork once its
        parent is dead, so a last look that finds nothing new finds everything)."""
        table = self.ops.process_table()
        alive = engine.main is not None and self.ops.is_alive(engine.main)
        if (alive and self.tracker.refresh([engine], table)) | self.escapees.take_in(table):
            self.dirty = True

    # ------------------------------------------------------------------ deep probes

    def start_probe(self, engine: EngineRuntime, now: float) -> None:
        self._probe_ids += 1
        engine.probe_id = self._probe_ids  # unique across re-registrations
        progress = engine.cfg.probe.progress_path
        # A starting engine's probe also asks its tp_size, so that the "healthy" event's status
        # carries it to the fleet view (engine_info.py reads it later if this read fails).
        info = (engine.cfg.url + SERVER_INFO_PATH
                if engine.state == S.STARTING and engine.tp_size is None else None)
        if not self.probes.submit(engine.id, engine.probe_id,
                                  engine.cfg.url + engine.cfg.probe.health_path,
                                  engine.cfg.probe.health_timeout_s,
                                  engine.cfg.url + progress if progress else None, info):
            engine.next_probe = now + policy.probe_interval(engine.state, engine.cfg.probe)
            return
        engine.probe_started = now
        engine.probes_out.add(engine.probe_id)

    def on_probe_result(self, result: ProbeResult) -> None:
        engine = self.engines.get(result.engine)
        if engine is None:
            return
        engine.probes_out.discard(result.probe_id)
        if result.tp_size is not None and result.probe_id == engine.probe_id:
            engine.server_tp_size = (engine.incarnation, result.tp_size)
        self.judge_probe(engine, result)

    def judge_probe(self, engine: EngineRuntime, result: ProbeResult) -> None:
        if result.probe_id != engine.probe_id or engine.probe_started is None:
            return  # a late answer to a probe already judged, or of an older incarnation
        engine.probe_started = None
        if not engine.state.running:
            return
        engine.last_probe = result.detail
        if engine.state == S.STARTING:
            engine.next_probe = self.clock.monotonic() + policy.probe_interval(
                engine.state, engine.cfg.probe)
            if result.ok:
                self.become_healthy(engine, f"first passing probe ({result.detail})")
            return  # failures while starting are expected; the startup deadline rules
        if result.progress is not None and self.fail_if_stalled(engine, result):
            return
        if not result.ok and engine.main is not None and self.ops.has_exited(engine.main):
            # dying: its sockets are closed before its exit is seen, which names the cause
            engine.next_probe = self.clock.monotonic() + policy.probe_interval(
                engine.state, engine.cfg.probe)
            return
        verdict = policy.judge_probe(result.ok, engine.probe_failures,
                                     engine.cfg.probe.failure_threshold)
        engine.probe_failures = verdict.failures
        if result.ok:
            engine.first_failure_at = None
            if engine.state == S.SUSPECT:
                self.transition(engine, S.HEALTHY, Cause.PROBE_PASSED, result.detail)
        else:
            if engine.first_failure_at is None:
                engine.first_failure_at = result.started
            detail = (f"probe {verdict.failures}/{engine.cfg.probe.failure_threshold} failed: "
                      f"{result.detail}")
            if verdict.declare_failed:
                self.fail(engine, Cause.PROBE_FAILED, detail, engine.first_failure_at)
                return
            if engine.state == S.HEALTHY:
                self.transition(engine, S.SUSPECT, Cause.PROBE_FAILED, detail)
        engine.next_probe = self.clock.monotonic() + policy.probe_interval(
            engine.state, engine.cfg.probe, result.finished - result.started)

    def fail_if_stalled(self, engine: EngineRuntime, result: ProbeResult) -> bool:
        """Fails an engine whose token counter stands still while requests run
        (`policy.judge_progress`), and says so."""
        assert result.progress is not None
        tokens, running = result.progress.tokens, result.progress.running
        verdict = policy.judge_progress(tokens, running, engine.progress_tokens,
                                        engine.progress_since, result.finished,
                                        engine.cfg.probe.progress_timeout_s)
        engine.progress_tokens, engine.progress_since = verdict.tokens, verdict.since
        if verdict.stalled_s is None:
            return False
        self.fail(engine, Cause.STALLED, f"token counter stuck at {tokens:g} for "
                  f"{verdict.stalled_s:.0f} s with {running:g} request(s) running",
                  verdict.since)
        return True

    def become_healthy(self, engine: EngineRuntime, detail: str) -> None:
        """From here on the exit of the engine's own long-lived processes (schedulers,
        detokenizer) is fatal; every other process is only tracked, so that a kill reaches
        it (a short-lived helper that happens to run now must not fail the engine later)."""
        table = self.ops.process_table()
        self.tracker.refresh([engine], table)
        if engine.main is not None:
            started_for = self.clock.since_boot() - engine.main.start_time
            for key in engine.alive_procs():
                stat = table.get(key.pid)
                if stat is not None and stat.key == key and policy.long_lived(
                        stat, engine.main, started_for):
                    engine.procs[key] = True
        engine.healthy_since = self.clock.monotonic()
        self.transition(engine, S.HEALTHY, Cause.PROBE_PASSED, detail)

    # ------------------------------------------------------------------ failure and recovery

    def fail(self, engine: EngineRuntime, cause: Cause, detail: str, evidence_at: float,
             **extra: Any) -> None:
        """Declare the current incarnation failed and start cleaning it up."""
        engine.last_failure = Failure(cause, detail, self.clock.wall())
        detected = round(max(0.0, self.clock.monotonic() - evidence_at), 6)
        self.start_kill(engine, cause, detail, AfterKill.RECOVER, detected_after_s=detected,
                        **extra)

    def start_kill(self, engine: EngineRuntime, cause: Cause, detail: str,
                   after: AfterKill, **extra: Any) -> None:
        now = self.clock.monotonic()
        job = KillJob(cause, detail, after, deadline=now + engine.cfg.restart.grace_s)
        engine.kill = job  # first: whatever fails below, the kill's timer goes on
        if engine.state.running:
            self.transition(engine, S.STOPPING, cause, detail, **extra)
        if engine.main is not None and engine.main in engine.dead:
            self.tracker.take_in_group(engine)
        engine.probe_started = None  # a probe still out is of no interest any more
        engine.backoff_until = None
        self._refresh_for_kill(engine)
        self.dirty = True
        self._kill_outcome(engine, kill.begin(engine, job, self.killing, now))

    def _signalled(self, engine: EngineRuntime, job: KillJob, sig: str, what: str) -> None:
        self.emit(engine, "signal_sent", cause=job.cause, detail=f"{sig} to {what}", signal=sig)

    def advance_kill(self, engine: EngineRuntime, now: float) -> None:
        assert engine.kill is not None
        waiting_for = engine.kill.problems
        outcome = kill.advance(engine, self.killing, now)
        if outcome == kill.Outcome.PENDING and engine.kill.problems != waiting_for:
            self.emit(engine, "release_pending",
                      detail="waiting for " + "; ".join(engine.kill.problems))
        self._kill_outcome(engine, outcome)

    def _kill_outcome(self, engine: EngineRuntime, outcome: kill.Outcome) -> None:
        job = engine.kill
        if outcome == kill.Outcome.PENDING or job is None:
            return
        engine.kill = None
        self.dirty = True
        if engine.returncode is None and engine.popen is not None and engine.main is not None:
            engine.returncode = self.ops.peek_exit(engine.main.pid)   # its exit not taken yet
        if engine.cgroup and outcome != kill.Outcome.UNKILLABLE:
            self.ops.cgroup_remove(Path(engine.cgroup))  # empty now; a sweep retries if not
        if outcome != kill.Outcome.DONE:
            detail = "; ".join(job.problems)
            engine.last_failure = Failure(outcome.cause, detail, self.clock.wall())
            self.transition(engine, S.FAILED, outcome.cause, detail)
        elif job.after == AfterKill.STOP:
            if engine.state != S.STOPPED:  # (a first launch's wait may end in a stop)
                self.transition(engine, S.STOPPED, job.cause,
                                f"{job.detail}; {describe_exit(engine.returncode)}")
            if not engine.cfg.command and not engine.external:  # removed from the config
                self.forget(engine, "removed", "stopped, and " + (
                    "forgotten" if engine.launched else "no longer in the config"))
        elif job.after == AfterKill.RESTART:
            self.launch(engine, job.cause)
        elif engine.external:
            self.transition(engine, S.STOPPED, job.cause,
                            "external engine cleaned up: its restart is left to its owner")
            self.emit(engine, "owner_restart_needed", cause=job.cause, detail=job.detail)
        else:
            self._recover(engine, job.cause)

    def _recover(self, engine: EngineRuntime, cause: Cause) -> None:
        """After a failure: relaunch after the backoff, wait (deferred), or give up (budget)."""
        if self.fail_if_budget_spent(engine, cause):
            return
        engine.consecutive_failures += 1
        if engine.restart_requested:
            self.count_relaunch(engine, cause, self.clock.wall())
            self.launch(engine, Cause.COMMANDED)
            return
        if engine.cfg.restart_policy == "deferred":
            engine.deferred_waiting = True
            self.transition(engine, S.BACKOFF, cause,
                            "deferred: cleaned up, relaunched on `restart` or at the next refit")
            return
        delay = policy.backoff_delay(engine.consecutive_failures, engine.cfg.restart, self.rng)
        engine.backoff_until = self.clock.monotonic() + delay
        self.transition(engine, S.BACKOFF, cause, f"relaunch in {delay:.2f} s")
        self.count_relaunch(engine, cause, self.clock.wall() + delay)
        if delay == 0:
            self.launch(engine, Cause.BACKOFF_ELAPSED)

    def fail_if_budget_spent(self, engine: EngineRuntime, cause: Cause) -> bool:
        """If the restart budget is spent, move the engine to `failed` and say so."""
        restart = engine.cfg.restart
        if not policy.budget_exhausted(engine.relaunch_times, self.clock.wall(), restart):
            return False
        engine.deferred_waiting = False
        self.transition(engine, S.FAILED, cause,
                        f"restart budget exhausted: {restart.max_restarts} relaunch(es) "
                        f"within {restart.window_s:g} s; `reset` to try again")
        return True

    def count_relaunch(self, engine: EngineRuntime, cause: Cause, at: float) -> None:
        """A relaunch after a failure: it uses the restart budget."""
        restart = engine.cfg.restart
        engine.relaunch_times = [t for t in engine.relaunch_times
                                 if at - t < restart.window_s] + [at]
        engine.restarts += 1
        self.emit(engine, "restart_counted", cause=cause,
                  detail=f"relaunch {len(engine.relaunch_times)} of {restart.max_restarts} "
                         f"within {restart.window_s:g} s")

    def probe_in_flight(self, engine_id: str) -> bool:
        """A probe to this engine id is still on the wire (of this runtime or of an earlier
        one under the same id: an engine unregistered and registered again)."""
        return self.probes.in_flight(engine_id)

    def release_problems(self, engine: EngineRuntime) -> list[str]:
        return kill.release_problems(engine, self.inspector, self.ops)
