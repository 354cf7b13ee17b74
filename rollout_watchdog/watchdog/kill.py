"""The bounded kill of one engine incarnation, and the checks before it may be relaunched.

SIGCONT+SIGTERM to the engine's process group, the grace period, then SIGKILL to the group and
to every process ever seen in the engine's tree (orphans that moved to their own session
included), a bounded wait for them to vanish, and finally: the engine's ports are bindable and
its GPUs show no compute process. Each step is a phase of the engine's `KillJob`, advanced by
the daemon's loop; nothing here waits. The supervisor decides what the outcome leads to.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from rollout_watchdog.common.states import Cause
from rollout_watchdog.watchdog.engine import AfterKill, EngineRuntime, KillJob, KillPhase
from rollout_watchdog.watchdog.gpu import GpuInspector, gpu_holders
from rollout_watchdog.watchdog.process import ProcessOps

log = logging.getLogger(__name__)
# How often a kill in progress looks again: are the processes gone, are ports and GPUs free.
CHECK_INTERVAL_S = 0.05


class Outcome(str, Enum):
    PENDING = "pending"
    DONE = "done"                      # processes gone, resources free (or not needed)
    UNKILLABLE = "unkillable"
    GPU_NOT_RELEASED = "gpu_not_released"
    PORT_NOT_RELEASED = "port_not_released"

    @property
    def cause(self) -> Cause:
        return Cause(self.value)


@dataclass
class KillContext:
    """What a kill needs from the daemon."""

    ops: ProcessOps
    inspector: GpuInspector | None
    live_groups: Callable[[], set[int]]     # groups with a live member, cached per loop turn
    refresh_tree: Callable[[EngineRuntime], None]   # find processes born since the last look
    signalled: Callable[[EngineRuntime, KillJob, str, str], None]   # (engine, job, sig, what)


def engine_group(engine: EngineRuntime, ops: ProcessOps) -> int | None:
    """The engine's process group, only while it verifiably is the engine's: one of the
    engine's live processes is in it. A recorded pid may belong to someone else by now (pid
    reuse, a reboot), and its group must never be signalled."""
    if engine.main is None:
        return None
    pgid = engine.main.pid
    for key in engine.alive_procs():
        if ops.process_group(key) == pgid:
            return pgid
    return None


def begin(engine: EngineRuntime, job: KillJob, ctx: KillContext, now: float) -> Outcome:
    engine.kill = job
    ops = ctx.ops
    if engine.cfg.restart.grace_s > 0 and any_alive(engine, ops):
        group = engine_group(engine, ops)
        if group is not None:
            ops.signal_group(group, signal.SIGCONT)
            ops.signal_group(group, signal.SIGTERM)
        outside = [k.pid for k in engine.alive_procs()  # outside the group (external engines)
                   if ops.process_group(k) != group
                   and ops.signal_proc(k, signal.SIGCONT) and ops.signal_proc(k, signal.SIGTERM)]
        ctx.signalled(engine, job, "SIGTERM", _targets(group, outside))
    return advance(engine, ctx, now)


def _targets(group: int | None, pids: list[int]) -> str:
    parts = ([f"group {group}"] if group is not None else []) + ([f"pids {pids}"] if pids else [])
    return " and ".join(parts) or "nothing left to signal"


def any_alive(engine: EngineRuntime, ops: ProcessOps) -> bool:
    """A process of the engine is left: one we know, or any in its cgroup (where it has one,
    the kernel's own answer: nothing escapes a cgroup)."""
    if engine.cgroup and ops.cgroup_populated(Path(engine.cgroup)):
        return True
    return any(ops.is_alive(k) for k in engine.alive_procs())


def _group_done(engine: EngineRuntime, ctx: KillContext) -> bool:
    """The graceful part is over: no live process left in the engine's group (processes that
    left the group, orphans, are not waited for: they get SIGKILL at once)."""
    if engine.main is not None and ctx.ops.is_alive(engine.main):
        return False
    group = engine_group(engine, ctx.ops)
    return group is None or group not in ctx.live_groups()


def advance(engine: EngineRuntime, ctx: KillContext, now: float) -> Outcome:
    job = engine.kill
    assert job is not None
    ops = ctx.ops
    if job.phase == KillPhase.TERM:
        if not (now >= job.deadline or _group_done(engine, ctx)):
            return _again(job, now)
        job.phase = KillPhase.KILL
        job.deadline = now + engine.cfg.restart.kill_timeout_s
        ctx.refresh_tree(engine)
        if any_alive(engine, ops) or engine_group(engine, ops) is not None:
            _sigkill_all(engine, job, ctx)
    if job.phase == KillPhase.KILL:
        if not any_alive(engine, ops):
            ctx.refresh_tree(engine)  # an escaped process found only now is killed too
        if any_alive(engine, ops):
            if now >= job.deadline:
                left = [str(k.pid) for k in engine.alive_procs() if ops.is_alive(k)]
                job.problems = [f"still alive {engine.cfg.restart.kill_timeout_s:g} s after "
                                "SIGKILL: " + (", ".join(left) or f"cgroup {engine.cgroup}")]
                return Outcome.UNKILLABLE
            _sigkill_all(engine, job, ctx, quiet=True)  # processes forked meanwhile
            return _again(job, now)
        if engine.popen is not None:
            engine.returncode = engine.popen.poll()  # reaps it, if nothing did yet
            if engine.returncode is None and now < job.deadline:
                # A zombie leader whose other threads still exit (the kernel holds a thread
                # group's exit until its last thread is gone; 6 ms measured): its status names
                # the cause, so the kill waits for it, a check interval as a rule.
                return _again(job, now)
        job.phase = KillPhase.RELEASE
        job.deadline = now + engine.cfg.restart.release_timeout_s
        job.next_check = now
    if job.phase == KillPhase.RELEASE and (job.after == AfterKill.STOP
                                           or not engine.cfg.command):
        return Outcome.DONE  # nothing will be relaunched here (a stop may come meanwhile)
    if job.phase == KillPhase.RELEASE and now >= job.next_check:
        problems = release_problems(engine, ctx.inspector, ops)
        if not problems:
            return Outcome.DONE
        if problems != job.problems:
            log.info("waiting for release: %s", "; ".join(problems), extra={"engine": engine.id})
        job.problems = problems
        if now >= job.deadline:
            return (Outcome.GPU_NOT_RELEASED if any("GPU" in p for p in problems)
                    else Outcome.PORT_NOT_RELEASED)
    return _again(job, now)


def _again(job: KillJob, now: float) -> Outcome:
    """Pending: the next look comes after CHECK_INTERVAL_S, or at the phase's deadline."""
    job.next_check = min(now + CHECK_INTERVAL_S, job.deadline)
    return Outcome.PENDING


def _sigkill_all(engine: EngineRuntime, job: KillJob, ctx: KillContext,
                 quiet: bool = False) -> None:
    """SIGKILL to the group and to every process ever seen in the tree."""
    ops = ctx.ops
    group = engine_group(engine, ops)
    if engine.cgroup:
        ops.cgroup_kill(Path(engine.cgroup))
    if group is not None:
        ops.signal_group(group, signal.SIGKILL)
    sent = [k.pid for k in engine.alive_procs() if ops.signal_proc(k, signal.SIGKILL)]
    if not quiet:
        ctx.signalled(engine, job, "SIGKILL", _targets(group, sent))


def release_problems(engine: EngineRuntime, inspector: GpuInspector | None,
                     ops: ProcessOps) -> list[str]:
    """What still blocks a relaunch: ports in use, GPU compute processes."""
    problems = [f"port {p} is still in use" for p in engine.cfg.ports
                if not ops.port_bindable(p)]
    if engine.cfg.gpus and inspector is not None:
        try:
            holders = gpu_holders(inspector, engine.cfg.gpus, {k.pid for k in engine.procs},
                                  shared=engine.cfg.restart_policy == "deferred")
        except Exception as exc:  # an NVML error must not kill the loop
            holders = {}
            log.warning("GPU check failed: %s", exc, extra={"engine": engine.id})
        problems += [f"GPU {gpu} still has compute process(es) {sorted(pids)}"
                     for gpu, pids in holders.items()]
    return problems
