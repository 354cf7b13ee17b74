"""Serving a `hub.Hub`, embedded in a thread of its own or standalone in the caller's, and
driven over an inproc pipe (`pipe.Pipe`), as pyzmq's `ThreadAuthenticator` drives its
`AuthenticationThread`: `stop` and `reload_keys` (and, standalone, SIGTERM, SIGINT and SIGHUP)
are commands down the pipe, which wake the hub's poll at once. The context and the pipe are
made by the controlling thread, so that `stop` works as soon as `start` returns; the serving
thread closes the hub, the pipe and the context as it ends.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable
from types import FrameType

import zmq

from rollout_watchdog.agent.hub import Hub
from rollout_watchdog.agent.pipe import RELOAD, STOP, Pipe
from rollout_watchdog.common.limits import raise_nofile_limit

log = logging.getLogger(__name__)
START_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 5.0

Context = zmq.Context[zmq.Socket[bytes]]


class HubThread:
    """Starts, stops and reloads one hub; `start`/`stop` and `run` are its two ways to serve."""

    def __init__(self, hub: Hub) -> None:
        self.hub = hub
        self._pipe: Pipe | None = None     # the last serving's
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self._start_error: BaseException | None = None

    def start(self) -> None:
        """Bind and serve in a thread of its own; raises what the bind raised."""
        ctx, pipe = self._new_pipe()
        self._started.clear()
        self._start_error = None
        self._thread = threading.Thread(target=self._serve, args=(ctx, pipe),
                                        name="rollout-watchdog-coordinator", daemon=True)
        self._thread.start()
        if not self._started.wait(START_TIMEOUT_S):
            raise RuntimeError(f"the coordinator did not start within {START_TIMEOUT_S:g} s")
        if self._start_error is not None:
            self._thread.join(START_TIMEOUT_S)
            raise self._start_error

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """STOP down the pipe (the loop wakes and ends at once); waits for the thread, at most
        `timeout_s`. From any thread; nothing when not serving."""
        if self._pipe is not None:
            self._pipe.send(STOP)
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None

    def reload_keys(self) -> None:
        """RELOAD down the pipe: the hub reads its authorized keys again at once. From any
        thread; nothing when not serving."""
        if self._pipe is not None:
            self._pipe.send(RELOAD)

    def run(self, opened: Callable[[], None] | None = None) -> int:
        """Serve in this thread until SIGTERM or SIGINT (the standalone coordinator); SIGHUP
        reloads the authorized keys; `opened` is called once the hub is open (bound, its
        journal restored), before it serves. The soft open-file limit goes up to the hard one
        first, so that a flood of connections cannot run it out of descriptors (a driver
        embedding the coordinator decides that for its own process: `common.limits`)."""
        old, new = raise_nofile_limit()
        if new != old:
            log.info("open file limit raised from %d to %d", old, new)
        ctx, pipe = self._new_pipe()

        def stop(signum: int, frame: FrameType | None) -> None:
            pipe.send(STOP)
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, stop)
        signal.signal(signal.SIGHUP, lambda signum, frame: pipe.send(RELOAD))
        try:
            self.hub.open(ctx)
        except BaseException:
            _end(ctx, pipe)
            raise
        log.info("coordinator %s serving on %s%s", self.hub.boot, self.hub.endpoint,
                 " (CURVE)" if self.hub.keys else "")
        try:
            if opened is not None:
                opened()
            self.hub.loop(pipe)
        finally:
            self.hub.close()
            _end(ctx, pipe)
        return 0

    def _new_pipe(self) -> tuple[Context, Pipe]:
        ctx: Context = zmq.Context()
        self._pipe = Pipe(ctx, "hub")
        return ctx, self._pipe

    def _serve(self, ctx: Context, pipe: Pipe) -> None:
        try:
            self.hub.open(ctx)
        except BaseException as exc:
            _end(ctx, pipe)
            self._start_error = exc
            self._started.set()
            return
        self._started.set()
        try:
            self.hub.loop(pipe)
        finally:
            self.hub.close()
            _end(ctx, pipe)


def _end(ctx: Context, pipe: Pipe) -> None:
    """The serving thread's last step: every socket of `ctx` is closed, so `term` returns."""
    pipe.close()
    ctx.term()
