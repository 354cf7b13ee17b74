"""The refit lock and the weight book: pure logic first, then the coordinator's refit commands
against real node daemons with emulator engines (docs: refit_bridge/service.py)."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from daemon_harness import EngineSpec, Node, wait_for
from test_coordinator import Peer, all_healthy, engines_of, fleet_of

from rollout_watchdog.common import protocol
from rollout_watchdog.emulator.testing import free_port
from rollout_watchdog.refit_bridge.coordinator import Coordinator
from rollout_watchdog.refit_bridge.fleet import FleetView
from rollout_watchdog.refit_bridge.lock import Fenced, LockHeld, RefitLock
from rollout_watchdog.refit_bridge.membership import RESTORED_WAIT_S, restored_due
from rollout_watchdog.refit_bridge.weights import RefitState, Unfinished, WeightBook

# ---------------------------------------------------------------------- pure logic


def test_a_lease_of_an_earlier_start_is_known_ended_once_a_holder_got_a_token_since() -> None:
    """refit_putback's question: may anyone have put that lease's members back? This start's
    own leases ended here; after a lease of this start was granted, its holder took (and
    continued) them. An acquisition never answered with its token (too big, not saved) let
    nobody act: it does not count."""
    lock = RefitLock(next_token=3)
    earlier = "0123456789abcdef-2-00ff"
    assert lock.ended_lease(earlier) is None
    unanswered = lock.acquire("trainer-a", "v1", lease_s=10.0, now=0.0)
    lock.lease = None   # (let go: its answer could not be sent)
    assert lock.ended_lease(earlier) is None
    assert "ended at this coordinator" in str(lock.ended_lease(unanswered.token))
    lock.grant(lock.acquire("trainer-b", "v1", lease_s=10.0, now=1.0), 1.0)
    assert "a later refit took the lock" in str(lock.ended_lease(earlier))


def test_one_holder_at_a_time_and_a_late_holder_is_fenced() -> None:
    lock = RefitLock(next_token=7, holder_timeout_s=5.0)
    first = lock.acquire("trainer-a", "v1", lease_s=10.0, now=0.0)
    assert first.number == 7 and first.token.startswith(f"{lock.epoch}-7-")
    assert lock.expire(now=30.0) is None          # its fleet-wide pause is not answered yet
    first.granted(0.0)
    with pytest.raises(LockHeld, match="held by trainer-a") as held:
        lock.acquire("trainer-b", "v1", lease_s=10.0, now=1.0)
    assert first.token not in str(held.value)     # the token is its holder's alone
    lock.renew(first.token, "trainer-a", now=4.0)
    lock.renew(first.token, "trainer-a", now=8.0)
    assert lock.expire(now=12.0) is None          # renewed at 8: ends at 18
    ended = lock.expire(now=13.5)                 # ... but silent since 8, for 5.5 s
    assert ended is not None and "silent" in ended[1]
    second = lock.acquire("trainer-b", "v2", lease_s=10.0, now=14.0)
    second.granted(14.0)
    assert second.number == 8
    with pytest.raises(Fenced, match="lease lost: trainer-a with token") as fenced:
        lock.renew(first.token, "trainer-a", now=14.5)
    assert second.token not in str(fenced.value)
    with pytest.raises(Fenced, match="lease lost: trainer-a"):   # the token, not its holder
        lock.renew(second.token, "trainer-a", now=14.5)
    with pytest.raises(Fenced, match="names no holder"):
        lock.renew(second.token, None, now=14.5)
    lock.renew(second.token, "trainer-b", now=15.0)
    assert lock.expire(now=19.0) is None
    ended = lock.expire(now=25.0)
    assert ended is not None and "ran out" in ended[1]
    with pytest.raises(ValueError, match="lease_s"):
        lock.acquire("trainer-c", "v3", lease_s=0.0, now=30.0)


def test_tokens_never_repeat_across_restarts_even_from_the_same_counter() -> None:
    """A restarted coordinator without a state dir counts from 1 again: its epoch differs."""
    before = RefitLock().acquire("trainer-a", "v1", lease_s=10.0, now=0.0)
    after = RefitLock().acquire("trainer-b", "v1", lease_s=10.0, now=0.0)
    assert before.number == after.number == 1 and before.token != after.token


def test_weight_book_serving_pending_and_stale() -> None:
    book = WeightBook()
    healthy = {"id": "e0", "state": "healthy", "incarnation": 1}
    assert book.serving("n", healthy)                # no refit yet: disk weights serve
    book.commit("v1", [("n", "e0", 1)])
    assert book.serving("n", healthy) and book.version_of("n", "e0", 1) == "v1"
    reborn = {**healthy, "incarnation": 2}
    assert not book.serving("n", reborn)             # pending_weights
    assert book.version_of("n", "e0", 2) is None
    book.commit("v2", [("n", "e1", 1)])
    assert not book.serving("n", healthy)            # still at v1: stale
    book.stale([("n", "e1", 1)])
    assert not book.serving("n", {"id": "e1", "state": "healthy", "incarnation": 1})
    assert not book.serving("n", {**healthy, "state": "starting"})
    fresh = WeightBook()
    fresh.stale([("n", "e0", 1)])                   # an aborted first refit reached it
    assert not fresh.serving("n", healthy)
    assert fresh.serving("n", {**healthy, "incarnation": 2})   # relaunched from disk


def test_refit_state_survives_a_restart_and_a_broken_file_is_named(tmp_path: Path) -> None:
    state = RefitState(str(tmp_path))
    book = WeightBook()
    book.commit("v1", [("n", "e0", 1), ("n", "e1", 3)])
    assert state.writer is not None
    unfinished = Unfinished(11, "trainer-a", "v2", "refit-0a1b", False, [])
    state.writer.write_now(state.encode(book, 12, [("n", "e1", 3)], unfinished))
    loaded, token, in_flight, saved = state.load()
    assert token == 12 and loaded.current == "v1" and in_flight == [("n", "e1", 3)]
    assert saved == unfinished   # the lease a restarted coordinator ends as its expiry would
    assert loaded.version_of("n", "e0", 1) == "v1"
    (tmp_path / "refit.json").write_text("{not json")
    with pytest.raises(ValueError, match="refit.json"):
        state.load()
    (tmp_path / "refit.json").write_text(json.dumps(
        {"next_token": 3, "weights": {"current": "v1", "held": [["n", "e0", "one", "v1"]]}}))
    with pytest.raises(ValueError, match="refit.json.*incarnation"):
        state.load()
    (tmp_path / "refit.json").write_text(json.dumps(
        {"next_token": 3, "unfinished": {"number": 2, "holder": "a", "version": "v1"}}))
    with pytest.raises(ValueError, match="refit.json.*unfinished.*pause_owner"):
        state.load()


def test_a_restored_lease_waits_for_its_members_nodes_not_only_a_node_timeout() -> None:
    """A lease found on disk ended a node timeout after the start: on a loaded host its node
    said hello later, no member URL was known, and its members stayed paused (a suite run).
    Now it waits for its members' nodes, up to RESTORED_WAIT_S."""
    view = FleetView(node_timeout_s=3.0)
    view.expected |= {"n1", "n2"}
    members = [("n1", "e0", 1)]
    assert not restored_due(view, members, 100.0, 104.0)   # past a node timeout, n1 away
    view.hello(protocol.Hello("n1", "b1", [], 0), "n1", 104.0, 0.0)
    assert restored_due(view, members, 100.0, 104.0)       # (n2 holds no member)
    assert restored_due(FleetView(node_timeout_s=3.0), members, 100.0, 100.0 + RESTORED_WAIT_S)
    assert restored_due(view, [], 100.0, 104.0)            # no member: the view's own wait


