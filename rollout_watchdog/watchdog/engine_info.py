"""Each engine's `tp_size` from its `/server_info`, read once per incarnation (DESIGN: an engine
whose config sets no `tp_size` takes "`tp_size` from its `/server_info`, else 1"), so that
`status` and the fleet view show it.

Off the probe path on purpose: SGLang answers `/server_info` from its scheduler, so a busy one
answers late, and a pause is acknowledged only once its probes are in; here a read waits on a
thread of its own, bounded by the engine's probe timeout, and the loop only looks at finished
ones. The first read follows the incarnation's first passing probe; a failed one is tried again
a health interval later. What was read is published as a `tp_size_read` event (`tp_size`, and
the engine's status with it), so that the coordinator's view has it at once: an engine adopted
by a restarted daemon, or one whose starting probe could not read it, is healthy already, and
no other event would carry it (pause events carry no status). Until then the refit reads
`/server_info` itself.
"""

from __future__ import annotations

import http.client
import json
import logging
import threading
import time
from collections.abc import Callable, Container, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from rollout_watchdog.common.server_info import READ_LIMIT, SERVER_INFO_PATH, tp_size_of
from rollout_watchdog.common.states import EngineState
from rollout_watchdog.watchdog.engine import EngineRuntime

log = logging.getLogger(__name__)


def read_tp_size(url: str, timeout_s: float) -> int:
    """GET the engine's /server_info, the whole exchange within `timeout_s`: its tp_size,
    else 1. Raises OSError (TimeoutError past the bound), HTTPException or ValueError."""
    deadline = time.monotonic() + timeout_s
    parts = urlsplit(url)
    kind = (http.client.HTTPSConnection if parts.scheme == "https"
            else http.client.HTTPConnection)
    conn = kind(parts.hostname or "127.0.0.1", parts.port, timeout=timeout_s)
    try:
        conn.request("GET", parts.path.rstrip("/") + SERVER_INFO_PATH)
        response = conn.getresponse()
        if response.status != 200:
            raise ValueError(f"HTTP {response.status}")
        body = b""
        while len(body) < READ_LIMIT:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no whole answer within {timeout_s:g} s")
            if conn.sock is not None:   # (each read bounded by what is left of the whole)
                conn.sock.settimeout(left)
            chunk = response.read1(READ_LIMIT - len(body))
            if not chunk:
                break
            body += chunk
        return tp_size_of(json.loads(body))
    finally:
        conn.close()


@dataclass
class _Read:
    """One read out, on a daemon thread of its own (a hung engine must not hold the daemon's
    exit): its result or error, once `done` is set."""

    engine_id: str
    incarnation: int
    done: threading.Event = field(default_factory=threading.Event)
    size: int | None = None
    error: Exception | None = None


class EngineInfo:
    """A participant of the daemon's loop: reads each healthy engine's tp_size when its config
    sets none (one read at a time: it is once per incarnation)."""

    def __init__(self, engines: Mapping[str, EngineRuntime],
                 emit: Callable[..., Any],
                 read: Callable[[str, float], int] = read_tp_size,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.engines = engines
        self._emit = emit   # (engine, kind, **fields): the daemon's publish point
        self._read = read
        self._clock = clock
        self._reading: _Read | None = None
        self._retry_at: dict[tuple[str, int], float] = {}

    def pollables(self) -> list[Any]:
        return []

    def handle(self, ready: Container[Any]) -> None:
        pass

    def after_save(self) -> None:
        pass

    def close(self) -> None:
        pass   # a read still out ends within its bound, on its daemon thread

    def next_deadline(self) -> float | None:
        """While a read is out, look again within a second (nothing wakes the loop for it)."""
        return self._clock() + 1.0 if self._reading is not None else None

    def tick(self, now: float) -> None:
        """Take a finished read; start the next one due (a healthy engine whose tp_size its
        starting probe could not read)."""
        if self._reading is not None:
            if not self._reading.done.is_set():
                return
            self._take(self._reading, now)
            self._reading = None
        for engine in self.engines.values():
            if (engine.tp_size is None and engine.state == EngineState.HEALTHY
                    and engine.cfg.url
                    and now >= self._retry_at.get((engine.id, engine.incarnation), 0.0)):
                self._start(engine)
                return

    def _start(self, engine: EngineRuntime) -> None:
        read = self._reading = _Read(engine.id, engine.incarnation)
        url, timeout_s = engine.cfg.url, engine.cfg.probe.health_timeout_s

        def run() -> None:
            try:
                read.size = self._read(url, timeout_s)
            except Exception as exc:
                read.error = exc
            finally:
                read.done.set()
        threading.Thread(target=run, name="engine-info", daemon=True).start()

    def _take(self, read: _Read, now: float) -> None:
        engine = self.engines.get(read.engine_id)
        if engine is None or engine.incarnation != read.incarnation:
            return   # gone, or relaunched meanwhile: the new one is read on its own
        key = (read.engine_id, read.incarnation)
        self._retry_at = {k: t for k, t in self._retry_at.items()   # (past incarnations out)
                          if k[0] != read.engine_id or k == key}
        if read.size is None:   # failed: tried again a health interval later
            self._retry_at[key] = now + engine.cfg.probe.health_interval_s
            log.debug("reading /server_info failed: %s", read.error,
                      extra={"engine": read.engine_id})
            return
        self._retry_at.pop(key, None)
        engine.server_tp_size = (read.incarnation, read.size)
        self._emit(engine, "tp_size_read", detail=f"tp_size {read.size} from /server_info",
                   tp_size=read.size)
