"""The Ray deployment's pure parts: each node's paths and config, and the daemon's
environment (no cluster needed; rollout_watchdog.ray imports ray, hence the skip)."""

from __future__ import annotations

import os
import sys
import tempfile
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("ray")


from rollout_watchdog.common.errors import CommandRefused  # noqa: E402
from rollout_watchdog.common.validate import MAX_IPC_PATH_BYTES  # noqa: E402
from rollout_watchdog.config import ConfigError, parse_config  # noqa: E402
from rollout_watchdog.ray import actors  # noqa: E402
from rollout_watchdog.ray.actors import gone_for_good, recreate_due  # noqa: E402
from rollout_watchdog.ray.daemon_process import (  # noqa: E402
    daemon_environment,
    find_raylet,
    process_environ,
)
from rollout_watchdog.ray.layout import NodeLayout, check_extra, node_config, to_toml  # noqa: E402
from rollout_watchdog.ray.placement import PlacedEngines  # noqa: E402
from rollout_watchdog.watchdog.process import ProcKey, ProcStat  # noqa: E402

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

NODE = "a" * 56   # a Ray node id in hex


def test_nodes_sharing_a_host_get_their_own_paths_and_a_short_control_socket(
        tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 120)
    one = NodeLayout.of(NODE, deep, deep / "logs", "rollout-watchdog")
    other = NodeLayout.of("b" * 56, deep, deep / "logs", "rollout-watchdog")
    again = NodeLayout.of(NODE, deep, deep / "logs", "rollout-watchdog")
    assert one.control != other.control and one.node_dir != other.node_dir
    assert one == again   # a restarted actor finds the same daemon
    assert len(one.control[len("ipc://"):].encode()) <= MAX_IPC_PATH_BYTES
    assert NodeLayout.of(NODE, deep, deep, "other-namespace").control != one.control


def test_the_node_config_is_valid_and_engine_logs_go_to_the_log_dir(tmp_path: Path) -> None:
    layout = NodeLayout.of(NODE, tmp_path / "state", tmp_path / "logs", "ns")
    layout.prepare()
    config = node_config(layout, coordinator="tcp://10.0.0.1:5555", metrics_host="10.0.0.2",
                         metrics_port=9100, lifeline_pid=1, key="/k/n.key_secret",
                         coordinator_key="/k/coordinator.key",
                         extra={"gpu_check": "none", "probe": {"health_interval_s": 0.5}})
    parsed = parse_config(tomllib.loads(to_toml(config)), check_commands=False)
    assert (parsed.node_id, parsed.lifeline_pid, parsed.metrics_port) == (NODE, 1, 9100)
    assert parsed.control == layout.control and parsed.engine_log == "file"
    assert parsed.probe.health_interval_s == 0.5
    assert (layout.state_dir / "logs").resolve() == layout.log_dir.resolve()


def test_node_config_refuses_the_keys_the_deployment_owns(tmp_path: Path) -> None:
    layout = NodeLayout.of(NODE, tmp_path, tmp_path, "ns")
    with pytest.raises(ValueError, match="control, node_id"):
        node_config(layout, coordinator="tcp://h:1", metrics_host="h", metrics_port=1,
                    lifeline_pid=1, extra={"node_id": "x", "control": "ipc:///x"})


def test_node_config_values_are_checked_before_any_actor_starts() -> None:
    with pytest.raises(ConfigError, match=r"\[probe\]: key 'health_interval_s' must be > 0"):
        check_extra({"probe": {"health_interval_s": -1}})
    check_extra({"gpu_check": "none", "restart": {"max_restarts": 2}})


def test_lifeline_pid_is_checked_like_every_key() -> None:
    with pytest.raises(ConfigError, match="key 'lifeline_pid' must be an integer"):
        parse_config({"lifeline_pid": "raylet"})
    with pytest.raises(ConfigError, match="key 'lifeline_pid' must be >= 1"):
        parse_config({"lifeline_pid": 0})


def test_the_daemon_never_gets_rays_empty_device_lists() -> None:
    env = daemon_environment({"CUDA_VISIBLE_DEVICES": "", "ROCR_VISIBLE_DEVICES": "",
                              "PATH": "/bin", "RAY_ADDRESS": "x"})
    assert env == {"PATH": "/bin", "RAY_ADDRESS": "x"}