# ---------------------------------------------------------------------- the coordinator


def two_engines(i: int) -> list[EngineSpec]:
    return [EngineSpec("e0"), EngineSpec("e1")]


def ok(reply: Any) -> dict[str, Any]:
    assert reply is not None and reply.status == "ok", reply
    return dict(reply.result)


def members(result: dict[str, Any]) -> list[list[Any]]:
    return [[m["node_id"], m["id"], m["incarnation"]] for m in result["members"]]


def test_lock_commit_abort_and_wedged_restart_against_real_nodes(
        make_node: Callable[..., Node]) -> None:
    with Coordinator(bind="tcp://127.0.0.1:0", node_timeout_s=3.0) as coordinator:
        client = Peer(coordinator.endpoint)
        try:
            fleet_of(make_node, coordinator.endpoint, 1, engines=two_engines)
            wait_for(all_healthy(client, 2), 60, "the fleet healthy")
            taken = ok(client.call("refit_acquire", args={"holder": "trainer-a",
                                                          "version": "v1", "lease_s": 30}))
            token = taken["token"]
            assert sorted(m["id"] for m in taken["members"]) == ["e0", "e1"]
            assert all(e["paused"] for e in engines_of(client.fleet()).values())
            held = client.call("refit_acquire", args={"holder": "trainer-b", "version": "v1"})
            assert held is not None and held.status == "error"
            assert "trainer-a" in str(held.reason) and held.result["holder"] == "trainer-a"
            assert token not in json.dumps([held.reason, held.result])
            assert token not in json.dumps(ok(client.call("ping")))

            committed = ok(client.call("refit_commit", args={
                "holder": "trainer-a", "token": token, "version": "v1",
                "members": members(taken), "release": True}))
            assert committed["released"] == token   # the lock too, in the same call
            view = engines_of(client.fleet())
            assert {(e["weight_version"], e["serving"]) for e in view.values()} == {("v1", True)}
            wait_for(lambda: not any(e["paused"] for e in engines_of(client.fleet()).values()),
                     10, "deep probes resumed")
            late = client.call("refit_commit", args={"holder": "trainer-a", "token": token,
                                                     "version": "v9", "members": members(taken)})
            assert late is not None and late.status == "error"
            assert str(late.reason).startswith("lease lost")

            # e0 dies and comes back: pending_weights, out of service; e1 still serves v1.
            before = view["node0/e0"]["incarnation"]
            os.kill(view["node0/e0"]["pid"], signal.SIGKILL)
            wait_for(lambda: (e := engines_of(client.fleet())["node0/e0"])["incarnation"]
                     > before and e["state"] == "healthy", 30, "e0 back")
            view = engines_of(client.fleet())
            assert (view["node0/e0"]["weight_version"], view["node0/e0"]["serving"]) \
                == (None, False)
            assert view["node0/e1"]["serving"]

            # A refit aborted with e1 wedged: both stale, e1 restarted with refit_wedged.
            second = ok(client.call("refit_acquire", args={"holder": "trainer-b",
                                                           "version": "v2"}))
            assert second["token"] != token
            e1 = next(m for m in members(second) if m[1] == "e1")
            ok(client.call("refit_abort", args={"holder": "trainer-b", "token": second["token"],
                                                "members": members(second), "wedged": [e1],
                                                "reason": "deadline"}))
            # Renewed while waiting: on a loaded host the restart may take more than 5 s.
            renew = {"holder": "trainer-b", "token": second["token"]}
            wait_for(lambda: ok(client.call("refit_renew", args=renew)) and (
                (e := engines_of(client.fleet())["node0/e1"])["last_failure"]
                or {}).get("cause") == "refit_wedged"
                and e["incarnation"] > e1[2] and e["state"] == "healthy", 60,
                "e1 restarted as refit_wedged")
            late = client.call("refit_commit", args={   # (the hostile run's: it was taken)
                **renew, "version": "v2", "members": members(second)})
            assert late is not None and late.status == "error", late
            assert "was aborted" in str(late.reason) and late.code == "BAD_ARGS"
            ok(client.call("refit_release", args={"holder": "trainer-b",
                                                  "token": second["token"]}))
            view = engines_of(client.fleet())
            assert not view["node0/e0"]["serving"] and not view["node0/e1"]["serving"]
        finally:
            client.close()


