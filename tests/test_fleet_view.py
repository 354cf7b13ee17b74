"""The coordinator's fleet view, driven with plain messages and explicit clocks (no sockets):
which node messages are taken or refused, what the fleet status shows, when nodes go silent,
and which parts of a multi-node engine a failure restarts (docs/protocol.md, "The
coordinator's side")."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest

from rollout_watchdog.common import protocol
from rollout_watchdog.common.plain import PlainRun, decode_plain
from rollout_watchdog.common.protocol import (
    Event,
    Hello,
    PlainEvents,
    ProtocolError,
    Run,
    decode,
    encode,
)
from rollout_watchdog.refit_bridge.fleet import FleetView, Refused
from rollout_watchdog.refit_bridge.held import waits_for_the_view

T0 = 1000.0          # monotonic clock of the tests
WALL0 = 1_700_000_000.0


def engine(engine_id: str, state: str = "healthy", group: str | None = None,
           incarnation: int = 1) -> dict[str, Any]:
    """An engine object as a node's status shows it (the fields the fleet reads, plus some)."""
    return {"id": engine_id, "state": state, "paused": False, "incarnation": incarnation,
            "pid": 4242, "restarts": 0, "group": group, "tp_size": 1}


def hello(node: str, boot: str = "b1", engines: list[dict[str, Any]] | None = None,
          last_seq: int = 0) -> Hello:
    return Hello(node, boot, engines if engines is not None else [engine("e0")], last_seq)


def state_event(node: str, seq: int, engine_id: str, src: str, dst: str,
                cause: str | None, boot: str = "b1",
                status: dict[str, Any] | None = None) -> Event:
    """A node's state-change event, with the engine's status after it when `status` is given."""
    body = {"ts": WALL0 + seq, "node_id": node, "engine": engine_id, "incarnation": 1,
            "kind": "state", "from": src, "to": dst, "cause": cause, "detail": ""}
    return Event(node, boot, seq, body, status)


def joined(view: FleetView, node: str, **kwargs: Any) -> None:
    view.hello(hello(node, **kwargs), node, T0, WALL0)


def engine_state(view: FleetView, node: str, engine_id: str) -> str:
    (entry,) = [n for n in view.status()["nodes"] if n["node_id"] == node]
    return str(next(e["state"] for e in entry["engines"] if e["id"] == engine_id))


# ---------------------------------------------------------------------- HELLO


def test_hello_makes_the_node_reachable_and_says_so() -> None:
    view = FleetView()
    own = view.hello(hello("n1"), "n1", T0, WALL0)
    assert [(e["kind"], e["node_id"], e["engine"]) for e in own] == \
        [("node_reachable", "n1", None)]
    assert view.reachable() == ["n1"]
    # a second HELLO of a node already reachable (a reconnect) announces nothing new
    assert view.hello(hello("n1"), "n1", T0 + 1, WALL0 + 1) == []


def test_hello_for_another_node_is_refused_as_unknown_node() -> None:
    view = FleetView()
    with pytest.raises(Refused) as refused:
        view.hello(hello("n2"), "n1", T0, WALL0)
    assert refused.value.reason == "unknown_node"
    assert "n2" in str(refused.value) and "n1" in str(refused.value)
    assert view.status() == {"nodes": [], "next": None}


def test_hello_for_a_superseded_boot_is_counted_as_duplicate_node_and_wins() -> None:
    """Two daemons with one node id (or an impostor without CURVE): the latest HELLO wins,
    so a real node locked out by an impostor comes back by reconnecting; each return of an
    old boot is counted."""
    view = FleetView()
    joined(view, "n1", boot="b1")
    joined(view, "n1", boot="b2")
    view.hello(hello("n1", boot="b1"), "n1", T0 + 1, WALL0 + 1)
    assert view.refused["duplicate_node"] == 1
    assert view.status()["nodes"][0]["boot"] == "b1"
    view.hello(hello("n1", boot="b2"), "n1", T0 + 2, WALL0 + 2)
    assert view.refused["duplicate_node"] == 2
    assert view.status()["nodes"][0]["boot"] == "b2"


