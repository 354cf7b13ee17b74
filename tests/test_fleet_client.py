"""FleetClient against a stand-in coordinator (a real ROUTER on a real port, tests/fleet_standin):
the typed fleet view, commands with typed results and errors, bounded waits, pickling, and an
event stream that follows the coordinator across restarts and never yields an event twice."""

from __future__ import annotations

import logging
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from daemon_harness import EngineSpec, Node, wait_for
from fleet_standin import StandIn, fan_out_ok

from rollout_watchdog import (
    CommandRefused,
    Coordinator,
    CoordinatorUnavailable,
    EngineView,
    FleetClient,
    FleetEvent,
    FleetResult,
)
from rollout_watchdog.common import protocol
from rollout_watchdog.common.keys import keygen
from rollout_watchdog.emulator.testing import free_port


def test_the_fleet_view_is_typed(standin: StandIn) -> None:
    client = FleetClient(standin.endpoint, timeout_s=2.0)
    engines = client.engines()
    assert [e.name for e in engines] == ["n1/e0", "n1/e1", "n2/e0"]
    first = engines[0]
    assert isinstance(first, EngineView)
    assert (first.state, first.pid, first.incarnation, first.tp_size, first.weight_version,
            first.serving, first.reachable) == ("healthy", 4242, 1, 2, "v1", True, True)
    assert engines[1].pid is None and not engines[2].reachable
    nodes = client.nodes()
    assert [(n.node_id, n.reachable) for n in nodes] == [("n1", True), ("n2", False)]
    client.engines(node="n2")
    assert standin.commands[-1].cmd == "status" and standin.commands[-1].node == "n2"


def test_pause_fans_out_with_a_deadline_inside_the_callers(standin: StandIn) -> None:
    client = FleetClient(standin.endpoint, timeout_s=2.0)
    result = client.pause(all=True, deadline_s=30)
    assert isinstance(result, FleetResult) and result.missing == []
    assert sorted(result.nodes) == ["n1", "n2"] and result.nodes["n1"].status == "ok"
    sent = standin.commands[-1]
    assert (sent.cmd, sent.node, sent.engine) == ("pause", None, None)
    assert sent.args["all"] is True and sent.args["deadline_s"] == 30
    # the coordinator gathers, and the node waits for probes, for less than we wait for it
    assert sent.timeout_s is not None and sent.args["wait_s"] < sent.timeout_s < 2.0
    client.restart("n1/e0")
    sent = standin.commands[-1]
    assert (sent.cmd, sent.node, sent.engine, sent.args) == ("restart", "n1", "e0", {})
    client.resume("e1", node="n1")
    assert (standin.commands[-1].node, standin.commands[-1].engine) == ("n1", "e1")
    # "like the CLI": `deadline` as --deadline; --node alone narrows "every engine" to a node
    client.pause(node="n2", deadline=45)
    sent = standin.commands[-1]
    assert (sent.node, sent.engine, sent.args["all"], sent.args["deadline_s"]) == (
        "n2", None, True, 45)
    client.resume(node="n2")
    sent = standin.commands[-1]
    assert (sent.cmd, sent.node, sent.engine, sent.args["all"]) == ("resume", "n2", None, True)


def test_bad_targets_are_refused_before_sending(standin: StandIn) -> None:
    client = FleetClient(standin.endpoint, timeout_s=2.0)
    with pytest.raises(ValueError, match="NODE/ENGINE"):
        client.restart("e0")
    with pytest.raises(ValueError, match="not on node"):
        client.stop("n1/e0", node="n2")
    with pytest.raises(ValueError, match="all"):
        client.pause()
    with pytest.raises(ValueError, match="not both"):
        client.pause("n1/e0", all=True)
    with pytest.raises(ValueError, match="not both"):
        client.pause(all=True, deadline=30, deadline_s=30)
    assert standin.commands == []


def test_a_nan_is_refused_for_what_it_is_and_never_waited_on(standin: StandIn) -> None:
    """A NaN argument cannot be encoded: BAD_ARGS (it said TOO_BIG); wait_until with a NaN
    timeout raises (it polled forever). A command too big for one message is still TOO_BIG."""
    client = FleetClient(standin.endpoint, timeout_s=2.0)
    with pytest.raises(CommandRefused) as refused:
        client.pause(all=True, deadline_s=float("nan"))
    assert refused.value.code == protocol.BAD_ARGS
    with pytest.raises(CommandRefused) as refused:
        client.call("status", {"padding": "x" * protocol.MAX_MESSAGE_BYTES})
    assert refused.value.code == protocol.TOO_BIG
    assert standin.commands == []
    with pytest.raises(ValueError, match="timeout_s"):
        client.wait_until(lambda view: False, float("nan"))


