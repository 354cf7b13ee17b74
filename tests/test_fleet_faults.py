"""Faults on a real fleet: a coordinator process and node daemons over emulator engines, each a
process of its own, over loopback TCP (issue 6, "Tests"). Each fault is injected abruptly
(SIGKILL, a stalled or reset link, garbage), and each test asserts what a user checks: the fleet
view, and a FleetClient event stream that follows the whole module and must hold every event of
every node exactly once, in order, as the node's own `events` log has them.

One fleet is shared by the module (its start-up is most of the cost): node n1 with engines e0
and e1 dials the coordinator directly, node n2 with engine e0 dials it through a TcpRelay. Each
test starts by waiting for that fleet to be settled, whatever the test before it did.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import zmq
from daemon_harness import Node, wait_for
from fleet_harness import (
    CoordinatorProcess,
    TcpRelay,
    start_coordinator_process,
    start_node_process,
)
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from rollout_watchdog import CommandRefused, FleetClient, FleetEvent
from rollout_watchdog.common import protocol
from rollout_watchdog.common.lines import SEPARATOR
from rollout_watchdog.emulator.testing import free_port

NODE_TIMEOUT_S = 3.0      # the coordinator's: a stalled link shows within seconds (3 beats)
SETTLE_S = 60.0           # engines launched and healthy, on a loaded 2-core machine
EVENT_S = 20.0            # an event or a view change after its cause
FUZZ = settings(max_examples=100, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])


# ---------------------------------------------------------------------- a follower


class Follower:
    """A `FleetClient.events()` stream read on a thread of its own, so that it keeps following
    (heartbeats, re-subscribes after the coordinator's death) while a test injects faults."""

    def __init__(self, client: FleetClient) -> None:
        self.events: list[FleetEvent] = []
        self.error: BaseException | None = None   # what ended the stream, shown by the waits
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(client,), daemon=True,
                                        name="fleet-follower")
        self._thread.start()

    def _run(self, client: FleetClient) -> None:
        try:
            with client.events(idle_s=0.2) as stream:   # idle_s: the stop flag is seen in time
                while not self._stop.is_set():
                    for event in stream:
                        with self._lock:
                            self.events.append(event)
        except BaseException as exc:
            self.error = exc
            raise

    def snapshot(self, start: int = 0) -> list[FleetEvent]:
        if self.error is not None:
            raise AssertionError(f"the follower's stream failed: {self.error!r}")
        with self._lock:
            return self.events[start:]

    def wait(self, match: Callable[[FleetEvent], bool], what: str, start: int = 0,
             timeout: float = EVENT_S) -> FleetEvent:
        """The first event from index `start` on that matches."""
        return wait_for(lambda: next((e for e in self.snapshot(start) if match(e)), None),
                        timeout, what, interval=0.05)

    def of_boot(self, node_id: str, boot: str) -> list[FleetEvent]:
        return [e for e in self.snapshot() if (e.node_id, e.boot) == (node_id, boot)]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)


# ---------------------------------------------------------------------- the shared fleet


@dataclass
class Fleet:
    tmp: Path
    endpoint: str
    coordinator: CoordinatorProcess
    relay: TcpRelay
    nodes: dict[str, Node]
    client: FleetClient
    follower: Follower
    retired: list[CoordinatorProcess] = field(default_factory=list)

    def start_coordinator(self) -> CoordinatorProcess:
        """A coordinator process on the fleet's port (a fresh one after a kill)."""
        self.coordinator = start_coordinator_process(
            self.endpoint, ["--node-timeout", str(NODE_TIMEOUT_S)],
            log_path=self.tmp / "coordinator.log")
        return self.coordinator

    def view(self) -> dict[str, dict[str, Any]]:
        """The coordinator's fleet view: NODE/ENGINE -> engine object (with the node's
        `boot` and `reachable` under `node`)."""
        return {f"{n['node_id']}/{e['id']}": {**e, "node": n}
                for n in self.client.status()["nodes"] for e in n["engines"]}

    def settled(self) -> dict[str, dict[str, Any]]:
        """Wait until every engine is healthy, unpaused and reachable in the view, as each
        node itself says; that view."""
        def check() -> dict[str, dict[str, Any]] | None:
            view = self.view()
            own = {f"{name}/{e['id']}": e for name, node in self.nodes.items()
                   for e in node.status()["engines"]}
            ok = view.keys() == own.keys() and all(
                e["state"] == "healthy" and e["reachable"] and not e["paused"]
                and (e["pid"], e["incarnation"]) == (own[k]["pid"], own[k]["incarnation"])
                for k, e in view.items())
            return view if ok else None
        return wait_for(check, SETTLE_S, "the fleet settled: every engine healthy, unpaused "
                        "and reachable, as its node says", interval=0.1)


