"""Talking to the local daemon over its control socket, with a bound on every wait.

A daemon that dies while a call waits is seen at once: a socket monitor on the call's DEALER
reports the peer's disconnect (a SIGKILLed daemon's kernel closes its end). One that stops
answering with its socket open (SIGSTOPped, wedged) is only told by silence: the call's timeout.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from typing import Any

import zmq

from rollout_watchdog.common.handshakes import read_event
from rollout_watchdog.config import DEFAULT_CONTROL
from rollout_watchdog.watchdog.control import socket_listening

ENV_CONTROL = "ROLLOUT_WATCHDOG_CONTROL"
# A connection that dropped, or a connect that failed (the daemon went between the listening
# check and the connect); retries (CONNECT_RETRIED) follow either, so they tell nothing more.
_MONITORED = zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED


class ControlError(Exception):
    """The daemon answered with an error, or did not answer in time."""


class DaemonGone(ControlError):
    """The daemon's end of the connection closed while a call waited: it exited (or dropped
    this client, as at its connection bound). Told at once, not after the call's timeout."""


def default_control() -> str:
    return os.environ.get(ENV_CONTROL) or DEFAULT_CONTROL


class ControlClient:
    def __init__(self, endpoint: str | None = None, timeout_s: float = 5.0) -> None:
        self.endpoint = endpoint or default_control()
        self.timeout_s = timeout_s
        self.ctx: zmq.SyncContext = zmq.Context.instance()

    def call(self, cmd: str, args: dict[str, Any] | None = None,
             timeout_s: float | None = None) -> Any:
        """Send one command and return its result; ControlError on an error reply or no reply
        (DaemonGone, at once, when the daemon's end closes first).

        A fresh socket per call: a daemon that restarted in between loses nothing, and a call
        that timed out leaves no stale reply behind for the next one.
        """
        timeout = self.timeout_s if timeout_s is None else timeout_s
        path = self.endpoint[len("ipc://"):] if self.endpoint.startswith("ipc://") else None
        if path is not None:
            try:
                listening = socket_listening(path)
            except PermissionError as exc:
                raise ControlError(f"permission denied on {self.endpoint}: the control socket "
                                   "is 0600, for root or the daemon's user only") from exc
            if not listening:
                raise ControlError(f"no daemon at {self.endpoint} (no socket, or nobody "
                                   "listening on it): is `rollout-watchdog run` running?")
        request_id = uuid.uuid4().hex
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        monitor = sock.get_monitor_socket(_MONITORED)  # before the connect: no event missed
        try:
            sock.connect(self.endpoint)
            sock.send(json.dumps({"v": 1, "id": request_id, "cmd": cmd,
                                  "args": args or {}}).encode())
            reply = json.loads(self._await_reply(sock, monitor, path, timeout))
        except zmq.ZMQError as exc:
            raise ControlError(f"cannot reach the daemon at {self.endpoint}: {exc}") from exc
        except ValueError as exc:
            raise ControlError(f"unreadable answer from the daemon: {exc}") from None
        finally:
            sock.disable_monitor()
            monitor.close(linger=0)
            sock.close(linger=0)
        if reply.get("status") != "ok":
            raise ControlError(reply.get("reason") or "the daemon answered with an error")
        return reply.get("result")

    def _await_reply(self, sock: zmq.SyncSocket, monitor: zmq.SyncSocket, path: str | None,
                     timeout: float) -> bytes:
        """The reply; DaemonGone as soon as the daemon's end closes, ControlError after
        `timeout` s of silence."""
        deadline = time.monotonic() + timeout
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        while (left := deadline - time.monotonic()) > 0:
            ready = dict(poller.poll(max(1, int(left * 1000))))
            if sock in ready:
                return sock.recv()
            if monitor in ready and peer_gone(read_event(monitor).event, path):
                try:  # a reply that came in just before the end is still the answer
                    return sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    raise DaemonGone(f"the daemon at {self.endpoint} closed the connection "
                                     "(it exited, or dropped this client)") from None
        raise ControlError(f"no answer from the daemon at {self.endpoint} within {timeout:g} s")


def peer_gone(event: int, path: str | None) -> bool:
    """Does this monitor event mean that the daemon is gone? A dropped connection does; a
    failed connect only when nobody listens any more (a full listen backlog fails it too)."""
    if event == zmq.EVENT_DISCONNECTED or path is None:
        return True
    try:
        return not socket_listening(path)
    except PermissionError:
        return False
