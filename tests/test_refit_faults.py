"""Refits that go wrong (issue 7, "Failure during a refit"), with the test process as the
trainer over gloo: an engine SIGKILLed mid-broadcast, an engine wedged in the collective, a
trainer SIGKILLed holding the lock, a node unreachable, and old servers without begin/end."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from daemon_harness import Node, wait_for
from refit_harness import TRAINER, all_healthy, by_name, generate, start_fleet, weights

from rollout_watchdog import CommandRefused, Coordinator, EngineLost, FleetClient
from rollout_watchdog.emulator.testing import inject_fault

torch = pytest.importorskip("torch")


def test_an_engine_killed_mid_broadcast_is_named_and_the_retry_goes_on_without_it(
        make_node: Callable[..., Node], coordinator: Coordinator) -> None:
    fleet = FleetClient(coordinator.endpoint)
    start_fleet(make_node, coordinator.endpoint, nodes=1, engines=3)
    fleet.wait_until(all_healthy(3), 90)
    victim = by_name(fleet)["node0/e1"]

    def killing(seed: int) -> Iterator[tuple[str, Any]]:
        for i, item in enumerate(weights(seed)):
            if i == 4:   # the buckets are read one ahead: three of five are sent by now
                assert victim.pid is not None
                os.kill(victim.pid, signal.SIGKILL)
            yield item

    with pytest.raises(EngineLost) as lost, \
            fleet.refit("v1", backend="gloo", timeout_s=120) as refit:
        refit.update_weights(killing(1), bucket_bytes=1)   # a bucket per tensor
    # The dead engine is named first. A survivor may be stuck in the broken broadcast (in
    # gloo's tree it waits on the dead one): then it is lost too, as wedged, and restarted.
    # One whose call broke (its connection cut when the collective failed) is lost, not
    # restarted: alive and stale, it is a member of the next refit.
    assert lost.value.lost[0] == ("node0", "e1", victim.incarnation), lost.value
    assert (lost.value.node_id, lost.value.engine) == ("node0", "e1")
    wedged = lost.value.lost[1:]
    assert all(f"{n}/{e} (incarnation {i})" in str(lost.value) for n, e, i in wedged)
    members = {("node0", e, 1) for e in ("e0", "e1", "e2")}
    assert not any(e.serving for e in fleet.engines()       # every member is stale now
                   if (e.node_id, e.id, e.incarnation) in members)
    fleet.wait_until(lambda v: all(
        any(e.id == engine and e.state == "healthy" and (
            e.incarnation == incarnation or e.incarnation > incarnation
            and (e.last_failure or {}).get("cause") == "refit_wedged") for e in v)
        for _, engine, incarnation in wedged), 90)
    fleet.wait_until(all_healthy(3), 90)   # the relaunched ones too: each a member of v2

    with fleet.refit("v2", backend="gloo", timeout_s=120) as refit:
        assert ("node0", "e1", victim.incarnation) not in {
            (e.node_id, e.id, e.incarnation) for e in refit.engines}
        refit.update_weights(weights(2))
    served = [e for e in fleet.engines() if e.serving]
    assert served and {e.weight_version for e in served} == {"v2"}


def test_a_wedged_engine_is_named_at_the_deadline_and_restarted_as_refit_wedged(
        make_node: Callable[..., Node], coordinator: Coordinator) -> None:
    fleet = FleetClient(coordinator.endpoint)
    start_fleet(make_node, coordinator.endpoint, nodes=1, engines=2)
    fleet.wait_until(all_healthy(2), 90)
    wedged = by_name(fleet)["node0/e0"]
    inject_fault(str(wedged.url), "hang_weight_update")
    started = time.monotonic()
    with pytest.raises(EngineLost) as lost, \
            fleet.refit("v1", backend="gloo", timeout_s=15) as refit:
        refit.update_weights(weights(1))
    assert time.monotonic() - started < 15, "timeout_s bounds the whole refit, its abort too"
    assert lost.value.lost == [("node0", "e0", wedged.incarnation)], lost.value
    assert "wedged" in str(lost.value)
    fleet.wait_until(lambda v: any(
        e.name == wedged.name and e.incarnation > wedged.incarnation
        and (e.last_failure or {}).get("cause") == "refit_wedged" for e in v), 90)


def test_a_trainer_killed_holding_the_lock_does_not_wedge_the_next(
        make_node: Callable[..., Node], coordinator: Coordinator) -> None:
    fleet = FleetClient(coordinator.endpoint)
    start_fleet(make_node, coordinator.endpoint, nodes=1, engines=1)
    fleet.wait_until(all_healthy(1), 90)
    holder = subprocess.Popen([sys.executable, str(TRAINER), coordinator.endpoint, "v1", "1",
                               "--hold", "--lease-s", "3"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None
        token = json.loads(holder.stdout.readline())["token"]
    finally:
        holder.kill()
        holder.wait(10)
    with fleet.refit("v2", backend="gloo", timeout_s=60) as refit:
        refit.update_weights(weights(2))
    assert {e.weight_version for e in fleet.engines()} == {"v2"}
    with pytest.raises(CommandRefused, match="^lease lost"):
        fleet.call("refit_renew", {"token": token})


def test_old_servers_without_begin_end_and_a_refit_while_a_node_is_unreachable(
        make_node: Callable[..., Node], coordinator: Coordinator) -> None:
    fleet = FleetClient(coordinator.endpoint)
    nodes = start_fleet(make_node, coordinator.endpoint, nodes=2, engines=1,
                        flags=("--sglang-version", "0.5.12"))
    fleet.wait_until(all_healthy(2), 90)
    assert nodes[1].proc is not None
    os.kill(nodes[1].proc.pid, signal.SIGSTOP)
    try:
        wait_for(lambda: not {n.node_id: n for n in fleet.nodes()}["node1"].reachable, 20,
                 "node1 unreachable")
        with fleet.refit("v1", backend="gloo", timeout_s=60) as refit:
            assert [e.name for e in refit.engines] == ["node0/e0"]
            refit.update_weights(weights(1))
    finally:
        os.kill(nodes[1].proc.pid, signal.SIGCONT)
    wait_for(lambda: {n.node_id: n for n in fleet.nodes()}["node1"].reachable, 20,
             "node1 back")
    engines = by_name(fleet)
    assert (engines["node0/e0"].weight_version, engines["node0/e0"].serving) == ("v1", True)
    assert (engines["node1/e0"].weight_version, engines["node1/e0"].serving) == (None, False)
    assert generate(str(engines["node0/e0"].url))[2] == "v1"


def test_two_engines_advertising_one_url_are_left_out_and_nothing_wedges(
        make_node: Callable[..., Node], coordinator: Coordinator) -> None:
    """A second node registers an engine under the URL (and process) of node0/e0: a lying
    node, or two nodes configured with one loopback URL. Both were refit members, so the
    trainer reached one server as two ranks: the refit wedged until its deadline and the real
    engine was restarted as `refit_wedged` (the hostile run). Now engines sharing a URL are
    neither refit members nor routed, and the refit goes on with the others."""
    fleet = FleetClient(coordinator.endpoint)
    start_fleet(make_node, coordinator.endpoint, nodes=1, engines=2)
    fleet.wait_until(all_healthy(2), 90)
    real = by_name(fleet)["node0/e0"]
    liar = make_node([], node_id="node1", top={"coordinator": coordinator.endpoint}).start()
    spelled = str(real.url).replace("127.0.0.1", "LocalHost") + "/"   # (one server still)
    liar.client.call("register", {"engine": "x0", "url": spelled, "pid": real.pid})
    fleet.wait_until(all_healthy(3), 60)
    assert {name: e.serving for name, e in by_name(fleet).items()} == {
        "node0/e0": False, "node0/e1": True, "node1/x0": False}   # (none in the router)
    with fleet.refit("v1", backend="gloo", timeout_s=30) as refit:
        assert [e.name for e in refit.engines] == ["node0/e1"]
        refit.update_weights(weights(1))
    engines = by_name(fleet)
    assert {name: (e.incarnation, e.serving) for name, e in engines.items()} == {
        "node0/e0": (1, False), "node0/e1": (1, True), "node1/x0": (1, False)}
    assert engines["node0/e1"].weight_version == "v1"