# ---------------------------------------------------------------------- events


def test_new_events_are_taken_and_a_replayed_seq_is_dropped_and_counted() -> None:
    view = FleetView()
    joined(view, "n1")
    first = state_event("n1", 1, "e0", "healthy", "suspect", "probe_failed")
    assert view.event(first, "n1", T0, WALL0) == (True, [])
    assert view.event(state_event("n1", 2, "e0", "suspect", "healthy", "probe_passed"),
                      "n1", T0, WALL0)[0] is True
    assert view.event(first, "n1", T0, WALL0)[0] is False
    assert view.event(state_event("n1", 2, "e0", "suspect", "healthy", "probe_passed"),
                      "n1", T0, WALL0)[0] is False
    assert view.refused["replayed"] == 2
    assert engine_state(view, "n1", "e0") == "healthy"


def test_an_event_before_hello_is_refused() -> None:
    view = FleetView()
    with pytest.raises(Refused) as refused:
        view.event(state_event("n1", 1, "e0", "healthy", "suspect", "probe_failed"), "n1",
                   T0, WALL0)
    assert refused.value.reason == "no_hello"


def test_an_event_from_a_stale_boot_is_refused() -> None:
    view = FleetView()
    joined(view, "n1", boot="b1")
    joined(view, "n1", boot="b2")
    with pytest.raises(Refused) as refused:
        view.event(state_event("n1", 9, "e0", "healthy", "suspect", "probe_failed", boot="b1"),
                   "n1", T0, WALL0)
    assert refused.value.reason == "stale_boot"
    # the new boot counts its events from 1 again
    assert view.event(state_event("n1", 1, "e0", "healthy", "suspect", "probe_failed",
                                  boot="b2"), "n1", T0, WALL0)[0] is True


def test_events_held_in_the_hello_snapshot_are_relayed_but_do_not_regress_it() -> None:
    """A node resends its unacknowledged events after its HELLO; they are news to clients, but
    the snapshot already holds their effect and more."""
    view = FleetView()
    joined(view, "n1", engines=[engine("e0", state="healthy", incarnation=2)], last_seq=2)
    old = state_event("n1", 2, "e0", "starting", "stopping", "startup_timeout",
                      status=engine("e0", state="stopping", incarnation=1))
    assert view.event(old, "n1", T0, WALL0)[0] is True
    assert engine_state(view, "n1", "e0") == "healthy"
    newer = state_event("n1", 3, "e0", "healthy", "suspect", "probe_failed",
                        status=engine("e0", state="suspect", incarnation=2))
    assert view.event(newer, "n1", T0, WALL0)[0] is True
    assert engine_state(view, "n1", "e0") == "suspect"


def test_engine_status_replaces_the_engine_entry() -> None:
    view = FleetView()
    joined(view, "n1", engines=[engine("e0"), engine("e1")])
    status = {**engine("e0", state="backoff", incarnation=4), "restarts": 3}
    view.event(state_event("n1", 1, "e0", "stopping", "backoff", "exited", status=status),
               "n1", T0, WALL0)
    (node,) = view.status()["nodes"]
    e0 = next(e for e in node["engines"] if e["id"] == "e0")
    assert {k: e0[k] for k in status} == status
    assert engine_state(view, "n1", "e1") == "healthy"


def test_an_event_without_engine_status_updates_what_it_says() -> None:
    """Bare events (an older node's, and pause events): the state and pause they report show."""
    view = FleetView()
    joined(view, "n1")
    view.event(state_event("n1", 1, "e0", "healthy", "suspect", "probe_failed"), "n1",
               T0, WALL0)
    paused = {"ts": WALL0, "node_id": "n1", "engine": "e0", "incarnation": 1,
              "kind": "paused", "from": None, "to": None, "cause": None, "detail": ""}
    view.event(Event("n1", "b1", 2, {**paused, "deadline": WALL0 + 60}), "n1", T0, WALL0)
    (e0,) = view.status()["nodes"][0]["engines"]
    assert (e0["state"], e0["paused"], e0["pause_deadline"]) == ("suspect", True, WALL0 + 60)
    view.event(Event("n1", "b1", 3, {**paused, "kind": "pause_expired"}), "n1", T0, WALL0)
    (e0,) = view.status()["nodes"][0]["engines"]
    assert (e0["paused"], e0["pause_deadline"]) == (False, None)


