"""The refit's other paths (issue 7): the group kept while membership holds and rebuilt when it
changes, a `deferred` engine relaunched by the refit and synced by it, the path for frameworks
that move weights themselves (commit only), and the generation hooks around a refit."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable

import pytest
from daemon_harness import EngineSpec, Node
from refit_harness import all_healthy, by_name, generate, start_fleet, weights

from rollout_watchdog import Coordinator, EngineLost, FleetClient
from rollout_watchdog.emulator.testing import http_request
from rollout_watchdog.refit_bridge.refit_state import GROUPS

pytest.importorskip("torch")


def test_the_group_is_kept_while_membership_holds_and_rebuilt_when_it_changes(
        make_node: Callable[..., Node], coordinator: Coordinator) -> None:
    fleet = FleetClient(coordinator.endpoint)
    start_fleet(make_node, coordinator.endpoint, nodes=1, engines=2)
    fleet.wait_until(all_healthy(2), 90)
    with fleet.refit("v1", backend="gloo", timeout_s=60) as refit:
        refit.update_weights(weights(1))
    # the block ends with the refit's probe pause lifted (its release answers once the nodes
    # acknowledged the resume): nothing to wait for
    assert [e.paused for e in fleet.engines()] == [False, False]
    with pytest.raises(RuntimeError, match="the trainer's own"), \
            fleet.refit("v1-aborted", backend="gloo", timeout_s=60):   # aborted: resumed too
        raise RuntimeError("the trainer's own failure")
    assert [e.paused for e in fleet.engines()] == [False, False]
    first = GROUPS.get(fleet.address)
    with fleet.refit("v2", backend="gloo", timeout_s=60) as refit:   # two updates, one session
        named = list(weights(2))
        refit.update_weights(named[:2], flattened=True)
        refit.update_weights(named[2:])
    assert GROUPS.get(fleet.address) is first                  # same members: same group
    victim = by_name(fleet)["node0/e0"]
    assert victim.pid is not None
    os.kill(victim.pid, signal.SIGKILL)
    fleet.wait_until(lambda v: any(e.name == victim.name and e.incarnation > victim.incarnation
                                   and e.state == "healthy" for e in v), 60)
    with fleet.refit("v3", backend="gloo", timeout_s=60) as refit:
        refit.update_weights(weights(3))
    assert GROUPS.get(fleet.address) is not first
    assert GROUPS.get(fleet.address).group_name != first.group_name
    engines = by_name(fleet)
    assert {(e.weight_version, e.serving) for e in engines.values()} == {("v3", True)}
    assert len({generate(str(e.url))[1] for e in engines.values()}) == 1


def test_a_deferred_engine_is_relaunched_by_the_refit_and_joins_it(
        make_node: Callable[..., Node], coordinator: Coordinator) -> None:
    fleet = FleetClient(coordinator.endpoint)
    node = make_node([EngineSpec("e0", extra={"tp_size": 1}),
                      EngineSpec("colo", extra={"tp_size": 1, "restart_policy": "deferred"})],
                     node_id="node0", top={"coordinator": coordinator.endpoint},
                     probe={"health_interval_s": 0.5})
    node.start()
    fleet.wait_until(all_healthy(2), 90)
    colocated = by_name(fleet)["node0/colo"]
    assert colocated.pid is not None
    os.kill(colocated.pid, signal.SIGKILL)
    fleet.wait_until(lambda v: any(e.name == colocated.name and e.raw.get("deferred_waiting")
                                   for e in v), 30)
    with fleet.refit("v1", backend="gloo", timeout_s=90) as refit:
        members = {e.name: e.incarnation for e in refit.engines}
        refit.update_weights(weights(1))
    assert members == {"node0/e0": 1, "node0/colo": colocated.incarnation + 1}
    engines = by_name(fleet)
    assert {(e.weight_version, e.serving) for e in engines.values()} == {("v1", True)}


def test_frameworks_that_move_weights_themselves_only_commit_and_the_hooks_pause_probes(
        make_node: Callable[..., Node], coordinator: Coordinator) -> None:
    fleet = FleetClient(coordinator.endpoint)
    start_fleet(make_node, coordinator.endpoint, nodes=1, engines=2)
    fleet.wait_until(all_healthy(2), 90)
    fleet.finish_generation()
    assert all(e.paused for e in fleet.engines())
    pids = {e.name: e.pid for e in fleet.engines()}
    with fleet.refit("ipc-1", backend="gloo", timeout_s=60) as refit:
        assert {e.name for e in refit.engines} == {"node0/e0", "node0/e1"}
        # views as the fleet shows them (they showed pid None, not paused, not serving)
        assert {(e.name, e.pid, e.paused, e.serving) for e in refit.engines} == {
            (name, pid, True, True) for name, pid in pids.items()}
        refit.commit()          # the weights went over CUDA IPC, say: only the version is ours
        assert refit.committed
        with pytest.raises(RuntimeError, match="committed"):   # nothing after the commit
            refit.update_weights(weights(1))
    assert GROUPS.get(fleet.address) is None                   # no group was built
    engines = by_name(fleet)
    assert {(e.weight_version, e.serving) for e in engines.values()} == {("ipc-1", True)}
    assert {generate(str(e.url))[2] for e in engines.values()} == {"ipc-1"}
    # The refit's release leaves alone what finish_generation() paused ...
    assert all(e.paused for e in fleet.engines())
    fleet.prepare_for_generation()                      # ... until the rollout comes back
    assert not any(e.paused for e in fleet.engines())


def test_a_member_failing_the_read_back_is_lost_and_the_others_commit(
        make_node: Callable[..., Node], coordinator: Coordinator) -> None:
    """One member reports another version at the commit's read-back: EngineLost names it, the
    others commit, the group is not kept (a member in an unknown state), the lock is released
    in the commit's own call, and the next refit rebuilds the group and takes everyone."""
    fleet = FleetClient(coordinator.endpoint)
    start_fleet(make_node, coordinator.endpoint, nodes=1, engines=2)
    fleet.wait_until(all_healthy(2), 90)
    with pytest.raises(EngineLost) as lost, \
            fleet.refit("v1", backend="gloo", timeout_s=60) as refit:
        refit.update_weights(weights(1))
        odd = next(e for e in refit.engines if e.id == "e1")
        status, _ = http_request(f"{odd.url}/update_weight_version", "POST",
                                 {"new_version": "elsewhere"})
        assert status == 200
    assert lost.value.lost == [("node0", "e1", odd.incarnation)]
    assert "the others committed" in str(lost.value)
    assert GROUPS.get(fleet.address) is None
    engines = by_name(fleet)
    assert (engines["node0/e0"].weight_version, engines["node0/e0"].serving) == ("v1", True)
    assert not engines["node0/e1"].serving
    with fleet.refit("v2", backend="gloo", timeout_s=20) as refit:   # the lock is free
        refit.update_weights(weights(2))
    assert {(e.weight_version, e.serving) for e in fleet.engines()} == {("v2", True)}
