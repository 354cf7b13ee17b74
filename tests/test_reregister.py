"""Issue 13, critical #2, through the real sglang-router: stale weights must never be served
after an external engine is registered again, an unregistered engine leaves the router at once,
the coordinator pulls a routed engine whose own weight_version drifts, and a daemon that lost its
state file does not let a fresh process inherit a committed version."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Callable, Iterator
from typing import Any

import psutil
import pytest
from daemon_harness import EMULATOR_ENV, EngineSpec, Node, emulator_command, wait_for
from refit_harness import by_name, generate, router_urls, run_trainer, wait_router

from rollout_watchdog import Coordinator, FleetClient
from rollout_watchdog.emulator.testing import free_port, http_request
from rollout_watchdog.refit_bridge.router import normalize_url

pytest.importorskip("sglang_router")
from router_harness import Router  # noqa: E402

MakeNode = Callable[..., Node]
VERIFY_S = 0.5   # the coordinator's check of routed engines' own versions, fast for the test



@pytest.fixture
def coordinator(router: Router) -> Iterator[Coordinator]:
    with Coordinator(bind="tcp://127.0.0.1:0", node_timeout_s=3.0, router_url=router.url,
                     router_verify_s=VERIFY_S) as running:
        yield running


class Servers:
    """Engine servers started by someone else (Ray actors), SIGKILLed at teardown."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, port: int) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(emulator_command(port), env={**os.environ, **EMULATOR_ENV},
                                start_new_session=True)
        self.procs.append(proc)
        return proc


@pytest.fixture
def servers() -> Iterator[Servers]:
    made = Servers()
    yield made
    for proc in made.procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def fleet_node(make_node: MakeNode, endpoint: str, engines: list[str]) -> Node:
    return make_node([EngineSpec(e, extra={"tp_size": 1}) for e in engines], node_id="node0",
                     top={"coordinator": endpoint}, probe={"health_interval_s": 0.5}).start()


def views(fleet: FleetClient) -> dict[str, Any]:
    return by_name(fleet)


def register(node: Node, port: int, pid: int) -> str:
    return str(node.client.call("register", {"engine": "x0", "url": f"http://127.0.0.1:{port}",
                                             "pid": pid})["action"])


def healthy(fleet: FleetClient, names: set[str], timeout: float = 90.0) -> dict[str, Any]:
    fleet.wait_until(lambda v: {e.name for e in v if e.state == "healthy"} >= names
                     and all(e.state == "healthy" for e in v if e.name in names), timeout)
    return views(fleet)


def test_an_engine_registered_again_is_a_new_incarnation_kept_out_until_a_refit(
        make_node: MakeNode, coordinator: Coordinator, router: Router,
        servers: Servers) -> None:
    """The reproduction: register x0, refit v1, unregister x0, kill its server, start a fresh
    one on the same URL (weight_version "default"), register it again."""
    fleet = FleetClient(coordinator.endpoint)
    node = fleet_node(make_node, coordinator.endpoint, ["e0"])
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    node.engines["x0"] = EngineSpec("x0", port=port)
    first = servers.start(port)
    assert register(node, port, first.pid) == "registered, incarnation 1"
    healthy(fleet, {"node0/e0", "node0/x0"})
    outcome = run_trainer(coordinator.endpoint, "v1", seed=1)
    assert outcome.get("ok") and sorted(outcome["members"]) == ["node0/e0", "node0/x0"], outcome
    e0_url = str(views(fleet)["node0/e0"].url)
    wait_router(router.url, {e0_url, url}, "both engines in the router")

    node.client.call("unregister", {"engine": "x0"})
    first.send_signal(signal.SIGKILL)
    first.wait(10)
    wait_router(router.url, {e0_url}, "x0 out of the router once unregistered", 10)
    assert "node0/x0" not in views(fleet)

    fresh = servers.start(port)     # loads its weights from disk: "default"
    wait_for(lambda: http_request(f"{url}/health_generate")[0] == 200, 60, "the fresh server")
    assert register(node, port, fresh.pid) == "registered, incarnation 2"
    x0 = healthy(fleet, {"node0/x0"})["node0/x0"]
    assert (x0.incarnation, x0.weight_version, x0.serving) == (2, None, False)
    ping = fleet.call("ping")[1]
    assert normalize_url(url) not in ping["router"]["desired"], ping["router"]
    assert router_urls(router.url) == {normalize_url(e0_url)}
    answers = [generate(router.url) for _ in range(20)]
    assert {(status, version) for status, _, version in answers} == {(200, "v1")}, answers

    outcome = run_trainer(coordinator.endpoint, "v2", seed=2)
    assert outcome.get("ok") and "node0/x0" in outcome["members"], outcome
    assert {(e.weight_version, e.serving) for e in views(fleet).values()} == {("v2", True)}
    wait_router(router.url, {e0_url, url}, "x0 back in the router at v2")
    assert {generate(router.url)[2] for _ in range(6)} == {"v2"}


