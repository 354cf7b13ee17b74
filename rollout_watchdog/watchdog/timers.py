"""An engine's timers: one function says which are set and when they fire. The loop's sleep
(the earliest of them) and the firing (every one that is due) both come from it, so they cannot
drift apart."""

from __future__ import annotations

from enum import Enum

from rollout_watchdog.common.states import EngineState
from rollout_watchdog.watchdog.engine import EngineRuntime

# A probe whose result has not come back this long after its own deadline is judged failed
# without it (the probe runner ends every probe at its deadline; this is the safety net).
PROBE_SLACK_S = 1.0


class Timer(str, Enum):
    """In firing order, when several are due at once."""

    KILL = "kill"                     # the current kill phase's deadline, or a release check
    PAUSE_EXPIRY = "pause_expiry"
    BACKOFF = "backoff"               # relaunch
    LIVENESS_ONLY = "liveness_only"   # deep probes off: healthy as soon as it runs
    STARTUP = "startup"               # the startup deadline
    PROBE_OVERDUE = "probe_overdue"   # a probe past its deadline and slack: judged failed
    PROBE_DUE = "probe_due"           # time for the next probe
    STABLE = "stable"                 # healthy long enough: the backoff starts over


def engine_timers(engine: EngineRuntime) -> list[tuple[Timer, float]]:
    """Every timer of the engine that is set, with its monotonic firing time, in firing order.
    A kill in progress holds every other timer."""
    if engine.kill is not None:
        job = engine.kill
        return [(Timer.KILL, job.next_check)]
    probe, restart = engine.cfg.probe, engine.cfg.restart
    timers: list[tuple[Timer, float]] = []
    if engine.paused is not None:
        timers.append((Timer.PAUSE_EXPIRY, engine.paused.expires))
    if engine.state == EngineState.BACKOFF and engine.backoff_until is not None:
        timers.append((Timer.BACKOFF, engine.backoff_until))
    if not engine.state.running:
        return timers
    starting = engine.state == EngineState.STARTING
    if starting and not probe.health_path:
        timers.append((Timer.LIVENESS_ONLY, engine.launched_at))
    if starting:
        timers.append((Timer.STARTUP, engine.launched_at + probe.startup_timeout_s))
    if engine.probe_started is not None:
        timers.append((Timer.PROBE_OVERDUE,
                       engine.probe_started + probe.health_timeout_s + PROBE_SLACK_S))
    elif engine.probing and not engine.probes_out:  # one probe per engine on the wire
        timers.append((Timer.PROBE_DUE, engine.next_probe))
    if (engine.state == EngineState.HEALTHY and engine.consecutive_failures
            and engine.healthy_since is not None):
        timers.append((Timer.STABLE, engine.healthy_since + restart.stable_s))
    return timers


def due_timer(engine: EngineRuntime, now: float) -> Timer | None:
    """The first timer of the engine that is due now, in firing order."""
    return next((timer for timer, at in engine_timers(engine) if at <= now), None)


def next_deadline(engine: EngineRuntime) -> float | None:
    return min((at for _, at in engine_timers(engine)), default=None)
