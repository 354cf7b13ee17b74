"""The pure parts of engines launched at run time: the conflict rule, the engine's environment,
one [[engine]] table read by the config's rules, and the file that keeps the specs."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from rollout_watchdog import EngineSpec
from rollout_watchdog.common.states import EngineState
from rollout_watchdog.config import (
    ConfigError,
    EngineConfig,
    NodeConfig,
    ProbeConfig,
    RestartConfig,
    parse_config,
    read_engine,
)
from rollout_watchdog.refit_bridge.views import EngineView
from rollout_watchdog.watchdog.engine import EngineRuntime
from rollout_watchdog.watchdog.engine_env import engine_environment
from rollout_watchdog.watchdog.launched import LaunchedSpecs, conflicts, restore
from rollout_watchdog.watchdog.runtime_engines import remove


def cfg(engine_id: str, port: int, *, gpus: tuple[int, ...] = (), ports: tuple[int, ...] = (),
        env: dict[str, str] | None = None) -> EngineConfig:
    return EngineConfig(id=engine_id, url=f"http://127.0.0.1:{port}", command=("x",),
                        gpus=gpus, env=env or {}, ports=tuple(sorted({port, *ports})))


def table(engine_id: str, port: int, **extra: Any) -> dict[str, Any]:
    return {"id": engine_id, "url": f"http://127.0.0.1:{port}", "command": ["x"], **extra}


# ---------------------------------------------------------------------- conflicts


def test_conflicts_name_the_other_engine() -> None:
    configured = EngineRuntime(cfg=cfg("e0", 30000, gpus=(0, 1), ports=(31000,)))
    registered = EngineRuntime(cfg=EngineConfig(id="r0", url="http://127.0.0.1:30005",
                                                command=()), external=True)
    launched = EngineRuntime(cfg=cfg("x0", 30010, gpus=(4,)), launched=True)
    others = [configured, registered, launched]
    assert conflicts(cfg("x1", 30020, gpus=(2, 3)), others) == []
    assert conflicts(cfg("e0", 30020), others) == [
        "engine id e0 is already on this node (config engine e0, stopped)"]
    assert conflicts(cfg("r0", 30020), others)[0].startswith(
        "engine id r0 is already on this node (registered engine r0")
    assert conflicts(cfg("x0", 30020), others)[0].startswith(
        "engine id x0 is already on this node (launched engine x0")
    assert conflicts(cfg("x1", 30000), others) == [
        "port 30000 is already in engine e0's url (http://127.0.0.1:30000)"]
    assert conflicts(cfg("x1", 30020, ports=(31000,)), others) == [
        "port 31000 is already one of engine e0's ports"]
    # a registered engine's port is its url's, though it declares no ports
    assert conflicts(cfg("x1", 30005), others) == [
        "port 30005 is already in engine r0's url (http://127.0.0.1:30005)"]
    assert conflicts(cfg("x1", 30020, gpus=(1, 4)), others) == [
        "GPU 1 is already in engine e0's gpus", "GPU 4 is already in engine x0's gpus"]
    assert conflicts(cfg("x1", 30020, ports=(9100,)), others, metrics_port=9100) == [
        "port 9100 is the node's metrics_port"]


# ---------------------------------------------------------------------- environment


@pytest.mark.parametrize(("daemon", "gpus", "env", "expected"), [
    ({"CUDA_VISIBLE_DEVICES": ""}, (0, 1), {}, "0,1"),          # Ray's empty value: replaced
    ({"CUDA_VISIBLE_DEVICES": ""}, (), {}, None),                # ... or dropped
    ({"CUDA_VISIBLE_DEVICES": " "}, (), {}, None),
    ({"CUDA_VISIBLE_DEVICES": "3,4"}, (1,), {}, "1"),           # the spec's GPUs, never ours
    ({"CUDA_VISIBLE_DEVICES": "3,4"}, (), {}, "3,4"),           # an operator's confinement
    ({}, (), {}, None),
    ({}, (2,), {"CUDA_VISIBLE_DEVICES": "2"}, "2"),
    ({"CUDA_VISIBLE_DEVICES": ""}, (), {"CUDA_VISIBLE_DEVICES": "GPU-abc"}, "GPU-abc"),
])
def test_an_engine_gets_exactly_its_gpus(daemon: dict[str, str], gpus: tuple[int, ...],
                                         env: dict[str, str], expected: str | None) -> None:
    got = engine_environment({"PATH": "/bin", "NOTIFY_SOCKET": "/run/x", **daemon},
                             cfg("e0", 1, gpus=gpus, env=env))
    assert got.get("CUDA_VISIBLE_DEVICES") == expected
    assert got["PATH"] == "/bin" and "NOTIFY_SOCKET" not in got


# ---------------------------------------------------------------------- one table


def test_one_table_is_read_by_the_config_rules_with_the_node_defaults() -> None:
    probe, restart = ProbeConfig(health_interval_s=7.0), RestartConfig(grace_s=3.0)
    engine = read_engine(EngineSpec("x0", "http://127.0.0.1:30001", ["python", "--port",
                                                                      "30001"], gpus=[2],
                                    restart={"max_restarts": 9}).to_table(),
                         probe, restart)
    assert (engine.gpus, engine.ports, engine.probe.health_interval_s) == ((2,), (30001,), 7.0)
    assert (engine.restart.grace_s, engine.restart.max_restarts) == (3.0, 9)
    bad = table("x0", 30001, gpus=[-1], tp_size=0, colour="red", probe={"health_path": "x"})
    with pytest.raises(ConfigError) as caught:
        read_engine(bad, probe, restart, check_commands=False)
    with pytest.raises(ConfigError) as whole_file:
        parse_config({"engine": [bad]}, check_commands=False)
    assert caught.value.problems == whole_file.value.problems   # check-config's very words
    assert any("key 'gpus'" in p for p in caught.value.problems)
    assert any("unknown key 'colour'" in p for p in caught.value.problems)
    with pytest.raises(ConfigError, match="engine #1: must be a table"):
        read_engine(["x"], probe, restart)


# ---------------------------------------------------------------------- the file


def node_config(*engines: EngineConfig) -> NodeConfig:
    return NodeConfig(node_id="n", engines=engines)


def test_specs_are_kept_restored_and_the_config_wins(tmp_path: Path,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    specs = LaunchedSpecs(tmp_path / "launched.json")
    specs.put("x0", table("x0", 30001, gpus=[1]))
    specs.put("x1", table("x1", 30002))
    specs.put("x2", table("x2", 30003, gpus="one"))     # no longer valid (written by hand)
    specs.drop("nope")
    configured = {"x1": EngineRuntime(cfg=cfg("x1", 40000)),
                  "e0": EngineRuntime(cfg=cfg("e0", 40001, gpus=(1,)))}
    fresh = LaunchedSpecs(tmp_path / "launched.json")
    assert restore(fresh, node_config(), configured) == []
    assert set(configured) == {"x1", "e0"}
    assert "launched engine x0 is dropped: the config wins (GPU 1 is already in engine e0's" \
        in caplog.text
    assert "launched engine x1 is dropped: the config wins" in caplog.text
    assert "launched engine x2 is dropped, its spec is no longer valid" in caplog.text
    assert json.loads((tmp_path / "launched.json").read_text())["engines"] == {}

    fresh.put("x3", table("x3", 30004))
    engines: dict[str, EngineRuntime] = {}
    [x3] = restore(LaunchedSpecs(tmp_path / "launched.json"), node_config(), engines)
    assert engines == {"x3": x3} and x3.launched and x3.origin == "launched"


def test_an_unreadable_file_is_set_aside(tmp_path: Path, caplog: pytest.LogCaptureFixture
                                         ) -> None:
    path = tmp_path / "launched.json"
    path.write_text("{not json")
    assert LaunchedSpecs(path).load() == {}
    assert (tmp_path / "launched.json.corrupt").exists() and not path.exists()
    assert "is unusable" in caplog.text


def test_an_engine_view_of_an_older_node_has_an_origin() -> None:
    view = EngineView.from_json("n", True, {"id": "e0", "state": "healthy"})
    assert view.origin == "config"
    assert EngineView.from_json("n", True, {"id": "r", "external": True}).origin == "registered"
    assert EngineView.from_json("n", True, {"id": "x", "origin": "launched"}).origin == \
        "launched"


# ---------------------------------------------------------------------- remove


class _KillEndsAsItBegins:
    """The node as `remove` sees it when the engine's processes exit on the SIGTERM before the
    kill's first check (a fast engine, or one already dead): the engine is forgotten at once."""

    def __init__(self, engine: EngineRuntime) -> None:
        self.engines = {engine.cfg.id: engine}
        self.launched = SimpleNamespace(drop=lambda engine_id: None, path=Path("launched.json"))

    def start_kill(self, engine: EngineRuntime, *args: Any, **extra: Any) -> None:
        del self.engines[engine.cfg.id]


def test_a_remove_that_waits_says_stopped_and_forgotten_even_when_the_kill_ends_at_once() -> None:
    """Seen in the suite: `remove --wait` answered "stopping, then forgotten" (the answer of a
    remove that does not wait) when the engine was gone by the time the kill began."""
    engine = EngineRuntime(cfg=cfg("x0", 30010), launched=True, state=EngineState.HEALTHY)
    node: Any = _KillEndsAsItBegins(engine)
    assert remove(node, {"engine": "x0", "wait_s": 30.0}) == {
        "engine": "x0", "action": "stopped and forgotten"}
    engine = EngineRuntime(cfg=cfg("x1", 30011), launched=True, state=EngineState.HEALTHY)
    node = _KillEndsAsItBegins(engine)
    assert remove(node, {"engine": "x1", "wait_s": None}) == {
        "engine": "x1", "action": "stopping, then forgotten"}
