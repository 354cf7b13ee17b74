"""What a node sends its coordinator, and how (the sending half of agent/link.py).

The outbox keeps the node's events, in order, until the coordinator ACKs them (bounded: on
overflow the oldest are dropped and counted; the next HELLO's snapshot supersedes them). Each
loop turn sends a pending HELLO first and alone, then the outbox's events not sent yet on this
connection, then the turn's other messages (a command's reply after the events it caused). How
they are framed follows what this connection's coordinator said it takes (`Takes`, from an ACK
read after this connection's HELLO went out): a turn's events as "run" frames (1.4: up to
protocol.BATCH_EVENTS and MAX_RUN_BYTES each, with their shared fields said once: 1.5) or
"events" frames (1.1-1.3: up to BATCH_EVENTS and BATCH_BYTES), else one frame each (an event
over MAX_EVENT_BYTES with its texts cut to fit); and a turn's frames as one frame of lines (1.6,
common/lines.py). A full send queue holds the rest back, in order, for the next turn: dropping
an event would lose it for good, as a later ACK covers every seq below it.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from rollout_watchdog.common import frames, lines, protocol
from rollout_watchdog.common.validate import shorten

log = logging.getLogger(__name__)
CUT_TEXTS_TO = (4096, 512)   # an event over MAX_EVENT_BYTES: its texts cut to these, in turn


@dataclass(frozen=True)
class Takes:
    """What the coordinator on this connection takes besides a message per frame; nothing
    until its ACK says so (it may be of any minor)."""

    batches: bool = False   # "events" frames (1.1)
    runs: bool = False      # "run" frames (1.4)
    common: bool = False    # runs that say their events' shared fields once (1.5)
    lines: bool = False     # frames of several messages, a line each (1.6)


class Outgoing:
    """The node's outbox and each turn's messages, sent through `send_frame` (False: the
    queue is full)."""

    def __init__(self, send_frame: Callable[[bytes], bool], outbox_limit: int,
                 on_dropped: Callable[[], None] | None = None) -> None:
        self.send_frame = send_frame
        self.outbox: deque[protocol.Event] = deque()
        self.outbox_limit = outbox_limit
        self.dropped = 0                        # events dropped from a full outbox
        self.queued: list[protocol.Message] = []   # a pending HELLO, then this turn's others
        self.takes = Takes()
        self._on_dropped = on_dropped
        self._sent_seq = 0       # the outbox's events up to this seq went out on this connection
        self._hello_out = False  # this connection's HELLO is sent: an ACK after it answers it

    @property
    def unsent(self) -> int:
        """Events of the outbox not sent on this connection yet (held back by a full queue,
        or no connection)."""
        return sum(1 for event in self.outbox if event.seq > self._sent_seq)

    def add_event(self, event: protocol.Event) -> None:
        """An event for the coordinator, kept until it is ACKed."""
        self.outbox.append(event)
        if len(self.outbox) > self.outbox_limit:
            self.outbox.popleft()
            self.dropped += 1
            if self._on_dropped is not None:
                self._on_dropped()

    def queue(self, message: protocol.Message) -> None:
        """A message for this turn (a reply, a heartbeat), sent after the events."""
        self.queued.append(message)

    def hello(self, hello: protocol.Hello) -> None:
        """A new connection: its HELLO first (the snapshot), then every event not ACKed (in
        order, once), framed a message each until this connection's ACK says more."""
        self.queued = [hello, *(m for m in self.queued if not isinstance(m, protocol.Hello))]
        self._sent_seq = 0
        self.takes = Takes()
        self._hello_out = False

    def acked(self, ack: protocol.Ack, boot: str) -> None:
        """The coordinator's ACK: what it takes (only from an ACK read after this connection's
        HELLO went out: one read before is the last connection's, as libzmq keeps its queue),
        and the events of this boot it holds, which leave the outbox."""
        if self._hello_out:
            self.takes = Takes(ack.batches, ack.runs, ack.common, ack.lines)
        if ack.boot == boot:
            while self.outbox and self.outbox[0].seq <= ack.seq:
                self.outbox.popleft()

    def drop_queued(self) -> None:
        """No connection: this turn's messages go nowhere (events wait in the outbox, and the
        next HELLO resends them)."""
        self.queued.clear()

    def send_all(self) -> bool:
        """Send a pending HELLO, then the outbox's events not sent yet on this connection, then
        this turn's other messages (a command's reply after the events it caused), as frames
        of lines when the coordinator takes them (1.6: a pause's run and reply in one); False
        if the queue filled up first (what is left stays, in order)."""
        out = lines.Joiner(self.send_frame, lines.MAX_LINES if self.takes.lines else 1)
        sent = 0   # of queued, in order

        def took() -> None:
            nonlocal sent
            sent += 1

        def hello_out() -> None:
            took()
            self._hello_out = True

        hello = bool(self.queued) and isinstance(self.queued[0], protocol.Hello)
        if (not hello or (self._send(self.queued[0], out, hello_out) and out.flush())) \
                and self._send_outbox(out) \
                and all(self._send(m, out, took) for m in self.queued[int(hello):]) \
                and out.flush():   # (a HELLO alone: it may meet a coordinator of any minor)
            self.queued.clear()
            return True
        self.queued = [m for m in self.queued[sent:] if not isinstance(m, protocol.Heartbeat)]
        return False

    def _send_outbox(self, out: lines.Joiner) -> bool:
        if not self.outbox:
            return True
        first = self.outbox[0].seq   # the outbox holds consecutive seqs
        return self._send_events(
            itertools.islice(self.outbox, max(0, self._sent_seq - first + 1), None), out)

    def _sent_to(self, seq: int) -> Callable[[], None]:
        """What to do once the frame of the outbox's events up to `seq` is out."""
        def sent() -> None:
            self._sent_seq = seq
        return sent

    def _send_events(self, events: Iterable[protocol.Event], out: lines.Joiner) -> bool:
        """Send `events` (the outbox's unsent ones), several to a frame when the coordinator
        takes that (as runs, when it takes those); False if the queue filled up first
        (`_sent_seq` says how far it got)."""
        if not self.takes.runs:
            return self._send_packed(events, out)
        chunk: list[protocol.Event] = []
        for event in events:
            chunk.append(event)
            if len(chunk) == protocol.BATCH_EVENTS:
                if not self._send_run(chunk, out):
                    return False
                chunk = []
        return not chunk or self._send_run(chunk, out)

    def _send_run(self, events: list[protocol.Event], out: lines.Joiner) -> bool:
        """`events` as one "run" frame, when there are several and it stays within
        MAX_RUN_BYTES; else as event frames (each cut to fit when too big)."""
        if len(events) > 1:
            try:
                frame: bytes | None = protocol.encode(protocol.Run.of(events, self.takes.common))
            except protocol.ProtocolError:   # not JSON (a bug): each event on its own, logged
                frame = None
            if frame is not None and len(frame) <= protocol.MAX_RUN_BYTES:
                return out.add(frame, self._sent_to(events[-1].seq))
        return self._send_packed(events, out)

    def _send_packed(self, events: Iterable[protocol.Event], out: lines.Joiner) -> bool:
        """_send_events() with each event's own frame, several to an "events" frame when the
        coordinator takes that."""
        packed = frames.EventsFrame(protocol.BATCH_EVENTS if self.takes.batches else 1,
                                    protocol.BATCH_BYTES)
        done = self._sent_seq          # sent, or skipped as unsendable, once `packed` is out
        for event in events:
            frame = event_frame(event)
            if frame is not None:
                if not packed.fits(frame) and not out.add(packed.take(), self._sent_to(done)):
                    return False
                packed.add(frame)
            done = event.seq
        if packed.frames:
            return out.add(packed.take(), self._sent_to(done))
        out.after(self._sent_to(done))   # (unsendable ones at the end: skipped, in order)
        return True

    def _send(self, message: protocol.Message, out: lines.Joiner, took: Callable[[], None]
              ) -> bool:
        """False if the queue is full. A message too big for the protocol (a reply with a huge
        result, a snapshot of too many engines) is not sent: a reply becomes an error reply
        that says so, anything else is logged; either way the turn goes on."""
        try:
            frame = protocol.encode(message)
        except protocol.ProtocolError as exc:
            log.error("cannot send a %s to the coordinator: %s", message.KIND, exc)
            if not isinstance(message, protocol.Reply):
                out.after(took)
                return True
            frame = protocol.encode(protocol.Reply(
                message.request_id, "error", f"the result cannot be sent: {exc}"[:1000],
                code=protocol.TOO_BIG))
        return out.add(frame, took)