def node_log(node: Node, since: int) -> tuple[str, list[dict[str, Any]], int]:
    """(boot, events after seq `since`, last seq) from the node's own control socket."""
    result = node.client.call("events", {"since": since, "wait_s": 0})
    return result["boot"], result["events"], result["next"]


def assert_relayed(fleet: Fleet, node_id: str, since: int) -> list[FleetEvent]:
    """The follower got every event of the node's current boot after seq `since`, in order,
    each once, exactly as the node's own log has them; those events."""
    boot, expected, last = node_log(fleet.nodes[node_id], since)
    wait_for(lambda: any(e.seq >= last for e in fleet.follower.of_boot(node_id, boot)),
             EVENT_S, f"{node_id}'s event {last} (boot {boot}) on the stream", interval=0.05)
    got = [e for e in fleet.follower.of_boot(node_id, boot) if since < e.seq <= last]
    assert [e.seq for e in got] == list(range(since + 1, last + 1)), "lost or doubled"
    assert [e.raw for e in got] == expected
    return got


def identities(view: dict[str, dict[str, Any]]) -> dict[str, tuple[Any, ...]]:
    """Who each engine is: (pid, incarnation, its node's boot)."""
    return {k: (e["pid"], e["incarnation"], e["node"]["boot"]) for k, e in view.items()}


def own_events(fleet: Fleet, start: int, coordinator_boot: str) -> list[tuple[str, str, str]]:
    """The coordinator's node events from `coordinator_boot` in the stream from index
    `start`: (node, kind, detail)."""
    return [(e.node_id, e.kind, e.detail or "") for e in fleet.follower.snapshot(start)
            if e.is_node_event and e.boot == coordinator_boot]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    tmp = tmp_path_factory.mktemp("fleet")
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    port = int(endpoint.rsplit(":", 1)[1])
    nodes: dict[str, Node] = {}
    coordinators: list[CoordinatorProcess] = []
    relay = TcpRelay(target=("127.0.0.1", port))
    follower = None
    try:
        coordinators.append(start_coordinator_process(
            endpoint, ["--node-timeout", str(NODE_TIMEOUT_S)], log_path=tmp / "coordinator.log"))
        client = FleetClient(endpoint, timeout_s=5.0)
        follower = Follower(client)
        wait_for(lambda: coordinators[0].call("ping").result["subscribers"] == 1, 10,
                 "the follower's subscription")
        nodes["n1"] = start_node_process("n1", endpoint, tmp, engines=2)
        nodes["n2"] = start_node_process("n2", relay.endpoint, tmp, engines=1)
        shared = Fleet(tmp, endpoint, coordinators[0], relay, nodes, client, follower)
        yield shared
        coordinators = [*shared.retired, shared.coordinator]
    finally:
        if follower is not None:
            follower.close()
        for node in nodes.values():
            node.cleanup()
        for coordinator in coordinators:
            coordinator.cleanup()
        relay.close()
        for log in [tmp / "coordinator.log", *(n.tmp / "daemon.log" for n in nodes.values())]:
            lines = log.read_text(errors="replace").splitlines() if log.exists() else []
            print(f"---- {log} (last 30 lines)\n" + "\n".join(lines[-30:]))


# ---------------------------------------------------------------------- the faults


