"""Relaying events to subscribed clients, in order, each once, at each client's own pace.

Every event the coordinator relays goes into one buffer, numbered by the coordinator, bounded
both by count (`BUFFER_EVENTS`) and by bytes (`BUFFER_BYTES`, counting each event's frame and
`ITEM_OVERHEAD` for its objects): the oldest events leave first. A subscriber is a cursor into
that buffer: the coordinator sends from its cursor until the socket would block (the client's
high-water mark) and carries on at the next turn, so one slow client neither blocks the loop nor
loses events, as long as it stays within the buffer. One that falls out of it is counted
(`skipped_behind`) and, before anything else, sent a "gap" event saying how many it lost (made
by the coordinator: `gap_frame`). A resuming subscriber starts at the oldest buffered event and
skips what its resume points say it has (docs/protocol.md, "The coordinator's side").

A subscriber that set `batches` gets runs of events as "events" frames (RELAYED_BATCH_EVENTS
and protocol.BATCH_BYTES at most): the events of nodes' "events" frames it wants whole spliced
from them (no encoding at all), others' own frames spliced in between. One frame per event for
the others. An event that came in a node's batch is encoded on its own only when needed (a
subscriber resumed mid-batch, one without `batches`, the journal).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from rollout_watchdog.common import frames, protocol

BUFFER_EVENTS = 50_000
BUFFER_BYTES = 64 << 20
ITEM_OVERHEAD = 200      # bytes of Python objects per buffered event, besides its frame
SUBSCRIBER_TIMEOUT_S = 10.0
SENDS_PER_TURN = 5_000   # per subscriber and turn: as many as a turn takes in (MESSAGES_PER_TURN)
# The most events in one "events" frame to a subscriber (and protocol.BATCH_BYTES): nodes'
# batches are joined, so that a fleet-wide pause is a few dozen frames to each client, not one
# per node.
RELAYED_BATCH_EVENTS = 256


@dataclass(eq=False)
class Batch:
    """A node's "events" frame whose events are all relayed, one after the other. Only the
    frame is kept (decoded events cost several times its size in memory); it is split into
    the events' own frames when first needed."""

    frame: bytes
    size: int
    # A node's "run" frame (1.4), not an "events" one: it goes whole, as an item of an "events"
    # frame, to a client that takes runs only.
    is_run: bool = False
    _frames: list[bytes] | None = None
    # The bytes each of its events is counted for in the buffer, objects included (split, the
    # frames take about as much again)
    item_size: int = field(init=False)

    def __post_init__(self) -> None:
        self.item_size = -(-len(self.frame) // self.size) + ITEM_OVERHEAD

    def event_frame(self, part: int) -> bytes:
        if self._frames is None:
            message = protocol.decode(self.frame)
            assert isinstance(message, (protocol.Events, protocol.Run))
            events = message.as_events() if isinstance(message, protocol.Run) else message.events
            self._frames = [protocol.encode(event) for event in events]
        return self._frames[part]

    def join(self, packed: frames.EventsFrame) -> bool:
        """Add all of its events to `packed` as they came, if they fit (False: they do not,
        or an "events" frame of another version's envelope, which goes alone as it came)."""
        if self.is_run:
            if not packed.fits(self.frame, self.size):
                return False
            packed.add(self.frame, self.size)
            return True
        return packed.add_batch(self.frame, self.size)


@dataclass(slots=True)
class Relayed:
    """One buffered event: its frame, encoded once for every subscriber (for one that came in
    a batch, when first needed)."""

    node_id: str
    boot: str
    seq: int
    encoded: bytes | None = None
    batch: Batch | None = None   # the batch it came in, and its place there
    part: int = 0

    @property
    def size(self) -> int:
        """What it is counted for in the relay buffer's byte bound."""
        if self.batch is not None:
            return self.batch.item_size
        assert self.encoded is not None, "a relayed event needs its frame or its batch"
        return len(self.encoded) + ITEM_OVERHEAD

    @property
    def frame_bytes(self) -> int:
        """The bytes of its frame (its share of its batch's: not split for this)."""
        if self.batch is not None:
            return -(-len(self.batch.frame) // self.batch.size)
        assert self.encoded is not None, "a relayed event needs its frame or its batch"
        return len(self.encoded)

    @property
    def frame(self) -> bytes:
        """The event alone as an "event" frame."""
        if self.encoded is None:
            assert self.batch is not None, "a relayed event needs its frame or its batch"
            self.encoded = self.batch.event_frame(self.part)
        return self.encoded


def batch_items(node_id: str, boot: str, seqs: Sequence[int], frame: bytes,
                is_run: bool = False) -> list[Relayed]:
    """The items for a node's "events" (or "run") frame (`frame`) all of whose events (of
    `node_id` and `boot`, numbered `seqs`) are relayed. The coordinator checked that each event,
    encoded again alone, fits in a frame."""
    batch = Batch(frame, len(seqs), is_run)
    return [Relayed(node_id, boot, seq, None, batch, i) for i, seq in enumerate(seqs)]


@dataclass
class Subscriber:
    client: bytes
    cursor: int                     # index (in relay numbering) of the next event to send
    last_heard: float
    last_sent: float = 0.0          # when an event last went into its queue
    skip_until: dict[str, int] = field(default_factory=dict)   # node -> index of its point
    resume: dict[str, protocol.ResumePoint] = field(default_factory=dict)
    batches: bool = False           # it takes "events" frames
    runs: bool = False              # ... with "run" messages in them (1.4)
    lost: int = 0                   # events it fell behind by, not yet told in a "gap" event

    def has(self, item: Relayed, index: int) -> bool:
        """Whether this client has the event already (by its resume points)."""
        if index <= self.skip_until.get(item.node_id, -1):
            return True
        point = self.resume.get(item.node_id)
        return point is not None and item.boot == point.boot and item.seq <= point.seq


# Sends one frame to one client; False when it would block (come back later). Raises
# LookupError when the socket cannot reach the client (treated alike: see pump).
Send = Callable[[bytes, bytes], bool]
# The frame of a "gap" event telling a subscriber how many events it lost.
GapFrame = Callable[[int], bytes]


class Relay:
    def __init__(self, capacity: int = BUFFER_EVENTS,
                 subscriber_timeout_s: float = SUBSCRIBER_TIMEOUT_S,
                 max_bytes: int = BUFFER_BYTES, gap_frame: GapFrame | None = None) -> None:
        self.buffer: deque[Relayed] = deque()
        self.capacity, self.max_bytes = capacity, max_bytes
        self.bytes = 0                # what the buffered events are counted for
        self.gap_frame = gap_frame
        self.first = 0                # relay index of buffer[0]
        self.subscribers: dict[bytes, Subscriber] = {}
        self.subscriber_timeout_s = subscriber_timeout_s
        self.skipped_behind = 0       # events a subscriber missed by falling out of the buffer

    @property
    def end(self) -> int:
        return self.first + len(self.buffer)

    def add(self, item: Relayed) -> None:
        """Buffer an event; the oldest leave while over either bound (the newest one stays)."""
        self.buffer.append(item)
        self.bytes += item.size
        self._trim()

    def add_all(self, items: list[Relayed]) -> None:
        """add() each of them (a node's batch: batch_items), the bounds kept once."""
        self.buffer.extend(items)
        self.bytes += sum([item.size for item in items])
        self._trim()

    def _trim(self) -> None:
        buffer, capacity, max_bytes = self.buffer, self.capacity, self.max_bytes
        held, dropped = self.bytes, 0   # (a full buffer drops as many as come: 8,000 a pause)
        while len(buffer) > 1 and (len(buffer) > capacity or held > max_bytes):
            held -= buffer.popleft().size
            dropped += 1
        self.bytes, self.first = held, self.first + dropped

    def subscribe(self, client: bytes, msg: protocol.Subscribe, now: float) -> None:
        """(Re)subscribe: from now on, or from the buffer's start minus what it has."""
        if msg.resume is None:
            self.subscribers[client] = Subscriber(client, self.end, now, batches=msg.batches,
                                                  runs=msg.runs)
            return
        sub = Subscriber(client, self.first, now, resume=dict(msg.resume), batches=msg.batches,
                         runs=msg.runs)
        for index, item in enumerate(self.buffer, self.first):
            point = sub.resume.get(item.node_id)
            if point is not None and (item.boot, item.seq) == (point.boot, point.seq):
                sub.skip_until[item.node_id] = index
        self.subscribers[client] = sub

    def heard(self, client: bytes, now: float) -> None:
        """A message from a client keeps its subscription (if it has one)."""
        sub = self.subscribers.get(client)
        if sub is not None:
            sub.last_heard = now

    def expire(self, now: float) -> list[bytes]:
        """Subscribers silent past the timeout to which nothing could be sent either (a
        client busy reading a burst may be late with its heartbeats; libzmq refuses sends to
        a peer that is gone)."""
        gone = [c for c, s in self.subscribers.items()
                if now - max(s.last_heard, s.last_sent) > self.subscriber_timeout_s]
        for client in gone:
            del self.subscribers[client]
        return gone

    def pump(self, send: Send, now: float) -> bool:
        """Send every subscriber what it lacks, up to a share per turn; True if any is still
        behind (the loop should come back soon)."""
        behind = False
        for client, sub in list(self.subscribers.items()):
            if sub.cursor < self.first:
                self.skipped_behind += self.first - sub.cursor
                sub.lost += self.first - sub.cursor
                sub.cursor = self.first
            if sub.lost and not self._tell_gap(send, sub, now):
                behind = True
                continue
            sent = 0
            while sub.cursor < self.end and sent < SENDS_PER_TURN:
                frame, count, after = self._next(sub, SENDS_PER_TURN - sent)
                if frame is not None:
                    try:
                        if not send(client, frame):
                            break
                    except LookupError:  # gone, or (libzmq) full and not writable yet:
                        break            # tried again; a gone client expires when silent
                    sent += count
                    sub.last_sent = now
                sub.cursor = after
            behind = behind or sub.cursor < self.end
        return behind

    def _tell_gap(self, send: Send, sub: Subscriber, now: float) -> bool:
        """Send `sub` its "gap" event (if the coordinator makes them); False: try again later."""
        if self.gap_frame is not None:
            try:
                if not send(sub.client, self.gap_frame(sub.lost)):
                    return False
            except LookupError:
                return False
            sub.last_sent = now
        sub.lost = 0
        return True

    def _next(self, sub: Subscriber, most: int) -> tuple[bytes | None, int, int]:
        """What to send `sub` next from its cursor: (frame or None when it has all of them,
        how many events the frame holds, the cursor after them)."""
        packed = frames.EventsFrame(min(most, RELAYED_BATCH_EVENTS) if sub.batches else 1,
                                    protocol.BATCH_BYTES)
        index = sub.cursor
        while index < self.end:
            item = self.buffer[index - self.first]
            if sub.has(item, index):
                index += 1
                continue
            batch = item.batch
            if sub.batches and self._whole_batch(sub, item, index, packed.max_events):
                assert batch is not None
                if batch.join(packed):   # spliced in whole
                    index += batch.size
                    continue
                if not packed.frames:   # a frame of another protocol version: as it came
                    return batch.frame, batch.size, index + batch.size
                break                   # what is packed goes first
            frame = item.frame
            if not packed.fits(frame):
                break
            packed.add(frame)
            index += 1
        count = packed.count
        return (packed.take() if count else None), count, index

    def _whole_batch(self, sub: Subscriber, item: Relayed, index: int, most: int) -> bool:
        """Whether `item` starts a node's batch that `sub` lacks all of, within `most` events."""
        batch = item.batch
        if (batch is None or item.part != 0 or batch.size > most
                or len(batch.frame) > protocol.BATCH_BYTES or index + batch.size > self.end
                or (batch.is_run and not sub.runs)):
            return False
        if self.buffer[index + batch.size - 1 - self.first].batch is not batch:
            return False
        if not (sub.resume or sub.skip_until):   # (has() is false for every item then)
            return True
        items = [self.buffer[i - self.first] for i in range(index, index + batch.size)]
        return not any(sub.has(other, i) for i, other in enumerate(items, index))
