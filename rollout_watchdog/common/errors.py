"""The errors the fleet's Python API raises (DESIGN.md, "Python"): one base class, so a driver
can catch everything of ours with one clause and still tell the cases apart."""

from __future__ import annotations


class RolloutWatchdogError(Exception):
    """Base of every error the fleet API raises."""


class CoordinatorUnavailable(RolloutWatchdogError):
    """The coordinator did not answer within the deadline (down, unreachable, or refusing our
    key: a CURVE peer that is not on the allowlist hears nothing at all)."""


class CommandRefused(RolloutWatchdogError):
    """The coordinator or a node answered with an error; the message is its reason.

    `replies` holds the per-node answers of a fan-out ({node_id: {"status", "reason", "result"}}),
    `missing` the nodes that did not answer in time."""

    def __init__(self, reason: str, replies: dict[str, dict[str, object]] | None = None,
                 missing: list[str] | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.replies = replies or {}
        self.missing = missing or []


class LeaseLost(RolloutWatchdogError):
    """The refit lock's lease expired (or was taken over) while this holder still acted."""


class EngineLost(RolloutWatchdogError):
    """A member of a refit died or wedged. `lost` lists every (node_id, engine, incarnation)
    the refit lost; `node_id`, `engine` and `incarnation` name the first."""

    def __init__(self, lost: list[tuple[str, str, int]], detail: str = "") -> None:
        if not lost:
            raise ValueError("EngineLost needs at least one lost engine")
        self.lost = list(lost)
        self.node_id, self.engine, self.incarnation = self.lost[0]
        names = ", ".join(f"{n}/{e} (incarnation {i})" for n, e, i in self.lost)
        super().__init__(f"engine lost during the refit: {names}" + (f": {detail}" if detail
                                                                     else ""))
