"""The node's link to the coordinator: a loop participant of the node daemon (issue 6, part 2).

A DEALER whose routing id is the node id dials the configured `coordinator` (CURVE when the
config names `key` and `coordinator_key`). On every completed handshake it sends a HELLO with a
full snapshot, then every event not yet acknowledged. Events wait in a bounded outbox until the
coordinator ACKs them; how a turn's events and messages are framed for what the coordinator
takes (runs, batches, lines), and held back in order by a full send queue, is
agent/outgoing.py's.
Commands run through the node's one command table; a repeated request id gets the same reply,
and a repeat of one still running (the coordinator sends its unanswered commands again on every
HELLO) gets nothing but that command's one reply when it is done.
Heartbeats go out about once a second. The node supervises on its own whenever the coordinator
is away: nothing here blocks, and nothing waits for it.

Staying linked (part 6). ZMTP heartbeats (PING every `heartbeat_s`, the connection closed when
nothing came back for `heartbeat_timeout_s`) find a half-open connection, such as a coordinator
whose host vanished or a cut network, and libzmq dials again. libzmq does not dial again after a
connection it dropped for a protocol error (a frame over MAX_MESSAGE_BYTES, garbage ZMTP): the
link notices (a disconnect that no retry follows) and dials again itself, with backoff. So does
it when a handshaken coordinator stays silent for `silent_redial_s` (a ROUTER that took the
reconnected node for a duplicate of its stale connection never reads from it). Bad input is
dropped and counted, never fatal; the counts are in the node's metrics and `status`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import secrets
from collections import deque
from collections.abc import Callable, Container
from typing import Any, Protocol, cast

import zmq

from rollout_watchdog.agent.outgoing import Outgoing
from rollout_watchdog.common import handshakes, protocol
from rollout_watchdog.common.clock import Clock
from rollout_watchdog.common.events import Event
from rollout_watchdog.common.keys import ClientKeys
from rollout_watchdog.common.lograte import worth_logging
from rollout_watchdog.common.replies import (
    CommandError,
    Deferred,
    PendingReplies,
    RecentReplies,
)

log = logging.getLogger(__name__)
HEARTBEAT_S = 1.0
HEARTBEAT_TIMEOUT_S = 3.0      # no word from the coordinator for this long: it is gone
SILENT_REDIAL_S = 10.0         # handshaken but silent this long: dial afresh
REDIAL_GRACE_S = 0.5           # a disconnect with no retry from libzmq within this: dial again
REDIAL_BACKOFF_S = (1.0, 30.0)  # first and longest wait between redials of our own
OUTBOX_LIMIT = 10_000          # events kept for the coordinator (about 5 MB at most)
SEND_RETRY_S = 0.01          # how soon sends held back by a full queue are tried again
MAX_MESSAGES_PER_ROUND = 100   # so a flood from the coordinator never starves the engines
# Plain ints: pyzmq's flag enums cost microseconds a use (a node's every message)
_NOBLOCK, _EVENTS, _POLLIN = int(zmq.NOBLOCK), int(zmq.EVENTS), int(zmq.POLLIN)
# Dropped handshakes in a row before the link warns (one alone may be a coordinator restarting)
DROPS_TO_WARN = 3
COORDINATOR = b"coordinator"   # the one client of this link's parked replies
_MONITORED = (zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
              | zmq.EVENT_CONNECT_RETRIED | handshakes.FAILURES)

Dispatch = Callable[[str, dict[str, Any]], "dict[str, Any] | Deferred"]


class LinkMetrics(Protocol):
    """What the link reports to the node's metrics (watchdog.metrics.Metrics is one)."""

    def link_bad_message(self, reason: str) -> None: ...
    def link_events_dropped(self) -> None: ...
    def set_link_state(self, outbox: int, connected: bool) -> None: ...


