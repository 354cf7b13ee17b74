"""What the hub judges of a node's frames by their bytes: whether an event is over the size the
coordinator takes, and whether a batch or run may be taken and relayed whole (each event in it,
split out or encoded again for a client that takes less, surely fits in a frame) or must go
event by event, each checked alone."""

from __future__ import annotations

from rollout_watchdog.agent.hub_policy import Refused
from rollout_watchdog.common import protocol


def check_size(event: protocol.Event, size: int, node: str) -> None:
    """Refused: an event over MAX_EVENT_BYTES (a node cuts its own to fit, so this one came
    from a hostile or broken node); never applied, relayed or journaled."""
    if size > protocol.MAX_EVENT_BYTES:
        raise Refused("oversized_event", f"event {event.seq} of node {node!r}: {size} bytes, "
                                         f"over the limit of {protocol.MAX_EVENT_BYTES}")


def encoded_size(event: protocol.Event) -> int:
    try:
        return len(protocol.encode(event))
    except protocol.ProtocolError:   # over the message limit once encoded again
        return protocol.MAX_MESSAGE_BYTES + 1


def expands_small(has_common: bool, count: int) -> bool:
    """Whether a run's events, each given its `common` fields again, stay within a few times
    its frame: a node's runs hold at most BATCH_EVENTS; a longer one with `common` (hostile or
    broken) could stand for events of thousands of times its bytes, and goes event by event."""
    return not has_common or count <= protocol.BATCH_EVENTS


def reencodes_small(frame: bytes) -> bool:
    """Whether each event of this "events" frame, encoded again on its own, surely fits in a
    frame: re-encoding ASCII JSON at most about quintuples it (a float written 1e9 comes back
    as 1000000000.0), and nodes send ASCII frames of at most BATCH_BYTES."""
    return len(frame) <= protocol.MAX_MESSAGE_BYTES // 8 and frame.isascii()
