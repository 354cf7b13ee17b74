"""The node link under bad input and bad networks (issue 6, part 6): garbage, truncated,
oversized, wrong-version and wrong-kind frames, unknown commands, a flood, and a link cut by a
paused TCP relay. A real ROUTER stands in for the coordinator; the link is driven in this process
as the daemon's loop drives it, and once inside a real node daemon."""

from __future__ import annotations

import contextlib
import json
import select
import selectors
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import requests
import zmq
from daemon_harness import EngineSpec, Node, wait_for

from rollout_watchdog.agent.link import MAX_MESSAGES_PER_ROUND, NodeLink
from rollout_watchdog.common import lines, protocol
from rollout_watchdog.common.clock import Clock
from rollout_watchdog.common.events import Event
from rollout_watchdog.common.replies import CommandError, Deferred
from rollout_watchdog.emulator.testing import free_port
from rollout_watchdog.watchdog.metrics import Metrics

NODE = b"test-node"
PING = protocol.Command("ping-1", "ping", {}, node="test-node")


class Router:
    """A ROUTER standing in for the coordinator: records what the node sends, heartbeats."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], port: int) -> None:
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.linger = 0
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a full pipe says so, nothing dropped
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)   # a reconnected node replaces its stale
        self.sock.sndtimeo = 20_000  # a send that blocks on a node gone wedged fails the test
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.sock.bind(self.endpoint)
        self.received: list[protocol.Message] = []
        self.frames: list[bytes] = []   # as they came (a frame of lines is one, 1.6)

    def pump(self) -> None:
        while self.sock.poll(0):
            node, data = self.sock.recv_multipart()
            # the last words of a stale connection come under the temporary id that
            # ROUTER_HANDOVER gives it, a zero byte and four more
            assert node == NODE or (len(node) == 5 and node[0] == 0), node
            self.frames.append(data)
            self.received += [protocol.decode(part) for part in (
                lines.split(data) if lines.NEWLINE in data else [data])]

    def send(self, message: protocol.Message | bytes, flags: int = 0) -> None:
        data = message if isinstance(message, bytes) else protocol.encode(message)
        self.sock.send_multipart([NODE, data], flags)

    def got(self, kind: type[protocol.Message]) -> list[Any]:
        return [m for m in self.received if isinstance(m, kind)]

    def reply(self, request_id: str) -> protocol.Reply | None:
        return next((m for m in self.got(protocol.Reply) if m.request_id == request_id), None)


def raw(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj).encode()


def ping_dispatch(name: str, args: dict[str, Any]) -> dict[str, Any] | Deferred:
    if name == "unencodable":   # a command's bug: a result that is not JSON
        return {"engines": {"e0", "e1"}}
    if name == "unencodable_later":
        return Deferred(lambda: {"when": object()}, time.monotonic() + 60, dict)
    if name != "ping":
        raise CommandError(f"unknown command {name!r}")
    return {"pong": True}


class Harness:
    """A NodeLink in this process, its turns taken as the daemon takes them, and a Router."""

    def __init__(self, link_port: int, router_port: int | None = None,
                 clock: Clock | None = None, **link_args: Any) -> None:
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.router = Router(self.ctx, router_port or link_port)
        self.metrics = Metrics()
        self.link = NodeLink(self.ctx, endpoint=f"tcp://127.0.0.1:{link_port}",
                             node_id="test-node", boot="boot-1",
                             snapshot=lambda: [{"id": "e0", "state": "healthy"}],
                             dispatch=ping_dispatch, clock=clock or Clock(),
                             metrics=self.metrics,
                             **link_args)
        self.poller = zmq.Poller()
        for pollable in self.link.pollables():
            self.poller.register(pollable, zmq.POLLIN)
        self.beats = True   # the stand-in heartbeats the node, as the coordinator does
        self.most_per_turn = 0

    def turn(self) -> None:
        now = self.link._clock.monotonic()
        deadline = self.link.next_deadline()
        wait_ms = 10 if deadline is None else max(0, min(10, round((deadline - now) * 1000)))
        ready = dict(self.poller.poll(wait_ms))
        before = self.link.bad_messages
        self.link.handle(ready)
        self.most_per_turn = max(self.most_per_turn, self.link.bad_messages - before)
        self.link.tick(self.link._clock.monotonic())
        self.link.after_save()
        if self.beats:
            with contextlib.suppress(zmq.ZMQError):  # the node is not there (yet)
                self.router.send(protocol.Heartbeat(time.time()), zmq.NOBLOCK)
        self.router.pump()

    def until(self, what: str, check: Callable[[], Any], timeout: float = 15.0) -> Any:
        def attempt() -> Any:
            self.turn()
            return check()
        return wait_for(attempt, timeout, what, interval=0)

    def hello(self, count: int = 1) -> None:
        self.until(f"HELLO #{count}", lambda: len(self.router.got(protocol.Hello)) >= count)

    def command(self, request_id: str, cmd: str = "ping") -> protocol.Reply:
        self.router.send(protocol.Command(request_id, cmd, {}, node="test-node"))
        reply: protocol.Reply = self.until(f"the reply to {request_id}",
                                           lambda: self.router.reply(request_id))
        return reply

    def metric(self, name: str) -> float:
        """One sample of the rendered metrics, as a scrape shows it (0 when absent)."""
        for line in self.metrics.render().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[-1])
        return 0.0

    def close(self) -> None:
        self.link.close()
        self.router.sock.close(0)
        self.ctx.term()


@pytest.fixture
def harness() -> Iterator[Harness]:
    h = Harness(free_port())
    yield h
    h.close()


def test_bad_frames_are_dropped_counted_and_the_link_answers_after(harness: Harness) -> None:
    harness.hello()
    good = PING.to_json()
    undecodable: list[bytes] = [
        b"\x00garbage\xff", b"", encode_cut(PING), b"{" * 5000, raw({**good, "v": [2, 0]}),
        raw({**good, "kind": "launch"}), raw({**good, "args": [1, 2]}),
        raw({**good, "request_id": 7})]
    unexpected: list[protocol.Message] = [  # kinds that only go towards the coordinator
        protocol.Hello("x", "b", [], 0), protocol.Event("x", "b", 1, {}),
        protocol.Reply("r", "ok"), protocol.Subscribe()]
    for frame in [*undecodable, *unexpected]:
        harness.router.send(frame)
    reply = harness.command("after")
    assert reply.status == "ok" and reply.result == {"pong": True}
    assert harness.link.bad_messages == len(undecodable) + len(unexpected)
    assert harness.metric('rollout_watchdog_link_bad_messages_total{reason="undecodable"}') \
        == len(undecodable)
    assert harness.metric('rollout_watchdog_link_bad_messages_total{reason="unexpected_kind"}') \
        == len(unexpected)
    status = harness.link.status()
    assert status["bad_messages"] == len(undecodable) + len(unexpected)
    assert status["connected"] and harness.metric("rollout_watchdog_coordinator_connected") == 1
    assert len(harness.router.got(protocol.Hello)) == 1  # none of it cost the connection


@pytest.mark.parametrize("cmd", ["unencodable", "unencodable_later"])
def test_a_result_that_cannot_be_encoded_is_an_internal_error_once(
        harness: Harness, cmd: str) -> None:
    """Answered (at once, or deferred) with an error naming the problem; the loop goes on,
    and a repeat of the request gets the same answer without running it again."""
    harness.hello()
    refused = harness.command("r-bad", cmd=cmd)
    assert refused.status == "error" and refused.code == protocol.INTERNAL
    assert "cannot be encoded" in (refused.reason or "")
    for _ in range(5):   # the next turns take no exception
        harness.turn()
    assert harness.command("r-after").result == {"pong": True}
    harness.router.received.clear()
    assert harness.command("r-bad", cmd=cmd) == refused


def encode_cut(message: protocol.Message) -> bytes:
    data = protocol.encode(message)
    return data[: len(data) // 2]


def test_unknown_command_gets_an_error_reply_naming_it(harness: Harness) -> None:
    harness.hello()
    refused = harness.command("r-x", cmd="launch-missiles")
    assert refused.status == "error" and "'launch-missiles'" in (refused.reason or "")
    assert harness.link.bad_messages == 0  # a well-formed command, refused: not bad input


def test_an_oversized_frame_costs_the_connection_and_the_link_dials_again(
        harness: Harness) -> None:
    harness.hello()
    harness.router.send(b" " * (protocol.MAX_MESSAGE_BYTES + 1))  # ZMQ_MAXMSGSIZE drops it
    harness.hello(2)
    assert harness.command("after").status == "ok"
    assert harness.metric('rollout_watchdog_link_bad_messages_total{reason="protocol_error"}') \
        == 1


def test_a_flood_is_taken_in_bounded_turns_and_counted(harness: Harness) -> None:
    harness.hello()
    flood, sent = 10_000, 0
    while sent < flood:
        try:
            harness.router.send(b"not json %d" % sent, zmq.NOBLOCK)
            sent += 1
        except zmq.Again:  # the node's pipe is full: let it take its turns
            harness.turn()
    harness.until("the flood to be counted", lambda: harness.link.bad_messages == flood)
    assert harness.most_per_turn <= MAX_MESSAGES_PER_ROUND  # the engines got their turns
    assert harness.command("after").status == "ok"
    assert harness.link.status()["bad_messages"] == flood


def test_a_silent_coordinator_on_an_open_connection_is_dialed_afresh() -> None:
    """A coordinator that stops speaking on a connection ZMQ still holds open (a ROUTER without
    ROUTER_HANDOVER that took the reconnected node for a duplicate of its stale connection,
    and never reads from it, does so) is dialed afresh, without waiting for it forever."""
    h = Harness(free_port(), silent_redial_s=1.0)
    try:
        h.hello()
        h.beats = False
        h.until("a HELLO on a fresh connection", lambda: len(h.router.got(protocol.Hello)) >= 2)
        assert h.link.bad_messages == 0
    finally:
        h.close()


class SteppedClock(Clock):
    """Monotonic time that moves only when the test says."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