# ---------------------------------------------------------------------- silence


def test_a_silent_node_becomes_unreachable_once_and_its_engines_stay_listed() -> None:
    view = FleetView(node_timeout_s=5.0)
    joined(view, "n1")
    joined(view, "n2")
    view.heard("n2", T0 + 4.0, WALL0 + 4.0)
    assert view.tick(T0 + 5.0, WALL0 + 5.0) == []          # at the deadline, not past it
    gone = view.tick(T0 + 5.1, WALL0 + 5.1)
    assert [(e["kind"], e["node_id"]) for e in gone] == [("node_unreachable", "n1")]
    assert view.tick(T0 + 8.0, WALL0 + 8.0) == []          # said once
    assert view.reachable() == ["n2"]
    n1 = view.status("n1")["nodes"][0]
    assert n1["reachable"] is False and n1["last_seen"] == WALL0
    assert [(e["id"], e["reachable"], e["serving"]) for e in n1["engines"]] \
        == [("e0", False, False)]
    # the next message from it makes it reachable again, announced once
    back = view.heard("n1", T0 + 9.0, WALL0 + 9.0)
    assert [(e["kind"], e["node_id"]) for e in back] == [("node_reachable", "n1")]
    assert view.heard("n1", T0 + 9.5, WALL0 + 9.5) == []
    again = view.status("n1")["nodes"][0]["engines"][0]
    assert (again["reachable"], again["serving"]) == (True, True)


def test_a_hello_after_silence_makes_the_node_reachable_again() -> None:
    view = FleetView(node_timeout_s=5.0)
    joined(view, "n1")
    view.tick(T0 + 6.0, WALL0 + 6.0)
    own = view.hello(hello("n1", boot="b2"), "n1", T0 + 7.0, WALL0 + 7.0)
    assert [e["kind"] for e in own] == ["node_reachable"]
    assert view.reachable() == ["n1"]


# ---------------------------------------------------------------------- status


def test_status_has_exactly_the_documented_shape() -> None:
    view = FleetView()
    node_engine = engine("e0", group="g1")
    view.hello(hello("n2", boot="b7", engines=[node_engine]), "n2", T0, WALL0 + 2)
    view.hello(hello("n1", boot="b3", engines=[engine("e1", state="starting")]), "n1",
               T0, WALL0 + 1)
    status = view.status()
    assert list(status) == ["nodes", "next"]
    assert [n["node_id"] for n in status["nodes"]] == ["n1", "n2"]
    n2 = status["nodes"][1]
    assert set(n2) == {"node_id", "reachable", "last_seen", "boot", "metrics_port", "engines"}
    assert (n2["reachable"], n2["last_seen"], n2["boot"]) == (True, WALL0 + 2, "b7")
    assert n2["metrics_port"] is None   # the node did not say
    (e0,) = n2["engines"]
    assert e0 == {**node_engine, "weight_version": None, "serving": True, "reachable": True}
    assert status["nodes"][0]["engines"][0]["serving"] is False   # starting is not serving
    assert view.status("n1")["nodes"] == [status["nodes"][0]]
    assert view.status("n9") == {"nodes": [], "next": None}


def test_the_metrics_port_of_the_latest_hello_is_in_the_view() -> None:
    view = FleetView()
    view.hello(Hello("n1", "b1", [], 0, metrics_port=9101), "n1", T0, WALL0)
    assert view.status()["nodes"][0]["metrics_port"] == 9101
    view.hello(Hello("n1", "b2", [], 0, metrics_port=9202), "n1", T0 + 1, WALL0 + 1)
    assert view.status()["nodes"][0]["metrics_port"] == 9202
    with pytest.raises(ProtocolError, match="metrics_port"):
        Hello("n1", "b3", [], 0, metrics_port=0)


