"""The coordinator's view of the fleet: pure decisions, no sockets (docs/protocol.md, "The
coordinator's side").

`FleetView` takes the nodes' messages (already decoded) and the time, and answers what to do:
whether an event is new (relay and ACK it) or a replay (drop and count it), which nodes went
silent, which parts of a multi-node group to restart. The coordinator does the I/O.
"""

from __future__ import annotations

import json
import logging
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

from rollout_watchdog.agent.hub_policy import Refused
from rollout_watchdog.common import protocol
from rollout_watchdog.common.plain import PlainRun
from rollout_watchdog.common.states import EngineState

log = logging.getLogger(__name__)
NODE_TIMEOUT_S = 5.0
STATUS_PAGE_BYTES = 512 * 1024   # well below the protocol's 1 MiB message limit
OLD_BOOTS_KEPT = 8
# Plain values for apply_event, batch and group_restarts, which see every event (tuples, not
# sets: a hostile node's kind, state or from may be any JSON value, unhashable too)
RUNNING_STATES = tuple(state.value for state in EngineState if state.running)
_STOPPING = EngineState.STOPPING.value
_FORGETTING, _PAUSE_KINDS = protocol.FORGETTING_KINDS, protocol.PAUSE_KINDS
_PAUSING = ("paused", "pause_extended")


@dataclass
class NodeRecord:
    """One node as the coordinator knows it; survives the node's silence and restarts."""

    node_id: str
    boot: str
    engines: dict[str, dict[str, Any]]
    last_heard: float                 # monotonic
    last_seen: float                  # wall clock, for people
    reachable: bool = True
    received_seq: int = 0             # highest event seq of `boot` received
    snapshot_seq: int = 0             # the HELLO's last_seq: older events are in its snapshot
    metrics_port: int | None = None   # the HELLO's: where the node serves its metrics
    old_boots: deque[str] = field(default_factory=lambda: deque(maxlen=OLD_BOOTS_KEPT))


def node_event(node_id: str, kind: str, detail: str, ts: float) -> dict[str, Any]:
    """An event of the coordinator's own about a node, shaped like the nodes' events."""
    return {"ts": ts, "node_id": node_id, "engine": None, "incarnation": None, "kind": kind,
            "from": None, "to": None, "cause": None, "detail": detail}


