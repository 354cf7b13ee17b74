"""The fleet wire protocol between node agents, the coordinator and its clients.

This docstring is the spec (docs/protocol.md says the same for people).

Framing. A message is one ZMQ frame holding one UTF-8 JSON object of at most MAX_MESSAGE_BYTES
(1 MiB: a HELLO snapshot of a node with hundreds of engines fits); (1.6) towards a coordinator
whose "ack" set `lines`, a node may join up to lines.MAX_LINES messages in one frame, one per
line (common/lines.py says how). Every message has
    "v":    [MAJOR, MINOR]  (this module speaks MAJOR 1, MINOR 6)
    "kind": one of "hello", "event", "events", "run", "ack", "heartbeat", "command", "reply",
            "subscribe"
and the fields of its kind below. A receiver refuses an unknown MAJOR, accepts any MINOR and
ignores fields it does not know. A newer minor only adds optional fields and kinds; a sender
uses a newer kind only towards a peer that asked for it (1.1: "events", asked for by the
`batches` flag of "ack" and "subscribe"; 1.2 added only the reply's optional `code`, which an
older peer ignores and an older peer's reply lacks; 1.3 only the paging of the refit's members,
asked for by the `paged` argument of `refit_acquire` and `refit_members`, which an older
coordinator ignores and answers with every member at once: refit_bridge/service.py; 1.4:
"run", asked for by the `runs` flag of "ack" and "subscribe"; 1.5: a run's `common`, asked for
by the `common` flag of "ack" and "subscribe"; 1.6: lines, asked for by the `lines` flag of
"ack"). Numbers
are finite
(no NaN/Infinity); the protocol's own integers (seq, last_seq) fit in a signed 64-bit int.
Sequence numbers count from 1 within one boot of a node daemon; 0 means "none yet".

Kinds (direction; fields, "?" = optional, may be null or absent):
    hello      node -> coordinator, on every (re)connect: node_id, boot (the node daemon's boot
               id), engines (the list `status --json` prints, each an object with a string
               "id"), last_seq (the highest seq issued in this boot, >= 0), metrics_port?
               (the port the node serves its Prometheus metrics on; shown in the fleet view).
    event      node -> coordinator -> client: node_id, boot, seq (>= 1), event (the object
               `events --json` prints), engine_status? (the engine's object of `status --json`
               right after the event, so the fleet view needs no snapshot to stay exact). A
               node keeps it until acknowledged. A node leaves engine_status out of the
               PAUSE_KINDS events, which say all that they change: "paused" and
               "pause_extended" set `paused` and `pause_deadline` (the event's `deadline`),
               "resumed" and "pause_expired" clear them (a fleet-wide pause is 8,000 of these,
               at half the bytes). A FORGETTING_KINDS event ("unregistered", "removed")
               comes without one too: the node no longer has the engine, and the fleet view
               drops it (and the router with it) at once. Its frame, encoded alone, is at most
               MAX_EVENT_BYTES (64 KiB): a node cuts the longest texts of a bigger one to fit,
               and the coordinator refuses a bigger one.
    events     (1.1) node -> coordinator -> client: events (a non-empty list of "event"
               messages, each a whole message with its own "v" and "kind", as it would be
               sent alone), in order. It stands for its events sent one by one: each is
               checked, deduplicated and acknowledged on its own. A node sends one for the
               events of one loop turn, a coordinator for a run of relayed events; either
               only to a peer that set `batches`, and never over MAX_MESSAGE_BYTES (a longer
               run is split). (1.4) Towards a peer that set `runs`, an element may also be a
               whole "run" message, which stands for its events in its place.
    run        (1.4) node -> coordinator -> client: node_id, boot, seq (>= 1), events (a
               non-empty list of event objects), statuses? (null or absent: no event has an
               engine_status; else a list as long as `events`, each an engine_status or
               null). It stands for the "event" messages seq, seq+1, ... of that boot, each
               with its status, sent one by one: one object per frame instead of one per
               event (the envelope is said once). A node sends one for the events of one loop
               turn (BATCH_EVENTS and MAX_RUN_BYTES at most; "events" frames for a bigger
               turn), only to a coordinator whose "ack" set `runs`; a coordinator relays it
               as it came, inside "events" frames, only to a client that set `runs`, and as
               its events to any other. common? (1.5): an object of fields that every event
               has, left out of each: event i is common's fields, then events[i]'s (events[i]'s
               win). A node says its events' shared scalar fields once (a pause's run of 8
               "paused" events: all but "engine" and "ts"), only to a coordinator whose "ack"
               set `common`; a coordinator relays such a run as it came only to a client that
               set `common`, and as its events to any other.
    ack        coordinator -> node: boot, seq (>= 0): every event of that boot up to seq is
               received; the node may drop them from its outbox. batches? (1.1; default
               false): the coordinator takes "events" from this node. runs? (1.4; default
               false): and "run". common? (1.5; default false): and runs with `common`.
               lines? (1.6; default false): and frames of lines.
               A coordinator may ACK late (this package's does so with
               its next heartbeat, in place of it; a HELLO, and 512 events owed, at once):
               a node keeps what is not ACKed, nothing more.
    heartbeat  both ways, about once a second: sent_at (sender's clock, seconds since epoch).
               Any message keeps its sender reachable: a node sends one only after a
               second in which it sent nothing else.
    command    client -> coordinator -> node: request_id (idempotency key: a repeated id gets
               the same reply), cmd (a control command name), args (object, default {}),
               node? (one node; null = every reachable node, except for `launch`, which a
               coordinator refuses without one: BAD_ARGS), engine? (one engine of `node`;
               null = all; needs `node`), timeout_s? (> 0: how long to gather the replies).
    reply      answer to a command: request_id, status ("ok" | "error"), reason? (required
               for "error": for people), result? (any JSON value), code? (1.2; only with
               "error", left out when none: what went wrong, for programs, which never read
               the reason; one of CODES, or a later minor's code, which a receiver takes as
               an error with no code):
                 LOCK_HELD        refit_acquire: another holder has the lock (`result`
                                  says who)
                 LEASE_LOST       a refit call whose token is not the current holder's
                 BAD_ARGS         an argument is missing or invalid
                 UNKNOWN_COMMAND  no such command
                 UNKNOWN_NODE     `node` names no node the coordinator knows
                 NODE_UNREACHABLE `node` is unreachable
                 NODE_ERRORS      a fan-out: some node answered an error or not at all
                                  (`result` holds each node's answer)
                 NOT_SAVED        the coordinator could not put the state on disk
                 TOO_BIG          the result does not fit in one message and is not paged:
                                  nothing of it is sent (a fan-out keeps its failed and
                                  missing nodes and the count of the others, with
                                  `results_left_out`); refit_acquire then leaves the lock
                                  free. A reply is never cut down to fit and sent as "ok".
                 INTERNAL         a bug on the answering side
                 BUSY             not run, and never will be: the coordinator could hold
                                  it back no longer (held/queued after a restart)
               A reply from a peer before 1.2 has no code: the receiver falls back on the
               result's shape (refit.py says how), never on the reason's text.
    subscribe  client -> coordinator: resume? (null = from now on, else
               {node_id: {"boot": ..., "seq": ...}}: the last event the client has per node,
               so none is sent twice). batches? (1.1; default false): the client takes
               "events". runs? (1.4; default false): and "run" messages in them. common?
               (1.5; default false): and runs with `common`.

decode() refuses any bad frame with one ProtocolError (a ValueError) whose message names the
problem; it never raises anything else, so a receiver can drop and count bad input.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, TypeAlias

from rollout_watchdog.common.control_messages import (
    BAD_ARGS,
    BUSY,
    CODES,
    INTERNAL,
    LEASE_LOST,
    LOCK_HELD,
    MAX_CODE_CHARS,
    NODE_ERRORS,
    NODE_UNREACHABLE,
    NOT_SAVED,
    STATUSES,
    TOO_BIG,
    UNKNOWN_COMMAND,
    UNKNOWN_NODE,
    Command,
    Reply,
    ResumePoint,
    Subscribe,
)
from rollout_watchdog.common.json_frame import MessageTooBig, ProtocolError, dumps, parse
from rollout_watchdog.common.message_base import (
    MAJOR,
    MINOR,
    VERSION,
    _as_float,
    _check_bool,
    _check_int,
    _check_object,
    _check_str,
    _fail,
    _Message,
    _missing,
    _plain_event,
    _plain_version,
)
from rollout_watchdog.common.run_fields import expanded, own_fields, plain_run, shared_fields

# What the modules of the messages define, and the protocol's users take from here.
__all__ = ["BAD_ARGS", "BUSY", "CODES", "INTERNAL", "LEASE_LOST", "LOCK_HELD", "MAX_CODE_CHARS",
           "NODE_ERRORS", "NODE_UNREACHABLE", "NOT_SAVED", "STATUSES", "TOO_BIG",
           "UNKNOWN_COMMAND", "UNKNOWN_NODE", "Command", "Reply", "ResumePoint", "Subscribe",
           "MessageTooBig", "ProtocolError", "MAJOR", "MINOR", "VERSION"]

MAX_MESSAGE_BYTES = 1 << 20
# The most an "events" frame holds as this package sends it: per-frame costs are well spread
# over 32 events, and a peer's queue of frames (high-water marks count frames) stays small.
BATCH_EVENTS = 32
BATCH_BYTES = 64 << 10
# The most one event's frame (encode() of it alone) may hold: a node cuts the texts of a bigger
# one to fit, and the coordinator refuses one over it (its relay buffer and journal hold
# thousands of events).
MAX_EVENT_BYTES = 64 << 10
# The most a "run" frame holds as this package sends it: each of its events, sent alone with its
# envelope, stays far within MAX_EVENT_BYTES (a bigger turn goes as several runs, or as events).
MAX_RUN_BYTES = 32 << 10
PAUSE_KINDS = ("paused", "pause_extended", "resumed", "pause_expired")
# Events after which an engine is no longer on its node (unwatched, or out of the config)
FORGETTING_KINDS = ("unregistered", "removed")


@dataclass(frozen=True)
class Hello(_Message):
    """A node's full snapshot, sent on every (re)connect; supersedes anything it lost."""

    KIND: ClassVar[str] = "hello"
    node_id: str
    boot: str
    engines: list[dict[str, Any]]
    last_seq: int
    metrics_port: int | None = None

    def __post_init__(self) -> None:
        _check_str(self.KIND, "node_id", self.node_id)
        if self.metrics_port is not None:
            _check_int(self.KIND, "metrics_port", self.metrics_port, 1)
        _check_str(self.KIND, "boot", self.boot)
        if not isinstance(self.engines, list):
            raise _fail(self.KIND, "engines", "a list", self.engines)
        for i, engine in enumerate(self.engines):
            _check_object(self.KIND, f"engines[{i}]", engine)
            _check_str(self.KIND, f"engines[{i}].id", engine.get("id"))
        _check_int(self.KIND, "last_seq", self.last_seq, 0)


