"""How a refit's lease ends at the coordinator: its members' weights settled, then its deep-probe
pause lifted on every node.

A lease that ends with members neither committed nor aborted (it ran out, its holder went
silent, or released without either) leaves them with unknown weights and maybe paused: they
are marked stale and put back in service off the loop (putback.py) before its pause is lifted,
as a dead trainer's paused generation must not fail their deep probes. A lease committed
without a release that then ends has its members' generation continued the same way (they hold
the committed version). Until a put-back ended, the lock is held by `coordinator`, and the
state on disk keeps its lease (a restarted coordinator puts them back again).

A lease of an earlier start (found on disk, or one its holder lost to a restart and asks to be
put back: service.py, refit_putback) first waits, held, until its members' nodes are back:
before their hellos the view knows no member's URL.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rollout_watchdog.agent.fanout import Gathering
from rollout_watchdog.common import protocol
from rollout_watchdog.refit_bridge import membership
from rollout_watchdog.refit_bridge.lock import Lease, LockHeld, RefitLock
from rollout_watchdog.refit_bridge.putback import PUTBACK_CALL_S, PutBack
from rollout_watchdog.refit_bridge.refit_call import Core, RefitError
from rollout_watchdog.refit_bridge.weights import Member, WeightBook

log = logging.getLogger(__name__)
# A release answers once its resume is acknowledged, or after this: a node that does not answer
# must not hold the holder's block (timeout_s bounds the refit, its teardown included).
RESUME_ANSWER_S = 1.0
# A release's node commands; a node that does not answer the resume in time is owed it.
RELEASE_TIMEOUT_S = 5.0
PUTBACK_POLL_S = 0.1         # how often the loop looks whether a put-back ended
MAX_PUTBACK = 65_536         # members one refit_putback names in all (its pages)


@dataclass
class Waiting:
    """A lease of an earlier start, held until its members' nodes are back, then ended as an
    expiry would. `asked`: the token of the holder that asked for it (refit_putback), whose
    further pages of members (`more`) it waits for too."""

    lease: Lease
    why: str
    since: float | None = None   # monotonic; None: the loop's start
    asked: str | None = None
    more: bool = False
    _taken: set[Member] = field(default_factory=set)

    def take(self, members: list[Member]) -> list[Member]:
        """A page of the members: those new to it (refused past MAX_PUTBACK in all)."""
        new = [m for m in members if m not in self._taken]
        if len(self._taken) + len(new) > MAX_PUTBACK:
            raise ValueError(f"a put-back takes at most {MAX_PUTBACK} members")
        self._taken.update(new)
        self.lease.members += new
        return new

    def end_members(self, core: Core) -> None:
        """Once due: an asked-for put-back keeps the members its view shows paused (the
        others were not left paused by that lease, or are gone)."""
        if self.asked is not None:
            self.lease.members = membership.paused(core.view, self.lease.members)

    def due(self, core: Core, now: float) -> bool:
        since = core.started_at if self.since is None else self.since
        if self.more:
            return now - since >= membership.RESTORED_WAIT_S
        return membership.restored_due(core.view, self.lease.members + self.lease.continuing,
                                       since, now)


@dataclass
class Releasing:
    """A release's answer: sent once its resume is acknowledged, or at `deadline`."""

    client: bytes       # a retry of the request moves the answer to its socket
    deadline: float     # monotonic
    send: Callable[[bytes], None]


