"""The engine state machine of DESIGN.md: which moves are legal, which are nonsense."""

from __future__ import annotations

import pytest

from rollout_watchdog.common.states import (
    Cause,
    EngineState,
    IllegalTransition,
    check_transition,
)

S = EngineState

# Every move DESIGN.md describes, with the reason it happens.
LEGAL: list[tuple[EngineState, EngineState, str]] = [
    (S.STARTING, S.HEALTHY, "first passing deep probe"),
    (S.STARTING, S.STOPPING, "exited or startup deadline passed while loading"),
    (S.HEALTHY, S.SUSPECT, "first failed probe"),
    (S.SUSPECT, S.HEALTHY, "one passing probe clears suspicion"),
    (S.SUSPECT, S.STOPPING, "failure_threshold consecutive failures"),
    (S.HEALTHY, S.STOPPING, "a process of the tree exited, or stop/restart commanded"),
    (S.STOPPING, S.BACKOFF, "killed and cleaned up; wait before the relaunch"),
    (S.BACKOFF, S.STARTING, "backoff elapsed: relaunch"),
    (S.STOPPING, S.STARTING, "commanded restart relaunches at once"),
    (S.STOPPING, S.FAILED, "unkillable, GPU not released, or budget exhausted"),
    (S.STOPPING, S.STOPPED, "stop commanded"),
    (S.BACKOFF, S.STOPPED, "stop commanded while waiting"),
    (S.BACKOFF, S.FAILED, "the relaunch could not be started"),
    (S.FAILED, S.STARTING, "reset"),
    (S.FAILED, S.STOPPED, "stop commanded"),
    (S.STOPPED, S.STARTING, "launch, or restart commanded"),
    (S.STOPPED, S.FAILED, "the launch itself failed (bad cwd, ...)"),
]

ILLEGAL: list[tuple[EngineState, EngineState]] = [
    (S.HEALTHY, S.BACKOFF),      # must be killed (stopping) first
    (S.SUSPECT, S.BACKOFF),
    (S.HEALTHY, S.FAILED),       # failed only after the kill
    (S.SUSPECT, S.FAILED),
    (S.STARTING, S.FAILED),
    (S.HEALTHY, S.STARTING),     # a restart goes through stopping
    (S.HEALTHY, S.STOPPED),      # a stop goes through stopping
    (S.STARTING, S.SUSPECT),     # failures while starting are the startup deadline's business
    (S.STARTING, S.BACKOFF),
    (S.STOPPED, S.HEALTHY),      # nothing runs: it must start first
    (S.STOPPED, S.SUSPECT),
    (S.STOPPED, S.BACKOFF),
    (S.FAILED, S.HEALTHY),       # needs a reset, then a fresh start
    (S.FAILED, S.SUSPECT),
    (S.FAILED, S.BACKOFF),
    (S.BACKOFF, S.HEALTHY),
    (S.BACKOFF, S.SUSPECT),
    (S.BACKOFF, S.STOPPING),     # nothing to kill
    (S.STOPPING, S.HEALTHY),     # a dying incarnation cannot recover
    (S.STOPPING, S.SUSPECT),
]


@pytest.mark.parametrize(("old", "new", "why"), LEGAL,
                         ids=[f"{a}->{b}" for a, b, _ in LEGAL])
def test_design_transitions_are_accepted(old: EngineState, new: EngineState, why: str) -> None:
    check_transition(old, new)  # raises on an illegal move


@pytest.mark.parametrize(("old", "new"), ILLEGAL, ids=[f"{a}->{b}" for a, b in ILLEGAL])
def test_nonsense_transitions_are_rejected(old: EngineState, new: EngineState) -> None:
    with pytest.raises(IllegalTransition) as info:
        check_transition(old, new)
    assert f"{old.value} -> {new.value}" in str(info.value)


@pytest.mark.parametrize("state", list(EngineState))
def test_a_state_does_not_transition_to_itself(state: EngineState) -> None:
    with pytest.raises(IllegalTransition):
        check_transition(state, state)


def test_the_recovery_cycle_of_design_md_is_walkable() -> None:
    cycle = [S.STARTING, S.HEALTHY, S.SUSPECT, S.HEALTHY, S.SUSPECT, S.STOPPING, S.BACKOFF,
             S.STARTING]
    for old, new in zip(cycle, cycle[1:], strict=False):
        check_transition(old, new)


def test_failed_and_stopped_are_reachable_and_left() -> None:
    into_failed = [s for s in EngineState if _legal(s, S.FAILED)]
    into_stopped = [s for s in EngineState if _legal(s, S.STOPPED)]
    assert S.STOPPING in into_failed and S.STOPPING in into_stopped
    # Leaving failed or stopped always means a fresh start (reset / restart), never health.
    assert [s for s in EngineState if _legal(S.FAILED, s)] == [S.STARTING, S.STOPPED]
    assert [s for s in EngineState if _legal(S.STOPPED, s)] == [S.STARTING, S.FAILED]


def test_illegal_transition_is_a_runtime_error() -> None:
    assert issubclass(IllegalTransition, RuntimeError)


def test_running_means_processes_are_expected_alive() -> None:
    assert {s for s in EngineState if s.running} == {S.STARTING, S.HEALTHY, S.SUSPECT}
    for state in (S.STOPPING, S.BACKOFF, S.FAILED, S.STOPPED):
        assert not state.running


def test_states_and_causes_print_as_their_wire_names() -> None:
    # status --json and events --json carry these strings.
    assert [str(s) for s in EngineState] == [
        "starting", "healthy", "suspect", "stopping", "backoff", "failed", "stopped"]
    assert EngineState("suspect") is S.SUSPECT
    assert S.HEALTHY == "healthy"
    for name in ("exited", "probe_failed", "startup_timeout", "stalled", "commanded",
                 "unkillable", "gpu_not_released"):
        assert str(Cause(name)) == name


def _legal(old: EngineState, new: EngineState) -> bool:
    try:
        check_transition(old, new)
    except IllegalTransition:
        return False
    return True