# ---------------------------------------------------------------------- groups


def group_fleet() -> FleetView:
    """Group g1 spans n1/e0, n2/e0 (running) and n3/e0 (stopped); n1/e1 has no group."""
    view = FleetView()
    joined(view, "n1", engines=[engine("e0", group="g1"), engine("e1")])
    joined(view, "n2", engines=[engine("e0", group="g1", state="suspect"), engine("e1")])
    joined(view, "n3", engines=[engine("e0", group="g1", state="stopped")])
    return view


@pytest.mark.parametrize("cause", ["probe_failed", "exited", "stalled", "startup_timeout"])
def test_a_failing_part_restarts_the_other_running_parts_of_its_group(cause: str) -> None:
    view = group_fleet()
    event = state_event("n1", 1, "e0", "healthy", "stopping", cause,
                        status=engine("e0", state="stopping", group="g1"))
    view.event(event, "n1", T0, WALL0)
    assert view.group_restarts("n1", event.event) == [("n2", "e0")]


@pytest.mark.parametrize(("node", "engine_id", "was", "cause", "group"), [
    ("n2", "e0", "suspect", "commanded", "g1"),   # a commanded restart does not cascade
    ("n1", "e1", "healthy", "exited", None),      # an engine without a group
    ("n3", "e0", "backoff", "exited", "g1"),      # a part that was not running
])
def test_no_group_restart(node: str, engine_id: str, was: str, cause: str,
                          group: str | None) -> None:
    view = group_fleet()
    status = engine(engine_id, state="stopping", **({"group": group} if group else {}))
    event = state_event(node, 1, engine_id, was, "stopping", cause, status=status)
    view.event(event, node, T0, WALL0)
    assert view.group_restarts(node, event.event) == []


def test_parts_on_unreachable_nodes_are_not_restarted() -> None:
    view = group_fleet()
    view.heard("n1", T0 + 6.0, WALL0 + 6.0)
    view.tick(T0 + 6.0, WALL0 + 6.0)                     # n2 and n3 went silent
    event = state_event("n1", 1, "e0", "healthy", "stopping", "probe_failed",
                        status=engine("e0", state="stopping", group="g1"))
    view.event(event, "n1", T0 + 6.0, WALL0 + 6.0)
    assert view.group_restarts("n1", event.event) == []


def test_a_big_fleet_view_comes_in_pages_that_each_fit_a_message() -> None:
    view = FleetView()
    engines = [{"id": f"e{i}", "state": "healthy", "detail": "x" * 400} for i in range(8)]
    for n in range(300):
        view.hello(Hello(f"n{n:03d}", "b", engines, 0), f"n{n:03d}", 0.0, 0.0)
    pages, after = [], None
    while True:
        page = view.status(after=after, max_bytes=100_000)
        assert len(json.dumps(page)) < 110_000
        pages.append(page)
        after = page["next"]
        if after is None:
            break
    assert len(pages) > 1
    assert [n["node_id"] for p in pages for n in p["nodes"]] == [f"n{n:03d}" for n in range(300)]


def test_a_part_being_restarted_is_not_restarted_again_by_a_second_failure() -> None:
    view = group_fleet()
    joined(view, "n4", engines=[engine("e0", group="g1")])
    first = state_event("n1", 1, "e0", "healthy", "stopping", "exited",
                        status=engine("e0", state="stopping", group="g1"))
    view.event(first, "n1", T0, WALL0)
    assert sorted(view.group_restarts("n1", first.event)) == [("n2", "e0"), ("n4", "e0")]
    # n2/e0 fails on its own before its restart shows: n4/e0 is already on its way
    second = state_event("n2", 1, "e0", "suspect", "stopping", "probe_failed",
                         status=engine("e0", state="stopping", group="g1"))
    view.event(second, "n2", T0, WALL0)
    assert view.group_restarts("n2", second.event) == []


