"""Lines (protocol 1.6): a turn's messages joined into one frame, a line each, and split again;
the Joiner that sends them keeps the sender's progress exact when a send finds the queue full."""

from __future__ import annotations

import json

import pytest
import zmq

from rollout_watchdog.agent.hub import MESSAGES_PER_TURN
from rollout_watchdog.common import lines, protocol
from rollout_watchdog.refit_bridge.coordinator import Coordinator


class Queue:
    """A send queue that takes `room` frames, then is full."""

    def __init__(self, room: int = 100) -> None:
        self.room, self.frames = room, []   # type: ignore[var-annotated]

    def send(self, frame: bytes) -> bool:
        if len(self.frames) >= self.room:
            return False
        self.frames.append(frame)
        return True


def test_a_frame_of_lines_splits_into_its_messages_and_too_many_are_refused() -> None:
    messages = [protocol.encode(protocol.Heartbeat(1.0 + i)) for i in range(lines.MAX_LINES)]
    messages[1] = protocol.encode(protocol.Reply("r-1", "ok", result={"x": {"y": {}}}))
    joined = lines.NEWLINE.join(messages)
    assert lines.split(joined) == messages
    with pytest.raises(protocol.ProtocolError, match=f"{lines.MAX_LINES + 1} lines in one "
                                                     f"frame, over the {lines.MAX_LINES}"):
        lines.split(joined + lines.NEWLINE + messages[0])


def test_a_message_never_holds_the_separator_even_with_newlines_for_whitespace() -> None:
    """A newline inside a string is written as an escape, and a JSON object's `}` is never
    followed by a `{`: a frame splits only between whole messages, and a peer's message
    written with newlines for whitespace (json.dumps(indent=...)) stays one message."""
    reply = protocol.Reply("r\n1", "error", "line one\nline two\r\n", {"x": "\n}\n{"})
    assert lines.NEWLINE not in protocol.encode(reply)
    nested = {"a": {"b": [{"c": 1}, {"d": {}}]}, "e": [[{}], {}]}
    for indent in (None, 0, 1, 4):
        assert lines.SEPARATOR not in json.dumps(nested, indent=indent).encode()


def test_a_turn_counts_each_line_against_its_budget_of_messages() -> None:
    """Frames of 64 lines from a node take a turn's budget (MESSAGES_PER_TURN) 64 times as
    fast as single messages: a peer cannot make one turn do 64 times the work."""
    coordinator = Coordinator("tcp://127.0.0.1:0")
    sock = StandInSocket()
    coordinator.hub.sock = sock   # type: ignore[assignment]
    sock.inbox = [[b"n1", protocol.encode(protocol.Hello("n1", "b1", [], 0))]]
    coordinator.hub._receive_some()
    assert "n1" in coordinator.view.nodes
    beats = lines.NEWLINE.join([protocol.encode(protocol.Heartbeat(1.0))] * lines.MAX_LINES)
    frames = MESSAGES_PER_TURN // lines.MAX_LINES + 10
    sock.inbox = [[b"n1", beats] for _ in range(frames)]
    coordinator.hub._receive_some()
    assert len(sock.inbox) == 10 - (1 if MESSAGES_PER_TURN % lines.MAX_LINES else 0)


class StandInFrame:
    def __init__(self, data: bytes) -> None:
        self.bytes, self.more = data, False

    def get(self, name: str) -> str:
        return "n1"


class StandInSocket:
    """The hub's ROUTER as its receive path calls it: each message is [peer, frame]."""

    def __init__(self) -> None:
        self.inbox: list[list[bytes]] = []   # the next one last
        self._frame: bytes | None = None

    def recv(self, flags: int = 0, copy: bool = True) -> bytes | StandInFrame:
        if self._frame is not None:
            frame, self._frame = self._frame, None
            return frame if copy else StandInFrame(frame)
        if not self.inbox:
            raise zmq.Again()
        peer, self._frame = self.inbox.pop()
        return peer

    def send(self, frame: bytes, flags: int = 0) -> None:
        pass


def test_one_line_at_a_time_sends_each_frame_alone_at_once() -> None:
    queue, done = Queue(), []
    out = lines.Joiner(queue.send, 1)
    for i in range(3):
        assert out.add(b"m%d" % i, lambda i=i: done.append(i))   # type: ignore[misc]
        assert done == list(range(i + 1))
    assert out.flush() and queue.frames == [b"m0", b"m1", b"m2"]


def test_frames_are_joined_up_to_the_line_and_byte_bounds_each_done_once_it_is_out() -> None:
    queue, done = Queue(), []
    out = lines.Joiner(queue.send, 3)
    for i in range(4):
        assert out.add(b"m%d" % i, lambda i=i: done.append(i))   # type: ignore[misc]
    assert queue.frames == [b"m0\nm1\nm2"] and done == [0, 1, 2]   # three lines: out
    big = b"x" * lines.MAX_LINES_BYTES
    assert out.add(big, lambda: done.append(4))   # would pass the byte bound: m3 goes first
    assert queue.frames[-1] == b"m3" and done == [0, 1, 2, 3]
    assert out.add(b"m5", lambda: done.append(5))   # (the big one alone, before it)
    assert queue.frames[-1] == big
    assert out.flush() and queue.frames[-1] == b"m5" and done == [0, 1, 2, 3, 4, 5]


def test_a_full_queue_drops_what_was_joined_without_its_dones_and_after_keeps_order() -> None:
    """What a send could not take is the sender's to send again: its progress (the dones) must
    not move, nor move past it (`after`: a skipped item's progress waits for the frames before
    it)."""
    queue, done = Queue(room=0), []
    out = lines.Joiner(queue.send, 8)
    out.add(b"m0", lambda: done.append(0))
    out.after(lambda: done.append("skipped"))
    assert done == []                       # waits for m0
    assert not out.flush() and done == [] and queue.frames == []
    assert out.flush()                      # nothing kept
    out.after(lambda: done.append("now"))  # nothing queued: at once
    assert done == ["now"]
