"""FleetClient is thread-safe and reuses its connections (issue 13, section 1 item 2 and section
3 item 8): one DEALER per calling thread, kept call after call; a call that timed out never
delivers its command later; a forked child makes its own sockets and leaves the parent's alone;
and two threads of one process share one client while one of them refits real emulators."""

from __future__ import annotations

import os
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
from daemon_harness import EngineSpec, Node, wait_for
from fleet_standin import StandIn
from refit_harness import by_name, weights

from rollout_watchdog import Coordinator, CoordinatorUnavailable, FleetClient
from rollout_watchdog.common import protocol


def spy_peers(standin: StandIn) -> list[bytes]:
    """The routing id of every command's sender, in order (one per client socket)."""
    peers: list[bytes] = []
    receive = standin._receive

    def spied(sock: Any, peer: bytes, data: bytes) -> None:
        if isinstance(protocol.decode(data), protocol.Command):
            peers.append(peer)
        receive(sock, peer, data)

    standin._receive = spied  # type: ignore[method-assign]
    return peers


def test_each_thread_keeps_one_connection_for_all_its_calls(standin: StandIn) -> None:
    peers = spy_peers(standin)
    client = FleetClient(standin.endpoint, timeout_s=5.0)
    for _ in range(3):
        assert len(client.engines()) == 3
    assert len(peers) == 3 and len(set(peers)) == 1

    by_thread: dict[str, list[bytes]] = {}

    def calls(name: str) -> None:
        start = len(peers)
        for _ in range(5):
            client.restart("n1/e0")
        by_thread[name] = peers[start:]

    threads = [threading.Thread(target=calls, args=(f"t{i}",)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(peers) == 3 + 15
    assert len(set(peers)) == 4                   # the main thread's and one per thread
    client.close()
    assert len(client.engines()) == 3              # closed: the next call connects again
    assert peers[-1] not in peers[:-1]


def test_a_call_that_timed_out_is_never_delivered_later(standin: StandIn) -> None:
    """The coordinator is down when a call is made: the call times out, and its command must
    not reach the coordinator when it comes back (the caller gave up on it)."""
    client = FleetClient(standin.endpoint, timeout_s=5.0)
    assert client.engines()                       # connected
    standin.stop()
    with pytest.raises(CoordinatorUnavailable):
        client.restart("n1/e0", timeout_s=0.5)    # queued on a socket to nobody
    standin.commands.clear()
    standin.start()
    result = client.restart("n1/e1")
    assert [(c.cmd, c.engine) for c in standin.commands] == [("restart", "e1")]
    assert standin.commands[0].request_id == result.request_id


def test_a_forked_child_makes_its_own_socket_and_leaves_the_parents(standin: StandIn) -> None:
    peers = spy_peers(standin)
    client = FleetClient(standin.endpoint, timeout_s=5.0)
    client.engines()
    pid = os.fork()
    if pid == 0:   # the child: its own socket, made on its own context
        code = 1
        try:
            code = 0 if len(client.engines()) == 3 else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert len(peers) == 2 and peers[1] != peers[0]
    client.engines()                              # the parent's socket still works
    assert peers[2] == peers[0]


def test_one_client_shared_by_a_refitting_thread_and_a_watching_one(
        make_node: Callable[..., Node], coordinator: Coordinator) -> None:
    """One thread refits the emulators twice (its guard thread renews through the same client);
    another lists engines, pauses and resumes a spare engine and follows events the whole
    time. Every call of both succeeds, and both refits commit."""
    pytest.importorskip("torch")
    fleet = FleetClient(coordinator.endpoint, timeout_s=10.0)
    node = make_node([EngineSpec(f"e{i}", extra={"tp_size": 1}) for i in range(2)]
                     + [EngineSpec("spare", extra={"tp_size": 1})], node_id="node0",
                     top={"coordinator": coordinator.endpoint}, probe={"health_interval_s": 0.5})
    node.start()
    fleet.wait_until(lambda v: len(v) == 3 and all(e.state == "healthy" for e in v), 90)
    fleet.stop("node0/spare")                     # not a member: the watcher's to pause
    fleet.wait_until(lambda v: by_state(v, "node0/spare") == "stopped", 30)

    refitting = threading.Event()
    refitting.set()
    done: dict[str, Any] = {}
    counts: Counter[str] = Counter()
    problems: list[BaseException] = []

    def refits() -> None:
        try:
            for version in ("v1", "v2"):
                with fleet.refit(version, backend="gloo", timeout_s=120) as refit:
                    done[version] = sorted(e.name for e in refit.engines)
                    refit.update_weights(weights(int(version[1:])))
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            problems.append(exc)
        finally:
            refitting.clear()

    def watch() -> None:
        try:
            with fleet.events(idle_s=0.1) as stream:
                while refitting.is_set():
                    assert len(fleet.engines()) == 3
                    counts["engines"] += 1
                    fleet.pause("node0/spare", deadline_s=60)
                    counts["pause"] += 1
                    fleet.resume("node0/spare")
                    counts["resume"] += 1
                    counts["events"] += sum(1 for _ in stream)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            problems.append(exc)

    threads = [threading.Thread(target=refits), threading.Thread(target=watch)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not any(t.is_alive() for t in threads), "a thread did not finish"
    assert problems == []
    assert done == {"v1": ["node0/e0", "node0/e1"], "v2": ["node0/e0", "node0/e1"]}
    assert min(counts["engines"], counts["pause"], counts["resume"]) >= 1 and counts["events"]
    engines = by_name(fleet)
    assert {(engines[n].weight_version, engines[n].serving) for n in ("node0/e0", "node0/e1")} \
        == {("v2", True)}
    wait_for(lambda: not by_name(fleet)["node0/spare"].paused, 10, "the spare resumed")


def by_state(view: list[Any], name: str) -> str | None:
    return next((e.state for e in view if e.name == name), None)
