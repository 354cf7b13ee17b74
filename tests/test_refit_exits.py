"""Every way out of `with fleet.refit(...)` raises one of the contract's types (DESIGN.md,
"Python"; docs/refit.md, "What a refit raises"), and the guide's retry loop catches what it
should. The refit's state and its translation of internal errors as pure logic; the lock's
answers scripted by a stand-in coordinator (a real ROUTER: protocol 1.2 codes, and a 1.1
coordinator's replies without them) with engines that are small HTTP doubles; the coordinator's
refusal of an acquisition it cannot send. The paths through real emulators are in
test_refit_exits_real.py."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from daemon_harness import wait_for
from fleet_standin import StandIn

from rollout_watchdog import (
    CommandRefused,
    CoordinatorUnavailable,
    EngineLost,
    FleetClient,
    LeaseLost,
    NoMembers,
    RefitTimeout,
    RolloutWatchdogError,
    UpdateRefused,
)
from rollout_watchdog.common import protocol
from rollout_watchdog.emulator.testing import free_port
from rollout_watchdog.refit_bridge import lock_holder
from rollout_watchdog.refit_bridge.engine_calls import EngineCallError
from rollout_watchdog.refit_bridge.group_member import (
    GroupAborted,
    GroupMember,
    GroupMemberFailed,
)
from rollout_watchdog.refit_bridge.refit_state import (
    GroupRegistry,
    Phase,
    RefitGuard,
    Snapshot,
    failure_of,
    not_empty,
    translate,
)
from rollout_watchdog.refit_bridge.service import RefitService

DOCS = Path(__file__).resolve().parents[1] / "docs" / "refit.md"
A, B, C, D = (("n1", f"e{i}", 1) for i in range(4))

# ---------------------------------------------------------------------- the state, pure


def test_a_refit_moves_forward_only_and_an_abort_never_follows_a_commit() -> None:
    guard = RefitGuard()
    for phase in (Phase.ACQUIRING, Phase.HELD, Phase.UPDATING, Phase.UPDATED, Phase.UPDATING,
                  Phase.UPDATED, Phase.COMMITTING, Phase.COMMITTED):
        guard.advance(phase)
    with pytest.raises(RuntimeError, match="from COMMITTED to ABORTED"):
        guard.advance(Phase.ABORTED)
    fresh = RefitGuard()
    with pytest.raises(RuntimeError, match="from NEW to HELD"):
        fresh.advance(Phase.HELD)


def test_the_guard_hands_out_the_group_only_while_a_failure_can_abort_it() -> None:
    guard = RefitGuard()
    group: Any = object()
    guard.advance(Phase.ACQUIRING)
    assert guard.lose([(A, "exited")]) is None         # no group yet: nothing to abort ...
    assert guard.attach(group) is group                # ... until one is in use
    assert guard.lose([(B, "exited"), (A, "again")]) is group
    snap = guard.snapshot()
    assert snap.lost == {A: "exited", B: "exited"}     # the first reason is kept
    guard.advance(Phase.HELD)
    guard.advance(Phase.COMMITTING)
    assert guard.lose_lease("lease lost: late") is None   # the commit's answer says how it went
    assert guard.snapshot().lease_lost is None
    guard.advance(Phase.COMMITTED)
    assert guard.expire() is None                      # nothing to abort once committed
    assert snap.lost == {A: "exited", B: "exited"}     # a snapshot is a copy


def test_the_group_registry_keeps_one_group_per_coordinator_and_none_across_a_fork() -> None:
    import os

    registry = GroupRegistry()
    first: Any = object()
    registry.put("tcp://a:1", first)
    assert registry.get("tcp://a:1") is first and registry.get("tcp://b:1") is None
    assert not registry.discard("tcp://a:1", object())   # a newer group stays
    pid = os.fork()
    if pid == 0:
        os._exit(0 if registry.get("tcp://a:1") is None else 1)   # the parent's, not ours
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    assert registry.discard("tcp://a:1", first) and registry.get("tcp://a:1") is None


def test_the_tensors_are_looked_at_before_the_update_and_stay_lazy() -> None:
    pulled: list[int] = []

    def tensors() -> Iterator[int | None]:
        for i in (None, 1, 2):   # (a first item that is None is an item)
            pulled.append(0 if i is None else i)
            yield i

    checked = not_empty(tensors())
    assert pulled == [0]                     # only the first, until the update takes them
    assert list(checked) == [None, 1, 2] and pulled == [0, 1, 2]
    with pytest.raises(ValueError, match="no tensors"):
        not_empty(iter(()))


def _member(m: tuple[str, str, int]) -> GroupMember:
    return GroupMember(m[0], m[1], m[2], f"http://127.0.0.1:{30000 + int(m[1][1:])}", 1)


def _refused_by_all() -> GroupMemberFailed:
    """All four members said no: two before the teardown (the culprits), two after it."""
    refused = {_member(m): f"update_weights_from_distributed: HTTP 400: shape mismatch ({m[1]})"
               for m in (A, B, C, D)}
    return GroupMemberFailed([_member(A), _member(B)], "4 refused", refused=refused)


NOTHING = Snapshot(Phase.UPDATING)


@pytest.mark.parametrize(("raised", "snap", "expected", "names"), [
    pytest.param(GroupAborted("a member died", []), Snapshot(Phase.UPDATING, {A: "exited"}),
                 EngineLost, ["n1/e0"], id="aborted-for-a-death"),
    pytest.param(GroupAborted("lease", []), Snapshot(Phase.UPDATING, lease_lost="lease lost"),
                 LeaseLost, [], id="aborted-for-the-lease"),
    pytest.param(GroupAborted("deadline", []), Snapshot(Phase.UPDATING, expired=True),
                 RefitTimeout, [], id="aborted-at-the-deadline"),
    pytest.param(GroupAborted("guard", []), Snapshot(Phase.UPDATING, guard_failed="guard died"),
                 RolloutWatchdogError, [], id="aborted-by-a-failed-guard"),
    pytest.param(_refused_by_all(), NOTHING, UpdateRefused,
                 ["n1/e0", "n1/e1", "n1/e2", "n1/e3"], id="every-member-refused"),
    pytest.param(_refused_by_all(), Snapshot(Phase.UPDATING, {C: "gone: no answer"}),
                 EngineLost, ["n1/e2"], id="one-gone-among-refusals"),
    pytest.param(GroupMemberFailed([_member(A)], "no answer within the group timeout"),
                 NOTHING, RolloutWatchdogError, ["n1/e0"], id="group-timeout"),
    pytest.param(EngineCallError("GET /server_info: no answer", answered=False), NOTHING,
                 RolloutWatchdogError, [], id="an-engine-call"),
    pytest.param(GroupAborted("a member died", []), NOTHING, RolloutWatchdogError, [],
                 id="aborted-for-nothing-heard"),
])
def test_every_internal_error_leaves_the_block_as_a_contract_type(
        raised: BaseException, snap: Snapshot, expected: type[BaseException],
        names: list[str]) -> None:
    out = translate(raised, snap, "v1", 60.0)
    assert type(out) is expected
    assert type(out).__module__ == "rollout_watchdog.common.errors"
    for name in names:
        assert name in str(out)
    if isinstance(out, UpdateRefused):
        assert sorted(out.refused) == [A, B, C, D] and out.replies.keys() == {
            "n1/e0", "n1/e1", "n1/e2", "n1/e3"}


def test_the_callers_own_error_and_the_contracts_pass_untouched() -> None:
    mine = KeyError("my iterator broke")
    assert translate(mine, NOTHING, "v1", 60.0) is mine
    lost = EngineLost([A], "read back")
    assert translate(lost, Snapshot(Phase.COMMITTED, {A: "read back"}), "v1", 60.0) is lost
    refused = CommandRefused("no", code=protocol.BAD_ARGS)
    assert translate(refused, NOTHING, "v1", 60.0) is refused
    assert isinstance(translate(GroupAborted("deadline", []), Snapshot(
        Phase.HELD, expired=True), "v1", 9.0), TimeoutError)   # RefitTimeout is one too


@pytest.mark.parametrize("snap", [
    Snapshot(Phase.UPDATING, {A: "exited"}), Snapshot(Phase.UPDATING, expired=True),
    Snapshot(Phase.COMMITTING, lease_lost="lease lost"),
    Snapshot(Phase.HELD, guard_failed="guard died")], ids=["lost", "late", "lease", "guard"])
def test_an_interrupt_leaves_the_block_as_it_came_whatever_the_guard_heard(
        snap: Snapshot) -> None:
    """Ctrl-C after the deadline, during a broadcast or the commit: still KeyboardInterrupt
    (it used to become RefitTimeout, EngineLost or LeaseLost)."""
    for stop in (KeyboardInterrupt(), SystemExit(3)):
        assert translate(stop, snap, "v1", 60.0) is stop


def test_the_callers_own_error_gives_way_to_a_lost_member_only() -> None:
    """docs/refit.md: re-raised as it is, unless a member was lost meanwhile (then EngineLost,
    naming it); not swapped for the deadline, the lease or the guard's failure."""
    mine = KeyError("my iterator broke")
    for snap in (Snapshot(Phase.UPDATING, expired=True),
                 Snapshot(Phase.UPDATING, lease_lost="lease lost: late"),
                 Snapshot(Phase.COMMITTING, lease_lost="lease lost: late"),
                 Snapshot(Phase.HELD, guard_failed="guard died")):
        assert translate(mine, snap, "v1", 60.0) is mine
    lost = translate(mine, Snapshot(Phase.UPDATING, {A: "exited"}, expired=True), "v1", 60.0)
    assert type(lost) is EngineLost and "n1/e0" in str(lost)


