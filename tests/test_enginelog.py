"""Engine output: journald's stream protocol, or a log file that rotation keeps bounded
(one engine wrote 7.8 GiB in 20 s into an unbounded state_dir/logs/ID.log)."""

from __future__ import annotations

import logging
import os
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from rollout_watchdog.config import NodeConfig
from rollout_watchdog.watchdog.enginelog import (
    engine_log_path,
    open_engine_output,
    rotate_if_needed,
)

HEADER = b"rollout-watchdog/e0\n\n6\n0\n0\n0\n0\n"
RATE = 1 << 20  # bytes per second the writing engine keeps to
# An engine writing numbered 100-byte lines, in chunks of 64, at RATE bytes/s. Starved by a
# loaded host, it does not catch up in a burst: it is never more than 50 ms behind its pace.
WRITER = f"""
import os, time
start, written, n = time.monotonic(), 0, 0
while True:
    chunk = b"".join(b"line %09d %s\\n" % (n + i, b"x" * 84) for i in range(64))
    n += 64
    os.write(1, chunk)
    written += len(chunk)
    ahead = written / {RATE} - (time.monotonic() - start)
    if ahead > 0:
        time.sleep(ahead)
    elif ahead < -0.05:
        start = time.monotonic() - written / {RATE} - 0.05
"""


def node(tmp_path: Path, mode: str = "file") -> NodeConfig:
    return NodeConfig(node_id="n", engines=(), state_dir=str(tmp_path / "state"),
                      engine_log=mode)


