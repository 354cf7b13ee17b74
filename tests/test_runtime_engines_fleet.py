"""Engines launched at run time through the fleet (issue 14 §1): `FleetClient.launch` and
`remove` against a real coordinator and node daemon, and the CLI's `launch`/`remove`, local and
with --coordinator."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

import pytest
from daemon_harness import EngineSpec, Node, emulator_command, pid_gone, wait_for

from rollout_watchdog import CommandRefused, Coordinator, EngineView, FleetClient
from rollout_watchdog import EngineSpec as Spec
from rollout_watchdog.common import protocol
from rollout_watchdog.emulator.testing import free_port
from rollout_watchdog.refit_bridge import launching

MakeNode = Callable[..., Node]


def cli(*args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "rollout_watchdog", *args],
                          capture_output=True, text=True, timeout=timeout)


def linked(fleet: FleetClient, node_id: str) -> None:
    """Wait until the node said hello (a daemon answers its control socket before)."""
    wait_for(lambda: any(n.node_id == node_id for n in fleet.nodes()), 30,
             f"{node_id} linked to the coordinator")


def emulated(engine_id: str, *flags: str, **kwargs: Any) -> Spec:
    port = free_port()
    return Spec(engine_id, f"http://127.0.0.1:{port}", emulator_command(port, *flags), **kwargs)


def test_fleet_launch_waits_for_health_refuses_and_removes(
        make_node: MakeNode, coordinator: Coordinator) -> None:
    node = make_node([EngineSpec("e0", extra={"gpus": [0]})], node_id="n1",
                     top={"coordinator": coordinator.endpoint}).start()
    fleet = FleetClient(coordinator.endpoint, timeout_s=10.0)
    fleet.wait_until(lambda v: any(e.name == "n1/e0" and e.state == "healthy" for e in v), 60)

    view = fleet.launch("n1", emulated("x0", gpus=[1], tp_size=1), wait_s=60)
    assert isinstance(view, EngineView)
    assert (view.name, view.state, view.origin, view.incarnation, view.tp_size) == (
        "n1/x0", "healthy", "launched", 1, 1)
    assert view.pid == node.engine("x0")["pid"]
    origins = {e.name: e.origin for e in fleet.engines()}
    assert origins == {"n1/e0": "config", "n1/x0": "launched"}

    # refusals: CommandRefused with the node's reason
    with pytest.raises(CommandRefused, match="GPU 1 is already in engine x0's gpus"):
        fleet.launch("n1", emulated("x1", gpus=[1]))
    with pytest.raises(CommandRefused, match="engine id e0 is already on this node") as same:
        fleet.launch("n1", emulated("e0"))
    assert same.value.replies["n1"]["status"] == "error"
    with pytest.raises(CommandRefused,
                       match="engine 'x1': key 'restart_policy' must be one of") as bad:
        fleet.launch("n1", emulated("x1", restart_policy="sometimes"))
    assert bad.value.replies["n1"]["code"] == protocol.BAD_ARGS
    with pytest.raises(CommandRefused, match="unknown node 'n9'"):
        fleet.launch("n9", emulated("x1"))
    with pytest.raises(CommandRefused, match="the config owns it"):
        fleet.remove("n1/e0")
    # a launch always names its node: the coordinator never sends one to every node
    lost = fleet.request(protocol.Command("r1", "launch", {"spec": emulated("x1").to_table()}))
    assert (lost.status, lost.code) == ("error", protocol.BAD_ARGS)

    # not healthy in time: TimeoutError, and the engine stays launched
    with pytest.raises(TimeoutError, match="n1/x2 was not healthy within 1 s"):
        fleet.launch("n1", emulated("x2", "--startup-delay", "600"), wait_s=1.0)
    fleet.wait_until(lambda v: any(e.name == "n1/x2" and e.state == "starting" for e in v), 30)

    # remove: gone from the node and from the fleet view
    pid = view.pid
    result = fleet.remove("n1/x0", wait_s=30)
    assert result.nodes["n1"].result == {"engine": "x0", "action": "stopped and forgotten"}
    assert pid is not None and pid_gone(pid)
    fleet.remove("x2", node="n1")
    fleet.wait_until(lambda v: {e.name for e in v} == {"n1/e0"}, 30)
    assert "x0" not in json.loads((node.state_dir / "launched.json").read_text())["engines"]


def test_cli_launch_and_remove_local_and_through_the_coordinator(
        make_node: MakeNode, coordinator: Coordinator) -> None:
    node = make_node([], node_id="n1", top={"coordinator": coordinator.endpoint}).start()
    fleet = FleetClient(coordinator.endpoint, timeout_s=10.0)
    port = free_port()
    bad = cli("launch", "x0", "--url", f"http://127.0.0.1:{port}", "--probe",
              "health_interval_s=-1", "--control", node.control, "--", "true")
    assert bad.returncode == 1 and "health_interval_s" in bad.stderr, bad.stderr
    done = cli("launch", "x0", "--url", f"http://127.0.0.1:{port}", "--gpus", "0,1", "--env",
               "OMP_NUM_THREADS=1", "--tp-size", "1", "--probe", "health_interval_s=0.5",
               "--probe", "health_path=/health", "--restart", "max_restarts=7", "--control",
               node.control, "--wait", "60", "--", *emulator_command(port))
    assert done.returncode == 0, done.stderr
    assert "x0: healthy, incarnation 1" in done.stdout
    x0 = node.engine("x0")
    assert (x0["origin"], x0["gpus"], x0["tp_size"]) == ("launched", [0, 1], 1)
    kept = json.loads((node.state_dir / "launched.json").read_text())
    assert json.dumps(kept).count('"health_interval_s": 0.5') == 1, kept   # typed, as given
    assert '"health_path": "/health"' in json.dumps(kept) and '"max_restarts": 7' in json.dumps(
        kept)

    # refused: non-zero, with the reason
    again = cli("launch", "x0", "--url", "http://127.0.0.1:1", "--control", node.control,
                "--", "true")
    assert again.returncode == 1 and "engine id x0 is already on this node" in again.stderr
    nothing = cli("launch", "x9", "--url", "http://127.0.0.1:1", "--control", node.control)
    assert nothing.returncode == 1 and "give the engine's command after --" in nothing.stderr

    # through the coordinator
    port2 = free_port()
    wait_for(lambda: any(e.name == "n1/x0" for e in fleet.engines()), 30, "x0 in the view")
    remote = cli("launch", "n1/x1", "--coordinator", coordinator.endpoint, "--url",
                 f"http://127.0.0.1:{port2}", "--gpus", "1", "--wait", "60", "--",
                 *emulator_command(port2))
    assert remote.returncode == 1 and "GPU 1 is already in engine x0's gpus" in remote.stderr
    remote = cli("launch", "n1/x1", "--coordinator", coordinator.endpoint, "--url",
                 f"http://127.0.0.1:{port2}", "--gpus", "2", "--restart-policy", "deferred",
                 "--wait", "60", "--", *emulator_command(port2))
    assert remote.returncode == 0, remote.stderr
    assert "n1/x1: launched, healthy, incarnation 1" in remote.stdout
    listed = json.loads(cli("status", "--json", "--coordinator", coordinator.endpoint).stdout)
    assert {e["id"]: (e["origin"], e["restart_policy"]) for e in listed["nodes"][0]["engines"]
            } == {"x0": ("launched", "immediate"), "x1": ("launched", "deferred")}

    gone = cli("remove", "n1/x0", "--coordinator", coordinator.endpoint, "--wait", "30")
    assert gone.returncode == 0 and "n1: x0: stopped and forgotten" in gone.stdout
    gone = cli("remove", "x1", "--control", node.control, "--wait", "30")
    assert gone.returncode == 0 and "x1: stopped and forgotten" in gone.stdout
    missing = cli("remove", "x1", "--control", node.control)
    assert missing.returncode == 1 and "no engine 'x1'" in missing.stderr
    assert node.status()["engines"] == []


def test_a_remove_sent_while_the_node_daemon_restarts_is_done_by_the_new_daemon(
        make_node: MakeNode) -> None:
    """The node's daemon is SIGKILLed and its engine removed before another daemon is back
    (the coordinator still counts the node reachable: a restart is quicker than its node
    timeout). The command waits for the new daemon's HELLO, which adopts the engine and
    removes it; it was refused at once before ("no answer within ... s"), the node's old
    connection being gone."""
    with Coordinator(bind="tcp://127.0.0.1:0", node_timeout_s=60.0) as coordinator:
        node = make_node([], node_id="n1", top={"coordinator": coordinator.endpoint}).start()
        fleet = FleetClient(coordinator.endpoint, timeout_s=10.0)
        linked(fleet, "n1")
        view = fleet.launch("n1", emulated("x0"), wait_s=60)
        boot = node.status()["boot_id"]
        node.kill_daemon()
        with ThreadPoolExecutor(1) as pool:
            removing = pool.submit(fleet.remove, "n1/x0", wait_s=60)
            wait_for(lambda: coordinator.fanout.pending, 30, "the remove at the coordinator")
            node.start()   # (nothing answers the remove before this daemon does)
            result = removing.result(timeout=120)
        assert node.status()["boot_id"] != boot
        assert result.nodes["n1"].result == {"engine": "x0", "action": "stopped and forgotten"}
        assert view.pid is not None and pid_gone(view.pid)
        fleet.wait_until(lambda v: not any(e.name == "n1/x0" for e in v), 30)


def test_a_remove_whose_daemon_died_mid_kill_is_finished_by_the_new_daemon(
        make_node: MakeNode) -> None:
    """The daemon is SIGKILLed while it stops a removed engine (one that ignores SIGTERM: the
    kill waits out its grace). The new daemon finds the engine in neither the config nor the
    launched specs and stops it; the remove the coordinator sends it again is answered
    "stopped and forgotten", not "the config owns it" (a config the engine was never in)."""
    with Coordinator(bind="tcp://127.0.0.1:0", node_timeout_s=60.0) as coordinator:
        node = make_node([], node_id="n1", top={"coordinator": coordinator.endpoint}).start()
        fleet = FleetClient(coordinator.endpoint, timeout_s=10.0)
        linked(fleet, "n1")
        view = fleet.launch("n1", emulated("x0", "--ignore-sigterm"), wait_s=60)
        with ThreadPoolExecutor(1) as pool:
            removing = pool.submit(fleet.remove, "n1/x0", wait_s=60)
            wait_for(lambda: node.engine("x0")["state"] == "stopping", 30, "x0 being stopped")
            node.kill_daemon()
            node.start()
            result = removing.result(timeout=120)
        assert result.nodes["n1"].result == {"engine": "x0", "action": "stopped and forgotten"}
        assert view.pid is not None and pid_gone(view.pid)
        assert node.status()["engines"] == []


def test_a_launch_waiting_for_health_outlasts_a_coordinator_that_restarted_without_state(
        ) -> None:
    """Found by a hostile run: a coordinator restarted (no state dir) while a launch waited
    for its engine refused the wait's status query as "unknown node" until the node said
    hello again, and the launch failed though its engine came up."""
    launched = EngineView.from_json("n1", True, {"id": "x1", "state": "starting",
                                                 "incarnation": 1})
    answers: list[Any] = [
        CommandRefused("unknown node 'n1' (known: none)", code=protocol.UNKNOWN_NODE),
        [EngineView.from_json("n1", True, {"id": "x1", "state": "healthy", "incarnation": 1})]]

    def engines(node: str | None = None, timeout_s: float | None = None) -> Any:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    client: Any = SimpleNamespace(timeout_s=5.0, engines=engines)
    assert launching._wait_healthy(client, launched, 30.0).state == "healthy"
    answers[:] = [CommandRefused("no", code=protocol.BAD_ARGS)]
    with pytest.raises(CommandRefused, match="no"):
        launching._wait_healthy(client, launched, 30.0)
