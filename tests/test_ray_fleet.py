"""rollout_watchdog.ray on a real multi-node Ray cluster on this machine
(`ray.cluster_utils.Cluster`: a head and 2 workers, one declaring 2 GPUs it does not have),
shared by the tests of this module: the real actors, node daemons and emulator engines, CURVE
on (the cluster's address is not a loopback one)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest
import requests

ray = pytest.importorskip("ray")

from daemon_harness import EMULATOR_ENV, FAST_PROBE, FAST_RESTART  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402
from ray.util.placement_group import placement_group, remove_placement_group  # noqa: E402
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy  # noqa: E402

import rollout_watchdog.ray as rw_ray  # noqa: E402
from rollout_watchdog import EngineSpec, FleetClient  # noqa: E402
from rollout_watchdog.common.errors import RolloutWatchdogError  # noqa: E402
from rollout_watchdog.emulator.testing import emulator_command, free_port, wait_until  # noqa: E402
from rollout_watchdog.ray.placement import bundle_locations  # noqa: E402
from rollout_watchdog.refit_bridge.views import EngineView  # noqa: E402
from rollout_watchdog.watchdog.process import is_alive, proc_key, read_stat  # noqa: E402

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

NS = "rw-test"
NODE_TIMEOUT_S = 3.0
WAIT_S = 90.0          # generous: a 2-core machine shared with other test runs
NODE_CONFIG = {"gpu_check": "none", "probe": FAST_PROBE, "restart": FAST_RESTART}


@dataclass
class RayFleet:
    cluster: Any
    fleet: FleetClient
    tmp: Path
    head: str        # Ray node ids (hex)
    cpu: str
    gpu: str


def _kill_left_over(tmp: Path) -> None:
    """Whatever a failed test left: every process started from a config under `tmp` (the
    daemons, double-forked away from Ray) and the trees below them."""
    for proc in psutil.process_iter(["cmdline"]):
        if str(tmp) in " ".join(proc.info["cmdline"] or []):
            try:
                for p in [*proc.children(recursive=True), proc]:
                    p.kill()
            except psutil.Error:
                pass


@pytest.fixture(scope="module")
def ray_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayFleet]:
    tmp = tmp_path_factory.mktemp("ray")
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    try:
        cpu = cluster.add_node(num_cpus=1)
        gpu = cluster.add_node(num_cpus=1, num_gpus=2)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address)
        fleet = rw_ray.start(NS, state_dir=str(tmp), log_dir=str(tmp / "logs"), keys=True,
                             node_timeout_s=NODE_TIMEOUT_S, node_config=NODE_CONFIG,
                             timeout_s=WAIT_S)
        yield RayFleet(cluster, fleet, tmp, cluster.head_node.node_id, cpu.node_id,
                       gpu.node_id)
        rw_ray.shutdown(NS)
    finally:
        ray.shutdown()
        cluster.shutdown()
        _kill_left_over(tmp)


@pytest.fixture(autouse=True)
def _one_failure_stays_one(request: pytest.FixtureRequest) -> Iterator[None]:
    """An engine a failed test could not remove would be the next tests' too (a refit takes
    every engine of the fleet): whatever a test launched and left on a live node is removed
    after it (one of a node that is gone, as a raylet's crash leaves, stays listed)."""
    yield
    if "ray_fleet" not in request.fixturenames:
        return
    fleet: FleetClient = request.getfixturevalue("ray_fleet").fleet
    with contextlib.suppress(RolloutWatchdogError, TimeoutError):
        for engine in fleet.engines():
            if engine.origin == "launched" and engine.reachable:
                print(f"removing {engine.name}, left by {request.node.name}")
                fleet.remove(engine.name, wait_s=WAIT_S)


def emulator(engine_id: str, gpus: list[int] | None = None, model: bool = False,
             **kwargs: Any) -> EngineSpec:
    """An emulator engine's spec; without a model (no torch: ~1.5 s less CPU a start) unless
    the test updates its weights."""
    port = free_port()
    command = emulator_command(port)
    if not model and "--no-model" not in command:
        command.append("--no-model")
    return EngineSpec(engine_id, f"http://127.0.0.1:{port}", command,
                      gpus=gpus or (), env=EMULATOR_ENV, tp_size=1, **kwargs)


def environ(pid: int) -> dict[str, str]:
    return dict(line.split("=", 1) for line in
                Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0") if "=" in line)


def view(fleet: FleetClient, name: str) -> EngineView | None:
    return next((e for e in fleet.engines() if e.name == name), None)


def wait_view(fleet: FleetClient, name: str, what: str, check: Any) -> EngineView:
    def ready() -> EngineView | None:
        found = view(fleet, name)
        return found if found is not None and check(found) else None
    return wait_until(ready, WAIT_S, what=what)


def node_info(node_id: str, namespace: str = NS) -> dict[str, Any]:
    actor = ray.get_actor(f"node-{node_id}", namespace=namespace)
    info: dict[str, Any] = ray.get(actor.info.remote(), timeout=WAIT_S)
    return info


@ray.remote(num_cpus=0)
def _start_again() -> list[tuple[str, bool, int | None]]:
    """A second `start` from a Ray task: a client of the running fleet."""
    fleet = rw_ray.start(NS)
    again = rw_ray.fleet(NS)
    assert [n.node_id for n in again.nodes()] == [n.node_id for n in fleet.nodes()]
    return [(n.node_id, n.reachable, n.metrics_port) for n in fleet.nodes()]


def test_start_puts_a_watchdog_on_every_node_and_a_second_start_joins(
        ray_fleet: RayFleet) -> None:
    nodes = ray_fleet.fleet.nodes()
    assert {n.node_id for n in nodes} == {ray_fleet.head, ray_fleet.cpu, ray_fleet.gpu}
    assert all(n.reachable for n in nodes)
    ports = [n.metrics_port for n in nodes]   # one each, though the nodes share a host
    assert all(isinstance(p, int) for p in ports) and len(set(ports)) == 3
    names = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["namespace"] == NS}
    assert names == {"coordinator"} | {f"node-{n.node_id}" for n in nodes}
    daemons = {n.node_id: node_info(n.node_id)["daemon_pid"] for n in nodes}
    controls = {node_info(n.node_id)["control"] for n in nodes}
    assert len(controls) == 3

    seen = ray.get(_start_again.remote(), timeout=WAIT_S)
    assert sorted(seen) == sorted((n.node_id, True, n.metrics_port) for n in nodes)
    assert {n: node_info(n)["daemon_pid"] for n in daemons} == daemons   # no second daemon
    # the metrics port is the daemon's own
    port = next(n.metrics_port for n in nodes if n.node_id == ray_fleet.head)
    assert "rollout_watchdog" in requests.get(f"http://{ray.util.get_node_ip_address()}:{port}"
                                              "/metrics", timeout=10).text
    # what the coordinator actor would die of is refused before anything starts (it died
    # with RayActorError, or a bad timeout waited its whole start out)
    with pytest.raises(ValueError, match="coordinator_options: unknown bogus"):
        rw_ray.start("rw-refused", coordinator_options={"bogus": 1})
    with pytest.raises(ValueError, match="node_timeout_s must be a number of seconds > 0"):
        rw_ray.start("rw-refused", node_timeout_s=-1)
    assert not [a for a in ray.util.list_named_actors(all_namespaces=True)
                if a["namespace"] == "rw-refused"]


def test_the_coordinator_actor_killed_comes_back_on_its_port_with_its_nodes(
        ray_fleet: RayFleet) -> None:
    fleet = ray_fleet.fleet
    boot = fleet.call("ping")[1]["coordinator"]
    ray.kill(ray.get_actor("coordinator", namespace=NS), no_restart=False)

    def back() -> bool:
        try:
            again = fleet.call("ping")[1]["coordinator"] != boot
            reachable = {n.node_id for n in fleet.nodes() if n.reachable}
            return again and reachable >= {ray_fleet.head, ray_fleet.cpu, ray_fleet.gpu}
        except Exception:   # between its lives
            return False
    wait_until(back, WAIT_S, what="the coordinator back, its nodes reachable again")
    assert rw_ray.fleet(NS).address == fleet.address   # the same port, the same keys


def test_a_hostile_key_registration_is_refused_and_harms_nothing(ray_fleet: RayFleet) -> None:
    coordinator = ray.get_actor("coordinator", namespace=NS)
    with pytest.raises(ray.exceptions.RayTaskError, match="unreadable public key"):
        ray.get(coordinator.authorize.remote("intruder", "not a key"), timeout=WAIT_S)
    with pytest.raises(ray.exceptions.RayTaskError, match="node id"):
        ray.get(coordinator.authorize.remote("../../etc", "x"), timeout=WAIT_S)
    keys = Path(ray_fleet.tmp) / NS / "coordinator" / "keys" / "authorized"
    assert [p.name for p in keys.iterdir() if p.name.startswith(("intruder", "."))
            or p.suffix != ".key"] == []
    joined = ray_fleet.cluster.add_node(num_cpus=1)   # the allowlist still loads: let in
    try:
        wait_until(lambda: any(n.node_id == joined.node_id and n.reachable
                               for n in ray_fleet.fleet.nodes()), WAIT_S, what="a new node")
    finally:
        ray_fleet.cluster.remove_node(joined)


def test_a_node_registered_by_many_calls_at_once_is_registered(ray_fleet: RayFleet) -> None:
    """A node's key registered again by calls in flight at once (queued while the coordinator
    actor did not answer, one each time its watchdog gave up waiting): the actor runs them in
    threads, and they raced on their files (FileNotFoundError)."""
    coordinator = ray.get_actor("coordinator", namespace=NS)
    keys = Path(node_info(ray_fleet.cpu)["state_dir"]).parent / "keys"
    public = (keys / f"{ray_fleet.cpu}.key").read_text()
    calls = [coordinator.authorize.remote(ray_fleet.cpu, public) for _ in range(32)]
    assert set(ray.get(calls, timeout=WAIT_S)) == {(keys / "coordinator.key").read_text()}
    assert next(n for n in ray_fleet.fleet.nodes() if n.node_id == ray_fleet.cpu).reachable


def test_start_refuses_node_config_keys_it_owns(ray_fleet: RayFleet) -> None:
    with pytest.raises(ValueError, match="may not set control"):
        rw_ray.start("rw-refused", node_config={"control": "ipc:///tmp/x"})
    with pytest.raises(Exception, match="no rollout-watchdog fleet"):
        rw_ray.fleet("rw-refused")


def test_an_engine_sigkilled_comes_back_with_its_port_and_gpus(ray_fleet: RayFleet) -> None:
    fleet = ray_fleet.fleet
    spec = emulator("kill-me", gpus=[1])
    first = fleet.launch(ray_fleet.head, spec, wait_s=WAIT_S)
    try:
        assert first.pid is not None and first.origin == "launched"
        assert environ(first.pid)["CUDA_VISIBLE_DEVICES"] == "1"
        logs = Path(node_info(ray_fleet.head)["log_dir"])   # where `ray logs` looks
        assert (logs / "kill-me.log").is_file() and (logs / "daemon.log").is_file()
        assert str(ray_fleet.tmp / "logs") in str(logs)
        os.kill(first.pid, signal.SIGKILL)
        again = wait_view(fleet, first.name, "the relaunch", lambda e: e.state == "healthy"
                          and e.incarnation > first.incarnation)
        assert again.url == first.url and again.pid != first.pid
        assert again.pid is not None
        assert environ(again.pid)["CUDA_VISIBLE_DEVICES"] == "1"
    finally:
        fleet.remove(first.name, wait_s=WAIT_S)


def test_bundles_map_to_their_nodes_gpus_and_engines(ray_fleet: RayFleet) -> None:
    fleet = ray_fleet.fleet
    pg = placement_group([{"GPU": 1, "CPU": 0.01}, {"GPU": 1, "CPU": 0.01}],
                         strategy="STRICT_PACK")
    calls: list[tuple[int, str, list[int], str]] = []
    placed = ray_fleet.tmp / NS / "coordinator" / "placed.json"   # the actor's books
    tracked_before: list[list[str]] = []

    def make_spec(index: int, node_id: str, gpu_ids: list[int], host: str) -> EngineSpec:
        calls.append((index, node_id, gpu_ids, host))
        # Each engine belongs to the group before the next bundle's spec is made (a driver
        # SIGKILLed in a slow make_spec left the engines launched before it forever)
        tracked_before.append(json.loads(placed.read_text()).get(pg.id.hex(), [])
                              if placed.exists() else [])
        return emulator(f"pg{index}", gpus=gpu_ids)

    views: list[EngineView] = []
    try:
        views = rw_ray.launch_in_placement_group(fleet, pg, make_spec, wait_s=WAIT_S)
        assert [c[0] for c in calls] == [0, 1]                     # bundle order, here
        assert tracked_before == [[], [views[0].name]]
        assert {c[1] for c in calls} == {ray_fleet.gpu}            # the node with the GPUs
        assert sorted(g for c in calls for g in c[2]) == [0, 1]    # one GPU each
        for (_, node_id, gpu_ids, _), engine in zip(calls, views, strict=True):
            assert engine.node_id == node_id and engine.state == "healthy"
            assert engine.pid is not None
            assert environ(engine.pid)["CUDA_VISIBLE_DEVICES"] == ",".join(map(str, gpu_ids))
        # the daemon itself holds no GPU, and never Ray's empty value
        assert "CUDA_VISIBLE_DEVICES" not in environ(node_info(ray_fleet.gpu)["daemon_pid"])
        # The group removed (its job ended, say), Ray's books show its GPUs free: its engines
        # go too (they stayed, and the next group on those GPUs shared them)
        remove_placement_group(pg)
        names = {engine.name for engine in views}
        wait_until(lambda: not names & {e.name for e in fleet.engines()}, WAIT_S,
                   what="the placement group's engines removed")
    finally:
        for engine in views:
            if view(fleet, engine.name) is not None:
                fleet.remove(engine.name, wait_s=WAIT_S)
        remove_placement_group(pg)


@ray.remote(num_cpus=0, num_gpus=0.5)
class _Colocated:
    """A framework's actor sharing its bundle's GPU (the colocated layout)."""

    def ready(self) -> bool:
        return True


def test_a_bundle_whose_gpu_another_actor_shares_is_a_timeout_that_says_why(
        ray_fleet: RayFleet) -> None:
    """The lookup task takes its bundle's whole GPUs: beside a colocated actor holding half of
    one it never ran, and the call waited 600 s for nothing."""
    pg = placement_group([{"GPU": 1, "CPU": 0.01}])
    try:
        ray.get(pg.ready(), timeout=WAIT_S)
        colocated = _Colocated.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
            pg, placement_group_bundle_index=0)).remote()
        assert ray.get(colocated.ready.remote(), timeout=WAIT_S)
        with pytest.raises(TimeoutError, match="colocated layout"):
            bundle_locations(pg, lookup_s=2.0)
        ray.kill(colocated)
    finally:
        remove_placement_group(pg)