def test_coordinator_sigkilled_while_an_engine_dies_and_comes_back(fleet: Fleet) -> None:
    settled = fleet.settled()
    before = settled["n1/e0"]
    node = fleet.nodes["n1"]
    since = node_log(node, 0)[2]
    mark = len(fleet.follower.snapshot())

    fleet.coordinator.kill()
    fleet.retired.append(fleet.coordinator)
    os.kill(before["pid"], signal.SIGKILL)
    relaunched = node.wait_state("e0", "healthy", timeout=SETTLE_S,
                                 incarnation=before["incarnation"] + 1)
    coordinator = fleet.start_coordinator()
    boot = coordinator.wait_ready(5)["coordinator"]

    view = fleet.settled()
    e0 = view["n1/e0"]
    assert e0["node"]["boot"] == before["node"]["boot"], "the same daemon, not a new node"
    assert (e0["state"], e0["reachable"], e0["incarnation"], e0["pid"]) == (
        "healthy", True, before["incarnation"] + 1, relaunched["pid"])
    others = [k for k in settled if k != "n1/e0"]
    assert [identities(view)[k] for k in others] == [identities(settled)[k] for k in others]
    got = assert_relayed(fleet, "n1", since)
    transitions = [(e.to, e.incarnation) for e in got if e.kind == "state"]
    assert transitions[0] == ("stopping", before["incarnation"])
    assert transitions[-1] == ("healthy", before["incarnation"] + 1)
    # the new coordinator's word on each node, once: it heard each HELLO
    fleet.follower.wait(lambda e: e.boot == boot and e.node_id == "n2", "n2's HELLO", mark)
    hellos = [(n, k) for n, k, d in own_events(fleet, mark, boot) if d.startswith("hello")]
    assert sorted(hellos) == [("n1", "node_reachable"), ("n2", "node_reachable")]


def test_node_daemon_sigkilled_and_restarted_keeps_its_engines(fleet: Fleet) -> None:
    before = fleet.settled()
    node = fleet.nodes["n1"]
    node.kill_daemon()
    node.start()
    new_boot = node.status()["boot_id"]
    assert new_boot != before["n1/e0"]["node"]["boot"]
    after = wait_for(lambda: (v := fleet.view())["n1/e0"]["node"]["boot"] == new_boot and v,
                     EVENT_S, "the restarted daemon's HELLO in the fleet view")
    for name in ("n1/e0", "n1/e1"):
        assert (after[name]["incarnation"], after[name]["pid"], after[name]["state"],
                after[name]["reachable"]) == (before[name]["incarnation"], before[name]["pid"],
                                              "healthy", True), name
    adopted = assert_relayed(fleet, "n1", 0)   # the new boot's whole log, from its first event
    assert {e.engine for e in adopted if e.kind == "adopted"} == {"e0", "e1"}


@pytest.mark.parametrize("how", ["pause", "cut"])
def test_a_link_down_for_seconds_loses_no_state_change(fleet: Fleet, how: str) -> None:
    """`pause`: the relay holds every byte (a blip; the connection stays open until ZMTP
    heartbeats give up). `cut`: every connection is reset and the node's redials are held."""
    before = fleet.settled()["n2/e0"]
    node = fleet.nodes["n2"]
    since = node_log(node, 0)[2]
    mark = len(fleet.follower.snapshot())
    boot = fleet.coordinator.call("ping").result["coordinator"]

    fleet.relay.pause()
    try:
        if how == "cut":
            fleet.relay.cut()
        fleet.follower.wait(lambda e: (e.node_id, e.kind) == ("n2", "node_unreachable"),
                            "n2 unreachable on the stream", mark)
        cut_off = fleet.view()
        assert cut_off["n2/e0"]["node"]["reachable"] is False
        assert cut_off["n2/e0"]["reachable"] is False   # listed, flagged, as last heard
        assert cut_off["n2/e0"]["incarnation"] == before["incarnation"]
        assert cut_off["n1/e0"]["reachable"] is True
        os.kill(before["pid"], signal.SIGKILL)
        node.wait_state("e0", "healthy", timeout=SETTLE_S, incarnation=before["incarnation"] + 1)
        assert all(e.seq <= since for e in fleet.follower.of_boot("n2", before["node"]["boot"])
                   ), "nothing passes a stalled link"
    finally:
        fleet.relay.resume()

    fleet.follower.wait(lambda e: (e.node_id, e.kind) == ("n2", "node_reachable"),
                        "n2 reachable again on the stream", mark)
    got = assert_relayed(fleet, "n2", since)
    assert ("stopping", before["incarnation"]) in [(e.to, e.incarnation) for e in got]
    assert got[-1].to == "healthy" and got[-1].incarnation == before["incarnation"] + 1
    view = fleet.settled()["n2/e0"]
    assert (view["incarnation"], view["node"]["boot"]) == (before["incarnation"] + 1,
                                                           before["node"]["boot"])
    # unreachable, then reachable: once, or again for a later silence of the busy node's link
    # (a node heard from again after each), never two of a kind in a row
    kinds = [k for n, k, _ in own_events(fleet, mark, boot) if n == "n2"]
    assert kinds[:2] == ["node_unreachable", "node_reachable"] and kinds[-1] == "node_reachable"
    assert all(a != b for a, b in zip(kinds, kinds[1:], strict=False)), kinds


