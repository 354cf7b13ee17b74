"""The daemon's local control socket: a ZMQ ROUTER on an ipc path (0600), JSON requests and
replies, never blocking the main loop.

Request `{"v": 1, "id": ANY, "cmd": NAME, "args": {...}}` (one frame from a DEALER, or a REQ
envelope); reply `{"v": 1, "id": ANY, "status": "ok"|"error", "reason": str|null, "result": ...}`.
A reply can wait for a condition (`Deferred`: a pause waits for in-flight probes, `events` for
new events); replies are sent only when the daemon says so, after it has saved its state.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq

log = logging.getLogger(__name__)
MAX_CONTROL_MESSAGE = 64 * 1024
MAX_REQUESTS_PER_ROUND = 100  # so a flood of requests never starves the engines


class CommandError(Exception):
    """A control command that cannot be carried out; the message is the reply's reason."""


@dataclass
class Deferred:
    """A reply that waits for a condition: `poll()` returns the result once it is ready."""

    poll: Callable[[], dict[str, Any] | None]
    deadline: float                       # monotonic
    on_timeout: Callable[[], dict[str, Any]]


@dataclass
class _Parked:
    envelope: list[bytes]
    request_id: Any
    deferred: Deferred


Dispatch = Callable[[str, dict[str, Any]], "dict[str, Any] | Deferred"]


class ControlServer:
    def __init__(self, ctx: zmq.Context, endpoint: str, dispatch: Dispatch,
                 on_bad_message: Callable[[str], None]) -> None:
        self.endpoint = endpoint
        self.socket = bind_control(ctx, endpoint)
        self._dispatch = dispatch
        self._on_bad_message = on_bad_message
        self.parked: list[_Parked] = []
        self._outbox: list[list[bytes]] = []

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
            request_id = None
            try:
                request = decode_request(payload)
                request_id = request.get("id")
                result = self._dispatch(request["cmd"], request.get("args") or {})
            except CommandError as exc:
                self._reply(envelope, request_id, error=str(exc))
            except ValueError as exc:
                self._on_bad_message(str(exc))
                self._reply(envelope, request_id, error=str(exc))
            except Exception as exc:  # a bug in one command must not take the daemon down
                log.exception("control command failed")
                self._reply(envelope, request_id, error=f"internal error: {exc!r}")
            else:
                if isinstance(result, Deferred):
                    self.parked.append(_Parked(envelope, request_id, result))
                else:
                    self._reply(envelope, request_id, result=result)

    def answer_parked(self, now: float) -> None:
        still = []
        for parked in self.parked:
            try:
                result = parked.deferred.poll()
                if result is None and now >= parked.deferred.deadline:
                    result = parked.deferred.on_timeout()
            except CommandError as exc:
                self._reply(parked.envelope, parked.request_id, error=str(exc))
                continue
            except Exception as exc:
                log.exception("deferred control reply failed")
                self._reply(parked.envelope, parked.request_id, error=f"internal error: {exc!r}")
                continue
            if result is None:
                still.append(parked)
            else:
                self._reply(parked.envelope, parked.request_id, result=result)
        self.parked = still

    def next_deadline(self) -> float | None:
        return min((p.deferred.deadline for p in self.parked), default=None)

    def _reply(self, envelope: list[bytes], request_id: Any, *, result: Any = None,
               error: str | None = None) -> None:
        body = {"v": 1, "id": request_id, "status": "error" if error else "ok",
                "reason": error, "result": result}
        self._outbox.append([*envelope, json.dumps(body).encode()])

    def flush(self) -> None:
        """Send the replies made so far (the daemon calls this after saving its state)."""
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
    if request.get("v", 1) != 1:
        raise ValueError(f"unsupported protocol version {request.get('v')!r} (this daemon "
                         "speaks 1)")
    if not isinstance(request.get("args", {}), dict):
        raise ValueError("'args' must be a JSON object")
    return request