def event_frame(event: protocol.Event) -> bytes | None:
    """The event's frame, at most MAX_EVENT_BYTES, which the coordinator refuses beyond: a
    bigger event has its texts cut until it fits, its engine status dropped last (the event
    still says what changed). None (logged) when it cannot be sent at all; a later ACK drops
    it from the outbox, so it never holds the events after it back."""
    try:
        frame = protocol.encode(event)
        if len(frame) <= protocol.MAX_EVENT_BYTES:
            return frame
        problem = f"{len(frame)} bytes"
    except protocol.ProtocolError as exc:   # over the message limit, or not JSON at all
        problem = str(exc)
    tries = [(_cut(event.event, n), _cut(event.engine_status, n)) for n in CUT_TEXTS_TO]
    for body, status in [*tries, (tries[-1][0], None)]:
        with contextlib.suppress(protocol.ProtocolError):
            frame = protocol.encode(protocol.Event(event.node_id, event.boot, event.seq, body,
                                                   status))
            if len(frame) <= protocol.MAX_EVENT_BYTES:
                log.warning("event %d (%s) was too big (%s, over %d): its texts are cut",
                            event.seq, event.event.get("kind"), problem,
                            protocol.MAX_EVENT_BYTES)
                return frame
    log.error("cannot send event %d to the coordinator: %s", event.seq, problem)
    return None


def _cut(value: Any, limit: int) -> Any:
    """A JSON value with every string over `limit` characters cut to it, saying so."""
    if isinstance(value, str):
        return shorten(value, limit)
    if isinstance(value, dict):
        return {key: _cut(item, limit) for key, item in value.items()}
    if isinstance(value, list):
        return [_cut(item, limit) for item in value]
    return value
