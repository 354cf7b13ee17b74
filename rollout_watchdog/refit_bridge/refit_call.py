"""What a refit command (service.py) is given and may raise: the coordinator's side it acts on
(`Core`, passed in, never imported), one call with its checked arguments (`Call`), its
and its refusal (`RefitError`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from rollout_watchdog.agent.fanout import Gathering
from rollout_watchdog.common import protocol
from rollout_watchdog.refit_bridge.fleet import FleetView

# Makes a gathering's final reply (a refit's lock reply after its pause); None: it answers
# by itself, later (once what the reply reports is on disk).
Finish = Callable[[Gathering], "protocol.Reply | None"]


class Core(Protocol):
    """What the refit commands need of the coordinator (passed in, never imported)."""

    view: FleetView

    @property
    def started_at(self) -> float: ...   # monotonic: when its loop began

    def gather(self, client: bytes | None, cmd: protocol.Command, targets: list[str],
               now: float, finish: Finish | None = None) -> None: ...
    def reply(self, client: bytes, reply: protocol.Reply) -> None: ...
    def weights_changed(self) -> None: ...
    def refit_ended(self, outcome: str, duration_s: float) -> None: ...
    def resume_owed(self, owner: str, nodes: list[str]) -> None: ...


@dataclass(frozen=True)
class Call:
    """One refit command to run: its arguments checked (`COMMANDS`)."""

    core: Core
    client: bytes
    cmd: protocol.Command
    args: dict[str, Any]
    now: float


class RefitError(Exception):
    """A refit command refused; the message is the reason."""

    def __init__(self, reason: str, result: dict[str, Any] | None = None,
                 code: str = protocol.BAD_ARGS) -> None:
        super().__init__(reason)
        self.result = result
        self.code = code