class FleetView:
    def __init__(self, node_timeout_s: float = NODE_TIMEOUT_S) -> None:
        self.node_timeout_s = node_timeout_s
        self.nodes: dict[str, NodeRecord] = {}
        self.refused: Counter[str] = Counter()
        # node -> (boot, seq) of the last event relayed before a coordinator restart (the
        # journal): what the node resends of it is not new
        self.journaled: dict[str, tuple[str, int]] = {}
        self.expected: set[str] = set()   # the nodes the journal knew at the start

    # ------------------------------------------------------------------ node messages

    def hello(self, msg: protocol.Hello, peer: str, now: float, wall: float
              ) -> list[dict[str, Any]]:
        """Take a node's snapshot; the coordinator's own events it causes (node_reachable).

        `peer` is who sent it: the routing id, or the name of its CURVE key. Refused: a HELLO
        for another node id, or for a boot of this node that was superseded already (two
        daemons claim one node id)."""
        if msg.node_id != peer:
            raise Refused("unknown_node", f"HELLO for node {msg.node_id!r} from peer {peer!r}: "
                                          "a node announces only itself")
        record = self.nodes.get(msg.node_id)
        engines = {e["id"]: dict(e) for e in msg.engines}
        if record is None:
            boot, seq = self.journaled.pop(msg.node_id, (msg.boot, 0))
            self.nodes[msg.node_id] = NodeRecord(msg.node_id, msg.boot, engines, now, wall,
                                                 received_seq=seq if boot == msg.boot else 0,
                                                 snapshot_seq=msg.last_seq,
                                                 metrics_port=msg.metrics_port)
            return [node_event(msg.node_id, "node_reachable", f"hello, boot {msg.boot}", wall)]
        if msg.boot in record.old_boots:
            # Two daemons claim one node id (or someone posed as it without CURVE). The
            # latest HELLO wins, so that a locked-out real node comes back by reconnecting;
            # the flapping is counted and logged for the operator.
            self.refused["duplicate_node"] += 1
            log.warning("node %r: boot %s is back after boot %s replaced it: two daemons "
                        "with one node id?", msg.node_id, msg.boot, record.boot)
            record.old_boots.remove(msg.boot)
        if msg.boot != record.boot:
            record.old_boots.append(record.boot)
            record.boot, record.received_seq = msg.boot, 0
        record.engines = engines
        record.snapshot_seq = msg.last_seq
        record.metrics_port = msg.metrics_port
        return self._heard(record, now, wall, f"hello, boot {msg.boot}")

    def event(self, msg: protocol.Event, peer: str, now: float, wall: float
              ) -> tuple[bool, list[dict[str, Any]]]:
        """(is it new, the coordinator's own events it causes). A new event is relayed and
        applied to the view, unless the node's last snapshot already holds it."""
        record = self.nodes.get(peer)
        if record is None or msg.node_id != peer:
            raise Refused("no_hello", f"event from {peer!r} for node {msg.node_id!r} before "
                                      "any HELLO of that node")
        if msg.boot != record.boot:
            raise Refused("stale_boot", f"event of node {peer!r} from boot {msg.boot}, not "
                                        f"the current boot {record.boot}")
        own = self._heard(record, now, wall, "event")
        if msg.seq <= record.received_seq:
            self.refused["replayed"] += 1
            return False, own
        record.received_seq = msg.seq
        if msg.seq > record.snapshot_seq:
            apply_event(record.engines, msg.event, msg.engine_status)
        return True, own

    def batch(self, batch: protocol.PlainEvents, peer: str, now: float, wall: float
              ) -> list[dict[str, Any]] | None:
        """A node's "events" frame taken whole, as `event` would take each of its events, when
        that is plain: the node's current boot, each seq the next after the last received, no
        engine stopping (which may restart a group's parts: decided event by event). Then the
        coordinator's own events it causes; None otherwise, and nothing changed. Its events
        are read as parsed: no object per event (a fleet-wide pause is 8,000 of them)."""
        record = self.nodes.get(peer)
        if record is None:
            return None
        boot, seq = record.boot, record.received_seq
        for item in batch.items:
            seq += 1
            if (item["seq"] != seq or item["boot"] != boot or item["node_id"] != peer
                    or item["event"].get("to") == _STOPPING):
                return None
        own = self._heard(record, now, wall, "event")
        record.received_seq = seq
        snapshot, engines = record.snapshot_seq, record.engines
        for item in batch.items:
            if item["seq"] > snapshot:
                apply_event(engines, item["event"], item.get("engine_status"))
        return own

    def run(self, run: PlainRun, peer: str, now: float, wall: float
            ) -> list[dict[str, Any]] | None:
        """A node's run (1.4) taken whole, as `batch` takes an "events" frame (and when), its
        events read as the frame says them (an event's own field, else its `common` one)."""
        record = self.nodes.get(peer)
        if (record is None or run.node_id != peer or run.boot != record.boot
                or run.seq != record.received_seq + 1):
            return None
        events, statuses = run.events, run.statuses
        defaults = common_defaults(run.common)
        to = defaults[_TO]
        for event in events:
            if event.get("to", to) == _STOPPING:
                return None
        own = self._heard(record, now, wall, "event")
        record.received_seq = run.seq + len(events) - 1
        start = max(0, record.snapshot_seq + 1 - run.seq)   # past the HELLO's snapshot
        apply_run(record.engines, events, statuses, defaults, start)
        return own

    def heard(self, peer: str, now: float, wall: float) -> list[dict[str, Any]]:
        """Any other message from a node (a heartbeat, a reply) keeps it reachable."""
        record = self.nodes.get(peer)
        return [] if record is None else self._heard(record, now, wall, "heartbeat")

    def _heard(self, record: NodeRecord, now: float, wall: float, what: str
               ) -> list[dict[str, Any]]:
        record.last_heard, record.last_seen = now, wall
        if record.reachable:
            return []
        record.reachable = True
        return [node_event(record.node_id, "node_reachable", f"{what} after silence", wall)]

    def tick(self, now: float, wall: float) -> list[dict[str, Any]]:
        """Nodes silent past the deadline become unreachable (their engines stay listed)."""
        out = []
        for record in self.nodes.values():
            if record.reachable and now - record.last_heard > self.node_timeout_s:
                record.reachable = False
                out.append(node_event(record.node_id, "node_unreachable",
                                      f"nothing heard for {now - record.last_heard:.1f} s "
                                      f"(deadline {self.node_timeout_s:g} s)", wall))
        return out

    # ------------------------------------------------------------------ questions

    def warm(self, started: float, now: float) -> bool:
        """Whether the view is whole again after a start: every node known from the journal
        has said hello, or a node timeout has passed (a node still silent then may be gone)."""
        if now - started >= self.node_timeout_s:   # (first: the cheap question, every command)
            return True
        return bool(self.expected) and self.expected <= self.nodes.keys()

    def reachable(self) -> list[str]:
        return [n for n, r in self.nodes.items() if r.reachable]

    def status(self, node: str | None = None, after: str | None = None,
               max_bytes: int = STATUS_PAGE_BYTES) -> dict[str, Any]:
        """The fleet view as `status --coordinator --json` prints it, one page of it: the nodes
        after node id `after`, in order, as many as fit in about `max_bytes` of JSON (at least
        one). `next` is the `after` of the next page, or null on the last."""
        if node is not None:
            records = [self.nodes[node]] if node in self.nodes else []
        else:
            records = sorted((r for r in self.nodes.values()
                              if after is None or r.node_id > after), key=lambda r: r.node_id)
        page: list[dict[str, Any]] = []
        size = 0
        for record in records:
            entry = {"node_id": record.node_id, "reachable": record.reachable,
                     "last_seen": record.last_seen, "boot": record.boot,
                     "metrics_port": record.metrics_port,
                     "engines": [engine_view(e, record.reachable)
                                 for e in record.engines.values()]}
            size += len(json.dumps(entry, separators=(",", ":")))
            if page and size > max_bytes:
                return {"nodes": page, "next": page[-1]["node_id"]}
            page.append(entry)
        return {"nodes": page, "next": None}

    def process_of(self, node_id: str, engine_id: str, incarnation: int) -> str | None:
        """The identity of the main process of this incarnation, as its node shows it (None
        if the view shows another incarnation, or a node too old to say)."""
        record = self.nodes.get(node_id)
        engine = record.engines.get(engine_id) if record else None
        if engine is None or engine.get("incarnation") != incarnation:
            return None
        process = engine.get("process")
        return process if isinstance(process, str) else None

    def group_restarts(self, node_id: str, event: dict[str, Any]) -> list[tuple[str, str]]:
        """The other parts of a multi-node engine to restart because this event says one
        part failed: a running part going to `stopping` for any cause but `commanded`."""
        if (event.get("kind") != "state" or event.get("to") != EngineState.STOPPING
                or event.get("cause") in (None, "commanded")
                or event.get("from") not in RUNNING_STATES):
            return []
        engine_id = str(event.get("engine"))
        engine = self.nodes[node_id].engines.get(engine_id)
        group = engine.get("group") if engine else None
        if not group:
            return []
        targets = [(r, e) for r in self.nodes.values() if r.reachable
                   for e in r.engines.values()
                   if e.get("group") == group and (r.node_id, e["id"]) != (node_id, engine_id)
                   and e.get("state") in RUNNING_STATES]
        for _, part in targets:  # restarting now: a second failure must not restart it again
            part["state"] = EngineState.STOPPING.value
        return [(r.node_id, e["id"]) for r, e in targets]


