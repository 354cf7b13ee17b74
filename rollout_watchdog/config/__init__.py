"""The node config (TOML), validated into typed objects.

Validation collects every problem instead of stopping at the first, so an operator fixes a broken
file in one pass; each problem is one line that names the engine and the key.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollout_watchdog.common.validate import (
    check_engine_id,
    endpoint_problem,
    ipc_problem,
    shown,
)
from rollout_watchdog.config.checker import Checker, type_name
from rollout_watchdog.config.engine_argv import command_found, command_ports, flag_port, url_port

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

DEFAULT_CONTROL = "ipc:///run/rollout-watchdog/control"

DEFAULT_STATE_DIR = "/var/lib/rollout-watchdog"
RESTART_POLICIES = ("immediate", "deferred")
GPU_CHECKS = ("auto", "nvml", "none")
ENGINE_LOGS = ("auto", "file", "journal")
# How every process of an engine incarnation is kept findable: a delegated cgroup v2 per
# incarnation, or the subreaper and the environment marker; auto: cgroup under systemd.
CONTAINMENTS = ("auto", "cgroup", "subreaper")
MAX_GPU_INDEX = 1023
DEFAULT_ENGINE_LOG_MAX_BYTES = 100 * 1024 * 1024
DEFAULT_ENGINE_LOG_BACKUPS = 2

MAX_FAILURE_THRESHOLD = 1000
MAX_RESTARTS = 10_000


def toml_value(text: str) -> Any:
    """`text` read as a TOML value (2, 0.5, true, "x"), or the text itself where it is none
    (/health): a config setting given on a command line."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


