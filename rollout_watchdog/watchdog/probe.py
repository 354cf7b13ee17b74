"""Deep probes (HTTP GET of the health path) on a thread pool, so a hung engine never blocks the
daemon's main loop. Results come back through a queue plus a wake-up pipe the loop polls."""

from __future__ import annotations

import contextlib
import http.client
import os
import queue
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from urllib.parse import urlsplit

# A probe request ends within MAX_CONNECT_S + its timeout (connect, then no byte for the timeout).
MAX_CONNECT_S = 5.0


@dataclass(frozen=True)
class ProbeResult:
    engine: str
    probe_id: int
    ok: bool
    detail: str
    started: float     # time.monotonic()
    finished: float
    progress: Progress | None = None   # from the progress probe, when there is one


@dataclass(frozen=True)
class Progress:
    """What the engine's Prometheus text says about generation."""

    tokens: float      # sglang:generation_tokens_total, summed over its series
    running: float     # sglang:num_running_reqs, summed


class ProbeRunner:
    def __init__(self, max_workers: int) -> None:
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="probe")
        self.results: queue.SimpleQueue[ProbeResult] = queue.SimpleQueue()
        self.wake_r, self._wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self._wake_w, False)

    def submit(self, engine: str, probe_id: int, url: str, timeout_s: float,
               progress_url: str | None = None) -> None:
        self._pool.submit(self._probe, engine, probe_id, url, timeout_s, progress_url)

    def _probe(self, engine: str, probe_id: int, url: str, timeout_s: float,
               progress_url: str | None) -> None:
        started = time.monotonic()
        progress = None
        try:
            if progress_url:  # first: /metrics answers even when the scheduler is stuck
                progress = read_progress(progress_url, timeout_s)
            ok, detail = http_get_ok(url, timeout_s)
        except Exception as exc:  # a probe always reports, or its pause is never acknowledged
            ok, detail = False, f"probe error: {exc!r:.200}"
        self.results.put(ProbeResult(engine, probe_id, ok, detail, started, time.monotonic(),
                                     progress))
        # A full pipe means the loop is already going to wake up.
        with contextlib.suppress(BlockingIOError):
            os.write(self._wake_w, b"!")

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

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        os.close(self.wake_r)
        os.close(self._wake_w)


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


def http_get(url: str, timeout_s: float, read_limit: int = 0) -> tuple[int, bytes]:
    """GET the URL: (status, up to read_limit bytes of body). Plain http.client: a probe every
    few seconds per engine is the daemon's main cost, and requests costs several times more CPU
    per call. Bounded by MAX_CONNECT_S to connect plus timeout_s without a byte; raises
    OSError / http.client.HTTPException."""
    parts = urlsplit(url)
    connection = (http.client.HTTPSConnection if parts.scheme == "https"
                  else http.client.HTTPConnection)
    conn = connection(parts.hostname or "127.0.0.1", parts.port,
                      timeout=min(timeout_s, MAX_CONNECT_S))
    try:
        conn.connect()
        assert conn.sock is not None
        conn.sock.settimeout(timeout_s)
        conn.request("GET", parts.path or "/", headers={"Connection": "close"})
        response = conn.getresponse()
        return response.status, response.read(read_limit) if read_limit else b""
    finally:
        conn.close()


def read_progress(url: str, timeout_s: float, limit: int = 4 * 1024 * 1024) -> Progress | None:
    """GET the engine's metrics (bounded in time and size); None if they say nothing."""
    try:
        status, body = http_get(url, timeout_s, limit)
    except (OSError, http.client.HTTPException):
        return None
    return parse_progress(body.decode(errors="replace")) if status == 200 else None


def http_get_ok(url: str, timeout_s: float) -> tuple[bool, str]:
    """The deep probe: (True, "HTTP 200") for a 200, else (False, why)."""
    try:
        status, _ = http_get(url, timeout_s)
        return status == 200, f"HTTP {status}"
    except TimeoutError:
        return False, f"no answer within {timeout_s:g} s"
    except ConnectionRefusedError:
        return False, "connection refused"
    except (OSError, http.client.HTTPException) as exc:
        return False, f"probe error: {exc!s:.200}"