# The fields of an event that `apply_event` reads, in the order it and `apply_run` unpack them:
# what a run's `common` (1.5) says of them for all its events (an event's own win), read once a
# run.
DEFAULTED_FIELDS = ("engine", "kind", "incarnation", "to", "deadline")
NO_DEFAULTS: tuple[Any, ...] = (None,) * len(DEFAULTED_FIELDS)
_TO = DEFAULTED_FIELDS.index("to")


def common_defaults(common: dict[str, Any] | None) -> tuple[Any, ...]:
    """`common`'s values of DEFAULTED_FIELDS (None for each it does not say)."""
    return NO_DEFAULTS if common is None else tuple(map(common.get, DEFAULTED_FIELDS))


def apply_event(engines: dict[str, dict[str, Any]], event: dict[str, Any],
                status: dict[str, Any] | None, defaults: tuple[Any, ...] = NO_DEFAULTS) -> None:
    """Bring one engine's entry up to date with an event message's `event` and
    `engine_status`: the status the node sent along replaces it; an event without one (a pause
    event, or any event of an older node) updates what the event itself says, or else what
    its run says for all (`defaults`: `common_defaults`)."""
    if status is not None:
        engines[status["id"]] = dict(status)
        return
    get = event.get
    engine_default, kind_default, incarnation_default, to_default, deadline_default = defaults
    engine_id = str(get("engine", engine_default))
    engine = engines.get(engine_id)
    if engine is None:
        return
    kind, incarnation = get("kind", kind_default), get("incarnation", incarnation_default)
    if kind in _FORGETTING and incarnation in (None, engine.get("incarnation")):
        del engines[engine_id]   # gone from its node: from the view and router
        return
    if incarnation is not None:
        engine["incarnation"] = incarnation
    if kind == "state":
        to = get("to", to_default)
        if isinstance(to, str):
            engine["state"] = to
    elif kind in _PAUSE_KINDS:   # sent without a status: they say all they change
        engine["paused"], engine["pause_deadline"] = pause_fields(
            kind, get("deadline", deadline_default))


