"""The daemon's local control socket: a ZMQ ROUTER on an ipc path (0600), JSON requests and
replies, never blocking the main loop.

Request `{"v": 1, "id": ANY, "cmd": NAME, "args": {...}}` (one frame from a DEALER, or a REQ
envelope); reply `{"v": 1, "id": ANY, "status": "ok"|"error", "reason": str|null, "result": ...}`.
Replies that wait for a condition are parked in the shared `PendingReplies`; every reply is
sent only after the daemon has saved its state.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from collections.abc import Callable, Container
from typing import Any

import zmq

from rollout_watchdog.watchdog.replies import (
    PROTOCOL_VERSION,
    CommandError,
    Deferred,
    PendingReplies,
    reply_body,
)

log = logging.getLogger(__name__)
MAX_CONTROL_MESSAGE = 64 * 1024
MAX_REQUESTS_PER_ROUND = 100  # so a flood of requests never starves the engines


Dispatch = Callable[[str, dict[str, Any]], "dict[str, Any] | Deferred"]


class ControlServer:
    """The local control socket as a loop participant: requests are dispatched to the command
    table, and replies (immediate or parked) are sent after the daemon saved its state."""

    def __init__(self, ctx: zmq.Context, endpoint: str, dispatch: Dispatch,
                 on_bad_message: Callable[[str], None]) -> None:
        self.endpoint = endpoint
        self.socket = bind_control(ctx, endpoint)
        self._dispatch = dispatch
        self._on_bad_message = on_bad_message
        self.pending = PendingReplies()
        self._outbox: list[list[bytes]] = []

    # the loop participant

    def pollables(self) -> list[zmq.Socket]:
        return [self.socket]

    def handle(self, ready: Container[Any]) -> None:
        if self.socket in ready:
            self.serve()

    def tick(self, now: float) -> None:
        self.pending.answer(now)

    def next_deadline(self) -> float | None:
        return self.pending.next_deadline()

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
        self.socket.close(linger=0)
        path = ipc_path(self.endpoint)
        if path and os.path.exists(path):
            os.unlink(path)

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


def bind_control(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    """Bind the control ROUTER; an ipc socket is made 0600 (only root or the daemon's user can
    kill engines through it), and a stale socket file of a dead daemon is replaced."""
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_CONTROL_MESSAGE)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
    path = ipc_path(endpoint)
    if path:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        if os.path.exists(path):
            if socket_listening(path):
                sock.close()
                raise RuntimeError(f"control socket {path} is in use: is another daemon "
                                   "running?")
            os.unlink(path)
        old_umask = os.umask(0o177)
        try:
            sock.bind(endpoint)
        finally:
            os.umask(old_umask)
        os.chmod(path, 0o600)
    else:
        sock.bind(endpoint)
    return sock


def socket_listening(path: str) -> bool:
    """Is a daemon listening on this ipc path? (A daemon killed by SIGKILL leaves its socket
    file behind: a connect tells at once.)"""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(path)
        return True
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
