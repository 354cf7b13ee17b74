"""The coordinator against real node daemons with emulator engines (each a process of its own),
over loopback TCP: what a driver sees of the fleet, what it can command, and what it cannot do
without the right key."""

from __future__ import annotations

import json
import os
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.auth
from daemon_harness import EngineSpec, Node, wait_for
from fleet_harness import start_coordinator_process

from rollout_watchdog.agent.acks import ACK_AFTER_EVENTS
from rollout_watchdog.agent.fanout import node_request_id
from rollout_watchdog.agent.hub import STALL_GRACE_S
from rollout_watchdog.common import lines, protocol
from rollout_watchdog.common.keys import keygen
from rollout_watchdog.emulator.testing import emulator_info, free_port, inject_fault
from rollout_watchdog.refit_bridge.coordinator import Coordinator


class Peer:
    """A client of the coordinator speaking the wire protocol directly (a DEALER)."""

    def __init__(self, endpoint: str, curve: tuple[bytes, bytes, bytes] | None = None) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.linger = 0
        if curve is not None:
            self.sock.curve_publickey, self.sock.curve_secretkey, self.sock.curve_serverkey = curve
        self.sock.connect(endpoint)
        self.events: list[protocol.Event] = []
        self.frames: list[bytes] = []   # every frame received, as it came

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()

    def call(self, cmd: str, timeout: float = 10.0, request_id: str | None = None,
             **fields: Any) -> protocol.Reply | None:
        """The reply to one command, or None if none came in time."""
        request_id = request_id or uuid.uuid4().hex
        try:  # a refused peer has no connection: nothing can even be queued
            self.sock.send(protocol.encode(protocol.Command(request_id, cmd, **fields)),
                           zmq.NOBLOCK)
        except zmq.Again:
            return None
        found = None

        def reply() -> protocol.Reply | None:
            nonlocal found
            self.pump(0.05)
            return found

        def keep(message: protocol.Message) -> None:
            nonlocal found
            if isinstance(message, protocol.Reply) and message.request_id == request_id:
                found = message
        self._keep = keep
        try:
            return wait_for(reply, timeout, f"the reply to {cmd}")
        except AssertionError:
            return None
        finally:
            self._keep = None

    _keep: Callable[[protocol.Message], None] | None = None

    def pump(self, wait_s: float) -> None:
        while self.sock.poll(int(wait_s * 1000)):
            self.frames.append(self.sock.recv())
            message = protocol.decode(self.frames[-1])
            if isinstance(message, protocol.Event):
                self.events.append(message)
            elif isinstance(message, protocol.Events):
                self.events.extend(message.events)
            elif self._keep is not None:
                self._keep(message)
            wait_s = 0

    def wait_event(self, match: Callable[[dict[str, Any]], bool], what: str,
                   timeout: float = 20.0) -> protocol.Event:
        def found() -> protocol.Event | None:
            self.pump(0.05)
            return next((e for e in self.events if match(e.event)), None)
        return wait_for(found, timeout, what)

    def fleet(self) -> dict[str, Any]:
        reply = self.call("status")
        assert reply is not None and reply.status == "ok", reply
        return dict(reply.result)


