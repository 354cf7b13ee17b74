"""The node's link to the coordinator: a loop participant of the node daemon (issue 6, part 2).

A DEALER whose routing id is the node id dials the configured `coordinator` (CURVE when the
config names `key` and `coordinator_key`). On every completed handshake it sends a HELLO with a
full snapshot, then every event not yet acknowledged. Events wait in a bounded outbox until the
coordinator ACKs them; on overflow the oldest are dropped and counted (the next HELLO's snapshot
supersedes them). Commands run through the node's one command table; a repeated request id gets
the same reply. Heartbeats go out about once a second. The node supervises on its own whenever
the coordinator is away: nothing here blocks, and nothing waits for it.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections import OrderedDict, deque
from collections.abc import Callable, Container
from typing import Any

import zmq
import zmq.auth

from rollout_watchdog.agent import protocol
from rollout_watchdog.watchdog.clock import Clock
from rollout_watchdog.watchdog.events import Event
from rollout_watchdog.watchdog.replies import CommandError, Deferred, PendingReplies

log = logging.getLogger(__name__)
HEARTBEAT_S = 1.0
OUTBOX_LIMIT = 10_000          # events kept for the coordinator (about 5 MB at most)
REPLIES_KEPT = 1024            # replies remembered for repeated request ids
MAX_MESSAGES_PER_ROUND = 100   # so a flood from the coordinator never starves the engines

Dispatch = Callable[[str, dict[str, Any]], "dict[str, Any] | Deferred"]


class NodeLink:
    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], *, endpoint: str, node_id: str,
                 boot: str, snapshot: Callable[[], list[dict[str, Any]]], dispatch: Dispatch,
                 clock: Clock, engine_status: Callable[[str], dict[str, Any] | None] = (
                     lambda engine_id: None),
                 key: str | None = None, coordinator_key: str | None = None,
                 heartbeat_s: float = HEARTBEAT_S, outbox_limit: int = OUTBOX_LIMIT) -> None:
        self.node_id, self.boot = node_id, boot
        self._snapshot, self._dispatch, self._clock = snapshot, dispatch, clock
        self._engine_status = engine_status
        self.heartbeat_s = heartbeat_s
        self.outbox: deque[protocol.Event] = deque()
        self.outbox_limit = outbox_limit
        self.seq = 0
        self.dropped = 0              # events dropped from a full outbox
        self.bad_messages = 0
        self._replies: OrderedDict[str, protocol.Reply] = OrderedDict()
        self._pending = PendingReplies()
        self._to_send: list[protocol.Message] = []
        self._next_heartbeat = 0.0
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.ROUTING_ID, node_id.encode())
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)   # nothing queued for a peer that is not there
        sock.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_MESSAGE_BYTES)
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 5000)
        if key and coordinator_key:
            public, secret = zmq.auth.load_certificate(key)
            server, _ = zmq.auth.load_certificate(coordinator_key)
            sock.curve_publickey, sock.curve_secretkey = public, secret
            sock.curve_serverkey = server
        self.monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        sock.connect(endpoint)
        self.socket = sock

    # ------------------------------------------------------------------ events (publisher)

    def on_event(self, event: Event) -> None:
        """A subscriber of the node's publish point: every event goes to the outbox."""
        self.seq += 1
        status = self._engine_status(event.engine) if event.engine is not None else None
        message = protocol.Event(self.node_id, self.boot, self.seq, event.to_json(), status)
        self.outbox.append(message)
        if len(self.outbox) > self.outbox_limit:
            self.outbox.popleft()
            self.dropped += 1
        self._to_send.append(message)

    # ------------------------------------------------------------------ the loop participant

    def pollables(self) -> list[Any]:
        return [self.socket, self.monitor]

    def handle(self, ready: Container[Any]) -> None:
        if self.monitor in ready:
            while self.monitor.poll(0):
                self.monitor.recv_multipart()
                self._hello()  # a (re)connected coordinator learns everything again
        if self.socket in ready:
            for _ in range(MAX_MESSAGES_PER_ROUND):
                try:
                    data = self.socket.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                try:
                    self._receive(protocol.decode(data))
                except protocol.ProtocolError as exc:
                    self.bad_messages += 1
                    log.warning("bad message from the coordinator: %s", exc)

    def tick(self, now: float) -> None:
        self._pending.answer(now)
        if now >= self._next_heartbeat:
            self._next_heartbeat = now + self.heartbeat_s
            self._to_send.append(protocol.Heartbeat(self._clock.wall()))

    def next_deadline(self) -> float | None:
        parked = self._pending.next_deadline()
        return self._next_heartbeat if parked is None else min(parked, self._next_heartbeat)

    def after_save(self) -> None:
        """Send what this turn made: after the save, a reply or event survives a crash."""
        for message in self._to_send:
            # no coordinator now (zmq.Again): events stay in the outbox, the HELLO resends them
            with contextlib.suppress(zmq.Again):
                self.socket.send(protocol.encode(message), zmq.NOBLOCK)
        self._to_send.clear()

    def close(self) -> None:
        self.socket.disable_monitor()
        self.monitor.close(linger=0)
        self.socket.close(linger=0)

    # ------------------------------------------------------------------ messages

    def _hello(self) -> None:
        """The snapshot, then every event not acknowledged (in order, once: events this turn
        made are in the outbox too)."""
        self._to_send = [m for m in self._to_send if not isinstance(m, protocol.Event)]
        self._to_send.append(protocol.Hello(self.node_id, self.boot, self._snapshot(),
                                            self.seq))
        self._to_send.extend(self.outbox)

    def _receive(self, message: protocol.Message) -> None:
        if isinstance(message, protocol.Ack):
            if message.boot == self.boot:
                while self.outbox and self.outbox[0].seq <= message.seq:
                    self.outbox.popleft()
        elif isinstance(message, protocol.Command):
            self._command(message)
        elif not isinstance(message, protocol.Heartbeat):
            self.bad_messages += 1
            log.warning("unexpected %s from the coordinator", type(message).__name__)

    def _command(self, command: protocol.Command) -> None:
        known = self._replies.get(command.request_id)
        if known is not None:  # a repeated request id: the same reply, nothing done again
            self._to_send.append(known)
            return
        args = dict(command.args)
        if command.engine is not None:
            args.setdefault("engine", command.engine)
        try:
            result = self._dispatch(command.cmd, args)
        except CommandError as exc:
            self._reply(command.request_id, {"status": "error", "reason": str(exc)})
            return
        except Exception as exc:  # a bug in one command must not take the daemon down
            log.exception("command from the coordinator failed")
            self._reply(command.request_id, {"status": "error",
                                             "reason": f"internal error: {exc!r}"})
            return
        if isinstance(result, Deferred):
            self._pending.park(b"coordinator", command.request_id, result,
                               lambda body: self._reply(command.request_id, body))
        else:
            self._reply(command.request_id, {"status": "ok", "result": result})

    def _reply(self, request_id: str, body: dict[str, Any]) -> None:
        status = body.get("status", "error")
        reply = protocol.Reply(request_id, status, body.get("reason") or (
            "no reason given" if status == "error" else None),
            json.loads(json.dumps(body.get("result"))))
        self._replies[request_id] = reply
        while len(self._replies) > REPLIES_KEPT:
            self._replies.popitem(last=False)
        self._to_send.append(reply)
