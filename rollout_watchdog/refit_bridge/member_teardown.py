"""What a refit that did not commit whole does to its members, in the trainer: which of them take
control calls again (continued: only stale) and which are still blocked in the collective
(wedged: restarted by their watchdogs), their generation continued, and, once its lease is
lost, the coordinator asked to put them back; and which members a commit found gone.

It exists apart from refit.py because these are questions put to the members and to the
coordinator's answers, not the refit's course: refit.py decides when, this module says who.
"""

from __future__ import annotations

import logging
from collections.abc import Container
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from rollout_watchdog.common.errors import RolloutWatchdogError
from rollout_watchdog.refit_bridge import engine_calls
from rollout_watchdog.refit_bridge.refit_state import Member
from rollout_watchdog.refit_bridge.views import EngineView
from rollout_watchdog.refit_bridge.weights import members_of

if TYPE_CHECKING:
    from rollout_watchdog.refit_bridge.client import FleetClient

log = logging.getLogger(__name__)
# After an abort: a member whose /server_info is not answered this long is stuck in the
# collective (a gloo peer freed by the teardown answers within half a second).
ABORT_GRACE_S = 1.0
WEDGED = ("its update call did not complete and it takes no control call (wedged in the "
          "collective)")
GONE = "gone (its server refuses connections)"
# Members a refit_putback names at most (one message holds 2,000 with long host names).
PUTBACK_PAGE = 2000


def member(engine: EngineView) -> Member:
    return (engine.node_id, engine.id, engine.incarnation)


@dataclass
class Responsive:
    """The members as an abort finds them once the group is torn down."""

    to_continue: set[str] = field(default_factory=set)   # their URLs
    wedged: list[Member] = field(default_factory=list)   # blocked in the collective
    gone: list[Member] = field(default_factory=list)     # their server refuses connections


def responsive(engines: list[EngineView], in_group: set[str], lost: Container[Member]
               ) -> Responsive:
    """Every member that takes a control call is continued, lost or not (first, in a group,
    its session is ended and its side destroyed): one lost for an error it answered would
    otherwise stay paused. A member of the group (`in_group`: their URLs) that takes none
    within ABORT_GRACE_S is still blocked in the collective (a gloo peer is usually freed by
    the teardown, but one waiting on a dead peer in gloo's tree is not; an NCCL one waits out
    its timeout): wedged, unless already `lost`. Without a group nothing can block it, so a
    slow one is only slow: it is continued too, within the call timeout."""
    state: dict[str, str] = {}
    engine_calls.on_each([str(e.url) for e in engines], lambda url: state.__setitem__(
        url, engine_calls.responsiveness(url, ABORT_GRACE_S)))
    found = Responsive({url for url, how in state.items()
                        if how == "ok" or (how == "stuck" and url not in in_group)})
    for engine in engines:
        how = state.get(str(engine.url))
        if how == "stuck" and str(engine.url) in in_group and member(engine) not in lost:
            found.wedged.append(member(engine))
        elif how == "gone":
            found.gone.append(member(engine))
    return found


def continue_generation(urls: set[str], version: str, timeout_s: float) -> None:
    """Let these members (their URLs) generate again; a failure is logged (the member is not
    lost for it: its weights are what counts)."""
    def one(url: str) -> None:
        try:
            engine_calls.post(url, "/continue_generation", {}, timeout_s)
        except RolloutWatchdogError as exc:
            log.warning("refit %r: continue_generation: %s", version, exc)
    engine_calls.on_each(sorted(urls), one)


def ask_put_back(client: FleetClient, holder: str, token: object, version: str,
                 engines: list[EngineView], timeout_s: float) -> None:
    """Ask the coordinator to put back the members a refit left paused, its lease lost. It
    does so only if nobody can have (service.py, refit_putback), checked and begun in one
    step: continuing them here after asking whether the lock is free would continue a next
    holder's paused members, had one taken the lock in between."""
    rows = [list(member(e)) for e in engines]
    pages = [rows[i:i + PUTBACK_PAGE] for i in range(0, len(rows), PUTBACK_PAGE)]
    for number, page in enumerate(pages, 1):
        try:
            _, result = client.call("refit_putback", {
                "holder": holder, "token": token, "version": version, "members": page,
                "more": number < len(pages)}, timeout_s=timeout_s)
        except RolloutWatchdogError as exc:
            log.warning("refit %r: its lease lost, the coordinator did not put its members "
                        "back (the next refit, or their watchdogs, do): %s", version, exc)
            return
        answer = result if isinstance(result, dict) else {}
        if answer.get("because"):
            log.info("refit %r: its lease lost; its members are not put back again (%s)",
                     version, answer["because"])
            return
    log.info("refit %r: its lease lost, the coordinator took its %d member(s): stale, and "
             "those still paused put back in service once their nodes are back", version,
             len(rows))


def gone_at_commit(ok: list[EngineView], result: object) -> list[tuple[EngineView, str]]:
    """Those of `ok` that a commit's answer (or refusal) names `gone`: stopped or relaunched
    after their read-back, as the coordinator's view showed at the commit (not recorded)."""
    rows = result.get("gone") if isinstance(result, dict) else None
    try:
        gone = set(members_of(rows)) if rows is not None else set()
    except ValueError:
        gone = set()
    return [(e, "stopped or relaunched before the commit (the coordinator did not record it)")
            for e in ok if member(e) in gone]


__all__ = ["ABORT_GRACE_S", "GONE", "Responsive", "WEDGED", "ask_put_back",
           "continue_generation", "gone_at_commit", "member", "responsive"]