def pause_fields(kind: object, deadline: Any) -> tuple[bool, Any]:
    """An engine's `paused` and `pause_deadline` after a PAUSE_KINDS event with `deadline`."""
    paused = kind in _PAUSING
    return paused, deadline if paused else None


def apply_run(engines: dict[str, dict[str, Any]], events: list[dict[str, Any]],
              statuses: list[dict[str, Any] | None] | None, defaults: tuple[Any, ...],
              start: int) -> None:
    """apply_event for a run's events from `start`. A pause kind said once (`defaults`) for
    events that say no kind, incarnation or deadline of their own, as a fleet-wide pause's
    (each its engine and time), is set in one loop: a fifth of the coordinator's pause went to
    apply_event's questions, asked again for each engine."""
    engine_default, kind, incarnation, _, deadline = defaults
    if statuses is not None or kind not in _PAUSE_KINDS:
        for i in range(start, len(events)):
            apply_event(engines, events[i], None if statuses is None else statuses[i], defaults)
        return
    paused, deadline = pause_fields(kind, deadline)
    for i in range(start, len(events)):
        event = events[i]
        if "kind" in event or "incarnation" in event or "deadline" in event:
            apply_event(engines, event, None, defaults)
            continue
        engine = engines.get(str(event.get("engine", engine_default)))
        if engine is not None:
            if incarnation is not None:
                engine["incarnation"] = incarnation
            engine["paused"], engine["pause_deadline"] = paused, deadline


def engine_view(engine: dict[str, Any], reachable: bool) -> dict[str, Any]:
    """An engine as the fleet shows it: its node's status object plus the fleet's fields.
    Until the refit bridge records weights, `serving` means healthy on a reachable node and
    `weight_version` is unknown (null)."""
    return {**engine, "weight_version": engine.get("weight_version"),
            "serving": reachable and engine.get("state") == EngineState.HEALTHY,
            "reachable": reachable}