@dataclass(frozen=True)
class Event(_Message):
    """One event of a node, numbered within its boot so that none is lost or doubled."""

    KIND: ClassVar[str] = "event"
    node_id: str
    boot: str
    seq: int
    event: dict[str, Any]
    engine_status: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        status = self.engine_status
        if _plain_event(self.node_id, self.boot, self.seq, self.event, status):
            return   # the common case, checked in one go
        _check_str(self.KIND, "node_id", self.node_id)
        _check_str(self.KIND, "boot", self.boot)
        _check_int(self.KIND, "seq", self.seq, 1)
        _check_object(self.KIND, "event", self.event)
        if status is not None:
            _check_object(self.KIND, "engine_status", status)
            _check_str(self.KIND, "engine_status.id", status.get("id"))

    # The two below are _Message's, written out: every event passes through them.
    def to_json(self) -> dict[str, Any]:
        return {"v": list(VERSION), "kind": self.KIND, "node_id": self.node_id,
                "boot": self.boot, "seq": self.seq, "event": self.event,
                "engine_status": self.engine_status}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> Event:
        try:
            return cls(obj["node_id"], obj["boot"], obj["seq"], obj["event"],
                       obj.get("engine_status"))
        except KeyError as exc:   # the first missing one, in field order, as _Message says
            raise _missing(cls.KIND, exc.args[0]) from None