# ---------------------------------------------------------------------- scripted coordinator


class Engines:
    """Engines as small HTTP doubles: they take the refit's quick calls, and report the version
    they were set to (or `report`, when set; `reports`: by port, for one of them)."""

    def __init__(self, count: int) -> None:
        self.version: str | None = None
        self.report: str | None = None
        self.reports: dict[int, str] = {}
        self.paths: list[str] = []
        self.failing: dict[tuple[int, str], int] = {}   # (port, path) -> the HTTP status it gets
        self.slow: dict[tuple[int, str], float] = {}    # (port, path) -> seconds before answering
        engines = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self, body: dict[str, Any]) -> None:
                time.sleep(engines.slow.get((self.server.server_address[1], self.path), 0.0))
                data = json.dumps(body).encode()
                self.send_response(engines.failing.get(
                    (self.server.server_address[1], self.path), 200))
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                engines.paths.append(self.path)
                self._answer({"weight_version": engines.reports.get(
                    self.server.server_address[1], engines.report or engines.version),
                              "tp_size": 1, "version": "0.5.21"})

            def do_POST(self) -> None:  # noqa: N802
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length) or b"{}")
                engines.paths.append(self.path)
                if self.path == "/update_weight_version":
                    engines.version = body["new_version"]
                self._answer({"success": True})

            def log_message(self, *args: Any) -> None:
                pass

        self.servers = [ThreadingHTTPServer(("127.0.0.1", 0), Handler) for _ in range(count)]
        for server in self.servers:
            threading.Thread(target=server.serve_forever, daemon=True).start()

    def members(self) -> list[dict[str, Any]]:
        return [{"node_id": "n1", "id": f"e{i}", "incarnation": 1, "tp_size": 1,
                 "url": f"http://127.0.0.1:{s.server_address[1]}", "weight_version": None}
                for i, s in enumerate(self.servers)]

    def close(self) -> None:
        for server in self.servers:
            server.shutdown()
            server.server_close()