def test_the_view_is_warm_once_every_journaled_node_is_back_or_a_timeout_passed() -> None:
    """Until then a restarted coordinator leaves the router alone: emptying it because no node
    has said hello yet would take every engine out of service."""
    view = FleetView(node_timeout_s=5.0)
    assert not view.warm(started=0.0, now=1.0) and view.warm(started=0.0, now=5.0)
    view.journaled = {"n1": ("b1", 3), "n2": ("b2", 9)}
    view.expected = {"n1", "n2"}
    view.hello(hello("n1"), "n1", now=1.0, wall=1.0)
    assert not view.warm(started=0.0, now=1.0)      # n2 not back yet
    view.hello(hello("n2", boot="b2"), "n2", now=1.5, wall=1.5)
    assert view.warm(started=0.0, now=1.5)


# ---------------------------------------------------------------------- batches


def as_parsed(events: list[Event]) -> PlainEvents:
    """A node's "events" frame as the coordinator's hub reads it."""
    return PlainEvents([e.to_json() for e in events])


def paused(node: str, seq: int, engine_id: str, boot: str = "b1") -> Event:
    body = {"ts": WALL0 + seq, "node_id": node, "engine": engine_id, "incarnation": 1,
            "kind": "paused", "from": None, "to": None, "cause": None, "detail": "",
            "deadline": WALL0 + 60}
    return Event(node, boot, seq, body)


def taken_whole(view: FleetView, shape: str, events: list[Event], peer: str, now: float,
                wall: float) -> list[dict[str, Any]] | None:
    """A node's frame of `events` taken whole, as an "events" frame or as a run (1.4), its
    shared fields said once (1.5) or not, read as the hub reads it."""
    if shape.startswith("run"):
        run = decode_plain(encode(Run.of(events, common=shape == "run_common")))
        said_once = shape == "run_common" and len(events) > 1   # (one event shares nothing)
        assert isinstance(run, PlainRun) and (run.common is not None) == said_once
        return view.run(run, peer, now, wall)
    return view.batch(as_parsed(events), peer, now, wall)


@pytest.mark.parametrize("shape", ["events", "run", "run_common"])
def test_a_plain_batch_is_taken_whole_as_its_events_one_by_one(shape: str) -> None:
    """A fleet-wide pause's frame per node: the same view, seqs and reachability as taking
    each event alone."""
    engines = [engine(f"e{i}") for i in range(4)]
    whole, alone = FleetView(), FleetView()
    for view in (whole, alone):
        view.hello(hello("n1", engines=[dict(e) for e in engines], last_seq=1), "n1", T0, WALL0)
    batch = [paused("n1", seq, f"e{seq - 1}") for seq in range(1, 5)]
    view_tick = T0 + 2 * whole.node_timeout_s
    for view in (whole, alone):   # silent: the batch makes the node reachable again
        assert [e["kind"] for e in view.tick(view_tick, WALL0)] == ["node_unreachable"]
    own = taken_whole(whole, shape, batch, "n1", view_tick, WALL0 + 9)
    expected: list[dict[str, Any]] = []
    for event in batch:
        fresh, more = alone.event(event, "n1", view_tick, WALL0 + 9)
        assert fresh
        expected += more
    assert own == expected and [e["kind"] for e in own] == ["node_reachable"]
    assert whole.status() == alone.status()
    assert whole.nodes["n1"].received_seq == alone.nodes["n1"].received_seq == 4
    # seq 1 was in the HELLO's snapshot: not applied; the others paused with their deadline
    assert [e["paused"] for e in whole.nodes["n1"].engines.values()] == [False, True, True, True]


