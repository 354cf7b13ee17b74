"""Events: what happened to which engine incarnation, and why. Kept in memory for `events`
followers and appended to a JSON-lines file for the record."""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Event:
    ts: float
    node_id: str
    engine: str | None
    incarnation: int | None
    kind: str
    from_: str | None = None
    to: str | None = None
    cause: str | None = None
    detail: str | None = None
    # Kind-specific fields beyond the contract's (a signal's name, a detection latency).
    extra: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        out = {"ts": self.ts, "node_id": self.node_id, "engine": self.engine,
               "incarnation": self.incarnation, "kind": self.kind, "from": self.from_,
               "to": self.to, "cause": self.cause, "detail": self.detail}
        if self.extra:
            out.update({k: v for k, v in self.extra.items() if k not in out})
        return out


class EventLog:
    """A bounded in-memory log with sequence numbers (seq of the first event is 1), mirrored to
    a file that rotates once at `max_file_bytes`. A failing disk is reported, never fatal."""

    def __init__(self, path: Path | None, capacity: int = 10000,
                 max_file_bytes: int = 20 * 1024 * 1024) -> None:
        self.path = path
        self.max_file_bytes = max_file_bytes
        self.capacity = capacity
        self._events: deque[tuple[int, Event]] = deque(maxlen=capacity)
        self.last_seq = 0
        self.write_errors = 0
        if path is not None and path.exists():
            with contextlib.suppress(OSError):
                path.chmod(0o600)  # a file an older version wrote world-readable

    def append(self, event: Event) -> int:
        self.last_seq += 1
        self._events.append((self.last_seq, event))
        self._write(event)
        return self.last_seq

    def since(self, seq: int, limit: int = 1000) -> list[tuple[int, Event]]:
        return [(s, e) for s, e in self._events if s > seq][:limit]

    def _write(self, event: Event) -> None:
        if self.path is None:
            return
        try:
            if self.path.exists() and self.path.stat().st_size > self.max_file_bytes:
                self.path.replace(self.path.with_suffix(self.path.suffix + ".1"))
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
            with open(fd, "a") as f:
                f.write(json.dumps(event.to_json()) + "\n")
        except OSError as exc:
            self.write_errors += 1
            if self.write_errors == 1:   # once: the metrics count the rest
                log.error("cannot write event log %s: %s (events stay in memory)", self.path,
                          exc.strerror or exc)

