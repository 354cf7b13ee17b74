"""The node's link to the coordinator, against a real daemon and a real ROUTER standing in for
the coordinator: HELLO with a snapshot, events in order until acknowledged and resent to a
coordinator that restarted, commands through the node's command table (a repeated request id
gets the same reply, a repeat of one still running nothing more), garbage survived."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from typing import Any

import pytest
import zmq
from daemon_harness import EngineSpec, Node, free_port, wait_for

from rollout_watchdog.common import protocol


class Coordinator:
    """A ROUTER on a fixed port that records what the node sends."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.ctx = zmq.Context()
        self.sock: zmq.Socket[bytes] | None = None
        self.received: list[protocol.Message] = []
        self.open()

    def open(self) -> None:
        sock = self.ctx.socket(zmq.ROUTER)
        sock.linger = 0

        def bound() -> bool:  # a closed socket's listener is released by libzmq's own thread
            try:
                sock.bind(f"tcp://127.0.0.1:{self.port}")
                return True
            except zmq.ZMQError:
                return False

        wait_for(bound, 10, f"port {self.port} to be free again")
        self.sock = sock
        self.received = []

    def close(self) -> None:
        assert self.sock is not None
        self.sock.close(linger=0)
        self.sock = None

    def pump(self) -> None:
        assert self.sock is not None
        while self.sock.poll(10):
            node, data = self.sock.recv_multipart()
            assert node == b"test-node"
            self.received.append(protocol.decode(data))

    def send(self, message: protocol.Message | bytes) -> None:
        assert self.sock is not None
        data = message if isinstance(message, bytes) else protocol.encode(message)
        self.sock.send_multipart([b"test-node", data])

    def wait(self, what: str, match: Any, timeout: float = 20.0) -> Any:
        def found() -> Any:
            self.pump()
            return next((m for m in self.received if match(m)), None)
        return wait_for(found, timeout, what)


@pytest.fixture
def linked(make_node: Any) -> Iterator[tuple[Node, Coordinator]]:
    port = free_port()
    coordinator = Coordinator(port)
    node = make_node([EngineSpec("e0")], top={"coordinator": f"tcp://127.0.0.1:{port}"})
    node.start()
    try:
        yield node, coordinator
    finally:
        if coordinator.sock is not None:
            coordinator.close()
        coordinator.ctx.term()


def test_hello_events_acks_and_a_coordinator_restart(linked: tuple[Node, Coordinator]) -> None:
    node, coordinator = linked
    hello = coordinator.wait("a HELLO", lambda m: isinstance(m, protocol.Hello))
    assert hello.node_id == "test-node" and [e["id"] for e in hello.engines] == ["e0"]
    first = node.wait_state("e0", "healthy")
    healthy = coordinator.wait("the healthy event", lambda m: isinstance(m, protocol.Event)
                               and m.event["to"] == "healthy")
    os.kill(first["pid"], signal.SIGKILL)
    down = coordinator.wait("the failure event", lambda m: isinstance(m, protocol.Event)
                            and m.event["to"] == "stopping")
    assert down.event["cause"] == "exited" and down.seq > healthy.seq
    # at least once, no gap: a seq sent twice (the HELLO's resend can cross a send made just
    # before the coordinator's handshake was seen) is the same event, which it dedups
    events = [m for m in coordinator.received if isinstance(m, protocol.Event)]
    by_seq = {m.seq: m for m in events}
    assert sorted(by_seq) == list(range(1, max(by_seq) + 1))
    assert all(by_seq[m.seq] == m for m in events)
    coordinator.send(protocol.Ack(hello.boot, healthy.seq))  # everything up to healthy
    # The node handles what the coordinator sends in order: once a later ping is answered,
    # the ACK has been taken in.
    coordinator.send(protocol.Command("barrier", "ping", {}, node="test-node"))
    coordinator.wait("the ping's reply", lambda m: isinstance(m, protocol.Reply)
                     and m.request_id == "barrier")
    coordinator.close()
    coordinator.open()  # restarted, with nothing: the node says everything again
    again = coordinator.wait("a new HELLO", lambda m: isinstance(m, protocol.Hello))
    assert again.boot == hello.boot and again.last_seq >= down.seq
    resent = coordinator.wait("the failure event again", lambda m: isinstance(
        m, protocol.Event) and m.seq == down.seq)
    assert resent == down
    coordinator.pump()
    assert all(m.seq > healthy.seq for m in coordinator.received
               if isinstance(m, protocol.Event))  # acknowledged ones are not sent again


def test_commands_run_through_the_node_table(linked: tuple[Node, Coordinator]) -> None:
    node, coordinator = linked
    coordinator.wait("a HELLO", lambda m: isinstance(m, protocol.Hello))
    node.wait_state("e0", "healthy")
    coordinator.send(b"\x00garbage")  # dropped and counted, the link lives on
    coordinator.send(protocol.Command("r1", "pause", {"deadline_s": 60}, node="test-node",
                                      engine="e0"))
    reply = coordinator.wait("the pause reply", lambda m: isinstance(m, protocol.Reply)
                             and m.request_id == "r1")
    assert reply.status == "ok" and reply.result["paused"] == ["e0"]
    assert node.engine("e0")["paused"]
    coordinator.send(protocol.Command("r1", "pause", {"deadline_s": 60}, node="test-node",
                                      engine="e0"))
    coordinator.wait("the same reply again", lambda m: isinstance(m, protocol.Reply)
                     and m.request_id == "r1" and m is not reply)
    assert [m for m in coordinator.received if isinstance(m, protocol.Reply)] == [reply, reply]
    assert len([e for e in node.events("e0") if e["kind"] == "paused"]) == 1  # done once
    coordinator.send(protocol.Command("r2", "restart", {}, node="test-node", engine="nope"))
    refused = coordinator.wait("a refusal", lambda m: isinstance(m, protocol.Reply)
                               and m.request_id == "r2")
    assert refused.status == "error" and "no engine 'nope'" in (refused.reason or "")
    coordinator.wait("a heartbeat", lambda m: isinstance(m, protocol.Heartbeat))


def test_a_repeat_of_a_command_still_running_gets_only_its_one_reply(
        linked: tuple[Node, Coordinator]) -> None:
    """The coordinator sends a node its unanswered commands again on each HELLO; a repeat of
    one still running (here a long-poll for events) is not run a second time."""
    node, coordinator = linked
    coordinator.wait("a HELLO", lambda m: isinstance(m, protocol.Hello))
    node.wait_state("e0", "healthy")
    last = node.client.call("events", {"since": 0, "wait_s": 0})["next"]
    poll = protocol.Command("poll", "events", {"since": last, "wait_s": 30}, node="test-node")
    coordinator.send(poll)
    coordinator.send(poll)   # while the first waits
    coordinator.send(protocol.Command("p1", "pause", {"deadline_s": 60}, node="test-node",
                                      engine="e0"))   # an event: the poll's answer
    answered = coordinator.wait("the poll's reply", lambda m: isinstance(m, protocol.Reply)
                                and m.request_id == "poll")
    assert answered.status == "ok" and [e["kind"] for e in answered.result["events"]] == [
        "paused"]
    coordinator.send(protocol.Command("barrier", "ping", {}, node="test-node"))
    coordinator.wait("the ping's reply", lambda m: isinstance(m, protocol.Reply)
                     and m.request_id == "barrier")   # taken in order, after the repeat
    assert [m for m in coordinator.received
            if isinstance(m, protocol.Reply) and m.request_id == "poll"] == [answered]
