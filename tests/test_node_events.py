"""What the hub does with a node's events (agent/node_events.py), driven without a socket: a
real fleet view, the coordinator's group-restart rule, and what goes out recorded in order (the
relay, the ACK count, refusals, restarts)."""

from __future__ import annotations

from typing import Any, cast

from rollout_watchdog.agent.acks import AckSchedule
from rollout_watchdog.agent.hub_policy import OwnEvent, Policy
from rollout_watchdog.agent.node_events import NodeEvents
from rollout_watchdog.agent.relay import Relayed
from rollout_watchdog.common import protocol
from rollout_watchdog.common.plain import PlainRun, decode_plain
from rollout_watchdog.common.protocol import Event, Hello, Run
from rollout_watchdog.refit_bridge.fleet import FleetView

T0, WALL0 = 1000.0, 1_700_000_000.0


class RecordedAcks(AckSchedule):
    """The ACK count, recorded with the other results."""

    def __init__(self, out: list[tuple[str, Any]]) -> None:
        super().__init__()
        self.out = out

    def took(self, node: str, events: int) -> None:
        self.out.append(("ack", (node, events)))
        super().took(node, events)


class Recorded:
    """Where NodeEvents' results go, in one list, in the order they went."""

    def __init__(self, view: Watched) -> None:
        self.view = view
        self.out: list[tuple[str, Any]] = []
        self.acks = RecordedAcks(self.out)
        self.items: list[Relayed] = []

    def restarts(self, peer: str, msg: Event) -> list[tuple[str, str]]:
        return self.view.group_restarts(peer, msg.event)   # (the coordinator's rule)

    def group_restart(self, node: str, engine: str, cause: Event) -> None:
        self.out.append(("restart", (node, engine, cause.seq)))

    def relay(self, item: Relayed) -> None:
        self.out.append(("relay", (item.seq, item.count, item.kind)))
        self.items.append(item)

    def own_events(self, events: list[OwnEvent]) -> None:
        self.out += [("own", e["kind"]) for e in events]

    def bad(self, reason: str, detail: str) -> None:
        self.out.append(("bad", reason))

    def node_events(self) -> NodeEvents:
        return NodeEvents(self.view, cast(Policy, self), self.acks, self.relay,
                          self.own_events, self.bad)


class Watched(FleetView):
    """A view that fails the test if an event is taken alone while `alone` is False."""

    alone = True

    def event(self, msg: Event, peer: str, now: float, wall: float
              ) -> tuple[bool, list[dict[str, Any]]]:
        assert self.alone, f"event {msg.seq} taken alone"
        return super().event(msg, peer, now, wall)


def engine(engine_id: str, group: str | None = None) -> dict[str, Any]:
    return {"id": engine_id, "state": "healthy", "paused": False, "incarnation": 1,
            "group": group, "tp_size": 1}


def paused(node: str, seq: int, engine_id: str, boot: str = "b1") -> Event:
    return Event(node, boot, seq, {"ts": WALL0 + seq, "node_id": node, "engine": engine_id,
                                   "incarnation": 1, "kind": "paused", "from": None,
                                   "to": None, "cause": None, "detail": "deep probes paused",
                                   "deadline": WALL0 + 60})


def crashed(node: str, seq: int, engine_id: str) -> Event:
    return Event(node, "b1", seq, {"ts": WALL0 + seq, "node_id": node, "engine": engine_id,
                                   "incarnation": 1, "kind": "state", "from": "healthy",
                                   "to": "stopping", "cause": "exited", "detail": ""})


def fleet(*nodes: tuple[str, list[dict[str, Any]]]) -> Recorded:
    view = Watched()
    for node, engines in nodes:
        view.hello(Hello(node, "b1", engines, 0), node, T0, WALL0)
    return Recorded(view)


def test_a_run_of_new_events_is_taken_whole_and_relayed_as_the_frame_it_came_in() -> None:
    rec = fleet(("n1", [engine(f"e{i}") for i in range(8)]))
    rec.view.alone = False
    run = Run.of([paused("n1", seq, f"e{seq - 1}") for seq in range(1, 9)], common=True)
    frame = protocol.encode(run)
    decoded = decode_plain(frame)
    assert isinstance(decoded, PlainRun) and decoded.common is not None
    rec.node_events().run(decoded, frame, "n1", T0, WALL0)
    assert rec.out == [("ack", ("n1", 8)), ("relay", (1, 8, "run"))]
    assert rec.items[0].frame is frame and rec.items[0].common
    assert rec.view.nodes["n1"].received_seq == 8
    assert all(e["paused"] for e in rec.view.nodes["n1"].engines.values())


