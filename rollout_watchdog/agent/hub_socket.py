"""The coordinator's ROUTER socket, every option set on purpose (DESIGN.md, "Agent")."""

from __future__ import annotations

import zmq

from rollout_watchdog.agent.security import NamedKeyAuthenticator, curve_server
from rollout_watchdog.common import protocol

# Per peer, in frames (a frame carries up to protocol.BATCH_EVENTS events). A subscriber behind
# by more waits in the relay buffer (its cursor), not in libzmq's memory. A node whose frames
# pile up keeps them in its own outbox (backpressure): libzmq's received frames can each pin an
# 8 KiB read buffer, so 1,000 nodes x 100 queued frames cost 400 MB of RSS in a burst
# (measured), x 10 under 170 MB, at the same throughput.
SEND_HWM = 1_000
RECV_HWM = 10


def bind_hub(ctx: zmq.Context[zmq.Socket[bytes]], bind: str, keys: str | None
             ) -> tuple[zmq.Socket[bytes], NamedKeyAuthenticator | None]:
    """The bound ROUTER and its authenticator (with `keys`); ValueError naming the problem."""
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a gone peer fails, never vanishes
    sock.setsockopt(zmq.ROUTER_HANDOVER, 1)   # a restarted node takes its id back at once
    sock.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_MESSAGE_BYTES)  # bigger: dropped by zmq
    sock.setsockopt(zmq.SNDHWM, SEND_HWM)
    sock.setsockopt(zmq.RCVHWM, RECV_HWM)
    # No ZMTP heartbeat timeout on this side, on purpose: it would drop a live client that
    # is slow to read a burst (its unread PINGs), and the client would then lose its
    # subscription. Nodes detect a dead coordinator with their own ZMTP heartbeats (which
    # libzmq answers here by itself); the coordinator finds silent nodes by their
    # heartbeats (node_timeout_s), and silent subscribers expire (relay.py).
    auth = None
    try:
        if keys:
            auth = curve_server(ctx, sock, keys)
        sock.bind(bind)
    except (zmq.ZMQError, ValueError) as exc:
        sock.close(0)
        if auth is not None:
            auth.stop()
        raise ValueError(f"cannot bind {bind}: {exc}") from None
    return sock, auth