class NodeLink:
    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], *, endpoint: str, node_id: str,
                 boot: str, snapshot: Callable[[], list[dict[str, Any]]], dispatch: Dispatch,
                 clock: Clock, engine_status: Callable[[str], dict[str, Any] | None] = (
                     lambda engine_id: None),
                 key: str | None = None, coordinator_key: str | None = None,
                 heartbeat_s: float = HEARTBEAT_S,
                 heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S,
                 silent_redial_s: float = SILENT_REDIAL_S, outbox_limit: int = OUTBOX_LIMIT,
                 metrics: LinkMetrics | None = None, metrics_port: int | None = None) -> None:
        self.endpoint, self.node_id, self.boot = endpoint, node_id, boot
        self.metrics_port = metrics_port   # told in every HELLO, for the fleet view
        self._snapshot, self._dispatch, self._clock = snapshot, dispatch, clock
        self._engine_status = engine_status
        self.heartbeat_s, self.heartbeat_timeout_s = heartbeat_s, heartbeat_timeout_s
        self.silent_redial_s = silent_redial_s
        self._metrics = metrics
        self.outgoing = Outgoing(self._send_frame, outbox_limit,
                                 None if metrics is None else metrics.link_events_dropped)
        self.seq = 0
        self.bad_messages = 0         # frames dropped, and connections lost to bad frames
        self.failed_handshakes = 0    # with the coordinator (each logged, rate-limited)
        self.handshake_failure: str | None = None   # why the last one failed, until one passes
        self._failed_in_a_row = 0
        self._keyed = bool(key and coordinator_key)
        self.coordinator_seen: float | None = None   # monotonic time of its last message
        self._handshake_at: float | None = None      # the current connection's handshake
        self._redial_at: float | None = None
        self._redial_wait = REDIAL_BACKOFF_S[0]
        self._replies: RecentReplies[protocol.Reply] = RecentReplies()
        self._pending = PendingReplies()
        self._retry_at: float | None = None          # sends held back by a full queue
        self._next_heartbeat = 0.0
        sock = ctx.socket(zmq.DEALER)
        # With CURVE the coordinator knows the node by its key, and a routing id of its own
        # that is never shown keeps any other admitted peer off its connection
        # (hub_socket.NodeRoutes); without, the routing id is the node id.
        sock.setsockopt(zmq.ROUTING_ID, secrets.token_hex(16).encode() if self._keyed
                        else node_id.encode())
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)   # nothing queued for a peer that is not there
        sock.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_MESSAGE_BYTES)
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 5000)
        # ZMTP PINGs find a half-open connection; TTL asks the coordinator to drop ours alike
        sock.setsockopt(zmq.HEARTBEAT_IVL, round(heartbeat_s * 1000))
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, round(heartbeat_timeout_s * 1000))
        sock.setsockopt(zmq.HEARTBEAT_TTL, round(heartbeat_timeout_s * 1000))
        if key and coordinator_key:
            ClientKeys.load(key, coordinator_key).apply(sock)
        self.monitor = sock.get_monitor_socket(_MONITORED)
        sock.connect(endpoint)
        self.socket = sock

    @property
    def connected(self) -> bool:
        """A handshake succeeded and the coordinator spoke within the heartbeat timeout."""
        return (self._handshake_at is not None and self.coordinator_seen is not None
                and self._clock.monotonic() - self.coordinator_seen <= self.heartbeat_timeout_s)

    def status(self) -> dict[str, Any]:
        """The `link` object of the node's `status`."""
        return {"coordinator": self.endpoint, "connected": self.connected,
                "outbox": len(self.outbox), "unsent": self.unsent, "dropped": self.dropped,
                "bad_messages": self.bad_messages, "failed_handshakes": self.failed_handshakes,
                "handshake_failure": self.handshake_failure}

    @property
    def outbox(self) -> deque[protocol.Event]:
        """The events kept until the coordinator ACKs them."""
        return self.outgoing.outbox

    @property
    def dropped(self) -> int:
        """Events dropped from a full outbox."""
        return self.outgoing.dropped

    @property
    def unsent(self) -> int:
        """Events of the outbox not sent on this connection yet."""
        return self.outgoing.unsent

    # ------------------------------------------------------------------ events (publisher)

    def on_event(self, event: Event) -> None:
        """A subscriber of the node's publish point: every event goes to the outbox."""
        self.seq += 1
        status = None if event.engine is None or event.kind in protocol.PAUSE_KINDS \
            else self._engine_status(event.engine)
        self.outgoing.add_event(
            protocol.Event(self.node_id, self.boot, self.seq, event.to_json(), status))

    # ------------------------------------------------------------------ the loop participant

    def pollables(self) -> list[Any]:
        return [self.socket, self.monitor]

    def handle(self, ready: Container[Any]) -> None:
        if self.monitor in ready:
            while self.monitor.poll(0):
                self._on_monitor_event(handshakes.read_event(self.monitor).event)
        if self.socket in ready:
            for _ in range(MAX_MESSAGES_PER_ROUND):
                if not cast(int, self.socket.get(_EVENTS)) & _POLLIN:   # (no zmq.Again: ~5 us)
                    break
                data = self.socket.recv(_NOBLOCK)
                try:
                    message = protocol.decode(data)
                except protocol.ProtocolError as exc:
                    self._bad("undecodable", str(exc))
                    continue
                self.coordinator_seen = self._clock.monotonic()
                self._redial_wait = REDIAL_BACKOFF_S[0]  # it speaks our protocol
                self._receive(message)

    def tick(self, now: float) -> None:
        self._pending.answer(now)
        if self._redial_at is not None and now >= self._redial_at:
            if not self._failed_in_a_row:   # (a failed handshake is counted as such)
                self._bad("protocol_error", "libzmq dropped the connection for a protocol error "
                          f"(a frame over {protocol.MAX_MESSAGE_BYTES} bytes, garbage) and gave "
                          "it up; dialing again")
            self._redial()
        elif (silent_since := self._silent_since()) is not None \
                and now - silent_since >= self.silent_redial_s:
            log.warning("the coordinator has been silent for %.0f s on an open connection; "
                        "dialing it afresh", now - silent_since)
            self._redial()
        if now >= self._next_heartbeat:
            self._next_heartbeat = now + self.heartbeat_s
            self.outgoing.queue(protocol.Heartbeat(self._clock.wall()))

    def next_deadline(self) -> float | None:
        deadlines = [self._next_heartbeat]
        if self._retry_at is not None:
            deadlines.append(self._retry_at)
        if self._redial_at is not None:
            deadlines.append(self._redial_at)
        if (silent_since := self._silent_since()) is not None:
            deadlines.append(silent_since + self.silent_redial_s)
        if (parked := self._pending.next_deadline()) is not None:
            deadlines.append(parked)
        return min(deadlines)

    def after_save(self) -> None:
        """Send what this turn made: after the save, a reply or event survives a crash.
        Nothing goes out before this connection's HELLO: a message libzmq took ahead of it
        would reach a coordinator that does not know this boot yet (events wait in the
        outbox, and the HELLO resends them)."""
        if self._handshake_at is None:
            self.outgoing.drop_queued()
        elif self.outgoing.send_all():
            self._retry_at = None
        else:
            # The coordinator's queue is full (it is slow, or gone and libzmq does not know
            # yet): the rest waits, in order, for the next turn (agent/outgoing.py).
            self._retry_at = self._clock.monotonic() + SEND_RETRY_S
        if self._metrics is not None:
            self._metrics.set_link_state(len(self.outbox), self.connected)

    def _send_frame(self, frame: bytes) -> bool:
        """Send one frame; any message says the node is alive, so the next heartbeat is due a
        heartbeat interval after it (a busy node sends none: a fleet-wide pause's window at
        the coordinator holds a thousand fewer messages)."""
        try:
            self.socket.send(frame, _NOBLOCK)
        except zmq.Again:
            return False
        self._next_heartbeat = self._clock.monotonic() + self.heartbeat_s
        return True

    def close(self) -> None:
        handshakes.close_monitored(self.socket, self.monitor)   # (drained first: see there)

    # ------------------------------------------------------------------ the connection

    def _on_monitor_event(self, event: int) -> None:
        now = self._clock.monotonic()
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self._handshake_at, self._redial_at = now, None
            self.handshake_failure, self._failed_in_a_row = None, 0
            self._hello()  # a (re)connected coordinator learns everything again
        elif event == zmq.EVENT_DISCONNECTED:
            # libzmq retries at once after a lost connection, never after a protocol error
            self._handshake_at = None
            self._redial_at = now + max(REDIAL_GRACE_S, self._redial_wait)
        elif event == zmq.EVENT_CONNECT_RETRIED:
            self._redial_at = None
        elif event in handshakes.FAILED:   # no link: nothing else would say why
            self.failed_handshakes += 1
            self._failed_in_a_row += 1
            self.handshake_failure = handshakes.failed_handshake_hint(event, self._keyed)
            # a refused key is certain; a dropped handshake, once, may be a restart
            certain = event == zmq.EVENT_HANDSHAKE_FAILED_AUTH \
                or self._failed_in_a_row >= DROPS_TO_WARN
            if worth_logging(self.failed_handshakes):
                log.log(logging.WARNING if certain else logging.INFO,
                        "no link to the coordinator at %s (failed handshakes: %d): %s",
                        self.endpoint, self.failed_handshakes, self.handshake_failure)

    def _silent_since(self) -> float | None:
        """Since when a handshaken coordinator has said nothing (None: not handshaken)."""
        if self._handshake_at is None:
            return None
        return max(self._handshake_at, self.coordinator_seen or self._handshake_at)

    def _redial(self) -> None:
        """Drop the connection (if any) and dial again, backing off while it keeps failing."""
        self._handshake_at, self._redial_at = None, None
        self._redial_wait = min(self._redial_wait * 2, REDIAL_BACKOFF_S[1])
        with contextlib.suppress(zmq.ZMQError):  # libzmq may have forgotten it already
            self.socket.disconnect(self.endpoint)
        self.socket.connect(self.endpoint)

    def _bad(self, reason: str, why: str) -> None:
        """Count a bad message; log it, rate-limited (lograte)."""
        self.bad_messages += 1
        if self._metrics is not None:
            self._metrics.link_bad_message(reason)
        if worth_logging(self.bad_messages):
            log.warning("bad message #%d from the coordinator (%s): %s", self.bad_messages,
                        reason, why)

    # ------------------------------------------------------------------ messages

    def _hello(self) -> None:
        """The snapshot first, then every event not acknowledged (in order, once)."""
        self.outgoing.hello(protocol.Hello(self.node_id, self.boot, self._snapshot(), self.seq,
                                           self.metrics_port))

    def _receive(self, message: protocol.Message) -> None:
        if isinstance(message, protocol.Ack):
            self.outgoing.acked(message, self.boot)
        elif isinstance(message, protocol.Command):
            self._command(message)
        elif not isinstance(message, protocol.Heartbeat):
            self._bad("unexpected_kind", f"a {message.KIND!r} message, which only goes "
                      "towards the coordinator")

    def _command(self, command: protocol.Command) -> None:
        known = self._replies.get(command.request_id)
        if known is not None:  # a repeated request id: the same reply, nothing done again
            self.outgoing.queue(known)
            return
        if self._pending.waiting(COORDINATOR, command.request_id):
            return   # a repeat of one still running (sent again on a HELLO): its reply comes
        args = dict(command.args)
        if command.engine is not None:
            args.setdefault("engine", command.engine)
        try:
            result = self._dispatch(command.cmd, args)
        except CommandError as exc:
            self._reply(command.request_id, {"status": "error", "reason": str(exc),
                                             "code": exc.code})
            return
        except Exception as exc:  # a bug in one command must not take the daemon down
            log.exception("command from the coordinator failed")
            self._reply(command.request_id, {"status": "error", "code": protocol.INTERNAL,
                                             "reason": f"internal error: {exc!r}"})
            return
        if isinstance(result, Deferred):
            self._pending.park(COORDINATOR, command.request_id, result,
                               lambda body: self._reply(command.request_id, body))
        else:
            self._reply(command.request_id, {"status": "ok", "result": result})

    def _reply(self, request_id: str, body: dict[str, Any]) -> None:
        """Answer (and remember) a request. A result that is not JSON (a command's bug) is
        answered as an internal error: raising here would lose the answer, and a deferred one
        would raise again on every loop turn."""
        try:
            result = json.loads(json.dumps(body.get("result")))
        except (TypeError, ValueError) as exc:
            log.error("the result of command %s cannot be encoded: %s", request_id, exc)
            body, result = {"status": "error", "code": protocol.INTERNAL, "reason": (
                f"internal error: the result cannot be encoded: {exc}")[:1000]}, None
        status = body.get("status", "error")
        reply = protocol.Reply(request_id, status, body.get("reason") or (
            "no reason given" if status == "error" else None), result,
            body.get("code") if status == "error" else None)
        self._replies.put(request_id, reply)
        self.outgoing.queue(reply)