class ConfigError(Exception):
    """A config that cannot be used; `problems` holds one readable line per problem."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


@dataclass(frozen=True)
class ProbeConfig:
    """How an engine is watched. Times in seconds."""

    liveness_interval_s: float = 1.0
    health_path: str = "/health_generate"
    health_interval_s: float = 5.0
    health_timeout_s: float = 30.0
    failure_threshold: int = 3
    startup_timeout_s: float = 1800.0
    # Progress probe (off unless progress_path is set, e.g. "/metrics" with --enable-metrics):
    # a token counter that does not advance for progress_timeout_s while requests run.
    progress_path: str = ""
    progress_timeout_s: float = 120.0


@dataclass(frozen=True)
class RestartConfig:
    """How an engine is killed and brought back. Times in seconds."""

    grace_s: float = 30.0
    backoff_initial_s: float = 1.0
    backoff_max_s: float = 60.0
    max_restarts: int = 5
    window_s: float = 600.0
    stable_s: float = 300.0
    kill_timeout_s: float = 10.0
    release_timeout_s: float = 60.0


@dataclass(frozen=True)
class EngineConfig:
    """One engine of the node, with its probe and restart settings already merged."""

    id: str
    url: str
    command: tuple[str, ...]
    gpus: tuple[int, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    ports: tuple[int, ...] = ()
    restart_policy: str = "immediate"
    group: str | None = None
    tp_size: int | None = None           # ranks in the weight-update group (None: ask /server_info)
    cwd: str | None = None
    probe: ProbeConfig = field(default_factory=ProbeConfig)
    restart: RestartConfig = field(default_factory=RestartConfig)


@dataclass(frozen=True)
class NodeConfig:
    node_id: str
    engines: tuple[EngineConfig, ...]
    coordinator: str | None = None
    key: str | None = None               # CURVE: this node's keypair (NODE.key_secret) ...
    coordinator_key: str | None = None   # ... and the coordinator's public key
    control: str = DEFAULT_CONTROL
    state_dir: str = DEFAULT_STATE_DIR
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    gpu_check: str = "auto"
    # Where engine output goes: "journal" (journald's stream socket), "file"
    # (state_dir/logs/ID.log, rotated at engine_log_max_bytes), or "auto" (journal under systemd).
    engine_log: str = "auto"
    engine_log_max_bytes: int = DEFAULT_ENGINE_LOG_MAX_BYTES
    engine_log_backups: int = DEFAULT_ENGINE_LOG_BACKUPS
    containment: str = "auto"
    # The pid of a process whose end means "stop every engine and exit" (under Ray: the
    # node's raylet, so that nothing outlives its Ray node). None: no such process.
    lifeline_pid: int | None = None
    probe: ProbeConfig = field(default_factory=ProbeConfig)
    restart: RestartConfig = field(default_factory=RestartConfig)


def _read_probe(problems: list[str], where: str, table: object, base: ProbeConfig) -> ProbeConfig:
    if not isinstance(table, dict):
        problems.append(f"{where}must be a table, got {type_name(table)}")
        return base
    c = Checker(problems, where, table)
    c.unknown({f.name for f in dataclasses.fields(ProbeConfig)})
    return ProbeConfig(
        liveness_interval_s=c.seconds("liveness_interval_s", base.liveness_interval_s),
        health_path=c.url_path("health_path", base.health_path, off="to turn deep probes off"),
        progress_path=c.url_path("progress_path", base.progress_path,
                                 off="for no progress probe"),
        progress_timeout_s=c.seconds("progress_timeout_s", base.progress_timeout_s),
        health_interval_s=c.seconds("health_interval_s", base.health_interval_s),
        health_timeout_s=c.seconds("health_timeout_s", base.health_timeout_s),
        failure_threshold=c.integer("failure_threshold", base.failure_threshold, minimum=1,
                                    maximum=MAX_FAILURE_THRESHOLD) or base.failure_threshold,
        startup_timeout_s=c.seconds("startup_timeout_s", base.startup_timeout_s),
    )


def _read_restart(problems: list[str], where: str, table: object,
                  base: RestartConfig) -> RestartConfig:
    if not isinstance(table, dict):
        problems.append(f"{where}must be a table, got {type_name(table)}")
        return base
    c = Checker(problems, where, table)
    c.unknown({f.name for f in dataclasses.fields(RestartConfig)})
    max_restarts = c.integer("max_restarts", base.max_restarts, minimum=0, maximum=MAX_RESTARTS)
    restart = RestartConfig(
        grace_s=c.seconds("grace_s", base.grace_s, zero_ok=True),
        backoff_initial_s=c.seconds("backoff_initial_s", base.backoff_initial_s, zero_ok=True),
        backoff_max_s=c.seconds("backoff_max_s", base.backoff_max_s, zero_ok=True),
        max_restarts=base.max_restarts if max_restarts is None else max_restarts,
        window_s=c.seconds("window_s", base.window_s),
        stable_s=c.seconds("stable_s", base.stable_s),
        kill_timeout_s=c.seconds("kill_timeout_s", base.kill_timeout_s),
        release_timeout_s=c.seconds("release_timeout_s", base.release_timeout_s),
    )
    backoff = {"backoff_initial_s", "backoff_max_s"}
    if not backoff & c.failed and restart.backoff_max_s < restart.backoff_initial_s:
        c.problem("backoff_max_s", f"must be >= backoff_initial_s ({restart.backoff_initial_s}), "
                                   f"got {restart.backoff_max_s}")
    if backoff & c.failed:  # both from the base, so engines inheriting them agree with the rule
        restart = dataclasses.replace(restart, backoff_initial_s=base.backoff_initial_s,
                                      backoff_max_s=base.backoff_max_s)
    return restart


def _env_problem(env: dict[str, str]) -> str | None:
    """What no process environment can hold (None: nothing)."""
    for key, value in env.items():
        if not key or "=" in key or "\0" in key:
            return f"has a variable name no environment can hold: {key!r}"
        if "\0" in value:
            return f"{key}'s value holds a NUL character"
    return None


def _read_engine(problems: list[str], index: int, table: object, probe: ProbeConfig,
                 restart: RestartConfig, check_commands: bool) -> EngineConfig | None:
    if not isinstance(table, dict):
        problems.append(f"engine #{index + 1}: must be a table, got {type_name(table)}")
        return None
    raw_id = table.get("id")
    if problem := check_engine_id(raw_id):
        problems.append(f"engine #{index + 1}: key 'id' {problem}")
        engine_id = f"#{index + 1}"
    else:
        engine_id = str(raw_id)
    where = f"engine '{engine_id}': "
    c = Checker(problems, where, table)
    c.unknown({"id", "url", "command", "gpus", "env", "ports", "restart_policy", "group", "cwd",
               "tp_size", "probe", "restart"})

    url = table.get("url")
    if url is None:
        problems.append(f"{where}missing key 'url'")
    elif not isinstance(url, str) or url_port(url) is None:
        c.problem("url", f"must be an http URL with a host, like http://127.0.0.1:30000, "
                         f"got {url!r}")
        url = None

    command = table.get("command")
    if command is None:
        problems.append(f"{where}missing key 'command'")
    elif (not isinstance(command, list) or not command
          or not all(isinstance(a, str) for a in command)):
        c.problem("command", "must be a non-empty list of strings (the argv)")
        command = None
    elif any("\0" in a for a in command):   # (the kernel's argv cannot hold one)
        c.problem("command", "holds a NUL character")
        command = None

    env = table.get("env", {})
    if not isinstance(env, dict) or not all(isinstance(v, str) for v in env.values()):
        c.problem("env", "must be a table of string values")
        env = {}
    elif problem := _env_problem(env):   # (the launch would fail, for good)
        c.problem("env", problem)
        env = {}
    if command and check_commands and not command_found(command[0], env):
        c.problem("command", f"names a program that is not found: {command[0]!r}")

    gpus = c.int_list("gpus", maximum=MAX_GPU_INDEX)
    if len(set(gpus)) < len(gpus):
        c.problem("gpus", f"names a GPU twice: {list(gpus)}")
    ports = c.int_list("ports", maximum=65535)
    policy = c.string("restart_policy", "immediate", choices=RESTART_POLICIES) or "immediate"
    group = c.string("group", None)
    tp_size = c.integer("tp_size", None, minimum=1)
    cwd = c.string("cwd", None)
    if cwd is not None and "\0" in cwd:
        c.problem("cwd", "holds a NUL character")
        cwd = None
    engine_probe = _read_probe(problems, f"engine '{engine_id}' [probe]: ",
                               table.get("probe", {}), probe)
    engine_restart = _read_restart(problems, f"engine '{engine_id}' [restart]: ",
                                   table.get("restart", {}), restart)
    port_flag = flag_port(tuple(command), "--port") if command else None
    if url is not None and port_flag is not None and url_port(url) != port_flag:
        c.problem("url", f"port {url_port(url)} differs from the command's --port {port_flag}: "
                         "probes would never reach the engine")
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if gpus and visible is not None and visible.replace(" ", "") != ",".join(map(str, gpus)):
        c.problem("gpus", f"{list(gpus)} disagrees with env CUDA_VISIBLE_DEVICES={visible!r}: "
                          "the GPU release check would watch the wrong GPUs")
    if url is None or command is None:
        return None
    all_ports = sorted({url_port(url) or 0, *command_ports(tuple(command)), *ports} - {0})
    return EngineConfig(id=engine_id, url=url.rstrip("/"), command=tuple(command), gpus=gpus,
                        env=dict(env), ports=tuple(all_ports), restart_policy=policy,
                        group=group, tp_size=tp_size, cwd=cwd, probe=engine_probe,
                        restart=engine_restart)


def read_engine(table: object, probe: ProbeConfig, restart: RestartConfig, *,
                check_commands: bool = True) -> EngineConfig:
    """One `[[engine]]` table (an engine launched at run time), validated by the config
    file's own rules and merged with the node's `probe`/`restart` defaults; ConfigError with
    every problem, each naming the field as check-config does."""
    problems: list[str] = []
    engine = _read_engine(problems, 0, table, probe, restart, check_commands)
    if problems or engine is None:
        raise ConfigError(problems or ["engine #1: unusable"])
    return engine


def _node_id(c: Checker) -> str:
    """The node id: also the ZMQ routing id towards a coordinator without CURVE (at most 255
    bytes), and the NODE of the fleet's NODE/ENGINE names (so no '/')."""
    default = socket.gethostname()
    node_id = c.name("node_id", default)
    if (any(ch.isspace() for ch in node_id) or "/" in node_id
            or len(node_id.encode()) > 255):
        c.problem("node_id", "must be at most 255 bytes without spaces or '/', got "
                             f"{shown(node_id)}")
        return default
    return node_id


