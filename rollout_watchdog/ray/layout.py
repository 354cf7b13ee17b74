"""Where a Ray node's watchdog keeps its things, and the node config it runs with: pure
functions of the node id and the directories `start` was given (no ray import, testable alone).

Every Ray node gets its own directory, control socket and ports, even when several Ray nodes
share one host (a test `Cluster`): everything is keyed by the Ray node id.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollout_watchdog.common.validate import bracket_host

# The node config keys `start(node_config=...)` may not set: the deployment owns them.
OWNED_KEYS = frozenset({"node_id", "coordinator", "key", "coordinator_key", "control",
                        "state_dir", "metrics_port", "metrics_host", "lifeline_pid", "engine"})


@dataclass(frozen=True)
class NodeLayout:
    """The paths of one Ray node's watchdog."""

    node_id: str
    node_dir: Path       # state_dir/<namespace>/node-<id>: config, keys, the daemon's state
    log_dir: Path        # the daemon's log and its engines' logs (`ray logs` finds them)
    control: str         # ipc://...: short, since a Unix socket path holds 107 bytes

    @classmethod
    def of(cls, node_id: str, state_root: str | os.PathLike[str],
           log_root: str | os.PathLike[str], namespace: str) -> NodeLayout:
        node_dir = Path(state_root) / namespace / f"node-{node_id}"
        digest = hashlib.sha256(str(node_dir).encode()).hexdigest()[:20]
        sockets = Path(tempfile.gettempdir()) / f"rollout-watchdog-{os.getuid()}"
        return cls(node_id, node_dir, Path(log_root) / "rollout_watchdog" / namespace
                   / f"node-{node_id}", f"ipc://{sockets}/{digest}.control")

    @property
    def state_dir(self) -> Path:
        return self.node_dir / "state"

    @property
    def config_path(self) -> Path:
        return self.node_dir / "node.toml"

    @property
    def keys_dir(self) -> Path:
        return self.node_dir / "keys"

    @property
    def daemon_log(self) -> Path:
        return self.log_dir / "daemon.log"

    @property
    def spawn_lock(self) -> Path:
        return self.node_dir / "spawn.lock"

    def prepare(self) -> None:
        """Make the directories (0700: the keys and the control socket are there), and send
        the engines' log files (state_dir/logs) to the log directory."""
        for folder in (self.node_dir, self.state_dir, self.log_dir,
                       Path(self.control[len("ipc://"):]).parent):
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        logs = self.state_dir / "logs"
        if not logs.exists() and not logs.is_symlink():
            logs.symlink_to(self.log_dir, target_is_directory=True)


def free_port(host: str) -> int:
    """A TCP port free on `host` now (the OS's pick)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def node_config(layout: NodeLayout, *, coordinator: str, metrics_host: str, metrics_port: int,
                lifeline_pid: int, key: str | None = None, coordinator_key: str | None = None,
                extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The node config (`rollout-watchdog run --config`) of one Ray node's daemon: no engine
    (they are launched at run time), output to files, and the raylet as its lifeline."""
    if extra and (owned := sorted(OWNED_KEYS & set(extra))):
        raise ValueError(f"node_config may not set {', '.join(owned)}: the Ray deployment "
                         "sets them")
    config: dict[str, Any] = {
        "node_id": layout.node_id, "coordinator": coordinator,
        "control": layout.control, "state_dir": str(layout.state_dir),
        "metrics_host": metrics_host, "metrics_port": metrics_port,
        "engine_log": "file", "containment": "subreaper", "lifeline_pid": lifeline_pid,
        **(extra or {})}
    if key is not None:
        config["key"], config["coordinator_key"] = key, coordinator_key
    return config


def to_toml(config: Mapping[str, Any]) -> str:
    """TOML of a config of strings, numbers, booleans, lists of those and tables of those
    (what a node config holds); JSON's string escapes are TOML's."""
    lines, tables = [], []
    for key, value in config.items():
        if isinstance(value, Mapping):
            tables.append(f"\n[{key}]\n" + to_toml(value))
        else:
            lines.append(f"{key} = {_value(value)}\n")
    return "".join(lines) + "".join(tables)


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float, str)):
        return json.dumps(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    raise ValueError(f"cannot write {value!r} in a node config")


def tcp_endpoint(host: str, port: int) -> str:
    return f"tcp://{bracket_host(host)}:{port}"
