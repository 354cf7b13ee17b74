"""The node config (TOML) of DESIGN.md and `rollout-watchdog check-config`.

Every user mistake must come back as exactly one readable line that names the engine and the
key, and the CLI must exit non-zero with those lines on stderr and no traceback.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from rollout_watchdog.config import (
    DEFAULT_CONTROL,
    DEFAULT_STATE_DIR,
    ConfigError,
    EngineConfig,
    NodeConfig,
    ProbeConfig,
    RestartConfig,
    check_engine_id,
    load_config,
    parse_config,
)
from rollout_watchdog.config.engine_argv import command_ports

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "systemd" / "config.example.toml"
# A program that exists on every machine running these tests, as a TOML string.
PY = json.dumps(sys.executable)



def engine_of(config: NodeConfig, engine_id: str) -> EngineConfig:
    found = [e for e in config.engines if e.id == engine_id]
    if not found:
        raise KeyError(engine_id)
    return found[0]

def engine_toml(eid: str = "e0", port: int = 30000, gpus: tuple[int, ...] = (0,),
                extra: str = "", nccl: int | None = None) -> str:
    """One [[engine]] table; `extra` lines go into the engine table itself."""
    argv = [sys.executable, "-m", "sglang.launch_server", "--port", str(port)]
    if nccl is not None:
        argv += ["--nccl-port", str(nccl)]
    return (f'\n[[engine]]\nid = "{eid}"\nurl = "http://127.0.0.1:{port}"\n'
            f"command = {json.dumps(argv)}\n"
            f"gpus = [{', '.join(str(g) for g in gpus)}]\n{extra}\n")


def write(tmp_path: Path, text: str, name: str = "node.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def problems(tmp_path: Path, text: str, *, check_commands: bool = True) -> list[str]:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(path, check_commands=check_commands)
    lines = info.value.problems
    for line in lines:
        assert "\n" not in line
        assert line.startswith(f"{path}: "), line
    return [line[len(f"{path}: "):] for line in lines]


def one_problem(tmp_path: Path, text: str, *fragments: str) -> str:
    lines = problems(tmp_path, text)
    assert len(lines) == 1, lines
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "rollout_watchdog", *args],
                          capture_output=True, text=True, timeout=120, cwd=REPO)


# ------------------------------------------------------------------ a valid config

FULL = f"""
node_id = "gpu-node-17"
coordinator = "tcp://10.0.0.5:5555"
control = "ipc:///tmp/rw-test/control"
state_dir = "/tmp/rw-test/state"
metrics_port = 9400
metrics_host = "0.0.0.0"
gpu_check = "none"

[probe]
liveness_interval_s = 0.5
health_path = "/health"
health_interval_s = 2.0
health_timeout_s = 25.0
failure_threshold = 4
startup_timeout_s = 900.0

[restart]
grace_s = 15.0
backoff_initial_s = 2.0
backoff_max_s = 30.0
max_restarts = 7
window_s = 300.0
stable_s = 120.0
kill_timeout_s = 8.0
release_timeout_s = 45.0

[[engine]]
id = "e0"
url = "http://127.0.0.1:30000"
command = [{PY}, "-m", "sglang.launch_server", "--model-path", "/models/m", "--port", "30000",
           "--nccl-port", "30100"]
gpus = [0, 1]
env = {{ SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION = "false", OMP_NUM_THREADS = "4" }}

[[engine]]
id = "e1"
url = "http://127.0.0.1:30001/"
command = [{PY}, "-m", "sglang.launch_server", "--port=30001", "--nccl-port=30101"]
gpus = [2, 3]
ports = [30201]
restart_policy = "deferred"
group = "tp-group-a"
cwd = "/tmp"

[engine.probe]
health_path = ""
health_interval_s = 10.0
failure_threshold = 5