def test_the_engines_do_not_inherit_the_thread_count_ray_gave_the_watchdog_actor() -> None:
    """Ray sets OMP_NUM_THREADS to a worker's num_cpus (1 for the watchdog's 0): every engine
    inherited it. Kept only when the node's own environment (the raylet's) has that value."""
    worker = {"PATH": "/bin", "OMP_NUM_THREADS": "1"}
    assert daemon_environment(worker, {"PATH": "/bin"}) == {"PATH": "/bin"}
    assert daemon_environment(worker, {"OMP_NUM_THREADS": "1"}) == worker   # the node's own
    assert daemon_environment(worker, None) == worker   # the raylet's unreadable: as it is
    assert process_environ(os.getpid()) is not None and process_environ(0) is None


def test_the_lifeline_is_the_raylet_even_behind_a_runtime_envs_wrapper() -> None:
    """Under a runtime env's `py_executable` (`uv run`, nsys) the actor's parent is the
    wrapper, not the raylet: the daemon took the wrapper for its lifeline, and a watchdog actor
    that Ray restarted stopped every engine. Ray's $RAY_RAYLET_PID, else the ancestors."""
    table = {100: ProcStat(100, b"S", 50, 100, 1.0, "pywrap.sh"),
             50: ProcStat(50, b"S", 1, 50, 1.0, "raylet"),
             70: ProcStat(70, b"S", 1, 70, 1.0, "raylet")}
    assert find_raylet({}, 100, table.get) == 50
    assert find_raylet({"RAY_RAYLET_PID": "70"}, 100, table.get) == 70
    assert find_raylet({"RAY_RAYLET_PID": "100"}, 100, table.get) == 50   # not a raylet
    assert find_raylet({}, 50, table.get) == 50
    alone = {100: ProcStat(100, b"S", 1, 100, 1.0, "python")}
    assert find_raylet({}, 100, alone.get) == 100   # none: the parent (a warning says so)


def test_a_control_socket_directory_others_may_enter_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The control socket's directory is in the shared temporary directory: one made first by
    someone else (or left open to all) was taken as it was, and whoever could write there
    could replace the daemon's socket."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    layout = NodeLayout.of(NODE, tmp_path / "state", tmp_path / "logs", "ns")
    sockets = Path(layout.control[len("ipc://"):]).parent
    sockets.mkdir(mode=0o700)
    sockets.chmod(0o777)
    with pytest.raises(RuntimeError, match="others may enter it"):
        layout.prepare()
    sockets.chmod(0o700)
    layout.prepare()   # ours alone: taken
    if os.getuid() == 0:   # (only root can give it away)
        os.chown(sockets, 65534, 65534)
        with pytest.raises(RuntimeError, match="owned by uid 65534"):
            layout.prepare()


def test_placed_engines_follow_their_groups_and_survive_a_restart(tmp_path: Path) -> None:
    path = tmp_path / "placed.json"
    placed = PlacedEngines(path)
    placed.add("aa", ["n1/e0"])
    placed.add("aa", ["n1/e1", "n1/e0"])
    placed.add("bb", ["n2/e0"])
    table = {"aa": {"state": "CREATED"}, "bb": {"state": "REMOVED"}}
    assert placed.removed(table) == {"bb": ["n2/e0"]}
    assert placed.removed({"aa": {"state": "CREATED"}}) == {"bb": ["n2/e0"]}  # gone from it
    placed.forget("bb")
    again = PlacedEngines(path)   # a restarted coordinator actor
    assert again.groups == {"aa": ["n1/e0", "n1/e1"]} and again.removed(table) == {}


def test_a_watchdog_that_keeps_dying_is_made_again_less_and_less_often() -> None:
    """One whose daemon cannot start was made again every watch_s (2 s) for ever."""
    assert recreate_due(0, 0.0, 0.0, 2.0)                 # never made: now
    assert not recreate_due(1, 100.0, 103.9, 2.0) and recreate_due(1, 100.0, 104.0, 2.0)
    assert not recreate_due(3, 100.0, 115.9, 2.0) and recreate_due(3, 100.0, 116.0, 2.0)
    assert not recreate_due(20, 100.0, 399.0, 2.0) and recreate_due(20, 100.0, 400.0, 2.0)


