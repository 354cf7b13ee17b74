"""Who is in a weight-update group (`GroupMember`), and how the group fails
(`GroupMemberFailed`, `GroupAborted`): plain data, apart from the group (group.py) so that
what names members and judges their failures needs none of its machinery. Both errors are
internal: a refit translates them into the contract's (refit_state.py)."""

from __future__ import annotations

from dataclasses import dataclass

from rollout_watchdog.common.errors import RolloutWatchdogError


@dataclass(frozen=True)
class GroupMember:
    """One engine in the group: who it is (for errors) and where it listens."""

    node_id: str
    engine: str
    incarnation: int
    url: str
    tp_size: int
    # The node's identity of its main process (kernel boot, pid, start time): a process that
    # took over an incarnation number (a daemon that lost its state file) is another member.
    process: str | None = None

    def label(self) -> str:
        return f"{self.node_id}/{self.engine} (incarnation {self.incarnation})"


class GroupMemberFailed(RolloutWatchdogError):
    """Members' calls failed. ``members`` names the likely culprits: those that gave no answer at
    all (gone), else those that answered with an error, else those whose calls never completed.
    ``detail`` has every member's reason; ``gone`` lists every member that gave no answer,
    ``refused`` every member that answered with an error, (node_id, engine, incarnation) ->
    its answer (internal: a refit raises EngineLost or UpdateRefused for them)."""

    def __init__(self, members: list[GroupMember], detail: str, *,
                 gone: list[GroupMember] | None = None,
                 refused: dict[GroupMember, str] | None = None) -> None:
        self.members = list(members)
        self.detail = detail
        self.gone = list(gone or [])
        self.refused = {(m.node_id, m.engine, m.incarnation): why
                        for m, why in (refused or {}).items()}
        names = ", ".join(m.label() for m in self.members) or "no member"
        super().__init__(f"weight-update group failed at {names}: {detail}")

    @property
    def lost(self) -> list[tuple[str, str, int]]:
        """(node_id, engine, incarnation) of each culprit, as EngineLost takes them."""
        return [(m.node_id, m.engine, m.incarnation) for m in self.members]


class GroupAborted(RolloutWatchdogError):
    """:meth:`WeightUpdateGroup.abort` was called; ``pending`` lists the members whose calls had
    not completed then (on a deadline: the wedged ones)."""

    def __init__(self, reason: str, pending: list[GroupMember]) -> None:
        self.reason = reason
        self.pending = list(pending)
        names = ", ".join(m.label() for m in pending) or "none"
        super().__init__(f"weight-update group aborted ({reason}); calls pending at: {names}")