[engine.restart]
grace_s = 60.0
max_restarts = 0
"""


def test_full_config_is_read_with_every_key(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, FULL))
    assert isinstance(config, NodeConfig)
    assert config.node_id == "gpu-node-17"
    assert config.coordinator == "tcp://10.0.0.5:5555"
    assert config.control == "ipc:///tmp/rw-test/control"
    assert config.state_dir == "/tmp/rw-test/state"
    assert config.metrics_port == 9400
    assert config.metrics_host == "0.0.0.0"
    assert config.gpu_check == "none"
    assert config.probe == ProbeConfig(liveness_interval_s=0.5, health_path="/health",
                                       health_interval_s=2.0, health_timeout_s=25.0,
                                       failure_threshold=4, startup_timeout_s=900.0)
    assert config.restart == RestartConfig(grace_s=15.0, backoff_initial_s=2.0,
                                           backoff_max_s=30.0, max_restarts=7, window_s=300.0,
                                           stable_s=120.0, kill_timeout_s=8.0,
                                           release_timeout_s=45.0)
    assert [e.id for e in config.engines] == ["e0", "e1"]


def test_engine_without_overrides_gets_the_node_defaults(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, FULL))
    e0 = engine_of(config, "e0")
    assert e0.url == "http://127.0.0.1:30000"
    assert e0.command == (sys.executable, "-m", "sglang.launch_server", "--model-path",
                          "/models/m", "--port", "30000", "--nccl-port", "30100")
    assert e0.gpus == (0, 1)
    assert e0.env == {"SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "false",
                      "OMP_NUM_THREADS": "4"}
    assert e0.ports == (30000, 30100)
    assert e0.restart_policy == "immediate"
    assert e0.group is None and e0.cwd is None
    assert e0.probe == config.probe
    assert e0.restart == config.restart


def test_engine_overrides_apply_on_top_of_the_node_defaults(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, FULL))
    e1 = engine_of(config, "e1")
    assert e1.url == "http://127.0.0.1:30001"  # trailing slash dropped
    assert e1.ports == (30001, 30101, 30201)
    assert e1.restart_policy == "deferred"
    assert e1.group == "tp-group-a"
    assert e1.cwd == "/tmp"
    assert e1.env == {}
    # Overridden keys take the engine's value, every other key the node's [probe]/[restart]
    # (not the built-in defaults).
    assert e1.probe == ProbeConfig(liveness_interval_s=0.5, health_path="",
                                   health_interval_s=10.0, health_timeout_s=25.0,
                                   failure_threshold=5, startup_timeout_s=900.0)
    assert e1.restart == RestartConfig(grace_s=60.0, backoff_initial_s=2.0, backoff_max_s=30.0,
                                       max_restarts=0, window_s=300.0, stable_s=120.0,
                                       kill_timeout_s=8.0, release_timeout_s=45.0)
    with pytest.raises(KeyError):
        engine_of(config, "e2")


def test_minimal_config_takes_the_design_defaults(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, engine_toml(gpus=())))
    assert config.node_id == socket.gethostname()
    assert config.coordinator is None
    assert config.control == DEFAULT_CONTROL == "ipc:///run/rollout-watchdog/control"
    assert config.state_dir == DEFAULT_STATE_DIR == "/var/lib/rollout-watchdog"
    assert config.metrics_port is None
    assert config.gpu_check == "auto"
    assert config.probe == ProbeConfig(liveness_interval_s=1.0, health_path="/health_generate",
                                       health_interval_s=5.0, health_timeout_s=30.0,
                                       failure_threshold=3, startup_timeout_s=1800.0)
    restart = config.restart
    assert (restart.grace_s, restart.backoff_initial_s, restart.backoff_max_s,
            restart.max_restarts, restart.window_s) == (30.0, 1.0, 60.0, 5, 600.0)
    (engine,) = config.engines
    assert engine.probe == config.probe and engine.restart == config.restart
    assert engine.restart_policy == "immediate"
    assert engine.gpus == () and engine.env == {}


def test_a_node_without_engines_is_valid(tmp_path: Path) -> None:
    assert load_config(write(tmp_path, 'node_id = "empty"\n')).engines == ()


def test_integers_are_accepted_for_durations(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, "[probe]\nhealth_timeout_s = 40\n" + engine_toml()))
    assert config.probe.health_timeout_s == 40.0
    assert engine_of(config, "e0").probe.health_timeout_s == 40.0


def test_example_config_validates(tmp_path: Path) -> None:
    # It names `python -m sglang...`, which need not exist here.
    config = load_config(EXAMPLE, check_commands=False)
    assert config.node_id == "gpu-node-17"
    assert config.metrics_port == 9400
    e0, e1 = config.engines
    assert (e0.id, e0.gpus, e0.ports, e0.restart_policy) == ("e0", (0, 1, 2, 3),
                                                             (30000, 30100), "immediate")
    assert (e1.id, e1.gpus, e1.ports, e1.restart_policy) == ("e1", (4, 5, 6, 7),
                                                             (30001, 30101), "deferred")
    assert e1.probe.failure_threshold == 5 and e1.probe.startup_timeout_s == 3600.0
    assert e1.probe.health_timeout_s == config.probe.health_timeout_s
    assert e0.probe == config.probe


def test_parse_config_takes_a_parsed_document() -> None:
    config = parse_config({"node_id": "n", "engine": [
        {"id": "a", "url": "http://127.0.0.1:31000", "command": [sys.executable]}]})
    assert engine_of(config, "a").ports == (31000,)
    with pytest.raises(ConfigError) as info:
        parse_config({"node_id": "n", "bogus": 1})
    # Without a file there is no file prefix.
    assert info.value.problems == ["unknown key 'bogus'"]
    assert str(info.value) == "unknown key 'bogus'"


def test_command_path_is_looked_up_in_the_engine_env_path(tmp_path: Path) -> None:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    program = bindir / "my-engine"
    program.write_text("#!/bin/sh\n")
    program.chmod(0o755)
    text = ('[[engine]]\nid = "e0"\nurl = "http://127.0.0.1:30000"\n'
            f'command = ["my-engine"]\nenv = {{ PATH = "{bindir}" }}\n')
    assert engine_of(load_config(write(tmp_path, text)), "e0").command == ("my-engine",)


# ------------------------------------------------------------------ one line per problem

# (test id, config text, fragments the single problem line must contain)
PROBLEMS: list[tuple[str, str, tuple[str, ...]]] = [
    # unknown keys
    ("unknown-top-level", 'nodeid = "x"\n' + engine_toml(), ("unknown key 'nodeid'",)),
    ("unknown-probe", "[probe]\nhealth_intervall_s = 5.0\n" + engine_toml(),
     ("[probe]", "unknown key 'health_intervall_s'")),
    ("unknown-restart", "[restart]\nbackoff_s = 5.0\n" + engine_toml(),
     ("[restart]", "unknown key 'backoff_s'")),
    ("unknown-engine", engine_toml(extra="gpu = [1]"), ("engine 'e0'", "unknown key 'gpu'")),
    ("unknown-engine-probe", engine_toml() + "[engine.probe]\ntimeout = 3.0\n",
     ("engine 'e0' [probe]", "unknown key 'timeout'")),
    ("unknown-engine-restart", engine_toml() + "[engine.restart]\nretries = 3\n",
     ("engine 'e0' [restart]", "unknown key 'retries'")),
    # wrong types
    ("string-for-number", '[probe]\nhealth_timeout_s = "30"\n' + engine_toml(),
     ("[probe]", "'health_timeout_s'", "number", "string")),
    ("string-for-number-engine", engine_toml() + '[engine.restart]\ngrace_s = "30s"\n',
     ("engine 'e0' [restart]", "'grace_s'", "number", "string")),
    ("bool-for-number", "[probe]\nhealth_interval_s = true\n" + engine_toml(),
     ("'health_interval_s'", "number", "boolean")),
    ("bool-for-int", "[restart]\nmax_restarts = true\n" + engine_toml(),
     ("[restart]", "'max_restarts'", "integer", "boolean")),
    ("bool-for-int-engine", engine_toml() + "[engine.probe]\nfailure_threshold = false\n",
     ("engine 'e0' [probe]", "'failure_threshold'", "integer", "boolean")),
    ("float-for-int", "[probe]\nfailure_threshold = 2.5\n" + engine_toml(),
     ("'failure_threshold'", "integer")),
    ("string-for-metrics-port", 'metrics_port = "9400"\n' + engine_toml(),
     ("'metrics_port'", "integer", "string")),
    ("metrics-port-range", "metrics_port = 70000\n" + engine_toml(),
     ("'metrics_port'", "70000")),
    ("number-for-node-id", "node_id = 17\n" + engine_toml(), ("'node_id'", "string")),
    ("gpus-string", engine_toml().replace("gpus = [0]", 'gpus = "0,1"'),
     ("engine 'e0'", "'gpus'", "list of integers")),
    ("gpus-mixed", engine_toml().replace("gpus = [0]", 'gpus = [0, "1"]'),
     ("engine 'e0'", "'gpus'", "list of integers")),
    ("gpus-bool", engine_toml().replace("gpus = [0]", "gpus = [true]"),
     ("engine 'e0'", "'gpus'", "list of integers")),
    ("gpus-negative", engine_toml().replace("gpus = [0]", "gpus = [-1]"),
     ("engine 'e0'", "'gpus'", "-1")),
    ("command-string", '[[engine]]\nid = "e0"\nurl = "http://127.0.0.1:30000"\n'
     'command = "python -m sglang.launch_server"\n', ("engine 'e0'", "'command'", "list")),
    ("command-empty", '[[engine]]\nid = "e0"\nurl = "http://127.0.0.1:30000"\ncommand = []\n',
     ("engine 'e0'", "'command'", "non-empty")),
    ("command-not-strings", '[[engine]]\nid = "e0"\nurl = "http://127.0.0.1:30000"\n'
     f'command = [{PY}, "--port", 30000]\n', ("engine 'e0'", "'command'", "strings")),
    ("env-int-value", engine_toml(extra="env = { OMP_NUM_THREADS = 4 }"),
     ("engine 'e0'", "'env'", "string")),
    ("env-not-table", engine_toml(extra='env = "A=1"'), ("engine 'e0'", "'env'")),
    # what no process can be given (check-config said OK, and `run` crashed at the launch)
    ("env-key-with-equals", engine_toml(extra='env = { "A=B" = "1" }'),
     ("engine 'e0'", "'env'", "'A=B'")),
    ("env-empty-key", engine_toml(extra='env = { "" = "1" }'), ("engine 'e0'", "'env'", "''")),
    ("env-nul-value", engine_toml(extra='env = { A = "x\\u0000y" }'),
     ("engine 'e0'", "'env'", "A's value holds a NUL")),
    ("cwd-nul", engine_toml(extra='cwd = "/tmp\\u0000x"'), ("engine 'e0'", "'cwd'", "NUL")),
    ("gpus-twice", engine_toml(gpus=(0, 0)), ("engine 'e0'", "'gpus'", "names a GPU twice")),
    ("ports-not-ints", engine_toml(extra='ports = ["30100"]'),
     ("engine 'e0'", "'ports'", "list of integers")),
    ("ports-range", engine_toml(extra="ports = [70000]"), ("engine 'e0'", "'ports'", "70000")),
    ("probe-not-table", "probe = 5\n" + engine_toml(), ("[probe]", "table")),
    ("engine-not-array", '[engine]\nid = "e0"\n', ("'engine'", "array of tables")),
    ("group-not-string", engine_toml(extra="group = 3"), ("engine 'e0'", "'group'", "string")),
    # missing keys
    ("missing-command", '[[engine]]\nid = "e0"\nurl = "http://127.0.0.1:30000"\n',
     ("engine 'e0'", "missing key 'command'")),
    ("missing-url", f'[[engine]]\nid = "e0"\ncommand = [{PY}]\n',
     ("engine 'e0'", "missing key 'url'")),
    ("missing-id", f'[[engine]]\nurl = "http://127.0.0.1:30000"\ncommand = [{PY}]\n',
     ("engine #1", "'id'")),
    ("bad-id", f'[[engine]]\nid = "e 0"\nurl = "http://127.0.0.1:30000"\ncommand = [{PY}]\n',
     ("engine #1", "'id'", "'e 0'")),
    # bad url
    ("url-no-scheme", engine_toml().replace('"http://127.0.0.1:30000"', '"127.0.0.1:30000"'),
     ("engine 'e0'", "'url'", "127.0.0.1:30000")),
    ("url-no-host", engine_toml().replace('"http://127.0.0.1:30000"', '"http://:30000"'),
     ("engine 'e0'", "'url'")),
    ("url-port-range", engine_toml().replace('"http://127.0.0.1:30000"',
                                             '"http://127.0.0.1:99999"'),
     ("engine 'e0'", "'url'", "99999")),
    ("url-ftp", engine_toml().replace('"http://127.0.0.1:30000"', '"ftp://127.0.0.1:30000"'),
     ("engine 'e0'", "'url'")),
    ("url-not-string", engine_toml().replace('"http://127.0.0.1:30000"', "30000"),
     ("engine 'e0'", "'url'")),
    # clashes between engines
    ("duplicate-id", engine_toml() + engine_toml(),
     ("engine 'e0'", "duplicate engine id")),
    ("same-url-port", engine_toml("e0", 30000, (0,)) + engine_toml("e1", 30000, (1,)),
     ("engine 'e1'", "port 30000", "'e0'")),
    ("same-nccl-port", engine_toml("e0", 30000, (0,), nccl=30100)
     + engine_toml("e1", 30001, (1,), nccl=30100),
     ("engine 'e1'", "port 30100", "'e0'")),
    ("nccl-port-on-url-port", engine_toml("e0", 30000, (0,))
     + engine_toml("e1", 30001, (1,), nccl=30000),
     ("engine 'e1'", "port 30000", "'e0'")),
    ("ports-list-clash", engine_toml("e0", 30000, (0,), extra="ports = [30500]")
     + engine_toml("e1", 30001, (1,), extra="ports = [30500]"),
     ("engine 'e1'", "port 30500", "'e0'")),
    ("overlapping-gpus", engine_toml("e0", 30000, (0, 1)) + engine_toml("e1", 30001, (1, 2)),
     ("engine 'e1'", "GPU 1", "'e0'")),
    # command not found
    ("command-not-found", '[[engine]]\nid = "e0"\nurl = "http://127.0.0.1:30000"\n'
     'command = ["no-such-sglang-launcher-xyz", "--port", "30000"]\n',
     ("engine 'e0'", "'command'", "not found", "no-such-sglang-launcher-xyz")),
    ("command-missing-path", '[[engine]]\nid = "e0"\nurl = "http://127.0.0.1:30000"\n'
     'command = ["/nonexistent/bin/python"]\n',
     ("engine 'e0'", "'command'", "/nonexistent/bin/python")),
    ("command-is-directory", '[[engine]]\nid = "e0"\nurl = "http://127.0.0.1:30000"\n'
     'command = ["/tmp"]\n', ("engine 'e0'", "'command'", "'/tmp'")),
    # nonsense bounds
    ("health-timeout-zero", "[probe]\nhealth_timeout_s = 0\n" + engine_toml(),
     ("[probe]", "'health_timeout_s'", "> 0")),
    ("health-timeout-negative", engine_toml() + "[engine.probe]\nhealth_timeout_s = -5.0\n",
     ("engine 'e0' [probe]", "'health_timeout_s'", "-5")),
    ("health-interval-zero", "[probe]\nhealth_interval_s = 0.0\n" + engine_toml(),
     ("'health_interval_s'", "> 0")),
    ("liveness-interval-zero", "[probe]\nliveness_interval_s = 0\n" + engine_toml(),
     ("'liveness_interval_s'", "> 0")),
    ("startup-timeout-negative", "[probe]\nstartup_timeout_s = -1\n" + engine_toml(),
     ("'startup_timeout_s'",)),
    ("failure-threshold-zero", "[probe]\nfailure_threshold = 0\n" + engine_toml(),
     ("[probe]", "'failure_threshold'", "0")),
    ("failure-threshold-zero-engine", engine_toml() + "[engine.probe]\nfailure_threshold = 0\n",
     ("engine 'e0' [probe]", "'failure_threshold'")),
    ("backoff-max-below-initial", "[restart]\nbackoff_initial_s = 10.0\nbackoff_max_s = 5.0\n"
     + engine_toml(), ("[restart]", "'backoff_max_s'", "backoff_initial_s")),
    ("backoff-max-below-initial-engine",
     engine_toml() + "[engine.restart]\nbackoff_initial_s = 120.0\n",
     ("engine 'e0' [restart]", "'backoff_max_s'", "backoff_initial_s")),
    ("negative-grace", "[restart]\ngrace_s = -1.0\n" + engine_toml(),
     ("[restart]", "'grace_s'", ">= 0")),
    ("negative-backoff-max", "[restart]\nbackoff_max_s = -1.0\n" + engine_toml(),
     ("[restart]", "'backoff_max_s'", ">= 0")),
    ("negative-backoff-initial", "[restart]\nbackoff_initial_s = -1.0\n" + engine_toml(),
     ("'backoff_initial_s'", ">= 0")),
    ("window-zero", "[restart]\nwindow_s = 0\n" + engine_toml(),
     ("[restart]", "'window_s'", "> 0")),
    ("max-restarts-negative", "[restart]\nmax_restarts = -1\n" + engine_toml(),
     ("'max_restarts'", "-1")),
    ("kill-timeout-zero", "[restart]\nkill_timeout_s = 0\n" + engine_toml(),
     ("'kill_timeout_s'",)),
    ("release-timeout-zero", engine_toml() + "[engine.restart]\nrelease_timeout_s = 0\n",
     ("engine 'e0' [restart]", "'release_timeout_s'")),
    ("stable-zero", "[restart]\nstable_s = 0\n" + engine_toml(), ("'stable_s'",)),
    # bad choices
    ("bad-restart-policy", engine_toml(extra='restart_policy = "later"'),
     ("engine 'e0'", "'restart_policy'", "immediate", "deferred", "'later'")),
    ("bad-health-path", "[probe]\nhealth_path = \"health_generate\"\n" + engine_toml(),
     ("[probe]", "'health_path'", "'/'")),
    ("bad-health-path-engine", engine_toml() + "[engine.probe]\nhealth_path = \"generate\"\n",
     ("engine 'e0' [probe]", "'health_path'")),
    ("health-path-number", "[probe]\nhealth_path = 5\n" + engine_toml(),
     ("'health_path'", "string")),
    ("bad-gpu-check", 'gpu_check = "cuda"\n' + engine_toml(),
     ("'gpu_check'", "auto", "'cuda'")),
    ("bad-control", 'control = "/run/rollout-watchdog/control"\n' + engine_toml(),
     ("'control'", "ipc://")),
]


@pytest.mark.parametrize(("text", "fragments"), [(t, f) for _, t, f in PROBLEMS],
                         ids=[name for name, _, _ in PROBLEMS])
def test_each_problem_is_one_line_naming_engine_and_key(tmp_path: Path, text: str,
                                                        fragments: tuple[str, ...]) -> None:
    one_problem(tmp_path, text, *fragments)


@pytest.mark.parametrize("restart", [
    "grace_s = -1.0", "backoff_max_s = -1.0", "backoff_initial_s = 10.0\nbackoff_max_s = 5.0",
    "backoff_initial_s = -1.0\nbackoff_max_s = 0.5", "backoff_initial_s = nan\nbackoff_max_s = 0.5",
    "backoff_max_s = inf", "grace_s = nan", "window_s = nan"])
def test_a_bad_node_default_is_not_blamed_on_every_engine(tmp_path: Path, restart: str) -> None:
    text = (f"[restart]\n{restart}\n" + engine_toml("e0", 30000, (0,))
            + engine_toml("e1", 30001, (1,)))
    lines = problems(tmp_path, text)
    assert len(lines) == 1, lines
    assert lines[0].startswith("[restart]: ")


def test_command_path_that_is_not_executable(tmp_path: Path) -> None:
    program = tmp_path / "launch.sh"
    program.write_text("#!/bin/sh\nexec true\n")
    program.chmod(0o644)
    text = (f'[[engine]]\nid = "e0"\nurl = "http://127.0.0.1:30000"\n'
            f'command = ["{program}"]\n')
    one_problem(tmp_path, text, "engine 'e0'", "'command'", str(program))
    program.chmod(program.stat().st_mode | stat.S_IXUSR)
    assert engine_of(load_config(tmp_path / "node.toml"), "e0").command == (str(program),)


def test_command_check_can_be_turned_off(tmp_path: Path) -> None:
    text = ('[[engine]]\nid = "e0"\nurl = "http://127.0.0.1:30000"\n'
            'command = ["no-such-sglang-launcher-xyz"]\n')
    path = write(tmp_path, text)
    with pytest.raises(ConfigError):
        load_config(path)
    assert engine_of(load_config(path, check_commands=False), "e0").command == (
        "no-such-sglang-launcher-xyz",)


def test_invalid_toml_is_one_line_with_its_position(tmp_path: Path) -> None:
    text = 'node_id = "gpu-node-17"\n[[engine]\nid = "e0"\n'
    line = one_problem(tmp_path, text, "invalid TOML", "line 2")
    assert "Traceback" not in line


def test_duplicate_keys_are_invalid_toml(tmp_path: Path) -> None:
    one_problem(tmp_path, 'node_id = "a"\nnode_id = "b"\n', "invalid TOML")


def test_missing_file_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "absent.toml"
    with pytest.raises(ConfigError) as info:
        load_config(path)
    (line,) = info.value.problems
    assert str(path) in line and "cannot read" in line and "No such file" in line


def test_directory_instead_of_file_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path)
    (line,) = info.value.problems
    assert str(tmp_path) in line and "cannot read" in line


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads a file whatever its mode")
def test_unreadable_file_is_one_line(tmp_path: Path) -> None:
    path = write(tmp_path, engine_toml())
    path.chmod(0)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    (line,) = info.value.problems
    assert str(path) in line and "cannot read" in line


def test_binary_file_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "node.toml"
    path.write_bytes(b"node_id = \"\xff\xfe\"\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    (line,) = info.value.problems
    assert str(path) in line and "UTF-8" in line


MANY = ("nodeid = 'x'\n"
        "[probe]\nhealth_timeout_s = 0\n"
        "[restart]\nbackoff_initial_s = 10.0\nbackoff_max_s = 5.0\n"
        + engine_toml("e0", 30000, (0, 1))
        + engine_toml("e1", 30000, (1,), extra='restart_policy = "sometimes"')
        + '[[engine]]\nid = "e2"\ncommand = ["no-such-sglang-launcher-xyz"]\n'
        + '[engine.probe]\nfailure_threshold = "3"\n')


def test_several_problems_are_all_reported(tmp_path: Path) -> None:
    lines = problems(tmp_path, MANY)
    expected = [
        ("unknown key 'nodeid'",),
        ("[probe]", "'health_timeout_s'"),
        ("[restart]", "'backoff_max_s'"),
        ("engine 'e1'", "'restart_policy'"),
        ("engine 'e2'", "missing key 'url'"),
        ("engine 'e2'", "'command'", "not found"),
        ("engine 'e2' [probe]", "'failure_threshold'"),
        ("engine 'e1'", "port 30000"),
        ("engine 'e1'", "GPU 1"),
    ]
    assert len(lines) == len(expected), lines
    for fragments in expected:
        assert any(all(f in line for f in fragments) for line in lines), (fragments, lines)


# ------------------------------------------------------------------ ports from the argv


@pytest.mark.parametrize(("argv", "ports"), [
    (["python", "-m", "sglang.launch_server", "--port", "30000"], [30000]),
    (["python", "-m", "sglang.launch_server", "--port=30000"], [30000]),
    (["python", "--nccl-port", "30100"], [30100]),
    (["python", "--nccl-port=30100"], [30100]),
    (["python", "--port", "30000", "--tp-size", "4", "--nccl-port", "30100"], [30000, 30100]),
    (["python", "--nccl-port=30101", "--port=30001"], [30101, 30001]),
    (["python", "--model-path", "/m", "--tp-size", "2"], []),
    (["python", "--port"], []),                       # a flag without a value
    (["python", "--port", "--nccl-port", "30100"], [30100]),
    (["python", "--port", "auto"], []),
    (["python", "--port-range", "30000"], []),       # another flag
    (["python", "--dist-init-addr", "10.0.0.1:30000"], []),
])
def test_command_ports(argv: list[str], ports: list[int]) -> None:
    assert command_ports(tuple(argv)) == ports


# ------------------------------------------------------------------ the CLI


def test_cli_check_config_ok(tmp_path: Path) -> None:
    path = write(tmp_path, FULL)
    result = run_cli("check-config", str(path))
    assert result.returncode == 0, result.stderr
    assert "OK" in result.stdout
    assert "e0" in result.stdout and "e1" in result.stdout
    assert "Traceback" not in result.stderr


CLI_CASES: list[tuple[str, str]] = [
    ("invalid-toml", 'node_id = "x"\n[[engine]\n'),
    ("unknown-key", 'nodeid = "x"\n' + engine_toml()),
    ("wrong-type", '[probe]\nhealth_timeout_s = "30"\n' + engine_toml()),
    ("missing-url", f'[[engine]]\nid = "e0"\ncommand = [{PY}]\n'),
    ("port-clash", engine_toml("e0", 30000, (0,)) + engine_toml("e1", 30000, (1,))),
    ("command-not-found", '[[engine]]\nid = "e0"\nurl = "http://127.0.0.1:30000"\n'
     'command = ["no-such-sglang-launcher-xyz"]\n'),
    ("nonsense-bound", "[probe]\nfailure_threshold = 0\n" + engine_toml()),
    ("many", MANY),
]


@pytest.mark.parametrize("text", [t for _, t in CLI_CASES], ids=[n for n, _ in CLI_CASES])
def test_cli_check_config_reports_problems_on_stderr(tmp_path: Path, text: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    result = run_cli("check-config", str(path))
    assert result.returncode != 0
    assert result.stdout == ""
    assert "Traceback" not in result.stderr
    assert result.stderr.splitlines() == info.value.problems


def test_cli_check_config_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "absent.toml"
    result = run_cli("check-config", str(path))
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    (line,) = result.stderr.splitlines()
    assert str(path) in line and "cannot read" in line


def test_cli_check_config_example_names_only_the_missing_program() -> None:
    """The example is valid except, on a machine without `python` on PATH, for its command."""
    result = run_cli("check-config", str(EXAMPLE))
    assert "Traceback" not in result.stderr
    if result.returncode == 0:
        assert "OK" in result.stdout
    else:
        lines = result.stderr.splitlines()
        assert lines and all("'command'" in line and "not found" in line for line in lines)


def test_url_port_must_match_the_commands_port(tmp_path: Path) -> None:
    text = engine_toml(port=30000).replace('url = "http://127.0.0.1:30000"',
                                           'url = "http://127.0.0.1:30005"')
    one_problem(tmp_path, text, "engine 'e0'", "key 'url'", "port 30005",
                "--port 30000")


def test_gpus_must_agree_with_cuda_visible_devices(tmp_path: Path) -> None:
    one_problem(tmp_path, engine_toml(gpus=(0,), extra='env = { CUDA_VISIBLE_DEVICES = "3" }'),
                "engine 'e0'", "key 'gpus'", "CUDA_VISIBLE_DEVICES='3'")


def test_metrics_port_must_not_be_an_engine_port(tmp_path: Path) -> None:
    one_problem(tmp_path, "metrics_port = 30000\n" + engine_toml(port=30000),
                "key 'metrics_port'", "engine 'e0'")


def test_the_control_socket_must_be_local(tmp_path: Path) -> None:
    one_problem(tmp_path, 'control = "tcp://0.0.0.0:31950"\n', "key 'control'", "ipc://",
                "no authentication")


# ------------------------------------------------------------------ bounds that keep supervision on

# Every duration key, with the bound its message must name.
TIMING_BOUNDS = {
    "liveness_interval_s": "86400 (1 day)", "health_interval_s": "86400 (1 day)",
    "health_timeout_s": "86400 (1 day)", "startup_timeout_s": "604800 (7 days)",
    "progress_timeout_s": "86400 (1 day)", "grace_s": "86400 (1 day)",
    "backoff_initial_s": "86400 (1 day)", "backoff_max_s": "86400 (1 day)",
    "window_s": "2592000 (30 days)", "stable_s": "604800 (7 days)",
    "kill_timeout_s": "86400 (1 day)", "release_timeout_s": "86400 (1 day)",
}
PROBE_KEYS = {f.name for f in dataclasses.fields(ProbeConfig)}


def test_every_duration_key_has_a_bound() -> None:
    durations = {f.name for cls in (ProbeConfig, RestartConfig)
                 for f in dataclasses.fields(cls) if f.type == "float"}
    assert durations == set(TIMING_BOUNDS)


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "+nan", "1e10", "above"])
@pytest.mark.parametrize("key", sorted(TIMING_BOUNDS))
@pytest.mark.parametrize("level", ["node", "engine"])
def test_durations_must_be_finite_and_bounded(tmp_path: Path, key: str, value: str,
                                              level: str) -> None:
    """nan switched supervision off (never probed, backoff forever); 1e10 overflowed the probe."""
    bound = TIMING_BOUNDS[key]
    if value == "above":
        value = str(float(bound.split()[0]) + 0.5)
    table = "probe" if key in PROBE_KEYS else "restart"
    if level == "node":
        text, where = f"[{table}]\n{key} = {value}\n" + engine_toml(), f"[{table}]: "
    else:
        text = engine_toml() + f"[engine.{table}]\n{key} = {value}\n"
        where = f"engine 'e0' [{table}]: "
    line = one_problem(tmp_path, text, f"key '{key}'")
    assert line.startswith(where), line
    if value != "-inf":  # below the lower bound first
        assert "finite" in line and bound in line, line


@pytest.mark.parametrize("key", sorted(TIMING_BOUNDS))
def test_durations_at_their_bound_are_accepted(tmp_path: Path, key: str) -> None:
    bound = float(TIMING_BOUNDS[key].split()[0])
    table = "probe" if key in PROBE_KEYS else "restart"
    extra = "backoff_max_s = 86400\n" if key == "backoff_initial_s" else ""
    config = load_config(write(tmp_path, f"[{table}]\n{key} = {bound}\n{extra}" + engine_toml()))
    assert getattr(getattr(config.engines[0], table), key) == bound


@pytest.mark.parametrize(("table", "key", "value", "bound"), [
    ("probe", "failure_threshold", 1001, "between 1 and 1000"),
    ("restart", "max_restarts", 10_001, "between 0 and 10000"),
    ("restart", "max_restarts", 2**62, "between 0 and 10000"),
])
def test_counts_are_bounded(tmp_path: Path, table: str, key: str, value: int,
                            bound: str) -> None:
    one_problem(tmp_path, f"[{table}]\n{key} = {value}\n" + engine_toml(), f"[{table}]",
                f"key '{key}'", bound, str(value))


# ------------------------------------------------------------------ names, paths, endpoints


def test_the_control_path_must_fit_a_unix_socket_address(tmp_path: Path) -> None:
    """`run` died with a raw ZMQError on a path over 107 bytes; check-config must refuse it."""
    longest = "/tmp/" + "c" * (107 - len("/tmp/"))
    config = load_config(write(tmp_path, f'control = "ipc://{longest}"\n'))
    assert config.control == f"ipc://{longest}"
    one_problem(tmp_path, f'control = "ipc://{longest}c"\n', "key 'control'", "108 bytes", "107")
    # The limit counts bytes, not characters.
    one_problem(tmp_path, f'control = "ipc://{longest[:-1]}é"\n', "key 'control'", "108 bytes")


def test_the_control_socket_must_not_be_abstract(tmp_path: Path) -> None:
    one_problem(tmp_path, 'control = "ipc://@rollout-watchdog"\n', "key 'control'", "abstract",
                "0600")


@pytest.mark.parametrize("control", ["ipc://", "ipc:///tmp/a\\u0000b", "ipc:///tmp/a\\nb"])
def test_the_control_path_must_be_a_usable_name(tmp_path: Path, control: str) -> None:
    one_problem(tmp_path, f'control = "{control}"\n', "key 'control'")


@pytest.mark.parametrize("coordinator", [
    "tcp://10.0.0.5:5555", "tcp://head-node.cluster.local:1", "tcp://[::1]:65535",
    "tcp://[fe80::1]:5555", "ipc:///run/rollout-watchdog/coordinator", "ipc://@coordinator",
])
def test_coordinator_endpoints_that_are_accepted(tmp_path: Path, coordinator: str) -> None:
    assert load_config(write(tmp_path, f'coordinator = "{coordinator}"\n')).coordinator == (
        coordinator)


@pytest.mark.parametrize("coordinator", [
    "", "10.0.0.5:5555", "http://10.0.0.5:5555", "tcp://10.0.0.5", "tcp://10.0.0.5:0",
    "tcp://10.0.0.5:65536", "tcp://10.0.0.5:port", "tcp://:5555", "tcp://*:5555",
    "tcp://[not-ipv6]:5555", "tcp://host name:5555", "tcp://-bad-.host:5555",
    "tcp://10.0.0.5:5555/path", "tcp://10.0.0.5:\\u0661\\u0662", "ipc://", "udp://10.0.0.5:5555",
    "ipc:///" + "x" * 120,
])
def test_coordinator_must_be_a_zmq_endpoint(tmp_path: Path, coordinator: str) -> None:
    one_problem(tmp_path, f'coordinator = "{coordinator}"\n', "key 'coordinator'")


@pytest.mark.parametrize(("key", "value"), [
    ("node_id", ""), ("node_id", "gpu node 17"), ("node_id", "gpu-node\\n17"),
    ("node_id", "n" * 256), ("node_id", "gpu-node-17\\u202e"), ("state_dir", ""),
    ("state_dir", "/var/lib/rw\\r\\n"),
])
def test_node_id_and_state_dir_must_be_usable_names(tmp_path: Path, key: str,
                                                    value: str) -> None:
    one_problem(tmp_path, f'{key} = "{value}"\n' + engine_toml(), f"key '{key}'")


@pytest.mark.parametrize("key", ["health_path", "progress_path"])
@pytest.mark.parametrize("path", ["/health generate", "/health\\r\\nX-Injected: 1", "/h\\tx",
                                  "health", "/h\\u00e9", "/h\\u0000"])
def test_probe_paths_must_fit_on_the_request_line(tmp_path: Path, key: str, path: str) -> None:
    one_problem(tmp_path, f'[probe]\n{key} = "{path}"\n' + engine_toml(), "[probe]",
                f"key '{key}'", "printable ASCII")


def test_probe_paths_with_a_query_are_accepted(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, '[probe]\nhealth_path = "/health?deep=1"\n'
                                         'progress_path = "/metrics"\n'))
    assert (config.probe.health_path, config.probe.progress_path) == ("/health?deep=1",
                                                                     "/metrics")


@pytest.mark.parametrize("gpus", ["[99999999]", "[1024]", "[0, 2000, 3000]"])
def test_gpu_indices_are_bounded(tmp_path: Path, gpus: str) -> None:
    line = one_problem(tmp_path, engine_toml().replace("gpus = [0]", f"gpus = {gpus}"),
                       "engine 'e0'", "key 'gpus'", "0 to 1023")
    assert "[0," not in line  # names only the bad values


def test_the_highest_gpu_index_is_accepted(tmp_path: Path) -> None:
    assert load_config(write(tmp_path, engine_toml(gpus=(1023,)))).engines[0].gpus == (1023,)


@pytest.mark.parametrize("engine_id", ["e0\\n", "e0 ", " e0", "e\\u202e0", "--all", "a/../../b",
                                       "../e0", "e" * 65, "", "-e0", ".e0"])
def test_engine_ids_outside_the_rule_are_refused(tmp_path: Path, engine_id: str) -> None:
    text = engine_toml().replace('id = "e0"', f'id = "{engine_id}"')
    one_problem(tmp_path, text, "engine #1", "key 'id'")


@pytest.mark.parametrize("engine_id", [
    "e0\n", "e0 ", "e\u202e0", "--all", "a/../../b", "x" * 60_000, "", 7, None, ["e0"]])
def test_check_engine_id_names_the_problem(engine_id: object) -> None:
    problem = check_engine_id(engine_id)
    assert problem is not None and "letters, digits" in problem
    assert "\n" not in problem and len(problem) < 200  # one short line, even for 60,000 chars


@pytest.mark.parametrize("engine_id", ["e0", "E", "0", "gpu-node-17.e_3", "e" * 64])
def test_check_engine_id_accepts_the_rule(engine_id: str) -> None:
    assert check_engine_id(engine_id) is None


# ------------------------------------------------------------------ engine logs


def test_engine_log_defaults(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, engine_toml()))
    assert (config.engine_log, config.engine_log_max_bytes, config.engine_log_backups) == (
        "auto", 100 * 1024 * 1024, 2)


def test_engine_log_keys_are_read(tmp_path: Path) -> None:
    text = 'engine_log = "file"\nengine_log_max_bytes = 65536\nengine_log_backups = 0\n'
    config = load_config(write(tmp_path, text))
    assert (config.engine_log, config.engine_log_max_bytes, config.engine_log_backups) == (
        "file", 65536, 0)


@pytest.mark.parametrize(("line", "fragments"), [
    ('engine_log = "syslog"', ("'engine_log'", "auto", "file", "journal", "'syslog'")),
    ("engine_log_max_bytes = 65535", ("'engine_log_max_bytes'", ">= 65536")),
    ('engine_log_max_bytes = "100M"', ("'engine_log_max_bytes'", "integer")),
    ("engine_log_backups = 101", ("'engine_log_backups'", "between 0 and 100")),
    ("engine_log_backups = -1", ("'engine_log_backups'", "between 0 and 100")),
])
def test_engine_log_keys_are_checked(tmp_path: Path, line: str,
                                     fragments: tuple[str, ...]) -> None:
    one_problem(tmp_path, line + "\n" + engine_toml(), *fragments)


def test_curve_keys_for_the_node_link(tmp_path: Path) -> None:
    """DESIGN's node config: `coordinator` plus, for CURVE, `key` and `coordinator_key`."""
    secret, public = tmp_path / "n.key_secret", tmp_path / "coordinator.key"
    secret.write_text("x")
    public.write_text("x")
    base = {"coordinator": "tcp://10.0.0.5:5555", "engine": []}
    config = parse_config({**base, "key": str(secret), "coordinator_key": str(public)})
    assert (config.key, config.coordinator_key) == (str(secret), str(public))
    with pytest.raises(ConfigError, match="'coordinator_key' is needed too"):
        parse_config({**base, "key": str(secret)})
    with pytest.raises(ConfigError, match="'key' is set, but there is no 'coordinator'"):
        parse_config({"engine": [], "key": str(secret), "coordinator_key": str(public)})
    with pytest.raises(ConfigError, match="not a readable file"):
        parse_config({**base, "key": str(tmp_path / "missing"), "coordinator_key": str(public)})