def test_a_group_that_cannot_be_placed_is_a_timeout_within_its_bound(
        ray_fleet: RayFleet) -> None:
    """More GPUs than the cluster has: the group is never placed; launching from it gives up
    after `placement_s`, having launched nothing."""
    pg = placement_group([{"GPU": 64}])
    try:
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            rw_ray.launch_in_placement_group(ray_fleet.fleet, pg, lambda *a: None,
                                             placement_s=1.0)
        assert time.monotonic() - started < 30
    finally:
        remove_placement_group(pg)


def test_a_group_removed_while_it_waits_to_be_placed_is_our_error(ray_fleet: RayFleet
                                                                  ) -> None:
    """Removed while launching from it waits for its placement: one of the contract's errors,
    naming the group, not Ray's TaskPlacementGroupRemoved; nothing launched."""
    pg = placement_group([{"GPU": 64}])
    remover = threading.Timer(1.0, remove_placement_group, [pg])
    remover.start()
    try:
        with pytest.raises(RolloutWatchdogError, match="was removed"):
            rw_ray.launch_in_placement_group(ray_fleet.fleet, pg, lambda *a: None,
                                             placement_s=60.0)
    finally:
        remover.join()


def test_the_watchdog_actor_killed_is_not_the_engines_lifeline(ray_fleet: RayFleet) -> None:
    fleet = ray_fleet.fleet
    node = ray_fleet.cpu
    engine = fleet.launch(node, emulator("survivor"), wait_s=WAIT_S)
    try:
        before = node_info(node)
        daemon = proc_key(before["daemon_pid"])
        assert daemon is not None and engine.pid is not None
        ray.kill(ray.get_actor(f"node-{node}", namespace=NS), no_restart=False)
        after = wait_until(lambda: (i := _info_or_none(node)) and
                           i["actor_pid"] != before["actor_pid"] and i, WAIT_S,
                           what="the watchdog actor back")
        assert after["daemon_pid"] == before["daemon_pid"] and after["kept"]
        assert is_alive(daemon)
        same = view(fleet, engine.name)
        assert same is not None and (same.pid, same.incarnation) == (engine.pid,
                                                                      engine.incarnation)
        # still supervised: a crash is relaunched
        os.kill(engine.pid, signal.SIGKILL)
        wait_view(fleet, engine.name, "the relaunch", lambda e: e.state == "healthy"
                  and e.incarnation == engine.incarnation + 1)

        # a daemon that died is replaced, and the new one adopts the engine as it is
        current = view(fleet, engine.name)
        assert current is not None
        os.kill(daemon.pid, signal.SIGKILL)
        replaced = wait_until(lambda: (i := _info_or_none(node)) and
                              i["daemon_pid"] != daemon.pid and i, WAIT_S,
                              what="another daemon")
        adopted = wait_view(fleet, engine.name, "the engine adopted",
                            lambda e: e.state == "healthy" and e.reachable)
        assert (adopted.pid, adopted.incarnation) == (current.pid, current.incarnation)
        assert replaced["daemon_pid"] != daemon.pid
    finally:
        fleet.remove(engine.name, wait_s=WAIT_S)