def test_an_error_reply_is_command_refused_with_its_reason(standin: StandIn) -> None:
    standin.answer = lambda c: protocol.Reply(c.request_id, "error", "n2 did not answer", {
        "nodes": {"n1": {"status": "ok", "reason": None, "result": {}}}, "missing": ["n2"]})
    client = FleetClient(standin.endpoint, timeout_s=2.0)
    with pytest.raises(CommandRefused) as refused:
        client.pause(all=True)
    assert refused.value.reason == "n2 did not answer" and refused.value.missing == ["n2"]
    assert refused.value.replies["n1"]["status"] == "ok"


def test_nothing_listening_is_coordinator_unavailable_in_time() -> None:
    """Each call is bounded by its timeout: the client's, or the call's own over a client's
    much longer one (60 s here, so that ignoring the call's would be unmistakable)."""
    address = f"tcp://127.0.0.1:{free_port()}"
    client = FleetClient(address, timeout_s=0.5)
    with pytest.raises(CoordinatorUnavailable, match=rf"{address} within 0.5 s"):
        client.engines()
    patient = FleetClient(address, timeout_s=60.0)
    started = time.monotonic()
    with pytest.raises(CoordinatorUnavailable, match="within 0.3 s"):
        patient.restart("n1/e0", timeout_s=0.3)
    assert time.monotonic() - started < 30   # well before the client's 60 s


def test_a_call_outlives_a_coordinator_restart_with_its_request_id(standin: StandIn) -> None:
    swallowed: list[protocol.Command] = []
    standin.answer = lambda c: swallowed.append(c)
    client = FleetClient(standin.endpoint, timeout_s=5.0)

    def restart_after_the_first() -> None:
        while not swallowed:
            time.sleep(0.01)
        standin.answer = fan_out_ok
        standin.restart("coordinator-boot-2")

    helper = threading.Thread(target=restart_after_the_first, daemon=True)
    helper.start()
    result = client.restart("n1/e0")
    helper.join(5)
    assert [c.request_id for c in standin.commands] == [result.request_id] * 2


def test_wait_until_polls_and_times_out_with_a_message(standin: StandIn) -> None:
    """The wait ends at its own timeout, not after a poll interval or a call's timeout on top
    (both 60 s here, so that either would be unmistakable)."""
    client = FleetClient(standin.endpoint, timeout_s=60.0)
    view = client.wait_until(lambda es: any(e.state == "healthy" for e in es), timeout_s=30.0)
    assert len(view) == 3
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=r"within 0.5 s .*n1/e1=starting"):
        client.wait_until(lambda es: all(e.state == "healthy" for e in es), timeout_s=0.5,
                          interval_s=60.0)
    assert time.monotonic() - started < 30   # well before the 60 s interval


def test_pickles_to_address_and_key_paths_only(standin: StandIn, tmp_path: Path) -> None:
    client = FleetClient(standin.endpoint, timeout_s=2.0)
    client.engines()  # used: it has had sockets, which must not travel
    copy = pickle.loads(pickle.dumps(client))
    assert copy.engines() == client.engines()
    _, secret = keygen(tmp_path, "trainer")
    public, _ = keygen(tmp_path, "coordinator")
    keyed = FleetClient(standin.endpoint, key=str(secret), coordinator_key=str(public))
    data = pickle.dumps(keyed)
    assert keyed.__getstate__() == {"address": standin.endpoint, "key": str(secret),
                                    "coordinator_key": str(public), "timeout_s": 5.0}
    secret_z85 = secret.read_text().split('secret-key = "')[1].split('"')[0]
    assert secret_z85.encode() not in data  # the secret stays in its 0600 file
    assert pickle.loads(data).__getstate__() == keyed.__getstate__()
    with pytest.raises(ValueError, match="both"):
        FleetClient(standin.endpoint, key=str(secret))


