"""The refit's members a page at a time (issue 13, Major 4), no reply ever cut down to fit
(Critical 3), and the group rebuilt for a new process under an unchanged incarnation.

Pure: the pages and their cursor, the client's putting them together. The coordinator's refit
service over a fake fleet view of 9,000 engines with long URLs (over one message): every page
of an acquisition and of `refit_members` fits, and together they are exactly the lease's
members; a client before 1.3 gets TOO_BIG and leaves the lock free. The embedded coordinator:
a `status` page that cannot be sent is a TOO_BIG error, not silence. Real daemon, emulator and
gloo: a daemon that lost its state file runs a new process under the same incarnation number,
and the next refit builds a new group instead of failing once. The 20,000-engine run over the
wire is test_refit_scale.py."""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from daemon_harness import Node, pid_gone, wait_for
from refit_harness import all_healthy, by_name, start_fleet, weights

from rollout_watchdog import CommandRefused, Coordinator, FleetClient
from rollout_watchdog.agent.fanout import encode_reply
from rollout_watchdog.common import protocol
from rollout_watchdog.refit_bridge import member_pages
from rollout_watchdog.refit_bridge.lease_end import MAX_PUTBACK
from rollout_watchdog.refit_bridge.lock import pause_owner_of
from rollout_watchdog.refit_bridge.refit_state import GROUPS
from rollout_watchdog.refit_bridge.service import RefitService

LONG_HOST = "gpu-node-" + "x" * 100 + ".cluster.example.com"


def fleet_members(count: int, per_node: int = 500) -> list[dict[str, Any]]:
    return sorted(({"node_id": f"node-{i // per_node:03d}.{LONG_HOST}", "id": f"e{i % per_node}",
                    "incarnation": 1, "url": f"http://{LONG_HOST}:{30000 + i}", "tp_size": 1,
                    "process": f"boot:{i}:1", "weight_version": "v" * 256}
                   for i in range(count)), key=member_pages.member_key)


# ---------------------------------------------------------------------- pure


def test_the_pages_hold_every_member_once_in_order_and_each_fits_one_message() -> None:
    listing = fleet_members(9_000)
    with pytest.raises(protocol.ProtocolError, match="exceeds the limit"):   # the premise:
        protocol.encode(protocol.Reply("r", "ok", None, {"members": listing}))   # not in one
    cursors: list[Any] = []

    def more(cursor: Any) -> dict[str, Any]:
        cursors.append(cursor)
        answer = member_pages.page(listing, member_pages.cursor(cursor), True)
        assert len(protocol.encode(protocol.Reply("r", "ok", None, answer))) \
            <= protocol.MAX_MESSAGE_BYTES
        return answer

    first = member_pages.page(listing, None, True)
    assert first["next"] is not None
    assert member_pages.collect(first, "refit_acquire", more) == listing
    assert len(cursors) >= 3 and len(set(map(tuple, cursors))) == len(cursors)
    assert member_pages.page(listing, None, False) == {"members": listing}   # before 1.3
    assert member_pages.page([], None, True) == {"members": [], "next": None}


def test_a_cursor_is_checked_and_a_page_that_does_not_move_on_is_refused() -> None:
    assert member_pages.cursor(["n1", "e0"]) == ("n1", "e0")
    for bad in ("n1/e0", ["n1", 3], [1], None):
        with pytest.raises(ValueError, match="must be the 'next' of an earlier page"):
            member_pages.cursor(bad)
    stuck = {"members": [{"node_id": "n1", "id": "e0"}], "next": ["n1", "e0"]}
    with pytest.raises(CommandRefused, match="does not move on"):
        member_pages.collect(stuck, "refit_acquire", lambda cursor: stuck)
    cut_down = {"nodes": {}, "missing": [], "ok": 2, "results_left_out": True}
    with pytest.raises(CommandRefused, match="too big for one message") as refused:
        member_pages.collect(cut_down, "refit_acquire", lambda cursor: cut_down)
    assert refused.value.code == protocol.TOO_BIG   # (a coordinator before 1.2)


# ---------------------------------------------------------------------- the coordinator's side