Answer = Callable[[protocol.Command], "protocol.Reply | None"]


class Lock:
    """The refit_* answers of a coordinator, each replaceable; what was asked, in order."""

    def __init__(self, standin: StandIn, members: list[dict[str, Any]]) -> None:
        self.asked: list[protocol.Command] = []
        self.answers: dict[str, Answer] = {
            "refit_acquire": lambda c: ok(c, {"token": 5, "lease_s": 30, "version": "v1",
                                              "members": members, "relaunched": [],
                                              "pause_problems": None}),
            "refit_renew": lambda c: ok(c, {"expires_in_s": 30}),
            "refit_commit": lambda c: ok(c, {"version": c.args["version"],
                                             "members": len(c.args["members"]),
                                             "released": c.args["token"]}),
            "refit_abort": lambda c: ok(c, {"stale": 1, "restarted": []}),
            "refit_release": lambda c: ok(c, {"released": c.args["token"]}),
            "refit_members": lambda c: ok(c, {"members": members}),
        }
        standin.answer = self._answer

    def _answer(self, command: protocol.Command) -> protocol.Reply | None:
        self.asked.append(command)
        return self.answers[command.cmd](command)

    def cmds(self) -> list[str]:
        return [c.cmd for c in self.asked if c.cmd != "refit_renew"]


def ok(command: protocol.Command, result: Any) -> protocol.Reply:
    return protocol.Reply(command.request_id, "ok", None, result)


def error(reason: str, code: str | None, result: Any = None) -> Answer:
    return lambda c: protocol.Reply(c.request_id, "error", reason, result, code)


HOLDER = {"holder": "trainer-b", "token": 4, "version": "v0", "expires_in_s": 20.0}
FENCED = "lease lost: token 5 is not the current holder's (nobody holds the lock)"


@pytest.fixture
def engines() -> Iterator[Engines]:
    doubles = Engines(2)
    try:
        yield doubles
    finally:
        doubles.close()


