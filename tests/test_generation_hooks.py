"""`prepare_for_generation()` / `finish_generation()` with a node that stopped answering (a Ray
node removed, a host frozen) before the coordinator's node timeout calls it unreachable: a
rollout loop's step goes on without it, naming it, as a refit does; a node's error still raises,
and the fleet-wide `pause` itself (the CLI's contract) still fails naming the silent node."""

from __future__ import annotations

import signal
from collections.abc import Callable

import pytest
from daemon_harness import EngineSpec, Node, wait_for

from rollout_watchdog import CommandRefused, FleetClient, FleetResult
from rollout_watchdog.common.protocol import LOCK_HELD, NODE_ERRORS
from rollout_watchdog.refit_bridge.coordinator import Coordinator


def test_a_silent_node_is_named_not_raised_by_the_generation_hooks(
        make_node: Callable[..., Node]) -> None:
    # A node timeout far beyond the test: the frozen node stays "reachable" in the view.
    with Coordinator(bind="tcp://127.0.0.1:0", node_timeout_s=600.0) as coordinator:
        nodes = [make_node([EngineSpec("e0")], node_id=f"node{i}",
                           top={"coordinator": coordinator.endpoint}) for i in range(2)]
        for node in nodes:
            node.start()
        fleet = FleetClient(coordinator.endpoint, timeout_s=3.0)
        fleet.wait_until(lambda v: len(v) == 2 and all(e.state == "healthy" for e in v), 60)
        assert nodes[1].proc is not None
        nodes[1].proc.send_signal(signal.SIGSTOP)   # silent, its connection open
        try:
            finished = fleet.finish_generation(timeout_s=3.0)
            assert finished.missing == ["node1"]
            assert finished.nodes["node0"].status == "ok"
            prepared = fleet.prepare_for_generation(timeout_s=3.0)
            assert prepared.missing == ["node1"]
            with pytest.raises(CommandRefused) as refused:
                fleet.pause(all=True, timeout_s=3.0)
            assert refused.value.missing == ["node1"]
            assert "node1" in str(refused.value)
        finally:
            nodes[1].proc.send_signal(signal.SIGCONT)
        wait_for(lambda: fleet.prepare_for_generation(timeout_s=3.0).missing == [], 30,
                 "node1 answering again")


def test_only_a_refusal_for_silent_nodes_alone_is_spared() -> None:
    ok = {"status": "ok", "reason": None, "result": {}}
    silent = CommandRefused("no answer within 3 s from node1", replies={"node0": ok},
                            missing=["node1"], code=NODE_ERRORS)
    spared = FleetResult.of_silent_nodes(silent)
    assert spared is not None and spared.missing == ["node1"] and list(spared.nodes) == ["node0"]
    failed = CommandRefused("node0: boom; no answer within 3 s from node1",
                            replies={"node0": {**ok, "status": "error", "reason": "boom"}},
                            missing=["node1"], code=NODE_ERRORS)
    assert FleetResult.of_silent_nodes(failed) is None          # a node's error is raised
    lock = CommandRefused("held", code=LOCK_HELD)
    assert FleetResult.of_silent_nodes(lock) is None