def test_an_engine_launched_again_in_another_group_is_that_groups_alone(tmp_path: Path) -> None:
    """e0 relaunched in group bb after its removal from aa: aa's removal must not take it."""
    placed = PlacedEngines(tmp_path / "placed.json")
    placed.add("aa", ["n1/e0", "n1/e1"])
    placed.add("bb", ["n1/e0"])
    assert placed.groups == {"aa": ["n1/e1"], "bb": ["n1/e0"]}
    placed.add("cc", ["n1/e1"])
    assert placed.groups == {"bb": ["n1/e0"], "cc": ["n1/e1"]}   # aa held nothing any more
    placed.clear()   # the fleet's end
    assert PlacedEngines(tmp_path / "placed.json").groups == {}


def test_an_engine_of_a_removed_group_is_forgotten_only_once_its_node_said_so() -> None:
    """Its node unreachable when the group went, the engine was forgotten and ran on."""
    answered = CommandRefused("n1: no engine 'e0' on this node", code="NODE_ERRORS")
    unreachable = CommandRefused("node 'n1' is unreachable", code="NODE_UNREACHABLE")
    silent = CommandRefused("no answer within 5 s from n1", code="NODE_ERRORS", missing=["n1"])
    unknown = CommandRefused("unknown node 'n1'", code="UNKNOWN_NODE")
    assert gone_for_good(answered, True)
    assert not any(gone_for_good(e, True) for e in (unreachable, silent, unknown))
    assert all(gone_for_good(e, False) for e in (unreachable, silent, unknown))  # node died


def test_a_daemon_found_dying_at_shutdown_has_its_engines_adopted_and_stopped(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """NodeWatchdog.stop() looked while a daemon SIGKILLed a moment before was still exiting:
    alive; then it dropped forget_launched's connection and was gone. Before, that daemon's
    stop was all, and its engine ran on, unwatched (a suite run). Now another daemon adopts
    the engines, and that one is stopped (its stop stops them)."""
    dying, successor = ProcKey(1001, 1.0), ProcKey(1002, 2.0)
    alive = {dying: True, successor: True}
    watchdog = object.__new__(actors.NodeWatchdog)   # (its __init__ needs a Ray worker)
    watchdog.settings = {"daemon_check_s": 1.0}
    watchdog.layout = SimpleNamespace(control="ipc:///nowhere")   # type: ignore[assignment]
    watchdog.daemon = dying
    watchdog._lock, watchdog._stop = threading.Lock(), threading.Event()
    watchdog._watcher = threading.Thread(target=lambda: None)
    watchdog._watcher.start()

    def adopt() -> None:
        watchdog.daemon = successor

    def forget(control: str, timeout_s: float) -> bool:
        if watchdog.daemon == dying:   # it drops the connection as it dies
            alive[dying] = False
            return False
        return True
    stopped: list[ProcKey] = []
    monkeypatch.setattr(watchdog, "ensure_daemon", adopt)
    monkeypatch.setattr(actors, "is_alive", lambda key: alive[key])
    monkeypatch.setattr(actors.daemon_process, "forget_launched", forget)
    monkeypatch.setattr(actors.daemon_process, "wait_gone", lambda key, t: not alive[key])
    monkeypatch.setattr(actors.daemon_process, "stop",
                        lambda key, t: stopped.append(key) is None)
    assert watchdog.stop(5.0) and stopped == [successor]


def test_a_daemon_gone_with_its_raylet_is_not_started_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The raylet SIGKILLed: its daemon exits (its lifeline), and the watchdog actor, which
    can outlive the raylet for minutes, started another every second, each finding its
    lifeline gone (a suite run: 72 in 90 s, the node reachable throughout). Now the watch ends
    with the raylet; while the raylet lives, a daemon that died is replaced."""
    daemon, raylet = ProcKey(1001, 1.0), ProcKey(1000, 0.5)
    alive = {daemon: False, raylet: True}
    watchdog = object.__new__(actors.NodeWatchdog)   # (its __init__ needs a Ray worker)
    watchdog.settings = {"daemon_check_s": 0.01}
    watchdog.daemon, watchdog.raylet, watchdog.raylet_key = daemon, raylet.pid, raylet
    watchdog._stop = threading.Event()
    started: list[bool] = []

    def replace() -> None:   # the replacement dies with the raylet
        started.append(True)
        alive[raylet] = False
    monkeypatch.setattr(watchdog, "ensure_daemon", replace)
    monkeypatch.setattr(actors, "is_alive", lambda key: alive[key])
    watcher = threading.Thread(target=watchdog._watch, daemon=True)
    watcher.start()
    try:
        watcher.join(10)
        assert not watcher.is_alive() and started == [True]
    finally:   # a watch that does not end (a regression) must not outlive the test
        watchdog._stop.set()
        watcher.join(5)
