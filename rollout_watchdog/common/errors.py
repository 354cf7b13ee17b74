"""The errors the fleet's Python API raises (DESIGN.md, "Python"): one base class, so a driver
can catch everything of ours with one clause and still tell the cases apart."""

from __future__ import annotations


class RolloutWatchdogError(Exception):
    """Base of every error the fleet API raises."""

    def __reduce__(self) -> tuple[object, ...]:
        """Pickled whole, rebuilt from its message and fields without calling `__init__`
        again (EngineLost's and UpdateRefused's take other arguments than their message): Ray
        hands a trainer actor's error to its driver pickled, and an error that could not be
        rebuilt reached it as Ray's UnserializableException, not as EngineLost."""
        return _rebuilt, (type(self), self.args, self.__dict__)


def _rebuilt(cls: type[RolloutWatchdogError], args: tuple[object, ...],
             fields: dict[str, object]) -> RolloutWatchdogError:
    error = cls.__new__(cls)
    error.args = args
    error.__dict__.update(fields)
    return error


class CoordinatorUnavailable(RolloutWatchdogError):
    """The coordinator did not answer within the deadline (down, unreachable, or refusing our
    key: a CURVE peer that is not on the allowlist hears nothing at all)."""


class CommandRefused(RolloutWatchdogError):
    """The coordinator or a node answered with an error; the message is its reason (for
    people: programs test `code` or the subclass, never the text).

    `code` is the reply's error code (`protocol.CODES`: LOCK_HELD, LEASE_LOST, BAD_ARGS, ...;
    None from a coordinator before protocol 1.2, or for a code this side does not know).
    `replies` holds the per-node answers of a fan-out ({node_id: {"status", "reason", "result"}}),
    `missing` the nodes that did not answer in time, `result` the error reply's result as it
    came (a refused refit_acquire's names the holder)."""

    def __init__(self, reason: str, replies: dict[str, dict[str, object]] | None = None,
                 missing: list[str] | None = None, code: str | None = None,
                 result: object = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.replies = replies or {}
        self.missing = missing or []
        self.code = code
        self.result = result


class NoMembers(CommandRefused):
    """`fleet.refit()` found no engine to update (no healthy engine on a reachable node): the
    lock was released at once and nothing changed. Wait for an engine, then refit."""


class UpdateRefused(CommandRefused):
    """Members of a refit answered its weight-update calls with an error (alive, and saying
    no: a parameter name or shape they do not have, say). `refused` maps every such
    (node_id, engine, incarnation) to its answer. Nothing was committed; retrying the same
    weights fails the same way."""

    def __init__(self, refused: dict[tuple[str, str, int], str], detail: str = "") -> None:
        if not refused:
            raise ValueError("UpdateRefused needs at least one member")
        self.refused = dict(refused)
        names = "; ".join(f"{n}/{e} (incarnation {i}): {why}"
                          for (n, e, i), why in self.refused.items())
        super().__init__(f"{len(self.refused)} member(s) refused the weight update: {names}"
                         + (f" ({detail})" if detail else ""),
                         replies={f"{n}/{e}": {"status": "error", "reason": why}
                                  for (n, e, _), why in self.refused.items()})


class RefitTimeout(RolloutWatchdogError, TimeoutError):
    """The refit ran past its `timeout_s` with no member to blame (the trainer's own side was
    slow): nothing was committed. A member still in its update call at the deadline is
    EngineLost instead."""


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
