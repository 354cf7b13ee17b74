"""What `FleetClient` hands back: typed views of the coordinator's answers and events.

Each keeps the JSON object it was made from (`raw`), so fields a newer coordinator or node adds
are not lost on the way to a caller that wants them.
"""

from __future__ import annotations

from collections.abc import Iterator, KeysView
from dataclasses import dataclass, field
from typing import Any

from rollout_watchdog.common.errors import CommandRefused, RolloutWatchdogError
from rollout_watchdog.common.protocol import NODE_ERRORS

# The coordinator's own events about a node; they are not resume points of that node's stream.
COORDINATOR_BOOT_PREFIX = "coordinator-"   # the boot id of the coordinator's own events


def _opt_int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _opt_str(value: object) -> str | None:
    return value if isinstance(value, str) else None


@dataclass(frozen=True)
class EngineView:
    """One engine of the fleet, as the coordinator last heard of it from its node."""

    node_id: str
    """The node daemon's `node_id` (its config's, default the host name)."""
    id: str
    """The engine's id on its node (`[[engine]] id`); `name` is `NODE/ENGINE`."""
    state: str
    """`starting`, `healthy`, `suspect`, `stopping`, `backoff`, `failed` or `stopped`."""
    incarnation: int
    """Which process of the engine: a new number at every launch, never reused."""
    url: str | None
    """Where the coordinator, the router and a refit reach the engine."""
    pid: int | None
    """The engine's main process on its node, None while it is not running."""
    paused: bool
    """Whether its deep probes are paused (`finish_generation()`, a refit, `pause`)."""
    weight_version: Any
    """The version a refit committed on this incarnation; None before the first refit reached
    it (it runs the weights it loaded from disk)."""
    serving: bool
    """Whether the coordinator routes it: healthy, on a reachable node, with current weights."""
    tp_size: int | None
    """The ranks it takes in the weight-update group (config, else its `/server_info`)."""
    reachable: bool
    """Whether its node is reachable; if not, the fields are the last state heard."""
    restarts: int
    """Relaunches after failures within the restart window."""
    last_failure: dict[str, Any] | None
    """`{"cause", "detail", "ts"}` of its last failure, or None."""
    group: str | None
    """The multi-node engine it is a part of (its config's `group`), whose parts are restarted
    together; None for an engine of one node."""
    origin: str = "config"
    """Where it came from: `"config"` (the node's config file), `"launched"` (`launch`, at
    run time) or `"registered"` (someone else's process, `register`). A node that predates
    the field is read as "config" ("registered" for its external engines)."""
    raw: dict[str, Any] = field(repr=False, compare=False, default_factory=dict)
    """The JSON object this view was made from (fields a newer coordinator adds are kept)."""

    @property
    def name(self) -> str:
        """NODE/ENGINE, as the CLI names it."""
        return f"{self.node_id}/{self.id}"

    @classmethod
    def from_json(cls, node_id: str, reachable: bool, obj: dict[str, Any]) -> EngineView:
        failure = obj.get("last_failure")
        return cls(node_id=node_id, id=str(obj.get("id")), state=str(obj.get("state")),
                   incarnation=_opt_int(obj.get("incarnation")) or 0,
                   url=_opt_str(obj.get("url")), pid=_opt_int(obj.get("pid")),
                   paused=bool(obj.get("paused")), weight_version=obj.get("weight_version"),
                   serving=bool(obj.get("serving")), tp_size=_opt_int(obj.get("tp_size")),
                   reachable=bool(obj.get("reachable", reachable)),
                   restarts=_opt_int(obj.get("restarts")) or 0,
                   last_failure=failure if isinstance(failure, dict) else None,
                   group=_opt_str(obj.get("group")),
                   origin=_opt_str(obj.get("origin"))
                   or ("registered" if obj.get("external") is True else "config"), raw=obj)


@dataclass(frozen=True)
class NodeView:
    """One node of the fleet: whether the coordinator hears it, and its engines."""

    node_id: str
    reachable: bool
    last_seen: float | None
    boot: str | None
    engines: list[EngineView]
    metrics_port: int | None = None   # where the node serves its Prometheus metrics

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> NodeView:
        node_id, reachable = str(obj.get("node_id")), bool(obj.get("reachable"))
        last_seen = obj.get("last_seen")
        engines = obj.get("engines")
        return cls(node_id=node_id, reachable=reachable,
                   last_seen=float(last_seen) if isinstance(last_seen, (int, float)) else None,
                   boot=_opt_str(obj.get("boot")),
                   engines=[EngineView.from_json(node_id, reachable, e)
                            for e in (engines if isinstance(engines, list) else [])
                            if isinstance(e, dict)],
                   metrics_port=port if isinstance(port := obj.get("metrics_port"), int)
                   and not isinstance(port, bool) else None)


