"""Rate limits on the logs of input that is dropped and counted (bad frames, refused messages,
replies that cannot be delivered): a flood must not flood the log too, yet the log still shows
that it goes on and how big it grew."""

from __future__ import annotations

import logging
import threading


def worth_logging(count: int) -> bool:
    """Whether the `count`th occurrence (1-based) of one kind of drop is logged: the first 10,
    then the 16th, 32nd, 64th... (the count is in each line)."""
    return count <= 10 or count & (count - 1) == 0


class DropCount:
    """How many frames one side dropped (undecodable, or of a kind it never takes), for its
    users to read, with each drop logged at `level`, rate-limited. Thread-safe: a FleetClient's
    threads share one."""

    def __init__(self, logger: logging.Logger, what: str, level: int = logging.DEBUG) -> None:
        self._log, self._what, self._level = logger, what, level
        self._lock = threading.Lock()
        self._count = 0

    @property
    def count(self) -> int:
        return self._count

    def drop(self, why: str) -> None:
        """Count one drop; `why` goes in the log line."""
        with self._lock:
            self._count += 1
            count = self._count
        if worth_logging(count):
            self._log.log(self._level, "dropped %s #%d: %s", self._what, count, why)
