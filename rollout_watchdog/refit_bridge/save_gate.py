"""Replies that wait until the refit state they report is on disk (refit.json).

A fencing token handed out, or a commit answered, must not be forgotten by a coordinator that
crashes a moment later, so a refit reply goes out only once the writer (durable.DurableWriter,
off the loop) has the state that holds it on disk. A write that fails, or takes longer than
`timeout_s`, answers with why instead. Without a state dir, replies go out at once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from rollout_watchdog.common import protocol
from rollout_watchdog.refit_bridge.weights import RefitState

log = logging.getLogger(__name__)
Then = Callable[[bytes, "str | None"], None]   # (client, None or why the state is not saved)


def answer_saved(reply: Callable[[bytes, protocol.Reply], None], cmd: protocol.Command,
                 result: object) -> Then:
    """The answer to `cmd` once its change is saved: `result`, or the error that it took
    effect but is not on disk (code NOT_SAVED)."""
    def answer(to: bytes, error: str | None) -> None:
        reply(to, protocol.Reply(cmd.request_id, "ok", None, result) if error is None
              else protocol.Reply(cmd.request_id, "error", f"{cmd.cmd} took effect but is "
                                  f"not saved: {error}", result, protocol.NOT_SAVED))
    return answer


@dataclass
class Unsaved:
    """A reply that waits for the state it reports to be on disk."""

    generation: int       # the writer's generation that holds the change
    request_id: str
    client: bytes         # a retry of the request moves the answer to its socket
    deadline: float       # monotonic: past it, the save counts as failed
    then: Then


class SaveGate:
    def __init__(self, state: RefitState, timeout_s: float) -> None:
        self.state = state
        self.timeout_s = timeout_s
        self._unsaved: list[Unsaved] = []   # (the oldest first)

    @property
    def wakeup_fd(self) -> int | None:
        """Readable when a write of the state ended: the loop then calls `saved`."""
        return None if self.state.writer is None else self.state.writer.wakeup_fd

    def submit(self, content: bytes) -> None:
        """The state changed: write `content` (the newest wins)."""
        if self.state.writer is not None:
            self.state.writer.submit(content)

    def retried(self, request_id: str, client: bytes) -> bool:
        """A retry of a request whose answer still waits for the disk: the answer goes to
        `client` (the retry's socket) when it comes; True if there is one."""
        for unsaved in self._unsaved:
            if unsaved.request_id == request_id:
                unsaved.client = client
                return True
        return False

    def once_saved(self, request_id: str, client: bytes, then: Then) -> None:
        """`then(client, None)` once every change so far is on disk (at once without a state
        dir, or when it is already); `then(client, error)` if the write failed."""
        writer = self.state.writer
        if writer is None:
            then(client, None)
            return
        self._unsaved.append(Unsaved(writer.submitted, request_id, client,
                                     time.monotonic() + self.timeout_s, then))
        self.saved(time.monotonic())

    def saved(self, now: float) -> None:
        """A write of the state ended, or a wait for one may be over: go on with what waited
        for it."""
        if self.state.writer is None:
            return
        written, failed, error = self.state.writer.outcome()   # (clears wakeup_fd: always)
        if not self._unsaved:
            return
        waiting, self._unsaved = self._unsaved, []
        for unsaved in waiting:
            if written >= unsaved.generation:
                unsaved.then(unsaved.client, None)
                continue
            if failed >= unsaved.generation:
                why = error
            elif now >= unsaved.deadline:
                why = (f"{self.state.path} was not written within {self.timeout_s:g} s "
                       "(a slow or hung disk)")
            else:
                self._unsaved.append(unsaved)
                continue
            log.error("refit state not saved: %s", why)
            unsaved.then(unsaved.client, why)

    def next_deadline(self) -> float | None:
        return self._unsaved[0].deadline if self._unsaved else None

    def close(self) -> None:
        if self.state.writer is not None:
            self.state.writer.close()
