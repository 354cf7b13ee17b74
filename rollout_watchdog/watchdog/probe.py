"""Deep probes (HTTP GET of the health path) on a thread pool, so a hung engine never blocks the
daemon's main loop. Results come back through a queue plus a wake-up pipe the loop polls."""

from __future__ import annotations

import contextlib
import os
import queue
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import requests

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


class ProbeRunner:
    def __init__(self, max_workers: int) -> None:
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="probe")
        self.results: queue.SimpleQueue[ProbeResult] = queue.SimpleQueue()
        self.wake_r, self._wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self._wake_w, False)

    def submit(self, engine: str, probe_id: int, url: str, timeout_s: float) -> None:
        self._pool.submit(self._probe, engine, probe_id, url, timeout_s)

    def _probe(self, engine: str, probe_id: int, url: str, timeout_s: float) -> None:
        started = time.monotonic()
        try:
            response = requests.get(url, timeout=(min(timeout_s, MAX_CONNECT_S), timeout_s))
            ok = response.status_code == 200
            detail = f"HTTP {response.status_code}"
        except requests.Timeout:
            ok, detail = False, f"no answer within {timeout_s:g} s"
        except requests.ConnectionError as exc:
            ok, detail = False, f"connection failed: {_reason(exc)}"
        except Exception as exc:  # a probe must report, never die silently
            ok, detail = False, f"probe error: {exc}"
        self.results.put(ProbeResult(engine, probe_id, ok, detail, started, time.monotonic()))
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


def _reason(exc: Exception) -> str:
    text = str(exc)
    if "Connection refused" in text:
        return "connection refused"
    return text[:200]
