"""Following the fleet's event stream across coordinator restarts (docs/protocol.md, "The
coordinator's side", clients).

The stream subscribes on its own DEALER and heartbeats to the coordinator about once a second
(a subscription ends when the client is silent for 10 s). When it hears nothing for `silence_s`
(3 s; the coordinator heartbeats every second) it takes the coordinator for gone and subscribes
again on a fresh socket, with `resume` set to the last node event it got from each node, so the
coordinator sends what it holds after those. It takes "events" frames (several events in one),
and dedupes each of their events on its own. Anything sent twice is dropped: per (node_id, boot)
the highest seq seen is kept, and an event at or below it is a duplicate. The coordinator's own
`node_reachable`/`node_unreachable` events (numbered by the coordinator's boot and count) are
deduplicated the same way but are never resume points.

A restarted coordinator (with a state dir) sends again everything it holds of a node the
stream has no resume point for, and all of its own events: events from before the stream's
creation, which the stream never promised. After a re-subscription, an event of a (node, boot)
the stream has not seen, from a node it has no point for (any for the coordinator's own), is
dropped when its `ts` is before the stream's creation.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from types import TracebackType
from typing import TYPE_CHECKING

import zmq

from rollout_watchdog.common import protocol
from rollout_watchdog.common.lograte import DropCount
from rollout_watchdog.refit_bridge.views import FleetEvent

if TYPE_CHECKING:
    from rollout_watchdog.refit_bridge.client import FleetClient

log = logging.getLogger(__name__)
SILENCE_S = 3.0      # no word from the coordinator for this long: it is gone, subscribe again
HEARTBEAT_S = 1.0    # our heartbeat, which keeps the subscription


class EventStream:
    """An iterator of FleetEvent, each event once, in the order the coordinator relays them,
    from the stream's creation on.

    With `resume` (the default) a re-subscription asks for what the client missed; without it,
    only for what comes next. With `idle_s`, the iteration ends after that long without an
    event (a later `next()` waits again; it is read at each `next()`); without, it follows for
    ever. With `wake` (a thread's end of its pipe, `agent.pipe`), it also ends as soon as that
    socket is readable (what is readable is left there). Not for sharing between threads: each
    follower makes its own with `FleetClient.events()`. `close()` (or `with`) releases the
    socket.
    """

    def __init__(self, client: FleetClient, *, resume: bool = True, idle_s: float | None = None,
                 silence_s: float = SILENCE_S, heartbeat_s: float = HEARTBEAT_S,
                 wake: zmq.Socket[bytes] | None = None) -> None:
        for name, value in (("idle_s", idle_s), ("silence_s", silence_s),
                            ("heartbeat_s", heartbeat_s)):
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0, got {value!r}")
        self.client, self.resume = client, resume
        self.idle_s, self.silence_s, self.heartbeat_s = idle_s, silence_s, heartbeat_s
        self.wake = wake
        self.positions: dict[str, protocol.ResumePoint] = {}  # last node event, per node
        self.subscriptions = 0   # how often it subscribed: 1 + the coordinator's departures
        self.duplicates = 0      # events dropped as already delivered
        self.before_start = 0    # replayed events older than the stream, dropped
        self.created = time.time()
        self._bad_frames = DropCount(log, "a bad frame from the coordinator")
        self._last: dict[tuple[str, str], int] = {}
        self._ready: deque[FleetEvent] = deque()   # the rest of a received batch
        self._sock: zmq.Socket[bytes] | None = None
        self._heard = self._next_heartbeat = 0.0
        self._subscribe(time.monotonic())  # events from now on, not from the first next()

    def __iter__(self) -> EventStream:
        return self

    def __next__(self) -> FleetEvent:
        if self._ready:
            return self._ready.popleft()
        idle_until = None if self.idle_s is None else time.monotonic() + self.idle_s
        while True:
            now = time.monotonic()
            if idle_until is not None and now >= idle_until:
                raise StopIteration
            if self._sock is not None and self._sock.poll(0):
                self._heard = now   # a caller slow between next()s: frames wait, all is well
            if self._sock is None or now - self._heard >= self.silence_s:
                self._subscribe(now)
            assert self._sock is not None
            if now >= self._next_heartbeat:
                self._next_heartbeat = now + self.heartbeat_s
                self._send(protocol.Heartbeat(time.time()))
            wake = min(self._heard + self.silence_s, self._next_heartbeat,
                       idle_until if idle_until is not None else float("inf"))
            if self._wait(max(1, int((wake - now) * 1000))):
                data = self._sock.recv()
                self._heard = time.monotonic()
                self._ready.extend(self._accept(data))
                if self._ready:
                    return self._ready.popleft()

    def _wait(self, timeout_ms: int) -> bool:
        """Whether a frame came within `timeout_ms`; StopIteration when `wake` is readable."""
        assert self._sock is not None
        if self.wake is None:
            return bool(self._sock.poll(timeout_ms))
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self.wake, zmq.POLLIN)
        ready = dict(poller.poll(timeout_ms))
        if self.wake in ready:
            raise StopIteration
        return self._sock in ready

    def _send(self, message: protocol.Message) -> None:
        assert self._sock is not None
        with contextlib.suppress(zmq.Again):  # no coordinator yet: the silence rule retries
            self._sock.send(protocol.encode(message), zmq.NOBLOCK)

    def _subscribe(self, now: float) -> None:
        self.close()
        self._sock = self.client.socket()
        resume = dict(self.positions) if self.resume and self.subscriptions else None
        self._send(protocol.Subscribe(resume, batches=True, runs=True, common=True))
        self.subscriptions += 1
        self._heard = now
        self._next_heartbeat = now + self.heartbeat_s

    def _accept(self, data: bytes) -> list[FleetEvent]:
        """The events in `data` not delivered yet; none for anything else."""
        try:
            message = protocol.decode(data)
        except protocol.ProtocolError as exc:
            self._bad_frames.drop(str(exc))
            return []
        if isinstance(message, (protocol.Events, protocol.Run)):
            events = message.as_events() if isinstance(message, protocol.Run) else message.events
            return [e for m in events if (e := self._new(m)) is not None]
        if isinstance(message, protocol.Event):
            event = self._new(message)
            return [] if event is None else [event]
        if not isinstance(message, protocol.Heartbeat):  # a heartbeat: the coordinator is there
            self._bad_frames.drop(f"a {message.KIND!r} message, not an event")
        return []

    def _new(self, message: protocol.Event) -> FleetEvent | None:
        """The event, unless it was delivered already (by its node, boot and seq)."""
        key = (message.node_id, message.boot)
        if message.seq <= self._last.get(key, 0):
            self.duplicates += 1
            return None
        event = FleetEvent.from_json(message.node_id, message.boot, message.seq, message.event)
        if self._older_than_the_stream(key, event):
            self.before_start += 1
            return None
        self._last[key] = message.seq
        if not event.is_node_event:
            self.positions[event.node_id] = protocol.ResumePoint(event.boot, event.seq)
        return event

    def _older_than_the_stream(self, key: tuple[str, str], event: FleetEvent) -> bool:
        """A replay, after a re-subscription, of an event from before the stream began (see
        the module docstring); the first subscription's events are all new to the stream."""
        if self.subscriptions < 2 or key in self._last or event.ts is None \
                or event.ts >= self.created:
            return False
        return event.is_node_event or event.node_id not in self.positions

    @property
    def bad_frames(self) -> int:
        """Frames dropped: undecodable, or neither events nor a heartbeat."""
        return self._bad_frames.count

    def stats(self) -> dict[str, int]:
        """The stream's counts: its subscriptions, the duplicates and bad frames it dropped."""
        return {"subscriptions": self.subscriptions, "duplicates": self.duplicates,
                "before_start": self.before_start, "bad_frames": self.bad_frames}

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    def __enter__(self) -> EventStream:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
