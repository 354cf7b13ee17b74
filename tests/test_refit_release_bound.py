"""A refit's release waits for its resume to be acknowledged, but not for long: a node that is
reachable yet does not answer the resume (a stuck command handler) must not hold the trainer's
block past its `timeout_s`, which bounds the whole refit, its teardown included (DESIGN)."""

from __future__ import annotations

import time
from typing import Any

import pytest
from daemon_harness import wait_for
from fake_nodes import FakeNodes

from rollout_watchdog import Coordinator, FleetClient
from rollout_watchdog.common.replies import Deferred


def hang_resume(nodes: FakeNodes, index: int) -> None:
    """Node `index` keeps its heartbeats but never answers a resume: still reachable."""
    node = nodes.nodes[index]
    plain = node.dispatch

    def dispatch(cmd: str, args: dict[str, Any]) -> dict[str, Any] | Deferred:
        if cmd == "resume":
            node.commands.append(cmd)
            return Deferred(lambda: None, time.monotonic() + 60, lambda: {"late": True})
        return plain(cmd, args)
    nodes.links[index]._dispatch = dispatch   # type: ignore[attr-defined]


def test_a_node_that_does_not_answer_the_resume_holds_no_block_past_its_timeout() -> None:
    with Coordinator(bind="tcp://127.0.0.1:0") as coordinator:
        fleet = FleetClient(coordinator.endpoint, timeout_s=10.0)
        with FakeNodes(coordinator.endpoint, 2, 1) as nodes:
            wait_for(lambda: len(fleet.engines()) == 2, 20, "both fake nodes")
            hang_resume(nodes, 1)
            started = time.monotonic()
            with pytest.raises(RuntimeError, match="the trainer's own"), \
                    fleet.refit("v1", backend="gloo", timeout_s=8):
                time.sleep(5.0)   # its work ends before the deadline (8 s, 2 s kept for the end)
                raise RuntimeError("the trainer's own failure")
            took = time.monotonic() - started
            assert "resume" in nodes.nodes[1].commands   # (it was asked, and never answered)
        fleet.close()
    assert took < 8, f"the refit took {took:.1f} s, past its timeout_s of 8 s"