def test_an_engine_unregistered_then_sigkilled_leaves_view_and_router(
        make_node: MakeNode, coordinator: Coordinator, router: Router,
        servers: Servers) -> None:
    fleet = FleetClient(coordinator.endpoint)
    node = fleet_node(make_node, coordinator.endpoint, [])
    port = free_port()
    server = servers.start(port)
    register(node, port, server.pid)
    healthy(fleet, {"node0/x0"})
    url = f"http://127.0.0.1:{port}"
    wait_router(router.url, {url}, "x0 routed (no refit yet: disk weights serve)")
    node.client.call("unregister", {"engine": "x0"})
    server.send_signal(signal.SIGKILL)
    server.wait(10)
    wait_router(router.url, set(), "the unregistered engine out of the router", 10)
    assert fleet.engines() == []
    assert fleet.call("ping")[1]["router"]["desired"] == {}


def test_a_routed_engine_whose_version_drifts_is_pulled_and_counted(
        make_node: MakeNode, coordinator: Coordinator, router: Router) -> None:
    fleet = FleetClient(coordinator.endpoint)
    node = fleet_node(make_node, coordinator.endpoint, ["e0", "e1"])
    healthy(fleet, {"node0/e0", "node0/e1"})
    outcome = run_trainer(coordinator.endpoint, "v1", seed=1)
    assert outcome.get("ok"), outcome
    urls = {name: str(e.url) for name, e in views(fleet).items()}
    wait_router(router.url, set(urls.values()), "both engines in the router")
    assert fleet.call("ping")[1]["router"]["version_mismatches"] == 0

    # Weights loaded behind the coordinator's back, through the engine's own HTTP API.
    assert node.emulator("e1", "/update_weight_version", {"new_version": "rogue"}).ok
    wait_router(router.url, {urls["node0/e0"]}, "the drifted engine out of the router", 15)
    status = fleet.call("ping")[1]["router"]
    assert status["version_mismatches"] >= 1, status
    assert "rogue" in status["last_mismatch"] and "'v1'" in status["last_mismatch"], status
    assert {generate(router.url)[2] for _ in range(6)} == {"v1"}

    # Once it reports the fleet's version again, it is routed again.
    assert node.emulator("e1", "/update_weight_version", {"new_version": "v1"}).ok
    wait_router(router.url, set(urls.values()), "e1 back once it reports v1", 15)


def test_a_daemon_that_lost_its_state_file_lets_no_fresh_process_inherit_weights(
        make_node: MakeNode, coordinator: Coordinator, router: Router) -> None:
    """The engines still running are adopted by their markers, the same processes holding the
    weights the refit gave them. Those that died meanwhile are started over: the fresh
    processes are incarnation 1 again, like the ones the refit reached, and hold nothing."""
    fleet = FleetClient(coordinator.endpoint)
    node = fleet_node(make_node, coordinator.endpoint, ["e0", "e1"])
    healthy(fleet, {"node0/e0", "node0/e1"})
    assert run_trainer(coordinator.endpoint, "v1", seed=1).get("ok")
    before = views(fleet)
    wait_router(router.url, {str(e.url) for e in before.values()}, "both engines routed")

    boot = fleet.status()["nodes"][0]["boot"]
    node.kill_daemon()
    (node.state_dir / "state.json").unlink()
    node.start()
    wait_for(lambda: fleet.status()["nodes"][0]["boot"] != boot, 30, "the new daemon's hello")
    healthy(fleet, set(before))   # (adopted as starting: its probes decide)
    assert {name: (e.pid, e.incarnation, e.weight_version, e.serving)
            for name, e in views(fleet).items()} == {
        name: (e.pid, 1, "v1", True) for name, e in before.items()}   # adopted, at v1
    assert all(node.wait_event(e, kind="adopted") for e in ("e0", "e1"))

    node.kill_daemon()
    (node.state_dir / "state.json").unlink()
    for engine in before.values():   # (died while no daemon watched)
        main = psutil.Process(engine.pid or 0)
        for process in [*main.children(recursive=True), main]:
            process.kill()
    node.start()
    fleet.wait_until(lambda v: len(v) == 2 and all(
        e.state == "healthy" and e.pid not in (None, before[e.name].pid) for e in v), 90)
    after = views(fleet)
    assert {(e.incarnation, e.weight_version, e.serving) for e in after.values()} == \
        {(1, None, False)}
    wait_router(router.url, set(), "no fresh process routed", 15)

    outcome = run_trainer(coordinator.endpoint, "v2", seed=2)
    assert outcome.get("ok") and len(outcome["members"]) == 2, outcome
    assert {(e.weight_version, e.serving) for e in views(fleet).values()} == {("v2", True)}
    wait_router(router.url, {str(e.url) for e in after.values()}, "both routed at v2")