@pytest.mark.parametrize(("answer", "expected", "code", "after"), [
    pytest.param(error("held by trainer-b", protocol.LOCK_HELD, HOLDER), CommandRefused,
                 protocol.LOCK_HELD, ["refit_acquire"] * 2, id="lock-held"),
    pytest.param(error("held by trainer-b", None, HOLDER), CommandRefused, protocol.LOCK_HELD,
                 ["refit_acquire"] * 2, id="lock-held-1.1"),   # (retried: at least twice)
    pytest.param(error("'lease_s' must be a number > 0", protocol.BAD_ARGS), CommandRefused,
                 protocol.BAD_ARGS, ["refit_acquire"], id="bad-args"),
    pytest.param(error("refit lock not taken: the answer cannot be sent", protocol.TOO_BIG),
                 CommandRefused, protocol.TOO_BIG, ["refit_acquire"], id="too-big"),
    pytest.param(lambda c: ok(c, {"nodes": {}, "missing": [], "ok": 2,
                                  "results_left_out": True}),
                 CommandRefused, protocol.TOO_BIG, ["refit_acquire"], id="cut-down-1.1"),
    pytest.param(lambda c: ok(c, {"token": 5, "members": [], "relaunched": []}), NoMembers,
                 None, ["refit_acquire", "refit_release"], id="no-member"),
    pytest.param(lambda c: ok(c, {"token": 5, "members": [{"url": "x"}]}), CommandRefused,
                 None, ["refit_acquire", "refit_release"], id="a-bad-member"),
])
def test_entering_raises_a_contract_type_and_lets_go_of_what_it_took(
        standin: StandIn, engines: Engines, answer: Answer, expected: type[Exception],
        code: str | None, after: list[str]) -> None:
    lock = Lock(standin, engines.members())
    lock.answers["refit_acquire"] = answer
    fleet = FleetClient(standin.endpoint, timeout_s=2.0)
    with pytest.raises(expected) as raised, fleet.refit("v1", timeout_s=2.0, backend="gloo"):
        pytest.fail("the block is not entered")
    assert raised.value.code == code           # type: ignore[attr-defined]
    if after == ["refit_acquire"] * 2:   # retried while held, until the refit's timeout
        assert set(lock.cmds()) == {"refit_acquire"} and len(lock.cmds()) >= 2
        assert raised.value.result["holder"] == "trainer-b"   # type: ignore[attr-defined]
    else:
        assert lock.cmds() == after
    if after[-1] == "refit_release":
        assert lock.asked[-1].args["token"] == 5   # the lock it took is let go at once


def test_nothing_listening_is_coordinator_unavailable() -> None:
    fleet = FleetClient(f"tcp://127.0.0.1:{free_port()}", timeout_s=0.5)
    with pytest.raises(CoordinatorUnavailable), fleet.refit("v1", timeout_s=0.6):
        pytest.fail("the block is not entered")


def test_a_bad_version_is_a_value_error_before_anything_is_sent(standin: StandIn) -> None:
    fleet = FleetClient(standin.endpoint)
    for bad in ("", None, 7):
        with pytest.raises(ValueError, match="version must be a non-empty string"):
            fleet.refit(bad)  # type: ignore[arg-type]
    assert standin.commands == []


@pytest.mark.parametrize(("kwargs", "name"), [
    ({"lease_s": 0.5}, "lease_s"), ({"lease_s": 7200}, "lease_s"), ({"lease_s": "30"}, "lease_s"),
    ({"lease_s": float("nan")}, "lease_s"), ({"timeout_s": 0}, "timeout_s"),
    ({"timeout_s": float("inf")}, "timeout_s"), ({"timeout_s": True}, "timeout_s"),
    ({"backend": "mpi"}, "backend"), ({"backend": None}, "backend"),
    ({"master_address": "192.0.2.1"}, "master_address"),       # not this machine's
    ({"master_address": "no-such-host.invalid"}, "master_address"),   # does not resolve
])
def test_a_bad_refit_argument_is_a_value_error_naming_it_before_anything_is_sent(
        standin: StandIn, kwargs: dict[str, Any], name: str) -> None:
    """Each used to come out later as another type (the coordinator's BAD_ARGS refusal, an
    OSError from the group's rendezvous after the members were paused, torch's error)."""
    fleet = FleetClient(standin.endpoint)
    with pytest.raises(ValueError, match=f"^{name} "):
        fleet.refit("v1", **kwargs)
    assert standin.commands == []


