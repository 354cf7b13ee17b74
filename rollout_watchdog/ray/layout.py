"""Where a Ray node's watchdog keeps its things, and the node config it runs with: pure
functions of the node id and the directories `start` was given (no ray import, testable alone).

Every Ray node gets its own directory, control socket and ports, even when several Ray nodes
share one host (a test `Cluster`): everything is keyed by the Ray node id. At the end, the
small file helpers the watchdog actors use on that directory (a lock, an atomic write, a log's
tail).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import stat
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollout_watchdog.common.validate import bracket_host
from rollout_watchdog.config import parse_config

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
        the engines' log files (state_dir/logs) to the log directory. RuntimeError if the
        control socket's directory (in the shared temporary directory) is not this user's
        alone: whoever else may write there can replace the socket."""
        sockets = Path(self.control[len("ipc://"):]).parent
        for folder in (self.node_dir, self.state_dir, self.log_dir, sockets):
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        check_private(sockets)
        logs = self.state_dir / "logs"
        if not logs.exists() and not logs.is_symlink():
            logs.symlink_to(self.log_dir, target_is_directory=True)


def check_private(folder: Path) -> None:
    """RuntimeError unless `folder` is a directory (not a link) of this user that no one else
    may enter (made by someone else first, in a shared /tmp, it is not ours)."""
    info = os.lstat(folder)
    problems = [what for what, bad in (
        ("not a directory (a link?)", not stat.S_ISDIR(info.st_mode)),
        (f"owned by uid {info.st_uid}, not {os.getuid()}", info.st_uid != os.getuid()),
        (f"mode {stat.S_IMODE(info.st_mode):o}: others may enter it",
         bool(info.st_mode & 0o077))) if bad]
    if problems:
        raise RuntimeError(f"{folder}, the node daemon's control socket directory, is "
                           f"{'; '.join(problems)}: remove it, or set TMPDIR to a directory "
                           "of this user")


def node_config(layout: NodeLayout, *, coordinator: str, metrics_host: str, metrics_port: int,
                lifeline_pid: int, key: str | None = None, coordinator_key: str | None = None,
                extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The node config (`rollout-watchdog run --config`) of one Ray node's daemon: no engine
    (they are launched at run time), output to files, and the raylet as its lifeline."""
    check_extra(extra or {})
    config: dict[str, Any] = {
        "node_id": layout.node_id, "coordinator": coordinator,
        "control": layout.control, "state_dir": str(layout.state_dir),
        "metrics_host": metrics_host, "metrics_port": metrics_port,
        "engine_log": "file", "containment": "subreaper", "lifeline_pid": lifeline_pid,
        **(extra or {})}
    if key is not None:
        config["key"], config["coordinator_key"] = key, coordinator_key
    return config


def check_extra(extra: Mapping[str, Any]) -> None:
    """ValueError naming the keys of `start(node_config=...)` that the deployment owns, and
    ConfigError naming every bad value (checked by the config file's own code)."""
    if owned := sorted(OWNED_KEYS & set(extra)):
        raise ValueError(f"node_config may not set {', '.join(owned)}: the Ray deployment "
                         "sets them")
    parse_config(dict(extra), check_commands=False)


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


@contextlib.contextmanager
def flocked(path: Path) -> Iterator[None]:
    """Held while the block runs: an exclusive lock on `path` (made if missing)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def write_atomic(path: Path, text: str, mode: int = 0o644) -> None:
    """Replace `path` with `text`, readers seeing the old file or the new, whole."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.chmod(mode)
    tmp.replace(path)


def tail(path: Path, lines: int = 20) -> str:
    """The last `lines` of a log, for an error message."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as exc:
        return f"(unreadable: {exc})"
