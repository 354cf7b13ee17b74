"""The /metrics HTTP endpoint, served from one selector thread.

prometheus_client's start_http_server spends a thread per connection and never times an idle
one out: about 1,000 idle connections exhausted the daemon's file descriptors and killed it.
Here one thread serves every connection, at most ``max_connections`` are open at once (a new one
evicts the oldest, so a fresh scrape always gets through a flood), and each lives at most
``timeout_s`` from accept to the end of its answer. Answers are ``Connection: close``.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from prometheus_client import CONTENT_TYPE_LATEST

MAX_CONNECTIONS = 64
TIMEOUT_S = 5.0
MAX_REQUEST_BYTES = 8192
METRICS_PATHS = ("/metrics", "/")
# An accept that fails for want of descriptors (EMFILE) stops accepting for this long, instead
# of spinning on a listener that stays readable.
_ACCEPT_BACKOFF_S = 0.1
_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
            431: "Request Header Fields Too Large", 500: "Internal Server Error"}


@dataclass
class _Conn:
    sock: socket.socket
    deadline: float
    request: bytearray = field(default_factory=bytearray)
    reply: bytes = b""  # non-empty once the request is complete: then we only write

    @property
    def writing(self) -> bool:
        return bool(self.reply)


def _response(status: int, body: bytes, content_type: str, head: bool) -> bytes:
    header = (f"HTTP/1.1 {status} {_REASONS[status]}\r\nContent-Type: {content_type}\r\n"
              f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n")
    return header.encode() + (b"" if head else body)


class MetricsServer:
    """Serves ``render()`` at /metrics; ``start`` binds (OSError if the port is taken)."""

    def __init__(self, render: Callable[[], bytes], host: str, port: int, *,
                 max_connections: int = MAX_CONNECTIONS, timeout_s: float = TIMEOUT_S) -> None:
        if max_connections < 1 or not 0 < timeout_s < float("inf"):
            raise ValueError(f"metrics server: max_connections {max_connections} must be >= 1 "
                             f"and timeout_s {timeout_s} finite and > 0")
        self._render = render
        self._addr = (host, port)
        self._max = max_connections
        self._timeout = timeout_s
        self._conns: dict[socket.socket, _Conn] = {}  # in accept order: the first is the oldest
        self._sel = selectors.DefaultSelector()
        self._listener: socket.socket | None = None
        self._wake_r, self._wake_w = socket.socketpair()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._accept_paused_until = 0.0

    @property
    def port(self) -> int:
        """The bound port (the real one when started on port 0)."""
        assert self._listener is not None, "not started"
        return int(self._listener.getsockname()[1])

    def start(self) -> None:
        host, port = self._addr
        family, _, _, _, addr = socket.getaddrinfo(
            host, port, 0, socket.SOCK_STREAM, 0, socket.AI_PASSIVE)[0]
        listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(addr)
            listener.listen(128)
            listener.setblocking(False)
        except OSError:
            listener.close()
            raise
        self._listener = listener
        self._sel.register(listener, selectors.EVENT_READ)
        self._sel.register(self._wake_r, selectors.EVENT_READ)
        self._thread = threading.Thread(target=self._run, name="metrics-http", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop serving and close every socket, the listener included, so the port is free."""
        self._stopping = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        if self._thread is not None:
            self._thread.join(timeout_s)
        self._wake_w.close()

    def _run(self) -> None:
        try:
            while not self._stopping:
                now = time.monotonic()
                self._expire(now)
                self._resume_accept(now)
                for key, mask in self._sel.select(self._next_wait(now)):
                    if key.fileobj is self._listener:
                        self._accept()
                    elif key.fileobj is self._wake_r:
                        self._wake_r.recv(64)
                    elif (conn := self._conns.get(key.fileobj)) is not None:  # type: ignore[call-overload]
                        self._serve(conn, mask)  # (None: evicted earlier in this batch)
        finally:
            for sock in list(self._conns):
                self._close(sock)
            self._sel.close()
            if self._listener is not None:
                self._listener.close()
            self._wake_r.close()

    def _next_wait(self, now: float) -> float:
        deadlines = [c.deadline for c in self._conns.values()]
        if self._accept_paused_until:
            deadlines.append(self._accept_paused_until)
        return max(0.0, min(deadlines, default=now + self._timeout) - now)

    def _expire(self, now: float) -> None:
        for sock in [s for s, c in self._conns.items() if c.deadline <= now]:
            self._close(sock)

    def _resume_accept(self, now: float) -> None:
        if self._accept_paused_until and now >= self._accept_paused_until:
            self._accept_paused_until = 0.0
            self._sel.register(self._listener, selectors.EVENT_READ)  # type: ignore[arg-type]

    def _accept(self) -> None:
        assert self._listener is not None
        for _ in range(self._max):  # bounded: a flood cannot keep this thread in accept
            try:
                sock, _ = self._listener.accept()
            except BlockingIOError:
                return
            except OSError:  # EMFILE, ENFILE, ENOBUFS: back off, never die
                self._sel.unregister(self._listener)
                self._accept_paused_until = time.monotonic() + _ACCEPT_BACKOFF_S
                return
            if len(self._conns) >= self._max:
                self._evict()
            sock.setblocking(False)
            self._conns[sock] = _Conn(sock, time.monotonic() + self._timeout)
            self._sel.register(sock, selectors.EVENT_READ)

    def _evict(self) -> None:
        """Close the oldest connection still sending its request (else the oldest of all)."""
        victim = next((s for s, c in self._conns.items() if not c.writing), None)
        self._close(victim if victim is not None else next(iter(self._conns)))

    def _close(self, sock: socket.socket) -> None:
        self._conns.pop(sock, None)
        with contextlib.suppress(KeyError, ValueError):
            self._sel.unregister(sock)
        sock.close()

    def _serve(self, conn: _Conn, mask: int) -> None:
        try:
            if mask & selectors.EVENT_READ and not conn.writing:
                data = conn.sock.recv(4096)
                if not data:
                    self._close(conn.sock)
                    return
                conn.request += data
                if b"\r\n\r\n" in conn.request or len(conn.request) > MAX_REQUEST_BYTES:
                    conn.reply = self._answer(bytes(conn.request))
                    self._sel.modify(conn.sock, selectors.EVENT_WRITE)
            if mask & selectors.EVENT_WRITE and conn.writing:
                sent = conn.sock.send(conn.reply)
                conn.reply = conn.reply[sent:]
                if not conn.reply:
                    self._close(conn.sock)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:  # the client reset or went away
            self._close(conn.sock)

    def _answer(self, request: bytes) -> bytes:
        text = "text/plain; charset=utf-8"
        if b"\r\n\r\n" not in request:
            return _response(431, b"request too large\n", text, head=False)
        parts = request.split(b"\r\n", 1)[0].split()
        if len(parts) != 3 or not parts[2].startswith(b"HTTP/"):
            return _response(400, b"bad request line\n", text, head=False)
        method, target = parts[0], parts[1].split(b"?", 1)[0].decode("latin-1")
        if method not in (b"GET", b"HEAD"):
            return _response(405, b"GET or HEAD only\n", text, head=False)
        if target not in METRICS_PATHS:
            return _response(404, b"metrics are at /metrics\n", text, head=method == b"HEAD")
        try:
            body = self._render()
        except Exception as exc:  # a broken collector must not end the server
            return _response(500, f"cannot render metrics: {exc}\n".encode(), text, head=False)
        return _response(200, body, CONTENT_TYPE_LATEST, head=method == b"HEAD")
