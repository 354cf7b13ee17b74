"""The coordinator: one ROUTER that nodes and clients connect to (DESIGN.md, "Agent";
docs/protocol.md, "The coordinator's side").

It holds the fleet view (`fleet.FleetView`), relays events to subscribed clients
(`relay.Relay`), fans commands out to nodes and gathers their replies (`fanout.Fanout`), and
restarts every part of a multi-node group when one part fails. Embeddable in a driver
(`with Coordinator(bind=...)`: a thread of its own) or standalone (`rollout-watchdog
coordinator`: `run()` in the main thread). Its loop never blocks: every send is non-blocking,
every wait is the poll's, bounded by the next deadline.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
import uuid
from collections import Counter
from types import FrameType, TracebackType
from typing import Any

import zmq

from rollout_watchdog.agent.fanout import DEFAULT_TIMEOUT_S, Fanout, Gathering, encode_reply
from rollout_watchdog.agent.hub_socket import NodeRoutes, bind_hub
from rollout_watchdog.agent.journal import Journal
from rollout_watchdog.agent.relay import BUFFER_EVENTS, Relay, Relayed, batch_items
from rollout_watchdog.agent.security import NamedKeyAuthenticator, check_bind
from rollout_watchdog.common import protocol
from rollout_watchdog.common.limits import raise_nofile_limit
from rollout_watchdog.common.lograte import worth_logging
from rollout_watchdog.refit_bridge import queries
from rollout_watchdog.refit_bridge import service as refit
from rollout_watchdog.refit_bridge.durable import STATE_WRITE_TIMEOUT_S
from rollout_watchdog.refit_bridge.fleet import NODE_TIMEOUT_S, FleetView, Refused, node_event
from rollout_watchdog.refit_bridge.lock import HOLDER_TIMEOUT_S
from rollout_watchdog.refit_bridge.metrics import CoordinatorMetrics
from rollout_watchdog.refit_bridge.router_sync import VERIFY_S, RouterSync
from rollout_watchdog.refit_bridge.views import COORDINATOR_BOOT_PREFIX

log = logging.getLogger(__name__)
HEARTBEAT_S = 1.0
MAX_POLL_S = 0.1            # how soon stop() is noticed
SWEEP_S = 0.1               # how often silent nodes and subscribers are looked for
MESSAGES_PER_TURN = 5_000   # then the relay sends as many (SENDS_PER_TURN): subscribers keep pace
START_TIMEOUT_S = 10.0
# Plain ints for the flags of the sends and receives of every message: pyzmq's flag enums, and
# its multipart helpers built on them, cost microseconds a call (thousands a fleet-wide pause)
_NOBLOCK, _SNDMORE, _RCVMORE = int(zmq.NOBLOCK), int(zmq.SNDMORE), int(zmq.RCVMORE)


class Coordinator:
    """The fleet's hub; see the module docstring. Not thread-safe: talk to it over ZMQ."""

    def __init__(self, bind: str, keys: str | None = None, insecure: bool = False,
                 router_url: str | None = None, state_dir: str | None = None,
                 node_timeout_s: float = NODE_TIMEOUT_S, heartbeat_s: float = HEARTBEAT_S,
                 holder_timeout_s: float = HOLDER_TIMEOUT_S,
                 state_write_timeout_s: float = STATE_WRITE_TIMEOUT_S,
                 metrics_port: int | None = None, metrics_host: str = "127.0.0.1",
                 route_after_first_refit: bool = False,
                 router_verify_s: float = VERIFY_S) -> None:
        check_bind(bind, keys, insecure)
        self.bind, self.keys, self.router_url, self.state_dir = bind, keys, router_url, state_dir
        self.endpoint = bind
        self.heartbeat_s = heartbeat_s
        self.boot = f"{COORDINATOR_BOOT_PREFIX}{uuid.uuid4().hex[:12]}"
        self.view = FleetView(node_timeout_s)
        self.routes = NodeRoutes(curve=bool(keys))
        self.relay = Relay(gap_frame=self._gap_frame)
        self.journal = Journal(state_dir, BUFFER_EVENTS) if state_dir else None
        self._unjournaled: list[Relayed] = []
        self.fanout = Fanout()
        self.refit = refit.RefitService(state_dir, holder_timeout_s,  # raises for bad state
                                        state_write_timeout_s, route_after_first_refit)
        # (router_verify_s: how often every routed engine's own weight_version is checked)
        self.router = RouterSync(router_url, verify_s=router_verify_s) if router_url else None
        # Prometheus (`--metrics-port`; 0 picks a free port, then `metrics_port` is it)
        self.metrics = CoordinatorMetrics() if metrics_port is not None else None
        self.metrics_port, self.metrics_host = metrics_port, metrics_host
        self._router_members: dict[str, str | None] | None = None   # None: not started
        self._started_at = 0.0
        self._view_changed = True     # since the router was last told
        self.bad_messages: Counter[str] = Counter()
        self.own_seq = 0
        self._stop = threading.Event()
        self._reload = threading.Event()
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        self._next_heartbeat = 0.0
        self._next_sweep = 0.0
        self._acks: set[str] = set()
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self.sock: zmq.Socket[bytes] | None = None
        self._auth: NamedKeyAuthenticator | None = None

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Bind and serve in a thread of its own; raises what the bind raised."""
        self._thread = threading.Thread(target=self._serve, name="rollout-watchdog-coordinator",
                                        daemon=True)
        self._thread.start()
        if not self._started.wait(START_TIMEOUT_S):
            raise RuntimeError(f"the coordinator did not start within {START_TIMEOUT_S:g} s")
        if self._start_error is not None:
            self._thread.join(START_TIMEOUT_S)
            raise self._start_error

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None

    def __enter__(self) -> Coordinator:
        self.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def reload_keys(self) -> None:
        """Read `keys/authorized/` again at the next loop turn (SIGHUP does this for the
        standalone coordinator): a node or client added there is let in, one removed is kept
        out of new connections."""
        self._reload.set()

    def run(self) -> int:
        """Serve in this thread until SIGTERM or SIGINT (the standalone coordinator); SIGHUP
        reloads the authorized keys. The soft open-file limit goes up to the hard one first,
        so that a flood of connections cannot run it out of descriptors (a driver embedding
        the coordinator decides that for its own process: `common.limits`)."""
        old, new = raise_nofile_limit()
        if new != old:
            log.info("open file limit raised from %d to %d", old, new)

        def stop(signum: int, frame: FrameType | None) -> None:
            self._stop.set()
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, stop)
        signal.signal(signal.SIGHUP, lambda signum, frame: self.reload_keys())
        self._open()
        log.info("coordinator %s serving on %s%s", self.boot, self.endpoint,
                 " (CURVE)" if self.keys else "")
        try:
            self._loop()
        finally:
            self._close()
        return 0

    def _serve(self) -> None:
        try:
            self._open()
        except BaseException as exc:
            self._start_error = exc
            self._started.set()
            return
        self._started.set()
        try:
            self._loop()
        finally:
            self._close()

    def _open(self) -> None:
        if self.journal is not None:
            try:
                for item in self.journal.load():
                    self.relay.add(item)
                    if not item.boot.startswith(COORDINATOR_BOOT_PREFIX):
                        self.view.journaled[item.node_id] = (item.boot, item.seq)
                        self.view.expected.add(item.node_id)
            except OSError as exc:
                raise ValueError(f"cannot use the state dir {self.state_dir}: {exc}") from exc
        self._ctx = zmq.Context()
        try:
            sock, self._auth = bind_hub(self._ctx, self.bind, self.keys)
        except ValueError:
            self._ctx.term()
            raise
        self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.sock = sock
        if self.metrics is not None and self.metrics_port is not None:
            try:
                self.metrics_port = self.metrics.start_server(self.metrics_port,
                                                              self.metrics_host)
            except OSError as exc:
                self._close()
                raise ValueError(f"cannot serve metrics on {self.metrics_host}:"
                                 f"{self.metrics_port}: {exc}") from exc
        self._started_at = time.monotonic()

    def _close(self) -> None:
        if self.metrics is not None:
            self.metrics.stop_server()
        if self.router is not None:
            self.router.stop()
        self.refit.close()
        if self.journal is not None:
            self.journal.close()
        if self.sock is not None:
            self.sock.close(0)
            self.sock = None
        self._stop_auth()
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    def _stop_auth(self) -> None:
        if self._auth is not None:
            self._auth.stop()
            self._auth = None

    # ------------------------------------------------------------------ the loop

    def _loop(self) -> None:
        assert self.sock is not None
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        saved = self.refit.wakeup_fd   # the refit state's writer: a write ended
        if saved is not None:
            poller.register(saved, zmq.POLLIN)
        behind = False
        while not self._stop.is_set():
            if self._reload.is_set():
                self._reload.clear()
                self._reload_keys()
            timeout = 0.005 if behind else self._timeout(time.monotonic())
            ready = dict(poller.poll(int(timeout * 1000)))
            if saved in ready:
                self.refit.saved(time.monotonic())
            if self.sock in ready:
                self._receive_some()
            self._tick(time.monotonic(), time.time())
            behind = self.relay.pump(self._send_or_wait, time.monotonic())

    def _reload_keys(self) -> None:
        if self._auth is None:
            log.warning("no keys to reload: this coordinator runs without CURVE")
            return
        try:
            self._auth.reload()
        except (OSError, ValueError) as exc:  # a half-copied key file: keep the old list
            log.error("cannot reload the authorized keys, keeping the old list: %s", exc)

    def _timeout(self, now: float) -> float:
        deadlines = [self._next_heartbeat, self._next_sweep, self.fanout.next_deadline(),
                     self.refit.next_deadline()]
        soonest = min(d for d in deadlines if d is not None)
        return min(MAX_POLL_S, max(0.0, soonest - now))

    def _receive_some(self) -> None:
        assert self.sock is not None
        taken = 0   # bytes: a turn takes less than the relay buffer holds, so that the events
        for _ in range(MESSAGES_PER_TURN):   # reach subscribers before they could leave it
            if taken > self.relay.max_bytes // 4:
                break
            try:
                received = self._recv()
            except zmq.Again:
                break
            try:
                if received is not None:
                    taken += len(received[1])
                    self._receive(*received)
            except Exception:  # a bug on one message must not stop the fleet's hub
                self.bad_messages["internal_error"] += 1
                log.exception("coordinator: failed to handle a message")
        if self.journal is not None and self._unjournaled:
            self.journal.append(self._unjournaled, self.relay.buffer)  # before the ACKs
        self._unjournaled.clear()
        for node_id in self._acks:
            record = self.view.nodes[node_id]
            self._send_node(node_id, protocol.ack_frame(record.boot, record.received_seq))
        self._acks.clear()

    def _recv(self) -> tuple[bytes, bytes, str | None] | None:
        """(peer, message, name of its CURVE key); None for a bad frame count. Frame objects
        (slower to get) only with CURVE, where the key's name (the User-Id) is needed."""
        assert self.sock is not None
        if not self.keys:
            frames = [self.sock.recv(_NOBLOCK)]
            while self.sock.get(_RCVMORE):
                frames.append(self.sock.recv(_NOBLOCK))
            if len(frames) == 2:
                return frames[0], frames[1], None
        else:
            parts = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            if len(parts) == 2:
                return parts[0].bytes, parts[1].bytes, str(parts[1].get("User-Id"))
            frames = [p.bytes for p in parts]
        self._bad("framing", f"{len(frames) - 1} frames instead of one")
        return None

    def _receive(self, route: bytes, data: bytes, user: str | None) -> None:
        """One message from the connection `route`; `user` is the name of its CURVE key (None
        without). Only the connection a node's HELLO came from speaks for it (NodeRoutes)."""
        try:
            msg = protocol.decode(data)
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
            elif isinstance(msg, (protocol.Event, protocol.Events)):
                if node is None:
                    raise Refused("no_hello", f"{msg.KIND} from a peer that sent no HELLO "
                                              f"(routing id {route[:60]!r})")
                if isinstance(msg, protocol.Event):
                    self._event(msg, data, node, now, wall)
                else:
                    self._events(msg, data, node, now, wall)
            elif isinstance(msg, protocol.Reply):
                if node is not None:   # anyone else's reply is no answer
                    self._own_events(self.view.heard(node, now, wall))
                    gathering = self.fanout.answered(msg, node)
                    if gathering is not None:
                        self._answer(gathering)
            elif isinstance(msg, protocol.Command):
                self._command(route, msg, now)
            elif isinstance(msg, protocol.Subscribe):
                self.relay.subscribe(route, msg, now)
            elif isinstance(msg, protocol.Heartbeat):
                if node is not None:
                    self._own_events(self.view.heard(node, now, wall))
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
        self._view_changed = True   # a snapshot: engines may differ, no event says so
        self._own_events(self.view.hello(msg, msg.node_id, now, wall))
        self.routes.bind(route, msg.node_id)
        self._acks.add(msg.node_id)

    def _event(self, msg: protocol.Event, frame: bytes, peer: str, now: float, wall: float
               ) -> None:
        _check_size(msg, len(frame), peer)
        new, own = self.view.event(msg, peer, now, wall)
        self._own_events(own)
        self._acks.add(peer)
        if not new:
            return
        self._relay(Relayed(msg.node_id, msg.boot, msg.seq, frame))
        for node, engine in self._restarts(peer, msg):
            self._group_restart(node, engine, msg)

    def _events(self, msg: protocol.Events, frame: bytes, peer: str, now: float, wall: float
                ) -> None:
        """A batch: each event taken as if it came alone (a refused one is counted), relayed
        as the node's frame when all are new (one ACK for all, as for any turn's events).
        A plain batch (FleetView.batch) is taken whole, with no work per event here."""
        if len(frame) <= protocol.MAX_EVENT_BYTES and frame.isascii():   # (_reencodes_small)
            own = self.view.batch(msg.events, peer, now, wall)
            if own is not None:
                self._own_events(own)
                self._acks.add(peer)
                self._relay_all(batch_items(msg.events, frame))
                return
        new: list[protocol.Event] = []
        restarts: list[tuple[protocol.Event, tuple[str, str]]] = []
        taken = False
        big = len(frame) > protocol.MAX_EVENT_BYTES   # (never a batch from this package's nodes)
        for event in msg.events:
            try:
                if big:
                    _check_size(event, _encoded_size(event), peer)
                fresh, own = self.view.event(event, peer, now, wall)
            except Refused as exc:
                self._bad(exc.reason, str(exc))
                continue
            taken = True
            if own:
                self._own_events(own)
            if fresh:   # restarts decided in turn, as for single events; sent after the relay
                new.append(event)
                restarts += [(event, target) for target in self._restarts(peer, event)]
        if taken:
            self._acks.add(peer)
        if len(new) == len(msg.events) and _reencodes_small(frame):
            for item in batch_items(new, frame):   # kept together: relayed as it came
                self._relay(item)
        else:
            for event in new:   # encoded now: one that cannot be sent is never relayed
                try:
                    self._relay(Relayed(event.node_id, event.boot, event.seq,
                                        protocol.encode(event)))
                except protocol.ProtocolError as exc:
                    self._bad("unsendable", f"event {event.seq} of {peer!r}: {exc}")
        for cause, (node, engine) in restarts:
            self._group_restart(node, engine, cause)

    def _restarts(self, peer: str, msg: protocol.Event) -> list[tuple[str, str]]:
        """The group parts a new event of `peer` makes the coordinator restart."""
        if msg.seq <= self.view.nodes[peer].snapshot_seq:
            return []  # older than the HELLO's snapshot: whoever heard it first acted on it
        return self.view.group_restarts(peer, msg.event)

    def _tick(self, now: float, wall: float) -> None:
        for gathering in self.fanout.expire(now):
            self._answer(gathering)
        if now >= self._next_sweep:  # the per-node checks, O(nodes): a few times a second
            self._next_sweep = now + SWEEP_S
            gone = self.view.tick(now, wall)
            self._own_events(gone)
            for event in gone:
                for gathering in self.fanout.node_gone(event["node_id"]):
                    self._answer(gathering)
            for client in self.relay.expire(now):
                log.info("subscriber %s silent for %g s: unsubscribed", client.hex(),
                         self.relay.subscriber_timeout_s)
            self.refit.tick(self, now)
            self._sync_router()
            if self.metrics is not None:
                self.metrics.sample(self, now)
        if now >= self._next_heartbeat:
            self._next_heartbeat = now + self.heartbeat_s
            beat = protocol.encode(protocol.Heartbeat(wall))
            for node in self.view.reachable():
                self._send_node(node, beat)
            for client in list(self.relay.subscribers):
                self._send(client, beat)

    # ------------------------------------------------------------------ commands

    def _command(self, client: bytes, cmd: protocol.Command, now: float) -> None:
        known = self.fanout.known(cmd.request_id)
        if isinstance(known, bytes):
            self._send_reply(client, known)
            return
        if isinstance(known, Gathering):   # a retry while in flight: answer the new socket
            known.client = client
            return
        if cmd.cmd in queries.COMMANDS:  # read-only: nothing to remember for a repeat
            self._send_reply(client, encode_reply(queries.answer(self, cmd)))   # (TOO_BIG: too big)
            return
        if cmd.cmd in refit.COMMANDS:
            self.refit.handle(self, client, cmd, now)
            return
        if cmd.node is not None and cmd.node not in self.view.nodes:
            self.reply(client, queries.error(cmd, f"unknown node {cmd.node!r} (known: "
                                       f"{', '.join(sorted(self.view.nodes)) or 'none'})",
                                       protocol.UNKNOWN_NODE))
            return
        if cmd.node is not None and not self.view.nodes[cmd.node].reachable:
            last = time.strftime("%H:%M:%S", time.localtime(self.view.nodes[cmd.node].last_seen))
            self.reply(client, queries.error(cmd, f"node {cmd.node!r} is unreachable (last seen "
                                            f"{last})", protocol.NODE_UNREACHABLE))
            return
        targets = [cmd.node] if cmd.node is not None else self.view.reachable()
        self.gather(client, _with_wait(cmd), targets, now)

    def gather(self, client: bytes | None, cmd: protocol.Command, targets: list[str],
               now: float, finish: refit.Finish | None = None) -> None:
        """Fan `cmd` out to `targets`; its gathered reply goes to `client` (None: nobody),
        made by `finish` if given."""
        timeout = cmd.timeout_s or DEFAULT_TIMEOUT_S
        gathering = Gathering(client, cmd, targets, now + timeout, finish=finish)
        for node, frame in self.fanout.start(gathering):
            if not self._send_node(node, frame):
                gathering.gone.add(node)
        if self.fanout.settle(gathering):
            self._answer(gathering)

    def reply(self, client: bytes, reply: protocol.Reply) -> None:
        """Answer `client`; the reply is kept for a repeat of its request id."""
        self._send_reply(client, self.fanout.remember(reply))

    def weights_changed(self) -> None:
        self._view_changed = True
        self._sync_router()

    def refit_ended(self, outcome: str, duration_s: float) -> None:
        if self.metrics is not None:
            self.metrics.refit_ended(outcome, duration_s)

    def _sync_router(self) -> None:
        """The router's membership, once the fleet view is warm (a restarted coordinator must
        not empty the router before its nodes are back)."""
        if self.router is None:
            return
        if self._router_members is None:
            if not self.view.warm(self._started_at, time.monotonic()):
                return
        elif not self._view_changed:   # (a sweep must not walk every engine for nothing)
            return
        self._view_changed = False
        members = self.refit.router_members(self.view)
        if members != self._router_members:
            first = self._router_members is None
            self._router_members = members
            self.router.set_desired(members)
            if first:
                self.router.start()

    def _answer(self, gathering: Gathering) -> None:
        reply = gathering.final
        if reply is None:
            return
        if gathering.client is not None:
            self._send_reply(gathering.client, gathering.frame)
        elif reply.status == "error":
            log.warning("%s %s: %s", gathering.command.cmd, gathering.command.engine,
                        reply.reason)

    def _group_restart(self, node: str, engine: str, cause: protocol.Event) -> None:
        """Restart another part of a multi-node engine whose part failed."""
        failed = f"{cause.node_id}/{cause.event.get('engine')}"
        detail = (f"part {failed} failed ({cause.event.get('cause')}): restarting the whole "
                  "group")
        log.warning("group restart of %s/%s: %s", node, engine, detail)
        event = node_event(node, "group_restart", detail, time.time())
        event["engine"] = engine
        self._own_events([event])
        cmd = protocol.Command(f"group-{uuid.uuid4().hex}", "restart", {}, node, engine)
        self.gather(None, cmd, [node], time.monotonic())

    # ------------------------------------------------------------------ output

    def _own_events(self, events: list[dict[str, Any]]) -> None:
        for event in events:
            self.own_seq += 1
            log.info("%s: %s (%s)", event["node_id"], event["kind"], event["detail"])
            message = protocol.Event(event["node_id"], self.boot, self.own_seq, event)
            self._relay(Relayed(event["node_id"], self.boot, self.own_seq,
                                protocol.encode(message)))

    def _gap_frame(self, lost: int) -> bytes:
        """The "gap" event that tells a subscriber that fell out of the relay buffer how many
        events it lost (its own: no other subscriber gets it)."""
        self.own_seq += 1
        event = node_event("*", "gap", f"{lost} event(s) lost: this subscriber fell behind the "
                           f"relay buffer ({self.relay.capacity} events, "
                           f"{self.relay.max_bytes >> 20} MiB)", time.time())
        return protocol.encode(protocol.Event("*", self.boot, self.own_seq, event))

    def _relay(self, item: Relayed) -> None:
        self._view_changed = True   # every change of the view comes with an event
        self.relay.add(item)
        if self.journal is not None:
            self._unjournaled.append(item)

    def _relay_all(self, items: list[Relayed]) -> None:
        """_relay() each of them (a node's batch)."""
        self._view_changed = True
        self.relay.add_all(items)
        if self.journal is not None:
            self._unjournaled += items

    def _send(self, peer: bytes, frame: bytes) -> bool:
        """Send without blocking; False if the peer is gone or its queue is full."""
        with contextlib.suppress(LookupError):
            return self._send_or_wait(peer, frame)
        return False

    def _send_reply(self, client: bytes, frame: bytes) -> None:
        """Send a reply; one that cannot go (the client's queue full, or the client gone) is
        counted (`bad_messages`, reason reply_dropped) and logged, rate-limited."""
        if not self._send(client, frame):
            self._bad("reply_dropped", f"a reply to client {client.hex()[:32]}: its queue is "
                      "full or it is gone")

    def _send_node(self, node_id: str, frame: bytes) -> bool:
        """Send to a node's own connection (NodeRoutes); False as _send, or when it has none."""
        route = self.routes.route_of(node_id)
        return route is not None and self._send(route, frame)

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
        if worth_logging(count):
            log.warning("dropped a bad message (%s, %d so far): %s", reason, count, detail)