def _take(stream: Iterator[FleetEvent], count: int) -> list[FleetEvent]:
    return [next(stream) for _ in range(count)]


def test_events_follow_a_restart_resume_and_come_once(standin: StandIn) -> None:
    client = FleetClient(standin.endpoint, timeout_s=2.0)
    # (silence_s: 10 of the stand-in's heartbeats, so that only its restart resubscribes)
    with client.events(idle_s=10.0, silence_s=2.0) as stream:
        first = iter(stream)
        standin.publish("n1", "b1", 1)   # queued until the stream has subscribed
        standin.publish("n1", "b1", 2, to="healthy", cause="launched")
        standin.node_event("n1", "node_unreachable")
        got = _take(first, 3)
        assert [(e.node_id, e.boot, e.seq, e.kind) for e in got] == [
            ("n1", "b1", 1, "state"), ("n1", "b1", 2, "state"),
            ("n1", "coordinator-boot-1", 1, "node_unreachable")]
        assert got[0].to_json()["boot"] == "b1" and got[0].to_json()["seq"] == 1
        # the coordinator dies; what happened meanwhile is held by the new one, which resends
        # everything (sloppy): the client asks from its last node event and drops the rest
        standin.stop()
        standin.publish("n1", "b1", 3)
        standin.held.append(protocol.Event("n2", "b9", 1, {"kind": "adopted", "engine": "e0"}))
        standin.sloppy = True
        subscribed = len(standin.subscribes)
        standin.restart("coordinator-boot-2")
        standin.node_event("n1", "node_reachable")
        got = _take(first, 3)
        resume = standin.wait_subscribed(subscribed + 1).resume   # the first to the new one
        assert resume == {"n1": protocol.ResumePoint("b1", 2)}  # node events are no resume point
        assert sorted((e.node_id, e.boot, e.seq) for e in got) == [
            ("n1", "b1", 3), ("n1", "coordinator-boot-2", 1), ("n2", "b9", 1)]
        # dropped: seqs 1 and 2 resent, and 3 both resent and relayed (more, if a stalled
        # host made the stream resubscribe once more: each event still came once, above)
        assert stream.duplicates >= 3 and stream.subscriptions >= 2
        standin.publish("n1", "b1", 4)
        assert next(first).seq == 4


def test_bad_frames_are_dropped_counted_and_logged(
        standin: StandIn, caplog: pytest.LogCaptureFixture) -> None:
    """Garbage and a message of the wrong kind ahead of a reply, and amid the events: the
    call and the stream go on, and each says how many it dropped (logged at debug)."""
    client = FleetClient(standin.endpoint, timeout_s=5.0)
    standin.junk = [b"\xff garbage", protocol.encode(protocol.Heartbeat(time.time()))]
    with caplog.at_level(logging.DEBUG, "rollout_watchdog.refit_bridge"):
        assert client.call("ping")[1] == {"coordinator": standin.boot}
        assert client.stats() == {"bad_frames": 2}
        with client.events(idle_s=10.0) as stream:
            first = iter(stream)
            standin.send_raw(b"not json")
            standin.send_raw(protocol.encode(protocol.Ack("b1", 1)))
            standin.publish("n1", "b1", 1)
            assert next(first).seq == 1
            stats = stream.stats()   # (a stalled host may make it subscribe once more)
            assert set(stats) == {"subscriptions", "duplicates", "before_start", "bad_frames"}
            assert stats["bad_frames"] == 2 and stats["subscriptions"] >= 1
    logged = [r.getMessage() for r in caplog.records
              if "dropped a bad frame from the coordinator" in r.getMessage()]
    assert len(logged) == 4, logged
    assert any("not a reply" in line for line in logged)
    assert any("'ack' message, not an event" in line for line in logged)
    client.close()


def test_an_idle_stream_ends_when_asked(standin: StandIn) -> None:
    client = FleetClient(standin.endpoint, timeout_s=2.0)
    started = time.monotonic()
    with client.events(idle_s=0.5) as stream:
        assert list(stream) == []   # it ends (the stand-in's heartbeats are no events)
    assert time.monotonic() - started >= 0.5   # not before it was idle that long


# -- against the real coordinator and real node daemons over emulator engines


