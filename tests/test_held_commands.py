"""Commands a restarted coordinator holds back until the nodes they need are back
(refit_bridge/held.py), driven on a real `Coordinator` with its clock, no thread, no socket:
their order, their bounds, and the coordinator's loop kept free."""

from __future__ import annotations

import pytest

from rollout_watchdog.common import protocol
from rollout_watchdog.refit_bridge import coordinator as coordinator_module
from rollout_watchdog.refit_bridge import held as held_module
from rollout_watchdog.refit_bridge.coordinator import Coordinator


def test_held_commands_go_in_order_once_the_view_is_whole_or_half_their_time_is_gone() -> None:
    """A restarted coordinator's held commands keep their order (a resume queued behind its
    pause does not overtake it) and none is held past half its own time."""
    coord = Coordinator(bind="tcp://127.0.0.1:0", node_timeout_s=30.0)   # driven here
    coord.view.expected |= {"n1", "n2"}
    now = coord._started_at = 1000.0
    coord.view.hello(protocol.Hello("n1", "b1", [], 0), "n1", now, 0.0)
    done: list[str] = []
    coord._dispatch = lambda client, cmd, at: done.append(cmd.request_id)   # type: ignore
    coord.command(b"c", protocol.Command("pause", "pause", {"all": True}, None, None, 8.0), now)
    coord.command(b"c", protocol.Command("resume", "resume", {}, "n1", "e0", 8.0), now)
    coord.command(b"c", protocol.Command("ping", "ping", {}), now)
    assert done == ["ping"]                       # a query is not held
    coord.sweep(now + 1.0)
    assert done == ["ping"]
    coord.view.hello(protocol.Hello("n2", "b2", [], 0), "n2", now + 2.0, 0.0)
    coord.sweep(now + 2.0)
    assert done == ["ping", "pause", "resume"]    # in the order they came
    coord.view.expected.add("n3")                 # one that never comes back
    coord.command(b"c", protocol.Command("p2", "pause", {"all": True}, None, None, 4.0),
                  now + 3.0)
    coord.sweep(now + 4.9)
    assert done[-1] == "resume"
    coord.sweep(now + 5.0)                        # half its 4 s gone: handled as things are
    assert done[-1] == "p2"


def test_without_a_journal_only_commands_for_a_node_not_heard_from_wait() -> None:
    """No state dir: which nodes come back is unknown. A command for a node not heard from
    since the start waits for it (one retried across a restart was refused as "unknown node");
    one for another node is not held up behind it, one that may reach it is."""
    coord = Coordinator(bind="tcp://127.0.0.1:0", node_timeout_s=30.0)   # driven here
    now = coord._started_at = 1000.0
    coord.view.hello(protocol.Hello("n1", "b1", [], 0), "n1", now, 0.0)
    done: list[str] = []
    coord._dispatch = lambda client, cmd, at: done.append(cmd.request_id)   # type: ignore
    for request, cmd, node in [("p2", "pause", "n2"), ("r1", "restart", "n1"),
                               ("all", "resume", None), ("s2", "status", "n2"),
                               ("ping", "ping", None), ("acq", "refit_acquire", None)]:
        coord.command(b"c", protocol.Command(request, cmd, {}, node, node and "e0", 20.0), now)
    assert done == ["r1", "ping", "acq"]          # n2's wait for it; the fleet's behind them
    coord.view.hello(protocol.Hello("n2", "b2", [], 0), "n2", now + 1.0, 0.0)
    coord.sweep(now + 1.0)
    assert done == ["r1", "ping", "acq", "p2", "all", "s2"]
    coord.command(b"c", protocol.Command("p3", "pause", {}, "n3", "e0", 100.0), now + 2.0)
    coord.sweep(now + 29.9)
    assert done[-1] == "s2"
    coord.sweep(now + 30.0)                       # a node timeout from the start: n3 unknown
    assert done[-1] == "p3"