def wait_for(condition: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def disk_use(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.iterdir())


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def journal(tmp_path: Path) -> Iterator[tuple[str, socket.socket]]:
    """A stand-in for journald's stream socket: a real AF_UNIX listener."""
    path = str(tmp_path / "journal.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(4)
    listener.settimeout(30)
    yield path, listener
    listener.close()


def received(listener: socket.socket) -> bytes:
    """Everything one connection to the listener sent, up to its end (bounded wait)."""
    conn, _ = listener.accept()
    conn.settimeout(30)
    data = b""
    with conn:
        while chunk := conn.recv(65536):
            data += chunk
    return data


# ------------------------------------------------------------------ the file


def test_rotation_keeps_disk_use_bounded_while_the_engine_writes(tmp_path: Path) -> None:
    max_bytes, backups = 256 * 1024, 2
    fd = open_engine_output(node(tmp_path), "e0")
    engine = subprocess.Popen([sys.executable, "-c", WRITER], stdout=fd, stderr=fd)
    os.close(fd)
    path = engine_log_path(tmp_path / "state", "e0")
    rotations, peak = 0, 0
    deadline = time.monotonic() + 60
    try:
        while rotations < 6:  # the daemon's worker thread does this periodically
            assert time.monotonic() < deadline, f"only {rotations} rotations"
            rotations += rotate_if_needed(path, max_bytes, backups)
            peak = max(peak, disk_use(path.parent))
            time.sleep(0.01)
        last_copied = int(Path(f"{path}.1").read_bytes().splitlines()[-1].split()[1])
        # The engine goes on writing at the start of the truncated file, not at its old offset.
        wait_for(lambda: path.stat().st_size > 1000)
        fresh = path.read_bytes()
    finally:
        engine.kill()
        engine.wait(30)
    # A copy is at most max_bytes; the live file exceeds it by what one 10 ms period adds,
    # give or take a stall of this thread on a loaded host (half a second is allowed).
    assert peak <= (backups + 1) * max_bytes + RATE // 2, peak
    assert sorted(p.name for p in path.parent.iterdir()) == ["e0.log", "e0.log.1", "e0.log.2"]
    assert all(Path(f"{path}.{i}").stat().st_size <= max_bytes for i in (1, 2))
    assert b"\0" not in fresh  # no hole where the old content was
    assert fresh.startswith(b"line ")
    assert int(fresh.split()[1]) > last_copied
    assert {mode(p) for p in path.parent.iterdir()} == {0o640}


def test_the_copy_is_the_tail_and_backups_shift(tmp_path: Path) -> None:
    path = tmp_path / "e0.log"
    path.write_bytes(b"old backup\n")
    Path(f"{path}.1").write_bytes(b"first backup\n")
    content = os.urandom(300 * 1024)
    path.write_bytes(content)
    assert rotate_if_needed(path, 100 * 1024, 3)
    assert Path(f"{path}.1").read_bytes() == content[-100 * 1024:]
    assert Path(f"{path}.2").read_bytes() == b"first backup\n"
    assert not Path(f"{path}.3").exists()
    assert path.stat().st_size == 0


def test_no_rotation_below_the_limit_or_without_a_file(tmp_path: Path) -> None:
    path = tmp_path / "e0.log"
    assert not rotate_if_needed(path, 1024, 2)
    path.write_bytes(b"x" * 1024)
    assert not rotate_if_needed(path, 1024, 2)
    assert path.stat().st_size == 1024 and not Path(f"{path}.1").exists()


def test_zero_backups_truncates_without_a_copy(tmp_path: Path) -> None:
    path = tmp_path / "e0.log"
    path.write_bytes(b"x" * 2048)
    assert rotate_if_needed(path, 1024, 0)
    assert [p.name for p in tmp_path.iterdir()] == ["e0.log"]
    assert path.stat().st_size == 0


def test_a_full_disk_returns_false_and_frees_the_space(tmp_path: Path) -> None:
    """A real EFBIG from the kernel (RLIMIT_FSIZE) stands in for ENOSPC: no exception, no
    partial copy left behind, older backups untouched, and the live file truncated so that
    an engine's output cannot keep the disk of the state file full."""
    path = tmp_path / "e0.log"
    path.write_bytes(b"y" * 200 * 1024)
    Path(f"{path}.1").write_bytes(b"first backup\n")
    code = (
        "import resource, signal, sys\n"
        "from rollout_watchdog.watchdog.enginelog import rotate_if_needed\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, resource.RLIM_INFINITY))\n"
        f"print(rotate_if_needed({str(path)!r}, 100 * 1024, 2))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60)
    assert (result.returncode, result.stdout) == (0, "False\n"), result.stderr
    assert "Traceback" not in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e0.log", "e0.log.1"]
    assert Path(f"{path}.1").read_bytes() == b"first backup\n"
    assert path.stat().st_size == 0


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes whatever the directory's mode")
def test_an_unwritable_directory_returns_false_and_keeps_the_file(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "logs" / "e0.log"
    path.parent.mkdir()
    path.write_bytes(b"z" * 2048)
    path.parent.chmod(0o500)
    try:
        assert not rotate_if_needed(path, 1024, 2)
    finally:
        path.parent.chmod(0o700)
    assert path.stat().st_size == 2048
    assert "cannot rotate" in caplog.text


def test_the_log_file_is_0640_and_appended_to(tmp_path: Path) -> None:
    path = engine_log_path(tmp_path / "state", "e0")
    path.parent.mkdir(parents=True)
    path.write_bytes(b"before\n")
    path.chmod(0o644)
    fd = open_engine_output(node(tmp_path), "e0")
    try:
        assert mode(path) == 0o640
        os.lseek(fd, 0, os.SEEK_SET)  # O_APPEND writes at the end whatever the offset
        os.write(fd, b"after\n")
    finally:
        os.close(fd)
    assert path.read_bytes() == b"before\nafter\n"


# ------------------------------------------------------------------ journald


def test_journal_stream_gets_the_header_then_the_engines_output(
        tmp_path: Path, journal: tuple[str, socket.socket]) -> None:
    socket_path, listener = journal
    fd = open_engine_output(node(tmp_path, "journal"), "e0", journal_socket=socket_path)
    assert os.get_blocking(fd)  # an engine's stdout must not be non-blocking
    code = "import sys; print('hello from e0', flush=True); print('oops', file=sys.stderr)"
    subprocess.run([sys.executable, "-c", code], stdout=fd, stderr=fd, timeout=60, check=True)
    os.close(fd)
    assert received(listener) == HEADER + b"hello from e0\noops\n"
    assert not (tmp_path / "state" / "logs").exists()


def test_journal_output_outlives_the_opener(tmp_path: Path,
                                            journal: tuple[str, socket.socket]) -> None:
    """The engine holds the stream: the daemon closing its copy (or dying) ends nothing."""
    socket_path, listener = journal
    fd = open_engine_output(node(tmp_path, "journal"), "e0", journal_socket=socket_path)
    engine = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.readline(); "
                               "print('still here')"], stdin=subprocess.PIPE, stdout=fd)
    os.close(fd)
    assert engine.stdin is not None
    engine.stdin.close()  # lets it print, after the opener's copy is gone
    assert engine.wait(30) == 0
    assert received(listener) == HEADER + b"still here\n"


def test_journal_falls_back_to_the_file_when_the_socket_is_absent(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    config = node(tmp_path, "journal")
    with caplog.at_level(logging.WARNING):
        fd = open_engine_output(config, "e0", journal_socket=str(tmp_path / "absent.sock"))
    try:
        os.write(fd, b"to the file\n")
    finally:
        os.close(fd)
    assert engine_log_path(config.state_dir, "e0").read_bytes() == b"to the file\n"
    assert "journald" in caplog.text


@pytest.mark.parametrize(("under_systemd", "to_journal"), [(True, True), (False, False)])
def test_auto_uses_the_journal_only_under_systemd(
        tmp_path: Path, journal: tuple[str, socket.socket], monkeypatch: pytest.MonkeyPatch,
        under_systemd: bool, to_journal: bool) -> None:
    socket_path, listener = journal
    if under_systemd:
        monkeypatch.setenv("INVOCATION_ID", "0123456789abcdef0123456789abcdef")
    else:
        monkeypatch.delenv("INVOCATION_ID", raising=False)
    config = node(tmp_path, "auto")
    fd = open_engine_output(config, "e0", journal_socket=socket_path)
    os.write(fd, b"hello\n")
    os.close(fd)
    log_file = engine_log_path(config.state_dir, "e0")
    if to_journal:
        assert received(listener) == HEADER + b"hello\n"
        assert not log_file.exists()
    else:
        assert log_file.read_bytes() == b"hello\n"


def test_file_mode_ignores_journald(tmp_path: Path,
                                    journal: tuple[str, socket.socket],
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    socket_path, listener = journal
    monkeypatch.setenv("INVOCATION_ID", "0123456789abcdef0123456789abcdef")
    config = node(tmp_path, "file")
    os.close(open_engine_output(config, "e0", journal_socket=socket_path))
    assert engine_log_path(config.state_dir, "e0").exists()
    listener.settimeout(0)
    with pytest.raises(BlockingIOError):  # nobody connected
        listener.accept()