def test_an_expired_lease_frees_the_lock_and_its_members_stay_stale_across_a_restart(
        make_node: Callable[..., Node], tmp_path: Path) -> None:
    port = free_port()
    state = tmp_path / "coord"
    endpoint = f"tcp://127.0.0.1:{port}"
    with Coordinator(bind=endpoint, node_timeout_s=3.0, state_dir=str(state)) as coordinator:
        client = Peer(coordinator.endpoint)
        try:
            fleet_of(make_node, endpoint, 1, engines=two_engines)
            wait_for(all_healthy(client, 2), 60, "the fleet healthy")
            first = ok(client.call("refit_acquire", args={"holder": "a", "version": "v1"}))
            ok(client.call("refit_commit", args={"holder": "a", "token": first["token"],
                                                 "version": "v1", "members": members(first)}))
            ok(client.call("refit_release", args={"holder": "a", "token": first["token"]}))
            # A holder that dies mid-refit: its 1 s lease ends, the lock is free again.
            dying = ok(client.call("refit_acquire", args={"holder": "dies", "version": "v2",
                                                          "lease_s": 1.0}))
            after = wait_for(lambda: (r := client.call("refit_acquire", args={
                "holder": "next", "version": "v2"})) is not None and r.status == "ok" and r,
                20, "the lock free after the lease")
            assert after.result["token"] != dying["token"]
            stale = client.call("refit_renew", args={"holder": "dies", "token": dying["token"]})
            assert stale is not None and str(stale.reason).startswith("lease lost")
            assert {e["serving"] for e in engines_of(client.fleet()).values()} == {False}
            # The coordinator stops while "next" holds the lock.
        finally:
            client.close()
    saved = json.loads((state / "refit.json").read_text())
    assert saved["in_flight"]
    with Coordinator(bind=endpoint, node_timeout_s=3.0, state_dir=str(state)) as coordinator:
        client = Peer(coordinator.endpoint)
        try:
            wait_for(lambda: len(engines_of(client.fleet())) == 2, 20, "the nodes back")
            view = engines_of(client.fleet())
            assert {(e["weight_version"], e["serving"]) for e in view.values()} \
                == {(None, False)}
            # (once the restarted coordinator put back the members of the lease it found)
            again = wait_for(lambda: (r := client.call("refit_acquire", args={
                "holder": "z", "version": "v3"})) is not None and r.status == "ok" and r,
                20, "the lock free after the put-back")
            assert again.result["token"] != after.result["token"]
        finally:
            client.close()


