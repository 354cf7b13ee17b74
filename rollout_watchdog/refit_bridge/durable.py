"""A small file written durably off the caller's loop: temp file, fsync, rename, fsync of the
directory, on a thread of its own.

The coordinator's refit state must be on disk before a reply says what it records (a fencing
token handed out and then lost in a power cut could be handed out again, to a second holder),
but an fsync can take a long time on a slow or failing disk, and the coordinator's loop must
never wait on one. So the loop submits the whole new content and goes on; the writer writes it
and counts it durable; the loop learns so from `wakeup_fd` (readable once a write has ended)
and then sends the replies that waited for it.

Each submission is the whole file: when several wait, only the newest is written, and it makes
every earlier one durable too. A failed write is counted failed (with its error), and the next
submission tries again.
"""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path

from rollout_watchdog.common.atomic_file import write_atomically

JOIN_TIMEOUT_S = 5.0
STATE_WRITE_TIMEOUT_S = 10.0   # how long a reply waits at most for its state to be on disk


class DurableWriter:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.submitted = 0     # generations handed to the writer
        self._cond = threading.Condition()
        self._content: bytes | None = None   # the newest content not taken by the writer yet
        self._written = 0      # the newest generation on disk
        self._failed = 0       # the newest generation whose write failed
        self._error = ""       # why it failed
        self._closed = False
        self._thread: threading.Thread | None = None
        self.wakeup_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)

    def write_now(self, content: bytes) -> None:
        """Write in the caller's thread (before serving: an error is raised, naming the file)."""
        with self._cond:
            self.submitted += 1
            self._written = self.submitted
        self._write(content)

    def submit(self, content: bytes) -> int:
        """Hand `content` to the writer; its generation (durable once `outcome` says so)."""
        with self._cond:
            if self._closed:
                raise RuntimeError(f"the writer of {self.path} is closed")
            self.submitted += 1
            self._content = content
            self._cond.notify()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name=f"write {self.path.name}")
                self._thread.start()
            return self.submitted

    def outcome(self) -> tuple[int, int, str]:
        """(newest generation written, newest that failed, its error); clears `wakeup_fd`."""
        with contextlib.suppress(BlockingIOError):
            os.eventfd_read(self.wakeup_fd)
        with self._cond:
            return self._written, self._failed, self._error

    def close(self, timeout_s: float = JOIN_TIMEOUT_S) -> None:
        """Let the write in progress and the one waiting end (at most `timeout_s`)."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout_s)
        os.close(self.wakeup_fd)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._content is not None or self._closed)
                if self._content is None:
                    return
                content, generation = self._content, self.submitted
                self._content = None
            try:
                self._write(content)
            except OSError as exc:
                with self._cond:
                    self._failed, self._error = generation, f"cannot write {self.path}: {exc}"
            else:
                with self._cond:
                    self._written = generation
            os.eventfd_write(self.wakeup_fd, 1)

    def _write(self, content: bytes) -> None:
        write_atomically(self.path, content, durable=True)
