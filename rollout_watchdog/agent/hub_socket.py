"""The coordinator's ROUTER socket, every option set on purpose (DESIGN.md, "Agent"), the
handshakes it failed (`FailedHandshakes`), and which of its connections speaks for which node
(`NodeRoutes`)."""

from __future__ import annotations

import errno
import logging
import time
from collections import Counter

import zmq

from rollout_watchdog.agent.security import NamedKeyAuthenticator, curve_server
from rollout_watchdog.common import handshakes, protocol
from rollout_watchdog.common.lograte import worth_logging

log = logging.getLogger(__name__)

# Per peer, in frames (a frame carries up to protocol.BATCH_EVENTS events). A subscriber behind
# by more waits in the relay buffer (its cursor), not in libzmq's memory. A node whose frames
# pile up keeps them in its own outbox (backpressure): libzmq's received frames can each pin an
# 8 KiB read buffer, so 1,000 nodes x 100 queued frames cost 400 MB of RSS in a burst
# (measured), x 10 under 170 MB, at the same throughput.
SEND_HWM = 1_000
RECV_HWM = 10


def bind_hub(ctx: zmq.Context[zmq.Socket[bytes]], bind: str, keys: str | None,
             handshake_timeout_s: float = handshakes.HANDSHAKE_TIMEOUT_S
             ) -> tuple[zmq.Socket[bytes], zmq.Socket[bytes], NamedKeyAuthenticator | None]:
    """The bound ROUTER, the monitor of its handshakes (`common.handshakes`: attached before
    the bind, so that none is missed) and its authenticator (with `keys`); ValueError naming
    the problem. `ctx` has one I/O thread (the monitor's failures are dated by the events
    next to them: `FailedHandshakes`)."""
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a gone peer fails, never vanishes
    # A reconnected node takes its routing id back at once. With CURVE a node's routing id is
    # a secret of its own (NodeRoutes), so no other peer can take its connection this way.
    sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
    sock.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_MESSAGE_BYTES)  # bigger: dropped by zmq
    sock.setsockopt(zmq.SNDHWM, SEND_HWM)
    sock.setsockopt(zmq.RCVHWM, RECV_HWM)
    # A connection that has not finished the ZMTP (and CURVE) handshake by then is dropped, so
    # one that never speaks holds a descriptor for seconds, not libzmq's default 30 s (never
    # 0, which would mean no limit at all).
    sock.setsockopt(zmq.HANDSHAKE_IVL, max(1, round(handshake_timeout_s * 1000)))
    # No ZMTP heartbeat timeout on this side, on purpose: it would drop a live client that
    # is slow to read a burst (its unread PINGs), and the client would then lose its
    # subscription. Nodes detect a dead coordinator with their own ZMTP heartbeats (which
    # libzmq answers here by itself); the coordinator finds silent nodes by their
    # heartbeats (node_timeout_s), and silent subscribers expire (relay.py).
    auth = None
    monitor = sock.get_monitor_socket(handshakes.DATED_FAILURES)
    try:
        if keys:
            auth = curve_server(ctx, sock, keys)
        sock.bind(bind)
    except (zmq.ZMQError, ValueError) as exc:
        handshakes.close_monitored(sock, monitor)
        if auth is not None:
            auth.stop()
        raise ValueError(f"cannot bind {bind}: {exc}") from exc
    return sock, monitor, auth