def _info_or_none(node_id: str, namespace: str = NS) -> dict[str, Any] | None:
    try:
        return node_info(node_id, namespace)
    except (ValueError, ray.exceptions.RayError):
        return None


@ray.remote(num_cpus=0)
class Trainer:
    """A trainer actor: refits through the client it was handed (pickled)."""

    def refit(self, fleet: FleetClient, version: str) -> list[str]:
        from rollout_watchdog.emulator.model import named_weights
        assert fleet.key is None   # no key path: the key material came in the pickle
        with fleet.refit(version, backend="gloo", timeout_s=WAIT_S) as refit:
            refit.update_weights(named_weights(7))
            return sorted(e.name for e in refit.engines)


def test_a_refit_from_a_ray_actor_through_a_pickled_client_with_curve(
        ray_fleet: RayFleet) -> None:
    fleet = ray_fleet.fleet
    assert "curve=True" in repr(fleet)
    trainer = Trainer.remote()   # (its worker starts while the engines load, both at once)
    engines: list[EngineView] = []
    try:
        for i, node in enumerate((ray_fleet.cpu, ray_fleet.gpu)):
            engines.append(fleet.launch(node, emulator(f"r{i}", model=True)))
        names = {e.name for e in engines}
        fleet.wait_until(lambda view: sum(e.name in names and e.state == "healthy"
                                          for e in view) == len(names), WAIT_S)
        members = ray.get(trainer.refit.remote(fleet, "v1"), timeout=WAIT_S * 2)
        assert members == sorted(names)
        fleet.wait_until(lambda view: all(e.weight_version == "v1" for e in view
                                          if e.name in names), WAIT_S)
    finally:
        ray.kill(trainer)
        for engine in engines:
            fleet.remove(engine.name, wait_s=WAIT_S)


