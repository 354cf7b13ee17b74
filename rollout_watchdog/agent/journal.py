"""The coordinator's journal of relayed node events (`--state-dir`), so that a coordinator
restart loses nothing a client has not received yet.

The coordinator ACKs an event to its node once it has it, and the node forgets it. Were the
coordinator SIGKILLed before a subscribed client got the event, only the coordinator would still
have had it. With a state dir, each relayed event is appended to `DIR/relay.jsonl` (one frame a
line) before the ACK goes out; a restarted coordinator reloads the newest ones into its relay
buffer, so a client resuming from its last event gets the rest, and knows per node the last
event it had, so events that nodes resend are not relayed twice. The file is compacted to the
buffer's size when it grows past `max_bytes`. A failing disk is logged once and the coordinator
goes on without the journal: it never stops relaying for it.
"""

from __future__ import annotations

import logging
import os
from collections import deque
from collections.abc import Iterable
from pathlib import Path
from typing import IO

from rollout_watchdog.agent.relay import Relayed
from rollout_watchdog.common import protocol

log = logging.getLogger(__name__)
JOURNAL = "relay.jsonl"
MAX_BYTES = 64 << 20


class Journal:
    def __init__(self, state_dir: str, keep: int, max_bytes: int = MAX_BYTES) -> None:
        self.path = Path(state_dir) / JOURNAL
        self.keep, self.max_bytes = keep, max_bytes
        self.failed: str | None = None
        self._file: IO[bytes] | None = None
        self._size = self._compacted = 0

    def load(self) -> list[Relayed]:
        """The newest `keep` events of the journal, oldest first (a bad line is skipped)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        items: deque[Relayed] = deque(maxlen=self.keep)
        skipped = 0
        try:
            with open(self.path, "rb") as file:
                for line in file:
                    try:
                        msg = protocol.decode(line.rstrip(b"\n"))
                    except protocol.ProtocolError:
                        skipped += 1  # a line cut short by a crash mid-write
                        continue
                    if isinstance(msg, protocol.Event):
                        items.append(Relayed(msg.node_id, msg.boot, msg.seq, line.rstrip(b"\n")))
        except FileNotFoundError:
            pass
        if skipped:
            log.warning("%s: skipped %d unreadable line(s)", self.path, skipped)
        self._rewrite(items)
        return list(items)

    def append(self, items: Iterable[Relayed], buffer: Iterable[Relayed]) -> None:
        """Write events (before their ACK goes out); compact to `buffer` when too big."""
        if self._file is None:
            return
        try:
            for item in items:
                self._file.write(item.frame + b"\n")
                self._size += len(item.frame) + 1
            self._file.flush()   # to the kernel: a SIGKILL of the coordinator loses nothing
            if self._size > max(self.max_bytes, 2 * self._compacted):
                self._rewrite(buffer)
        except OSError as exc:
            self._fail(exc)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def _rewrite(self, items: Iterable[Relayed]) -> None:
        """The journal replaced by `items` alone, atomically (write, then rename)."""
        self.close()
        tmp = self.path.with_suffix(".tmp")
        try:
            with open(tmp, "wb") as file:
                size = 0
                for item in items:
                    file.write(item.frame + b"\n")
                    size += len(item.frame) + 1
            os.replace(tmp, self.path)
            self._file, self._size = open(self.path, "ab"), size  # noqa: SIM115 (kept open)
            self._compacted = size   # a buffer bigger than max_bytes: not rewritten each turn
        except OSError as exc:
            self._fail(exc)

    def _fail(self, exc: OSError) -> None:
        self.close()
        self.failed = f"{self.path}: {exc}"
        log.error("coordinator journal off: %s; events are relayed from memory only, so a "
                  "coordinator restart may lose events a client has not received yet",
                  self.failed)