def test_a_node_that_keeps_sending_sends_no_heartbeat_until_a_silent_interval() -> None:
    """Any message says the node is alive: replies every 0.6 s leave no heartbeat due; one
    goes after a heartbeat interval with nothing sent."""
    clock = SteppedClock()
    h = Harness(free_port(), clock=clock)
    try:
        h.hello()
        beats = len(h.router.got(protocol.Heartbeat))
        for i in range(10):
            clock.now += 0.6
            h.command(f"r{i}")
        assert len(h.router.got(protocol.Heartbeat)) == beats
        clock.now += h.link.heartbeat_s
        h.until("a heartbeat after a silent interval",
                lambda: len(h.router.got(protocol.Heartbeat)) > beats)
    finally:
        h.close()


def test_the_outbox_overflow_is_counted() -> None:
    h = Harness(free_port(), outbox_limit=3)
    try:
        for i in range(5):
            h.link.on_event(Event(ts=float(i), node_id="test-node", engine="e0",
                                  incarnation=1, kind="x"))
        h.turn()
        assert h.link.status()["dropped"] == 2 and h.link.status()["outbox"] == 3
        assert h.metric("rollout_watchdog_link_outbox_dropped_total") == 2
        assert h.metric("rollout_watchdog_link_outbox_events") == 3
    finally:
        h.close()