def test_a_node_removed_goes_unreachable_and_nothing_of_it_stays(ray_fleet: RayFleet) -> None:
    fleet = ray_fleet.fleet
    joined = ray_fleet.cluster.add_node(num_cpus=1)
    node = joined.node_id
    # a node that joins later gets its watchdog (within 10 s by design; a generous bound here)
    wait_until(lambda: any(n.node_id == node and n.reachable for n in fleet.nodes()), WAIT_S,
               what="the new node's watchdog")
    engine = fleet.launch(node, emulator("doomed"), wait_s=WAIT_S)
    daemon = proc_key(node_info(node)["daemon_pid"])
    assert daemon is not None and engine.pid is not None
    engine_key = proc_key(engine.pid)
    assert engine_key is not None
    ray_fleet.cluster.remove_node(joined)
    wait_until(lambda: not next(n for n in fleet.nodes() if n.node_id == node).reachable,
               WAIT_S, what="the node unreachable")
    wait_until(lambda: not is_alive(daemon) and not is_alive(engine_key), WAIT_S,
               what="its daemon and engine gone")
    # and its watchdog is not recreated elsewhere (hard affinity)
    with pytest.raises(ValueError):
        ray.get_actor(f"node-{node}", namespace=NS)
    # a refit goes on without it
    trainer = Trainer.remote()   # (its worker starts while the engine loads)
    try:
        survivor = fleet.launch(ray_fleet.cpu, emulator("after", model=True), wait_s=WAIT_S)
        try:
            members = ray.get(trainer.refit.remote(fleet, "v2"), timeout=WAIT_S * 2)
            assert members == [survivor.name]
        finally:
            fleet.remove(survivor.name, wait_s=WAIT_S)
    finally:
        ray.kill(trainer)


