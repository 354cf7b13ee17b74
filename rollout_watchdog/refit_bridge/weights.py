"""Which weights each engine holds, as far as refits went (pure logic, persisted).

An engine incarnation holds version V once a refit that reached that exact incarnation
committed V. Everything else holds no known version: a new incarnation (`pending_weights`), and
every member of an aborted refit (its buffers may hold partial weights). An engine serves when it
is healthy and holds the fleet's current version; before the first refit ever commits, the weights
an engine loaded from disk are the only ones, so every healthy engine serves.

The book also keeps the identity of each holder's main process (the node's `process`): a process
whose incarnation number was handed out again (by a daemon that lost its state file) is another
process, and never inherits what the old one held.

None of this can be rebuilt from node snapshots (an engine's own `weight_version` survives an
aborted update), so the coordinator persists the book with `--state-dir`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rollout_watchdog.common.states import EngineState
from rollout_watchdog.refit_bridge.durable import DurableWriter

Member = tuple[str, str, int]   # (node_id, engine, incarnation)
SERVING_STATES = (EngineState.HEALTHY.value,)
# A version goes into every acquire reply (once per member), every status page and the state
# file: a long one would push them past the frame limit, for good.
MAX_VERSION_CHARS = 256


def check_version(version: object) -> str:
    """`version` if it is a weight version (1 to MAX_VERSION_CHARS printable characters);
    ValueError naming the problem otherwise."""
    problem = version_problem(version)
    if problem is not None:
        raise ValueError(f"version {problem}")
    assert isinstance(version, str)
    return version


def version_problem(version: object) -> str | None:
    """Why `version` is not a weight version, or None (the caller names it: common.validate's
    convention)."""
    if not isinstance(version, str) or not version:
        return f"must be a non-empty string, got {str(version)[:40]!r}"
    if len(version) > MAX_VERSION_CHARS:
        return (f"must be at most {MAX_VERSION_CHARS} characters, got {len(version)}: "
                f"{version[:40]!r}...")
    if not version.isprintable():
        return f"must be printable characters only, got {version[:80]!r}"
    return None


@dataclass
class Held:
    incarnation: int
    version: str | None   # None: stale (an aborted refit reached it)
    process: str | None = None   # the node's identity of its main process; None: not known

    def of(self, incarnation: object, process: object) -> bool:
        """Whether this is what `incarnation` with main process `process` holds."""
        return self.incarnation == incarnation and (
            self.process is None or process is None or self.process == process)


ProcessOf = Callable[[str, str, int], "str | None"]


class WeightBook:
    def __init__(self) -> None:
        self.current: str | None = None   # the version the last committed refit set
        self.held: dict[tuple[str, str], Held] = {}
        # Before the first commit, engines serve the weights they loaded from disk: right for
        # a fresh run, wrong for one resumed from a checkpoint (--route-after-first-refit).
        self.disk_weights_serve = True

    def version_of(self, node: str, engine: str, incarnation: object,
                   process: object = None) -> str | None:
        held = self.held.get((node, engine))
        if held is None or not held.of(incarnation, process):
            return None
        return held.version

    def serving(self, node: str, engine: dict[str, Any]) -> bool:
        if engine.get("state") not in SERVING_STATES:
            return False
        engine_id, incarnation = str(engine.get("id")), engine.get("incarnation")
        process = engine.get("process")
        if self.current is None:   # disk weights, unless an aborted refit reached it
            if not self.disk_weights_serve:
                return False
            held = self.held.get((node, engine_id))
            return held is None or not held.of(incarnation, process) or held.version is not None
        return self.version_of(node, engine_id, incarnation, process) == self.current

    def decorate(self, node: str, engine: dict[str, Any], reachable: bool) -> None:
        """Set an engine view's `weight_version` and `serving` (in place). An engine of an
        unreachable node is not serving: the router holds no such engine (membership.py)."""
        engine["weight_version"] = self.version_of(node, str(engine.get("id")),
                                                   engine.get("incarnation"),
                                                   engine.get("process"))
        engine["serving"] = reachable and self.serving(node, engine)

    def commit(self, version: str, members: list[Member],
               process_of: ProcessOf | None = None) -> None:
        """`process_of(node, engine, incarnation)`: the main process the view shows for it."""
        for node, engine, incarnation in members:
            process = process_of(node, engine, incarnation) if process_of else None
            self.held[(node, engine)] = Held(incarnation, version, process)
        self.current = version

    def stale(self, members: list[Member]) -> None:
        """An aborted refit: its members' weights are unknown until a later commit."""
        for node, engine, incarnation in members:
            self.held[(node, engine)] = Held(incarnation, None)

    def to_json(self) -> dict[str, Any]:
        return {"current": self.current,
                "held": [[n, e, h.incarnation, h.version, h.process]
                         for (n, e), h in self.held.items()]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> WeightBook:
        book = cls()
        current = data.get("current")
        book.current = current if isinstance(current, str) else None
        for row in data.get("held", []):
            if not (isinstance(row, list) and len(row) in (4, 5) and isinstance(row[0], str)
                    and isinstance(row[1], str) and isinstance(row[2], int)
                    and all(v is None or isinstance(v, str) for v in row[3:])):
                raise ValueError(f"not a [node, engine, incarnation, version, process]: "
                                 f"{str(row)[:80]}")
            book.held[(row[0], row[1])] = Held(*row[2:])
        return book


def members_of(rows: object) -> list[Member]:
    """Parse `[[node, engine, incarnation], ...]` (a command's `members` or `wedged`, the
    state file's `in_flight`); ValueError says what is wrong, the caller names the argument."""
    if not isinstance(rows, list):
        raise ValueError(f"must be a list of [node, engine, incarnation], got "
                         f"{str(rows)[:40]}")
    out = []
    for row in rows:
        if not (isinstance(row, list) and len(row) == 3 and isinstance(row[0], str)
                and isinstance(row[1], str) and isinstance(row[2], int)
                and not isinstance(row[2], bool)):
            raise ValueError(f"holds {str(row)[:80]}, not a [node, engine, incarnation]")
        out.append((row[0], row[1], row[2]))
    return out


class RefitState:
    """The refit state the coordinator keeps on disk: the weight book, the counter of the next
    fencing token (the token's epoch is drawn afresh at every start), and the members of the
    refit in flight (stale if the coordinator stops before it ends).
    Written atomically and durably, off the coordinator's loop (durable.DurableWriter)."""

    FILE = "refit.json"

    def __init__(self, state_dir: str | None) -> None:
        self.path = Path(state_dir) / self.FILE if state_dir else None
        self.writer = DurableWriter(self.path) if self.path else None
        self.afresh = True   # (until `load` found a file: this coordinator knows no earlier refit)

    def load(self) -> tuple[WeightBook, int, list[Member], Unfinished | None]:
        """(the book, the next token, the refit in flight, its lease's `Unfinished`); a missing
        file is a fresh start, a broken one an error naming it (refit state must not silently
        reset: stale engines would serve)."""
        if self.path is None or not self.path.exists():
            return WeightBook(), 1, [], None
        self.afresh = False
        try:
            data = json.loads(self.path.read_text())
            if not isinstance(data, dict):
                raise ValueError("not a JSON object")
            token = data.get("next_token", 1)
            if not isinstance(token, int) or token < 1:
                raise ValueError(f"bad next_token {token!r}")
            try:
                in_flight = members_of(data.get("in_flight", []))
            except ValueError as exc:
                raise ValueError(f"in_flight {exc}") from None
            unfinished = data.get("unfinished")
            return (WeightBook.from_json(data.get("weights") or {}), token, in_flight,
                    None if unfinished is None else Unfinished.from_json(unfinished))
        except (OSError, ValueError) as exc:
            raise ValueError(f"refit state {self.path} is unreadable ({exc}); move it away "
                             "to start afresh (every engine then needs a refit)") from exc

    @staticmethod
    def encode(book: WeightBook, next_token: int, in_flight: list[Member],
               unfinished: Unfinished | None = None) -> bytes:
        return json.dumps({"next_token": next_token, "weights": book.to_json(),
                           "in_flight": [list(m) for m in in_flight],
                           "unfinished": None if unfinished is None else asdict(unfinished)
                           }).encode()


@dataclass(frozen=True)
class Unfinished:
    """What a restarted coordinator needs of the lease that was held when it stopped, to end
    it as its expiry would: its members (`in_flight`) put back in service, its committed
    ones' generation continued, its deep-probe pause (`pause_owner`) lifted."""

    number: int
    holder: str
    version: str
    pause_owner: str
    committed: bool
    continuing: list[Member]

    @classmethod
    def from_json(cls, data: object) -> Unfinished:
        """ValueError naming what is wrong."""
        if not isinstance(data, dict):
            raise ValueError(f"unfinished: not an object: {str(data)[:40]}")
        try:
            made = cls(data["number"], data["holder"], data["version"], data["pause_owner"],
                       data["committed"], members_of(data["continuing"]))
        except (KeyError, ValueError) as exc:
            raise ValueError(f"unfinished: {exc}") from None
        if not (isinstance(made.number, int) and isinstance(made.committed, bool) and all(
                isinstance(v, str) for v in (made.holder, made.version, made.pause_owner))):
            raise ValueError(f"unfinished: a field of the wrong type in {str(data)[:120]}")
        return made