@pytest.mark.parametrize("address", ["tcp://127.0.0.1", "tcp://127.0.0.1:port", "bogus://x"])
def test_an_address_zeromq_refuses_is_coordinator_unavailable(address: str) -> None:
    """Not a raw zmq.ZMQError out of a call (nor out of `with fleet.refit()`)."""
    fleet = FleetClient(address, timeout_s=0.5)
    with pytest.raises(CoordinatorUnavailable, match="cannot connect"):
        fleet.status()
    with pytest.raises(CoordinatorUnavailable), fleet.refit("v1", timeout_s=1):
        pytest.fail("the block is not entered")


@pytest.mark.parametrize("code", [protocol.LEASE_LOST, None], ids=["1.2", "1.1"])
def test_a_lease_lost_while_inside_the_block_is_lease_lost(
        standin: StandIn, engines: Engines, code: str | None) -> None:
    lock = Lock(standin, engines.members())
    lock.answers["refit_renew"] = error(FENCED, code)
    fleet = FleetClient(standin.endpoint, timeout_s=2.0)
    with pytest.raises(LeaseLost, match="lease lost"), \
            fleet.refit("v1", timeout_s=60, backend="gloo") as refit:
        wait_for(lambda: refit._state.snapshot().lease_lost, 20, "the renewal refused")
    assert "refit_commit" not in lock.cmds() and "refit_release" not in lock.cmds()
    assert engines.version is None             # nothing was set on the members


@pytest.mark.parametrize("code", [protocol.LEASE_LOST, None], ids=["1.2", "1.1"])
def test_a_commit_refused_for_its_token_is_lease_lost(
        standin: StandIn, engines: Engines, code: str | None) -> None:
    lock = Lock(standin, engines.members())
    lock.answers["refit_commit"] = error(FENCED, code)
    fleet = FleetClient(standin.endpoint, timeout_s=2.0)
    with pytest.raises(LeaseLost, match="lease lost"), \
            fleet.refit("v1", timeout_s=60, backend="gloo"):
        pass
    assert lock.cmds() == ["refit_acquire", "refit_commit"]


def test_a_holder_whose_lease_ended_unheard_touches_no_member_at_its_commit(
        standin: StandIn, engines: Engines) -> None:
    """A holder stopped past its lease resumes all its threads at once: its commit renews the
    lease before it calls any member, so the members (the next holder's by then) are left
    alone (the hostile run saw a stale holder end the next holder's update sessions and
    continue its paused generation)."""
    lock = Lock(standin, engines.members())
    fleet = FleetClient(standin.endpoint, timeout_s=2.0)
    with pytest.raises(LeaseLost, match="lease lost"), \
            fleet.refit("v1", timeout_s=60, backend="gloo"):
        lock.answers["refit_renew"] = error(FENCED, protocol.LEASE_LOST)
    assert "refit_commit" not in lock.cmds()
    assert engines.version is None and engines.paths == []   # no member was called


def test_a_commit_not_saved_took_effect_and_says_so(standin: StandIn, engines: Engines
                                                    ) -> None:
    """A commit whose state file cannot be written (a full disk) took effect in the
    coordinator's memory: CommandRefused with code NOT_SAVED, the refit committed, the lock
    released (it used to abort, and the abort's refusal made it LeaseLost: "nothing of ours
    is committed", which was false)."""
    lock = Lock(standin, engines.members())
    lock.answers["refit_commit"] = error("cannot write the refit state: No space left on "
                                         "device", protocol.NOT_SAVED)
    fleet = FleetClient(standin.endpoint, timeout_s=2.0)
    with pytest.raises(CommandRefused) as refused, \
            fleet.refit("v1", timeout_s=60, backend="gloo") as refit:
        pass
    assert refused.value.code == protocol.NOT_SAVED
    assert refit.committed and engines.version == "v1"
    assert lock.cmds() == ["refit_acquire", "refit_commit", "refit_release"]


def test_a_commit_without_an_answer_is_coordinator_unavailable(
        standin: StandIn, engines: Engines, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lock_holder, "CALL_TIMEOUT_S", 1.0)
    lock = Lock(standin, engines.members())
    lock.answers["refit_commit"] = lambda c: None
    fleet = FleetClient(standin.endpoint, timeout_s=2.0)
    with pytest.raises(CoordinatorUnavailable), fleet.refit("v1", timeout_s=60):
        pass
    assert lock.cmds()[:2] == ["refit_acquire", "refit_commit"]


def test_the_deadline_passing_inside_the_block_is_refit_timeout(
        standin: StandIn, engines: Engines) -> None:
    lock = Lock(standin, engines.members())
    fleet = FleetClient(standin.endpoint, timeout_s=2.0)
    with pytest.raises(RefitTimeout, match="ran past its 2 s") as raised, \
            fleet.refit("v1", timeout_s=2.0) as refit:
        wait_for(lambda: refit._state.snapshot().expired, 20, "the deadline")
    assert isinstance(raised.value, TimeoutError)
    assert lock.cmds() == ["refit_acquire", "refit_abort", "refit_release"]