# Runs as a node could write them (the wire allows more than Run.of makes): each event's own
# fields, and `common` said once; an event's own field wins, its own null too.
HANDWRITTEN_RUNS = {
    "own_kind_wins": ({"kind": "paused", "deadline": 5.0, "incarnation": 1},
                      [{"engine": "e0"}, {"engine": "e1", "kind": "resumed"}]),
    "own_null_wins": ({"kind": "state", "to": "stopping", "engine": "e0"},
                      [{"to": None}, {"to": None}]),
    "engine_and_to_from_common": ({"engine": "e0", "kind": "state"},
                                  [{"to": "healthy"}, {"to": "suspect"}]),
    "incarnation_from_common": ({"kind": "state", "incarnation": 2, "to": "starting"},
                                [{"engine": "e0"}, {"engine": "e1"}]),
    "forgotten_by_common": ({"kind": "removed", "incarnation": 1}, [{"engine": "e1"}]),
    "deadline_own_null": ({"kind": "paused", "deadline": 9.0},
                          [{"engine": "e0", "deadline": None}, {"engine": "e1"}]),
    "own_incarnation_in_a_pause": ({"kind": "pause_extended", "deadline": 7.0, "incarnation": 2},
                                   [{"engine": "e0", "incarnation": 3}, {"engine": "e1"}]),
    "resumed_by_common": ({"kind": "resumed", "deadline": 7.0},
                          [{"engine": "e0", "ts": 1.0}, {"engine": "e1", "ts": 2.0}]),
    "pause_with_an_unknown_engine": ({"kind": "paused", "deadline": 3.0},
                                     [{"engine": "e9"}, {"engine": "e1"}]),
}


@pytest.mark.parametrize("case", sorted(HANDWRITTEN_RUNS))
def test_a_run_s_common_fields_are_read_as_if_merged_into_each_event(case: str) -> None:
    """The hub's run (its events as the frame says them, common not merged) leaves the view as
    the same events merged (protocol.decode) taken one by one."""
    common, events = HANDWRITTEN_RUNS[case]
    frame = json.dumps({"v": [1, 6], "kind": "run", "node_id": "n1", "boot": "b1", "seq": 1,
                        "common": common, "events": events}).encode()
    whole, alone = FleetView(), FleetView()
    for view in (whole, alone):
        joined(view, "n1", engines=[engine("e0"), engine("e1")])
    plain, merged = decode_plain(frame), decode(frame)
    assert isinstance(plain, PlainRun) and isinstance(merged, Run)
    assert whole.run(plain, "n1", T0, WALL0) is not None
    for event in merged.as_events():
        assert alone.event(event, "n1", T0, WALL0)[0]
    assert whole.status() == alone.status()
    engines = whole.nodes["n1"].engines
    assert {"own_kind_wins": lambda: (engines["e0"]["paused"], engines["e1"]["paused"])
            == (True, False),
            "own_null_wins": lambda: engines["e0"]["state"] == "healthy",
            "engine_and_to_from_common": lambda: engines["e0"]["state"] == "suspect",
            "incarnation_from_common": lambda: [e["incarnation"] for e in engines.values()]
            == [2, 2],
            "forgotten_by_common": lambda: list(engines) == ["e0"],
            "deadline_own_null": lambda: (engines["e0"]["pause_deadline"],
                                          engines["e1"]["pause_deadline"]) == (None, 9.0),
            "own_incarnation_in_a_pause": lambda: [
                (e["incarnation"], e["paused"], e["pause_deadline"]) for e in engines.values()]
            == [(3, True, 7.0), (2, True, 7.0)],
            "resumed_by_common": lambda: [(e["paused"], e["pause_deadline"])
                                          for e in engines.values()] == [(False, None)] * 2,
            "pause_with_an_unknown_engine": lambda: [
                e["paused"] for e in engines.values()] == [False, True],
            }[case]()