def _state(client: FleetClient, name: str, state: str, timeout_s: float = 60.0) -> EngineView:
    view = client.wait_until(lambda es: any(e.name == name and e.state == state for e in es),
                             timeout_s)
    return next(e for e in view if e.name == name)


def _next_matching(stream: Iterator[FleetEvent], what: str, **match: object) -> FleetEvent:
    for event in stream:  # the stream's idle_s bounds this
        if all(getattr(event, k) == v for k, v in match.items()):
            return event
    raise AssertionError(f"no {what} ({match}) before the stream went idle")


def _until(stream: Iterator[FleetEvent], into: list[FleetEvent], **match: object) -> None:
    """Collect events into `into` up to and with the first that matches `match`."""
    for event in stream:  # the stream's idle_s bounds this
        into.append(event)
        if all(getattr(event, k) == v for k, v in match.items()):
            return
    raise AssertionError(f"no event with {match} before the stream went idle")


def test_a_real_fleet_commands_and_events(make_node: Callable[..., Node]) -> None:
    with Coordinator(bind="tcp://127.0.0.1:0") as coordinator:
        node = make_node([EngineSpec("e0")], node_id="n1",
                         top={"coordinator": coordinator.endpoint}).start()
        client = FleetClient(coordinator.endpoint, timeout_s=5.0)
        with client.events(idle_s=30.0) as stream:
            healthy = _state(client, "n1/e0", "healthy")
            assert healthy.reachable and healthy.pid == node.engine("e0")["pid"]
            os.kill(healthy.pid or 0, signal.SIGKILL)
            died = _next_matching(stream, "the failure", node_id="n1", to="stopping")
            assert (died.engine, died.cause, died.incarnation) == ("e0", "exited",
                                                                   healthy.incarnation)
        back = _state(client, "n1/e0", "healthy")
        assert back.incarnation == healthy.incarnation + 1
        paused = client.pause(all=True, deadline_s=60)
        assert paused.nodes["n1"].status == "ok" and paused.nodes["n1"].result["paused"] == ["e0"]
        assert client.engines()[0].paused
        client.resume("n1/e0")
        with pytest.raises(CommandRefused, match="no engine 'nope'"):
            client.restart("n1/nope")
        with pytest.raises(CommandRefused, match="unknown node 'n9'"):
            client.restart("n9/e0")


def test_events_follow_a_real_coordinator_restart_once(make_node: Callable[..., Node]) -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    coordinators = [Coordinator(bind=endpoint)]
    coordinators[0].start()
    try:
        client = FleetClient(endpoint, timeout_s=5.0)
        with client.events(idle_s=30.0) as stream:
            wait_for(lambda: coordinators[0].relay.subscribers, 10, "the subscription")
            node = make_node([EngineSpec("e0")], node_id="n1",
                             top={"coordinator": endpoint}).start()
            got: list[FleetEvent] = []
            _until(stream, got, node_id="n1", to="healthy", incarnation=1)
            coordinators[0].stop()       # gone while the engine dies and comes back
            os.kill(node.engine("e0")["pid"], signal.SIGKILL)
            node.wait_state("e0", "healthy", incarnation=2)
            coordinators.append(Coordinator(bind=endpoint))
            coordinators[1].start()
            _until(stream, got, node_id="n1", to="healthy", incarnation=2)
        from_node = [e for e in got if not e.is_node_event]
        # every event of the node's boot, in order, once: nothing lost, nothing doubled
        assert [e.seq for e in from_node] == list(range(1, len(from_node) + 1))
        assert len({e.boot for e in from_node}) == 1
        assert [e.to for e in from_node if e.kind == "state"] == [
            e["to"] for e in node.events("e0") if e["kind"] == "state"]
        assert stream.subscriptions >= 2
    finally:
        for coordinator in coordinators:
            coordinator.stop()