def _check_size(event: protocol.Event, size: int, node: str) -> None:
    """Refused: an event over MAX_EVENT_BYTES (a node cuts its own to fit, so this one came
    from a hostile or broken node); never applied, relayed or journaled."""
    if size > protocol.MAX_EVENT_BYTES:
        raise Refused("oversized_event", f"event {event.seq} of node {node!r}: {size} bytes, "
                                         f"over the limit of {protocol.MAX_EVENT_BYTES}")


def _encoded_size(event: protocol.Event) -> int:
    try:
        return len(protocol.encode(event))
    except protocol.ProtocolError:   # over the message limit once encoded again
        return protocol.MAX_MESSAGE_BYTES + 1


def _reencodes_small(frame: bytes) -> bool:
    """Whether each event of this "events" frame, encoded again on its own, surely fits in a
    frame: re-encoding ASCII JSON at most about quintuples it (a float written 1e9 comes back
    as 1000000000.0), and nodes send ASCII frames of at most BATCH_BYTES."""
    return len(frame) <= protocol.MAX_MESSAGE_BYTES // 8 and frame.isascii()


def _with_wait(cmd: protocol.Command) -> protocol.Command:
    """A pause waits on each node for its in-flight probes: ask the node to answer (done or
    not) before the gathering's deadline, so a late node is named rather than missing."""
    if cmd.cmd != "pause" or "wait_s" in cmd.args:
        return cmd
    timeout = cmd.timeout_s or DEFAULT_TIMEOUT_S
    args = {**cmd.args, "wait_s": max(0.0, timeout - min(1.0, timeout / 5))}
    return protocol.Command(cmd.request_id, cmd.cmd, args, cmd.node, cmd.engine, cmd.timeout_s)
