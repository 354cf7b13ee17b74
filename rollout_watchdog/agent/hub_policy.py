"""What the hub (`hub.Hub`) asks of the coordinator that owns it: a `View`, the fleet view that
says what the nodes' messages mean, and a `Policy`, which decides everything else (commands,
group restarts, the refit lock, router gating). `refit_bridge.coordinator` provides both; they
are typed here, by what the hub calls, so that the transport never imports the refit bridge.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from rollout_watchdog.agent.relay import Relayed
from rollout_watchdog.common import protocol
from rollout_watchdog.common.plain import PlainRun

# An event of the coordinator's own, shaped like the nodes' events (`common.events.Event`).
OwnEvent = dict[str, Any]


class Refused(Exception):
    """A node message that is dropped and counted; `reason` is the counter's key."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


class AckPoint(Protocol):
    """How far a node's events were taken: the hub ACKs up to there."""

    @property
    def boot(self) -> str: ...
    @property
    def received_seq(self) -> int: ...


class View(Protocol):
    """The fleet view (`refit_bridge.fleet.FleetView`): pure decisions on the nodes' messages.
    Each returns the coordinator's own events it causes (node_reachable, node_unreachable)."""

    @property
    def nodes(self) -> Mapping[str, AckPoint]: ...

    def hello(self, msg: protocol.Hello, peer: str, now: float, wall: float
              ) -> list[OwnEvent]:
        """Take a node's snapshot; Refused for a HELLO it must not take."""
    def event(self, msg: protocol.Event, peer: str, now: float, wall: float
              ) -> tuple[bool, list[OwnEvent]]:
        """Take a node's event: whether it is new (relayed), Refused for a bad one."""
    def batch(self, batch: protocol.PlainEvents, peer: str, now: float, wall: float
              ) -> list[OwnEvent] | None:
        """A node's "events" frame taken whole when plain (None: take each event alone)."""
    def run(self, run: PlainRun, peer: str, now: float, wall: float
            ) -> list[OwnEvent] | None:
        """A node's "run" frame (1.4) taken whole when plain (None: take each event alone)."""
    def heard(self, peer: str, now: float, wall: float) -> list[OwnEvent]:
        """A node was heard from (a heartbeat, a reply)."""
    def tick(self, now: float, wall: float) -> list[OwnEvent]:
        """The nodes that went silent."""
    def reachable(self) -> list[str]: ...


class Policy(Protocol):
    """The coordinator's decisions; the hub calls these from its loop, and only from there."""

    @property
    def wakeup_fd(self) -> int | None:
        """A file descriptor the loop polls too; readable, the loop calls `woke`."""
    def woke(self, now: float) -> None: ...
    def next_deadline(self) -> float | None:
        """The soonest the policy has something to do (None: nothing): the poll wakes then."""

    def opened(self) -> None:
        """The hub's socket is bound; a ValueError fails the start (`closed` follows)."""
    def closed(self) -> None:
        """The hub stopped serving, or failed to start."""
    def restored(self, items: list[Relayed]) -> None:
        """The events a restarted hub took back from its journal, oldest first."""

    def command(self, client: bytes, cmd: protocol.Command, now: float) -> None:
        """A client's command: answered, or fanned out (`Hub.reply`, `Hub.gather`)."""
    def restarts(self, peer: str, msg: protocol.Event) -> list[tuple[str, str]]:
        """The (node, engine) group parts a new event of `peer` makes the coordinator restart,
        decided in turn; `group_restart` is called for each once the event is relayed."""
    def group_restart(self, node: str, engine: str, cause: protocol.Event) -> None: ...
    def changed(self) -> None:
        """The fleet view changed (an event relayed, a HELLO's snapshot)."""
    def sweep(self, now: float) -> None:
        """The periodic checks, a few times a second (`Hub.sweep_s`)."""