def test_zmtp_heartbeats_are_set_on_purpose(harness: Harness) -> None:
    sock = harness.link.socket
    assert sock.getsockopt(zmq.HEARTBEAT_IVL) == 1000
    assert sock.getsockopt(zmq.HEARTBEAT_TIMEOUT) == 3000
    assert sock.getsockopt(zmq.HEARTBEAT_TTL) == 3000


class Relay:
    """A TCP relay between the node and the ROUTER; paused, it forwards nothing, not even a
    close, as a cut network would."""

    def __init__(self, upstream: int) -> None:
        self.upstream = upstream
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.running = threading.Event()
        self.running.set()
        self.stopped = False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self.listener, selectors.EVENT_READ)
        peers: dict[socket.socket, socket.socket] = {}
        while not self.stopped:
            self.running.wait(0.05)
            if not self.running.is_set():
                continue
            for key, _ in sel.select(0.05):
                sock: Any = key.fileobj
                if sock is not self.listener and sock not in peers:
                    continue  # closed with its peer earlier in this round
                if sock is self.listener:
                    client, _ = sock.accept()
                    server = socket.create_connection(("127.0.0.1", self.upstream))
                    peers[client], peers[server] = server, client
                    sel.register(client, selectors.EVENT_READ)
                    sel.register(server, selectors.EVENT_READ)
                    continue
                try:
                    data = sock.recv(65536)
                except OSError:
                    data = b""
                if data:
                    with contextlib.suppress(OSError):
                        peers[sock].sendall(data)
                    continue
                for end in (sock, peers.pop(sock)):
                    peers.pop(end, None)
                    sel.unregister(end)
                    end.close()
        for end in [*peers, self.listener]:
            end.close()

    def dialed(self) -> bool:
        """Whether a new connection waits to be accepted (seen while paused, too)."""
        return bool(select.select([self.listener], [], [], 0)[0])

    def close(self) -> None:
        self.stopped = True
        self.running.set()
        self.thread.join(5)


