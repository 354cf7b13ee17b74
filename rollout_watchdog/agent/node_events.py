"""What the hub does with a node's events once decoded and its sender checked (docs/protocol.md,
"The coordinator's side"): a single "event", a "run" (1.4) or an "events" batch.

Each event goes into the fleet view (which says whether it is new), is counted for the node's
next ACK (`acks.AckSchedule`), relayed to subscribers, and may restart the other parts of a
multi-node engine (the policy decides). A node's plain run or batch is taken whole (the view's
`run`/`batch`: no object per event, a fleet-wide pause is 8,000 of them) and relayed as the
frame it came in; anything else is taken event by event, each refusal counted on its own.

The hub hands in where the results go (`relay`, `own_events`, `bad`): this module owns no
socket and no counter, so its decisions are the whole of it.
"""

from __future__ import annotations

from collections.abc import Callable

from rollout_watchdog.agent import frame_bounds
from rollout_watchdog.agent.acks import AckSchedule
from rollout_watchdog.agent.hub_policy import OwnEvent, Policy, Refused, View
from rollout_watchdog.agent.relay import Relayed
from rollout_watchdog.common import protocol
from rollout_watchdog.common.plain import PlainRun


class NodeEvents:
    """See the module docstring. Called by the hub's thread only."""

    def __init__(self, view: View, policy: Policy, acks: AckSchedule,
                 relay: Callable[[Relayed], None],
                 own_events: Callable[[list[OwnEvent]], None],
                 bad: Callable[[str, str], None]) -> None:
        self.view, self.policy, self.acks = view, policy, acks
        self._relay, self._own_events, self._bad = relay, own_events, bad

    def event(self, msg: protocol.Event, frame: bytes, peer: str, now: float, wall: float
              ) -> None:
        """One "event" message; Refused (for the hub to count) when its frame is too big or
        the view refuses it."""
        frame_bounds.check_size(msg, len(frame), peer)
        new, own = self.view.event(msg, peer, now, wall)
        self._own_events(own)
        self.acks.took(peer, 1)
        if not new:
            return
        self._relay(Relayed(msg.node_id, msg.boot, msg.seq, frame))
        for node, engine in self.policy.restarts(peer, msg):
            self.policy.group_restart(node, engine, msg)

    def run(self, msg: PlainRun, frame: bytes, peer: str, now: float, wall: float) -> None:
        """A node's run (1.4), taken whole when plain (FleetView.run: no object per event) and
        relayed as it came; else as the events it stands for, each on its own."""
        common = msg.common is not None
        if len(frame) <= protocol.MAX_RUN_BYTES and frame_bounds.reencodes_small(frame) \
                and frame_bounds.expands_small(common, len(msg.events)):
            own = self.view.run(msg, peer, now, wall)
            if own is not None:
                self._own_events(own)
                self.acks.took(peer, len(msg.events))
                self._relay(Relayed(peer, msg.boot, msg.seq, frame, len(msg.events), msg.KIND,
                                    common))
                return
        self.batch(protocol.Events(msg.run().as_events()), frame, peer, now, wall, msg.KIND,
                   common)

    def batch(self, msg: protocol.PlainEvents | protocol.Events, frame: bytes, peer: str,
              now: float, wall: float, kind: str = protocol.Events.KIND, common: bool = False
              ) -> None:
        """A batch (or the events of a run: `kind`, the frame's): each event taken as if it
        came alone (a refused one is counted), relayed as the node's frame when all are new
        (one ACK for all, as for any turn's events). A plain batch (FleetView.batch) is taken
        whole, with no object per event."""
        small = frame_bounds.reencodes_small(frame)   # (one scan of the frame for both paths)
        if (isinstance(msg, protocol.PlainEvents) and small
                and len(frame) <= protocol.MAX_EVENT_BYTES):
            own = self.view.batch(msg, peer, now, wall)
            if own is not None:
                count = len(msg.items)   # (its seqs run up to the last received)
                self._own_events(own)
                self.acks.took(peer, count)
                record = self.view.nodes[peer]
                self._relay(Relayed(peer, record.boot, record.received_seq - count + 1, frame,
                                    count, kind))
                return
        events = msg.events() if isinstance(msg, protocol.PlainEvents) else msg.events
        new: list[protocol.Event] = []
        restarts: list[tuple[protocol.Event, tuple[str, str]]] = []
        taken = False
        # (never a batch or run from this package's nodes: each event then is checked alone)
        big = len(frame) > (protocol.MAX_RUN_BYTES if kind == protocol.Run.KIND
                            else protocol.MAX_EVENT_BYTES)
        for event in events:
            try:
                if big:
                    frame_bounds.check_size(event, frame_bounds.encoded_size(event), peer)
                fresh, own = self.view.event(event, peer, now, wall)
            except Refused as exc:
                self._bad(exc.reason, str(exc))
                continue
            taken = True
            if own:
                self._own_events(own)
            if fresh:   # restarts decided in turn, as for single events; sent after the relay
                new.append(event)
                restarts += [(event, target) for target in self.policy.restarts(peer, event)]
        if taken:
            self.acks.took(peer, len(events))
        if len(new) == len(events) and small and (   # kept together: relayed as it came
                frame_bounds.expands_small(common, len(new))) and all(
                e.seq == new[0].seq + i for i, e in enumerate(new)):
            self._relay(Relayed(peer, new[0].boot, new[0].seq, frame, len(new), kind, common))
        else:
            for event in new:   # encoded now: one that cannot be sent is never relayed
                try:
                    self._relay(Relayed(event.node_id, event.boot, event.seq,
                                        protocol.encode(event)))
                except protocol.ProtocolError as exc:
                    self._bad("unsendable", f"event {event.seq} of {peer!r}: {exc}")
        for cause, (node, engine) in restarts:
            self.policy.group_restart(node, engine, cause)
