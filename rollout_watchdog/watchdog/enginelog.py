"""Where an engine's stdout and stderr go: journald, or a size-bounded file under state_dir.

An engine can write gigabytes of output (7.8 GiB in 20 s was seen), which would fill the disk
the state file lives on. Under systemd the output goes to journald, whose own limits apply;
otherwise to `state_dir/logs/ID.log`, which `rotate_if_needed` keeps bounded. Either way the
engine holds the file descriptor, so its output survives a daemon restart.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import queue
import socket
import threading
from pathlib import Path

from rollout_watchdog.config import NodeConfig

log = logging.getLogger(__name__)

JOURNAL_STREAM_SOCKET = "/run/systemd/journal/stdout"
# Bound on connecting to journald and sending the stream header (its backlog may be full).
JOURNAL_CONNECT_TIMEOUT_S = 1.0
LOG_MODE = 0o640
# Errors that mean "no room": the copy is given up and the live file truncated anyway, so that
# an engine's output cannot keep the disk of the state file full.
_NO_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
_COPY_CHUNK = 1 << 20


def engine_log_path(state_dir: str | Path, engine_id: str) -> Path:
    """The log file of an engine when its output goes to a file."""
    return Path(state_dir) / "logs" / f"{engine_id}.log"


def _journal_wanted(mode: str, socket_path: str) -> bool:
    """Whether `engine_log = mode` asks for journald here: "auto" means running as a systemd
    service (which sets INVOCATION_ID) with journald's stream socket present."""
    if mode == "auto":
        return "INVOCATION_ID" in os.environ and os.path.exists(socket_path)
    return mode == "journal"


def open_engine_output(config: NodeConfig, engine_id: str, *,
                       journal_socket: str = JOURNAL_STREAM_SOCKET) -> int:
    """A file descriptor to give the engine as stdout and stderr; the caller closes its own
    copy once the engine is started.

    journald's stream socket when `config.engine_log` asks for it, falling back (with a
    warning) to the log file if journald cannot be reached. Raises OSError only when the
    log file cannot be opened for another reason than a full disk (a misconfigured
    state_dir): on a full disk the output goes to /dev/null, so the engine still starts.
    """
    if _journal_wanted(config.engine_log, journal_socket):
        try:
            return _connect_journal(journal_socket, f"rollout-watchdog/{engine_id}")
        except OSError as exc:
            log.warning("cannot connect to journald, engine output goes to its log file: %s",
                        exc, extra={"engine": engine_id, "socket": journal_socket})
    path = engine_log_path(config.state_dir, engine_id)
    try:
        return _open_log_file(path)
    except OSError as exc:
        if exc.errno not in _NO_ROOM:
            raise
        log.error("cannot create the engine log, its output is discarded: %s", exc,
                  extra={"engine": engine_id, "path": str(path)})
        return os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)


def _open_log_file(path: Path) -> int:
    """`path` for appending (so a truncation by rotate_if_needed moves the writer back to
    the start), mode 0640 whatever the umask or an older file said."""
    path.parent.mkdir(mode=0o750, parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW,
                 LOG_MODE)
    try:
        os.fchmod(fd, LOG_MODE)
    except OSError:
        os.close(fd)
        raise
    return fd