class LeaseEnd:
    """The ends of leases: at most one put-back at a time (the lock is held meanwhile), and
    the releases whose answer waits for their resume."""

    def __init__(self, book: WeightBook, save: Callable[[], None]) -> None:
        self.book = book
        self._save = save   # the state changed (it names `putting_back`'s lease while there is one)
        self._putback: tuple[PutBack, Lease] | None = None
        self._releasing: dict[str, Releasing] = {}   # by the release's request id
        self.waiting: Waiting | None = None   # (its lease is the lock's)
        # Why a later refit_putback is not done: one was, since this start.
        self._asked_here: str | None = None

    def asked(self, core: Core, lock: RefitLock, afresh: bool, args: dict[str, Any],
              now: float) -> dict[str, Any]:
        """refit_putback (service.py): `args` checked; `afresh`: this coordinator started
        with no refit state. Only one holder's per start (one lease at a time was held when
        it stopped), at most MAX_PUTBACK members: stale at once (a restarted coordinator
        without state would route them, half updated), put back once their nodes are back
        if the view shows them paused then."""
        token, holder, members = args["token"], args["holder"], list(dict.fromkeys(args["members"]))
        if len(members) > MAX_PUTBACK:   # (before it takes this start's one request)
            raise ValueError(f"a put-back takes at most {MAX_PUTBACK} members")
        waiting = self.waiting
        if waiting is None or (token, holder) != (waiting.asked, waiting.lease.holder):
            because = self._first_ask(lock, afresh, token, holder, args["version"], now)
            if because is not None:
                return {"put_back": 0, "because": because}
            waiting = self.waiting
            assert waiting is not None
        taken = waiting.take(members)
        waiting.more = args["more"]
        self.book.stale(taken)
        core.weights_changed()
        return {"put_back": len(taken)}

    def _first_ask(self, lock: RefitLock, afresh: bool, token: str, holder: str, version: str,
                   now: float) -> str | None:
        """Hold the lock for the lost lease of `token` if nobody can have put its members
        back (None); else why not, saying who did (or raise the refusal of a held lock)."""
        held = lock.lease
        if held is not None and (token, holder) == (held.token, held.holder):
            raise ValueError("this holder holds the lock: it aborts its refit (refit_abort)")
        refusal = self.refusal()
        if refusal is not None:
            raise refusal
        if held is not None:
            raise held_refusal(LockHeld(held, now))
        because = (self._asked_here or lock.ended_lease(token) if afresh else
                   "this coordinator's state knew that refit: its end put them back")
        if because is not None:
            return because
        lease = lock.hold_for(holder, token, version, [], now)
        self.waiting = Waiting(lease, "its holder lost it to a coordinator restart and asked "
                               "for its members to be put back", now, token)
        self._asked_here = (f"{holder} asked for refit #{lease.number}'s members since this "
                            "coordinator started: that put-back covers those left paused")
        log.warning("%s, whose refit #%d was lost to a coordinator restart, asks that its "
                    "members be put back in service once their nodes are back", holder,
                    lease.number)
        return None

    def released(self, core: Core, lease: Lease, now: float, request_id: str, client: bytes,
                 send: Callable[[bytes], None]) -> None:
        """`lease` released by its holder: ended, and `send(client)` run once every node its
        resume went to acknowledged it (or RESUME_ANSWER_S passed): the holder's `with` block
        ends with its probes resumed, as DESIGN's refit says."""
        self._releasing[request_id] = Releasing(client, now + RESUME_ANSWER_S, send)
        self.end(core, lease, now, "released by its holder", expired=False,
                 resumed=lambda: self._answer(request_id))

    def retried(self, request_id: str, client: bytes) -> bool:
        """A retry of a release whose answer waits for its resume: it goes to `client` (the
        retry's socket) when it comes; True if there is one."""
        releasing = self._releasing.get(request_id)
        if releasing is not None:
            releasing.client = client
        return releasing is not None

    def _answer(self, request_id: str) -> None:
        """(Once: at the resume's acknowledgement or at the deadline, the first.)"""
        releasing = self._releasing.pop(request_id, None)
        if releasing is not None:
            releasing.send(releasing.client)

    @property
    def putting_back(self) -> Lease | None:
        """The lease whose members are being put back (the lock is not free until then)."""
        return None if self._putback is None else self._putback[1]

    def holder(self) -> dict[str, Any] | None:
        """Who holds the lock while a put-back runs (`ping`'s and a refusal's holder)."""
        lease = self.putting_back
        return None if lease is None else {"holder": "coordinator", "version": lease.version,
                                           "expires_in_s": 2 * PUTBACK_CALL_S}

    def refusal(self) -> RefitError | None:
        """An acquisition's refusal while a put-back runs (None: none runs)."""
        lease = self.putting_back
        if lease is None:
            return None
        return RefitError(f"the refit lock is held by the coordinator: it puts the members of "
                          f"refit #{lease.number} (by {lease.holder}, which neither committed "
                          "nor aborted) back in service", self.holder(), protocol.LOCK_HELD)

    def end(self, core: Core, lease: Lease, now: float, why: str, expired: bool,
            resumed: Callable[[], None] | None = None) -> None:
        """`lease` is over: its members' weights settled, then its pause lifted (`resumed`
        runs once the nodes acknowledged that; at once when a put-back comes first, which
        takes its time)."""
        core.refit_ended("committed" if lease.committed else "aborted" if lease.aborted
                         else "expired" if expired else "released", now - lease.taken)
        if lease.members:
            # Neither committed nor aborted: its weights are unknown, and its holder may have
            # left their generation paused.
            log.warning("refit %r (refit #%d) ended uncommitted (%s): putting its member(s) "
                        "back in service, stale", lease.version, lease.number, why)
            self.put_back(core, lease, lease.members, stale=True)
        elif expired and lease.continuing:
            # Committed, and its holder gone before it continued their generation: they
            # hold the fleet's version, paused.
            log.warning("refit %r (refit #%d) ended committed but unreleased (%s): continuing "
                        "generation on its member(s)", lease.version, lease.number, why)
            self.put_back(core, lease, lease.continuing, stale=False)
        else:
            self._save()
            self.resume(core, lease, now, resumed)
            return
        if resumed is not None:
            resumed()

    def put_back(self, core: Core, lease: Lease, members: list[Member], stale: bool) -> None:
        """Put these members of `lease` back in service (`stale`: marked so first; those no
        longer in the view are left: a replaced incarnation is not paused), then lift its
        pause."""
        urls = membership.member_urls(core.view, members)
        if stale:
            self.book.stale(members)
            core.weights_changed()
        self._putback = (PutBack(f"refit #{lease.number}", urls), lease)
        self._save()   # (with the put-back's lease: a restart puts them back again)

    def tick(self, core: Core, now: float) -> None:
        """Releases past their wait answered; once a put-back ended, the state forgets its
        lease and its pause is lifted."""
        for request_id in [r for r, wait in self._releasing.items() if now >= wait.deadline]:
            self._answer(request_id)
        if self._putback is not None and self._putback[0].done():
            lease = self._putback[1]
            self._putback = None
            self._save()
            self.resume(core, lease, now)

    def next_deadline(self, now: float) -> float | None:
        putback = None if self._putback is None else now + PUTBACK_POLL_S
        releasing = min((wait.deadline for wait in self._releasing.values()), default=None)
        return min((d for d in (putback, releasing) if d is not None), default=None)

    def resume(self, core: Core, lease: Lease, now: float,
               resumed: Callable[[], None] | None = None) -> None:
        """Lift the refit's own pause on every reachable node (its owner tag: a pause by
        finish_generation, or by a later refit, stays); `resumed` runs once they all
        acknowledged it, or the gathering's bound passed. A node that did not is owed it."""
        resume = protocol.Command(f"refit-resume-{uuid.uuid4().hex}", "resume",
                                  {"all": True, "owner": lease.pause_owner}, None, None,
                                  RELEASE_TIMEOUT_S)

        def finish(gathering: Gathering) -> protocol.Reply | None:
            core.resume_owed(lease.pause_owner, [n for n in core.view.nodes if gathering.answers
                                                 .get(n, {}).get("status") != "ok"])
            if resumed is not None:
                resumed()
            return gathering.reply()
        core.gather(None, resume, core.view.reachable(), now, finish)


def held_refusal(exc: LockHeld) -> RefitError:
    """The refusal of a call while another holds the lock: naming it, never its token."""
    return RefitError(str(exc), {"holder": exc.lease.holder, "version": exc.lease.version,
                                 "expires_in_s": exc.expires_in_s}, protocol.LOCK_HELD)


__all__ = ["LeaseEnd", "PUTBACK_POLL_S", "RELEASE_TIMEOUT_S", "RESUME_ANSWER_S", "Releasing",
           "Waiting", "held_refusal"]