def test_a_cut_link_is_noticed_and_the_node_reconnects_and_says_hello_again() -> None:
    router_port = free_port()
    relay = Relay(router_port)
    h = Harness(relay.port, router_port, heartbeat_s=0.2, heartbeat_timeout_s=0.6)
    try:
        h.hello()
        h.until("the coordinator to be seen", lambda: h.link.connected)
        relay.running.clear()  # the network is cut: nothing passes, nothing closes
        h.until("the coordinator to be missed", lambda: not h.link.connected)
        h.turn()   # the metric is published at the end of a loop turn, as the daemon's is
        assert h.metric("rollout_watchdog_coordinator_connected") == 0
        h.until("the node to give the dead connection up and dial again", relay.dialed)
        h.link.on_event(Event(ts=1.0, node_id="test-node", engine="e0", incarnation=1,
                              kind="while-cut"))
        h.turn()
        relay.running.set()
        h.hello(2)
        h.until("the coordinator to be seen again", lambda: h.link.connected)
        sent = h.until("the event made while cut", lambda: next(
            (m for m in h.router.got(protocol.Event) if m.event["kind"] == "while-cut"), None))
        assert sent.seq == 1
        assert h.command("after").status == "ok"
    finally:
        h.close()
        relay.close()


@pytest.fixture
def linked_node(make_node: Any) -> Iterator[tuple[Node, Router, int]]:
    """A real node daemon linked to a Router, and its metrics port."""
    port, metrics_port = free_port(), free_port()
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    router = Router(ctx, port)
    node = make_node([EngineSpec("e0")], top={"coordinator": f"tcp://127.0.0.1:{port}",
                                              "metrics_port": metrics_port})
    node.start()
    try:
        yield node, router, metrics_port
    finally:
        router.sock.close(0)
        ctx.term()


def test_a_real_node_survives_garbage_and_a_flood_and_shows_its_link(
        linked_node: tuple[Node, Router, int]) -> None:
    node, router, metrics_port = linked_node

    def answered(request_id: str, cmd: str = "ping", args: dict[str, Any] | None = None
                 ) -> protocol.Reply:
        router.send(protocol.Command(request_id, cmd, args or {}, node="test-node"))

        def reply() -> protocol.Reply | None:
            router.send(protocol.Heartbeat(time.time()))
            router.pump()
            return router.reply(request_id)
        return wait_for(reply, 20, f"the reply to {request_id}")

    first = node.wait_state("e0", "healthy")
    assert answered("hi").status == "ok"
    bad = [b"\x00garbage", raw({**PING.to_json(), "v": [9, 1]}), b'{"v": [1, 0], "ki']
    for frame in bad:
        router.send(frame)
    for i in range(10_000):  # blocks while the node's pipe is full (ROUTER_MANDATORY)
        router.send(b"flood %d" % i)
    unknown = answered("r-unknown", "launch-missiles")
    assert unknown.status == "error" and "unknown command 'launch-missiles'" in (
        unknown.reason or "")
    mistyped = answered("r-args", "restart", {"engine": 5})
    assert mistyped.status == "error" and "name an engine" in (mistyped.reason or "")
    def connected() -> dict[str, Any] | None:
        router.send(protocol.Heartbeat(time.time()))
        link: dict[str, Any] = node.status()["link"]
        return link if link["connected"] else None

    link = wait_for(connected, 10, "the link to show the coordinator connected")
    assert link["coordinator"] == router.endpoint
    assert link["bad_messages"] == len(bad) + 10_000
    assert link["dropped"] == 0
    # (the gauges are set at the end of a loop turn: the one after the status may be needed)
    scrape = wait_for(lambda: text if "rollout_watchdog_coordinator_connected 1.0" in (
        text := requests.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).text)
        else None, 10, "the connected gauge")
    assert 'rollout_watchdog_link_bad_messages_total{reason="undecodable"} 10003.0' in scrape
    again = node.engine("e0")  # supervised throughout: the same engine, healthy
    assert again["state"] == "healthy" and again["pid"] == first["pid"]


