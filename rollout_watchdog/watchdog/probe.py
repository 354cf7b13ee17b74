"""Deep probes (HTTP GET of the health path, after the progress path when there is one), so a
hung engine never blocks the daemon's main loop. Results come back through a queue plus a
wake-up pipe the loop polls.

One deadline bounds a whole probe (connect, request, status line, and the progress GET before
it): each read waits only for what is left of it, and `expire`, which the loop calls, shuts down
the socket of a probe past its deadline, so a read blocked on an engine that trickles bytes
returns at once. A probe then reports "no answer within N s" and its thread ends. (Resolving a
host name is the one step nothing can cut short; its probe stays in flight until it returns.)

Probes run on worker threads that are kept for the next probes, and a new one is started
whenever none is idle: an engine has at most one probe in flight (`submit` refuses a second),
so the workers never outnumber the engines, and no engine's probe ever waits in a queue behind
the hung probes of others.
"""

from __future__ import annotations

import contextlib
import functools
import http.client
import io
import json
import math
import os
import queue
import socket
import ssl
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast
from urllib.parse import urlsplit

from rollout_watchdog.common.server_info import READ_LIMIT, tp_size_of

if TYPE_CHECKING:
    from _typeshed import WriteableBuffer

# Connecting gives up after this, or at the probe's deadline if sooner: a listener that has not
# accepted within it is not going to.
MAX_CONNECT_S = 5.0
PROGRESS_READ_LIMIT = 4 * 1024 * 1024  # bytes of the engine's Prometheus text read at most
# The most a starting engine's passing probe waits for its /server_info (engine_info.py): it
# delays that probe's result, and a pause waits for probes in flight.
INFO_S = 1.0
DETAIL_LIMIT = 200  # characters of a failure's detail kept (it goes to logs and status JSON)


@dataclass(frozen=True)
class ProbeResult:
    engine: str
    probe_id: int
    ok: bool
    detail: str
    started: float     # time.monotonic()
    finished: float
    progress: Progress | None = None   # from the progress probe, when there is one
    tp_size: int | None = None         # from /server_info, when asked for (engine_info.py)


@dataclass(frozen=True)
class Progress:
    """What the engine's Prometheus text says about generation."""

    tokens: float      # sglang:generation_tokens_total, summed over its series
    running: float     # sglang:num_running_reqs, summed


@dataclass(eq=False)
class _Flight:
    """One probe in flight. `sock` (the socket it reads, None between its requests) is set,
    cleared and shut down only under the runner's lock, so `expire` never touches a closed file
    descriptor, whose number may already belong to something else."""

    probe_id: int
    timeout_s: float
    started: float = field(default_factory=time.monotonic)
    sock: socket.socket | None = None
    expired: bool = False   # `expire` or `close` aborted it

    @property
    def deadline(self) -> float:
        return self.started + self.timeout_s

    def abort(self) -> None:
        """Under the runner's lock: end the probe now. The plain socket's shutdown (not an
        SSLSocket's own, which would tear down TLS state under the reading thread) makes a
        blocked read return at once."""
        self.expired = True
        if self.sock is not None:
            with contextlib.suppress(OSError):
                socket.socket.shutdown(self.sock, socket.SHUT_RDWR)