def test_a_failed_guard_thread_fails_the_refit(standin: StandIn, engines: Engines) -> None:
    class NoEvents(FleetClient):
        def events(self, *args: Any, **kwargs: Any) -> Any:
            raise OSError("out of file descriptors")

    lock = Lock(standin, engines.members())
    fleet = NoEvents(standin.endpoint, timeout_s=2.0)
    with pytest.raises(RolloutWatchdogError, match="guard thread failed: out of file") as raised, \
            fleet.refit("v1", timeout_s=60):
        pass
    assert type(raised.value) is RolloutWatchdogError
    assert lock.cmds() == ["refit_acquire", "refit_abort", "refit_release"]


def test_a_lease_lost_while_waiting_for_relaunched_engines_is_lease_lost(
        standin: StandIn, engines: Engines) -> None:
    lock = Lock(standin, engines.members())
    acquired = lock.answers["refit_acquire"]
    lock.answers["refit_acquire"] = lambda c: ok(c, {**acquired(c).result,
                                                     "relaunched": [["n1", "e0"]]})
    lock.answers["refit_members"] = error(FENCED, protocol.LEASE_LOST)
    fleet = FleetClient(standin.endpoint, timeout_s=2.0)
    with pytest.raises(LeaseLost, match="lease lost"), fleet.refit("v1", timeout_s=60):
        pytest.fail("the block is not entered")
    assert lock.cmds() == ["refit_acquire", "refit_members"]   # nothing to release


def test_a_member_gone_before_the_update_is_engine_lost_and_the_others_continue(
        standin: StandIn, engines: Engines) -> None:
    lock = Lock(standin, engines.members())
    fleet = FleetClient(standin.endpoint, timeout_s=2.0)
    with pytest.raises(EngineLost, match="pause_generation") as lost, \
            fleet.refit("v1", timeout_s=60) as refit:
        engines.servers[1].shutdown()
        engines.servers[1].server_close()
        refit.update_weights([("w", object())])   # type: ignore[list-item]
    assert lost.value.lost == [("n1", "e1", 1)]
    assert engines.paths.count("/continue_generation") == 1   # the other one generates again
    assert lock.cmds() == ["refit_acquire", "refit_abort", "refit_release"]


@pytest.mark.parametrize("other", ["prompt", "slow"])
def test_a_member_lost_for_an_error_it_answered_is_continued_with_the_others(
        standin: StandIn, engines: Engines, other: str) -> None:
    """A member whose pause_generation answered an error is lost, but it answers: the abort
    lets it generate again with the others, not leave it paused until the next refit (a
    trainer that sends rollouts to the engines' own URLs would wait on it). `slow`: the other
    member answers /server_info past ABORT_GRACE_S; before a group exists nothing can block it
    in a collective, so it is continued too, not left paused as if wedged."""
    lock = Lock(standin, engines.members())
    engines.failing[(engines.servers[1].server_address[1], "/pause_generation")] = 500
    if other == "slow":
        engines.slow[(engines.servers[0].server_address[1], "/server_info")] = 1.5
    fleet = FleetClient(standin.endpoint, timeout_s=2.0)
    with pytest.raises(EngineLost, match="pause_generation") as lost, \
            fleet.refit("v1", timeout_s=60) as refit:
        refit.update_weights([("w", object())])   # type: ignore[list-item]
    assert lost.value.lost == [("n1", "e1", 1)]
    assert engines.paths.count("/continue_generation") == 2
    assert lock.cmds() == ["refit_acquire", "refit_abort", "refit_release"]


def test_the_callers_error_aborts_and_is_raised_as_it_is(
        standin: StandIn, engines: Engines) -> None:
    lock = Lock(standin, engines.members())
    fleet = FleetClient(standin.endpoint, timeout_s=2.0)
    with pytest.raises(KeyError, match="my iterator"), fleet.refit("v1", timeout_s=60):
        raise KeyError("my iterator")
    assert lock.cmds() == ["refit_acquire", "refit_abort", "refit_release"]
    assert "my iterator" in next(c for c in lock.asked if c.cmd == "refit_abort").args["reason"]