def _connect_journal(socket_path: str, identifier: str) -> int:
    """A stream connection to journald with the header systemd-cat sends: identifier, unit id
    (empty), priority 6 (info), level prefix 0, then no forwarding to syslog, kmsg or console.
    The returned descriptor is blocking, as an engine's stdout must be."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(JOURNAL_CONNECT_TIMEOUT_S)
        sock.connect(socket_path)
        sock.shutdown(socket.SHUT_RD)
        sock.sendall(f"{identifier}\n\n6\n0\n0\n0\n0\n".encode())
        sock.setblocking(True)
    except OSError:
        sock.close()
        raise
    return sock.detach()


def rotate_if_needed(path: str | Path, max_bytes: int, backups: int) -> bool:
    """Rotate `path` when it is over `max_bytes`; return whether it was rotated. Never raises.

    copytruncate, since the engine keeps its O_APPEND descriptor: the last `max_bytes` are
    copied to ID.log.1 (after ID.log.1..N-1 move up one, the oldest dropped), then the file
    is truncated to 0 and the engine's next write lands at its start. Lines written between
    the copy and the truncation are lost, as with logrotate. Blocking file I/O: call it from
    a worker thread, not the daemon loop. Disk use stays near (backups + 1) x max_bytes.
    """
    path = Path(path)
    try:
        size = path.stat().st_size
    except OSError:
        return False  # no log (yet), or an unreadable one: nothing to do
    if size <= max_bytes:
        return False
    copy = Path(f"{path}.tmp")
    try:
        if backups:
            _copy_tail(path, copy, max_bytes)
            for i in range(backups - 1, 0, -1):
                older = Path(f"{path}.{i}")
                if older.exists():
                    older.replace(f"{path}.{i + 1}")
            copy.replace(f"{path}.1")
        os.truncate(path, 0)
        return True
    except OSError as exc:
        with contextlib.suppress(OSError):
            copy.unlink(missing_ok=True)
        if exc.errno in _NO_ROOM:
            _truncate_without_copy(path, exc)
        else:
            log.warning("cannot rotate the engine log: %s", exc, extra={"path": str(path)})
        return False


def _truncate_without_copy(path: Path, reason: OSError) -> None:
    """The disk is full: drop the output rather than let it block the state file."""
    try:
        os.truncate(path, 0)
        log.error("no room to rotate the engine log, truncated it without a copy: %s", reason,
                  extra={"path": str(path)})
    except OSError as exc:
        log.error("no room to rotate the engine log, and it cannot be truncated: %s", exc,
                  extra={"path": str(path)})


def _copy_tail(source: Path, target: Path, max_bytes: int) -> None:
    """Copy the last `max_bytes` of `source` (as of now) to `target`, mode 0640."""
    src = os.open(source, os.O_RDONLY | os.O_CLOEXEC)
    try:
        end = os.fstat(src).st_size
        offset = max(0, end - max_bytes)
        dst = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
                      | os.O_NOFOLLOW, LOG_MODE)
        try:
            os.fchmod(dst, LOG_MODE)
            while offset < end:
                sent = os.sendfile(dst, src, offset, min(_COPY_CHUNK, end - offset))
                if sent == 0:
                    break  # the file shrank under us
                offset += sent
        finally:
            os.close(dst)
    finally:
        os.close(src)


class LogRotator:
    """Rotates the engine logs on a thread of its own: rotation copies up to max_bytes of file,
    I/O that the daemon's loop must never wait for. The loop only looks at the sizes (a stat
    per engine in its sweep) and hands over the logs that are due."""

    def __init__(self, paths: list[Path], max_bytes: int, backups: int) -> None:
        self.paths = paths
        self._max_bytes = max_bytes
        self._backups = backups
        self._due: queue.SimpleQueue[Path | None] = queue.SimpleQueue()
        self._pending: set[Path] = set()
        self._thread = threading.Thread(target=self._run, name="log-rotator", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def check(self) -> None:
        """Hand every log past its size to the thread (from the loop: a stat per log)."""
        for path in self.paths:
            try:
                over = os.stat(path).st_size > self._max_bytes
            except OSError:
                continue  # no log (journald, or not launched yet)
            if over and path not in self._pending:
                self._pending.add(path)
                self._due.put(path)

    def _run(self) -> None:
        while (path := self._due.get()) is not None:
            rotate_if_needed(path, self._max_bytes, self._backups)
            self._pending.discard(path)

    def stop(self, wait_s: float = 2.0) -> None:
        self._due.put(None)
        if self._thread.is_alive():
            self._thread.join(wait_s)
