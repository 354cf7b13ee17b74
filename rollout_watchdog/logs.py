"""Process-wide logging set-up: readable text for people, one JSON object a line for collectors.

Context (engine id, incarnation, cause) is passed with ``extra=`` on each call, so that a log
pipeline can filter on it as fields rather than parse it out of the message.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from enum import Enum
from typing import Any

FORMATS = ("text", "json")

# Attributes every LogRecord has; anything else on a record came from ``extra=``.
_RECORD_ATTRS = frozenset(
    logging.LogRecord("", logging.INFO, "", 0, "", (), None).__dict__
) | {"message", "asctime", "taskName"}


def _extra_fields(record: logging.LogRecord) -> dict[str, Any]:
    """The ``extra=`` fields of a record, in the order they were given."""
    return {k: v for k, v in record.__dict__.items() if k not in _RECORD_ATTRS}


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


class _Handler(logging.StreamHandler):
    """Marks the handler setup_logging installed, so that a second call can replace it."""


def setup_logging(level: str = "info", fmt: str = "text") -> None:
    """Send every log record of the process to stderr in ``fmt`` ("text" or "json").

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
    handler = _Handler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    for old in root.handlers[:]:
        if isinstance(old, _Handler):
            root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(numeric)
