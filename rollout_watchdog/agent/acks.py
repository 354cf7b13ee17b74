"""When the coordinator ACKs a node's events: with its next heartbeat, in place of it.

An ACK only lets a node drop events from its outbox (they are sent again after a reconnect, and
the coordinator skips those it has), so it need not go at once. Sent at once, a fleet-wide
pause costs the coordinator a thousand more messages (an ACK to every node), a quarter of all
it handles then; riding the heartbeat that goes to every node each second anyway, it costs
none. Two ACKs go at once, at the end of the loop turn that took the events: the first after a
`hello` (it tells the node that the coordinator takes batches, runs and common fields), and one
for a node owed `after_events` events (so that a busy node's outbox stays far within its bound,
10,000). Pure bookkeeping: the hub sends.
"""

from __future__ import annotations

ACK_AFTER_EVENTS = 512   # events owed to one node that are ACKed without waiting for a beat


class AckSchedule:
    """Which nodes are owed an ACK, and which of them get it at the end of this turn."""

    def __init__(self, after_events: int = ACK_AFTER_EVENTS) -> None:
        self.after_events = after_events
        self._owed: dict[str, int] = {}   # node -> events taken since its last ACK
        self._now: set[str] = set()

    def took(self, node: str, events: int) -> None:
        """The hub took `events` of `node`'s (deduplicated, refused or new: all ACKed)."""
        owed = self._owed[node] = self._owed.get(node, 0) + events
        if owed >= self.after_events:
            self._now.add(node)

    def hello(self, node: str) -> None:
        """A `hello` was taken: ACK it at the end of this turn."""
        self._owed.setdefault(node, 0)
        self._now.add(node)

    def due_now(self) -> list[str]:
        """The nodes to ACK at the end of this turn (each then `sent`)."""
        due = list(self._now)
        self._now.clear()
        return due

    def owed(self, node: str) -> bool:
        """Whether `node` is owed an ACK: its heartbeat should be one."""
        return node in self._owed

    def sent(self, node: str) -> None:
        self._owed.pop(node, None)
        self._now.discard(node)