def test_update_weights_refuses_a_bad_call_before_anything_is_sent_and_the_refit_goes_on(
        standin: StandIn, engines: Engines) -> None:
    """No tensors (an exhausted generator) or a bad `bucket_bytes`: ValueError before the
    members are paused (it used to come after the pause and the group's build, and the
    refit could only abort); the block goes on and commits."""
    lock = Lock(standin, engines.members())
    fleet = FleetClient(standin.endpoint, timeout_s=2.0)
    spent = iter([("w", object())])
    next(spent)
    with fleet.refit("v1", timeout_s=60, backend="gloo") as refit:
        for tensors, size in (([], None), (spent, None), ([("w", object())], 0),
                              ([("w", object())], True), ([("w", object())], "1")):
            with pytest.raises(ValueError, match="no tensors|bucket_bytes"):
                refit.update_weights(tensors, bucket_bytes=size)  # type: ignore[arg-type]
        assert engines.paths == [] and refit.phase is Phase.HELD
    assert refit.committed and engines.version == "v1"
    assert lock.cmds() == ["refit_acquire", "refit_commit", "refit_release"]


def test_a_member_reporting_another_version_is_engine_lost_the_others_committed(
        standin: StandIn, engines: Engines) -> None:
    lock = Lock(standin, engines.members())
    engines.reports[engines.servers[1].server_address[1]] = "elsewhere"
    fleet = FleetClient(standin.endpoint, timeout_s=2.0)
    with pytest.raises(EngineLost, match="the others committed") as lost, \
            fleet.refit("v1", timeout_s=60) as refit:
        refit.commit()
    assert lost.value.lost == [("n1", "e1", 1)]
    assert lock.cmds() == ["refit_acquire", "refit_commit", "refit_release"]
    assert next(c for c in lock.asked if c.cmd == "refit_commit").args["members"] == [
        ["n1", "e0", 1]]


def test_the_fencing_token_is_never_logged(standin: StandIn, engines: Engines,
                                           caplog: pytest.LogCaptureFixture) -> None:
    """The token is shown to its holder's code only (it used to be logged at INFO)."""
    lock = Lock(standin, engines.members())
    acquired = lock.answers["refit_acquire"]
    lock.answers["refit_acquire"] = lambda c: ok(c, {**acquired(c).result,
                                                     "token": "tok-7f3a9c"})
    fleet = FleetClient(standin.endpoint, timeout_s=2.0)
    with caplog.at_level("DEBUG"), fleet.refit("v1", timeout_s=60):
        pass
    assert "lock taken" in caplog.text and "tok-7f3a9c" not in caplog.text
    assert lock.asked[-1].args["token"] == "tok-7f3a9c"


def test_every_member_failing_its_read_back_aborts_and_commits_nothing(
        standin: StandIn, engines: Engines) -> None:
    """docs/refit.md: a refit with no member is never committed (the fleet's version would be
    one no engine holds); it used to send refit_commit with no member."""
    lock = Lock(standin, engines.members())
    engines.report = "elsewhere"
    fleet = FleetClient(standin.endpoint, timeout_s=2.0)
    with pytest.raises(EngineLost, match="nothing committed") as lost, \
            fleet.refit("v1", timeout_s=60) as refit:
        refit.commit()
    assert sorted(lost.value.lost) == [("n1", "e0", 1), ("n1", "e1", 1)]
    assert lock.cmds() == ["refit_acquire", "refit_abort", "refit_release"]
    assert not refit.committed


# ---------------------------------------------------------------------- the coordinator's side


class Core:
    """What RefitService needs of the coordinator: a fleet view of one node, and gathers that
    answer at once."""

    def __init__(self, engines: int, url_chars: int) -> None:
        record = SimpleNamespace(reachable=True, engines={
            f"e{i}": {"id": f"e{i}", "state": "healthy", "incarnation": 1, "tp_size": 1,
                      "url": f"http://{'h' * url_chars}:{i}"} for i in range(engines)})
        self.view = SimpleNamespace(nodes={"n1": record}, reachable=lambda: ["n1"])
        self.replies: list[protocol.Reply] = []
        self.gathered: list[protocol.Command] = []

    def gather(self, client: bytes | None, cmd: protocol.Command, targets: list[str],
               now: float, finish: Any = None) -> None:
        self.gathered.append(cmd)
        if finish is not None:
            done = SimpleNamespace(client=client, answers={}, reply=lambda: ok(cmd, {"nodes": {},
                                                                       "missing": []}))
            finish(done)   # (it answers by itself once its listing is saved: at once here)

    def reply(self, client: bytes, reply: protocol.Reply) -> None:
        self.replies.append(reply)

    def weights_changed(self) -> None:
        pass

    def refit_ended(self, outcome: str, duration_s: float) -> None:
        pass

    def resume_owed(self, owner: str, nodes: list[str]) -> None:
        pass