def _control(c: Checker) -> str:
    """The control endpoint: a Unix socket file, since its only protection is its mode (0600)."""
    control = c.string("control", DEFAULT_CONTROL) or DEFAULT_CONTROL
    if not control.startswith("ipc://"):
        # Remote control goes through the coordinator, which authenticates.
        c.problem("control", f"must be an ipc:// path (the local control socket has no "
                             f"authentication), got {shown(control)}")
    elif problem := ipc_problem(control[len("ipc://"):], local=True):
        c.problem("control", problem)
    else:
        return control
    return DEFAULT_CONTROL


def _curve_keys(c: Checker, coordinator: str | None, *, check_files: bool
                ) -> tuple[str | None, str | None]:
    """CURVE on the node link: both key files or neither, only with a coordinator."""
    key, coordinator_key = c.string("key", None), c.string("coordinator_key", None)
    if (key is None) != (coordinator_key is None):
        c.problem("coordinator_key" if key else "key", "is needed too: CURVE takes the node's "
                  "keypair (key) and the coordinator's public key (coordinator_key)")
    if key is not None and coordinator is None:
        c.problem("key", "is set, but there is no 'coordinator' to use it with")
    for name, path in (("key", key), ("coordinator_key", coordinator_key)):
        if check_files and path is not None and not os.access(path, os.R_OK):
            c.problem(name, f"{path!r} is not a readable file (rollout-watchdog keygen makes "
                            "one)")
    return key, coordinator_key