def test_a_hostile_from_restarts_nothing_and_raises_nothing() -> None:
    """A failure's `from` that is no state (a list: unhashable) is no running part failing."""
    view = FleetView()
    joined(view, "n1", engines=[engine("e0", group="g"), engine("e1", group="g")])
    view.nodes["n1"].engines["e1"]["state"] = ["healthy"]   # a hostile HELLO's state, too
    for source in ([], {"a": 1}, None, "stopping"):
        assert view.group_restarts("n1", {"kind": "state", "to": "stopping", "cause": "exited",
                                          "engine": "e0", "from": source}) == []
    assert view.group_restarts("n1", {"kind": "state", "to": "stopping", "cause": "exited",
                                      "engine": "e0", "from": "healthy"}) == []   # e1: no state


@pytest.mark.parametrize("shape", ["events", "run", "run_common"])
@pytest.mark.parametrize("case", ["gap", "replay", "other_boot", "other_node", "stopping",
                                  "all_stopping", "unknown_node"])
def test_a_batch_that_is_not_plain_is_left_to_the_event_by_event_path(case: str,
                                                                       shape: str) -> None:
    view = FleetView()
    joined(view, "n1", engines=[engine("e0"), engine("e1")])
    view.event(paused("n1", 1, "e0"), "n1", T0, WALL0)
    batch = {"gap": [paused("n1", 2, "e0"), paused("n1", 4, "e1")],
             "replay": [paused("n1", 1, "e0"), paused("n1", 2, "e1")],
             "other_boot": [paused("n1", 2, "e0", boot="b2")],
             "other_node": [paused("n1", 2, "e0"), Event("n2", "b1", 3, {})],
             "stopping": [paused("n1", 2, "e0"),
                          state_event("n1", 3, "e1", "healthy", "stopping", "exited")],
             "all_stopping": [state_event("n1", 2, "e0", "healthy", "stopping", "exited"),
                              state_event("n1", 3, "e1", "healthy", "stopping", "exited")],
             "unknown_node": [paused("n9", 1, "e0")]}[case]
    before = json.dumps(view.status())
    if shape != "events" and case in ("gap", "other_node"):   # not one run: its seqs follow on
        batch = [replace(batch[0], seq=3 if case == "gap" else 2,
                         node_id="n2" if case == "other_node" else "n1")]
    assert taken_whole(view, shape, batch, "n9" if case == "unknown_node" else "n1", T0 + 1,
                       WALL0) is None
    assert json.dumps(view.status()) == before and view.nodes["n1"].received_seq == 1


def test_a_restarted_coordinator_holds_what_needs_the_whole_fleet_until_its_nodes_are_back(
        ) -> None:
    view = FleetView(node_timeout_s=5.0)
    view.expected |= {"n1", "n2"}                      # the journal knew both
    view.hello(protocol.Hello("n1", "b1", [], 0), "n1", 100.0, 0.0)

    def waits(cmd: str, node: str | None = None, at: float = 101.0) -> bool:
        return waits_for_the_view(view, 100.0, at)(protocol.Command("r", cmd, {}, node))

    assert waits("pause") and waits("resume")          # every node: n2 not back yet
    assert not waits("pause", "n1") and waits("pause", "n2") and waits("remove", "n2")
    assert not waits("status") and not waits("ping") and waits("status", "n2")
    assert waits("refit_acquire") and not waits("refit_commit")
    assert not waits("pause", at=105.0)                # a node timeout on: n2 may be gone
    view.hello(protocol.Hello("n2", "b2", [], 0), "n2", 101.0, 0.0)
    assert not waits("pause") and not waits("refit_acquire")
    fresh = FleetView(node_timeout_s=5.0)   # no journal: only a node not heard from waits
    fresh.hello(protocol.Hello("n1", "b1", [], 0), "n1", 100.0, 0.0)
    for cmd, node, held in [("pause", None, False), ("refit_acquire", None, False),
                            ("pause", "n1", False), ("status", "n1", False),
                            ("remove", "n2", True), ("status", "n2", True)]:
        assert waits_for_the_view(fresh, 100.0, 100.1)(protocol.Command(
            "r", cmd, {}, node)) is held, (cmd, node)
    assert not waits_for_the_view(fresh, 100.0, 105.0)(protocol.Command("r", "remove", {}, "n2"))