def acquire(service: RefitService, core: Core, holder: str) -> protocol.Reply:
    service.handle(core, b"client", protocol.Command(  # type: ignore[arg-type]
        f"r-{holder}", "refit_acquire", {"holder": holder, "version": "v1"}), time.monotonic())
    return core.replies[-1]


def test_an_acquisition_whose_answer_cannot_be_sent_is_refused_and_leaves_the_lock_free() -> None:
    service = RefitService(None)
    big = Core(engines=9000, url_chars=120)    # ~1.3 MB of members: over one message
    refused = acquire(service, big, "trainer-a")
    assert (refused.status, refused.code) == ("error", protocol.TOO_BIG)
    assert "refit lock not taken" in str(refused.reason) and service.lock.lease is None
    assert [c.cmd for c in big.gathered] == ["pause", "resume"]   # the pause is undone
    small = Core(engines=2, url_chars=10)
    taken = acquire(service, small, "trainer-b")
    assert taken.status == "ok" and taken.result["token"] is not None


# ---------------------------------------------------------------------- the guide's retry loop


def guide_loop() -> str:
    """The retry loop of docs/refit.md, section 2, as users copy it."""
    text = DOCS.read_text()
    match = re.search(r"\n(def refit\(.*?\n    raise RuntimeError\(.*?\n)", text, re.S)
    assert match, "docs/refit.md section 2 has no `def refit(` retry loop"
    return match.group(1)


class FakeFleet:
    """`fleet` for the guide's loop: refit() raises `first` once, then commits."""

    def __init__(self, first: Exception) -> None:
        self.first: Exception | None = first
        self.attempts = 0
        self.waited = 0

    def refit(self, version: str, **kwargs: Any) -> Any:
        self.attempts += 1
        failure, self.first = self.first, None

        class Block:
            def __enter__(self) -> Any:
                if failure is not None:
                    raise failure
                return SimpleNamespace(update_weights=lambda *a, **k: None)

            def __exit__(self, *exc: object) -> None:
                pass

        return Block()

    def wait_until(self, predicate: Callable[[list[Any]], bool], timeout_s: float) -> list[Any]:
        self.waited += 1
        view = [SimpleNamespace(state="healthy", reachable=True, serving=True)]
        assert predicate(view)
        return view


RETRIED = [EngineLost([A], "exited"), LeaseLost("lease lost"), NoMembers("no engine")]
RAISED = [UpdateRefused({A: "HTTP 400: shape mismatch"}),
          CommandRefused("no refit lock within 600 s", code=protocol.LOCK_HELD),
          CoordinatorUnavailable("no answer"), RefitTimeout("ran past its 600 s"),
          RolloutWatchdogError("the refit's guard thread failed")]


@pytest.mark.parametrize("failure", RETRIED + RAISED, ids=lambda e: type(e).__name__)
def test_the_guides_retry_loop_retries_what_a_retry_can_mend_and_raises_the_rest(
        failure: Exception) -> None:
    import logging

    import rollout_watchdog
    fleet = FakeFleet(failure)
    scope: dict[str, Any] = {"fleet": fleet, "log": logging.getLogger("train"),
                             **{n: getattr(rollout_watchdog, n)
                                for n in rollout_watchdog.__all__ if n[0].isupper()}}
    exec(guide_loop(), scope)   # noqa: S102 - the guide's own code, as users run it
    if any(failure is r for r in RETRIED):
        scope["refit"]("7", lambda: [])
        assert fleet.attempts == 2
        assert fleet.waited == (1 if isinstance(failure, NoMembers) else 0)
    else:
        with pytest.raises(type(failure)):
            scope["refit"]("7", lambda: [])
        assert fleet.attempts == 1


def test_a_member_its_watchdog_saw_die_is_named_before_the_survivors_lost_with_it() -> None:
    """A death breaks the collective: the survivors' update calls may fail, and be lost, before
    the guard hears of the death; the dead one is still the one EngineLost names first."""
    guard = RefitGuard()
    guard.lose([(("n0", "e0", 1), "gone: broken pipe"), (("n0", "e2", 1), "gone: reset")])
    guard.lose([(("n0", "e1", 1), "state stopping (exited)")], seen=True)
    error = failure_of(guard.snapshot(), "v1", 60.0)
    assert isinstance(error, EngineLost)
    assert error.lost == [("n0", "e1", 1), ("n0", "e0", 1), ("n0", "e2", 1)]
    assert (error.node_id, error.engine, error.incarnation) == ("n0", "e1", 1)
