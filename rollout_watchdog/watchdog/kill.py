"""The bounded kill of one engine incarnation, and the checks before it may be relaunched.

SIGCONT+SIGTERM to the engine's process group, the grace period, then SIGKILL to the group and
to every process ever seen in the engine's tree (orphans that moved to their own session
included), a bounded wait for them to vanish, and finally: the engine's ports are bindable and
its GPUs show no compute process. Each step is a phase of the engine's `KillJob`, advanced by
the daemon's loop; nothing here waits. The daemon decides what the outcome leads to.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from rollout_watchdog.watchdog.engine import AfterKill, EngineRuntime, KillJob, KillPhase
from rollout_watchdog.watchdog.gpu import GpuInspector, gpu_holders
from rollout_watchdog.watchdog.metrics import Metrics
from rollout_watchdog.watchdog.process import (
    is_alive,
    port_bindable,
    process_group,
    signal_group,
    signal_proc,
)
from rollout_watchdog.watchdog.states import Cause

log = logging.getLogger(__name__)
RELEASE_CHECK_INTERVAL_S = 0.05


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

    metrics: Metrics
    inspector: GpuInspector | None
    live_groups: Callable[[], set[int]]     # groups with a live member, cached per loop turn
    refresh_tree: Callable[[EngineRuntime], None]   # find processes born since the last sweep


def engine_group(engine: EngineRuntime) -> int | None:
    """The engine's process group, only while it verifiably is the engine's: one of the
    engine's live processes is in it. A recorded pid may belong to someone else by now (pid
    reuse, a reboot), and its group must never be signalled."""
    if engine.main is None:
        return None
    pgid = engine.main.pid
    for key in engine.alive_procs():
        if process_group(key) == pgid:
            return pgid
    return None


def begin(engine: EngineRuntime, job: KillJob, ctx: KillContext, now: float) -> Outcome:
    engine.kill = job
    if engine.cfg.restart.grace_s > 0 and any_alive(engine):
        group = engine_group(engine)
        if group is not None:
            signal_group(group, signal.SIGCONT)
            signal_group(group, signal.SIGTERM)
        for key in engine.alive_procs():  # those outside the group (external engines)
            if process_group(key) != group:
                signal_proc(key, signal.SIGCONT)
                signal_proc(key, signal.SIGTERM)
        ctx.metrics.kill(engine.id, str(job.cause), "SIGTERM")
    return advance(engine, ctx, now)


def any_alive(engine: EngineRuntime) -> bool:
    return any(is_alive(k) for k in engine.alive_procs())


def _group_done(engine: EngineRuntime, ctx: KillContext) -> bool:
    """The graceful part is over: no live process left in the engine's group (processes that
    left the group, orphans, are not waited for: they get SIGKILL at once)."""
    if engine.main is not None and is_alive(engine.main):
        return False
    group = engine_group(engine)
    return group is None or group not in ctx.live_groups()


def advance(engine: EngineRuntime, ctx: KillContext, now: float) -> Outcome:
    job = engine.kill
    assert job is not None
    if job.phase == KillPhase.TERM:
        if not (now >= job.deadline or _group_done(engine, ctx)):
            return Outcome.PENDING
        job.phase = KillPhase.KILL
        job.deadline = now + engine.cfg.restart.kill_timeout_s
        if engine.main is not None and is_alive(engine.main):
            ctx.refresh_tree(engine)
        if any_alive(engine) or engine_group(engine) is not None:
            _sigkill_all(engine, job, ctx)
    if job.phase == KillPhase.KILL:
        if any_alive(engine):
            if now >= job.deadline:
                job.problems = [f"still alive {engine.cfg.restart.kill_timeout_s:g} s after "
                                "SIGKILL: " + ", ".join(str(k.pid) for k in engine.alive_procs()
                                                        if is_alive(k))]
                return Outcome.UNKILLABLE
            _sigkill_all(engine, job, ctx, quiet=True)  # processes forked meanwhile
            return Outcome.PENDING
        if engine.popen is not None:
            engine.returncode = engine.popen.poll()  # reaps it, if nothing did yet
        if job.after == AfterKill.STOP or not engine.cfg.command:
            return Outcome.DONE  # nothing will be relaunched here: no resources to wait for
        job.phase = KillPhase.RELEASE
        job.deadline = now + engine.cfg.restart.release_timeout_s
        job.next_check = now
    if job.phase == KillPhase.RELEASE and now >= job.next_check:
        problems = release_problems(engine, ctx.inspector)
        if not problems:
            return Outcome.DONE
        if problems != job.problems:
            log.info("waiting for release: %s", "; ".join(problems), extra={"engine": engine.id})
        job.problems = problems
        if now >= job.deadline:
            return (Outcome.GPU_NOT_RELEASED if any("GPU" in p for p in problems)
                    else Outcome.PORT_NOT_RELEASED)
        job.next_check = now + RELEASE_CHECK_INTERVAL_S
    return Outcome.PENDING


def _sigkill_all(engine: EngineRuntime, job: KillJob, ctx: KillContext,
                 quiet: bool = False) -> None:
    """SIGKILL to the group and to every process ever seen in the tree."""
    group = engine_group(engine)
    if group is not None:
        signal_group(group, signal.SIGKILL)
    sent = [k.pid for k in engine.alive_procs() if signal_proc(k, signal.SIGKILL)]
    if not quiet:
        ctx.metrics.kill(engine.id, str(job.cause), "SIGKILL")
        log.info("SIGKILL to group %s and pids %s", group, sent, extra={"engine": engine.id})


def release_problems(engine: EngineRuntime, inspector: GpuInspector | None) -> list[str]:
    """What still blocks a relaunch: ports in use, GPU compute processes."""
    problems = [f"port {p} is still in use" for p in engine.cfg.ports if not port_bindable(p)]
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