class Core:
    """What RefitService needs of the coordinator: a fleet view and gathers that answer at
    once; the replies go through the coordinator's own encoding (fanout.encode_reply)."""

    def __init__(self, members: list[dict[str, Any]]) -> None:
        self.view = SimpleNamespace(nodes={}, reachable=lambda: list(self.view.nodes))
        for m in members:
            record = self.view.nodes.setdefault(
                m["node_id"], SimpleNamespace(reachable=True, engines={}))
            record.engines[m["id"]] = {**m, "state": "healthy"}
        self.replies: list[protocol.Reply] = []
        self.started_at = time.monotonic()

    def gather(self, client: bytes | None, cmd: protocol.Command, targets: list[str],
               now: float, finish: Any = None) -> None:
        if finish is not None:   # (it answers by itself once its listing is saved)
            finish(SimpleNamespace(client=client, answers={}, reply=lambda: protocol.Reply(
                cmd.request_id, "ok", None, {"nodes": {}, "missing": []})))

    def reply(self, client: bytes, reply: protocol.Reply) -> None:
        decoded = protocol.decode(encode_reply(reply))
        assert isinstance(decoded, protocol.Reply)
        self.replies.append(decoded)

    def weights_changed(self) -> None:
        pass

    def refit_ended(self, outcome: str, duration_s: float) -> None:
        pass

    def resume_owed(self, owner: str, nodes: list[str]) -> None:
        pass

    def call(self, service: RefitService, cmd: str, args: dict[str, Any]) -> protocol.Reply:
        service.handle(self, b"client", protocol.Command(  # type: ignore[arg-type]
            f"r{len(self.replies)}", cmd, args), time.monotonic())
        return self.replies[-1]


def test_an_acquisition_and_refit_members_page_one_listing_and_a_client_before_1_3_is_refused(
        ) -> None:
    listing = [{**m, "weight_version": None, "pid": 1000 + i, "paused": False, "serving": True}
               for i, m in enumerate(fleet_members(9_000))]   # (no refit yet: all serve)
    core, service = Core(listing), RefitService(None)
    old = core.call(service, "refit_acquire", {"holder": "old", "version": "v1"})
    assert (old.status, old.code) == ("error", protocol.TOO_BIG)
    assert "1048576" in str(old.reason) and service.lock.lease is None   # the lock is free

    first = core.call(service, "refit_acquire", {"holder": "t", "version": "v1",
                                                 "paged": True}).result
    token = first["token"]
    members = member_pages.collect(first, "refit_acquire", lambda cursor: core.call(
        service, "refit_members", {"holder": "t", "token": token, "after": cursor}).result)
    assert members == listing and all(m["process"] for m in members)
    lease = service.lock.lease
    assert lease is not None and len(lease.members) == 9_000

    gone = listing[4_500]   # an engine dies meanwhile: the pages of the listing hold it still
    core.view.nodes[gone["node_id"]].engines[gone["id"]]["state"] = "stopping"
    again = member_pages.collect(first, "refit_acquire", lambda cursor: core.call(
        service, "refit_members", {"holder": "t", "token": token, "after": cursor}).result)
    assert again == listing
    fresh = core.call(service, "refit_members", {"holder": "t", "token": token, "paged": True})
    assert fresh.status == "ok" and fresh.result["next"] is not None
    refreshed = member_pages.collect(fresh.result, "refit_members", lambda cursor: core.call(
        service, "refit_members", {"holder": "t", "token": token, "after": cursor}).result)
    assert gone not in refreshed and len(refreshed) == len(lease.members) == 8_999

    whole = core.call(service, "refit_members", {"holder": "t", "token": token})  # before 1.3
    assert (whole.status, whole.code, whole.result) == ("error", protocol.TOO_BIG, None)
    assert "exceeds the limit of 1048576 bytes" in str(whole.reason)
    for bad in ({"after": "n1/e0"}, {"paged": "yes"}):
        refused = core.call(service, "refit_members", {"holder": "t", "token": token, **bad})
        assert refused.code == protocol.BAD_ARGS and f"'{next(iter(bad))}'" in str(refused.reason)
    assert core.call(service, "refit_release", {"holder": "t", "token": token}).status == "ok"


