"""The coordinator's journal of relayed node events (`--state-dir`), so that a coordinator
restart loses nothing a client has not received yet.

The coordinator ACKs an event to its node once it has it, and the node forgets it. Were the
coordinator SIGKILLed before a subscribed client got the event, only the coordinator would still
have had it. With a state dir, each relayed event is appended to `DIR/relay.jsonl` (one frame a
line: an event's, or a node's batch or run as it came) before the ACK goes out; a restarted
coordinator reloads the newest ones into its relay buffer, so a client resuming from its last
event gets the rest, and knows per node the last event it had, so events that nodes resend are
not relayed twice. The file is bounded by bytes: when it grows past `max_bytes` (64 MiB) it is
rewritten with the newest buffered events that fit in half of that, so it never holds more than
`max_bytes` plus one loop turn's events, and each byte appended is rewritten about once at most.
A failing disk is logged once and the coordinator goes on without the journal: it never stops
relaying for it. """

from __future__ import annotations

import logging
import os
from collections import deque
from collections.abc import Callable, Iterable, Reversible
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
        self._size = 0

    def load(self) -> list[Relayed]:
        """The newest events of the journal, at most about `keep` and `max_bytes` of them (by
        whole lines), oldest first (a bad line is skipped)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        items: deque[Relayed] = deque()
        held = events = skipped = 0
        try:
            with open(self.path, "rb") as file:
                for line in file:
                    try:
                        loaded = _items_of(line.rstrip(b"\n"))
                    except protocol.ProtocolError:
                        skipped += 1  # a line cut short by a crash mid-write
                        continue
                    for item in loaded:
                        items.append(item)
                        held, events = held + _line_bytes(item), events + item.count
                        while len(items) > 1 and (events > self.keep or held > self.max_bytes):
                            gone = items.popleft()
                            held, events = held - _line_bytes(gone), events - gone.count
        except FileNotFoundError:
            pass
        if skipped:
            log.warning("%s: skipped %d unreadable line(s)", self.path, skipped)
        self._rewrite(items, self.max_bytes)
        return list(items)

    def append(self, items: Iterable[Relayed], buffer: Callable[[], Reversible[Relayed]]
               ) -> None:
        """Write items (before their ACK goes out); compact to the newest of `buffer()` (the
        relay's, oldest first) when too big."""
        if self._file is None:
            return
        try:
            for item in items:
                self._file.write(item.frame + b"\n")
                self._size += _line_bytes(item)
            self._file.flush()   # to the kernel: a SIGKILL of the coordinator loses nothing
            if self._size > self.max_bytes:
                self._rewrite(buffer(), self.max_bytes // 2)
        except OSError as exc:
            self._fail(exc)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def _rewrite(self, items: Reversible[Relayed], budget: int) -> None:
        """The journal replaced by the newest of `items` that fit in `budget` bytes, atomically
        (write, then rename)."""
        self.close()
        kept: list[Relayed] = []
        size = 0
        for item in reversed(items):
            if size + _line_bytes(item) > budget:
                break
            kept.append(item)
            size += _line_bytes(item)
        tmp = self.path.with_suffix(".tmp")
        try:
            with open(tmp, "wb") as file:
                for item in reversed(kept):
                    file.write(item.frame + b"\n")
            os.replace(tmp, self.path)
            self._file, self._size = open(self.path, "ab"), size  # noqa: SIM115 (kept open)
        except OSError as exc:
            self._fail(exc)

    def _fail(self, exc: OSError) -> None:
        self.close()
        self.failed = f"{self.path}: {exc}"
        log.error("coordinator journal off: %s; events are relayed from memory only, so a "
                  "coordinator restart may lose events a client has not received yet",
                  self.failed)


def _line_bytes(item: Relayed) -> int:
    return len(item.frame) + 1


def _items_of(line: bytes) -> list[Relayed]:
    """The relay items of one journal line: an event, or a node's batch or run (ProtocolError
    for a line that is neither, or cut short)."""
    msg = protocol.decode(line)
    if isinstance(msg, protocol.Event):
        return [Relayed(msg.node_id, msg.boot, msg.seq, line)]
    if isinstance(msg, protocol.Run):
        return [Relayed(msg.node_id, msg.boot, msg.seq, line, len(msg.events), msg.KIND,
                        msg.common is not None)]
    if not isinstance(msg, protocol.Events):
        raise protocol.ProtocolError(f"a {msg.KIND!r} message, not events")
    first = msg.events[0]
    if all(e.node_id == first.node_id and e.boot == first.boot and e.seq == first.seq + i
           for i, e in enumerate(msg.events)):
        return [Relayed(first.node_id, first.boot, first.seq, line, len(msg.events), msg.KIND)]
    return [Relayed(e.node_id, e.boot, e.seq, protocol.encode(e)) for e in msg.events]