def test_the_coordinator_stopped_past_the_node_timeout_judges_no_node_silent(
        fleet: Fleet) -> None:
    """The coordinator SIGSTOPped for twice the node timeout, then continued: its nodes spoke
    all along (their messages queued), so none is unreachable, and no holder of anything is
    judged silent. Its sweep used to run before libzmq's I/O thread had delivered what queued:
    spurious node_unreachable / node_reachable pairs (3 runs of 5 in the hostile run), and once
    a refit holder released for "silence"."""
    fleet.settled()
    mark = len(fleet.follower.snapshot())
    boot = fleet.coordinator.call("ping").result["coordinator"]
    os.kill(fleet.coordinator.proc.pid, signal.SIGSTOP)
    try:
        threading.Event().wait(2 * NODE_TIMEOUT_S)   # the fault's length: the nodes speak on
    finally:
        os.kill(fleet.coordinator.proc.pid, signal.SIGCONT)
    fleet.coordinator.call("ping")   # (it answers again: its loop runs)
    threading.Event().wait(NODE_TIMEOUT_S)   # the window in which a node judged silent shows
    kinds = [(n, k) for n, k, _ in own_events(fleet, mark, boot)
             if k in ("node_unreachable", "node_reachable")]
    assert kinds == [], kinds
    assert all(v["node"]["reachable"] for v in fleet.view().values())


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "rollout_watchdog", *args],
                          capture_output=True, text=True, timeout=30)


def test_the_cli_against_a_coordinator_process(fleet: Fleet) -> None:
    before = fleet.settled()
    ep = fleet.endpoint
    out = _cli("status", "--coordinator", ep, "--json")
    assert out.returncode == 0, out.stderr
    nodes = json.loads(out.stdout)["nodes"]
    assert [n["node_id"] for n in nodes] == ["n1", "n2"]
    for entry in nodes:
        assert {"node_id", "reachable", "last_seen", "boot", "engines"} <= entry.keys()
        assert entry["boot"] == fleet.nodes[entry["node_id"]].status()["boot_id"]
        for engine in entry["engines"]:
            assert {"id", "state", "paused", "pid", "incarnation", "restarts", "url",
                    "last_failure", "weight_version", "serving", "reachable"} <= engine.keys()
            assert engine["pid"] == before[f"{entry['node_id']}/{engine['id']}"]["pid"]
    assert [e["id"] for n in nodes for e in n["engines"]] == ["e0", "e1", "e0"]

    out = _cli("pause", "--all", "--coordinator", ep)
    assert out.returncode == 0, out.stderr
    assert [line.split(":")[0] for line in out.stdout.splitlines()] == ["n1", "n2"]
    assert all(e["paused"] for e in fleet.view().values())
    out = _cli("resume", "--all", "--coordinator", ep)
    assert out.returncode == 0, out.stderr
    assert not any(e["paused"] for e in fleet.view().values())

    out = _cli("restart", "n1/e1", "--coordinator", ep)
    assert out.returncode == 0 and out.stdout.strip() == "n1: e1: killing, then relaunching", out
    bumped = before["n1/e1"]["incarnation"] + 1
    wait_for(lambda: (e := fleet.view()["n1/e1"])["incarnation"] == bumped
             and e["state"] == "healthy", SETTLE_S, "n1/e1 relaunched in the view")
    assert fleet.nodes["n1"].engine("e1")["incarnation"] == bumped


