"""Talking to the local daemon over its control socket, with a bound on every wait."""

from __future__ import annotations

import json
import os
import uuid
from typing import Any

import zmq

from rollout_watchdog.config import DEFAULT_CONTROL
from rollout_watchdog.watchdog.control import socket_listening

ENV_CONTROL = "ROLLOUT_WATCHDOG_CONTROL"


class ControlError(Exception):
    """The daemon answered with an error, or did not answer in time."""


def default_control() -> str:
    return os.environ.get(ENV_CONTROL) or DEFAULT_CONTROL


class ControlClient:
    def __init__(self, endpoint: str | None = None, timeout_s: float = 5.0) -> None:
        self.endpoint = endpoint or default_control()
        self.timeout_s = timeout_s
        self.ctx: zmq.SyncContext = zmq.Context.instance()

    def call(self, cmd: str, args: dict[str, Any] | None = None,
             timeout_s: float | None = None) -> Any:
        """Send one command and return its result; ControlError on an error reply or no reply.

        A fresh socket per call: a daemon that restarted in between loses nothing, and a call
        that timed out leaves no stale reply behind for the next one.
        """
        timeout = self.timeout_s if timeout_s is None else timeout_s
        path = self.endpoint[len("ipc://"):] if self.endpoint.startswith("ipc://") else None
        if path is not None:
            try:
                listening = socket_listening(path)
            except PermissionError:
                raise ControlError(f"permission denied on {self.endpoint}: the control socket "
                                   "is 0600, for root or the daemon's user only") from None
            if not listening:
                raise ControlError(f"no daemon at {self.endpoint} (no socket, or nobody "
                                   "listening on it): is `rollout-watchdog run` running?")
        request_id = uuid.uuid4().hex
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(self.endpoint)
            sock.send(json.dumps({"v": 1, "id": request_id, "cmd": cmd,
                                  "args": args or {}}).encode())
            if not sock.poll(int(timeout * 1000)):
                raise ControlError(f"no answer from the daemon at {self.endpoint} within "
                                   f"{timeout:g} s")
            reply = json.loads(sock.recv())
        except zmq.ZMQError as exc:
            raise ControlError(f"cannot reach the daemon at {self.endpoint}: {exc}") from None
        except ValueError as exc:
            raise ControlError(f"unreadable answer from the daemon: {exc}") from None
        finally:
            sock.close(linger=0)
        if reply.get("status") != "ok":
            raise ControlError(reply.get("reason") or "the daemon answered with an error")
        return reply.get("result")