@dataclass(frozen=True)
class Events(_Message):
    """Several events in one frame (1.1): per-frame costs paid once for a node's loop turn,
    or for a run of relayed events."""

    KIND: ClassVar[str] = "events"
    events: list[Event]

    def __post_init__(self) -> None:
        if not isinstance(self.events, list) or not self.events:
            raise _fail(self.KIND, "events", "a non-empty list of events", self.events)
        for i, event in enumerate(self.events):
            if not isinstance(event, Event):
                raise _fail(self.KIND, f"events[{i}]", "an event", event)

    def to_json(self) -> dict[str, Any]:
        return {"v": list(VERSION), "kind": self.KIND,
                "events": [event.to_json() for event in self.events]}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> Events:
        raw = obj.get("events")
        if not isinstance(raw, list) or not raw:
            raise _fail(cls.KIND, "events", "a non-empty list of events", raw)
        plain = plain_events(obj)   # the common case, in one loop
        if plain is not None:
            return cls(plain.events())
        events: list[Event] = []
        for i, item in enumerate(raw):   # the full checks, and the exact error
            try:
                message = Event.from_json(item) if _is_event_envelope(item) else from_json(item)
            except ProtocolError as exc:
                raise ProtocolError(f"events[{i}]: {exc}") from None
            if isinstance(message, Run):   # (1.4) stands for its events
                events += message.as_events()
            elif isinstance(message, Event):
                events.append(message)
            else:
                raise ProtocolError(f"events[{i}]: an {message.KIND!r} message, not an event")
        return cls(events)


