"""The commands a restarted coordinator holds back until the nodes they need are back (pure
logic: the coordinator asks, and runs or refuses what this says).

A command is held while `waits_for_the_view` says so, or while it is queued behind an earlier
held one that may reach the same node (`queued_behind`: a resume must not overtake its pause).
Each is held for at most HOLD_SHARE of its own time. Then one that waited for the view is run
with the nodes that are back; one still queued behind an earlier one is refused (code BUSY),
never run later: its caller is about to give up on it. So is any command that would be held
once MAX_HELD are. `due` hands them out in the order they came, as the caller's time budget
allows: a flood of held commands released at once must not stop the coordinator's loop.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from rollout_watchdog.agent.fanout import DEFAULT_TIMEOUT_S
from rollout_watchdog.common import protocol
from rollout_watchdog.refit_bridge import queries
from rollout_watchdog.refit_bridge import service as refit
from rollout_watchdog.refit_bridge.fleet import FleetView

MAX_HELD = 10_000   # commands held back after a restart (past it, refused: BUSY)
HOLD_SHARE = 0.5    # of a command's own time (timeout_s), the most it is held back


def waits_for_the_view(view: FleetView, started: float, now: float
                       ) -> Callable[[protocol.Command], bool]:
    """Whether a restarted coordinator holds a command back until its view is whole again:
    its journal named nodes, not all of which said hello yet, within a node timeout of its
    start (`FleetView.warm`). Held: a command for every node (it would reach only those heard
    from: a fleet-wide pause that pauses half the fleet), one for a node not heard from yet
    (it would be refused as unknown, though it may have run before the restart), and a refit's
    acquire (its members, and its pause, are the whole fleet's). With no journal (no state
    dir), which nodes come back is unknown: only a command for a node not heard from is held
    (a client's retry across the restart would be refused, its node back a moment later).
    The view is read once, for the many commands a release asks about."""
    if view.warm(started, now):   # (first: the cheap question, asked of every command)
        return lambda cmd: False
    if not view.expected:
        return lambda cmd: cmd.node is not None and cmd.node not in view.nodes
    missing = view.expected - view.nodes.keys()
    if not missing:
        return lambda cmd: False

    def waits(cmd: protocol.Command) -> bool:
        if cmd.cmd in queries.COMMANDS:
            return cmd.node in missing
        if cmd.cmd in refit.COMMANDS:
            return cmd.cmd == "refit_acquire"
        return cmd.node is None or cmd.node in missing
    return waits


def queued_behind(cmd: protocol.Command, ahead: Counter[str | None]) -> bool:
    """Whether node command `cmd` waits behind the held ones (`ahead`: how many for each node,
    None for every node): it must not overtake an earlier one that may reach the same node.
    One for another node goes on (a command for a node not heard from holds up no other's)."""
    if not ahead or cmd.cmd in queries.COMMANDS or cmd.cmd in refit.COMMANDS:
        return False
    return cmd.node is None or None in ahead or cmd.node in ahead


@dataclass
class Held:
    client: bytes       # a retry while held moves the answer to its socket
    cmd: protocol.Command
    since: float        # monotonic

    def limit(self) -> float:
        return (self.cmd.timeout_s or DEFAULT_TIMEOUT_S) * HOLD_SHARE


class HeldCommands:
    def __init__(self) -> None:
        self._held: dict[str, Held] = {}
        self._nodes: Counter[str | None] = Counter()   # held commands for each node

    def __len__(self) -> int:
        return len(self._held)

    def retried(self, client: bytes, cmd: protocol.Command) -> bool:
        """A retry of a held command: its answer goes to the new socket."""
        held = self._held.get(cmd.request_id)
        if held is not None:
            held.client = client
        return held is not None

    def holds(self, cmd: protocol.Command, waits: bool) -> bool:
        """Whether `cmd` must be held (it `waits` for the view, or is queued behind)."""
        return waits or queued_behind(cmd, self._nodes)

    def full(self) -> bool:
        return len(self._held) >= MAX_HELD

    def hold(self, client: bytes, cmd: protocol.Command, now: float) -> None:
        self._held[cmd.request_id] = Held(client, cmd, now)
        self._nodes[cmd.node] += 1

    def due(self, now: float, waits: Callable[[protocol.Command], bool]
            ) -> Iterator[tuple[Held, bool]]:
        """The held commands to handle now, in the order they came, each taken out as it is
        handed out: (it, True) to run it, (it, False) to refuse it (BUSY). The caller may stop
        at any one: the rest stay held."""
        ahead: Counter[str | None] = Counter()
        for request_id, held in list(self._held.items()):
            behind = queued_behind(held.cmd, ahead)
            late = now - held.since >= held.limit()
            if not late and (behind or waits(held.cmd)):
                ahead[held.cmd.node] += 1
                continue
            del self._held[request_id]
            self._nodes[held.cmd.node] -= 1
            if not self._nodes[held.cmd.node]:
                del self._nodes[held.cmd.node]
            yield held, not behind