class FailedHandshakes:
    """The connections the ROUTER dropped before they spoke, counted by kind
    (`common.handshakes`: timeout, closed, auth, protocol), each kind logged as a WARNING,
    rate-limited: a flood of half-open connections, or a node with the wrong key, never
    reaches the hub's loop as a message, so this is where it shows. A failure with no detail
    is dated by its connection's ACCEPTED and the DISCONNECTED that follows it, so that a
    timeout is told from a peer that left (`handshakes.failure_kind`)."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.counts: Counter[str] = Counter(dict.fromkeys(handshakes.FAILURE_KINDS, 0))
        self._accepted: dict[int, float] = {}   # a live connection's descriptor -> read when
        # a NO_DETAIL waiting for its DISCONNECTED
        self._undated: handshakes.MonitorEvent | None = None

    def take(self, monitor: zmq.Socket[bytes], limit: int) -> None:
        """Count what `monitor` reported, at most `limit` events, never blocking."""
        for event in handshakes.monitor_events(monitor, limit):
            self.note(event, time.monotonic())

    def note(self, event: handshakes.MonitorEvent, now: float) -> None:
        """One event of the ROUTER's monitor (`handshakes.DATED_FAILURES`), read at `now`."""
        if event.event == zmq.EVENT_ACCEPTED:
            self._accepted[event.value] = now
            return
        undated, self._undated = self._undated, None
        if event.event == zmq.EVENT_DISCONNECTED:
            accepted = self._accepted.pop(event.value, None)
            if undated is not None:
                self._count(undated, None if accepted is None else now - accepted)
            return
        if undated is not None:    # no DISCONNECTED came after it: its errno alone says
            self._count(undated, None)
        if event.event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
            self._undated = event
        else:
            self._count(event, None)

    def _count(self, event: handshakes.MonitorEvent, age_s: float | None) -> None:
        kind = handshakes.failure_kind(event.event, event.value, age_s, self.timeout_s)
        if kind is None:
            return
        self.counts[kind] += 1
        count = self.counts[kind]
        if worth_logging(count):
            log.warning("dropped a connection to %s before it spoke (%s, %d so far): %s",
                        event.endpoint, kind, count, self._why(kind, event.value))

    def _why(self, kind: str, value: int) -> str:
        if kind == handshakes.TIMEOUT:
            return f"no handshake within {self.timeout_s:g} s"
        if kind == handshakes.CLOSED:
            return f"the peer left during the handshake ({errno.errorcode.get(value, value)})"
        if kind == handshakes.AUTH:
            return f"its CURVE key is not authorized (ZAP status {value})"
        return f"not a ZMTP/CURVE handshake this socket takes (libzmq code {value:#x})"


class NodeRoutes:
    """Which connection (ROUTER routing id) speaks for which node.

    A node is bound to the routing id its accepted HELLO came from, and the coordinator's
    frames for it go there alone. Without CURVE that routing id must be the node id itself
    (nothing else tells a node apart, so nothing stops a peer that takes that routing id: hence
    keys off loopback). With CURVE the HELLO must come under the node's own key (the ZAP
    User-Id, the key file's name); the routing id may be anything, and a node uses a secret
    random one (`agent.link`), so that a client's key holding the node id as its routing id
    gets no frame of the node's and cannot take its connection over (ROUTER_HANDOVER acts
    inside libzmq, before any message is seen)."""

    def __init__(self, curve: bool) -> None:
        self.curve = curve
        self._routes: dict[str, bytes] = {}     # node -> its routing id
        self._nodes: dict[bytes, str] = {}      # routing id -> node

    def refusal(self, route: bytes, node_id: str, user: str | None) -> str | None:
        """Why a HELLO for `node_id` from `route` under the key named `user` is refused; None
        when it is taken."""
        if self.curve:
            if user != node_id:
                return (f"HELLO for node {node_id!r} under the key of {user!r}: a node "
                        "announces itself only with its own key")
        elif route != node_id.encode():
            return (f"HELLO for node {node_id!r} from routing id {_shown(route)}: a node "
                    "announces only itself")
        return None

    def bind(self, route: bytes, node_id: str) -> None:
        """From now on `route` speaks for `node_id` (its earlier routing id no longer does)."""
        old = self._routes.get(node_id)
        if old is not None and old != route:
            del self._nodes[old]
        previous = self._nodes.get(route)
        if previous is not None and previous != node_id:
            del self._routes[previous]
        self._routes[node_id], self._nodes[route] = route, node_id

    def node_of(self, route: bytes) -> str | None:
        """The node `route` speaks for (None: a client, or a node before its HELLO)."""
        return self._nodes.get(route)

    def route_of(self, node_id: str) -> bytes | None:
        return self._routes.get(node_id)


def _shown(route: bytes) -> str:
    text = repr(route)
    return text if len(text) <= 60 else text[:57] + "..."
