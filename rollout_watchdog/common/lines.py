"""Lines (protocol 1.6): a node's turn in one frame, its messages one per line.

Towards a coordinator whose "ack" (answering this connection's HELLO) set `lines`, a node may
send up to MAX_LINES messages in one frame: each the JSON object it would send alone, joined by
a newline. The coordinator splits such a frame where one object ends and the next begins
(SEPARATOR, `}` newline `{`, which no single JSON value holds: a newline inside a string is an
escape, and an object's `}` is followed by `,`, `]` or `}`), so a message with newlines for
whitespace stays one message. Such a frame stays within MAX_LINES_BYTES (a bigger message goes
alone), and each message within its own bounds. A HELLO always goes alone. The coordinator
takes lines only on a node's connection (after its HELLO), each as if it came alone, in order,
each counted against its turn's budget of messages; it refuses a frame of more lines whole
("framing"). A fleet-wide pause's run and reply from a node are then one message for libzmq and
for the coordinator's loop, not two (bench/transport_floor.py, "one frame").
"""

from __future__ import annotations

from collections.abc import Callable

from rollout_watchdog.common.json_frame import ProtocolError

MAX_LINES = 64
MAX_LINES_BYTES = 64 << 10
NEWLINE = b"\n"
SEPARATOR = b"}\n{"


def split(frame: bytes) -> list[bytes]:
    """The messages of a frame of lines (one holding SEPARATOR), each sliced once;
    ProtocolError over MAX_LINES (no list of them made: a hostile frame's cost is a count)."""
    parts: list[bytes] = []
    start = 0
    while (at := frame.find(SEPARATOR, start)) >= 0:
        if len(parts) == MAX_LINES - 1:
            raise ProtocolError(f"{frame.count(SEPARATOR) + 1} lines in one frame, over the "
                                f"{MAX_LINES} allowed")
        parts.append(frame[start:at + 1])   # (each message keeps its braces)
        start = at + 2
    parts.append(frame[start:])
    return parts


class Joiner:
    """A turn's frames, sent as few frames of lines as `max_lines` allows (1: each alone).
    Each frame comes with what to do once it is out (`done`). What a send could not take is
    dropped and its `done` never called: the sender's own state (what it holds as unsent)
    sends it again."""

    def __init__(self, send: Callable[[bytes], bool], max_lines: int) -> None:
        self._send, self.max_lines = send, max_lines
        self._frames: list[bytes] = []
        self._done: list[Callable[[], None]] = []
        self._size = 0

    def add(self, frame: bytes, done: Callable[[], None]) -> bool:
        """Queue `frame`; False if a send that it needed first found the queue full (then add
        nothing more this turn: it would go out of order)."""
        if self._frames and self._size + len(frame) > MAX_LINES_BYTES and not self.flush():
            return False
        self._frames.append(frame)
        self._done.append(done)
        self._size += len(frame) + 1
        return len(self._frames) < self.max_lines or self.flush()

    def after(self, done: Callable[[], None]) -> None:
        """Call `done` once what is queued now is out (at once when nothing is)."""
        if self._frames:
            self._done.append(done)
        else:
            done()

    def flush(self) -> bool:
        """Send what is queued as one frame; False, and nothing kept, if the queue was full."""
        if not self._frames:
            return True
        frames, done = self._frames, self._done
        self._frames, self._done, self._size = [], [], 0
        if not self._send(frames[0] if len(frames) == 1 else NEWLINE.join(frames)):
            return False
        for then in done:
            then()
        return True
