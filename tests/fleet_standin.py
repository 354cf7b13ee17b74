"""A stand-in coordinator for the client's tests: a real ROUTER on a real port, in a thread,
answering clients as docs/protocol.md ("The coordinator's side", clients) says, with what the
test sets. It can be restarted on the same port (a coordinator that died and came back) and made
sloppy (resending everything it holds) to show that the client drops what it has."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import zmq
from daemon_harness import wait_for

from rollout_watchdog.common import protocol

Answer = Callable[[protocol.Command], protocol.Reply | None]


def fan_out_ok(command: protocol.Command) -> protocol.Reply:
    """Every node named answers ok, with what the node's command would return."""
    nodes = [command.node] if command.node else ["n1", "n2"]
    result = {"engine": command.engine, "action": "killing, then relaunching"} \
        if command.engine else {"paused": ["e0"], "deadline": time.time() + 60}
    return protocol.Reply(command.request_id, "ok", None, {
        "nodes": {n: {"status": "ok", "reason": None, "result": result} for n in nodes},
        "missing": []})


def engine(engine_id: str, **over: Any) -> dict[str, Any]:
    return {"id": engine_id, "state": "healthy", "paused": False, "pid": 4242, "incarnation": 1,
            "restarts": 0, "url": "http://127.0.0.1:30000", "last_failure": None,
            "since": time.time(), "group": None, "tp_size": 2, "weight_version": "v1",
            "serving": True, "reachable": True, **over}


class StandIn:
    def __init__(self, port: int, heartbeat_s: float = 0.2) -> None:
        self.port, self.heartbeat_s = port, heartbeat_s
        self.fleet: dict[str, Any] = {"nodes": [
            {"node_id": "n1", "reachable": True, "last_seen": time.time(), "boot": "b1",
             "engines": [engine("e0"), engine("e1", state="starting", pid=None)]},
            {"node_id": "n2", "reachable": False, "last_seen": time.time() - 30, "boot": "b2",
             "engines": [engine("e0", reachable=False)]}]}
        self.answer: Answer = fan_out_ok
        self.commands: list[protocol.Command] = []
        self.subscribes: list[protocol.Subscribe] = []
        self.held: list[protocol.Event] = []     # what a coordinator keeps to resume from
        self.sloppy = False                       # resend everything held, ignoring resume
        self.junk: list[bytes] = []               # hostile frames sent ahead of each reply
        self.boot = "coordinator-boot-1"
        self._seq = 0
        self._outgoing: deque[protocol.Message | bytes] = deque()   # bytes: sent raw
        self._subscribers: set[bytes] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.ctx = zmq.Context()

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    # -- life

    def start(self) -> StandIn:
        sock = self.ctx.socket(zmq.ROUTER)
        sock.linger = 0

        def bound() -> bool:  # a closed socket's port is released by libzmq's own thread
            try:
                sock.bind(self.endpoint)
                return True
            except zmq.ZMQError:
                return False

        wait_for(bound, 10, f"port {self.port} to be free")
        self._stop.clear()
        self._subscribers.clear()
        self._thread = threading.Thread(target=self._serve, args=(sock,), daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Gone at once, as if killed: nothing is said to anyone."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
            self._thread = None

    def restart(self, boot: str) -> None:
        self.stop()
        self.boot, self._seq = boot, 0
        self.start()

    def close(self) -> None:
        self.stop()
        self.ctx.term()

    # -- what the test does

    def publish(self, node_id: str, boot: str, seq: int, **event: Any) -> protocol.Event:
        """A node's event, relayed to subscribers and held for resumes."""
        body = {"ts": time.time(), "node_id": node_id, "engine": "e0", "incarnation": 1,
                "kind": "state", "from": "healthy", "to": "stopping", "cause": "exited",
                "detail": None, **event}
        message = protocol.Event(node_id, boot, seq, body)
        self.held.append(message)
        self._outgoing.append(message)
        return message

    def node_event(self, node_id: str, kind: str) -> protocol.Event:
        """The coordinator's own word on a node (numbered by its own boot; never held)."""
        self._seq += 1
        message = protocol.Event(node_id, self.boot, self._seq, {
            "ts": time.time(), "node_id": node_id, "engine": None, "incarnation": None,
            "kind": kind, "from": None, "to": None, "cause": None, "detail": None})
        self._outgoing.append(message)
        return message

    def send_raw(self, frame: bytes) -> None:
        """A frame as it is (garbage, a message of the wrong kind) to the subscribers."""
        self._outgoing.append(frame)

    def wait_subscribed(self, count: int, timeout: float = 10.0) -> protocol.Subscribe:
        wait_for(lambda: len(self.subscribes) >= count and self._subscribers, timeout,
                 f"subscription #{count}")
        return self.subscribes[count - 1]

    # -- the server thread

    def _serve(self, sock: zmq.Socket[bytes]) -> None:
        next_beat = 0.0
        try:
            while not self._stop.is_set():
                if sock.poll(20):
                    peer, data = sock.recv_multipart()
                    self._receive(sock, peer, data)
                while self._outgoing and self._subscribers:
                    self._send_all(sock, self._outgoing.popleft())
                if time.monotonic() >= next_beat:
                    next_beat = time.monotonic() + self.heartbeat_s
                    self._send_all(sock, protocol.Heartbeat(time.time()))
        finally:
            sock.close(linger=0)

    def _send_all(self, sock: zmq.Socket[bytes], message: protocol.Message | bytes) -> None:
        frame = message if isinstance(message, bytes) else protocol.encode(message)
        for peer in list(self._subscribers):
            sock.send_multipart([peer, frame])

    def _receive(self, sock: zmq.Socket[bytes], peer: bytes, data: bytes) -> None:
        message = protocol.decode(data)
        if isinstance(message, protocol.Command):
            self.commands.append(message)
            reply = (protocol.Reply(message.request_id, "ok", None, self.fleet)
                     if message.cmd == "status" else
                     protocol.Reply(message.request_id, "ok", None, {"coordinator": self.boot})
                     if message.cmd == "ping" else self.answer(message))
            if reply is not None:
                for frame in self.junk:
                    sock.send_multipart([peer, frame])
                sock.send_multipart([peer, protocol.encode(reply)])
        elif isinstance(message, protocol.Subscribe):
            self.subscribes.append(message)
            self._subscribers = {peer}
            points = message.resume or {}
            for held in self.held:
                point = points.get(held.node_id)
                after = point is None or held.boot != point.boot or held.seq > point.seq
                if message.resume is not None and (after or self.sloppy):
                    sock.send_multipart([peer, protocol.encode(held)])