def parse_config(data: dict[str, Any], *, check_commands: bool = True) -> NodeConfig:
    """Validate a parsed TOML document; raise ConfigError listing every problem."""
    problems: list[str] = []
    c = Checker(problems, "", data)
    c.unknown({"node_id", "coordinator", "key", "coordinator_key", "control", "state_dir",
               "metrics_port", "metrics_host",
               "gpu_check", "engine_log", "engine_log_max_bytes", "engine_log_backups",
               "containment", "lifeline_pid", "probe", "restart", "engine"})
    node_id = _node_id(c)
    coordinator = c.string("coordinator", None)
    if coordinator is not None and (problem := endpoint_problem(coordinator)):
        c.problem("coordinator", problem)
    key, coordinator_key = _curve_keys(c, coordinator, check_files=check_commands)
    control = _control(c)
    state_dir = c.name("state_dir", DEFAULT_STATE_DIR)
    engine_log = c.string("engine_log", "auto", choices=ENGINE_LOGS) or "auto"
    engine_log_max_bytes = c.integer("engine_log_max_bytes", DEFAULT_ENGINE_LOG_MAX_BYTES,
                                     minimum=64 * 1024) or DEFAULT_ENGINE_LOG_MAX_BYTES
    engine_log_backups = c.integer("engine_log_backups", DEFAULT_ENGINE_LOG_BACKUPS, minimum=0,
                                   maximum=100)
    if engine_log_backups is None:
        engine_log_backups = DEFAULT_ENGINE_LOG_BACKUPS
    metrics_port = c.integer("metrics_port", None, minimum=1, maximum=65535)
    metrics_host = c.string("metrics_host", "127.0.0.1") or "127.0.0.1"
    gpu_check = c.string("gpu_check", "auto", choices=GPU_CHECKS) or "auto"
    containment = c.string("containment", "auto", choices=CONTAINMENTS) or "auto"
    lifeline_pid = c.integer("lifeline_pid", None, minimum=1)
    probe = _read_probe(problems, "[probe]: ", data.get("probe", {}), ProbeConfig())
    restart = _read_restart(problems, "[restart]: ", data.get("restart", {}), RestartConfig())

    raw_engines = data.get("engine", [])
    if not isinstance(raw_engines, list):
        problems.append("key 'engine' must be an array of tables ([[engine]])")
        raw_engines = []
    engines = [e for i, t in enumerate(raw_engines)
               if (e := _read_engine(problems, i, t, probe, restart, check_commands))]

    if metrics_port is not None:
        for engine in engines:
            if metrics_port in engine.ports:
                c.problem("metrics_port", f"{metrics_port} is also a port of engine "
                                          f"'{engine.id}'")
    seen_ids: set[str] = set()
    port_owner: dict[int, str] = {}
    gpu_owner: dict[int, str] = {}
    for engine in engines:
        if engine.id in seen_ids:
            problems.append(f"engine '{engine.id}': duplicate engine id")
        seen_ids.add(engine.id)
        for port in engine.ports:
            if port in port_owner and port_owner[port] != engine.id:
                problems.append(f"engine '{engine.id}': port {port} is also used by engine "
                                f"'{port_owner[port]}'")
            port_owner.setdefault(port, engine.id)
        for gpu in engine.gpus:
            if gpu in gpu_owner and gpu_owner[gpu] != engine.id:
                problems.append(f"engine '{engine.id}': GPU {gpu} is also used by engine "
                                f"'{gpu_owner[gpu]}'")
            gpu_owner.setdefault(gpu, engine.id)
    if problems:
        raise ConfigError(problems)
    return NodeConfig(node_id=node_id, engines=tuple(engines), coordinator=coordinator,
                      key=key, coordinator_key=coordinator_key, control=control,
                      state_dir=state_dir, metrics_port=metrics_port,
                      metrics_host=metrics_host, gpu_check=gpu_check, engine_log=engine_log,
                      engine_log_max_bytes=engine_log_max_bytes,
                      engine_log_backups=engine_log_backups, containment=containment,
                      lifeline_pid=lifeline_pid, probe=probe, restart=restart)


def load_config(path: str | Path, *, check_commands: bool = True) -> NodeConfig:
    """Read and validate a config file; every problem line is prefixed with the file name."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except OSError as exc:
        raise ConfigError([f"{path}: cannot read: {exc.strerror or exc}"]) from exc
    except UnicodeDecodeError as exc:
        raise ConfigError([f"{path}: not UTF-8 text: {exc.reason}"]) from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError([f"{path}: invalid TOML: {exc}"]) from None
    try:
        return parse_config(data, check_commands=check_commands)
    except ConfigError as exc:
        raise ConfigError([f"{path}: {p}" for p in exc.problems]) from None