def test_a_full_send_queue_holds_events_back_in_order_and_loses_none(harness: Harness) -> None:
    """Far more events than libzmq queues (SNDHWM 1000) while the coordinator does not read:
    each arrives once, in order, once it reads again, though a later ACK covers them all."""
    harness.hello()
    harness.link.socket.setsockopt(zmq.SNDHWM, 50)
    harness.router.sock.setsockopt(zmq.RCVHWM, 50)
    for i in range(3000):   # 30 MB: more than libzmq's and the kernel's buffers hold
        harness.link.on_event(Event(ts=float(i), node_id="test-node", engine="e0",
                                    incarnation=1, kind="x", detail="x" * 10_000))
        if i % 100 == 0:
            harness.link.after_save()   # the daemon's turns go on; nothing is read
    harness.link.after_save()
    assert harness.link.status()["unsent"] > 0          # held back, not dropped

    def all_in() -> bool:
        seqs = [m.seq for m in harness.router.got(protocol.Event)]
        if seqs:
            harness.router.send(protocol.Ack("boot-1", seqs[-1]))
        return len(seqs) >= 3000
    harness.until("every event at the coordinator", all_in, timeout=30)
    assert [m.seq for m in harness.router.got(protocol.Event)] == list(range(1, 3001))
    harness.until("the outbox acknowledged", lambda: not harness.link.outbox)


def test_a_full_send_queue_with_lines_holds_events_and_replies_back_in_order() -> None:
    """(1.6) The same with the coordinator taking lines: runs and the replies of the commands
    taken meanwhile go joined into frames of lines, are held back while the queue is full, and
    each arrives once, in order (a reply after the events of its turn)."""
    harness = Harness(free_port(), outbox_limit=50_000)
    try:
        harness.hello()
        flags = {"batches": True, "runs": True, "common": True, "lines": True}
        harness.router.send(protocol.Ack("boot-1", 0, **flags))
        harness.until("the ACK taken", lambda: harness.link.outgoing.takes.lines)
        harness.beats = False   # (the coordinator does not read: it sends nothing either)
        harness.link.socket.setsockopt(zmq.SNDHWM, 50)
        harness.router.sock.setsockopt(zmq.RCVHWM, 50)
        total = 25_000   # ~20 MB of runs of ~25 KB, two to a frame of lines
        for i in range(total):
            harness.link.on_event(Event(ts=float(i), node_id="test-node", engine="e0",
                                        incarnation=1, kind="x", detail=f"{i}" + "x" * 700))
            if i % 1000 == 999:
                harness.link._receive(protocol.Command(f"c-{i + 1}", "ping", {},
                                                       node="test-node"))
                harness.link.after_save()   # the daemon's turns go on; nothing is read
        assert harness.link.status()["unsent"] > 0          # held back, not dropped

        def order() -> list[tuple[str, int]]:
            """What arrived: ("e", seq) per event, ("r", its turn's last seq) per reply."""
            return [item for m in harness.router.received for item in (
                [("e", e.seq) for e in m.as_events()] if isinstance(m, protocol.Run)
                else [("r", int(m.request_id[2:]))] if isinstance(m, protocol.Reply)
                else [])]

        def all_in() -> bool:
            seqs = [n for kind, n in order() if kind == "e"]
            if seqs:
                harness.router.send(protocol.Ack("boot-1", seqs[-1], **flags))
            return len(seqs) >= total
        harness.beats = True
        harness.until("every event at the coordinator", all_in, timeout=60)
        arrived = order()
        assert [n for kind, n in arrived if kind == "e"] == list(range(1, total + 1))
        replies = [(i, n) for i, (kind, n) in enumerate(arrived) if kind == "r"]
        assert [n for _, n in replies] == list(range(1000, total + 1, 1000))   # each once
        assert all(max(m for kind, m in arrived[:i] if kind == "e") >= n
                   for i, n in replies)   # after the events of its turn
        assert any(lines.SEPARATOR in frame for frame in harness.router.frames)
    finally:
        harness.close()