@dataclass(frozen=True)
class Run(_Message):
    """(1.4) A node's consecutive events with their envelope said once: one object per frame
    where "events" holds a whole message per event (a fleet-wide pause is 8,000 events). In
    memory, `events` are whole; `common` (1.5) only says which fields the frame says once."""

    KIND: ClassVar[str] = "run"
    node_id: str
    boot: str
    seq: int
    events: list[dict[str, Any]]
    statuses: list[dict[str, Any] | None] | None = None
    common: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if plain_run(self.node_id, self.boot, self.seq, self.events, self.statuses,
                     self.common):
            return   # the common case, checked in one go
        _check_str(self.KIND, "node_id", self.node_id)
        _check_str(self.KIND, "boot", self.boot)
        _check_int(self.KIND, "seq", self.seq, 1)
        if not isinstance(self.events, list) or not self.events:
            raise _fail(self.KIND, "events", "a non-empty list of events", self.events)
        for i, event in enumerate(self.events):
            _check_object(self.KIND, f"events[{i}]", event)
        _check_int(self.KIND, "the last seq", self.seq + len(self.events) - 1, 1)
        if self.common is not None:
            _check_object(self.KIND, "common", self.common)
        if self.statuses is None:
            return
        if not isinstance(self.statuses, list) or len(self.statuses) != len(self.events):
            raise _fail(self.KIND, "statuses", f"null or a list of {len(self.events)}",
                        self.statuses)
        for i, status in enumerate(self.statuses):
            if status is not None:
                _check_object(self.KIND, f"statuses[{i}]", status)
                _check_str(self.KIND, f"statuses[{i}].id", status.get("id"))

    def to_json(self) -> dict[str, Any]:
        """Without `statuses` when no event has one; with `common`, each event without it."""
        body = {"v": list(VERSION), "kind": self.KIND, "node_id": self.node_id,
                "boot": self.boot, "seq": self.seq}
        if self.common is None:
            body["events"] = self.events
        else:
            body["common"] = self.common
            body["events"] = [own_fields(event, self.common) for event in self.events]
        if self.statuses is not None:
            body["statuses"] = self.statuses
        return body

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> Run:
        try:   # (_Message's, written out: a fleet-wide pause is a thousand of them)
            events, common = obj["events"], obj.get("common")
            if common is not None:
                events = expanded(common, events)
            return cls(obj["node_id"], obj["boot"], obj["seq"], events, obj.get("statuses"),
                       common)
        except KeyError as exc:   # the first missing one, in field order, as _Message says
            raise _missing(cls.KIND, exc.args[0]) from None

    def as_events(self) -> list[Event]:
        """The "event" messages it stands for."""
        statuses = self.statuses or [None] * len(self.events)
        return [Event(self.node_id, self.boot, self.seq + i, event, status)
                for i, (event, status) in enumerate(zip(self.events, statuses, strict=True))]

    @classmethod
    def of(cls, events: list[Event], common: bool = False) -> Run:
        """The run of `events` (one node's boot, consecutive seqs: the caller's outbox); with
        `common` (a peer that set it), the fields they share said once."""
        first = events[0]
        statuses = [e.engine_status for e in events]
        bodies = [e.event for e in events]
        return cls(first.node_id, first.boot, first.seq, bodies,
                   statuses if any(s is not None for s in statuses) else None,
                   shared_fields(bodies) if common else None)


def _is_event_envelope(item: object) -> bool:
    """Whether `item` plainly has an event's envelope (the common case, checked quickly;
    anything else gets from_json's full check and its exact error)."""
    return type(item) is dict and item.get("kind") == Event.KIND and _plain_version(item.get("v"))


@dataclass(frozen=True)
class PlainEvents:
    """An "events" message as parsed, each of its items plainly a valid "event" message (what
    Events.from_json takes without a question): `plain.decode_plain` gives it to the coordinator,
    which takes a node's batch without an object per event. Not a message class of its own:
    `events()` gives the Events' events."""

    KIND: ClassVar[str] = "events"
    items: list[dict[str, Any]]

    def events(self) -> list[Event]:
        return [Event(i["node_id"], i["boot"], i["seq"], i["event"], i.get("engine_status"))
                for i in self.items]