def test_a_fan_out_too_big_for_one_message_is_an_error_that_names_the_limit() -> None:
    answers = {f"n{i:05d}": {"status": "ok", "reason": None, "result": {"x": "y" * 100}}
               for i in range(20_000)}
    reply = protocol.decode(encode_reply(protocol.Reply("r", "ok", None,
                                                        {"nodes": answers, "missing": []})))
    assert isinstance(reply, protocol.Reply)
    assert (reply.status, reply.code) == ("error", protocol.TOO_BIG)
    assert "limit of 1048576 bytes" in str(reply.reason) and "20000 that answered ok" in str(
        reply.reason)
    assert reply.result == {"nodes": {}, "missing": [], "ok": 20_000, "results_left_out": True}


def test_a_status_page_that_cannot_be_sent_is_too_big_not_silence() -> None:
    """One node's entry cannot be split across pages: a HELLO just under the limit, which the
    view's own fields push over it."""
    import zmq
    engines = [{"id": f"e{i:05d}", "state": "healthy"} for i in range(26_000)]
    hello = protocol.encode(protocol.Hello("big", "b1", engines, 0))
    assert len(hello) < protocol.MAX_MESSAGE_BYTES
    with Coordinator(bind="tcp://127.0.0.1:0") as coordinator:
        ctx = zmq.Context()
        node = ctx.socket(zmq.DEALER)
        node.setsockopt(zmq.ROUTING_ID, b"big")
        node.setsockopt(zmq.LINGER, 0)
        node.connect(coordinator.endpoint)
        node.send(hello)
        fleet = FleetClient(coordinator.endpoint, timeout_s=10.0)
        try:
            wait_for(lambda: fleet.call("ping")[1]["nodes"] == 1, 20, "the node's hello")
            with pytest.raises(CommandRefused, match="exceeds the limit") as refused:
                fleet.status()
            assert refused.value.code == protocol.TOO_BIG
        finally:
            fleet.close()
            node.close()
            ctx.term()


# ---------------------------------------------------------------------- a new process


@pytest.mark.skipif(pytest.importorskip("torch") is None, reason="torch")
def test_a_new_process_under_an_unchanged_incarnation_gets_a_new_group(
        make_node: Callable[..., Node], coordinator: Coordinator) -> None:
    """B's leftover: the daemon and its engine die, the state file is lost, and the engine is
    launched again as incarnation 1 on the same URL: only `process` tells the trainer."""
    fleet = FleetClient(coordinator.endpoint)
    node = start_fleet(make_node, coordinator.endpoint, nodes=1, engines=1)[0]
    fleet.wait_until(all_healthy(1), 90)
    with fleet.refit("v1", backend="gloo", timeout_s=60) as refit:
        refit.update_weights(weights(1))
    first = GROUPS.get(fleet.address)
    before = by_name(fleet)["node0/e0"]
    assert first is not None and before.pid is not None
    node.kill_daemon()
    os.kill(before.pid, signal.SIGKILL)
    wait_for(lambda: pid_gone(before.pid), 10, "the engine to die")   # type: ignore[arg-type]
    shutil.rmtree(node.state_dir)   # the state file and the incarnation marks with it
    node.start()
    after = fleet.wait_until(lambda view: any(
        e.name == before.name and e.state == "healthy" and e.pid != before.pid
        for e in view), 90)[0]
    assert (after.incarnation, after.url) == (before.incarnation, before.url)   # same key ...
    assert after.raw.get("process") != before.raw.get("process")               # ... new process
    with fleet.refit("v2", backend="gloo", timeout_s=60) as refit:   # no failure first
        refit.update_weights(weights(2))
    assert GROUPS.get(fleet.address) is not first
    assert by_name(fleet)["node0/e0"].weight_version == "v2"


