"""Process-wide logging set-up: readable text for people, one JSON object a line for collectors.

Context (engine id, incarnation, cause) is passed with ``extra=`` on each call, so that a log
pipeline can filter on it as fields rather than parse it out of the message.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import sys
import threading
import time
from collections import deque
from enum import Enum
from typing import Any, TextIO

FORMATS = ("text", "json")
# Bound on waiting for queued log lines to be written, at exit or when the handler is replaced.
EXIT_DRAIN_S = 2.0

# Attributes every LogRecord has; anything else on a record came from ``extra=``.
_RECORD_ATTRS = frozenset(
    logging.LogRecord("", logging.INFO, "", 0, "", (), None).__dict__
) | {"message", "asctime", "taskName"}


def _extra_fields(record: logging.LogRecord) -> dict[str, Any]:
    """The ``extra=`` fields of a record, in the order they were given. Private attributes
    (a leading underscore) are left out: libraries add their own to every record (Ray's log
    record factory adds ``_ray_timestamp_ns`` in any process that imported ray)."""
    return {k: v for k, v in record.__dict__.items()
            if k not in _RECORD_ATTRS and not k.startswith("_")}


class JsonFormatter(logging.Formatter):
    """``{"ts", "level", "logger", "msg", <extra fields>..., "exc"?}`` on a single line."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = _extra_fields(record)
        # The base fields win over an ``extra`` of the same name, so every line has them.
        entry.update(
            ts=record.created,
            level=record.levelname.lower(),
            logger=record.name,
            msg=record.getMessage(),
        )
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            entry["exc"] = record.exc_text
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        return json.dumps(entry, default=str, ensure_ascii=False)


def _text_value(value: Any) -> str:
    """A value as it reads in ``key=value``: bare when unambiguous, JSON-quoted otherwise.

    Enum members (states, causes) read as their value, as they do in the JSON format.
    """
    text = str(value.value if isinstance(value, Enum) else value)
    if not text or any(c.isspace() or c in '="' for c in text):
        return json.dumps(text, ensure_ascii=False)
    return text


class TextFormatter(logging.Formatter):
    """``2026-11-29 15:00:00.123 INFO logger: msg key=value ...`` in local time."""

    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record.created))
        millis = int(record.created * 1000) % 1000
        line = f"{stamp}.{millis:03d} {record.levelname} {record.name}: {record.getMessage()}"
        fields = _extra_fields(record)
        if fields:
            line += " " + " ".join(f"{k}={_text_value(v)}" for k, v in fields.items())
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        elif record.exc_text:
            line += "\n" + record.exc_text
        if record.stack_info:
            line += "\n" + self.formatStack(record.stack_info)
        return line


def dropped_log_lines() -> int:
    """Log lines dropped since the process started because stderr was not read fast enough."""
    return _dropped.value


class _Counter:
    """A process-wide count, safe to bump from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.value = 0

    def add(self, n: int) -> None:
        with self._lock:
            self.value += n


_dropped = _Counter()


class QueueingHandler(logging.Handler):
    """Formats a record on the caller's thread and queues the line; a writer thread writes it.

    A log call therefore never blocks on a stalled reader of stderr (journald, a log shipper):
    when `capacity` lines wait, new ones are dropped and counted (dropped_log_lines()), and
    the next line that fits is preceded by a warning that says how many were lost. Writes go
    straight to the file descriptor where there is one, so that a writer stuck in a pipe holds
    no lock of sys.stderr that the interpreter's exit would wait for.
    """

    BATCH = 256  # lines per write; with capacity, bounds the memory held

    def __init__(self, stream: TextIO, capacity: int = 10_000) -> None:
        super().__init__()
        self.stream = stream
        self.capacity = capacity
        self._fd = _fileno(stream)
        self._cond = threading.Condition()
        self._lines: deque[str] = deque()
        self._writing = False  # the writer holds lines it has not written yet
        self._closed = False
        self._unreported = 0  # dropped since the last line that got through
        self._thread = threading.Thread(target=self._run, name="log-writer", daemon=True)
        self._thread.start()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record)
        except Exception:  # noqa: BLE001 - a bad record must not break the caller
            self.handleError(record)
            return
        with self._cond:
            if len(self._lines) >= self.capacity or self._closed:
                self._unreported += 1
                _dropped.add(1)
                return
            if self._unreported:  # may go one over capacity: the count must get through
                self._lines.append(self._drop_notice(self._unreported))
                self._unreported = 0
            self._lines.append(line)
            self._cond.notify()

    def _drop_notice(self, count: int) -> str:
        record = logging.makeLogRecord({
            "name": __name__, "levelno": logging.WARNING, "levelname": "WARNING",
            "msg": "%d log lines dropped: stderr is not read fast enough", "args": (count,),
            "dropped_lines": count})
        return self.format(record)

    def drain(self, timeout_s: float = EXIT_DRAIN_S) -> bool:
        """Wait, at most `timeout_s`, until every queued line is written; False if some are
        not. Returns at once after close(), which has already waited its turn."""
        with self._cond:
            return self._cond.wait_for(
                lambda: self._closed or (not self._lines and not self._writing), timeout_s)

    def flush(self) -> None:
        self.drain()

    def close(self) -> None:
        """Write what is queued (bounded wait), then stop the writer; lines still queued
        are dropped and counted."""
        self.drain()
        with self._cond:
            if not self._closed:
                _dropped.add(len(self._lines))
                self._lines.clear()
                self._closed = True
                self._cond.notify_all()
        super().close()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._lines or self._closed)
                if self._closed:
                    return
                batch = [self._lines.popleft()
                         for _ in range(min(self.BATCH, len(self._lines)))]
                self._writing = True
            try:
                self._write("".join(line + "\n" for line in batch))
            except (OSError, ValueError):  # stderr closed or gone: nobody to tell
                _dropped.add(len(batch))
            with self._cond:
                self._writing = False
                self._cond.notify_all()

    def _write(self, text: str) -> None:
        if self._fd is None:
            self.stream.write(text)
            self.stream.flush()
            return
        data = text.encode("utf-8", "backslashreplace")
        while data:
            data = data[os.write(self._fd, data):]


def _fileno(stream: TextIO) -> int | None:
    """The file descriptor under a stream, or None (pytest's capture, an io.StringIO)."""
    try:
        return stream.fileno()
    except (AttributeError, OSError, ValueError):
        return None


def _close_at_exit() -> None:
    """Write the queued lines before the process ends, waiting at most EXIT_DRAIN_S for a
    stalled reader (logging's own shutdown, which runs next, then returns at once)."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, QueueingHandler):
            handler.close()


def setup_logging(level: str = "info", fmt: str = "text") -> None:
    """Send every log record of the process to stderr in ``fmt`` ("text" or "json"), through
    a QueueingHandler, so that logging never blocks the caller.

    Replaces the handler an earlier call installed, so calling it again (tests, a CLI that
    re-parses its options) reconfigures instead of duplicating lines; handlers installed by
    others (pytest's capture, say) are left alone. Raises ValueError for an unknown
    level or format, which the CLI turns into a usage error.
    """
    if fmt not in FORMATS:
        raise ValueError(f"unknown log format {fmt!r}; expected one of {', '.join(FORMATS)}")
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"unknown log level {level!r}")
    handler = QueueingHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    for old in root.handlers[:]:
        if isinstance(old, QueueingHandler):
            root.removeHandler(old)
            old.close()
    root.addHandler(handler)
    root.setLevel(numeric)


atexit.register(_close_at_exit)