def test_the_rendezvous_address_is_toward_the_coordinator_unless_only_the_engines_are_remote(
        ) -> None:
    from rollout_watchdog.refit_bridge.rendezvous import address_toward, master_address_for
    local = ["http://127.0.0.1:30000"]
    assert master_address_for("tcp://127.0.0.1:5555", local) == "127.0.0.1"
    # An embedded (loopback) coordinator with engines on another host: the route to them.
    remote = ["http://127.0.0.1:30000", "http://10.255.255.1:30000"]
    assert master_address_for("tcp://127.0.0.1:5555", remote) \
        == address_toward("http://10.255.255.1:30000")


def test_the_holder_timeout_is_set_on_the_command_line(tmp_path: Path) -> None:
    """`coordinator --holder-timeout 1`: a holder that goes silent loses the lock after 1 s of
    silence (said in the coordinator's log), long before its 600 s lease ends."""
    from fleet_harness import start_coordinator_process

    log = tmp_path / "coordinator.log"
    coord = start_coordinator_process(f"tcp://127.0.0.1:{free_port()}", ["--holder-timeout", "1"],
                                      log_path=log)
    try:
        gone = Peer(coord.endpoint)
        ok(gone.call("refit_acquire", args={"holder": "trainer-a", "version": "v1",
                                            "lease_s": 600}))
        gone.close()   # no renewal from now on
        late = Peer(coord.endpoint)
        try:
            def taken() -> bool:
                reply = late.call("refit_acquire", args={"holder": "trainer-b", "version": "v1"})
                return reply is not None and reply.status == "ok"
            wait_for(taken, 30, "the silent holder's lock released")
        finally:
            late.close()
        wait_for(lambda: "holder was silent for 1 s" in log.read_text(), 15,
                 "the release's log line (written by the log's own thread)")
    finally:
        coord.cleanup()