class ProbeRunner:
    def __init__(self, max_workers: int | None = None) -> None:
        """max_workers: at most this many probes in flight over all engines, where the caller
        wants a bound on threads; None (no bound but one probe per engine) lets no engine's
        probe be refused for another's."""
        if max_workers is not None and max_workers < 1:
            raise ValueError(f"max_workers must be at least 1, not {max_workers}")
        self._max = max_workers
        self._lock = threading.Lock()
        self._flights: dict[str, _Flight] = {}
        # Worker threads, kept for the next probes: a thread is started only when none is
        # idle, so there are never more than the most probes ever in flight at once.
        self._jobs: queue.SimpleQueue[tuple[str, _Flight, str, str | None, str | None] | None] = (
            queue.SimpleQueue())
        self._workers: list[threading.Thread] = []
        self._idle = 0
        self._closed = False
        self.results: queue.SimpleQueue[ProbeResult] = queue.SimpleQueue()
        self.wake_r, self._wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self._wake_w, False)

    def submit(self, engine: str, probe_id: int, url: str, timeout_s: float,
               progress_url: str | None = None, info_url: str | None = None) -> bool:
        """Start a probe that ends within timeout_s. False (nothing started) while the engine
        still has a probe in flight, when max_workers are out, or after close; once True,
        exactly one result for this probe comes."""
        if not (math.isfinite(timeout_s) and timeout_s > 0):
            raise ValueError(f"probe timeout must be a finite number of seconds > 0, "
                             f"not {timeout_s!r}")
        flight = _Flight(probe_id, timeout_s)
        with self._lock:
            if (self._closed or engine in self._flights
                    or (self._max is not None and len(self._flights) >= self._max)):
                return False
            self._flights[engine] = flight
            start_one = self._idle == 0
            if not start_one:
                self._idle -= 1  # that idle worker takes this job
        self._jobs.put((engine, flight, url, progress_url, info_url))
        if start_one:
            worker = threading.Thread(target=self._work, name="probe", daemon=True)
            try:
                worker.start()
                self._workers.append(worker)
            except RuntimeError as exc:  # no thread to be had: still the one result promised
                # (the job stays queued; a worker that takes it later finds it answered)
                self._post(engine, flight, False, f"probe error: {exc}")
        return True

    def in_flight(self, engine: str) -> bool:
        """Whether the engine has a probe whose result is not yet posted."""
        with self._lock:
            return engine in self._flights

    def next_deadline(self) -> float | None:
        """The earliest deadline (time.monotonic()) of a probe not yet expired: when the loop
        must next call `expire`. Expired ones are left out, or the loop would spin until their
        threads post."""
        with self._lock:
            return min((f.deadline for f in self._flights.values() if not f.expired),
                       default=None)

    def expire(self, now: float) -> None:
        """Abort the probes past their deadline at `now` (time.monotonic()); cheap: no I/O but
        a shutdown per probe."""
        with self._lock:
            for flight in self._flights.values():
                if not flight.expired and now >= flight.deadline:
                    flight.abort()

    def drain(self) -> list[ProbeResult]:
        try:
            while os.read(self.wake_r, 4096):
                pass
        except BlockingIOError:
            pass
        out = []
        while True:
            try:
                out.append(self.results.get_nowait())
            except queue.Empty:
                return out

    def close(self, wait_s: float = 1.0) -> None:
        """Abort every probe in flight and wait at most wait_s for their threads to end. Their
        results still go to `results`; the wake-up pipe is closed."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            flights = list(self._flights.values())
            for flight in flights:
                flight.abort()
            os.close(self.wake_r)
            os.close(self._wake_w)
        for _ in self._workers:
            self._jobs.put(None)
        end = time.monotonic() + wait_s
        for worker in self._workers:
            worker.join(max(0.0, end - time.monotonic()))

    # ------------------------------------------------------------------ the probe's thread

    def _work(self) -> None:
        """A worker: one probe after another, until close."""
        while (job := self._jobs.get()) is not None:
            self._run(*job)
            with self._lock:
                self._idle += 1

    def _run(self, engine: str, flight: _Flight, url: str, progress_url: str | None,
             info_url: str | None) -> None:
        with self._lock:
            if self._flights.get(engine) is not flight:
                return  # already answered (no thread could be started for it)
        progress = tp_size = None
        ok, detail, stage = False, "probe error: no verdict", ""
        try:  # a probe always reports, or its pause is never acknowledged
            if progress_url:  # first: /metrics answers even when the scheduler is stuck
                stage = " (during the progress probe)"
                progress = self._progress(flight, progress_url)
                stage = ""
            status, _ = self._get(flight, url)
            ok, detail = status == 200, f"HTTP {status}"
            if ok and info_url:
                tp_size = self._tp_size(flight, info_url)
        except Exception as exc:
            detail = _failure(exc, flight) + stage
        finally:
            self._post(engine, flight, ok, detail, progress, tp_size)

    def _tp_size(self, flight: _Flight, url: str) -> int | None:
        """The engine's tp_size from its /server_info, within INFO_S and the probe's deadline;
        None when unread (the verdict stands either way: this is not a health check)."""
        info = _Flight(flight.probe_id, min(INFO_S, max(0.0, flight.deadline
                                                        - time.monotonic())))
        if info.timeout_s <= 0:
            return None
        try:
            status, body = self._get(info, url, READ_LIMIT)
            return tp_size_of(json.loads(body)) if status == 200 else None
        except (OSError, http.client.HTTPException, ValueError):
            return None

    def _post(self, engine: str, flight: _Flight, ok: bool, detail: str,
              progress: Progress | None = None, tp_size: int | None = None) -> None:
        result = ProbeResult(engine, flight.probe_id, ok, printable(detail), flight.started,
                             time.monotonic(), progress, tp_size)
        with self._lock:
            # Out of the table before the result is seen, so the caller may submit the next.
            if self._flights.get(engine) is flight:
                del self._flights[engine]
            self.results.put(result)
            if not self._closed:
                # A full pipe means the loop is already going to wake up.
                with contextlib.suppress(BlockingIOError):
                    os.write(self._wake_w, b"!")

    def _hold(self, flight: _Flight, sock: socket.socket | None) -> None:
        """Show the socket the probe reads to `expire` (None: it is about to be closed)."""
        with self._lock:
            if sock is not None and flight.expired:
                raise TimeoutError("probe expired")
            flight.sock = sock

    def _progress(self, flight: _Flight, url: str) -> Progress | None:
        """The engine's metrics, or None if they say nothing or fail; past the deadline the
        probe itself has failed, so that raises."""
        try:
            status, body = self._get(flight, url, PROGRESS_READ_LIMIT)
        except (OSError, http.client.HTTPException):
            if flight.expired or time.monotonic() >= flight.deadline:
                raise
            return None
        return parse_progress(body.decode(errors="replace")) if status == 200 else None

    def _get(self, flight: _Flight, url: str, read_limit: int = 0) -> tuple[int, bytes]:
        """GET the URL before the probe's deadline: (status, up to read_limit bytes of body).
        Plain http.client: a probe every few seconds per engine is the daemon's main cost, and
        requests costs several times more CPU per call. Raises OSError / HTTPException."""
        parts = urlsplit(url)
        host = parts.hostname or "127.0.0.1"
        tls = parts.scheme == "https"
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        sock = socket.create_connection((host, parts.port or (443 if tls else 80)),
                                        timeout=min(_left(flight.deadline), MAX_CONNECT_S))
        try:
            if tls:
                sock = ssl.create_default_context().wrap_socket(
                    sock, server_hostname=host, do_handshake_on_connect=False)
            self._hold(flight, sock)
            try:
                sock.settimeout(_left(flight.deadline))
                if isinstance(sock, ssl.SSLSocket):
                    sock.do_handshake()
                conn = _BorrowedConnection(host, parts.port)
                conn.sock = sock
                conn.response_class = cast("type[http.client.HTTPResponse]", functools.partial(
                    _DeadlineResponse, deadline=flight.deadline))
                conn.request("GET", target, headers={"Connection": "close"})
                response = conn.getresponse()
                return response.status, response.read(read_limit) if read_limit else b""
            finally:
                self._hold(flight, None)
        finally:
            sock.close()


class _BorrowedConnection(http.client.HTTPConnection):
    """http.client's connection over a socket the probe owns. On a response that ends the
    connection, getresponse() closes the connection, which would close the socket before the
    body is read through it (a body not already buffered with the headers then read as
    "Bad file descriptor": a /metrics of more than a buffer, or one sent apart from its
    headers). Here closing only lets go of the socket; the probe closes it once done."""

    def close(self) -> None:
        self.sock = None


class _DeadlineReader(io.RawIOBase):
    """A socket's reads, each waiting only for what is left until the deadline: a fresh timeout
    per read would let an engine trickling a byte at a time hold a probe for ever."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        super().__init__()
        self._sock = sock
        self._deadline = deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: WriteableBuffer) -> int:
        self._sock.settimeout(_left(self._deadline))
        return self._sock.recv_into(buffer)