def test_a_lock_being_put_back_by_the_coordinator_is_refused_as_held() -> None:
    """Until a lease that ended uncommitted has its members back in service the lock is the
    coordinator's: LOCK_HELD, which the refit waits out (it used to be BAD_ARGS, which ended
    the next trainer's refit at once)."""
    core, service = Core([{"node_id": "n1", "id": "e0", "incarnation": 1, "tp_size": 1,
                           "url": "http://127.0.0.1:1", "process": "p"}]), RefitService(None)
    first = core.call(service, "refit_acquire", {"holder": "a", "version": "v1", "lease_s": 1})
    assert first.status == "ok"
    service.tick(core, time.monotonic() + 2)   # the lease ran out, uncommitted
    refused = core.call(service, "refit_acquire", {"holder": "b", "version": "v2"})
    assert (refused.status, refused.code) == ("error", protocol.LOCK_HELD)
    assert refused.result["holder"] == "coordinator"


def test_a_lost_leases_members_are_put_back_only_by_a_coordinator_that_cannot_have(
        ) -> None:
    """`refit_putback`: a holder whose lease was lost to a coordinator restart asks for its
    members to be put back. A coordinator that started without refit state, after that lease,
    and granted none since marks them stale at once, holds the lock for that lease until
    their nodes are back (it takes further pages meanwhile), then puts back those its view
    shows paused. Only one holder's per start (one lease was held when it stopped: a forged
    ask after it does nothing), at most MAX_PUTBACK members. One that knows the lease's end
    (its own token, a lease granted since) says who did; one whose lock is held refuses it as
    held: that holder continues them (the hostile run's stale holder continued them itself
    after asking `ping`, under the next holder)."""
    engines = [{"node_id": "n1", "id": f"e{i}", "incarnation": 1, "tp_size": 1,
                "url": f"http://127.0.0.1:{i + 1}", "process": "p", "paused": i == 0}
               for i in range(2)]   # (e0's refuses: put back at once; e1 is not paused)
    core, service = Core(engines), RefitService(None)
    lost = {"holder": "a", "token": "0123456789abcdef-7-00ff", "version": "vA",
            "members": [["n2", "e0", 1]], "more": True}
    asked = core.call(service, "refit_putback", lost)   # (n2: not back yet)
    assert (asked.status, asked.result) == ("ok", {"put_back": 1})
    rest = {**lost, "members": [["n1", "e0", 1], ["n1", "e1", 1]], "more": False}
    assert core.call(service, "refit_putback", rest).result == {"put_back": 2}
    everyone = {("n2", "e0"), ("n1", "e0"), ("n1", "e1")}
    assert service.book.held.keys() == everyone   # stale at once
    service.tick(core, time.monotonic())   # n2 is not back: the lease waits, held
    held = core.call(service, "refit_acquire", {"holder": "b", "version": "v1"})
    assert (held.code, held.result["holder"]) == (protocol.LOCK_HELD, "a")
    service.tick(core, time.monotonic() + 61)   # (RESTORED_WAIT_S: n2 is left to its node)
    assert service.ending.putting_back is not None
    assert service.ending.putting_back.members == [("n1", "e0", 1)]   # the paused one only
    assert service.ending.putting_back.pause_owner == pause_owner_of(lost["token"])
    put_back_ended(service, core)
    assert service.book.held.keys() == everyone

    forged = core.call(service, "refit_putback", {**lost, "token": "feed-1-x"}).result
    assert forged["put_back"] == 0 and "a asked for refit #7" in forged["because"]
    for bad, named in (({"members": [["n1", "e0"]]}, "'members'"), ({"token": 7}, "'token'"),
                       ({"token": None}, "'token'"), ({"token": "x-y"}, "'token'")):
        refused = core.call(service, "refit_putback", {**lost, **bad})
        assert refused.code == protocol.BAD_ARGS and named in str(refused.reason), bad
    token = core.call(service, "refit_acquire", {"holder": "b", "version": "v1"}).result["token"]
    mine = core.call(service, "refit_putback", {**lost, "holder": "b", "token": token})
    assert (mine.code, "refit_abort" in str(mine.reason)) == (protocol.BAD_ARGS, True)
    refused = core.call(service, "refit_putback", lost)
    assert (refused.code, refused.result["holder"]) == (protocol.LOCK_HELD, "b")


