"""Relaying events to subscribed clients, in order, each once, at each client's own pace.

Every event the coordinator relays goes into one buffer, numbered by the coordinator, in items
of one frame each (an event alone, or a node's batch or run: one object per frame, not per
event), bounded both by count (`BUFFER_EVENTS`) and by bytes (`BUFFER_BYTES`, counting each
item's frame and `ITEM_OVERHEAD` for each of its events, and a run with `common` its frame
again for each, what splitting it for a client without `common` may take): the oldest items
leave first. A
subscriber is a cursor into that numbering: the coordinator sends from its cursor until the
socket would block (the client's high-water mark) and carries on at the next turn, so one slow
client neither blocks the loop nor loses events, as long as it stays within the buffer. One
that falls out of it is counted (`skipped_behind`) and, before anything else, sent a "gap"
event saying how many it lost (made by the coordinator: `gap_frame`). A resuming subscriber
starts at the oldest buffered event and skips what its resume points say it has
(docs/protocol.md, "The coordinator's side").

A subscriber that set `batches` gets runs of events as "events" frames (RELAYED_BATCH_EVENTS
and protocol.BATCH_BYTES at most): the events of nodes' "events" frames it wants whole spliced
from them (no encoding at all), nodes' "run" frames whole inside them for one that set `runs`
(and `common`, for a run that says its events' shared fields once), others' own frames spliced
in between. One frame per event for the others. A node's batch is split into its events' own
frames only when needed (a subscriber resumed mid-batch, one without `batches`, a run for one
without `runs` or `common`).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable
from dataclasses import dataclass, field

from rollout_watchdog.common import frames, protocol

BUFFER_EVENTS = 50_000
BUFFER_BYTES = 64 << 20
ITEM_OVERHEAD = 200      # bytes counted per buffered event for its objects, besides the frame
SUBSCRIBER_TIMEOUT_S = 10.0
SENDS_PER_TURN = 5_000   # per subscriber and turn: as many as a turn takes in (MESSAGES_PER_TURN)
# The most events in one "events" frame to a subscriber (and protocol.BATCH_BYTES): nodes'
# batches are joined, so that a fleet-wide pause is a few dozen frames to each client, not one
# per node.
RELAYED_BATCH_EVENTS = 256


@dataclass(eq=False, slots=True)
class Relayed:
    """The events of one frame in the relay buffer: an event alone ("event", `count` 1), or a
    node's "events" or "run" frame all of whose events are relayed (seqs `seq` to
    seq + count - 1 of one boot). One object per frame, not per event (a fleet-wide pause is
    8,000 events in 1,000 frames): the frame is kept as it came, and split into its events' own
    frames only when a subscriber needs them alone."""

    node_id: str
    boot: str
    seq: int                    # of its first event
    frame: bytes
    count: int = 1
    kind: str = protocol.Event.KIND
    common: bool = False        # a run that says its events' shared fields once (1.5)
    own: bool = False           # the coordinator's own event about the node (not its stream)
    first: int = 0              # the relay index of its first event (the relay numbers it)
    _split: list[bytes] | None = None

    @property
    def size(self) -> int:
        """What it is counted for in the relay buffer's byte bound: its frame, and the objects
        of each event once split (with `common`, each event also gets the shared fields back,
        at most the frame's bytes again)."""
        split = ITEM_OVERHEAD + (len(self.frame) if self.common else 0)
        return len(self.frame) + split * self.count

    def event_frame(self, part: int) -> bytes:
        """Its event number `part` (from 0) alone, as an "event" frame."""
        if self.kind == protocol.Event.KIND:
            return self.frame
        if self._split is None:
            message = protocol.decode(self.frame)
            assert isinstance(message, (protocol.Events, protocol.Run))
            events = message.as_events() if isinstance(message, protocol.Run) else message.events
            self._split = [protocol.encode(event) for event in events]
        return self._split[part]

    def join(self, packed: frames.EventsFrame) -> bool:
        """Add all of its events to `packed` as they came, if they fit (False: they do not,
        or an "events" frame of another version's envelope, which goes alone as it came)."""
        if self.kind == protocol.Events.KIND:
            return packed.add_batch(self.frame, self.count)
        if not packed.fits(self.frame, self.count):
            return False
        packed.add(self.frame, self.count)
        return True


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
    common: bool = False            # ... and runs with `common` (1.5)
    lost: int = 0                   # events it fell behind by, not yet told in a "gap" event

    def has(self, item: Relayed, part: int) -> bool:
        """Whether this client has event `part` of `item` already (by its resume points: a
        node's point says nothing of the coordinator's own events about the node, which a new
        coordinator makes anew; a client drops one it has by its (node_id, boot, seq))."""
        if not item.own and item.first + part <= self.skip_until.get(item.node_id, -1):
            return True
        point = self.resume.get(item.node_id)
        return point is not None and item.boot == point.boot and item.seq + part <= point.seq

    def has_none(self, item: Relayed) -> bool:
        """Whether it lacks every event of `item`."""
        return not (self.resume or self.skip_until) or not any(
            self.has(item, part) for part in range(item.count))


# Sends one frame to one client; False when it would block (come back later). Raises
# LookupError when the socket cannot reach the client (treated alike: see pump).
Send = Callable[[bytes, bytes], bool]
# The frame of a "gap" event telling a subscriber how many events it lost.
GapFrame = Callable[[int], bytes]


class Relay:
    def __init__(self, capacity: int = BUFFER_EVENTS,
                 subscriber_timeout_s: float = SUBSCRIBER_TIMEOUT_S,
                 max_bytes: int = BUFFER_BYTES, gap_frame: GapFrame | None = None) -> None:
        # The buffered items, oldest first, from _items[_head] on (a list, not a deque: a
        # subscriber's place is found by bisection; the items that left are cut off in bulk).
        self._items: list[Relayed] = []
        self._head = 0
        self.capacity, self.max_bytes = capacity, max_bytes
        self.events = 0               # buffered events
        self.bytes = 0                # what the buffered events are counted for
        self.gap_frame = gap_frame
        self.first = 0                # relay index of the oldest buffered event
        self.subscribers: dict[bytes, Subscriber] = {}
        self.subscriber_timeout_s = subscriber_timeout_s
        self.skipped_behind = 0       # events a subscriber missed by falling out of the buffer

    @property
    def end(self) -> int:
        """The relay index after the newest buffered event (every event relayed so far)."""
        return self.first + self.events

    @property
    def buffer(self) -> list[Relayed]:
        """The buffered items, oldest first (a copy)."""
        return self._items[self._head:]

    def add(self, item: Relayed) -> None:
        """Buffer an item (an event, or a node's batch); the oldest items leave while over
        either bound (the newest one stays)."""
        item.first = self.end
        self._items.append(item)
        self.events += item.count
        self.bytes += item.size
        while len(self._items) - self._head > 1 and (self.events > self.capacity
                                                     or self.bytes > self.max_bytes):
            gone = self._items[self._head]
            self._head += 1
            self.first += gone.count
            self.events -= gone.count
            self.bytes -= gone.size
        if self._head > 1024 and self._head * 2 > len(self._items):
            del self._items[:self._head]
            self._head = 0

    def _at(self, index: int) -> int:
        """The position in _items of the item holding the event at relay index `index`
        (buffered: first <= index < end)."""
        return bisect_right(self._items, index, lo=self._head, key=_first_of) - 1

    def subscribe(self, client: bytes, msg: protocol.Subscribe, now: float) -> None:
        """(Re)subscribe: from now on, or from the buffer's start minus what it has."""
        if msg.resume is None:
            self.subscribers[client] = Subscriber(client, self.end, now, batches=msg.batches,
                                                  runs=msg.runs, common=msg.common)
            return
        sub = Subscriber(client, self.first, now, resume=dict(msg.resume), batches=msg.batches,
                         runs=msg.runs, common=msg.common)
        for item in self.buffer:
            point = sub.resume.get(item.node_id)
            if (point is not None and item.boot == point.boot
                    and item.seq <= point.seq < item.seq + item.count):
                sub.skip_until[item.node_id] = item.first + point.seq - item.seq
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
        index, position = sub.cursor, self._at(sub.cursor)
        while index < self.end:
            item = self._items[position]
            part = index - item.first
            if part == 0 and sub.batches and self._whole(sub, item, packed.max_events):
                if item.join(packed):   # spliced in whole
                    index += item.count
                    position += 1
                    continue
                if not packed.frames:   # a frame of another protocol version: as it came
                    return item.frame, item.count, index + item.count
                break                   # what is packed goes first
            while part < item.count:    # event by event
                if not sub.has(item, part):
                    frame = item.event_frame(part)
                    if not packed.fits(frame):
                        count = packed.count
                        return packed.take(), count, index
                    packed.add(frame)
                part += 1
                index += 1
            position += 1
        count = packed.count
        return (packed.take() if count else None), count, index

    @staticmethod
    def _whole(sub: Subscriber, item: Relayed, most: int) -> bool:
        """Whether `sub` gets all of the node batch `item` as it came: it lacks every event of
        it, takes its kind, and it fits in `most` events and a frame."""
        return (item.kind != protocol.Event.KIND and item.count <= most
                and len(item.frame) <= protocol.BATCH_BYTES
                and (item.kind != protocol.Run.KIND or sub.runs)
                and (sub.common or not item.common) and sub.has_none(item))


def _first_of(item: Relayed) -> int:
    return item.first