def plain_events(obj: object) -> PlainEvents | None:
    """`obj` (parsed JSON) as PlainEvents, if it is plainly an "events" message; else None,
    and from_json() gives the answer."""
    if type(obj) is not dict or obj.get("kind") != Events.KIND or not _plain_version(obj.get("v")):
        return None
    items = obj.get("events")
    if type(items) is not list or not items:
        return None
    for item in items:   # (one call per event: a fleet-wide pause is 8,000 of them)
        if type(item) is not dict or not _plain_event_message(item, item.get):
            return None
    return PlainEvents(items)


def _plain_event_message(item: dict[str, Any], get: Callable[[str], Any]) -> bool:
    """Whether `item` (with its `get`) plainly is a whole valid "event" message."""
    return (get("kind") == Event.KIND and _plain_version(get("v"))
            and _plain_event(get("node_id"), get("boot"), get("seq"), get("event"),
                             get("engine_status")))


@dataclass(frozen=True)
class Ack(_Message):
    """Every event of `boot` up to `seq` has arrived: the node may forget them."""

    KIND: ClassVar[str] = "ack"
    boot: str
    seq: int
    batches: bool = False
    runs: bool = False   # 1.4
    common: bool = False   # 1.5
    lines: bool = False   # 1.6

    def __post_init__(self) -> None:
        _check_str(self.KIND, "boot", self.boot)
        _check_int(self.KIND, "seq", self.seq, 0)
        _check_bool(self.KIND, "batches", self.batches)
        _check_bool(self.KIND, "runs", self.runs)
        _check_bool(self.KIND, "common", self.common)
        _check_bool(self.KIND, "lines", self.lines)


@dataclass(frozen=True)
class Heartbeat(_Message):
    """Liveness, both ways; a peer silent past its deadline is unreachable."""

    KIND: ClassVar[str] = "heartbeat"
    sent_at: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "sent_at", _as_float(self.KIND, "sent_at", self.sent_at))


Message: TypeAlias = (Hello | Event | Events | Run | Ack | Heartbeat | Command | Reply
                      | Subscribe)
KINDS: dict[str, type[Message]] = {
    cls.KIND: cls for cls in (Hello, Event, Events, Run, Ack, Heartbeat, Command, Reply,
                              Subscribe)}


def encode(msg: Message, finite: bool = False) -> bytes:
    """One frame for `msg`; ProtocolError if it holds something JSON cannot carry or is too big.
    `finite`: every number in it is known to be finite (json_frame.dumps)."""
    try:
        data = dumps(msg.to_json(), finite)
    except (TypeError, ValueError, RecursionError) as exc:
        raise ProtocolError(f"{msg.KIND}: cannot encode: {exc}") from None
    if len(data) > MAX_MESSAGE_BYTES:
        raise MessageTooBig(f"{msg.KIND}: {len(data)} bytes exceeds the limit of "
                            f"{MAX_MESSAGE_BYTES} bytes")
    return data


def unsendable_code(exc: ProtocolError) -> str:
    """The code of a refusal to send what `encode` refused: too big, or not encodable."""
    return TOO_BIG if isinstance(exc, MessageTooBig) else BAD_ARGS


def from_json(obj: object) -> Message:
    """The message in an already-parsed JSON value: envelope checked, then its kind's fields."""
    if not isinstance(obj, dict):
        raise ProtocolError(f"a message is a JSON object, got {type(obj).__name__}")
    version = obj.get("v")
    if not _plain_version(version):   # (the common case in one check)
        if (not isinstance(version, list) or len(version) != 2
                or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0
                           for n in version)):
            raise ProtocolError(f"missing or malformed version 'v' (want [MAJOR, MINOR]), "
                                f"got {version!r:.60}")
        raise ProtocolError(f"unsupported protocol version {version[0]}.{version[1]}: this "
                            f"side speaks {MAJOR}")
    kind = obj.get("kind")
    if kind is None:
        raise ProtocolError("missing 'kind'")
    if not isinstance(kind, str) or kind not in KINDS:
        raise ProtocolError(f"unknown kind {kind!r:.60} (known: {', '.join(sorted(KINDS))})")
    return KINDS[kind].from_json(obj)


def decode(data: bytes) -> Message:
    """The message in one frame; ProtocolError (and nothing else) for anything invalid."""
    return message_in(parse(data, MAX_MESSAGE_BYTES))


def message_in(obj: object) -> Message:
    """from_json(), with a value nested too deeply to show in a refusal refused as such."""
    try:
        return from_json(obj)
    except RecursionError:  # showing a deeply nested value in a refusal
        raise ProtocolError("JSON nested too deeply") from None