def test_a_put_back_takes_only_so_many_members_and_a_lease_granted_since_ends_it() -> None:
    """Pages of made-up members are refused past MAX_PUTBACK (the hostile run grew the book
    and the state to 1.1 M entries), a first page too big without taking this start's one
    request; a lease granted since is known to have put them back."""
    core, service = Core([]), RefitService(None)
    page = [["n1", f"e{i}", 1] for i in range(MAX_PUTBACK // 2)]
    lost = {"holder": "a", "token": "0123456789abcdef-7-00ff", "version": "vA",
            "members": page, "more": True}
    too_big = core.call(service, "refit_putback", {**lost, "members": [
        ["n3", f"e{i}", 1] for i in range(MAX_PUTBACK + 1)], "token": "feed-1-x"})
    assert too_big.code == protocol.BAD_ARGS and str(MAX_PUTBACK) in str(too_big.reason)
    assert core.call(service, "refit_putback", lost).result == {"put_back": len(page)}
    again = core.call(service, "refit_putback", lost).result   # (the same page: nothing new)
    assert again == {"put_back": 0}
    more = [["n2", f"e{i}", 1] for i in range(MAX_PUTBACK // 2 + 1)]
    refused = core.call(service, "refit_putback", {**lost, "members": more})
    assert refused.code == protocol.BAD_ARGS and str(MAX_PUTBACK) in str(refused.reason)
    assert len(service.book.held) == MAX_PUTBACK // 2   # (bounded: one request a start)
    ended = RefitService(None)
    token = core.call(ended, "refit_acquire", {"holder": "b", "version": "v1"}).result["token"]
    assert core.call(ended, "refit_release", {"holder": "b", "token": token}).status == "ok"
    since = core.call(ended, "refit_putback", lost).result
    assert since["put_back"] == 0 and "a later refit took the lock" in since["because"]
    here = core.call(ended, "refit_putback", {**lost, "holder": "b", "token": token}).result
    assert here["put_back"] == 0 and "ended at this coordinator" in here["because"]


def test_a_put_back_asked_for_is_kept_on_disk_until_it_ended(tmp_path: Path) -> None:
    """A coordinator with a state dir but no refit state yet (a first start, or the file moved
    away) is asked to put a lost lease's members back: the state names them until their
    put-back ended, so a coordinator killed meanwhile puts them back after its restart; one
    whose state knew every earlier lease says so and does nothing."""
    engine = {"node_id": "n1", "id": "e0", "incarnation": 1, "tp_size": 1,
              "url": "http://127.0.0.1:1", "process": "p"}
    state = tmp_path / "state"
    first = RefitService(str(state))
    lost = {"holder": "a", "token": "0123456789abcdef-7-00ff", "version": "vA",
            "members": [["n2", "e0", 1]]}
    assert saved_call(first, Core([engine]), "refit_putback", lost).result == {"put_back": 1}
    assert json.loads((state / "refit.json").read_text())["in_flight"] == [["n2", "e0", 1]]
    first.close()   # (killed: its state is what it wrote)
    restarted, core = RefitService(str(state)), Core([{**engine, "node_id": "n2"}])
    assert restarted.live_lease is not None and restarted.live_lease.holder == "a"
    restarted.tick(core, time.monotonic())   # n2 is back: put back
    assert restarted.ending.putting_back is not None
    put_back_ended(restarted, core)
    again = saved_call(restarted, core, "refit_putback", lost).result
    assert again["put_back"] == 0 and "state knew that refit" in again["because"]
    restarted.close()


def saved_call(service: RefitService, core: Core, cmd: str, args: dict[str, Any]
               ) -> protocol.Reply:
    """A refit command to a coordinator with a state dir: its answer, once saved."""
    answered = len(core.replies)
    service.handle(core, b"client", protocol.Command(  # type: ignore[arg-type]
        f"s{answered}", cmd, args), time.monotonic())
    saved_turns(service, lambda: len(core.replies) > answered)
    return core.replies[-1]


def put_back_ended(service: RefitService, core: Core) -> None:
    """The coordinator's loop turns until its put-back ended and the lock is free."""
    deadline = time.monotonic() + 10
    while service.live_lease is not None:
        assert time.monotonic() < deadline, "the put-back did not end within 10 s"
        service.tick(core, time.monotonic())
        time.sleep(0.01)


def test_a_command_too_big_for_one_message_is_refused_before_it_is_sent() -> None:
    """A refit naming 20,000 long-named members to a coordinator before 1.3: a contract
    error with code TOO_BIG, never a raw ValueError out of the refit."""
    fleet = FleetClient("tcp://127.0.0.1:9", timeout_s=0.5)
    rows = [[f"node-{i}.{LONG_HOST}", "e0", 1] for i in range(20_000)]
    with pytest.raises(CommandRefused, match="refit_commit command cannot be sent") as refused:
        fleet.call("refit_commit", {"holder": "t", "token": "x", "members": rows})
    assert refused.value.code == protocol.TOO_BIG
    fleet.close()


def test_an_engine_lost_during_the_acquisitions_pause_is_never_committed() -> None:
    """The members are listed before the fleet-wide pause (up to 30 s) and again when it
    answers: an engine that turned suspect meanwhile is not in the client's list, so a compact
    commit (`members_except`) must not record it at the new version either (it used to: the
    lease kept the first listing, and the router got an engine with the old weights)."""
    rows = [{"node_id": "n1", "id": f"e{i}", "incarnation": 1, "tp_size": 1,
             "url": f"http://127.0.0.1:{i + 1}", "process": f"p{i}"} for i in range(3)]
    core, service = Core(rows), RefitService(None)
    core.view.process_of = lambda node, engine, incarnation: f"p{engine[1:]}"
    pauses: list[Any] = []
    core.gather = lambda client, cmd, targets, now, finish=None: (   # type: ignore[method-assign]
        pauses.append(finish) if finish is not None else None)
    service.handle(core, b"client", protocol.Command(   # type: ignore[arg-type]
        "r0", "refit_acquire", {"holder": "t", "version": "v1"}), time.monotonic())
    core.view.nodes["n1"].engines["e1"]["state"] = "suspect"   # while the pause is under way
    pauses.pop()(SimpleNamespace(client=b"client", reply=lambda: protocol.Reply(
        "r0", "ok", None, {"nodes": {}, "missing": []})))
    answer = core.replies[-1]
    given = [(m["node_id"], m["id"]) for m in answer.result["members"]]
    assert given == [("n1", "e0"), ("n1", "e2")]
    committed = core.call(service, "refit_commit", {
        "holder": "t", "token": answer.result["token"], "version": "v1", "members_except": []})
    assert committed.status == "ok" and committed.result["members"] == 2
    assert service.book.version_of("n1", "e1", 1, "p1") is None
    assert service.book.version_of("n1", "e2", 1, "p2") == "v1"


def test_a_member_relaunched_before_the_commit_is_answered_gone_and_not_recorded() -> None:
    """Members the view shows stopped or relaunched at the commit (after their holder read
    their versions back) are not recorded and are answered `gone`; with none left, nothing
    is committed (never a fleet version that no engine holds)."""
    rows = [{"node_id": "n1", "id": f"e{i}", "incarnation": 1, "tp_size": 1,
             "url": f"http://127.0.0.1:{i + 1}", "process": f"p{i}"} for i in range(2)]
    core, service = Core(rows), RefitService(None)
    core.view.process_of = lambda node, engine, incarnation: f"p{engine[1:]}"
    token = core.call(service, "refit_acquire", {"holder": "t", "version": "v1"}
                      ).result["token"]
    core.view.nodes["n1"].engines["e0"]["incarnation"] = 2   # relaunched
    core.view.nodes["n1"].engines["e1"]["state"] = "backoff"   # dead, not relaunched yet
    everyone = {"holder": "t", "token": token, "version": "v1"}
    refused = core.call(service, "refit_commit", {**everyone, "members_except": []})
    assert (refused.code, refused.result) == (protocol.BAD_ARGS,
                                              {"gone": [["n1", "e0", 1], ["n1", "e1", 1]]})
    assert service.book.current is None
    core.view.nodes["n1"].engines["e1"]["state"] = "healthy"
    committed = core.call(service, "refit_commit", {**everyone, "members_except": []})
    assert committed.result == {"version": "v1", "members": 1, "gone": [["n1", "e0", 1]]}
    assert service.book.version_of("n1", "e0", 1, "p0") is None
    assert service.book.version_of("n1", "e1", 1, "p1") == "v1"


def saved_turns(service: RefitService, until: Callable[[], bool]) -> None:
    """The coordinator's loop turns for its refit state: woken by the writer, `saved`."""
    deadline = time.monotonic() + 10
    while not until():
        assert time.monotonic() < deadline, "the refit state was not written within 10 s"
        assert service.wakeup_fd is not None
        select.select([service.wakeup_fd], [], [], 0.5)
        service.saved(time.monotonic())


@pytest.mark.parametrize("disk", ["works", "fails", "hangs"])
def test_the_acquisitions_answer_waits_until_its_members_are_on_disk(
        tmp_path: Path, disk: str) -> None:
    """The members listed when the fleet-wide pause answers are what a commit commits, also
    after a coordinator restart (refit.json): the token goes out only once that listing is on
    disk, and a listing that cannot be written lets the lock go (NOT_SAVED), since a
    restarted coordinator would commit the listing from before the pause. While the save
    hangs, the lease does not run out: its holder has no token to renew it with yet."""
    rows = [{"node_id": "n1", "id": f"e{i}", "incarnation": 1, "tp_size": 1,
             "url": f"http://127.0.0.1:{i + 1}", "process": f"p{i}"} for i in range(3)]
    state = tmp_path / "state"
    core = Core(rows)   # (a hung save is given up after 1 s; the others get the default)
    service = RefitService(str(state), **({"state_write_timeout_s": 1.0} if disk == "hangs"
                                          else {}))
    pauses: list[Any] = []
    gathered: list[str] = []

    def gather(client: bytes | None, cmd: protocol.Command, targets: list[str], now: float,
               finish: Any = None) -> None:
        gathered.append(cmd.cmd)
        if finish is not None:
            pauses.append(finish)
    core.gather = gather   # type: ignore[method-assign]
    service.handle(core, b"client", protocol.Command(   # type: ignore[arg-type]
        "r0", "refit_acquire", {"holder": "t", "version": "v1"}), time.monotonic())
    saved_turns(service, lambda: bool(pauses))   # the lease on disk: the fleet is paused
    core.view.nodes["n1"].engines["e1"]["state"] = "suspect"   # while the pause is under way
    if disk == "fails":
        (state / "refit.json.tmp").mkdir()   # every write of refit.json fails from now on
    if disk == "hangs":   # the writer's open() waits for a reader, as on a hung disk
        os.mkfifo(state / "refit.json.tmp")
    on_disk_when_answered: list[list[str]] = []
    reply = core.reply

    def answered(client: bytes, answer: protocol.Reply) -> None:
        on_disk_when_answered.extend(
            m[:2] for m in json.loads((state / "refit.json").read_text())["in_flight"])
        reply(client, answer)
    core.reply = answered   # type: ignore[method-assign]
    pauses.pop()(SimpleNamespace(client=b"client", reply=lambda: protocol.Reply(
        "r0", "ok", None, {"nodes": {}, "missing": []})))
    if disk == "hangs":
        assert core.replies == []   # (the write cannot have ended: nobody reads the FIFO)
        assert service.lock.expire(time.monotonic() + 600) is None   # no lease clock yet
    try:
        saved_turns(service, lambda: bool(core.replies))
    finally:
        if disk == "hangs":   # the writer let go (its write then fails), and stopped
            os.close(os.open(state / "refit.json.tmp", os.O_RDONLY | os.O_NONBLOCK))
        service.close()
    answer = core.replies[-1]
    if disk == "works":
        assert answer.status == "ok", answer
        assert [m["id"] for m in answer.result["members"]] == ["e0", "e2"]
        assert on_disk_when_answered == [["n1", "e0"], ["n1", "e2"]]
        return
    assert (answer.status, answer.code) == ("error", protocol.NOT_SAVED), answer
    why = ("cannot write" if disk == "fails"
           else f"{state / 'refit.json'} was not written within 1 s")
    assert str(answer.reason).startswith(f"refit lock not taken: {why}")
    assert str(state / "refit.json") in str(answer.reason)
    assert on_disk_when_answered == [["n1", "e0"], ["n1", "e1"], ["n1", "e2"]]   # (before)
    assert service.lock.lease is None and gathered[-1] == "resume"   # let go, pause lifted
