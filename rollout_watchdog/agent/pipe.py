"""Thread control over an in-process pipe, as pyzmq's `ThreadAuthenticator` drives its thread
(zmq/auth/thread.py) and zguide's clone.py its agent: a thread that waits in a ZMQ poll also
polls its end of an inproc PAIR, so a command sent down the pipe (stop, reload) wakes it at
once. Nothing is polled on a timer to notice it.

Threads: `end` belongs to the thread that serves; `send` may be called from any thread (the
control end is kept behind a lock), from a signal handler of the serving thread too. The
serving thread closes both ends when it ends (`close`); a later `send` does nothing.
"""

from __future__ import annotations

import contextlib
import threading
import uuid

import zmq

STOP = b"STOP"
RELOAD = b"RELOAD"


class Pipe:
    """The two ends of one inproc PAIR, in `ctx` (the serving thread's sockets' context)."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], name: str) -> None:
        endpoint = f"inproc://rollout-watchdog-{name}-{uuid.uuid4().hex}"
        # Re-entrant: a signal handler may send while its thread closes the pipe (it then
        # finds the control end gone, and the thread is ending anyway).
        self._lock = threading.RLock()
        control = ctx.socket(zmq.PAIR)
        control.linger = 0
        control.bind(endpoint)
        self.end: zmq.Socket[bytes] = ctx.socket(zmq.PAIR)
        self.end.linger = 0
        self.end.connect(endpoint)
        self._control: zmq.Socket[bytes] | None = control

    def send(self, command: bytes) -> None:
        """Tell the serving thread; never blocks (a full pipe already holds a command)."""
        with self._lock:
            if self._control is not None:
                with contextlib.suppress(zmq.Again):
                    self._control.send(command, zmq.NOBLOCK)

    def receive(self) -> list[bytes]:
        """The commands sent so far, oldest first (the serving thread's call)."""
        commands = []
        while True:
            try:
                commands.append(self.end.recv(zmq.NOBLOCK))
            except zmq.Again:
                return commands

    def close(self) -> None:
        """Close both ends (the serving thread's call, as it ends)."""
        with self._lock:
            control, self._control = self._control, None
            if control is not None:
                control.close(0)
            self.end.close(0)
