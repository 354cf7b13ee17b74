"""The daemon's local control socket: a ZMQ ROUTER on an ipc path (0600), JSON requests and
replies, never blocking the main loop.

Request `{"v": 1, "id": ANY, "cmd": NAME, "args": {...}}` (one frame from a DEALER, or a REQ
envelope); reply `{"v": 1, "id": ANY, "status": "ok"|"error", "reason": str|null, "result": ...}`.
Replies that wait for a condition are parked in the shared `PendingReplies`; every reply is
sent only after the daemon has saved its state.

Connections are bounded: libzmq accepts on its own I/O thread, without limit, and its ipc
listener aborts the whole process when accept() fails with EMFILE (4.3.x allows only ENFILE
there). A socket monitor counts the connections; at the bound the endpoint is closed (the file
unlinked at once, then unbound, which drops every connection made through it) and bound again,
0600 as before, a few seconds later. Peers that never finish the ZMTP handshake are dropped
after `HANDSHAKE_TIMEOUT_S`, and each peer's queues are capped at `PEER_HWM` messages.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import resource
import socket
from collections.abc import Callable, Container
from typing import Any

import zmq

from rollout_watchdog.common.handshakes import read_event
from rollout_watchdog.common.replies import (
    PROTOCOL_VERSION,
    CommandError,
    Deferred,
    PendingReplies,
    reply_body,
)

log = logging.getLogger(__name__)
MAX_CONTROL_MESSAGE = 64 * 1024
MAX_REQUESTS_PER_ROUND = 100  # so a flood of requests never starves the engines
# At most this many connections, and never more than 1/FD_SHARE of the fd limit: libzmq keeps
# accepting until the endpoint is closed, so the rest of the limit is the margin for that.
MAX_CONNECTIONS = 256
FD_SHARE = 4
REOPEN_AFTER_S = 2.0          # how long the endpoint stays closed after reaching the bound
HANDSHAKE_TIMEOUT_S = 3.0     # a peer that has not finished the ZMTP greeting by then is dropped
# Messages queued per peer and direction. A client has one request in flight; one that never
# reads could otherwise hold 1,000 replies of up to 1,000 events each in the daemon.
PEER_HWM = 16
MAX_MONITOR_EVENTS_PER_ROUND = 4096
_CONNECTION_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED


Dispatch = Callable[[str, dict[str, Any]], "dict[str, Any] | Deferred"]


class ControlServer:
    """The local control socket as a loop participant: requests are dispatched to the command
    table, and replies (immediate or parked) are sent after the daemon saved its state."""

    def __init__(self, ctx: zmq.SyncContext, endpoint: str, dispatch: Dispatch,
                 on_bad_message: Callable[[str], None],
                 max_connections: int | None = None) -> None:
        self.endpoint = endpoint
        self.socket = control_router(ctx)
        self._monitor = self.socket.get_monitor_socket(_CONNECTION_EVENTS)
        try:
            bind_control(self.socket, endpoint)
        except BaseException:
            self._close_sockets()
            raise
        self.max_connections = max_connections or connection_bound()
        self.connections = 0      # accepted through the current binding and not yet gone
        self.bound = True
        self._reopen_at: float | None = None
        self._dispatch = dispatch
        self._on_bad_message = on_bad_message
        self.pending = PendingReplies()
        self._outbox: list[list[bytes]] = []

    # the loop participant

    def pollables(self) -> list[zmq.SyncSocket]:
        return [self.socket, self._monitor]

    def handle(self, ready: Container[Any]) -> None:
        if self._monitor in ready:
            self.count_connections()
        if self.socket in ready:
            self.serve()

    def tick(self, now: float) -> None:
        self.pending.answer(now)
        if not self.bound:
            if self._reopen_at is None:
                self._reopen_at = now + REOPEN_AFTER_S
            elif now >= self._reopen_at:
                self._reopen(now)

    def next_deadline(self) -> float | None:
        return min((d for d in (self.pending.next_deadline(), self._reopen_at)
                    if d is not None), default=None)

    def after_save(self) -> None:
        """Send the replies made so far: after the save, an acknowledged command survives a
        crash."""
        for frames in self._outbox:
            try:
                self.socket.send_multipart(frames, zmq.NOBLOCK)
            except zmq.ZMQError as exc:  # the client went away; nothing to do
                log.debug("control reply dropped: %s", exc)
        self._outbox.clear()

    def close(self) -> None:
        self._close_sockets()
        path = ipc_path(self.endpoint)
        if self.bound and path and os.path.exists(path):
            os.unlink(path)

    def _close_sockets(self) -> None:
        self.socket.disable_monitor()
        self._monitor.close(linger=0)
        self.socket.close(linger=0)

    # the connection bound

    def count_connections(self) -> None:
        """Follow the monitor's accepted/disconnected events; close the endpoint at the bound.
        Events of a closed binding are skipped: its connections went with it."""
        for _ in range(MAX_MONITOR_EVENTS_PER_ROUND):
            try:
                event = read_event(self._monitor, zmq.NOBLOCK).event
            except zmq.Again:
                break
            if not self.bound:
                continue
            if event == zmq.EVENT_ACCEPTED:
                self.connections += 1
            elif event == zmq.EVENT_DISCONNECTED:
                self.connections = max(0, self.connections - 1)
        if self.bound and self.connections >= self.max_connections:
            self._stop_accepting()

    def _stop_accepting(self) -> None:
        """Unlink the socket file first: no new connection can start from then on, whatever
        libzmq's I/O thread is doing; the unbind then drops every connection made through it."""
        log.warning("control socket %s: %d connections reached the bound of %d; all dropped, "
                    "and none accepted for %g s", self.endpoint, self.connections,
                    self.max_connections, REOPEN_AFTER_S)
        path = ipc_path(self.endpoint)
        if path:
            with contextlib.suppress(OSError):
                os.unlink(path)
        try:
            self.socket.unbind(self.endpoint)
        except zmq.ZMQError as exc:
            log.error("control socket %s: cannot unbind: %s", self.endpoint, exc)
        self.bound = False
        self.connections = 0
        self._reopen_at = None

    def _reopen(self, now: float) -> None:
        self.count_connections()  # skip what the closed binding still reported
        try:
            bind_control(self.socket, self.endpoint)
        except (RuntimeError, OSError, zmq.ZMQError) as exc:
            log.error("control socket %s: cannot bind again: %s; next try in %g s",
                      self.endpoint, exc, REOPEN_AFTER_S)
            self._reopen_at = now + REOPEN_AFTER_S
            return
        self.bound = True
        self._reopen_at = None
        log.warning("control socket %s: accepting connections again", self.endpoint)

    # requests

    def serve(self) -> None:
        """Handle the requests waiting on the socket (a bounded number of them)."""
        for _ in range(MAX_REQUESTS_PER_ROUND):
            try:
                frames = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            envelope, payload = split_envelope(frames)
            if envelope is None:
                self._on_bad_message(f"malformed frames ({len(frames)} frames)")
                continue
            send = self._sender(envelope)
            request_id = None
            try:
                request = decode_request(payload)
                request_id = request.get("id")
                result = self._dispatch(request["cmd"], request.get("args") or {})
            except CommandError as exc:
                send(reply_body(request_id, error=str(exc)))
            except ValueError as exc:
                self._on_bad_message(str(exc))
                send(reply_body(request_id, error=str(exc)))
            except Exception as exc:  # a bug in one command must not take the daemon down
                log.exception("control command failed")
                send(reply_body(request_id, error=f"internal error: {exc!r}"))
            else:
                if isinstance(result, Deferred):
                    self.pending.park(envelope[0], request_id, result, send)
                else:
                    send(reply_body(request_id, result=result))

    def _sender(self, envelope: list[bytes]) -> Callable[[dict[str, Any]], None]:
        def send(body: dict[str, Any]) -> None:
            self._outbox.append([*envelope, json.dumps(body).encode()])
        return send