def test_a_follower_gets_nothing_older_than_itself_from_a_restarted_coordinator(
        make_node: Callable[..., Node], tmp_path: Path) -> None:
    """A coordinator with a state dir, restarted, sent a follower everything its journal held
    of the nodes the follower had no event of, and its own node events: a follower started at
    T printed events from minutes before T (found by a contract review). Now only what came
    after it, and nothing lost: the crash during the outage comes, once."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    state = str(tmp_path / "coordinator")
    coordinators = [Coordinator(bind=endpoint, state_dir=state)]
    coordinators[0].start()
    try:
        node = make_node([EngineSpec("e0")], node_id="n1", top={"coordinator": endpoint}).start()
        client = FleetClient(endpoint, timeout_s=5.0)
        wait_for(lambda: any(e.state == "healthy" for e in client.engines()), 60, "n1/e0 up")
        with client.events(idle_s=30.0) as stream:
            wait_for(lambda: coordinators[0].relay.subscribers, 10, "the subscription")
            coordinators[0].stop()   # away while the engine dies and comes back
            os.kill(node.engine("e0")["pid"], signal.SIGKILL)
            node.wait_state("e0", "healthy", incarnation=2)
            coordinators.append(Coordinator(bind=endpoint, state_dir=state))
            coordinators[1].start()
            got: list[FleetEvent] = []
            _until(stream, got, node_id="n1", to="healthy", incarnation=2)
        assert stream.subscriptions >= 2
        old = [(e.kind, e.to, e.incarnation) for e in got
               if e.ts is not None and e.ts < stream.created]
        assert old == [], f"events from before the follower: {old}"
        assert [e.to for e in got if e.kind == "state"] == ["stopping", "backoff", "starting",
                                                              "healthy"]
    finally:
        for coordinator in coordinators:
            coordinator.stop()


def test_curve_admits_the_listed_key_only(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keygen(keys, "coordinator")
    _, trainer = keygen(keys, "trainer")
    _, stranger = keygen(tmp_path / "other", "stranger")
    (keys / "authorized").mkdir()
    (keys / "authorized" / "trainer.key").write_text((keys / "trainer.key").read_text())
    coordinator_key = str(keys / "coordinator.key")
    with Coordinator(bind="tcp://127.0.0.1:0", keys=str(keys)) as coordinator:
        ep = coordinator.endpoint
        assert FleetClient(ep, str(trainer), coordinator_key, timeout_s=5.0).engines() == []
        # (each error says which way the keys do not match; 5 s: the coordinator's ZAP thread
        # must refuse the stranger before the call's timeout on a loaded host, 2 s: a dropped
        # handshake is seen within milliseconds of the connection)
        with pytest.raises(CoordinatorUnavailable, match="refused this side's key"):
            FleetClient(ep, str(stranger), coordinator_key, timeout_s=5.0).engines()
        with pytest.raises(CoordinatorUnavailable, match="requires CURVE keys: none are set"):
            FleetClient(ep, timeout_s=2.0).engines()
        other_coordinator = str(tmp_path / "other" / "stranger.key")   # not this one's key
        with pytest.raises(CoordinatorUnavailable, match="key set on this side is its public"):
            FleetClient(ep, str(trainer), other_coordinator, timeout_s=2.0).engines()
    with Coordinator(bind="tcp://127.0.0.1:0") as plain, \
            pytest.raises(CoordinatorUnavailable, match="the coordinator runs with keys"):
        FleetClient(plain.endpoint, str(trainer), coordinator_key, timeout_s=2.0).engines()


def test_the_package_root_loads_the_fleet_api_on_first_use() -> None:
    code = ("import sys, rollout_watchdog as rw; "
            "light = 'rollout_watchdog.refit_bridge.client' not in sys.modules "
            "and 'zmq' not in sys.modules; rw.FleetClient; rw.CommandRefused; "
            "print(light, 'rollout_watchdog.refit_bridge.client' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.stdout.split() == ["True", "True"], out.stderr


def test_a_fleet_event_reads_like_its_json_object() -> None:
    """DESIGN calls events JSON objects: a test written from it may say event["kind"]."""
    obj = {"ts": 1.5, "node_id": "n1", "engine": "e0", "incarnation": 2, "kind": "state",
           "from": "healthy", "to": "stopping", "cause": "exited", "detail": "gone"}
    event = FleetEvent.from_json("n1", "b1", 7, obj)
    assert (event["kind"], event["from"], event["to"], event["boot"], event["seq"]) == (
        "state", "healthy", "stopping", "b1", 7)
    assert event.get("cause") == "exited" and event.get("nope", 3) == 3
    assert "from" in event and "nope" not in event
    assert dict(event) == {**obj, "boot": "b1", "seq": 7}
    assert list(event) == list(event.keys()) and len(event) == len(obj) + 2
    with pytest.raises(KeyError):
        event["nope"]