def engines_of(fleet: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {f"{n['node_id']}/{e['id']}": e for n in fleet["nodes"] for e in n["engines"]}


class RawNode:
    """A node speaking the wire protocol directly (a DEALER with its routing id)."""

    def __init__(self, endpoint: str, node_id: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.linger, self.sock.routing_id = 0, node_id.encode()
        self.sock.connect(endpoint)

    def send(self, message: protocol.Message) -> None:
        self.sock.send(protocol.encode(message))

    def acked(self, seq: int | None = None) -> protocol.Ack:
        """The coordinator's ACK of `seq` (waited for); with None, its next ACK."""
        def ack() -> protocol.Ack | None:
            while self.sock.poll(50):
                message = protocol.decode(self.sock.recv())
                if isinstance(message, protocol.Ack) and seq in (None, message.seq):
                    return message
            return None
        found: protocol.Ack = wait_for(ack, 10, f"the ACK of seq {seq}")
        return found

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


@pytest.fixture
def client(coordinator: Coordinator) -> Iterator[Peer]:
    peer = Peer(coordinator.endpoint)
    yield peer
    peer.close()


def fleet_of(make_node: Callable[..., Node], endpoint: str, count: int,
             engines: Callable[[int], list[EngineSpec]] | None = None, **kwargs: Any
             ) -> list[Node]:
    nodes = [make_node(engines(i) if engines else [EngineSpec("e0")], node_id=f"node{i}",
                       top={"coordinator": endpoint, **kwargs.pop("top", {})}, **kwargs)
             for i in range(count)]
    for node in nodes:
        node.start()
    return nodes


def all_healthy(client: Peer, count: int) -> Callable[[], bool]:
    def check() -> bool:
        states = [e["state"] for e in engines_of(client.fleet()).values()]
        return len(states) == count and set(states) == {"healthy"}
    return check


def test_an_engine_sigkilled_on_a_node_reaches_a_subscriber_with_cause_and_incarnation(
        make_node: Callable[..., Node], coordinator: Coordinator, client: Peer) -> None:
    fleet_of(make_node, coordinator.endpoint, 2)
    wait_for(all_healthy(client, 2), 60, "both nodes' engines healthy in the fleet view")
    client.sock.send(protocol.encode(protocol.Subscribe()))
    wait_for(lambda: client.call("ping").result["subscribers"] == 1, 10, "the subscription")
    victim = engines_of(client.fleet())["node1/e0"]
    os.kill(victim["pid"], signal.SIGKILL)

    died = client.wait_event(lambda e: e["engine"] == "e0" and e["kind"] == "state"
                             and e["to"] == "stopping", "the crash event")
    assert (died.node_id, died.event["cause"], died.event["incarnation"]) == (
        "node1", "exited", victim["incarnation"])
    assert died.boot and died.seq >= 1
    back = client.wait_event(lambda e: e["to"] == "healthy" and e["node_id"] == "node1",
                             "the relaunch")
    assert back.event["incarnation"] == victim["incarnation"] + 1
    view = engines_of(client.fleet())["node1/e0"]
    assert (view["state"], view["incarnation"]) == ("healthy", victim["incarnation"] + 1)
    assert view["pid"] not in (None, victim["pid"])
    seqs = [e.seq for e in client.events if e.node_id == "node1" and e.boot == died.boot]
    assert seqs == sorted(set(seqs)), "events of one node arrive in order, each once"


def test_fleet_view_shape_and_unreachable_node(make_node: Callable[..., Node],
                                               coordinator: Coordinator, client: Peer) -> None:
    nodes = fleet_of(make_node, coordinator.endpoint, 2)
    wait_for(all_healthy(client, 2), 60, "the fleet healthy")
    fleet = client.fleet()
    assert [n["node_id"] for n in fleet["nodes"]] == ["node0", "node1"]
    for node in fleet["nodes"]:
        assert {"node_id", "reachable", "last_seen", "engines"} <= node.keys()
        for engine in node["engines"]:
            assert {"id", "state", "paused", "pid", "incarnation", "restarts", "url",
                    "last_failure", "weight_version", "serving"} <= engine.keys()
    client.sock.send(protocol.encode(protocol.Subscribe()))
    wait_for(lambda: client.call("ping").result["subscribers"] == 1, 10, "the subscription")

    assert nodes[1].proc is not None
    nodes[1].proc.send_signal(signal.SIGSTOP)   # silent, connection open: a hung node
    try:
        client.wait_event(lambda e: e["kind"] == "node_unreachable" and e["node_id"] == "node1",
                          "node1 unreachable")
        node1 = next(n for n in client.fleet()["nodes"] if n["node_id"] == "node1")
        assert node1["reachable"] is False
        assert [(e["reachable"], e["state"], e["serving"]) for e in node1["engines"]] \
            == [(False, "healthy", False)]   # listed, flagged, as last heard; not routed
        refused = client.call("restart", node="node1", engine="e0")
        assert refused is not None and refused.status == "error"
        assert "unreachable" in str(refused.reason)
    finally:
        nodes[1].proc.send_signal(signal.SIGCONT)
    back = client.wait_event(lambda e: e["kind"] == "node_reachable" and e["node_id"] == "node1"
                             and "silence" in e["detail"], "node1 reachable again")
    assert back.event["engine"] is None


def test_commands_fan_out_and_name_what_failed(make_node: Callable[..., Node],
                                                coordinator: Coordinator, client: Peer) -> None:
    fleet_of(make_node, coordinator.endpoint, 2)
    wait_for(all_healthy(client, 2), 60, "the fleet healthy")
    paused = client.call("pause", args={"all": True})
    assert paused is not None and paused.status == "ok", paused
    assert set(paused.result["nodes"]) == {"node0", "node1"}
    # Pause events come without the engine's status: the view takes what they say.
    deadlines = {n: r["result"]["deadline"] for n, r in paused.result["nodes"].items()}
    view = engines_of(client.fleet())
    assert all(e["paused"] and e["pause_deadline"] == deadlines[name.split("/")[0]]
               for name, e in view.items()), view
    resumed = client.call("resume", args={"all": True})
    assert resumed is not None and resumed.status == "ok"
    assert not any(e["paused"] or e["pause_deadline"] for e in engines_of(client.fleet()).values())

    before = engines_of(client.fleet())["node0/e0"]["incarnation"]
    restarted = client.call("restart", node="node0", engine="e0")
    assert restarted is not None and restarted.status == "ok", restarted
    wait_for(lambda: engines_of(client.fleet())["node0/e0"]["incarnation"] == before + 1
             and engines_of(client.fleet())["node0/e0"]["state"] == "healthy", 30,
             "node0/e0 restarted")

    wrong = client.call("restart", node="node0", engine="nope")
    assert wrong is not None and wrong.status == "error" and "node0" in str(wrong.reason)
    unknown = client.call("frobnicate", node="node0")
    assert unknown is not None and "unknown command" in str(unknown.reason)
    stranger = client.call("restart", node="node9", engine="e0")
    assert stranger is not None and "unknown node 'node9'" in str(stranger.reason)

    # A repeated request id gets the same reply, and nothing is done twice.
    incarnation = engines_of(client.fleet())["node1/e0"]["incarnation"] + 1
    first = client.call("restart", request_id="same-id", node="node1", engine="e0")
    wait_for(lambda: (e := engines_of(client.fleet())["node1/e0"])["state"] == "healthy"
             and e["incarnation"] == incarnation, 30, "node1/e0 restarted once")
    again = client.call("restart", request_id="same-id", node="node1", engine="e0")
    assert again == first                                # the remembered reply
    assert engines_of(client.fleet())["node1/e0"]["incarnation"] == incarnation


def test_fleet_pause_waits_for_the_inflight_probe(make_node: Callable[..., Node],
                                                 coordinator: Coordinator, client: Peer) -> None:
    """With each probe taking about 4 s (slow tokens) and one in flight, a pause given less
    time than that is refused naming the node; one given more is acknowledged once the probe
    is done. (4 s: the probe is still in flight half a second after it was seen, even when a
    loaded host sees it late.)"""
    (node,) = fleet_of(make_node, coordinator.endpoint, 1,
                       probe={"health_timeout_s": 10.0, "health_interval_s": 0.1},
                       env={"SGLANG_HEALTH_CHECK_TIMEOUT": "20"})
    wait_for(all_healthy(client, 1), 60, "the engine healthy")
    url = node.engines["e0"].url
    inject_fault(url, "token_latency", ms=4000)
    wait_for(lambda: emulator_info(url)["num_pending"] >= 1, 10, "a slow probe in flight")
    short = client.call("pause", args={"all": True}, timeout_s=0.5)
    assert short is not None and short.status == "error"
    assert "node0" in str(short.reason)
    long = client.call("pause", timeout=20.0, args={"all": True}, timeout_s=15.0)
    assert long is not None and long.status == "ok", long
    assert long.result["nodes"]["node0"]["result"]["paused"] == ["e0"]
    assert emulator_info(url)["num_pending"] == 0


def test_node_daemon_sigkilled_and_restarted_keeps_its_engines(
        make_node: Callable[..., Node], coordinator: Coordinator, client: Peer) -> None:
    (node,) = fleet_of(make_node, coordinator.endpoint, 1,
                       engines=lambda i: [EngineSpec("e0"), EngineSpec("e1")])
    wait_for(all_healthy(client, 2), 60, "the engines healthy")
    before = client.fleet()["nodes"][0]
    node.kill_daemon()
    node.start()
    after = wait_for(lambda: (n := client.fleet()["nodes"][0])["boot"] != before["boot"]
                     and n, 30, "the restarted daemon's HELLO")
    assert after["reachable"]
    assert {e["id"]: (e["incarnation"], e["pid"]) for e in after["engines"]} == {
        e["id"]: (e["incarnation"], e["pid"]) for e in before["engines"]}


def test_a_failed_part_of_a_multi_node_engine_restarts_the_whole_group(
        make_node: Callable[..., Node], coordinator: Coordinator, client: Peer) -> None:
    fleet_of(make_node, coordinator.endpoint, 2,
             engines=lambda i: [EngineSpec("tp", extra={"group": "big"}), EngineSpec("solo")])
    wait_for(all_healthy(client, 4), 60, "the fleet healthy")
    before = engines_of(client.fleet())
    os.kill(before["node0/tp"]["pid"], signal.SIGKILL)
    wait_for(lambda: engines_of(client.fleet())["node1/tp"]["incarnation"]
             == before["node1/tp"]["incarnation"] + 1, 30, "the other part restarted")
    wait_for(all_healthy(client, 4), 60, "the fleet healthy again")
    after = engines_of(client.fleet())
    assert after["node1/solo"]["incarnation"] == before["node1/solo"]["incarnation"]
    assert after["node0/tp"]["incarnation"] == before["node0/tp"]["incarnation"] + 1


def test_garbage_is_dropped_and_counted_and_the_coordinator_carries_on(
        coordinator: Coordinator, client: Peer) -> None:
    junk = [b"", b"\xff\xfe", b"{", b"[]", b'{"v":[2,0],"kind":"hello"}',
            b'{"v":[1,0],"kind":"bogus"}', b'{"v":[1,0],"kind":"ack","boot":"b","seq":1}',
            protocol.encode(protocol.Hello("someone-else", "b", [], 0)),
            protocol.encode(protocol.Event("ghost", "b", 1, {}))]
    for frame in junk:
        client.sock.send(frame)
    client.sock.send_multipart([b"two", b"frames"])
    reply = client.call("ping")
    assert reply is not None and reply.status == "ok"
    bad = reply.result["bad_messages"]
    assert bad["undecodable"] == 6 and bad["wrong_direction"] == 1
    assert bad["unknown_node"] == 1 and bad["no_hello"] == 1 and bad["framing"] == 1


def test_a_batch_with_a_replayed_event_relays_each_new_event_once(
        coordinator: Coordinator, client: Peer) -> None:
    """A node's "events" frame is taken event by event: the one already received is dropped
    and counted, the rest relayed (to a client taking batches) and acknowledged."""
    client.sock.send(protocol.encode(protocol.Subscribe(batches=True)))
    assert client.call("ping") is not None   # same connection: the subscription is in place
    node = RawNode(coordinator.endpoint, "n1")

    def event(seq: int) -> protocol.Event:
        state = "healthy" if seq % 2 else "suspect"
        return protocol.Event("n1", "b1", seq, {"kind": "state", "engine": "e0", "to": state},
                              {"id": "e0", "state": state})
    try:
        node.send(protocol.Hello("n1", "b1", [{"id": "e0"}], 0))
        assert node.acked(0).batches   # the coordinator takes batches
        node.send(protocol.Events([event(1), event(2), event(3)]))
        node.acked(3)
        node.send(protocol.Events([event(3), event(4)]))
        node.acked(4)
        reply = client.call("ping")
        assert reply is not None and reply.result["bad_messages"].get("replayed") == 1
        wait_for(lambda: client.pump(0.05) or len(
            [e for e in client.events if e.boot == "b1"]) >= 4, 10, "four events")
        client.pump(0.2)
        assert [e.seq for e in client.events if e.boot == "b1"] == [1, 2, 3, 4]
        assert engines_of(client.fleet())["n1/e0"]["state"] == "suspect"   # event 4's status
    finally:
        node.close()


def test_a_nodes_runs_are_taken_whole_and_reach_each_client_as_it_takes_them(
        coordinator: Coordinator) -> None:
    """A node's "run" (1.4) updates the view, is acknowledged, and reaches a client taking
    runs as that very message inside an "events" frame, and a client taking batches only as
    the events it stands for; a run that repeats an event or stops an engine is taken event by
    event (the replayed one counted), and both clients get every event once, in order."""
    runs, batches = Peer(coordinator.endpoint), Peer(coordinator.endpoint)
    runs.sock.send(protocol.encode(protocol.Subscribe(batches=True, runs=True)))
    batches.sock.send(protocol.encode(protocol.Subscribe(batches=True)))
    assert runs.call("ping") is not None and batches.call("ping") is not None
    node = RawNode(coordinator.endpoint, "n1")

    def paused(engine: str) -> dict[str, Any]:
        return {"kind": "paused", "engine": engine, "deadline": 1e9 + 60}

    try:
        engines = [{"id": e, "state": "healthy", "paused": False} for e in ("e0", "e1")]
        node.send(protocol.Hello("n1", "b1", engines, 0))
        assert node.acked(0).runs   # the coordinator takes runs
        first = protocol.Run("n1", "b1", 1, [paused("e0"), paused("e1")])
        node.send(first)
        node.acked(2)
        stopping = {"kind": "state", "engine": "e1", "from": "healthy", "to": "stopping",
                    "cause": "probe_failed"}
        again = protocol.Run("n1", "b1", 2, [paused("e1"), stopping],
                             [None, {"id": "e1", "state": "stopping"}])
        node.send(again)
        node.acked(3)
        reply = runs.call("ping")
        assert reply is not None and reply.result["bad_messages"].get("replayed") == 1
        view = engines_of(runs.fleet())
        assert view["n1/e0"]["paused"] and view["n1/e0"]["pause_deadline"] == 1e9 + 60
        assert view["n1/e1"]["state"] == "stopping"
        for peer in (runs, batches):
            wait_for(lambda p=peer: p.pump(0.05) or len(  # type: ignore[misc]
                [e for e in p.events if e.boot == "b1"]) >= 3, 10, "three events")
            peer.pump(0.2)
            assert [e.seq for e in peer.events if e.boot == "b1"] == [1, 2, 3]
        assert any(protocol.encode(first) in data for data in runs.frames)   # as it came
        assert not any(b'"kind":"run"' in data for data in batches.frames)   # split
    finally:
        node.close()
        runs.close()
        batches.close()


def test_a_run_saying_common_fields_once_is_taken_and_relayed_as_each_client_takes_it(
        coordinator: Coordinator) -> None:
    """A node's run with `common` (1.5) updates the view like any run, and reaches a client
    that set `common` as it came, and one taking only runs (a 1.4 client) as its events."""
    common, runs = Peer(coordinator.endpoint), Peer(coordinator.endpoint)
    common.sock.send(protocol.encode(protocol.Subscribe(batches=True, runs=True, common=True)))
    runs.sock.send(protocol.encode(protocol.Subscribe(batches=True, runs=True)))
    assert common.call("ping") is not None and runs.call("ping") is not None
    node = RawNode(coordinator.endpoint, "n1")
    try:
        engines = [{"id": e, "state": "healthy", "paused": False} for e in ("e0", "e1")]
        node.send(protocol.Hello("n1", "b1", engines, 0))
        assert node.acked(0).common   # the coordinator takes runs with common
        events = [protocol.Event("n1", "b1", 1 + i, {"kind": "paused", "engine": e,
                                                     "deadline": 1e9 + 60})
                  for i, e in enumerate(("e0", "e1"))]
        run = protocol.Run.of(events, common=True)
        assert run.common is not None
        node.send(run)
        wait_for(lambda: all(engines_of(common.fleet())[f"n1/{e}"].get("pause_deadline")
                             == 1e9 + 60 for e in ("e0", "e1")), 10, "both paused in the view")
        for peer in (common, runs):
            wait_for(lambda p=peer: p.pump(0.05) or len(  # type: ignore[misc]
                [e for e in p.events if e.boot == "b1"]) >= 2, 10, "two events")
            assert [e for e in peer.events if e.boot == "b1"] == events
        assert any(protocol.encode(run) in data for data in common.frames)   # as it came
        assert not any(b'"common"' in data for data in runs.frames)
    finally:
        node.close()
        common.close()
        runs.close()


def test_a_nodes_frame_of_lines_is_taken_message_by_message_in_order(
        coordinator: Coordinator, client: Peer) -> None:
    """(1.6) A node's turn in one frame, a line each: its run updates the view and reaches a
    subscriber as it came, its reply answers the command; a bad line is counted and the others
    are taken; a frame of more than MAX_LINES lines is refused whole, and so is one from a peer
    that sent no HELLO. A message with newlines for whitespace is still one message."""
    client.sock.send(protocol.encode(protocol.Subscribe(batches=True, runs=True, common=True)))
    node = RawNode(coordinator.endpoint, "n1")
    try:
        engines = [{"id": e, "state": "healthy", "paused": False} for e in ("e0", "e1")]
        node.send(protocol.Hello("n1", "b1", engines, 0))
        assert node.acked(0).lines   # the coordinator takes frames of lines
        before = client.call("ping")
        assert before is not None
        request_id = uuid.uuid4().hex
        client.sock.send(protocol.encode(protocol.Command(request_id, "pause", {"all": True},
                                                          node="n1")))
        command = wait_for(lambda: node.sock.poll(50) and next(
            (m for m in [protocol.decode(node.sock.recv())] if isinstance(m, protocol.Command)),
            None), 10, "the command at the node")
        events = [protocol.Event("n1", "b1", 1 + i, {"kind": "paused", "engine": e,
                                                     "deadline": 1e9 + 60})
                  for i, e in enumerate(("e0", "e1"))]
        run = protocol.encode(protocol.Run.of(events, common=True))
        reply = protocol.encode(protocol.Reply(command.request_id, "ok", result={"n": 2}))
        bogus = b'{"v":[1,6],"kind":"bogus"}'
        node.sock.send(lines.NEWLINE.join([run, bogus, reply]))

        def answered() -> protocol.Reply | None:
            client.pump(0.05)
            return next((protocol.decode(f) for f in client.frames
                         if request_id.encode() in f), None)
        gathered = wait_for(answered, 10, "the gathered reply")
        assert isinstance(gathered, protocol.Reply) and gathered.status == "ok", gathered
        assert gathered.result["nodes"]["n1"]["result"] == {"n": 2}
        wait_for(lambda: client.pump(0.05) or len(
            [e for e in client.events if e.boot == "b1"]) >= 2, 10, "both events relayed")
        assert [e for e in client.events if e.boot == "b1"] == events
        assert any(run in data and b"{\n" not in data for data in client.frames)  # as it came
        assert all(e.get("pause_deadline") == 1e9 + 60
                   for k, e in engines_of(client.fleet()).items() if k.startswith("n1/"))
        beats = [protocol.encode(protocol.Heartbeat(1.0))] * (lines.MAX_LINES + 1)
        node.sock.send(lines.NEWLINE.join(beats))

        def grew() -> dict[str, int]:
            after = client.call("ping")
            assert after is not None
            return {k: after.result["bad_messages"].get(k, 0)
                    - before.result["bad_messages"].get(k, 0) for k in ("undecodable", "framing")}
        client.sock.send(lines.NEWLINE.join(beats[:2]))   # not a node: no lines
        wait_for(lambda: grew()["framing"] == 2, 10, "both frames of lines refused")
        assert grew() == {"undecodable": 1, "framing": 2}
        pretty = json.dumps(protocol.Command("pretty", "ping").to_json(), indent=1).encode()
        assert lines.NEWLINE in pretty
        client.sock.send(pretty)
        assert wait_for(lambda: client.pump(0.05) or any(
            b'"request_id":"pretty"' in f or b'"request_id": "pretty"' in f
            for f in client.frames), 10, "the pretty command answered")
    finally:
        node.close()


def test_events_are_acknowledged_with_the_next_heartbeat_or_at_once_past_a_bound() -> None:
    """A node's events are ACKed in place of the coordinator's next heartbeat (a fleet-wide
    pause costs no ACK of its own); its HELLO, and events owed past ACK_AFTER_EVENTS, at the
    end of the turn that took them."""
    def run(seq: int, count: int) -> protocol.Run:
        return protocol.Run("n1", "b1", seq, [{"kind": "paused", "engine": "e0",
                                               "deadline": 1e9} for _ in range(count)])

    with Coordinator(bind="tcp://127.0.0.1:0", heartbeat_s=3600.0) as coord:  # no beat due
        node = RawNode(coord.endpoint, "n1")
        try:
            node.send(protocol.Hello("n1", "b1", [{"id": "e0", "state": "healthy"}], 0))
            assert node.acked(0).runs
            node.send(run(1, 2))   # owed, not ACKed: the next ACK covers it with the rest
            client = Peer(coord.endpoint)
            try:   # taken, in a turn of its own
                wait_for(lambda: engines_of(client.fleet())["n1/e0"].get("paused"), 10, "the run")
            finally:
                client.close()
            seq = 3
            while seq <= ACK_AFTER_EVENTS:
                node.send(run(seq, protocol.BATCH_EVENTS))
                seq += protocol.BATCH_EVENTS
            assert node.acked().seq >= ACK_AFTER_EVENTS   # the first ACK since the HELLO's
        finally:
            node.close()
    with Coordinator(bind="tcp://127.0.0.1:0", heartbeat_s=0.2) as coord:
        node = RawNode(coord.endpoint, "n1")
        try:
            node.send(protocol.Hello("n1", "b1", [{"id": "e0", "state": "healthy"}], 0))
            node.acked(0)
            node.send(run(1, 2))
            node.acked(2)   # with a heartbeat
        finally:
            node.close()


def test_a_non_loopback_bind_without_keys_is_refused() -> None:
    with pytest.raises(ValueError, match="--insecure"):
        Coordinator(bind="tcp://0.0.0.0:0")
    Coordinator(bind="tcp://0.0.0.0:0", insecure=True)  # the operator said so


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    directory = tmp_path / "keys"
    keygen(directory, "coordinator")
    (directory / "authorized").mkdir()
    for name in ("node0", "trainer", "stranger"):
        keygen(tmp_path / "peers", name)
    for name in ("node0", "trainer"):
        (directory / "authorized" / f"{name}.key").write_bytes(
            (tmp_path / "peers" / f"{name}.key").read_bytes())
    return directory


def curve_of(tmp_path: Path, name: str) -> tuple[bytes, bytes, bytes]:
    public, secret = zmq.auth.load_certificate(tmp_path / "peers" / f"{name}.key_secret")
    server, _ = zmq.auth.load_certificate(tmp_path / "keys" / "coordinator.key")
    assert secret is not None
    return public, secret, server


def test_curve_lets_in_listed_keys_only(make_node: Callable[..., Node], tmp_path: Path,
                                        keys: Path) -> None:
    with Coordinator(bind="tcp://127.0.0.1:0", keys=str(keys)) as coord:
        (node,) = fleet_of(make_node, coord.endpoint, 1, top={
            "key": str(tmp_path / "peers" / "node0.key_secret"),
            "coordinator_key": str(keys / "coordinator.key")})
        trainer = Peer(coord.endpoint, curve_of(tmp_path, "trainer"))
        stranger = Peer(coord.endpoint, curve_of(tmp_path, "stranger"))
        plain = Peer(coord.endpoint)
        try:
            wait_for(all_healthy(trainer, 1), 60, "the node, over CURVE")
            assert node.status()["link"]["handshake_failure"] is None
            for outsider in (stranger, plain):
                assert outsider.call("restart", timeout=2.0, node="node0", engine="e0") is None
                assert outsider.call("status", timeout=1.0) is None
            before = engines_of(trainer.fleet())["node0/e0"]["incarnation"]
            assert engines_of(trainer.fleet())["node0/e0"]["incarnation"] == before
            # a listed client key cannot pose as a node
            trainer.sock.send(protocol.encode(protocol.Hello("node0", "fake", [], 0)))
            bad = trainer.call("ping")
            assert bad is not None and bad.result["bad_messages"]["unknown_node"] == 1
        finally:
            for peer in (trainer, stranger, plain):
                peer.close()


def test_a_node_whose_key_is_not_authorized_says_why_it_has_no_link(
        make_node: Callable[..., Node], tmp_path: Path, keys: Path) -> None:
    """Nothing else tells the node's operator: its log names the refusal and what to check."""
    with Coordinator(bind="tcp://127.0.0.1:0", keys=str(keys)) as coord:
        node = make_node([], node_id="stranger", top={
            "coordinator": coord.endpoint, "key": str(tmp_path / "peers" / "stranger.key_secret"),
            "coordinator_key": str(keys / "coordinator.key")}).start()
        wait_for(lambda: "the coordinator refused this side's key" in node.log_text(), 30,
                 "the refusal in the node's log")
        assert f"no link to the coordinator at {coord.endpoint} (failed handshakes: 1)" \
            in node.log_text()
        # and its status says the same; a refusal is no bad message (a second one comes from
        # the link's own redial: libzmq gives a refused connection up)
        def refused_twice() -> dict[str, Any] | None:
            link: dict[str, Any] = node.status()["link"]
            return link if link["failed_handshakes"] >= 2 else None
        link = wait_for(refused_twice, 30, "a second refusal, after the link's redial")
        assert link["connected"] is False and link["bad_messages"] == 0
        assert "refused this side's key" in link["handshake_failure"]


def test_a_node_without_a_key_at_a_curve_coordinator_says_so_once_it_repeats(
        make_node: Callable[..., Node], keys: Path) -> None:
    """The coordinator drops a keyless node's handshake, and libzmq dials again: the first drop
    is logged at INFO (a coordinator restarting drops one too), the repeats at WARNING."""
    with Coordinator(bind="tcp://127.0.0.1:0", keys=str(keys)) as coord:
        node = make_node([], node_id="keyless", top={"coordinator": coord.endpoint}).start()

        def drops() -> list[dict[str, Any]]:
            lines = (json.loads(line) for line in node.log_text().splitlines() if line.strip())
            return [e for e in lines if "requires CURVE keys: none are set" in e.get("msg", "")]
        wait_for(lambda: any(e["level"] == "warning" for e in drops()), 30, "the warning")
        assert drops()[0]["level"] == "info"
        assert "requires CURVE keys" in node.status()["link"]["handshake_failure"]


def test_sighup_lets_in_a_key_added_to_authorized(tmp_path: Path, keys: Path) -> None:
    """An operator adds a node's or client's public key and sends SIGHUP: no restart."""
    bind = f"tcp://127.0.0.1:{free_port()}"
    coordinator = start_coordinator_process(
        bind, ["--keys", str(keys)], key=tmp_path / "peers" / "trainer.key_secret",
        coordinator_key=keys / "coordinator.key", log_path=tmp_path / "coordinator.log")
    late = Peer(bind, curve_of(tmp_path, "stranger"))
    try:
        assert late.call("ping", timeout=1.0) is None          # not on the list yet
        (keys / "authorized" / "stranger.key").write_bytes(
            (tmp_path / "peers" / "stranger.key").read_bytes())
        coordinator.proc.send_signal(signal.SIGHUP)

        def let_in() -> protocol.Reply | None:
            nonlocal late   # a new connection each try: libzmq does not retry a refused one
            late.close()
            late = Peer(bind, curve_of(tmp_path, "stranger"))
            return late.call("ping", timeout=2.0)   # (a handshake on a loaded host)
        reply = wait_for(let_in, 30, "the reloaded key let in")
        assert reply.status == "ok"
        assert coordinator.proc.poll() is None                 # SIGHUP did not stop it
    finally:
        late.close()
        coordinator.cleanup()


def test_an_ack_that_cannot_be_sent_stays_owed_for_the_next_heartbeat() -> None:
    """The node's queue full (or no route to it): the ACK is not taken as sent, so the next
    heartbeat is that ACK, not a plain beat that leaves the node's outbox unacknowledged."""
    coord = Coordinator(bind="tcp://127.0.0.1:0")   # its hub driven here: no thread, socket
    hub = coord.hub
    now, wall = time.monotonic(), time.time()
    hub.view.hello(protocol.Hello("n1", "b1", [{"id": "e0", "state": "healthy"}], 0), "n1",
                   now, wall)
    hub.acks.took("n1", 3)
    sent: list[bytes] = []
    hub._send_node = lambda node, frame: False   # type: ignore[method-assign]
    hub._ack("n1")
    assert hub.acks.owed("n1")
    hub._send_node = lambda node, frame: sent.append(frame) or True   # type: ignore
    hub._ack("n1")
    assert not hub.acks.owed("n1") and isinstance(protocol.decode(sent[0]), protocol.Ack)


def test_a_command_that_cannot_be_sent_goes_at_a_heartbeat_and_again_on_the_nodes_hello(
        ) -> None:
    """No connection to the node (its daemon restarting) or its queue full: the command is
    neither lost nor given up. It goes at the first heartbeat that can send it, and again on
    the node's HELLO (one sent into a connection already gone is lost), until it is answered.
    """
    coord = Coordinator(bind="tcp://127.0.0.1:0")   # its hub driven here: no thread, socket
    hub = coord.hub
    now, wall = time.monotonic(), time.time()
    hello = protocol.Hello("n1", "b1", [{"id": "e0", "state": "healthy"}], 0)
    hub.view.hello(hello, "n1", now, wall)
    sent: list[protocol.Message] = []
    connected = False

    def send_node(node: str, frame: bytes) -> bool:
        if connected:
            sent.append(protocol.decode(frame))
        return connected

    def commands() -> list[str]:
        return [m.request_id for m in sent if isinstance(m, protocol.Command)]

    hub._send_node = send_node   # type: ignore[method-assign]
    sent_r1 = node_request_id("r1", "n1")
    hub.gather(None, protocol.Command("r1", "pause", {}, "n1", "e0", 30.0), ["n1"], now)
    hub._tick(now, wall)                       # a heartbeat: still no connection
    assert commands() == [] and "r1" in hub.fanout.pending
    connected = True
    hub._tick(now + hub.heartbeat_s, wall)     # the next one sends it
    assert commands() == [sent_r1]
    hub._tick(now + 2 * hub.heartbeat_s, wall)
    assert commands() == [sent_r1]             # sent: not again at a heartbeat
    hub._hello(hello, b"n1", None, now + 2.5, wall)
    assert commands() == [sent_r1, sent_r1]    # unanswered: again on the HELLO
    assert hub.fanout.answered(protocol.Reply(sent_r1, "ok"), "n1") is not None
    hub._hello(hello, b"n1", None, now + 3, wall)
    assert commands() == [sent_r1, sent_r1] and hub.fanout.pending == {}


def test_after_the_loops_own_stall_a_node_is_judged_on_what_it_sent_meanwhile() -> None:
    """The coordinator's loop stopped for 10 s (SIGSTOP, swap): its nodes spoke all along, and
    their heartbeats queued. The first sweep after it ran before they were read, and judged
    every node silent (the hostile run: spurious node_unreachable pairs, and once a refit
    holder released for "silence"). Now the sweep waits STALL_GRACE_S after the stall, once:
    a node still silent then is judged as before. Driven on the hub, with its clock."""
    coord = Coordinator(bind="tcp://127.0.0.1:0", node_timeout_s=3.0)   # no thread, socket
    hub = coord.hub
    now, wall = time.monotonic(), time.time()
    hub.view.hello(protocol.Hello("n1", "b1", [], 0), "n1", now, wall)
    hub.view.hello(protocol.Hello("n2", "b2", [], 0), "n2", now, wall)
    hub._tick(now, wall)
    later = now + 10.0
    hub._stalled(later, True)                  # the loop's first turn after the stop
    hub._tick(later, wall + 10.0)
    assert [r.reachable for r in hub.view.nodes.values()] == [True, True]
    hub.view.heard("n1", later + 0.5, wall + 10.5)   # n1's queued heartbeat, read now
    hub._stalled(later + 0.5, True)            # a slow turn: the grace is not given again
    hub._tick(later + STALL_GRACE_S, wall + 11.0)
    assert {n: r.reachable for n, r in hub.view.nodes.items()} == {"n1": True, "n2": False}
    hub._tick(later + 3.6, wall + 13.6)        # n1 silent since: judged as any node
    assert not hub.view.nodes["n1"].reachable


