"""Structured logging: JSON lines with extra fields as keys, and the readable text format."""

from __future__ import annotations

import io
import json
import logging
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from enum import Enum
from pathlib import Path
from typing import Any

import pytest

from rollout_watchdog.logs import QueueingHandler, TextFormatter, dropped_log_lines, setup_logging

LOGGER = "rollout_watchdog.watchdog"


class Cause(str, Enum):
    EXITED = "exited"


@pytest.fixture(autouse=True)
def _restore_root_logger() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    for handler in root.handlers:
        if handler not in handlers:
            handler.close()  # ends its writer thread
    root.handlers[:] = handlers
    root.setLevel(level)


def _err(capsys: pytest.CaptureFixture[str]) -> str:
    """What reached stderr, once the log writer thread has written every queued line."""
    for handler in logging.getLogger().handlers:
        handler.flush()
    return capsys.readouterr().err


def _lines(capsys: pytest.CaptureFixture[str]) -> list[str]:
    return _err(capsys).splitlines()


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
    err = _err(capsys)
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


# ------------------------------------------------------------------ never blocking the caller


class _StalledStream(io.StringIO):
    """A stderr whose reader stalls: write() blocks until `release` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = threading.Event()
        self.release = threading.Event()

    def write(self, text: str) -> int:
        self.entered.set()
        assert self.release.wait(30), "the test never released the stream"
        return super().write(text)


def test_a_stalled_stream_drops_lines_and_reports_how_many() -> None:
    stream = _StalledStream()
    handler = QueueingHandler(stream, capacity=10)
    handler.setFormatter(TextFormatter())
    log = logging.getLogger("test.stalled")
    log.propagate = False
    log.addHandler(handler)
    try:
        log.warning("first")
        assert stream.entered.wait(10), "the writer never wrote"
        before = dropped_log_lines()
        started = time.monotonic()
        for i in range(15):  # the writer is stuck: 10 wait, 5 are dropped
            log.warning("n%d", i)
        assert time.monotonic() - started < 5  # the caller was never blocked
        assert dropped_log_lines() - before == 5
        stream.release.set()
        assert handler.drain(10)
        log.warning("after")
        assert handler.drain(10)
    finally:
        stream.release.set()
        log.removeHandler(handler)
        handler.close()
    messages = [line.split(": ", 1)[1] for line in stream.getvalue().splitlines()]
    assert messages == ["first", *(f"n{i}" for i in range(10)),
                        "5 log lines dropped: stderr is not read fast enough dropped_lines=5",
                        "after"]


def test_a_process_whose_stderr_nobody_reads_still_finishes(tmp_path: Path) -> None:
    """The daemon hung in a pipe write after ~490 logged commands when journald stalled."""
    code = (
        "import logging, time\n"
        "from rollout_watchdog.logs import setup_logging, dropped_log_lines\n"
        "setup_logging('info', 'text')\n"
        "log = logging.getLogger('x')\n"
        "started = time.monotonic()\n"
        "for i in range(100_000):\n"
        "    log.info('line %d of a log nobody reads', i, extra={'engine': 'e0'})\n"
        "print(dropped_log_lines(), time.monotonic() - started, flush=True)\n"
    )
    with (tmp_path / "stdout").open("w") as stdout:
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=stdout,
                                stderr=subprocess.PIPE)  # never read
        try:
            status = proc.wait(timeout=60)
        finally:
            proc.kill()
            assert proc.stderr is not None
            proc.stderr.close()
    assert status == 0
    dropped, seconds = (tmp_path / "stdout").read_text().split()
    assert int(dropped) > 0
    assert float(seconds) < 30  # the logging loop itself was never blocked


def test_queued_lines_are_written_before_exit(tmp_path: Path) -> None:
    code = (
        "import logging\n"
        "from rollout_watchdog.logs import setup_logging, dropped_log_lines\n"
        "setup_logging('info', 'json')\n"
        "for i in range(5000):\n"
        "    logging.getLogger('x').info('line %d', i)\n"
        "print(dropped_log_lines())\n"
    )
    with (tmp_path / "stderr").open("w") as stderr:
        proc = subprocess.run([sys.executable, "-c", code], stdout=subprocess.PIPE,
                              stderr=stderr, text=True, timeout=60)
    assert (proc.returncode, proc.stdout) == (0, "0\n")
    lines = (tmp_path / "stderr").read_text().splitlines()
    assert [json.loads(line)["msg"] for line in lines] == [f"line {i}" for i in range(5000)]


def test_a_library_s_private_record_attributes_stay_out(
        capsys: pytest.CaptureFixture[str]) -> None:
    """Ray's record factory adds `_ray_timestamp_ns` to every record in a process that
    imported ray (the coordinator actor): not a field of ours, in either format."""
    previous = logging.getLogRecordFactory()

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = previous(*args, **kwargs)
        record._ray_timestamp_ns = 1   # type: ignore[attr-defined]
        return record

    logging.setLogRecordFactory(factory)
    try:
        setup_logging("info", "json")
        logging.getLogger(LOGGER).info("json", extra={"engine": "e0"})
        assert json.loads(_lines(capsys)[0]).keys() == {"ts", "level", "logger", "msg", "engine"}
        setup_logging("info", "text")
        logging.getLogger(LOGGER).info("text", extra={"engine": "e0"})
        assert _lines(capsys)[0].endswith(" text engine=e0")
    finally:
        logging.setLogRecordFactory(previous)