# ---------------------------------------------------------------------- garbage and fuzz

names = st.text(min_size=1, max_size=12)
finite = st.floats(allow_nan=False, allow_infinity=False)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 64), 1 << 64) | finite | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                max_size=3),
    max_leaves=8)
# Node-side kinds (and harmless ones): a client sending them is refused, never obeyed.
valid = st.one_of(
    st.builds(protocol.Hello, node_id=names, boot=names, engines=st.just([]),
              last_seq=st.integers(0, 1 << 40)),
    st.builds(protocol.Event, node_id=names, boot=names, seq=st.integers(1, 1 << 40),
              event=st.dictionaries(st.text(max_size=6), json_values, max_size=3)),
    st.builds(protocol.Ack, boot=names, seq=st.integers(0, 1 << 40)),
    st.builds(protocol.Heartbeat, sent_at=finite),
    st.builds(protocol.Reply, request_id=names, status=st.just("ok"), reason=st.none(),
              result=json_values))


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    """A valid message with one thing done to it: nothing, a field dropped, retyped or added,
    or its encoding cut short."""
    obj = draw(valid).to_json()
    how = draw(st.sampled_from(["keep", "drop", "retype", "extra", "truncate"]))
    key = draw(st.sampled_from(sorted(obj)))
    if how == "drop":
        del obj[key]
    elif how == "retype":
        obj[key] = draw(json_values)
    elif how == "extra":
        obj[draw(st.text(max_size=6))] = draw(json_values)
    data = json.dumps(obj).encode()
    return data[:draw(st.integers(0, len(data) - 1))] if how == "truncate" else data


frames = st.one_of(
    st.binary(max_size=256).map(lambda b: [b]),
    json_values.map(lambda v: [json.dumps(v).encode()]),
    mutated().map(lambda b: [b]),
    mutated().map(lambda b: [b]),   # twice: more of what decodes and must still be refused
    st.lists(st.binary(max_size=16), min_size=2, max_size=3))


def refusal(parts: list[bytes]) -> str | None:
    """The bad_messages reason a client's frames must be counted under (None: not bad)."""
    if len(parts) != 1 or SEPARATOR in parts[0]:   # (1.6: lines only from a node)
        return "framing"
    try:
        message = protocol.decode(parts[0])
    except protocol.ProtocolError:
        return "undecodable"
    return {protocol.Hello: "unknown_node", protocol.Event: "no_hello",
            protocol.Ack: "wrong_direction"}.get(type(message))


def test_fuzzed_frames_from_a_client_are_counted_and_the_fleet_is_served(fleet: Fleet) -> None:
    before = fleet.settled()
    conn = fleet.coordinator.connect()
    seen: list[str | None] = []
    try:
        counts = conn.result("ping")["bad_messages"]

        @FUZZ
        @given(parts=frames)
        @example(parts=[SEPARATOR])   # (hypothesis draws it too: a constant of the code)
        def check(parts: list[bytes]) -> None:
            nonlocal counts
            conn.socket.send_multipart(parts)
            now = conn.result("ping", timeout_s=5.0)["bad_messages"]   # after the frames
            reason = refusal(parts)
            seen.append(reason)
            expected = counts if reason is None else {**counts, reason: counts.get(reason, 0) + 1}
            counts = now   # before the check: each example (hypothesis's shrinking included)
            assert now == expected   # is judged against the counts just before it

        check()
    finally:
        conn.close()
    print(f"client fuzz: {len(seen)} examples, {Counter(seen)}")
    assert "internal_error" not in counts and fleet.coordinator.proc.poll() is None
    assert identities(fleet.settled()) == identities(before)


