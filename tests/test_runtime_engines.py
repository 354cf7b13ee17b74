"""Engines launched at run time (issue 14 §1), on the real daemon with real engines: `launch`
and its refusals, supervision exactly as for a configured engine, adoption after a daemon
SIGKILL, `remove`, the spec kept across restarts, and the GPUs an engine gets."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest
from daemon_harness import EngineSpec, Node, emulator_command, pid_gone, wait_for

from rollout_watchdog.cli.client import ControlError
from rollout_watchdog.config import ConfigError, parse_config
from rollout_watchdog.emulator.testing import free_port

MakeNode = Callable[..., Node]
# A process that writes the CUDA_VISIBLE_DEVICES it got (JSON: null when absent) and sleeps;
# watched by liveness alone (no HTTP), so a launch costs no engine boot.
ENV_PROBE = ("import json, os, sys, time; open(sys.argv[1], 'w').write(json.dumps("
             "os.environ.get('CUDA_VISIBLE_DEVICES'))); time.sleep(600)")


def sleeper(engine_id: str, out: Path, stubborn: bool = False, **extra: Any) -> dict[str, Any]:
    """The spec of an engine that only records its GPUs (deep probes off); a `stubborn` one
    ignores SIGTERM (its kill takes the whole grace)."""
    code = ("import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN); " if stubborn
            else "") + ENV_PROBE
    return {"id": engine_id, "url": f"http://127.0.0.1:{free_port()}",
            "command": [sys.executable, "-c", code, str(out)],
            "probe": {"health_path": ""}, **extra}


def emulator_spec(engine_id: str, **extra: Any) -> dict[str, Any]:
    port = free_port()
    return {"id": engine_id, "url": f"http://127.0.0.1:{port}",
            "command": emulator_command(port), **extra}


def launch(node: Node, table: dict[str, Any]) -> dict[str, Any]:
    result: dict[str, Any] = node.client.call("launch", {"spec": table}, timeout_s=10.0)
    return result


def refused(node: Node, cmd: str, args: dict[str, Any]) -> str:
    with pytest.raises(ControlError) as caught:
        node.client.call(cmd, args)
    return str(caught.value)


def seen_env(path: Path) -> Any:
    return wait_for(lambda: path.exists() and path.read_text() and [json.loads(
        path.read_text())], 20, f"{path.name} to be written")[0]


def test_launch_refusals_origin_and_gpus(make_node: MakeNode, tmp_path: Path) -> None:
    # the daemon runs where Ray gives an actor without GPUs CUDA_VISIBLE_DEVICES=""
    node = make_node([EngineSpec("e0", extra={"gpus": [0]})],
                     env={"CUDA_VISIBLE_DEVICES": ""}).start()
    e0 = node.wait_state("e0", "healthy")
    answer = launch(node, sleeper("x1", tmp_path / "x1.env", gpus=[1, 2]))
    assert answer["engine"] == "x1" and answer["status"]["origin"] == "launched"
    node.wait_state("x1", "healthy")
    assert seen_env(tmp_path / "x1.env") == "1,2"   # exactly its spec's GPUs
    launch(node, sleeper("x2", tmp_path / "x2.env", stubborn=True))
    node.wait_state("x2", "healthy")
    assert seen_env(tmp_path / "x2.env") is None    # Ray's empty value never reaches it

    # someone else's engine, registered
    outsider = subprocess.Popen(["sleep", "600"])
    try:
        port = free_port()
        node.client.call("register", {"engine": "r0", "url": f"http://127.0.0.1:{port}",
                                      "pid": outsider.pid})
        origins = {e["id"]: e["origin"] for e in node.status()["engines"]}
        assert origins == {"e0": "config", "x1": "launched", "x2": "launched",
                           "r0": "registered"}

        # every refusal names the other engine
        assert "engine id e0 is already on this node (config engine e0" in refused(
            node, "launch", {"spec": sleeper("e0", tmp_path / "no")})
        assert "engine id x1 is already on this node (launched engine x1" in refused(
            node, "launch", {"spec": sleeper("x1", tmp_path / "no")})
        assert "engine id r0 is already on this node (registered engine r0" in refused(
            node, "launch", {"spec": sleeper("r0", tmp_path / "no")})
        taken = {**sleeper("y", tmp_path / "no"), "url": e0["url"]}
        assert f"port {node.engines['e0'].port} is already in engine e0's url" in refused(
            node, "launch", {"spec": taken})
        assert f"port {port} is already in engine r0's url" in refused(
            node, "launch", {"spec": sleeper("y", tmp_path / "no", ports=[port])})
        assert "GPU 2 is already in engine x1's gpus" in refused(
            node, "launch", {"spec": sleeper("y", tmp_path / "no", gpus=[3, 2])})
        assert "GPU 0 is already in engine e0's gpus" in refused(
            node, "launch", {"spec": sleeper("y", tmp_path / "no", gpus=[0])})
        # a bad spec: the field named as check-config names it
        bad = sleeper("y", tmp_path / "no", gpus="zero", restart={"grace_s": -1})
        with pytest.raises(ConfigError) as checked:
            parse_config({"engine": [bad]}, check_commands=False)
        said = refused(node, "launch", {"spec": bad})
        assert checked.value.problems and all(p in said for p in checked.value.problems)
        assert "engine 'y': key 'gpus' must be a list of integers" in said
        assert "engine 'y' [restart]: key 'grace_s' must be >= 0" in said
        assert "'spec' must be an [[engine]] table" in refused(node, "launch", {"spec": [1]})
        assert "key 'command' names a program that is not found" in refused(
            node, "launch", {"spec": {**sleeper("y", tmp_path / "no"), "command": ["nope-x"]}})
        # remove: only what was launched
        assert "the config owns it" in refused(node, "remove", {"engine": "e0"})
        assert "`unregister` it" in refused(node, "remove", {"engine": "r0"})
        assert "no engine 'zz' on this node" in refused(node, "remove", {"engine": "zz"})
        node.client.call("unregister", {"engine": "r0"})
    finally:
        outsider.kill()
        outsider.wait()
    # nothing refused was kept or launched
    assert {e["id"] for e in node.status()["engines"]} == {"e0", "x1", "x2"}
    kept = json.loads((node.state_dir / "launched.json").read_text())["engines"]
    assert sorted(kept) == ["x1", "x2"]
    # while the daemon stops (x2 takes its whole grace), nothing is launched or removed
    assert node.proc is not None
    node.proc.send_signal(signal.SIGTERM)
    node.wait_state("x2", "stopping")
    assert "the daemon is stopping" in refused(
        node, "launch", {"spec": sleeper("y", tmp_path / "no")})
    assert "the daemon is stopping" in refused(node, "remove", {"engine": "x1"})
    assert node.proc.wait(timeout=30) == 0
    kept = json.loads((node.state_dir / "launched.json").read_text())["engines"]
    assert sorted(kept) == ["x1", "x2"]


def test_launched_engine_is_supervised_adopted_and_removed(make_node: MakeNode) -> None:
    node = make_node([]).start()
    table = emulator_spec("x0", gpus=[3], restart={"max_restarts": 3})
    launch(node, table)
    first = node.wait_state("x0", "healthy", timeout=60)
    assert (first["incarnation"], first["origin"], first["gpus"]) == (1, "launched", [3])

    # an engine SIGKILLed: relaunched, same port and GPUs, a new incarnation
    os.kill(first["pid"], signal.SIGKILL)
    second = node.wait_state("x0", "healthy", incarnation=2, timeout=60)
    assert second["last_failure"]["cause"] == "exited" and second["restarts"] == 1
    assert (second["url"], second["ports"], second["gpus"]) == (
        first["url"], first["ports"], first["gpus"])

    # the daemon SIGKILLed: the next one adopts the same process, same incarnation ...
    node.kill_daemon()
    assert not pid_gone(second["pid"])
    node.start()
    adopted = node.wait_state("x0", "healthy", incarnation=2)
    assert (adopted["pid"], adopted["origin"]) == (second["pid"], "launched")
    assert node.wait_event("x0", kind="adopted")["incarnation"] == 2
    # ... and still supervises it
    os.kill(adopted["pid"], signal.SIGKILL)
    third = node.wait_state("x0", "healthy", incarnation=3, timeout=60)

    # remove: the whole tree, then forgotten
    tree = [psutil.Process(third["pid"]), *psutil.Process(third["pid"]).children(True)]
    assert len(tree) >= 2   # the emulator's scheduler child
    answer = node.client.call("remove", {"engine": "x0", "wait_s": 20}, timeout_s=25)
    assert answer == {"engine": "x0", "action": "stopped and forgotten"}
    assert all(pid_gone(p.pid) for p in tree)
    assert node.status()["engines"] == []
    assert node.wait_event("x0", kind="removed")["incarnation"] == 3
    # ... and not brought back by a restart, even after a SIGKILL
    node.kill_daemon()
    node.start()
    assert node.status()["engines"] == []


def test_a_launched_engine_comes_back_after_a_clean_stop_until_the_config_takes_its_id(
        make_node: MakeNode, tmp_path: Path) -> None:
    node = make_node([]).start()
    launch(node, sleeper("x0", tmp_path / "x0.env", gpus=[1]))
    launch(node, sleeper("x1", tmp_path / "x1.env"))
    first = node.wait_state("x0", "healthy")
    assert seen_env(tmp_path / "x0.env") == "1"
    assert node.stop_daemon() == 0
    assert pid_gone(first["pid"])
    (tmp_path / "x0.env").unlink()
    node.start()
    again = node.wait_state("x0", "healthy")   # launched again, as a configured one would be
    assert again["incarnation"] == 2 and again["origin"] == "launched"
    assert seen_env(tmp_path / "x0.env") == "1"
    assert node.stop_daemon() == 0

    # the config now lists an engine x0: it wins, and the log says so
    configured = EngineSpec("x0", command=[sys.executable, "-c", "import time; time.sleep(600)"],
                            extra={"probe": {"health_path": ""}})
    node2 = make_node([configured], node_id="test-node")
    node2.state_dir = node.state_dir
    node2.config_path.write_text(node2.config_path.read_text().replace(
        str(node2.tmp / "state"), str(node.state_dir)))
    node2.start()
    assert node2.wait_state("x0", "healthy")["origin"] == "config"
    assert node2.wait_state("x1", "healthy")["origin"] == "launched"
    wait_for(lambda: "launched engine x0 is dropped: the config wins" in node2.log_text(), 10,
             "the log line")
    kept = json.loads((node.state_dir / "launched.json").read_text())["engines"]
    assert sorted(kept) == ["x1"]
