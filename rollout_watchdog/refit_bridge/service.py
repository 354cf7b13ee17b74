"""The coordinator's refit commands: the lock, membership (membership.py) and the weight book.

The wire spec (each a COMMAND to the coordinator; every reply carries status and reason). A
refit-scoped call carries the `holder` that took the lock and its `token`, an opaque string
shown to that holder only (never in a refusal, `ping` or `status`) and never handed out again,
also by a restarted coordinator; a call whose pair is not the current holder's is refused with a
reason starting "lease lost" (code LEASE_LOST). Every error reply carries a code
(protocol.CODES). A `version` is 1 to 256 printable characters. Each command's arguments are
declared with its handler (`COMMANDS`, `common.commands`) and checked before it runs: a
malformed one is refused naming it (code BAD_ARGS).

- `refit_acquire {holder, version, lease_s, deadline_s, paged?}`: take the lock. Pauses deep
  probes on every reachable node with the refit's own owner tag (answering once in-flight
  probes ended, as `pause --all` does; nodes resume by themselves after `deadline_s` if nothing
  else resumes them), relaunches `deferred` engines that wait for it, and answers `{token,
  lease_s, version, members, next, relaunched, pause_problems}`. `members` are the engines the
  refit updates: healthy, on reachable nodes, serving or `pending_weights`, with a server no
  other running engine advertises (membership.shared_urls: logged, never a member) (each `{node_id,
  id, incarnation, url, tp_size, process, weight_version}`; `process` names the main process,
  as the node's status does, null from an older node), in order of node id, then engine id.
  `pause_problems` (for people) is cut at 20,000 characters. Held by another: an error
  (LOCK_HELD) naming the holder, with `{holder, version, expires_in_s}`.
- Pages (1.3, member_pages.py): with `paged: true`, `members` is the first page (about 512 KiB)
  and `next` the cursor of the following one, null on the last; `refit_members {holder, token,
  after: NEXT}` answers `{members, next}`, the next page of that same listing. Without `paged`
  (a client before 1.3): every member in one answer, no `next`; when they do not fit, an error
  (TOO_BIG) naming the limit, and an acquisition leaves the lock free. No answer is ever cut to
  fit: any other reply too big for a message is a TOO_BIG error too (agent/fanout.py).
- `refit_members {holder, token, paged?, after?}`: without `after`, the members listed afresh,
  now including the relaunched engines that have become healthy (the lease holds those from
  then on); an engine that comes back otherwise waits for the next refit (admission is frozen
  while the lock is held). Paged as above.
- `refit_renew {holder, token}`: extend the lease by its `lease_s`; `{expires_in_s}`.
- `refit_commit {holder, token, version, members, release}`: these `[node, engine,
  incarnation]` hold `version` now, which becomes the fleet's current version; the router gets
  them. Answers `{version, members}`, and `gone` (after 1.6), those it did not record: the
  view shows them stopped or relaunched since (their update is lost; none left: an error,
  nothing committed, with `{gone}`). With `release: true`, the lock is released too, as
  `refit_release` does (one round trip fewer). 1.3: `members_except` instead of `members`
  names those of the last listing that do not (20,000 members with long host names are more
  than one message).
- `refit_abort {holder, token, members?, wedged, reason}`: the refit failed; every member
  (without `members`: every member of the last listing) is stale until a later commit; each
  `wedged` member is restarted by its watchdog with cause `refit_wedged`.
- `refit_putback {holder, token, version, members, more?}` (after 1.6): the holder of a lease
  lost to a coordinator restart asks that these `[node, engine, incarnation]`, which it left
  paused, be put back in service. Done only if nobody can have done it: this coordinator
  started without refit state (no state dir, or no refit.json in it), after that lease (its
  token is of an earlier start), and granted no lease and took no other put-back since. Then
  the members are stale at once, the lock is held for that lease (refused as held by its
  holder) until their nodes are back (at most RESTORED_WAIT_S, 60 s), and it ends as an
  expiry would (below) for the members the view shows with deep probes paused, its pause
  (the owner tag derives from the token) lifted. Answers `{put_back}`, the members it took, or 0
  with `because`; held by another: LOCK_HELD (that holder continues them). `more: true`: a
  page, more to come (2,000 a message; 65,536 in all). Checked and begun in one step on the
  loop: it never continues the paused members of a lease this coordinator granted.
- `refit_release {holder, token}`: end the refit; the refit's own pause is lifted on every
  reachable node (`resume` with its owner tag: a node paused by `finish_generation` too stays
  paused until `prepare_for_generation`, as a colocated engine may not have its KV cache back).
  Answered `{released}` once those nodes acknowledged it (or RESUME_ANSWER_S, 1 s, passed: the
  holder's `timeout_s` bounds its teardown too), so the holder's block ends with its probes
  resumed; a commit with `release` likewise.

A lease that ends with members neither committed nor aborted (it ran out, its holder went
silent, or released without either) has them marked stale and put back in service before its
pause is lifted; one committed without `release` has their generation continued (lease_end.py
says how). Until then the lock is refused as held by `coordinator` (so `ping`'s holder says).

With a state dir, every reply waits until the state it reports is on disk (refit.json, written
off the loop by durable.DurableWriter: the members of a refit in flight must be known stale
after a crash). A write that fails, or takes longer than `state_write_timeout_s`, turns the reply
into an error naming the file: `refit_acquire` then leaves the lock free; any other call took
effect, but a restarted coordinator would not know it.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

from rollout_watchdog.agent.fanout import Gathering
from rollout_watchdog.common import protocol
from rollout_watchdog.common.commands import Arg, Registry, flag, number, rule, text
from rollout_watchdog.common.replies import CommandError
from rollout_watchdog.refit_bridge import member_pages, membership
from rollout_watchdog.refit_bridge.durable import STATE_WRITE_TIMEOUT_S
from rollout_watchdog.refit_bridge.lease_end import (
    RELEASE_TIMEOUT_S,
    LeaseEnd,
    Waiting,
    held_refusal,
)
from rollout_watchdog.refit_bridge.lock import (
    HOLDER_TIMEOUT_S,
    Fenced,
    Lease,
    LockHeld,
    RefitLock,
    token_problem,
)
from rollout_watchdog.refit_bridge.refit_call import Call, Core, RefitError
from rollout_watchdog.refit_bridge.save_gate import SaveGate, answer_saved
from rollout_watchdog.refit_bridge.weights import (
    Member,
    RefitState,
    WeightBook,
    members_of,
    version_problem,
)

log = logging.getLogger(__name__)
PAUSE_WAIT_S = 30.0          # in-flight probes end within their timeout; 30 s is the default
# A handler answers with its result, or None when it answers by itself (refit_acquire).
Handler = Callable[["RefitService", Call], "dict[str, Any] | None"]
COMMANDS: Registry[Handler] = Registry("the coordinator")
# The holder and its token are checked by the lock (a pair that is not the holder's: LEASE_LOST).
FENCE = (Arg("holder", lambda v: v), Arg("token", lambda v: v))
VERSION = Arg("version", rule(version_problem), required=True)


class RefitService:
    def __init__(self, state_dir: str | None, holder_timeout_s: float = HOLDER_TIMEOUT_S,
                 state_write_timeout_s: float = STATE_WRITE_TIMEOUT_S,
                 route_after_first_refit: bool = False) -> None:
        self.state = RefitState(state_dir)
        self.saves = SaveGate(self.state, state_write_timeout_s)
        self.book, next_token, in_flight, unfinished = self.state.load()
        self.book.disk_weights_serve = not route_after_first_refit
        if in_flight:
            log.warning("a refit was in flight when the coordinator stopped: %d engine(s) are "
                        "stale until the next refit commits", len(in_flight))
            self.book.stale(in_flight)
        self.lock = RefitLock(next_token, holder_timeout_s)
        self.relaunched: list[tuple[str, str]] = []
        self.ending = LeaseEnd(self.book, self._save)
        if unfinished is not None:   # the lease held when it stopped: ended as if expired
            self.ending.waiting = Waiting(self.lock.restore(unfinished, in_flight,
                                                            time.monotonic()),
                                          "the coordinator stopped during it")
        if self.state.writer is not None:
            try:
                self.state.writer.write_now(self._content())
            except OSError as exc:
                raise ValueError(f"cannot write the refit state {self.state.path}: {exc}"
                                 ) from None

    @property
    def wakeup_fd(self) -> int | None:
        """Readable when a write of the state ended: the loop then calls `saved`."""
        return self.saves.wakeup_fd

    def saved(self, now: float) -> None:
        self.saves.saved(now)

    def close(self) -> None:
        self.saves.close()

    # ------------------------------------------------------------------ commands

    def handle(self, core: Core, client: bytes, cmd: protocol.Command, now: float) -> None:
        if self.saves.retried(cmd.request_id, client):   # a retry while its save is under way
            return
        if self.ending.retried(cmd.request_id, client):   # while its resume is under way
            return
        try:
            spec = COMMANDS.lookup(cmd.cmd)
            result = spec.handler(self, Call(core, client, cmd, spec.validate(cmd.args), now))
        except RefitError as exc:
            core.reply(client, protocol.Reply(cmd.request_id, "error", str(exc), exc.result,
                                              exc.code))
            return
        except CommandError as exc:   # an argument refused (BAD_ARGS), an unknown command
            core.reply(client, protocol.Reply(cmd.request_id, "error", str(exc), None,
                                              exc.code or protocol.BAD_ARGS))
            return
        except (Fenced, ValueError) as exc:
            code = protocol.LEASE_LOST if isinstance(exc, Fenced) else protocol.BAD_ARGS
            core.reply(client, protocol.Reply(cmd.request_id, "error", str(exc), None, code))
            return
        if result is not None:   # (None: it answers by itself)
            self.saves.once_saved(cmd.request_id, client, answer_saved(core.reply, cmd, result))

    @COMMANDS.command("refit_acquire", Arg("holder", text(), required=True), VERSION,
                      Arg("lease_s", number(0, above=True), 30.0),
                      Arg("deadline_s", number(0, above=True), 600.0), Arg("paged", flag, False))
    def _acquire(self, call: Call) -> None:
        """Take the lock, pause the fleet, answer the token and the members (module docstring;
        with `paged`, their first page)."""
        core, client, cmd, now = call.core, call.client, call.cmd, call.now
        holder, version = call.args["holder"], call.args["version"]
        lease_s, deadline_s = call.args["lease_s"], call.args["deadline_s"]
        paged: bool = call.args["paged"]
        refusal = self.ending.refusal()
        if refusal is not None:
            raise refusal
        try:
            lease = self.lock.acquire(holder, version, lease_s, now)
        except LockHeld as exc:
            raise held_refusal(exc) from None
        shared = membership.shared_urls(core.view)
        lease.members = [(m["node_id"], m["id"], m["incarnation"])
                         for m in self._listing(core, shared=shared)]
        for url, names in shared.items():   # (none is a member)
            log.error("refit #%d leaves out %s: they all advertise %s (one server is not two "
                      "members: give each engine its own URL)", lease.number, ", ".join(names),
                      url)
        self._save()

        def saved(to: bytes, error: str | None) -> None:
            if error is None:
                self._acquired(core, to, cmd, lease, deadline_s, paged)
                return
            lease.members = []   # nothing was done to them
            if self.lock.lease is lease:
                self.lock.lease = None
            core.reply(to, protocol.Reply(cmd.request_id, "error",
                                          f"refit lock not taken: {error}", None,
                                          protocol.NOT_SAVED))
        self.saves.once_saved(cmd.request_id, client, saved)

    def _acquired(self, core: Core, client: bytes, cmd: protocol.Command, lease: Lease,
                  deadline_s: float, paged: bool) -> None:
        """The lease is on disk: pause the fleet, relaunch deferred engines, list the members
        again, then answer once that listing is on disk too (the first page of the members,
        for a client that pages)."""
        now = time.monotonic()
        self.relaunched = self._relaunch_deferred(core, now)
        log.info("refit lock taken by %s (refit #%d, version %r, %d member(s))", lease.holder,
                 lease.number, lease.version, len(lease.members))
        pause = protocol.Command(cmd.request_id, "pause",
                                 {"all": True, "deadline_s": deadline_s, "owner": lease.pause_owner,
                                  "wait_s": PAUSE_WAIT_S - 1.0}, None, None, PAUSE_WAIT_S)

        def finish(gathering: Gathering) -> None:
            paused = gathering.reply()
            for node_id, engine in self.relaunched:   # a starting engine needs its probes
                resume = protocol.Command(f"refit-relaunch-{uuid.uuid4().hex}", "resume",
                                          {"owner": lease.pause_owner}, node_id, engine,
                                          RELEASE_TIMEOUT_S)
                core.gather(None, resume, [node_id], time.monotonic())
            # The client gets this listing, not the one before the pause: the lease holds the
            # same (a compact commit commits the lease's members less those it names).
            self._relist(core, lease)
            reply = protocol.Reply(cmd.request_id, "ok", None, {
                "token": lease.token, "lease_s": lease.lease_s, "version": lease.version,
                **member_pages.page(lease.listing, None, paged),
                "relaunched": self.relaunched,
                "pause_problems": member_pages.cut(paused.reason)})
            try:
                protocol.encode(reply)
            except protocol.ProtocolError as exc:   # never an "ok" stripped of its token
                pages = "" if paged else (f"; {len(lease.listing)} members: a client of "
                                          "protocol 1.3 takes them in pages")
                reply = self._not_granted(core, cmd, lease, f"the answer cannot be sent "
                                          f"({exc}{pages})", protocol.TOO_BIG)

            def saved(to: bytes, error: str | None) -> None:
                if reply.status == "error":   # (too big: the lock is let go already)
                    core.reply(to, reply)
                elif error is not None:   # a crash now would forget what the token covers
                    core.reply(to, self._not_granted(core, cmd, lease, error,
                                                     protocol.NOT_SAVED))
                else:
                    self.lock.grant(lease, time.monotonic())   # it runs from its token's answer
                    core.reply(to, reply)
            self.saves.once_saved(cmd.request_id, gathering.client or client, saved)
        core.gather(client, pause, core.view.reachable(), now, finish)

    def _not_granted(self, core: Core, cmd: protocol.Command, lease: Lease, why: str, code: str
                     ) -> protocol.Reply:
        """The acquisition cannot be answered with its token (too big to send, or the members
        not saved): its holder would never know the token, so the lock is let go at once
        (nothing was done to the members but the pause)."""
        if self.lock.lease is lease:   # (not ended meanwhile)
            lease.members = []
            self.lock.lease = None
            self._ended(core, lease, time.monotonic(), why, expired=False)
        log.error("refit lock of %s let go: %s", lease.holder, why)
        return protocol.Reply(cmd.request_id, "error", f"refit lock not taken: {why}", None,
                              code)

    @COMMANDS.command("refit_members", *FENCE, Arg("paged", flag, False),
                      Arg("after", member_pages.cursor))
    def _members(self, call: Call) -> dict[str, Any]:
        """Without `after`: the members listed afresh, with the relaunched engines that
        became healthy (the lease holds those from now on); with it: the next page of that
        listing."""
        lease = self.lock.check(call.args["token"], call.args["holder"], call.now)
        after: member_pages.Cursor | None = call.args["after"]
        if after is None:
            self._relist(call.core, lease)
        return member_pages.page(lease.listing, after, call.args["paged"] or after is not None)

    @COMMANDS.command("refit_renew", *FENCE)
    def _renew(self, call: Call) -> dict[str, Any]:
        """Extend the lease by its `lease_s`."""
        lease = self.lock.renew(call.args["token"], call.args["holder"], call.now)
        return {"expires_in_s": lease.expires - call.now}

    @COMMANDS.command("refit_commit", *FENCE, VERSION, Arg("members", members_of),
                      Arg("members_except", members_of), Arg("release", flag, False))
    def _commit(self, call: Call) -> dict[str, Any] | None:
        """These members hold `version` now, the fleet's current version (`members_except`:
        every member of the last listing but these); `release`: and the lock is released."""
        core = call.core
        lease = self.lock.check(call.args["token"], call.args["holder"], call.now)
        if lease.aborted:   # its members are stale, their weights unknown: never the fleet's
            raise ValueError(f"refit #{lease.number} was aborted: nothing of it can be committed")
        version: str = call.args["version"]
        members: list[Member] | None = call.args["members"]
        left_out: list[Member] | None = call.args["members_except"]
        if left_out is not None:   # (1.3: compact, for 20,000 members with long names)
            skipped = set(left_out)
            members = [m for m in lease.members if m not in skipped]
        elif members is None:
            raise ValueError("'members' (or 'members_except') must be a list of [node, engine, "
                             "incarnation], got None")
        gone = membership.gone(core.view, members)   # (since the holder checked them)
        if gone:
            left_out_now = set(gone)
            members = [m for m in members if m not in left_out_now]
            if not members:   # never a version that no engine holds
                raise RefitError(f"nothing committed: every member of refit #{lease.number} "
                                 "stopped or was relaunched since it was listed",
                                 {"gone": [list(m) for m in gone]}, protocol.BAD_ARGS)
        self.book.commit(version, members, core.view.process_of)
        lease.committed = True
        lease.continuing = [] if call.args["release"] else lease.members or members
        lease.members = []
        self._save()
        core.weights_changed()
        log.info("refit %r committed by %s on %d engine(s)", version, lease.holder,
                 len(members))
        result = {"version": version, "members": len(members),
                  **({"gone": [list(m) for m in gone]} if gone else {})}
        if call.args["release"]:
            self._let_go(call, result)
            return None
        return result

    @COMMANDS.command("refit_abort", *FENCE, Arg("members", members_of),
                      Arg("wedged", members_of, []), Arg("reason", text(empty=True)))
    def _abort(self, call: Call) -> dict[str, Any]:
        """The refit failed: its members are stale, its `wedged` ones restarted."""
        core, now = call.core, call.now
        lease = self.lock.check(call.args["token"], call.args["holder"], now)
        members: list[Member] | None = call.args["members"]
        if members is None:   # (absent: the lease's)
            members = list(lease.members)
        wedged: list[Member] = call.args["wedged"]
        reason = (call.args["reason"] or "aborted by its holder")[:500]
        if not lease.committed:   # (an abort after a commit whose answer was lost)
            self.book.stale(members + lease.members)
            lease.aborted = True
        lease.members = []
        self._save()
        core.weights_changed()
        log.warning("refit %r aborted by %s: %s; %d engine(s) stale, %d wedged", lease.version,
                    lease.holder, reason, len(members), len(wedged))
        for node, engine, incarnation in wedged:
            restart = protocol.Command(
                f"refit-wedged-{uuid.uuid4().hex}", "restart",
                {"cause": "refit_wedged", "incarnation": incarnation,
                 "detail": f"wedged in refit {lease.version!r} (incarnation {incarnation}): "
                           f"{reason}"[:500]},
                node, engine, RELEASE_TIMEOUT_S)
            if node in core.view.reachable():
                core.gather(None, restart, [node], now)
        return {"stale": len(members), "restarted": [[n, e] for n, e, _ in wedged]}

    @COMMANDS.command("refit_putback", Arg("holder", text(), required=True),
                      Arg("token", rule(token_problem), required=True), VERSION,
                      Arg("members", members_of, required=True), Arg("more", flag, False))
    def _put_back(self, call: Call) -> dict[str, Any]:
        """A holder whose lease was lost asks that its members be put back in service: stale
        at once, their sessions ended and generation continued once their nodes are back
        (lease_end.py), only if nobody can have done it (this start's first such request);
        otherwise `put_back` is 0 and `because` says who did. `more`: a page, more to
        come."""
        result = self.ending.asked(call.core, self.lock, self.state.afresh, call.args,
                                   call.now)
        self._save()
        return result

    @COMMANDS.command("refit_release", *FENCE)
    def _release(self, call: Call) -> None:
        """End the refit: its own pause is lifted."""
        self._let_go(call, {})

    def _let_go(self, call: Call, result: dict[str, Any]) -> None:
        """Release the lock; answer `result` and `released` once its resume is in (lease_end),
        then once that is saved."""
        lease = self.lock.release(call.args["token"], call.args["holder"], call.now)
        request_id = call.cmd.request_id
        answer = answer_saved(call.core.reply, call.cmd, {**result, "released": lease.token})
        self.relaunched = []
        self.ending.released(call.core, lease, call.now, request_id, call.client,
                             lambda to: self.saves.once_saved(request_id, to, answer))

    # ------------------------------------------------------------------ the loop's turn

    def tick(self, core: Core, now: float) -> None:
        self.saved(now)
        self.ending.tick(core, now)
        expired = self.lock.expire(now)
        waiting = self.ending.waiting
        if waiting is not None and waiting.due(core, now):
            waiting.end_members(core)
            expired, self.lock.lease = (waiting.lease, waiting.why), None
            self.ending.waiting = None
        if expired is None:
            return
        lease, why = expired
        log.warning("refit lock of %s (refit #%d) released: %s", lease.holder, lease.number,
                    why)
        self._ended(core, lease, now, why, expired=True)

    @property
    def live_lease(self) -> Lease | None:
        """The lease whose end is not over: held, or its members being put back."""
        return self.lock.lease or self.ending.putting_back

    def next_deadline(self) -> float | None:
        unsaved = self.saves.next_deadline()
        ending = self.ending.next_deadline(time.monotonic())
        return min((d for d in (unsaved, ending, self.lock.next_deadline()) if d is not None),
                   default=None)

    def _ended(self, core: Core, lease: Lease, now: float, why: str, expired: bool) -> None:
        self.relaunched = []
        self.ending.end(core, lease, now, why, expired)

    # ------------------------------------------------------------------ questions

    def _listing(self, core: Core, lease: Lease | None = None,
                 shared: dict[str, list[str]] | None = None) -> list[dict[str, Any]]:
        """The engines a refit updates (membership.refit_members); once the lock is held,
        only those known at its start and the deferred engines it relaunched."""
        allowed = None if lease is None else (
            {(n, e) for n, e, _ in lease.members} | set(self.relaunched))
        return membership.refit_members(core.view, self.book, allowed, shared)

    def _relist(self, core: Core, lease: Lease) -> None:
        """List the members afresh: the lease holds exactly those its holder is given."""
        lease.listing = self._listing(core, lease)
        lease.members = [(m["node_id"], m["id"], m["incarnation"]) for m in lease.listing]
        self._save()

    def status(self, now: float) -> dict[str, Any]:
        lease = self.lock.lease
        holder = None if lease is None else {   # (never its token)
            "holder": lease.holder, "version": lease.version,
            "expires_in_s": max(0.0, lease.expires - now)}
        holder = self.ending.holder() or holder
        return {"current_version": self.book.current, "holder": holder}

    def _relaunch_deferred(self, core: Core, now: float) -> list[tuple[str, str]]:
        waiting = membership.deferred_waiting(core.view)
        for node_id, engine_id in waiting:
            cmd = protocol.Command(f"refit-relaunch-{uuid.uuid4().hex}", "restart", {},
                                   node_id, engine_id, RELEASE_TIMEOUT_S)
            core.gather(None, cmd, [node_id], now)
        return waiting

    def _save(self) -> None:
        self.saves.submit(self._content())

    def _content(self) -> bytes:
        lease = self.live_lease
        return self.state.encode(self.book, self.lock.next_token, *(
            ([], None) if lease is None else (lease.members, lease.unfinished())))


__all__ = ["COMMANDS", "Core", "RefitService", "Member", "WeightBook"]
