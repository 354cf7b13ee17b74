"""The ways out of `with fleet.refit(...)` that real processes can show (the others, with
doubles, are in test_refit_exits.py): every member refusing the update is UpdateRefused naming
each of them (issue 13, section 4 item 2: not only those that failed before the teardown), and
a fleet with no healthy engine is NoMembers with the lock let go at once."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from daemon_harness import Node
from refit_harness import all_healthy, by_name, start_fleet, weights

from rollout_watchdog import Coordinator, FleetClient, NoMembers, UpdateRefused

pytest.importorskip("torch")


def test_every_member_that_refused_the_update_is_named_and_a_fixed_retry_commits(
        make_node: Callable[..., Node], coordinator: Coordinator) -> None:
    import torch

    fleet = FleetClient(coordinator.endpoint)
    start_fleet(make_node, coordinator.endpoint, nodes=1, engines=3)
    fleet.wait_until(all_healthy(3), 120)
    named = weights(1)
    name, tensor = named[0]
    wrong = [(name, torch.zeros(tensor.shape[0] + 1, *tensor.shape[1:])), *named[1:]]
    with pytest.raises(UpdateRefused) as refused, \
            fleet.refit("v1", backend="gloo", timeout_s=90) as refit:
        members = sorted((e.node_id, e.id, e.incarnation) for e in refit.engines)
        refit.update_weights(wrong)
    assert sorted(refused.value.refused) == members and len(members) == 3
    for node_id, engine, _ in members:
        assert f"{node_id}/{engine}" in str(refused.value)
    assert "shape mismatch" in str(refused.value)
    engines = by_name(fleet)
    assert all(e.state == "healthy" and not e.serving for e in engines.values())  # alive, stale
    with fleet.refit("v1", backend="gloo", timeout_s=90) as refit:   # the lock is free
        refit.update_weights(named)
    assert {(e.weight_version, e.serving) for e in fleet.engines()} == {("v1", True)}


def test_no_healthy_engine_is_no_members_and_the_lock_is_let_go(
        coordinator: Coordinator) -> None:
    fleet = FleetClient(coordinator.endpoint)
    with pytest.raises(NoMembers, match="no engine to update"), \
            fleet.refit("v1", backend="gloo", timeout_s=30):
        pytest.fail("the block is not entered")
    _, ping = fleet.call("ping")
    assert ping["refit"]["holder"] is None and ping["refit"]["current_version"] is None