def test_a_raylet_crash_stops_its_daemon_and_engines(ray_fleet: RayFleet) -> None:
    """A raylet SIGKILLed stays a zombie child of this process (measured): the daemon reads
    its state, so the zombie counts as gone."""
    fleet = ray_fleet.fleet
    joined = ray_fleet.cluster.add_node(num_cpus=1)
    try:
        node = joined.node_id
        wait_until(lambda: any(n.node_id == node and n.reachable for n in fleet.nodes()),
                   WAIT_S, what="the new node's watchdog")
        engine = fleet.launch(node, emulator("orphan-to-be"), wait_s=WAIT_S)
        daemon = proc_key(node_info(node)["daemon_pid"])
        assert daemon is not None and engine.pid is not None
        engine_key = proc_key(engine.pid)
        assert engine_key is not None
        raylet = joined.all_processes["raylet"][0].process
        raylet.send_signal(signal.SIGKILL)
        wait_until(lambda: (stat := read_stat(raylet.pid)) is not None and stat.state == b"Z",
                   WAIT_S, what="the raylet a zombie")
        wait_until(lambda: not is_alive(daemon) and not is_alive(engine_key), WAIT_S,
                   what="its daemon and engine gone")
        wait_until(lambda: not next(n for n in fleet.nodes() if n.node_id == node).reachable,
                   WAIT_S, what="the node unreachable")
    finally:
        ray_fleet.cluster.remove_node(joined, allow_graceful=False)


@ray.remote(num_cpus=0)
def _start_in(namespace: str, **kwargs: Any) -> str:
    return rw_ray.start(namespace, **kwargs).address


def test_a_coordinator_made_again_on_another_port_gets_every_node_back(
        ray_fleet: RayFleet) -> None:
    """The coordinator actor gone (its node died, say) and made again by a later start() on
    another endpoint: the node watchdogs kept dialing the old one, and start() timed out with
    every kept node unreachable. Now each is told; its daemon is replaced and the new one adopts
    the engines (same process, same incarnation)."""
    namespace = "rw-moved"
    options = {"state_dir": str(ray_fleet.tmp / "moved"), "node_config": NODE_CONFIG,
               "log_dir": str(ray_fleet.tmp / "moved-logs"), "timeout_s": WAIT_S}
    try:
        fleet = rw_ray.start(namespace, **options)
        engine = fleet.launch(ray_fleet.cpu, emulator("kept"), wait_s=WAIT_S)
        fleet.close()
        ray.kill(ray.get_actor("coordinator", namespace=namespace), no_restart=True)
        (ray_fleet.tmp / "moved" / namespace / "coordinator" / "port").unlink()
        again = rw_ray.start(namespace, **options)   # every node reachable, or TimeoutError
        assert again.address != fleet.address
        same = again.wait_until(lambda v: any(
            e.name == engine.name and e.reachable and e.state == "healthy" for e in v), WAIT_S)
        assert same
        kept = view(again, engine.name)
        assert kept is not None and (kept.pid, kept.incarnation) == (engine.pid,
                                                                      engine.incarnation)
        again.close()
    finally:
        rw_ray.shutdown(namespace)


def _coordinator_of(node_id: str, namespace: str) -> str:
    """The coordinator endpoint node `node_id`'s daemon was started to dial."""
    state = Path(node_info(node_id, namespace)["state_dir"])
    return str(tomllib.loads((state.parent / "node.toml").read_text())["coordinator"])


