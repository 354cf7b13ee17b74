"""ZMTP/CURVE handshakes as a libzmq socket monitor reports them, for the sides that watch
them: a client or a node that wants to say why it got no answer or no link (its key refused,
its handshake dropped), and the coordinator's ROUTER, which counts the connections it dropped
before they spoke (docs/protocol.md).

What libzmq 4.3 raises (`stream_engine_base.cpp`, `zmtp_engine.cpp`; checked by experiment):
- HANDSHAKE_FAILED_AUTH: the ZAP handler refused the peer (CURVE: a key not in `authorized/`);
- HANDSHAKE_FAILED_PROTOCOL: a ZMTP greeting that is wrong (the other mechanism, bytes that
  start like a greeting and are not one);
- HANDSHAKE_FAILED_NO_DETAIL: the handshake ended otherwise, its value the errno at that
  moment: HANDSHAKE_IVL expired (a timer: the errno left by the I/O thread's last failed call,
  most often a read's EAGAIN) or the peer closed or reset the connection (that read's own
  errno, EPIPE or ECONNRESET). The errno alone misreads a timer that fires just after another
  connection left (measured: 9 timeouts in 40 read as `closed` beside 3 clients that came and
  went), so the ROUTER's monitor also watches each connection's ACCEPTED and DISCONNECTED
  (their value its descriptor; libzmq reports DISCONNECTED right after the failure, from the
  same I/O thread: adjacent in the monitor while the context has one I/O thread, pyzmq's
  default, which the coordinator keeps) and `failure_kind` takes the failed handshake's age: one
  that lasted half the timer is a timeout, whatever the errno says.
A first byte other than 0xff is taken for a ZMTP 1.0 peer: without CURVE it is spoken to (and
ends as above), with CURVE it is dropped with no handshake event at all, so it is not counted.
The v1 monitor names the socket's own endpoint, never the peer's (libzmq's v2 monitor is a
draft API that pyzmq's libzmq lacks). An unread monitor blocks libzmq's I/O thread once its
pipe is full (about 2,000 events, measured: the socket then stops accepting and moving
messages; a connection costs the ROUTER's monitor three), so its reader reads it every turn,
and drains it before `disable_monitor()`, which waits for the lock that the blocked I/O thread
holds.
"""

from __future__ import annotations

import contextlib
import errno
import struct
from collections.abc import Iterator
from typing import NamedTuple

import zmq

TIMEOUT, CLOSED, AUTH, PROTOCOL = "timeout", "closed", "auth", "protocol"
FAILURE_KINDS = (TIMEOUT, CLOSED, AUTH, PROTOCOL)
FAILED = (zmq.EVENT_HANDSHAKE_FAILED_AUTH, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
          zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
FAILURES = FAILED[0] | FAILED[1] | FAILED[2]   # a monitor's mask: the failed ones only
MONITORED = zmq.EVENT_HANDSHAKE_SUCCEEDED | FAILURES   # each handshake's end, either way
# the ROUTER's monitor: the failures, dated by their connection's start and end
DATED_FAILURES = FAILURES | zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED
# A NO_DETAIL that came this share of the handshake timeout after its connection was accepted
# is the timer's, even with a peer-gone errno. The times are those the monitor was read at, each
# a turn of the reader late: a reader late by half a timeout dates wrongly (one late by a whole
# timeout reads both events in one turn, age ~0: the errno decides, as before). A peer that
# leaves after half the timeout without a word is counted as a timeout.
TIMER_SHARE = 0.5
DRAIN_EVENTS = 10_000   # more than a full monitor pipe holds
# The coordinator drops a connection that has not finished its handshake by then (the CLI's
# default for `coordinator --handshake-timeout`: here, so that the CLI need not import the hub).
HANDSHAKE_TIMEOUT_S = 5.0
# NO_DETAIL's errnos that say the peer went (a read or write failed), not that the timer fired
_PEER_GONE = frozenset({errno.EPIPE, errno.ECONNRESET, errno.ECONNABORTED, errno.ENOTCONN,
                        errno.ETIMEDOUT, errno.EHOSTUNREACH, errno.ENETUNREACH,
                        errno.ENETDOWN, errno.ENETRESET})


class MonitorEvent(NamedTuple):
    event: int
    value: int
    endpoint: str


def read_event(monitor: zmq.Socket[bytes], flags: int = 0) -> MonitorEvent:
    """One event off a socket monitor (zmq.Again, with NOBLOCK, when none waits). libzmq's v1
    monitor message: a frame of the event (16 bits) and its value (32 bits), then the endpoint.
    pyzmq's `zmq.utils.monitor` reads the same, but importing it imports asyncio: a third of
    the start-up of a node daemon or a CLI call."""
    frames = monitor.recv_multipart(flags)
    if len(frames) != 2 or len(frames[0]) != 6:
        raise zmq.ZMQError(msg=f"not a socket monitor's message: {frames!r:.80}")
    event, value = struct.unpack("=hi", frames[0])
    return MonitorEvent(event, value, frames[1].decode(errors="replace"))


def failure_kind(event: int, value: int, age_s: float | None = None,
                 timeout_s: float | None = None) -> str | None:
    """The kind of failed handshake a monitor event reports (FAILURE_KINDS); None for any
    other event. `age_s`: how long the connection had lived when it failed (None: not known),
    `timeout_s` its handshake timeout; with both, a NO_DETAIL that old is a timeout."""
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return AUTH
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        return PROTOCOL
    if event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
        old_enough = age_s is not None and timeout_s is not None \
            and age_s >= timeout_s * TIMER_SHARE
        return CLOSED if value in _PEER_GONE and not old_enough else TIMEOUT
    return None


def failed_handshake_hint(failure: int | None, keyed: bool) -> str:
    """What a client or node says of its last handshake with the coordinator ("" for None: it
    did not fail), by how it failed (a FAILED event) and whether this side speaks CURVE
    (`keyed`). Measured from this side: a key not authorized is AUTH, which is certain; a
    coordinator of the other mechanism, or a CURVE key for another coordinator, drops the
    connection (NO_DETAIL), as does a coordinator restarting or too slow to finish in time."""
    if failure is None:
        return ""
    if failure == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return ("the CURVE handshake failed: the coordinator refused this side's key; add its "
                "public key to the coordinator's authorized/ and send the coordinator SIGHUP")
    if keyed:
        return ("the CURVE handshake failed: the coordinator dropped it (as it does while "
                "restarting or overloaded); if this repeats, check that the coordinator runs "
                "with keys and that the coordinator key set on this side is its public key")
    return ("the handshake failed: the coordinator dropped it (as it does while restarting or "
            "overloaded); if this repeats, check whether the coordinator requires CURVE keys: "
            "none are set on this side")


def close_monitored(sock: zmq.Socket[bytes], monitor: zmq.Socket[bytes]) -> None:
    """Close `sock` and its monitor: the monitor drained first (see above), then stopped."""
    for _ in monitor_events(monitor, DRAIN_EVENTS):
        pass
    with contextlib.suppress(zmq.ZMQError):   # (the context terminated: nothing to stop)
        sock.disable_monitor()
    monitor.close(0)
    sock.close(0)


def monitor_events(monitor: zmq.Socket[bytes], limit: int) -> Iterator[MonitorEvent]:
    """At most `limit` events waiting on `monitor`, never blocking."""
    for _ in range(limit):
        try:
            yield read_event(monitor, zmq.NOBLOCK)
        except zmq.Again:
            return
