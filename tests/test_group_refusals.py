"""WeightUpdateGroup's failure path, driven with stand-in calls (no engines, no collective):
members that answered "no" leave the others time to end their calls before the group is torn
down; a member that gave no answer at all has it torn down at once."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

import pytest

from rollout_watchdog.emulator.testing import free_port
from rollout_watchdog.refit_bridge.engine_calls import EngineCallError
from rollout_watchdog.refit_bridge.group import REFUSAL_WAIT_S, WeightUpdateGroup
from rollout_watchdog.refit_bridge.group_member import (
    GroupAborted,
    GroupMember,
    GroupMemberFailed,
)

WHAT = "update_weights_from_distributed"
MEMBERS = [GroupMember("node0", f"e{i}", 1, f"http://127.0.0.1:{30000 + i}", 1)
           for i in range(3)]


@pytest.fixture
def group() -> Iterator[WeightUpdateGroup]:
    made = WeightUpdateGroup(MEMBERS, master_address="127.0.0.1", master_port=free_port(),
                             backend="gloo", http_timeout_s=5.0, init_timeout_s=30.0)
    yield made
    made.calls.release()


def torn_down_with(group: WeightUpdateGroup, calls: dict[GroupMember, Future[Any]],
                   monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many calls had ended at each teardown of the group (its sockets are not touched)."""
    ended: list[int] = []
    monkeypatch.setattr(group, "_teardown_group", lambda: ended.append(
        sum(f.done() for f in calls.values())))
    return ended


def test_members_that_refuse_leave_the_others_time_before_the_teardown(
        group: WeightUpdateGroup, monkeypatch: pytest.MonkeyPatch) -> None:
    """One member refuses the update (a shape it does not have) while the other two are still
    taking the data, and they refuse 0.3 and 0.6 s later: before, the group was torn down at
    the first refusal and cut them off mid-collective (a suite run: one came out wedged, and
    was restarted). Now the teardown waits for them, and every member's refusal is named."""
    calls: dict[GroupMember, Future[Any]] = {m: Future() for m in MEMBERS}
    ended_at_teardown = torn_down_with(group, calls, monkeypatch)
    refusal = EngineCallError("HTTP 400: shape mismatch for embed_tokens.weight", answered=True)

    def refuse(member: GroupMember) -> None:
        calls[member].set_exception(refusal)
        group._wake.set()
    calls[MEMBERS[0]].set_exception(refusal)
    later = [threading.Timer(0.3, refuse, (MEMBERS[1],)),
             threading.Timer(0.6, refuse, (MEMBERS[2],))]
    for timer in later:
        timer.start()
    with pytest.raises(GroupMemberFailed) as failed:
        group._fail(calls, [], WHAT)
    assert ended_at_teardown == [3]
    assert sorted(failed.value.refused) == [("node0", m.engine, 1) for m in MEMBERS]


def test_a_member_that_gave_no_answer_has_the_group_torn_down_at_once(
        group: WeightUpdateGroup, monkeypatch: pytest.MonkeyPatch) -> None:
    """A member gone (its call got no HTTP answer) leaves the others blocked in the collective:
    the group is torn down without waiting for them."""
    calls: dict[GroupMember, Future[Any]] = {m: Future() for m in MEMBERS}
    ended_at_teardown = torn_down_with(group, calls, monkeypatch)
    calls[MEMBERS[0]].set_exception(EngineCallError("connection refused", answered=False))
    with pytest.raises(GroupMemberFailed) as failed:
        group._fail(calls, [], WHAT)
    assert ended_at_teardown == [1]
    assert failed.value.gone == [MEMBERS[0]]


def test_an_abort_during_the_wait_after_a_refusal_judges_no_one_gone(
        group: WeightUpdateGroup, monkeypatch: pytest.MonkeyPatch) -> None:
    """The refit's guard aborts the group (its deadline) while the others still take the data:
    abort()'s release() ends their calls with no HTTP answer (stand-ins here), which is no sign
    that their engines are gone. Before, they came out `gone` (lost: EngineLost for healthy
    engines, not the deadline's RefitTimeout); now the abort's own error."""
    calls: dict[GroupMember, Future[Any]] = {m: Future() for m in MEMBERS}
    torn_down_with(group, calls, monkeypatch)
    calls[MEMBERS[0]].set_exception(
        EngineCallError("HTTP 400: shape mismatch for embed_tokens.weight", answered=True))

    def guard() -> None:   # Refit._abort_group at the deadline
        if not group.aborted:
            group.abort("the refit's deadline of 10 s passed")
            for m in MEMBERS[1:]:   # as release() ends them: RemoteDisconnected
                calls[m].set_exception(EngineCallError("no answer", answered=False))
    timer = threading.Timer(0.3, guard)
    timer.start()
    with pytest.raises(GroupAborted) as aborted:
        group._fail(calls, [], WHAT)
    timer.join()
    assert "deadline" in aborted.value.reason


def test_a_refused_rendezvous_is_torn_down_at_once(
        group: WeightUpdateGroup, monkeypatch: pytest.MonkeyPatch) -> None:
    """The others cannot complete init_weights_update_group without the member that refused
    it: waiting for them is pure delay (past a short refit's deadline: RefitTimeout, not
    UpdateRefused)."""
    calls: dict[GroupMember, Future[Any]] = {m: Future() for m in MEMBERS}
    ended_at_teardown = torn_down_with(group, calls, monkeypatch)
    calls[MEMBERS[0]].set_exception(EngineCallError("HTTP 400: group exists", answered=True))
    started = time.monotonic()
    with pytest.raises(GroupMemberFailed) as failed:
        group._fail(calls, [], "init_weights_update_group")
    assert ended_at_teardown == [1]
    assert time.monotonic() - started < REFUSAL_WAIT_S   # (FAILURE_GRACE_S: 2 s)
    assert list(failed.value.refused) == [("node0", "e0", 1)]