def test_a_coordinator_restarted_while_its_port_is_taken_serves_on_another_with_its_nodes(
        ray_fleet: RayFleet) -> None:
    """Ray restarts the coordinator actor and its saved port is someone else's by then: it
    serves on a fresh port, and its watcher tells every node watchdog (`point_to`), whose
    daemon is replaced by one dialing the new port. (The saved port is one this test holds:
    binding the old port between the actor's death and its restart would race Ray.) One
    watchdog actor hangs (SIGSTOP) as it is told, then dies (SIGKILL): the one Ray makes again
    dials the old port, as its creation said, until the coordinator tells it again."""
    namespace = "rw-taken"
    options = {"state_dir": str(ray_fleet.tmp / "taken"), "node_config": NODE_CONFIG,
               "log_dir": str(ray_fleet.tmp / "taken-logs"), "timeout_s": WAIT_S}
    nodes = {ray_fleet.head, ray_fleet.cpu, ray_fleet.gpu}
    taker = socket.socket()
    hung: int | None = None
    try:
        first = rw_ray.start(namespace, **options)
        first.close()
        host = first.address.rsplit(":", 1)[0].removeprefix("tcp://").strip("[]")
        taker.bind((host, 0))
        taker.listen()
        taken = taker.getsockname()[1]
        port_file = ray_fleet.tmp / "taken" / namespace / "coordinator" / "port"
        port_file.write_text(str(taken))
        hung = node_info(ray_fleet.cpu, namespace)["actor_pid"]
        os.kill(hung, signal.SIGSTOP)
        ray.kill(ray.get_actor("coordinator", namespace=namespace), no_restart=False)

        def moved() -> FleetClient | None:
            try:
                client = rw_ray.fleet(namespace)   # (waits for the actor's restart)
            except (ray.exceptions.RayError, RolloutWatchdogError):
                return None
            if client.address == first.address:   # not restarted yet
                client.close()
                return None
            return client
        again = wait_until(moved, WAIT_S, what="the coordinator actor restarted")
        try:
            port = int(again.address.rsplit(":", 1)[1])
            assert port != taken and port_file.read_text() == str(port)
            told = nodes - {ray_fleet.cpu}
            wait_until(lambda: {n.node_id for n in again.nodes() if n.reachable} >= told,
                       WAIT_S, what="the other nodes reachable through the moved coordinator")
            os.kill(hung, signal.SIGKILL)   # its point_to call fails; Ray makes it again
            wait_until(lambda: {n.node_id for n in again.nodes() if n.reachable} >= nodes,
                       WAIT_S, what="every node reachable through the moved coordinator")
            assert {_coordinator_of(n, namespace) for n in nodes} == {again.address}
        finally:
            again.close()
    finally:
        if hung is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(hung, signal.SIGCONT)
        taker.close()
        rw_ray.shutdown(namespace)


def test_a_daemon_dead_while_the_coordinator_cannot_answer_is_replaced_with_its_keys(
        ray_fleet: RayFleet) -> None:
    """CURVE: the coordinator actor does not answer (SIGSTOP: its node hangs, say) when a
    node's daemon dies. The watchdog gives up asking it after a while and starts another daemon
    with the keys its node registered before; once the coordinator answers again, the node is
    reachable."""
    fleet, node = ray_fleet.fleet, ray_fleet.cpu
    before = node_info(node)
    keys = Path(before["state_dir"]).parent / "keys"
    registered = {p.name: p.read_text() for p in keys.iterdir()}
    assert {f"{node}.key", f"{node}.key_secret", "coordinator.key"} <= set(registered)
    coordinator = ray.get_actor("coordinator", namespace=NS)
    pid = ray.get(coordinator.__ray_call__.remote(lambda actor: os.getpid()), timeout=WAIT_S)
    stopped = psutil.Process(pid)
    os.kill(pid, signal.SIGSTOP)
    try:
        os.kill(before["daemon_pid"], signal.SIGKILL)
        replaced = wait_until(lambda: (i := _info_or_none(node)) and
                              i["daemon_pid"] != before["daemon_pid"] and i, WAIT_S,
                              what="another daemon, the coordinator not answering")
        assert stopped.status() == psutil.STATUS_STOPPED   # it was replaced without it
    finally:
        os.kill(pid, signal.SIGCONT)
    daemon = proc_key(replaced["daemon_pid"])
    assert daemon is not None and is_alive(daemon)
    assert {p.name: p.read_text() for p in keys.iterdir()} == registered   # the same keys
    wait_until(lambda: {n.node_id for n in fleet.nodes() if n.reachable} >= {
        ray_fleet.head, ray_fleet.cpu, ray_fleet.gpu}, WAIT_S,
        what="every node reachable, the coordinator answering again")
    assert node_info(node)["daemon_pid"] == daemon.pid