class _DeadlineResponse(http.client.HTTPResponse):
    """http.client's response, read through a _DeadlineReader."""

    def __init__(self, sock: socket.socket, debuglevel: int = 0, method: str | None = None,
                 url: str | None = None, *, deadline: float) -> None:
        super().__init__(sock, debuglevel, method, url)
        self.fp.close()  # the socket's own file: drop its reference to the socket
        self.fp = io.BufferedReader(_DeadlineReader(sock, deadline))


def _left(deadline: float) -> float:
    """Seconds left until the deadline; TimeoutError once there are none."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("probe deadline passed")
    return left


def _failure(exc: Exception, flight: _Flight) -> str:
    """Why a probe failed, in the words an operator reads in status and events."""
    if flight.expired or time.monotonic() >= flight.deadline:
        return f"no answer within {flight.timeout_s:g} s"
    if isinstance(exc, TimeoutError):
        return f"no connection within {MAX_CONNECT_S:g} s"
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, (OSError, http.client.HTTPException)) and str(exc):
        return f"probe error: {exc}"
    return f"probe error: {exc!r}"


def printable(text: str, limit: int = DETAIL_LIMIT) -> str:
    """Text fit for a log line and the status JSON: an engine's garbage answer can carry any byte
    (control characters, terminal escapes, bidi overrides), so everything but printable ASCII is
    escaped, and the text is trimmed to `limit` characters."""
    out = "".join(c if c.isascii() and c.isprintable() else c.encode("unicode_escape").decode()
                  for c in text)
    return out if len(out) <= limit else out[:limit - 3] + "..."


def parse_progress(text: str) -> Progress | None:
    """The token counter and running requests from Prometheus text, or None if absent."""
    sums = {"sglang:generation_tokens_total": 0.0, "sglang:num_running_reqs": 0.0}
    seen = set()
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in sums:
            try:
                sums[name] += float(line.rsplit(" ", 1)[1])
                seen.add(name)
            except (IndexError, ValueError):
                continue
    if "sglang:generation_tokens_total" not in seen:
        return None
    return Progress(sums["sglang:generation_tokens_total"], sums["sglang:num_running_reqs"])
