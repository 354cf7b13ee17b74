"""Lines (protocol 1.6): a node's turn in one frame, its messages one per line.

Towards a coordinator whose "ack" set `lines`, a node may send up to MAX_LINES messages in one
frame: each the JSON it would send alone, joined by a newline (0x0A, which no message holds:
JSON writes a newline inside a string as an escape). Such a frame stays within MAX_LINES_BYTES
(a bigger message goes alone), and each message within its own bounds. The coordinator takes
each line as if it came alone, in order, from the same peer; it refuses a frame of more lines
whole ("framing"). A fleet-wide pause's run and reply from a node are then one message for
libzmq and for the coordinator's loop, not two (bench/transport_floor.py, "one frame").
"""

from __future__ import annotations

from collections.abc import Callable

from rollout_watchdog.common.json_frame import ProtocolError

MAX_LINES = 64
MAX_LINES_BYTES = 64 << 10
NEWLINE = b"\n"


def split(frame: bytes) -> list[bytes]:
    """The messages of a frame of lines (one holding NEWLINE); ProtocolError over MAX_LINES."""
    parts = frame.split(NEWLINE)
    if len(parts) > MAX_LINES:
        raise ProtocolError(f"{len(parts)} lines in one frame, over the {MAX_LINES} allowed")
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