def test_fuzzed_frames_under_a_nodes_routing_id_leave_its_view_right(fleet: Fleet) -> None:
    """A DEALER that takes n1's routing id (the coordinator hands an id over to its newest
    connection; without CURVE nothing tells them apart) and sends garbage. While it holds the
    id, n1 is cut off and pauses an engine on its own; once it is gone, n1 is linked again,
    obeys the coordinator, and its engines, and every event it made, are as they are."""
    before = fleet.settled()
    node = fleet.nodes["n1"]
    since = node_log(node, 0)[2]
    counts = fleet.coordinator.call("ping").result["bad_messages"]
    ctx = zmq.Context()
    impostor = ctx.socket(zmq.DEALER)
    impostor.linger = 0
    impostor.setsockopt(zmq.ROUTING_ID, b"n1")
    impostor.connect(fleet.endpoint)
    sent: list[str | None] = []
    try:
        @FUZZ
        @given(parts=frames)
        def check(parts: list[bytes]) -> None:
            try:
                message = protocol.decode(parts[0]) if len(parts) == 1 else None
            except protocol.ProtocolError:
                message = None
            # what a node may legitimately say for itself (a new boot) is not garbage
            assume(not isinstance(message, protocol.Hello) or message.node_id != "n1")
            impostor.send_multipart(parts)
            sent.append(refusal(parts))
            assert fleet.coordinator.call("ping", timeout_s=5.0).status == "ok"

        check()
        # it holds n1's id: what the coordinator says to n1 comes to it
        assert impostor.poll(int(EVENT_S * 1000)), "nothing sent to n1 reached the impostor"
        assert node.client.call("pause", {"engine": "e0"})["paused"] == ["e0"]
    finally:
        impostor.close(0)
        ctx.term()
    print(f"impostor fuzz: {len(sent)} examples, {Counter(sent)}")
    now = fleet.coordinator.call("ping").result["bad_messages"]
    assert "internal_error" not in now and fleet.coordinator.proc.poll() is None
    assert now.get("undecodable", 0) > counts.get("undecodable", 0)
    wait_for(lambda: node.status()["link"]["connected"] and fleet.view()["n1/e0"]["paused"],
             EVENT_S, "n1 linked again, its pause in the fleet view")
    fleet.client.resume("n1/e0")
    got = assert_relayed(fleet, "n1", since)
    assert [e.kind for e in got if e.kind in ("paused", "resumed")] == ["paused", "resumed"]
    assert identities(fleet.settled()) == identities(before)


def test_a_call_for_a_node_not_back_after_a_restart_without_state_waits_for_it(
        tmp_path: Path) -> None:
    """A coordinator without a state dir, SIGKILLed and started again, refused a client's
    retried call for a node that had not said hello yet as "unknown node", though the node
    came back a moment later. Now the call waits for the node (within a node timeout of the
    start, and half its own time), and `ping` counts it held back."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    options = ["--node-timeout", "60"]   # (the hold's bound: never the test's)
    relay = TcpRelay(target=("127.0.0.1", int(endpoint.rsplit(":", 1)[1])))
    coordinators = [start_coordinator_process(endpoint, options)]
    node = start_node_process("n1", relay.endpoint, tmp_path, engines=1)
    client = FleetClient(endpoint, timeout_s=60.0)
    try:
        wait_for(lambda: [n.reachable for n in client.nodes()] == [True], SETTLE_S, "n1 up")
        relay.pause()   # n1 cannot say hello to the coordinator that comes next
        coordinators[0].kill()
        coordinators.append(start_coordinator_process(endpoint, options))
        coordinators[1].wait_ready(10)
        with pytest.raises(CommandRefused) as unknown:   # held for half its 1 s, not 2.5 s:
            client.nodes("n9", timeout_s=1.0)            # refused in time, not unavailable
        assert unknown.value.code == protocol.UNKNOWN_NODE
        asked: list[Any] = []
        thread = threading.Thread(target=lambda: asked.append(client.nodes("n1")))
        thread.start()
        wait_for(lambda: coordinators[1].call("ping").result["held_back"] == 1, EVENT_S,
                 "the call held back")
        assert thread.is_alive() and not asked
        relay.cut()      # the connection to the dead coordinator reset: n1 redials at once
        relay.resume()
        thread.join(EVENT_S)
        assert [n.node_id for n in asked[0]] == ["n1"] and asked[0][0].reachable
        assert coordinators[1].call("ping").result["held_back"] == 0
    finally:
        client.close()
        node.cleanup()
        for coordinator in coordinators:
            coordinator.cleanup()
        relay.close()
