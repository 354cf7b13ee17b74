"""Frames built without a message object each, for the hub's hot path (a fleet-wide pause is
a thousand ACKs, commands and event batches): the very bytes `protocol.encode` writes (tests hold
them to it), with what the frames share encoded once."""

from __future__ import annotations

from rollout_watchdog.common.json_frame import _ENCODER
from rollout_watchdog.common.message_base import _check_str
from rollout_watchdog.common.protocol import (
    MAJOR,
    MAX_MESSAGE_BYTES,
    MINOR,
    Command,
    ProtocolError,
    encode,
)

_ACK_OPEN = f'{{"v":[{MAJOR},{MINOR}],"kind":"ack","boot":'.encode()
_EVENTS_OPEN = f'{{"v":[{MAJOR},{MINOR}],"kind":"events","events":['.encode()
_EVENTS_CLOSE = b"]}"


class EventsFrame:
    """Event frames (each a whole "event" message, as encode() makes them, or a "run" of
    events) gathered into one frame without encoding them again: one event stays itself,
    several become an "events" message. Holds at most `max_events`, and never makes a frame
    over `max_bytes`. Whole "events" frames as this package writes them join too
    (`add_batch`): their events are spliced in."""

    def __init__(self, max_events: int, max_bytes: int = MAX_MESSAGE_BYTES) -> None:
        self.max_events, self.max_bytes = max_events, max_bytes
        self.frames: list[bytes] = []   # event frames, or runs of them joined by commas
        self.count = 0                  # events in them
        self._size = len(_EVENTS_OPEN) + len(_EVENTS_CLOSE)

    def fits(self, frame: bytes, count: int = 1) -> bool:
        """Whether `frame` (of `count` events) can join (the first always can: it is a frame
        of its own)."""
        return not self.frames or (self.count + count <= self.max_events
                                   and self._size + len(frame) + 1 <= self.max_bytes)

    def add(self, frame: bytes, count: int = 1) -> None:
        """Add a whole message: an event, or a run of `count` events (1.4)."""
        self.frames.append(frame)
        self.count += count
        self._size += len(frame) + 1

    def add_batch(self, frame: bytes, count: int) -> bool:
        """Splice in the `count` events of an "events" frame with this package's envelope
        (`batch_inner`); False, and nothing added, for any other frame or one that does not
        fit."""
        inner = batch_inner(frame)
        if inner is None or not self.fits(inner, count):
            return False
        self.add(inner, count)
        return True

    def take(self) -> bytes:
        """The frame of what was added (at least one), and empty again."""
        frames, count = self.frames, self.count
        self.frames, self.count = [], 0
        self._size = len(_EVENTS_OPEN) + len(_EVENTS_CLOSE)
        return frames[0] if count == 1 else _EVENTS_OPEN + b",".join(frames) + _EVENTS_CLOSE


def batch_inner(frame: bytes) -> bytes | None:
    """The comma-joined event frames inside an "events" frame as encode() writes it at this
    protocol version (what several such frames are spliced from), else None."""
    if frame.startswith(_EVENTS_OPEN) and frame.endswith(_EVENTS_CLOSE):
        return frame[len(_EVENTS_OPEN):-len(_EVENTS_CLOSE)]
    return None


def ack_frame(boot: str, seq: int) -> bytes:
    """encode(Ack(boot, seq, batches=True, runs=True, common=True, lines=True)), for a
    coordinator that acknowledges a thousand nodes at once: `boot` and `seq` come from events
    it took already."""
    return b"".join((_ACK_OPEN, _ENCODER.encode(boot).encode("ascii"), b',"seq":',
                     str(seq).encode("ascii"), b',"batches":true,"runs":true,"common":true,'
                     b'"lines":true}'))


def command_frames(template: Command, targets: list[tuple[str, str]]) -> list[bytes]:
    """The frame of `template` for each (request_id, node) of `targets` (a fleet-wide
    command's per-node copies): what they share encoded once, as encode() would write it."""
    marked = Command("\x00request", template.cmd, template.args, "\x00node", template.engine,
                     template.timeout_s)
    parts = encode(marked).split(b'"\\u0000request"')
    if len(parts) == 2 and parts[1].count(b'"\\u0000node"') == 1:
        head, (middle, tail) = parts[0], parts[1].split(b'"\\u0000node"')
        room = MAX_MESSAGE_BYTES - len(head) - len(middle) - len(tail)
        frames = []
        for request_id, node in targets:
            _check_str(Command.KIND, "request_id", request_id)
            _check_str(Command.KIND, "node", node)
            rid, name = _ENCODER.encode(request_id), _ENCODER.encode(node)
            if len(rid) + len(name) > room:
                raise ProtocolError(f"command: {len(rid) + len(name) - room} bytes over the "
                                    f"limit of {MAX_MESSAGE_BYTES} bytes")
            frames.append(b"".join((head, rid.encode("ascii"), middle, name.encode("ascii"),
                                    tail)))
        return frames
    return [encode(Command(request_id, template.cmd, template.args, node, template.engine,
                           template.timeout_s))   # (its args hold a mark)
            for request_id, node in targets]