def test_a_watchdog_actor_restarted_after_the_coordinator_moved_dials_where_it_is_now(
        ray_fleet: RayFleet) -> None:
    """A watchdog actor told of a newer coordinator endpoint (`point_to`) and then restarted
    by Ray gets its creation's settings back, which name the old endpoint: it reads the newer
    one from its state dir, keeps the daemon that dials it, and the node stays reachable."""
    namespace = "rw-pointed"
    options = {"state_dir": str(ray_fleet.tmp / "pointed"), "node_config": NODE_CONFIG,
               "log_dir": str(ray_fleet.tmp / "pointed-logs"), "timeout_s": WAIT_S}
    node = ray_fleet.cpu
    try:
        first = rw_ray.start(namespace, **options)
        first.close()
        ray.kill(ray.get_actor("coordinator", namespace=namespace), no_restart=True)
        (ray_fleet.tmp / "pointed" / namespace / "coordinator" / "port").unlink()
        again = rw_ray.start(namespace, **options)   # made again, elsewhere: every node told
        assert again.address != first.address
        assert _coordinator_of(node, namespace) == again.address

        def replaced() -> dict[str, Any] | None:   # (reachable already: it said hello)
            info = node_info(node, namespace)
            daemon = proc_key(info["daemon_pid"])
            return info if daemon is not None and is_alive(daemon) else None
        before = wait_until(replaced, WAIT_S, what="the daemon dialing the new endpoint")
        ray.kill(ray.get_actor(f"node-{node}", namespace=namespace), no_restart=False)
        after = wait_until(lambda: (i := _info_or_none(node, namespace)) and
                           i["actor_pid"] != before["actor_pid"] and i, WAIT_S,
                           what="the watchdog actor back")
        watchdog = ray.get_actor(f"node-{node}", namespace=namespace)
        assert ray.get(watchdog.__ray_call__.remote(
            lambda actor: actor.settings["coordinator"]), timeout=WAIT_S) == again.address
        assert after["kept"] and after["daemon_pid"] == before["daemon_pid"]
        assert _coordinator_of(node, namespace) == again.address
        assert next(n for n in again.nodes() if n.node_id == node).reachable
        again.close()
    finally:
        rw_ray.shutdown(namespace)


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSTOP], ids=["died", "hung"])
def test_shutdown_stops_the_engines_of_a_daemon_that_died_or_hung(
        ray_fleet: RayFleet, how: signal.Signals) -> None:
    """A daemon SIGKILLed and not replaced yet (its watchdog looks every daemon_check_s):
    shutdown() found it dead and did nothing, and its engine ran on, unwatched. A daemon
    SIGSTOPped: shutdown() SIGKILLed it after timeout_s, and the same. Now a daemon adopts the
    engines, to stop them."""
    namespace = f"rw-{how.name.lower()}-daemon"
    fleet = rw_ray.start(namespace, **_options(ray_fleet, namespace, daemon_check_s=600.0))
    engine = fleet.launch(ray_fleet.cpu, emulator("orphaned"), wait_s=WAIT_S)
    fleet.close()
    daemon = ray.get(ray.get_actor(f"node-{ray_fleet.cpu}", namespace=namespace).info.remote())
    key = proc_key(engine.pid or 0)
    assert key is not None
    os.kill(daemon["daemon_pid"], how)
    try:
        rw_ray.shutdown(namespace, timeout_s=3.0 if how == signal.SIGSTOP else WAIT_S)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(daemon["daemon_pid"], signal.SIGCONT)
    assert not is_alive(key), "the engine of the daemon outlived shutdown()"


def test_shutdown_stops_the_daemon_and_engines_of_a_watchdog_actor_that_hangs(
        ray_fleet: RayFleet) -> None:
    """The watchdog actor's worker SIGSTOPped (its host swapping, say): shutdown() waited out
    its stop's whole bound, killed the actor, and left its daemon and engine running. Now a
    task on its node stops them, the launched engine forgotten first."""
    namespace = "rw-hung-watchdog"
    fleet = rw_ray.start(namespace, **_options(ray_fleet, "hung-watchdog"))
    engine = fleet.launch(ray_fleet.cpu, emulator("under-a-hung-watchdog"), wait_s=WAIT_S)
    fleet.close()
    info = node_info(ray_fleet.cpu, namespace)
    keys = [proc_key(engine.pid or 0), proc_key(info["daemon_pid"])]
    assert None not in keys
    os.kill(info["actor_pid"], signal.SIGSTOP)
    try:
        rw_ray.shutdown(namespace, timeout_s=3.0)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(info["actor_pid"], signal.SIGCONT)
    assert [k for k in keys if k is not None and is_alive(k)] == []
    books = [p.read_text() for p in (ray_fleet.tmp / "hung-watchdog").rglob("launched.json")]
    assert books and not any("under-a-hung-watchdog" in b for b in books), books
    assert not _named_in(namespace)


