"""Structured logging: JSON lines with extra fields as keys, and the readable text format."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from enum import Enum

import pytest

from rollout_watchdog.logs import setup_logging

LOGGER = "rollout_watchdog.watchdog"


class Cause(str, Enum):
    EXITED = "exited"


@pytest.fixture(autouse=True)
def _restore_root_logger() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def _lines(capsys: pytest.CaptureFixture[str]) -> list[str]:
    return capsys.readouterr().err.splitlines()


def test_json_lines(capsys: pytest.CaptureFixture[str]) -> None:
    setup_logging("info", "json")
    before = time.time()
    log = logging.getLogger(LOGGER)
    log.info("restarting %s", "e0", extra={"engine": "e0", "incarnation": 3})
    log.debug("not shown at info")
    log.warning("multi\nline", extra={"cause": Cause.EXITED, "detail": {"code": -9}})
    lines = _lines(capsys)
    assert len(lines) == 2
    first = json.loads(lines[0])
    assert first == {
        "ts": first["ts"],
        "level": "info",
        "logger": LOGGER,
        "msg": "restarting e0",
        "engine": "e0",
        "incarnation": 3,
    }
    assert isinstance(first["ts"], float) and before <= first["ts"] <= time.time()
    second = json.loads(lines[1])
    assert second["msg"] == "multi\nline"
    assert second["level"] == "warning"
    assert second["cause"] == "exited"
    assert second["detail"] == {"code": -9}


def test_json_exception_and_unserializable_extra(capsys: pytest.CaptureFixture[str]) -> None:
    setup_logging("debug", "json")
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        logging.getLogger(LOGGER).exception("probe crashed", extra={"obj": object()})
    (line,) = _lines(capsys)
    entry = json.loads(line)
    assert entry["level"] == "error"
    assert "RuntimeError: boom" in entry["exc"] and "Traceback" in entry["exc"]
    assert entry["obj"].startswith("<object object")


def test_text_format(capsys: pytest.CaptureFixture[str]) -> None:
    setup_logging("info", "text")
    extra = {"engine": "e0", "incarnation": 3, "cause": Cause.EXITED, "detail": "exit code 1"}
    logging.getLogger(LOGGER).info("restarting", extra=extra)
    (line,) = _lines(capsys)
    assert re.fullmatch(
        r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} INFO rollout_watchdog\.watchdog: restarting"
        r' engine=e0 incarnation=3 cause=exited detail="exit code 1"',
        line,
    ), line


def test_text_exception(capsys: pytest.CaptureFixture[str]) -> None:
    setup_logging("info", "text")
    try:
        raise ValueError("bad")
    except ValueError:
        logging.getLogger(LOGGER).exception("failed")
    err = capsys.readouterr().err
    assert " ERROR rollout_watchdog.watchdog: failed\nTraceback" in err
    assert err.rstrip().endswith("ValueError: bad")


def test_reconfigure_replaces_handler(capsys: pytest.CaptureFixture[str]) -> None:
    setup_logging("info", "text")
    setup_logging("warning", "json")
    log = logging.getLogger(LOGGER)
    log.info("hidden")
    log.warning("shown")
    (line,) = _lines(capsys)
    assert json.loads(line)["msg"] == "shown"


@pytest.mark.parametrize(("level", "fmt"), [("loud", "text"), ("info", "xml")])
def test_bad_arguments(level: str, fmt: str) -> None:
    with pytest.raises(ValueError):
        setup_logging(level, fmt)


def test_fresh_process_writes_json_to_stderr() -> None:
    """The root logger of a process that configured nothing else: stdout stays clean."""
    code = (
        "import logging; from rollout_watchdog.logs import setup_logging; "
        "setup_logging('info', 'json'); "
        "logging.getLogger('x').info('hello', extra={'engine': 'e1'})"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert proc.stdout == ""
    entry = json.loads(proc.stderr)
    assert (entry["logger"], entry["msg"], entry["engine"]) == ("x", "hello", "e1")