def test_a_turns_events_go_as_batches_split_by_size_once_the_coordinator_takes_them(
        harness: Harness) -> None:
    """After an ACK that says `batches`, the events of a turn go as "events" frames of at most
    BATCH_EVENTS and BATCH_BYTES; each arrives once, in order, and one ACK clears them all."""
    harness.hello()
    harness.router.send(protocol.Ack("boot-1", 0, batches=True))
    harness.until("the ACK taken", lambda: harness.link.outgoing.takes.batches)
    for i in range(100):   # 20 KB each: three to a frame by size
        harness.link.on_event(Event(ts=float(i), node_id="test-node", engine="e0",
                                    incarnation=1, kind="x", detail="x" * 20_000))
    def frames() -> list[list[protocol.Event]]:
        return [m.events if isinstance(m, protocol.Events) else [m]
                for m in harness.router.received if isinstance(m, (protocol.Event,
                                                                   protocol.Events))]
    harness.until("every event at the coordinator", lambda: sum(map(len, frames())) >= 100)
    assert [e.seq for frame in frames() for e in frame] == list(range(1, 101))
    assert [len(frame) for frame in frames()] == [3] * 33 + [1]   # by size; one alone: "event"
    assert all(len(protocol.encode(m)) <= protocol.BATCH_BYTES
               for m in harness.router.got(protocol.Events))
    harness.router.send(protocol.Ack("boot-1", 100, batches=True))
    harness.until("the outbox acknowledged", lambda: not harness.link.outbox)


def test_a_turns_events_go_as_runs_once_the_coordinator_takes_them(harness: Harness) -> None:
    """After an ACK that says `runs` (1.4), a turn's events go as "run" frames of at most
    BATCH_EVENTS and MAX_RUN_BYTES; a run that would be bigger
    goes as "events" frames instead, and one event alone as an "event"."""
    harness.hello()
    harness.router.send(protocol.Ack("boot-1", 0, batches=True, runs=True))
    harness.until("the ACK taken", lambda: harness.link.outgoing.takes.runs)

    def turn(count: int, detail: str) -> None:
        for i in range(count):
            harness.link.on_event(Event(ts=float(i), node_id="test-node", engine="e0",
                                        incarnation=1, kind="paused", detail=detail))
        harness.link.after_save()

    def frames() -> list[protocol.Message]:
        return [m for m in harness.router.received
                if isinstance(m, (protocol.Event, protocol.Events, protocol.Run))]

    def events() -> list[protocol.Event]:
        return [e for m in frames() for e in (
            m.as_events() if isinstance(m, protocol.Run) else
            m.events if isinstance(m, protocol.Events) else [m])]   # type: ignore[union-attr]

    turn(40, "small")      # 32 + 8
    turn(1, "alone")
    turn(3, "x" * 15_000)  # ~45 KB: over MAX_RUN_BYTES
    harness.until("every event at the coordinator", lambda: len(events()) >= 44)
    assert [e.seq for e in events()] == list(range(1, 45))
    assert [type(m).__name__ for m in frames()][:3] == ["Run", "Run", "Event"]
    runs = [m for m in frames() if isinstance(m, protocol.Run)]
    assert [len(r.events) for r in runs] == [32, 8]
    assert all(len(protocol.encode(r)) <= protocol.MAX_RUN_BYTES for r in runs)
    assert not any(isinstance(m, protocol.Run) for m in frames()[3:])   # the big turn
    assert all(r.common is None for r in runs)   # not asked for
    harness.router.send(protocol.Ack("boot-1", 44, batches=True, runs=True, common=True))
    harness.until("the outbox acknowledged", lambda: not harness.link.outbox)
    turn(4, "shared")   # (1.5) the fields the 4 share said once: all but "ts"
    harness.until("the run at the coordinator", lambda: len(events()) >= 48)
    last = frames()[-1]
    assert isinstance(last, protocol.Run) and last.common is not None
    assert "ts" not in last.common and last.common["detail"] == "shared"
    assert [e.seq for e in events()] == list(range(1, 49))