def driven_coordinator(expected: set[str], back: list[str]
                       ) -> tuple[Coordinator, float, list[str], list[protocol.Reply]]:
    """A coordinator driven here (no thread, socket), restarted `now` with a journal naming
    `expected`, the nodes `back` said hello: (it, now, the request ids it ran, its replies)."""
    coord = Coordinator(bind="tcp://127.0.0.1:0", node_timeout_s=30.0)
    coord.view.expected |= expected
    now = coord._started_at = 1000.0
    for node in back:
        coord.view.hello(protocol.Hello(node, f"b-{node}", [], 0), node, now, 0.0)
    done: list[str] = []
    replies: list[protocol.Reply] = []
    coord._dispatch = lambda client, cmd, at: done.append(cmd.request_id)   # type: ignore
    coord.reply = lambda client, reply: replies.append(reply)   # type: ignore[method-assign]
    return coord, now, done, replies


def test_a_command_queued_past_half_its_time_is_refused_and_never_runs_later() -> None:
    """Another client's command for a node not back held a fleet-wide pause queued behind it
    past the pause's own time: its caller gave up, and both nodes were paused 3 s later (the
    hostile run). Now it is refused (BUSY) at half its time, and never runs."""
    coord, now, done, replies = driven_coordinator(set(), ["n1"])   # no journal
    coord.command(b"a", protocol.Command("ghost", "restart", {}, "n9", "e0", 100.0), now)
    coord.command(b"b", protocol.Command("other", "restart", {}, "n1", "e0", 4.0), now)
    coord.command(b"b", protocol.Command("pause", "pause", {"all": True}, None, None, 4.0), now)
    assert done == ["other"] and coord.held_back == 2   # another node's goes on
    coord.sweep(now + 1.9)
    assert done == ["other"] and replies == []
    coord.sweep(now + 2.0)   # half the pause's 4 s
    assert [(r.request_id, r.code) for r in replies] == [("pause", "BUSY")]
    coord.sweep(now + 30.0)  # a node timeout from the start: the ghost's turn
    assert done == ["other", "ghost"] and coord.held_back == 0


def test_past_max_held_a_command_is_refused_not_run_ahead_of_those_held(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Past MAX_HELD a command was run at once: a resume overtook its held pause (the hostile
    run, with 9,999 held queries). Now it is refused (BUSY)."""
    monkeypatch.setattr(held_module, "MAX_HELD", 2)
    coord, now, done, replies = driven_coordinator({"n1", "n2"}, ["n1"])
    coord.command(b"c", protocol.Command("pause", "pause", {"all": True}, None, None, 8.0), now)
    coord.command(b"x", protocol.Command("s2", "status", {}, "n2", None, 8.0), now)
    coord.command(b"c", protocol.Command("resume", "resume", {"all": True}, None, None, 8.0),
                  now)
    assert done == [] and [(r.request_id, r.code) for r in replies] == [("resume", "BUSY")]
    coord.view.hello(protocol.Hello("n2", "b-n2", [], 0), "n2", now + 1.0, 0.0)
    coord.sweep(now + 1.0)
    assert done == ["pause", "s2"]


def test_held_commands_are_run_a_budget_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """5,000 held queries released in one sweep stopped the coordinator's loop for 27 s (the
    hostile run). Now a sweep runs them for HELD_BUDGET_S at most (here: one a sweep)."""
    monkeypatch.setattr(coordinator_module, "HELD_BUDGET_S", 0.0)
    coord, now, done, _ = driven_coordinator({"n1", "n2"}, ["n1"])
    for i in range(3):
        coord.command(b"c", protocol.Command(f"s{i}", "status", {}, "n2", None, 8.0), now)
    coord.view.hello(protocol.Hello("n2", "b-n2", [], 0), "n2", now + 1.0, 0.0)
    for turn in range(1, 4):
        coord.sweep(now + 1.0)
        assert done == [f"s{i}" for i in range(turn)]
