"""Lines (protocol 1.6): a turn's messages joined into one frame, a line each, and split again;
the Joiner that sends them keeps the sender's progress exact when a send finds the queue full."""

from __future__ import annotations

import pytest

from rollout_watchdog.common import lines, protocol


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
    joined = lines.NEWLINE.join(messages)
    assert lines.split(joined) == messages
    with pytest.raises(protocol.ProtocolError, match=f"{lines.MAX_LINES + 1} lines in one "
                                                     f"frame, over the {lines.MAX_LINES}"):
        lines.split(joined + lines.NEWLINE + messages[0])


def test_no_message_holds_a_newline_so_a_line_is_always_a_whole_message() -> None:
    """A newline inside a string is written as an escape: the frame's separators are the only
    0x0A bytes."""
    reply = protocol.Reply("r\n1", "error", "line one\nline two\r\n", {"x": "\n"})
    assert lines.NEWLINE not in protocol.encode(reply)


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