def nodes_of(status: object) -> list[NodeView]:
    """The nodes of a `status` result; RolloutWatchdogError if it is not one."""
    nodes = status.get("nodes") if isinstance(status, dict) else None
    if not isinstance(nodes, list):
        raise RolloutWatchdogError(f"the coordinator's status is not a fleet view: "
                                   f"{str(status)[:80]}")
    return [NodeView.from_json(n) for n in nodes if isinstance(n, dict)]


@dataclass(frozen=True)
class NodeReply:
    """One node's answer to a command."""

    status: str
    reason: str | None
    result: Any


@dataclass(frozen=True)
class FleetResult:
    """The answers to a command sent to one engine, one node or every reachable node."""

    request_id: str
    nodes: dict[str, NodeReply]
    missing: list[str]   # nodes that did not answer in time (empty when the call succeeded)

    @classmethod
    def from_json(cls, request_id: str, result: object) -> FleetResult:
        nodes = result.get("nodes") if isinstance(result, dict) else None
        if not isinstance(nodes, dict):
            raise RolloutWatchdogError(f"the coordinator's answer is not a fan-out result: "
                                       f"{str(result)[:80]}")
        missing = result.get("missing") if isinstance(result, dict) else None
        return cls(request_id=request_id,
                   nodes={str(n): NodeReply(str(r.get("status")), _opt_str(r.get("reason")),
                                            r.get("result"))
                          for n, r in nodes.items() if isinstance(r, dict)},
                   missing=[str(n) for n in missing] if isinstance(missing, list) else [])

    @classmethod
    def of_silent_nodes(cls, exc: CommandRefused) -> FleetResult | None:
        """The result of a fan-out refused only because some nodes did not answer (each
        that did answered "ok"), `missing` naming them; None for any other refusal."""
        if exc.code != NODE_ERRORS or not exc.missing or any(
                isinstance(r, dict) and r.get("status") != "ok" for r in exc.replies.values()):
            return None
        return cls.from_json("", {"nodes": exc.replies, "missing": exc.missing})


@dataclass(frozen=True)
class FleetEvent:
    """One event of the fleet: a node's event (numbered by `boot` and `seq` within that node
    daemon's boot), or the coordinator's own `node_reachable`/`node_unreachable` (`engine`
    None; `boot` and `seq` are then the coordinator's)."""

    node_id: str
    boot: str
    seq: int
    kind: str
    engine: str | None
    incarnation: int | None
    from_: str | None
    to: str | None
    cause: str | None
    detail: str | None
    ts: float | None
    raw: dict[str, Any] = field(repr=False, compare=False, default_factory=dict)

    @property
    def is_node_event(self) -> bool:
        """The coordinator's own word about a node (node_reachable, node_unreachable,
        group_restart, ...), not a node's event: its boot is the coordinator's."""
        return (self.boot or "").startswith(COORDINATOR_BOOT_PREFIX)

    @classmethod
    def from_json(cls, node_id: str, boot: str, seq: int, obj: dict[str, Any]) -> FleetEvent:
        ts = obj.get("ts")
        return cls(node_id=node_id, boot=boot, seq=seq, kind=str(obj.get("kind")),
                   engine=_opt_str(obj.get("engine")),
                   incarnation=_opt_int(obj.get("incarnation")),
                   from_=_opt_str(obj.get("from")), to=_opt_str(obj.get("to")),
                   cause=_opt_str(obj.get("cause")), detail=_opt_str(obj.get("detail")),
                   ts=float(ts) if isinstance(ts, (int, float)) else None, raw=obj)

    def to_json(self) -> dict[str, Any]:
        """What `events --coordinator EP --json` prints: the event object plus boot and seq."""
        return {**self.raw, "node_id": self.node_id, "boot": self.boot, "seq": self.seq}

    def __getitem__(self, key: str) -> Any:
        """The event's JSON fields by name, as `events --json` prints them (`event["kind"]`,
        `event["from"]`, `event["boot"]`): KeyError for a field the event lacks."""
        return self.to_json()[key]

    def get(self, key: str, default: Any = None) -> Any:
        """`event.get("cause")`: a JSON field, or `default` when the event lacks it."""
        return self.to_json().get(key, default)

    def __contains__(self, key: object) -> bool:
        return key in self.to_json()

    def __iter__(self) -> Iterator[str]:
        return iter(self.to_json())

    def __len__(self) -> int:
        return len(self.to_json())

    def keys(self) -> KeysView[str]:
        """The JSON fields' names (`dict(event)` is the JSON object)."""
        return self.to_json().keys()
