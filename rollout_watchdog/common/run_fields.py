"""The fields of a "run" message's events (protocol.py is the spec): the plain check of the
coordinator's hot path, and `common` (1.5), the fields that every event of a run shares, said
once. A fleet-wide pause's run of 8 "paused" events shares all but the engine and the time:
said once, its frame is a quarter of the bytes to encode, send, parse, relay and journal."""

from __future__ import annotations

from typing import Any

from rollout_watchdog.common.json_frame import ProtocolError
from rollout_watchdog.common.message_base import _INT_LIMIT

_DICT = {dict}
_SCALARS = (str, int, float, bool, type(None))
_ABSENT = object()


def plain_run(node_id: object, boot: object, seq: object, events: object, statuses: object,
              common: object) -> bool:
    """Whether a run's fields are plainly valid (the coordinator's hot path: one check per
    event, that it is an object); anything else gets Run's full checks and their exact error."""
    return (type(node_id) is str and node_id != "" and type(boot) is str and boot != ""
            and type(seq) is int and type(events) is list and events != []
            and 1 <= seq <= _INT_LIMIT - len(events) and set(map(type, events)) == _DICT
            and (common is None or type(common) is dict)
            and (statuses is None or (type(statuses) is list and len(statuses) == len(events)
                                      and all(s is None or (type(s) is dict
                                                            and type(s.get("id")) is str
                                                            and s["id"] != "")
                                              for s in statuses))))


def shared_fields(events: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The fields with one scalar value (of one type: 1 is not 1.0 or true) in every event;
    None when there are none, or a single event."""
    if len(events) < 2:
        return None
    shared = {key: value for key, value in events[0].items() if type(value) in _SCALARS}
    for event in events[1:]:
        for key in [key for key, value in shared.items()   # (inline: ~100 a run)
                    if (other := event.get(key, _ABSENT)) is not value
                    and (type(other) is not type(value) or other != value)]:
            del shared[key]
        if not shared:
            return None
    return shared


def expanded(common: object, events: object) -> object:
    """The events of a run that said `common`: each is common's fields, then its own (its own
    win). What is not a list of objects is left as it is, for Run's checks to name."""
    if type(common) is not dict:
        raise ProtocolError(f"run: field 'common' must be an object, got {common!r:.60}")
    if type(events) is not list:
        return events
    return [{**common, **event} if type(event) is dict else event for event in events]


def own_fields(event: dict[str, Any], common: dict[str, Any]) -> dict[str, Any]:
    """An event's fields as a run that says `common` carries it: those common does not say."""
    return {key: value for key, value in event.items()
            if key not in common or ((shared := common[key]) is not value
                                     and (type(shared) is not type(value) or shared != value))}
