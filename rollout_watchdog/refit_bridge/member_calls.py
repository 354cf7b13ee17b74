"""The HTTP calls of a weight-update group to its members, each from a thread of its own.

It exists apart from the group because the group's job is the protocol of rank 0 (rendezvous,
sessions, broadcasts, who to blame), while freeing a caller stuck in a call is a job of its
own: every call's socket is tracked while it is under way, so that an abort shuts it (and the
thread that waits in it returns at once), and every HTTP socket ever opened is remembered, so
that a teardown that shuts the group's own connections leaves these alone. Every completion sets
the group's wake-up event: the group's waiter sleeps on that one event alone.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Generic, Protocol, TypeVar

from rollout_watchdog.refit_bridge import engine_calls, sockets

T = TypeVar("T")


class Callee(Protocol):
    """A member as its calls see it: where it listens."""

    @property
    def url(self) -> str: ...


M = TypeVar("M", bound=Callee)


def unanswered(fut: Future[Any]) -> bool:
    """A finished call that got no HTTP answer at all: its engine is likely dead."""
    exc = fut.exception()
    return exc is not None and not (isinstance(exc, engine_calls.EngineCallError)
                                    and exc.answered)


class MemberCalls(Generic[M]):
    """Calls to members on a pool of `workers` threads (named `thread_prefix`-N): connecting
    and a quick call are bounded by `http_timeout_s`, a blocking call's answer (it returns when
    a collective completes) by `blocking_timeout_s`."""

    def __init__(self, thread_prefix: str, workers: int, wake: threading.Event, *,
                 http_timeout_s: float, blocking_timeout_s: float) -> None:
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=thread_prefix)
        self._wake = wake
        self.http_timeout_s = http_timeout_s
        self.blocking_timeout_s = blocking_timeout_s
        self._lock = threading.Lock()
        self._aborted = False
        self._inflight: dict[M, Future[dict[str, Any]]] = {}
        self._socks: dict[int, socket.socket] = {}  # inode -> socket of a call under way
        self._inodes: set[int] = set()  # every HTTP socket ever opened: not the group's

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """Run `fn` on the pool, beside the calls (the trainer's own part of a collective)."""
        return self._pool.submit(fn, *args)

    def call(self, m: M, method: str, path: str, body: dict[str, Any] | None,
             blocking: bool, cleanup: bool = False) -> dict[str, Any]:
        """One call to one member; its socket is tracked while under way (abort shuts it,
        except a `cleanup` call's: those are what comes after an abort)."""
        inode = 0

        def track(sock: socket.socket) -> None:
            nonlocal inode
            inode = sockets.inode_of(sock)
            with self._lock:
                self._inodes.add(inode)
                if cleanup:
                    return
                self._socks[inode] = sock
                aborted = self._aborted
            if aborted:
                sock.shutdown(socket.SHUT_RDWR)

        try:
            return engine_calls.call(
                m.url, method, path, body, connect_timeout_s=self.http_timeout_s,
                read_timeout_s=self.blocking_timeout_s if blocking else self.http_timeout_s,
                on_socket=track)
        finally:
            with self._lock:
                self._socks.pop(inode, None)

    def post_all(self, path: str, bodies: dict[M, dict[str, Any]], blocking: bool,
                 cleanup: bool = False) -> dict[M, Future[dict[str, Any]]]:
        """POST each body to its member, each from its own thread; the blocking ones are the
        calls `pending` and `abort` look at."""
        calls: dict[M, Future[dict[str, Any]]] = {}
        for m, body in bodies.items():
            fut = self._pool.submit(self.call, m, "POST", path, body, blocking, cleanup)
            fut.add_done_callback(lambda _f: self._wake.set())
            calls[m] = fut
        if blocking:
            with self._lock:
                self._inflight = dict(calls)
        return calls

    def pending(self) -> list[M]:
        """Members whose current call has not completed (at a deadline: the wedged ones)."""
        with self._lock:
            return [m for m, f in self._inflight.items() if not f.done()]

    def abort(self) -> list[M]:
        """From now on a call's socket is shut as soon as it opens (a cleanup call's excepted).
        Returns the members whose blocking calls are pending now; `release` frees them."""
        with self._lock:
            self._aborted = True
            return [m for m, f in self._inflight.items() if not f.done()]

    def release(self) -> None:
        """Shut the sockets of the calls under way, so their threads end now."""
        with self._lock:
            http = list(self._socks.values())
        for sock in http:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def inodes(self) -> set[int]:
        """Every HTTP socket the calls ever opened."""
        with self._lock:
            return set(self._inodes)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False)
