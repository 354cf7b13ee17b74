"""The refit's members a page at a time (protocol 1.3), both sides: pure logic, no I/O.

A fleet of 20,000 engines lists about 6 MB of members (more with long host names, URLs or
versions), far over one message (protocol.MAX_MESSAGE_BYTES). As `status` pages nodes,
`refit_acquire` and `refit_members` page members, for a client that says `paged: true`: each
answer holds about MEMBERS_PAGE_BYTES of them and `next`, the cursor of the following page
(null on the last), which `refit_members {after: NEXT}` takes. Every page of one listing comes
from the same list, kept with the lease (`Lease.listing`), so the pages add up to exactly the
members the lease holds: no engine twice, none missed, whatever the fleet did in between.

A client that does not page (before 1.3) gets the whole list in one answer, or, when it does
not fit, an error with code TOO_BIG naming the limit (an acquisition then leaves the lock
free): never the first page taken for the whole.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Callable
from typing import Any

from rollout_watchdog.common import protocol
from rollout_watchdog.common.errors import CommandRefused
from rollout_watchdog.common.validate import shorten
from rollout_watchdog.refit_bridge.fleet import STATUS_PAGE_BYTES

MEMBERS_PAGE_BYTES = STATUS_PAGE_BYTES   # half the message limit: room for the rest
PROBLEMS_CHARS = 20_000    # an acquisition's `pause_problems`, for people: cut beyond this
MAX_PAGES = 10_000         # a client stops after this many (a coordinator that loops)
Cursor = tuple[str, str]   # (node_id, engine id) of the last member of a page


def member_key(member: dict[str, Any]) -> Cursor:
    return (str(member["node_id"]), str(member["id"]))


def cursor(value: Any) -> Cursor:
    """An argument `after` (a kind of common.commands): the `next` of an earlier page, sent
    back as it came; ValueError saying what is wrong otherwise."""
    if isinstance(value, list) and len(value) == 2 and all(isinstance(p, str) for p in value):
        return (value[0], value[1])
    raise ValueError(f"must be the 'next' of an earlier page ([node_id, engine]), got "
                     f"{str(value)[:80]!r}")


def page(listing: list[dict[str, Any]], after: Cursor | None, paged: bool,
         max_bytes: int = MEMBERS_PAGE_BYTES) -> dict[str, Any]:
    """`{members, next}`: the members of `listing` (sorted by member_key) after `after`, as
    many as fit in about `max_bytes` of JSON (at least one); `next` is null on the last page.
    Not `paged`: the whole listing, and no `next` (a client before 1.3 knows none)."""
    if not paged:
        return {"members": listing}
    start = 0 if after is None else bisect.bisect_right(listing, after, key=member_key)
    size, end = 0, start
    while end < len(listing):
        size += len(json.dumps(listing[end], separators=(",", ":")))
        if end > start and size > max_bytes:
            break
        end += 1
    chunk = listing[start:end]
    return {"members": chunk,
            "next": list(member_key(chunk[-1])) if end < len(listing) else None}


def cut(text: str | None, limit: int = PROBLEMS_CHARS) -> str | None:
    """`text` cut to `limit` characters, saying so (a text for people, never data)."""
    return None if text is None else shorten(text, limit)


# ---------------------------------------------------------------------- the client's side

def field_of(result: dict[str, Any], name: str, kind: type, cmd: str) -> Any:
    """`result[name]`, of `kind`; CommandRefused naming what is wrong otherwise (an answer cut
    down to fit one message by a coordinator before 1.2 says so)."""
    value = result.get(name)
    if value is not None and isinstance(value, kind) and (kind is object
                                                          or not isinstance(value, bool)):
        return value
    cut_down = result.get("results_left_out") is True
    raise CommandRefused(
        f"the coordinator's answer to {cmd} lacks its {name!r}" + (
            " (left out: the answer was too big for one message; a lock it took is let go "
            "when its holder is silent for 5 s)" if cut_down else f": {str(result)[:80]}"),
        code=protocol.TOO_BIG if cut_down else None)


def checked(members: list[Any]) -> list[dict[str, Any]]:
    """The members of an answer, checked."""
    for m in members:
        if not isinstance(m, dict) or not isinstance(m.get("node_id"), str) \
                or not isinstance(m.get("id"), str):
            raise CommandRefused(f"the coordinator's answer names a member badly: "
                                 f"{str(m)[:80]}")
    return members


def collect(first: dict[str, Any], cmd: str, more: Callable[[Any], dict[str, Any]]
            ) -> list[dict[str, Any]]:
    """Every member of a listing whose first page is `first` (the answer to `cmd`), asking
    `more(cursor)` (`refit_members {after: cursor}`) for each following page. An answer with
    no `next` (the last page, or a coordinator before 1.3) ends it. CommandRefused for a page
    that is not one, or a cursor that does not move on."""
    members = list(checked(field_of(first, "members", list, cmd)))   # (a copy)
    cursor = first.get("next")
    pages = 1
    while cursor is not None:
        if pages >= MAX_PAGES:
            raise CommandRefused(f"the coordinator's members of {cmd} did not end within "
                                 f"{MAX_PAGES} pages")
        answer = more(cursor)
        chunk = checked(field_of(answer, "members", list, "refit_members"))
        following = answer.get("next")
        if not chunk or following == cursor:
            raise CommandRefused(f"the coordinator's page of members after {str(cursor)[:80]} "
                                 "does not move on")
        members += chunk
        cursor, pages = following, pages + 1
    return members


__all__ = ["MEMBERS_PAGE_BYTES", "collect", "cursor", "cut", "page"]
