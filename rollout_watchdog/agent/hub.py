"""The coordinator's hub: the one ROUTER that nodes and clients connect to, and its loop
(DESIGN.md, "Agent"; docs/protocol.md, "The coordinator's side").

It receives and decodes every message and checks who sent it (`hub_socket.NodeRoutes`), hands
a node's events to `node_events.NodeEvents` (the view, the ACK count, the relay, group
restarts), ACKs them once taken (journaled first, with a state dir: `journal.Journal`; most
ACKs ride the next heartbeat: `acks.AckSchedule`), relays them to subscribed clients
(`relay.Relay`), fans commands out to nodes and gathers their replies (`fanout.Fanout`), and
heartbeats. What a node's message means is the fleet view's to say, and everything else is
the policy's to decide (`hub_policy`: commands, group restarts, the refit lock, router
gating); the coordinator (`refit_bridge.coordinator`) hands both in.

`loop` is one turn after another, each the same named steps: wait for a message or the next
deadline; obey the pipe (`pipe.Pipe`: stop, reload the keys), which wakes the poll at once;
receive (and count the handshakes that failed: `hub_socket.FailedHandshakes`); do what is
due; relay. It never blocks: every send is non-blocking, every wait is the
poll's. `hub_thread.HubThread` serves it, in a thread of its own or in the caller's.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable

import zmq

from rollout_watchdog.agent.acks import AckSchedule
from rollout_watchdog.agent.fanout import DEFAULT_TIMEOUT_S, Fanout, Gathering
from rollout_watchdog.agent.hub_policy import OwnEvent, Policy, Refused, View
from rollout_watchdog.agent.hub_socket import FailedHandshakes, NodeRoutes, bind_hub
from rollout_watchdog.agent.journal import Journal
from rollout_watchdog.agent.node_events import NodeEvents
from rollout_watchdog.agent.pipe import RELOAD, STOP, Pipe
from rollout_watchdog.agent.relay import BUFFER_EVENTS, Relay, Relayed
from rollout_watchdog.agent.security import NamedKeyAuthenticator
from rollout_watchdog.common import frames, handshakes, lines, protocol
from rollout_watchdog.common.events import Event
from rollout_watchdog.common.handshakes import HANDSHAKE_TIMEOUT_S
from rollout_watchdog.common.lograte import worth_logging
from rollout_watchdog.common.plain import PlainRun, decode_plain

log = logging.getLogger(__name__)
HEARTBEAT_S = 1.0
SWEEP_S = 0.1               # how often silent nodes and subscribers are looked for
MESSAGES_PER_TURN = 5_000   # then the relay sends as many (SENDS_PER_TURN): subscribers keep pace
BEHIND_POLL_S = 0.005       # the relay has more to send: a short look at the sockets first
MONITOR_EVENTS_PER_TURN = 3_000   # monitor events read a turn (3 a connection): a flood waits
# A turn that came this much later than the poll asked (the process stopped, swapped out, a
# paused VM) was the loop's own silence, not its peers': the sweep waits STALL_GRACE_S more,
# for the messages queued meanwhile (libzmq's I/O thread stopped too: not all are readable at
# once) to be taken before any peer is judged silent.
STALL_S = 1.0
STALL_GRACE_S = 1.0
# Plain ints for the flags of the sends and receives of every message: pyzmq's flag enums, and
# its multipart helpers built on them, cost microseconds a call (thousands a fleet-wide pause)
_NOBLOCK, _SNDMORE = int(zmq.NOBLOCK), int(zmq.SNDMORE)
_SEPARATOR = lines.SEPARATOR


class Hub:
    """See the module docstring. Not thread-safe: only the thread that serves it calls it;
    others talk to it over ZMQ, or down its pipe."""

    def __init__(self, bind: str, keys: str | None, view: View, policy: Policy, boot: str,
                 state_dir: str | None = None, heartbeat_s: float = HEARTBEAT_S,
                 sweep_s: float = SWEEP_S, handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S
                 ) -> None:
        self.bind, self.keys, self.boot = bind, keys, boot
        self.endpoint = bind      # the bound one once serving (a port 0 picked)
        self.view, self.policy = view, policy
        self.heartbeat_s, self.sweep_s = heartbeat_s, sweep_s
        self.routes = NodeRoutes(curve=bool(keys))
        self.relay = Relay(gap_frame=self._gap_frame)
        self.journal = Journal(state_dir, BUFFER_EVENTS) if state_dir else None
        self.fanout = Fanout()
        self.bad_messages: Counter[str] = Counter()
        self.handshakes = FailedHandshakes(handshake_timeout_s)   # connections that never spoke
        self.own_seq = 0
        self.sock: zmq.Socket[bytes] | None = None
        self.monitor: zmq.Socket[bytes] | None = None   # the ROUTER's handshakes
        self._unjournaled: list[Relayed] = []
        self.acks = AckSchedule()
        self.node_events = NodeEvents(view, policy, self.acks, self._relay, self.own_events,
                                      self._bad)
        self._next_heartbeat = self._next_sweep = 0.0
        self._sweep_deferred = False   # by a stall of the loop, until the sweep has run
        self._auth: NamedKeyAuthenticator | None = None

    # ------------------------------------------------------------------ open and close

    def open(self, ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
        """Journal back into the relay, socket bound in `ctx`, policy told; ValueError naming
        the problem, and then everything closed again."""
        try:
            if self.journal is not None:
                try:
                    restored = self.journal.load()
                except OSError as exc:
                    raise ValueError(f"cannot use the state dir {self.journal.path.parent}: "
                                     f"{exc}") from exc
                for item in restored:
                    self.relay.add(item)
                self.policy.restored(restored)
            sock, monitor, self._auth = bind_hub(ctx, self.bind, self.keys,
                                                 self.handshakes.timeout_s)
            self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
            self.sock, self.monitor = sock, monitor
            self.policy.opened()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        self.policy.closed()
        if self.journal is not None:
            self.journal.close()
        if self.sock is not None and self.monitor is not None:
            handshakes.close_monitored(self.sock, self.monitor)
            self.sock = self.monitor = None
        if self._auth is not None:
            self._auth.stop()
            self._auth = None

    # ------------------------------------------------------------------ the loop

    def loop(self, pipe: Pipe) -> None:
        """One turn after another, each the same steps, until STOP comes down the pipe."""
        assert self.sock is not None and self.monitor is not None
        poller = zmq.Poller()
        for sock in (pipe.end, self.sock, self.monitor):
            poller.register(sock, zmq.POLLIN)
        woken = self.policy.wakeup_fd
        if woken is not None:
            poller.register(woken, zmq.POLLIN)
        behind = False   # the relay had more to send than a turn sends
        woke = time.monotonic()
        while True:
            # wait: for a message, a command down the pipe, or the next deadline
            timeout = BEHIND_POLL_S if behind else self._timeout(time.monotonic())
            ready = dict(poller.poll(int(timeout * 1000)))
            woke, last = time.monotonic(), woke
            self._stalled(woke, woke - last > timeout + STALL_S)   # (in the wait, or the turn)
            # obey the pipe: stop (before anything else), reload the keys
            if pipe.end in ready and not self._obey(pipe.receive()):
                return
            if woken in ready:          # the policy's own descriptor (its state written)
                self.policy.woke(time.monotonic())
            if self.sock in ready:      # receive: messages, then the journal and the ACKs
                self._receive_some()
            if self.monitor in ready:   # handshakes that failed: counted, logged
                self.handshakes.take(self.monitor, MONITOR_EVENTS_PER_TURN)
            # what is due: expired gatherings, the sweep, heartbeats
            now = time.monotonic()
            self._stalled(now, now - woke > STALL_S)   # (this very turn)
            self._tick(now, time.time())
            # relay: events to subscribers, as far as their queues take them
            behind = self.relay.pump(self._send_or_wait, time.monotonic())

    def _stalled(self, now: float, stalled: bool) -> None:
        """After the loop's own silence, the sweep waits for the messages queued meanwhile
        (once until it ran: a loop that is slow every turn still sweeps)."""
        if stalled and not self._sweep_deferred:
            self._sweep_deferred = True
            self._next_sweep = max(self._next_sweep, now + STALL_GRACE_S)
            log.warning("coordinator: its loop did not run for a while (stopped, swapped out?): "
                        "peers are judged silent again in %g s", STALL_GRACE_S)

    def _timeout(self, now: float) -> float:
        """Until the soonest deadline: nothing else needs a turn (the pipe wakes the poll for
        stop and reload, the sockets for messages)."""
        policy = self.policy.next_deadline()   # (met in the sweep: never before it)
        deadlines = [self._next_heartbeat, self._next_sweep, self.fanout.next_deadline(),
                     None if policy is None else max(policy, self._next_sweep)]
        soonest = min(d for d in deadlines if d is not None)
        return max(0.0, soonest - now)

    def _obey(self, commands: list[bytes]) -> bool:
        """The commands that came down the pipe; False for STOP."""
        if STOP in commands:
            return False
        if RELOAD in commands:
            self._reload_keys()
        return True

    def _reload_keys(self) -> None:
        if self._auth is None:
            log.warning("no keys to reload: this coordinator runs without CURVE")
            return
        try:
            self._auth.reload()
        except (OSError, ValueError) as exc:  # a half-copied key file: keep the old list
            log.error("cannot reload the authorized keys, keeping the old list: %s", exc)

    def _receive_some(self) -> None:
        assert self.sock is not None
        taken = 0   # bytes: a turn takes less than the relay buffer holds, so that the events
        handled = 0   # reach subscribers before they could leave it; messages, lines counted
        while handled < MESSAGES_PER_TURN and taken <= self.relay.max_bytes // 4:
            try:
                received = self._recv()
            except zmq.Again:
                break
            if received is None:
                handled += 1
            else:
                taken += len(received[1])
                handled += self._take(*received)
        if self.journal is not None and self._unjournaled:
            self.journal.append(self._unjournaled, lambda: self.relay.buffer)  # before ACKs
        self._unjournaled.clear()
        for node_id in self.acks.due_now():
            self._ack(node_id)

    def _ack(self, node_id: str) -> None:
        """ACK what the node sent so far; one that could not be sent (no route, a full queue)
        stays owed, for its next heartbeat."""
        record = self.view.nodes[node_id]
        if self._send_node(node_id, frames.ack_frame(record.boot, record.received_seq)):
            self.acks.sent(node_id)

    def _recv(self) -> tuple[bytes, bytes, str | None] | None:
        """(peer, message, name of its CURVE key); None for a bad frame count. The message is
        taken as a Frame, whose `more` is libzmq's flag as read: `get(RCVMORE)` cost ~3 us a
        message here (pyzmq looks every option up in an enum), more than the two receives."""
        assert self.sock is not None
        route = self.sock.recv(_NOBLOCK)   # (a ROUTER's message has a frame after the routing id)
        body = self.sock.recv(_NOBLOCK, copy=False)
        if not body.more:
            return route, body.bytes, str(body.get("User-Id")) if self.keys else None
        count, more = 1, True
        while more:
            more = self.sock.recv(_NOBLOCK, copy=False).more
            count += 1
        self._bad("framing", f"{count} frames instead of one")
        return None

    def _take(self, route: bytes, data: bytes, user: str | None) -> int:
        """A frame: one message, or (1.6) its lines, each taken as if it came alone, on a
        node's connection only (after its HELLO); how many messages it counts for."""
        if _SEPARATOR not in data:
            parts = [data]
        elif self.routes.node_of(route) is None:
            self._bad("framing", "a frame of lines from a peer that sent no HELLO (routing id "
                                 f"{route[:60]!r})")
            return 1
        else:
            try:
                parts = lines.split(data)
            except protocol.ProtocolError as exc:
                self._bad("framing", str(exc))
                return 1
        for part in parts:
            try:
                self._receive(route, part, user)
            except Exception:  # a bug on one message must not stop the fleet's hub
                self.bad_messages["internal_error"] += 1
                log.exception("coordinator: failed to handle a message")
        return len(parts)

    def _receive(self, route: bytes, data: bytes, user: str | None) -> None:
        """One message from the connection `route`; `user` is the name of its CURVE key (None
        without). Only the connection a node's HELLO came from speaks for it (NodeRoutes)."""
        try:
            msg = decode_plain(data)
        except protocol.ProtocolError as exc:
            self._bad("undecodable", str(exc))
            return
        node = self.routes.node_of(route)
        now, wall = time.monotonic(), time.time()
        if node is not None and self.keys and user != node:   # a routing id taken over
            self._bad("unknown_node", f"{msg.KIND} from node {node!r}'s routing id under the "
                                      f"key of {user!r}")
            return
        try:
            if isinstance(msg, protocol.Hello):
                self._hello(msg, route, user, now, wall)
            elif isinstance(msg, (protocol.Event, protocol.PlainEvents, protocol.Events,
                                  PlainRun)):
                if node is None:
                    raise Refused("no_hello", f"{msg.KIND} from a peer that sent no HELLO "
                                              f"(routing id {route[:60]!r})")
                if isinstance(msg, protocol.Event):
                    self.node_events.event(msg, data, node, now, wall)
                elif isinstance(msg, PlainRun):
                    self.node_events.run(msg, data, node, now, wall)
                else:
                    self.node_events.batch(msg, data, node, now, wall)
            elif isinstance(msg, protocol.Reply):
                if node is not None:   # anyone else's reply is no answer
                    self.own_events(self.view.heard(node, now, wall))
                    gathering = self.fanout.answered(msg, node)
                    if gathering is not None:
                        self._answer(gathering)
            elif isinstance(msg, protocol.Command):
                self.policy.command(route, msg, now)
            elif isinstance(msg, protocol.Subscribe):
                self.relay.subscribe(route, msg, now)
            elif isinstance(msg, protocol.Heartbeat):
                if node is not None:
                    self.own_events(self.view.heard(node, now, wall))
                self.relay.heard(route, now)
            else:
                self._bad("wrong_direction", f"{msg.KIND} from {route[:60]!r}")
        except Refused as exc:
            self._bad(exc.reason, str(exc))

    def _hello(self, msg: protocol.Hello, route: bytes, user: str | None, now: float,
               wall: float) -> None:
        refusal = self.routes.refusal(route, msg.node_id, user)
        if refusal is not None:
            raise Refused("unknown_node", refusal)
        self.policy.changed()   # a snapshot: engines may differ, no event says so
        self.own_events(self.view.hello(msg, msg.node_id, now, wall))
        self.routes.bind(route, msg.node_id)
        self.acks.hello(msg.node_id)
        for gathering in self.fanout.unanswered(msg.node_id):   # lost with a connection, unsent
            self._send_command(msg.node_id, gathering, now)

    def _tick(self, now: float, wall: float) -> None:
        """What is due: expired gatherings; the sweep (silent nodes and subscribers, then the
        policy's checks); heartbeats to nodes and subscribers."""
        for gathering in self.fanout.expire(now):
            self._answer(gathering)
        if now >= self._next_sweep:  # the per-node checks, O(nodes): a few times a second
            self._next_sweep, self._sweep_deferred = now + self.sweep_s, False
            gone = self.view.tick(now, wall)
            self.own_events(gone)
            for event in gone:
                for gathering in self.fanout.node_gone(event["node_id"]):
                    self._answer(gathering)
            for client in self.relay.expire(now):
                log.info("subscriber %s silent for %g s: unsubscribed", client.hex(),
                         self.relay.subscriber_timeout_s)
            self.policy.sweep(now)
        if now >= self._next_heartbeat:
            self._next_heartbeat = now + self.heartbeat_s
            for node, gathering in self.fanout.unsent():
                self._send_command(node, gathering, now)
            beat = protocol.encode(protocol.Heartbeat(wall))
            for node in self.view.reachable():
                if self.acks.owed(node):   # an ACK stands for the heartbeat
                    self._ack(node)
                else:
                    self._send_node(node, beat)
            for client in list(self.relay.subscribers):
                self.send(client, beat)

    # ------------------------------------------------------------------ commands down

    def gather(self, client: bytes | None, cmd: protocol.Command, targets: list[str],
               now: float, finish: Callable[[Gathering], protocol.Reply | None] | None = None
               ) -> None:
        """Fan `cmd` out to `targets`; its gathered reply goes to `client` (None: nobody),
        made by `finish` if given. Every node is waited for until it answers, goes unreachable
        or the deadline passes, its command sent again on each of its HELLOs (one lost with a
        connection that was gone) and, while it cannot be sent, at each heartbeat."""
        timeout = cmd.timeout_s or DEFAULT_TIMEOUT_S
        gathering = Gathering(client, cmd, targets, now + timeout, finish=finish)
        for node, _ in self.fanout.start(gathering):
            self._send_command(node, gathering)
        if self.fanout.settle(gathering):
            self._answer(gathering)

    def _send_command(self, node: str, gathering: Gathering, again: float | None = None
                      ) -> None:
        """Send `node` its command of `gathering` (sent `again` at that time: `Fanout.again`),
        or mark it to be tried again."""
        frame = (gathering.commands[node] if again is None
                 else self.fanout.again(gathering, node, again))
        if self._send_node(node, frame):
            gathering.unsent.discard(node)
        else:
            gathering.unsent.add(node)

    def reply(self, client: bytes, reply: protocol.Reply) -> None:
        """Answer `client`; the reply is kept for a repeat of its request id."""
        self.send_reply(client, self.fanout.remember(reply))

    def send_reply(self, client: bytes, frame: bytes) -> None:
        """Send a reply; one that cannot go (the client's queue full, or the client gone) is
        counted (`bad_messages`, reason reply_dropped) and logged, rate-limited."""
        if not self.send(client, frame):
            self._bad("reply_dropped", f"a reply to client {client.hex()[:32]}: its queue is "
                      "full or it is gone")

    def _answer(self, gathering: Gathering) -> None:
        reply = gathering.final
        if reply is None:
            return
        if gathering.client is not None:
            self.send_reply(gathering.client, gathering.frame)
        elif reply.status == "error":
            log.warning("%s %s: %s", gathering.command.cmd, gathering.command.engine,
                        reply.reason)

    # ------------------------------------------------------------------ output

    def own_events(self, events: list[OwnEvent]) -> None:
        """Relay events of the coordinator's own (numbered by its boot and count)."""
        for event in events:
            self.own_seq += 1
            log.info("%s: %s (%s)", event["node_id"], event["kind"], event["detail"])
            message = protocol.Event(event["node_id"], self.boot, self.own_seq, event)
            self._relay(Relayed(event["node_id"], self.boot, self.own_seq,
                                protocol.encode(message), own=True))

    def _gap_frame(self, lost: int) -> bytes:
        """The "gap" event that tells a subscriber that fell out of the relay buffer how many
        events it lost (its own: no other subscriber gets it)."""
        self.own_seq += 1
        event = Event(time.time(), "*", None, None, "gap",
                      detail=f"{lost} event(s) lost: this subscriber fell behind the relay "
                             f"buffer ({self.relay.capacity} events, "
                             f"{self.relay.max_bytes >> 20} MiB)").to_json()
        return protocol.encode(protocol.Event("*", self.boot, self.own_seq, event))

    def _relay(self, item: Relayed) -> None:
        self.policy.changed()   # every change of the view comes with an event
        self.relay.add(item)
        if self.journal is not None:
            self._unjournaled.append(item)

    def send(self, peer: bytes, frame: bytes) -> bool:
        """Send without blocking; False if the peer is gone or its queue is full."""
        try:   # (not contextlib.suppress: a context per send, 3,000 sends a fleet-wide pause)
            return self._send_or_wait(peer, frame)
        except LookupError:
            return False

    def _send_node(self, node_id: str, frame: bytes) -> bool:
        """Send to a node's own connection (NodeRoutes); False as send, or when it has none."""
        route = self.routes.route_of(node_id)
        return route is not None and self.send(route, frame)

    def _send_or_wait(self, peer: bytes, frame: bytes) -> bool:
        """False when the peer's queue is full (try later); LookupError when it is gone."""
        assert self.sock is not None
        try:   # (a full or gone peer fails the first part; a message's parts go together)
            self.sock.send(peer, _NOBLOCK | _SNDMORE)
            self.sock.send(frame, _NOBLOCK)
        except zmq.Again:
            return False
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:
                raise LookupError(peer) from None
            raise
        return True

    def _bad(self, reason: str, detail: str) -> None:
        self.bad_messages[reason] += 1
        count = self.bad_messages[reason]
        if worth_logging(count):   # a flood must not flood the log too
            log.warning("dropped a bad message (%s, %d so far): %s", reason, count, detail)