def test_shutdown_leaves_no_process_behind(ray_fleet: RayFleet) -> None:
    """... of a fleet that three processes started at once: one coordinator, one daemon a
    node; even with its coordinator actor gone (killed here; its node dies, on a cluster):
    shutdown() returned at once and left every daemon and engine running. Its launched engine
    is forgotten too (a later fleet on the same state dir does not bring it back)."""
    namespace = "rw-shutdown"
    options = {"state_dir": str(ray_fleet.tmp / "other"), "node_config": NODE_CONFIG,
               "log_dir": str(ray_fleet.tmp / "other-logs"), "timeout_s": WAIT_S}
    racing = [_start_in.remote(namespace, **options) for _ in range(2)]
    fleet = rw_ray.start(namespace, **options)
    assert ray.get(racing, timeout=WAIT_S * 2) == [fleet.address] * 2
    daemons = [p for p in psutil.process_iter(["cmdline"])
               if str(ray_fleet.tmp / "other") in " ".join(p.info["cmdline"] or [])]
    assert len(daemons) == 3, [p.info["cmdline"] for p in daemons]
    engine = fleet.launch(ray_fleet.cpu, emulator("gone"), wait_s=WAIT_S)
    infos = [ray.get(ray.get_actor(f"node-{n.node_id}", namespace=namespace).info.remote())
             for n in fleet.nodes()]
    assert engine.pid is not None
    keys = [k for pid in [engine.pid, *(i["daemon_pid"] for i in infos)]
            if (k := proc_key(pid)) is not None]
    assert len(keys) == 4
    fleet.close()
    ray.kill(ray.get_actor("coordinator", namespace=namespace), no_restart=True)
    start = time.monotonic()
    rw_ray.shutdown(namespace)
    assert [k for k in keys if is_alive(k)] == []
    wait_until(lambda: not [a for a in ray.util.list_named_actors(all_namespaces=True)
                            if a["namespace"] == namespace], WAIT_S, what="no actor left")
    left = [p.pid for p in psutil.process_iter(["cmdline"])
            if str(ray_fleet.tmp / "other") in " ".join(p.info["cmdline"] or [])]
    assert left == [], f"left after shutdown ({time.monotonic() - start:.1f} s): {left}"
    launched = [json.loads(p.read_text()) for p in (ray_fleet.tmp / "other").rglob(
        "launched.json")]
    assert launched and not any("gone" in str(books) for books in launched), launched
    with pytest.raises(Exception, match="no rollout-watchdog fleet"):
        rw_ray.fleet(namespace)
    # the other fleet goes on
    assert {n.node_id for n in ray_fleet.fleet.nodes() if n.reachable} >= {
        ray_fleet.head, ray_fleet.cpu, ray_fleet.gpu}


def test_shutdown_with_its_coordinator_stopped_leaves_no_watchdog_made_again(
        ray_fleet: RayFleet) -> None:
    """The coordinator actor's worker SIGSTOPped during shutdown() and continued once the
    watchdogs were stopped: its watch's next round made them (and their daemons) again after
    shutdown() returned. Now shutdown() kills a coordinator actor that does not answer first.
    Meanwhile `fleet()` and a joining `start()` raise a TimeoutError that names it, in their
    bound (Ray's said "some object(s) not ready", and `fleet()` waited 120 s)."""
    namespace = "rw-stopped-coordinator"
    rw_ray.start(namespace, **_options(ray_fleet, "stopped-coord", watch_s=0.5)).close()
    coordinator = ray.get_actor("coordinator", namespace=namespace)
    pid = ray.get(coordinator.__ray_call__.remote(lambda actor: os.getpid()), timeout=WAIT_S)
    os.kill(pid, signal.SIGSTOP)
    for call in (rw_ray.fleet, rw_ray.start):   # (a second start joins: it asks the actor)
        with pytest.raises(TimeoutError, match=f"coordinator actor .* {namespace!r}"):
            call(namespace, timeout_s=1.0)
    shutting = threading.Thread(target=rw_ray.shutdown, args=(namespace, 3.0))
    shutting.start()
    try:   # continued once the watchdogs are gone, while shutdown() goes on
        wait_until(lambda: not [n for n in _named_in(namespace) if n.startswith("node-")],
                   WAIT_S, what="the watchdogs stopped")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
        shutting.join(WAIT_S * 4)
    assert not shutting.is_alive()
    wait_until(lambda: not _named_in(namespace), WAIT_S, what="no actor left in the namespace")
    deadline = time.monotonic() + 3.0   # six of its watch rounds: none makes a watchdog
    while time.monotonic() < deadline:
        assert not _named_in(namespace), _named_in(namespace)
        time.sleep(0.1)
    assert not [p for p in psutil.process_iter(["cmdline"])
                if str(ray_fleet.tmp / "stopped-coord") in " ".join(p.info["cmdline"] or [])]


def _named_in(namespace: str) -> list[str]:
    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["namespace"] == namespace]


def _options(ray_fleet: RayFleet, name: str, **more: Any) -> dict[str, Any]:
    """start()'s options for a fleet of its own in `ray_fleet`'s cluster, under `name`."""
    return {"state_dir": str(ray_fleet.tmp / name), "node_config": NODE_CONFIG,
            "log_dir": str(ray_fleet.tmp / f"{name}-logs"), "timeout_s": WAIT_S, **more}