def test_a_plain_events_frame_is_taken_whole_from_the_next_seq() -> None:
    rec = fleet(("n1", [engine(f"e{i}") for i in range(5)]))
    intake = rec.node_events()
    for seq in (1, 2):
        single = paused("n1", seq, f"e{seq - 1}")
        intake.event(single, protocol.encode(single), "n1", T0, WALL0)
    rec.view.alone = False
    frame = protocol.encode(protocol.Events([paused("n1", seq, f"e{seq - 1}")
                                             for seq in (3, 4, 5)]))
    batch = decode_plain(frame)
    assert isinstance(batch, protocol.PlainEvents)
    intake.batch(batch, frame, "n1", T0, WALL0)
    assert rec.out[-2:] == [("ack", ("n1", 3)), ("relay", (3, 3, "events"))]
    assert rec.items[-1].frame is frame and rec.view.nodes["n1"].received_seq == 5


def test_a_run_overlapping_what_was_taken_goes_event_by_event_and_only_the_new_are_relayed(
        ) -> None:
    rec = fleet(("n1", [engine("e0"), engine("e1"), engine("e2")]))
    intake = rec.node_events()
    first = paused("n1", 1, "e0")
    intake.event(first, protocol.encode(first), "n1", T0, WALL0)
    run = Run.of([paused("n1", 1, "e0"), paused("n1", 2, "e1"), paused("n1", 3, "e2")])
    frame = protocol.encode(run)
    plain = decode_plain(frame)
    assert isinstance(plain, PlainRun)
    intake.run(plain, frame, "n1", T0, WALL0)
    # the replayed seq 1 is dropped (the view counts it); 2 and 3 go out each as an event
    assert rec.out == [("ack", ("n1", 1)), ("relay", (1, 1, "event")),
                       ("ack", ("n1", 3)), ("relay", (2, 1, "event")), ("relay", (3, 1, "event"))]
    assert rec.view.refused["replayed"] == 1 and rec.view.nodes["n1"].received_seq == 3


def test_a_refused_event_in_a_batch_is_counted_and_the_events_around_it_are_taken() -> None:
    rec = fleet(("n1", [engine("e0"), engine("e1"), engine("e2")]))
    batch = protocol.Events([paused("n1", 1, "e0"), paused("n1", 2, "e1", boot="b0"),
                             paused("n1", 2, "e2")])
    rec.node_events().batch(batch, protocol.encode(batch), "n1", T0, WALL0)
    assert rec.out == [("bad", "stale_boot"), ("ack", ("n1", 3)), ("relay", (1, 1, "event")),
                       ("relay", (2, 1, "event"))]
    assert [e["paused"] for e in rec.view.nodes["n1"].engines.values()] == [True, False, True]


def test_a_part_that_fails_in_a_batch_restarts_its_group_after_the_batch_is_relayed() -> None:
    rec = fleet(("n1", [engine("e0"), engine("e1", group="g")]),
                ("n2", [engine("e0", group="g")]))
    batch = protocol.Events([paused("n1", 1, "e0"), crashed("n1", 2, "e1")])
    rec.node_events().batch(batch, protocol.encode(batch), "n1", T0, WALL0)
    assert rec.out == [("ack", ("n1", 2)), ("relay", (1, 2, "events")),
                       ("restart", ("n2", "e0", 2))]


def test_a_part_that_fails_alone_restarts_its_group_after_its_event_is_relayed() -> None:
    rec = fleet(("n1", [engine("e1", group="g")]), ("n2", [engine("e0", group="g")]))
    event = crashed("n1", 1, "e1")
    rec.node_events().event(event, protocol.encode(event), "n1", T0, WALL0)
    assert rec.out == [("ack", ("n1", 1)), ("relay", (1, 1, "event")),
                       ("restart", ("n2", "e0", 1))]


def test_a_silent_node_heard_again_through_its_events_is_said_reachable_first() -> None:
    rec = fleet(("n1", [engine("e0")]))
    later = T0 + 2 * rec.view.node_timeout_s
    rec.view.tick(later, WALL0)
    event = paused("n1", 1, "e0")
    rec.node_events().event(event, protocol.encode(event), "n1", later, WALL0)
    assert rec.out == [("own", "node_reachable"), ("ack", ("n1", 1)),
                       ("relay", (1, 1, "event"))]
