"""Every error the fleet API raises survives pickling whole: Ray hands a trainer actor's error
to the driver that way (`ray.get`), as multiprocessing does; before, EngineLost and
UpdateRefused reached a Ray driver as Ray's UnserializableException."""

from __future__ import annotations

import pickle

import pytest

import rollout_watchdog
from rollout_watchdog.common.errors import RolloutWatchdogError
from rollout_watchdog.refit_bridge.engine_calls import EngineCallError
from rollout_watchdog.refit_bridge.group_member import (
    GroupAborted,
    GroupMember,
    GroupMemberFailed,
)
from rollout_watchdog.refit_bridge.router import RouterError

LOST = [("node0", "e0", 3), ("node1", "e1", 1)]
ERRORS = [
    rollout_watchdog.EngineLost(LOST, "wedged in update_weights_from_distributed"),
    rollout_watchdog.UpdateRefused({("node0", "e0", 3): "HTTP 400: no 'l1.weight'"}, "v7"),
    rollout_watchdog.CommandRefused("refit lock is held", {"n": {"status": "error"}}, ["m"],
                                    code="lock_held", result={"holder": "x"}),
    rollout_watchdog.NoMembers("no engine to update"),
    rollout_watchdog.LeaseLost("lease lost: expired"),
    rollout_watchdog.RefitTimeout("refit past its timeout_s"),
    rollout_watchdog.CoordinatorUnavailable("no answer within 5 s"),
]


def test_the_contract_lists_every_error_here() -> None:
    exported = {name for name in rollout_watchdog.__all__
                if isinstance(getattr(rollout_watchdog, name), type)
                and issubclass(getattr(rollout_watchdog, name), RolloutWatchdogError)}
    assert exported == {type(e).__name__ for e in ERRORS} | {"RolloutWatchdogError"}


@pytest.mark.parametrize("error", ERRORS, ids=lambda e: type(e).__name__)
def test_an_error_of_the_contract_pickles_whole(error: RolloutWatchdogError) -> None:
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is type(error) and str(again) == str(error)
    assert again.args == error.args and vars(again) == vars(error)


def test_the_internal_errors_pickle_too() -> None:
    member = GroupMember("node0", "e0", 3, "http://127.0.0.1:30000", 1)
    for error in (GroupMemberFailed([member], "HTTP 400", refused={member: "HTTP 400"}),
                  GroupAborted("deadline", [member]),
                  RouterError("http://127.0.0.1:29000", "add", "refused", refused=True),
                  EngineCallError("POST /x: HTTP 500", answered=True)):
        again = pickle.loads(pickle.dumps(error))
        assert type(again) is type(error) and str(again) == str(error)
        assert vars(again) == vars(error)
