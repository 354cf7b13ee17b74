"""Engine states, failure causes and the transitions allowed between states.

Pure data: the daemon asks `check_transition` before every change, so an impossible move is a
loud bug instead of a silently wrong status.
"""

from __future__ import annotations

from enum import Enum


class EngineState(str, Enum):
    STARTING = "starting"
    HEALTHY = "healthy"
    SUSPECT = "suspect"
    STOPPING = "stopping"
    BACKOFF = "backoff"
    FAILED = "failed"
    STOPPED = "stopped"

    def __str__(self) -> str:
        return self.value

    @property
    def running(self) -> bool:
        """The engine's processes are expected to be alive (and watched)."""
        return self in (EngineState.STARTING, EngineState.HEALTHY, EngineState.SUSPECT)


class Cause(str, Enum):
    """Why a state changed. Failure causes first, then the causes of ordinary progress."""

    EXITED = "exited"
    PROBE_FAILED = "probe_failed"
    STARTUP_TIMEOUT = "startup_timeout"
    STALLED = "stalled"
    COMMANDED = "commanded"
    UNKILLABLE = "unkillable"
    GPU_NOT_RELEASED = "gpu_not_released"
    PORT_NOT_RELEASED = "port_not_released"
    LAUNCH_FAILED = "launch_failed"
    REFIT_WEDGED = "refit_wedged"    # stuck in a refit's collective (the coordinator says)
    LAUNCHED = "launched"
    PROBE_PASSED = "probe_passed"
    BACKOFF_ELAPSED = "backoff_elapsed"
    RESET = "reset"

    def __str__(self) -> str:
        return self.value


S = EngineState
ALLOWED: frozenset[tuple[EngineState, EngineState]] = frozenset({
    (S.STARTING, S.HEALTHY), (S.STARTING, S.STOPPING),
    (S.HEALTHY, S.SUSPECT), (S.HEALTHY, S.STOPPING),
    (S.SUSPECT, S.HEALTHY), (S.SUSPECT, S.STOPPING),
    (S.STOPPING, S.BACKOFF), (S.STOPPING, S.STARTING), (S.STOPPING, S.FAILED),
    (S.STOPPING, S.STOPPED),
    (S.BACKOFF, S.STARTING), (S.BACKOFF, S.STOPPED), (S.BACKOFF, S.FAILED),
    (S.FAILED, S.STARTING), (S.FAILED, S.STOPPED),
    (S.STOPPED, S.STARTING), (S.STOPPED, S.FAILED),  # FAILED: the launch itself failed
})


class IllegalTransition(RuntimeError):
    pass


def check_transition(old: EngineState, new: EngineState) -> None:
    if (old, new) not in ALLOWED:
        raise IllegalTransition(f"{old} -> {new} is not a transition of the engine state machine")
