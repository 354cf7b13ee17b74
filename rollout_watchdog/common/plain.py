"""The coordinator's decode of a node's frame (protocol.py is the spec): a node's events as
parsed, with no object per event. A fleet-wide pause is 1,000 runs of 8 events: a plain
"events" batch comes as `protocol.PlainEvents`, and a "run" always as `PlainRun`, whose events
are left as the frame says them, their `common` fields (1.5) not merged into each.
"""

from __future__ import annotations

from typing import Any, ClassVar

from rollout_watchdog.common.json_frame import parse
from rollout_watchdog.common.message_base import _plain_version
from rollout_watchdog.common.protocol import (
    MAX_MESSAGE_BYTES,
    Message,
    PlainEvents,
    Run,
    message_in,
    plain_events,
)
from rollout_watchdog.common.run_fields import expanded, plain_run


class PlainRun:
    """A "run" message, plainly valid (`run_fields.plain_run`), as parsed: `events` are each
    event's own fields and `common` those said once for all (None: the frame said none). An
    event's field is its own, else common's (`protocol.Run` merges them: an object per event).
    `run()` is the whole message."""

    KIND: ClassVar[str] = Run.KIND
    __slots__ = ("node_id", "boot", "seq", "events", "statuses", "common")

    def __init__(self, node_id: str, boot: str, seq: int, events: list[dict[str, Any]],
                 statuses: list[dict[str, Any] | None] | None,
                 common: dict[str, Any] | None) -> None:
        self.node_id, self.boot, self.seq = node_id, boot, seq
        self.events, self.statuses, self.common = events, statuses, common

    def run(self) -> Run:
        """The whole message: each event with common's fields merged in."""
        events = self.events if self.common is None else expanded(self.common, self.events)
        return Run(self.node_id, self.boot, self.seq, events,  # type: ignore[arg-type]
                   self.statuses, self.common)


def plain_run_message(obj: object) -> PlainRun | None:
    """`obj` (parsed JSON) as a PlainRun, if it is plainly a "run" message; else None, and
    from_json() gives the answer."""
    if type(obj) is not dict or obj.get("kind") != Run.KIND or not _plain_version(obj.get("v")):
        return None
    get = obj.get
    node_id, boot, seq = get("node_id"), get("boot"), get("seq")
    events, statuses, common = get("events"), get("statuses"), get("common")
    if not plain_run(node_id, boot, seq, events, statuses, common):
        return None
    return PlainRun(node_id, boot, seq, events, statuses, common)  # type: ignore[arg-type]


def decode_plain(data: bytes) -> Message | PlainEvents | PlainRun:
    """protocol.decode(), but a plain "events" message as PlainEvents and a "run" as PlainRun
    (every valid run is plain: Run's checks take no other), ProtocolError (and nothing else)
    for anything invalid."""
    obj = parse(data, MAX_MESSAGE_BYTES)
    return plain_events(obj) or plain_run_message(obj) or message_in(obj)