def ipc_path(endpoint: str) -> str | None:
    return endpoint[len("ipc://"):] if endpoint.startswith("ipc://") else None


def connection_bound() -> int:
    """The most control connections this process can afford: `MAX_CONNECTIONS`, or a share of
    the soft fd limit in force when the socket is made, whichever is less."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return MAX_CONNECTIONS
    return max(1, min(MAX_CONNECTIONS, soft // FD_SHARE))


def control_router(ctx: zmq.SyncContext) -> zmq.SyncSocket:
    """The control ROUTER, with its bounds: message size, handshake time, per-peer queues."""
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_CONTROL_MESSAGE)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 0)   # a reply to a peer that left is dropped
    sock.setsockopt(zmq.HANDSHAKE_IVL, int(HANDSHAKE_TIMEOUT_S * 1000))
    sock.setsockopt(zmq.SNDHWM, PEER_HWM)      # beyond it, replies to that peer are dropped
    sock.setsockopt(zmq.RCVHWM, PEER_HWM)
    return sock


def bind_control(sock: zmq.SyncSocket, endpoint: str) -> None:
    """Bind the control ROUTER; an ipc socket is made 0600 (only root or the daemon's user can
    kill engines through it), and a stale socket file of a dead daemon is replaced."""
    path = ipc_path(endpoint)
    if path:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        if os.path.exists(path):
            try:
                listening = socket_listening(path)
            except PermissionError as exc:
                raise RuntimeError(f"control socket {path} exists and belongs to another "
                                   "user (permission denied)") from exc
            if listening:
                raise RuntimeError(f"control socket {path} is in use: is another daemon "
                                   "running?")
            os.unlink(path)
        old_umask = os.umask(0o177)
        try:
            _bind(sock, endpoint)
        finally:
            os.umask(old_umask)
        os.chmod(path, 0o600)
    else:
        _bind(sock, endpoint)


def _bind(sock: zmq.SyncSocket, endpoint: str) -> None:
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as exc:   # (a read-only directory, an address in use: one line)
        raise RuntimeError(f"cannot bind the control socket ('control' = {endpoint!r}): "
                           f"{exc}") from exc


def socket_listening(path: str) -> bool:
    """Is a daemon listening on this ipc path? (A daemon killed by SIGKILL leaves its socket
    file behind: a connect tells at once.) PermissionError when this user may not connect:
    that says nothing about whether a daemon is there."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(path)
        return True
    except PermissionError:
        raise
    except OSError:
        return False
    finally:
        probe.close()


def split_envelope(frames: list[bytes]) -> tuple[list[bytes] | None, bytes]:
    """ROUTER frames: [identity, payload] from a DEALER, [identity, b"", payload] from a REQ."""
    if len(frames) == 2:
        return frames[:1], frames[1]
    if len(frames) == 3 and frames[1] == b"":
        return frames[:2], frames[2]
    return None, b""


def decode_request(payload: bytes) -> dict[str, Any]:
    try:
        request = json.loads(payload)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise ValueError(f"not a JSON request: {exc!s:.200}") from None
    if not isinstance(request, dict) or not isinstance(request.get("cmd"), str):
        raise ValueError("a request is a JSON object with a string 'cmd'")
    if request.get("v", PROTOCOL_VERSION) != PROTOCOL_VERSION:
        raise ValueError(f"unsupported protocol version {request.get('v')!r} (this daemon "
                         f"speaks {PROTOCOL_VERSION})")
    if not isinstance(request.get("args", {}), dict):
        raise ValueError("'args' must be a JSON object")
    return request