def test_a_commands_reply_goes_in_one_frame_with_the_turns_run_once_the_coordinator_takes_lines(
        harness: Harness) -> None:
    """(1.6) After an ACK that says `lines`, a turn's run and the reply to the command of that
    turn arrive as one frame, a line each, the run first; before it, as two frames."""
    harness.hello()

    def pausing(name: str, args: dict[str, Any]) -> dict[str, Any] | Deferred:
        """A command whose run emits two events, as a pause does (in the turn that takes it)."""
        for engine in ("e0", "e1"):
            harness.link.on_event(Event(ts=1.0, node_id="test-node", engine=engine,
                                        incarnation=1, kind="paused", detail="paused"))
        return ping_dispatch(name, args)
    harness.link._dispatch = pausing

    def turn_with_command(request_id: str) -> bytes:
        """The frame that brought the reply to a command that emitted 2 events."""
        harness.command(request_id)
        return next(f for f in harness.router.frames if request_id.encode() in f)

    harness.router.send(protocol.Ack("boot-1", 0, batches=True, runs=True, common=True))
    harness.until("the ACK taken", lambda: harness.link.outgoing.takes.runs)
    assert lines.NEWLINE not in turn_with_command("r-alone")   # a 1.5 coordinator: alone
    harness.router.send(protocol.Ack("boot-1", 2, batches=True, runs=True, common=True,
                                     lines=True))
    harness.until("the ACK taken", lambda: not harness.link.outbox)
    joined = turn_with_command("r-joined")
    parts = [protocol.decode(part) for part in lines.split(joined)]
    assert [type(m).__name__ for m in parts[:2]] == ["Run", "Reply"]
    assert all(isinstance(m, protocol.Heartbeat) for m in parts[2:])   # (one may be due)
    assert [e.seq for e in parts[0].as_events()] == [3, 4]   # type: ignore[union-attr]
    assert [e.seq for run in harness.router.got(protocol.Run)
            for e in run.as_events()] == [1, 2, 3, 4]   # each once, in order


def test_a_stale_ack_read_after_a_reconnect_neither_joins_the_hello_nor_sets_the_flags() -> None:
    """An ACK of the last connection (libzmq keeps a DEALER's queue across a reconnect) read
    after the new handshake says nothing of the new coordinator, which may be of any minor: the
    HELLO goes alone, and what follows goes a message per frame until this connection's own
    ACK says otherwise."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    link = NodeLink(ctx, endpoint=f"tcp://127.0.0.1:{free_port()}", node_id="test-node",
                    boot="boot-1", snapshot=lambda: [], dispatch=ping_dispatch, clock=Clock())
    sent: list[bytes] = []
    link.outgoing.send_frame = lambda frame: sent.append(frame) is None
    try:
        link._on_monitor_event(zmq.EVENT_HANDSHAKE_SUCCEEDED)   # a new connection
        link._receive(protocol.Ack("boot-1", 0, batches=True, runs=True, common=True,
                                   lines=True))   # read now, sent by the last coordinator
        for engine in ("e0", "e1"):
            link.on_event(Event(ts=1.0, node_id="test-node", engine=engine, incarnation=1,
                                kind="paused", detail="paused"))
        link._receive(PING)
        link.after_save()
        kinds = [protocol.decode(frame).KIND for frame in sent]
        assert kinds == ["hello", "event", "event", "reply"], kinds   # a message each
        link._receive(protocol.Ack("boot-1", 0, batches=True, runs=True, common=True,
                                   lines=True))   # this connection's own
        link._receive(protocol.Command("ping-2", "ping", {}, node="test-node"))
        for engine in ("e0", "e1"):
            link.on_event(Event(ts=2.0, node_id="test-node", engine=engine, incarnation=1,
                                kind="resumed", detail="resumed"))
        link.after_save()
        assert [protocol.decode(part).KIND for part in lines.split(sent[-1])] == ["run", "reply"]
    finally:
        link.close()
        ctx.term()
