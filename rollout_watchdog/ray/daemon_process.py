"""The node daemon as a process apart from its Ray actor (no ray import).

Ray kills the direct children of a worker that ends (`ray.kill`, a crash), even ones in a
session of their own (docs/ray.md, measured). So the daemon is double-forked: a launcher in a
new session forks the daemon and exits at once, and the daemon, reparented away from the
actor, outlives it. The actor keeps the daemon's identity (pid and start time) and finds a
running one again through its state dir's lock and its control socket.
"""

from __future__ import annotations

import fcntl
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from rollout_watchdog.cli.client import ControlClient, ControlError
from rollout_watchdog.config import ConfigError, load_config
from rollout_watchdog.watchdog.process import (
    ProcKey,
    ProcStat,
    is_alive,
    proc_key,
    process_table,
    read_stat,
)

log = logging.getLogger(__name__)
# What Ray sets for a worker that holds no accelerator ("" for CUDA: vllm#3198). The daemon
# holds none either: an engine gets exactly the GPUs of its spec, never these.
RAY_VISIBILITY_VARS = ("CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES",
                       "NEURON_RT_VISIBLE_CORES", "TPU_VISIBLE_CHIPS",
                       "ASCEND_RT_VISIBLE_DEVICES")
LAUNCH_TIMEOUT_S = 30.0
POLL_S = 0.05

# The launcher: forks the daemon with its output on the log file, prints its pid, and exits,
# so that the daemon is nobody's child in the actor's tree.
_LAUNCHER = """
import os, sys
pid = os.fork()
if pid:
    sys.stdout.write(str(pid))
    sys.stdout.flush()
    os._exit(0)
log = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
null = os.open(os.devnull, os.O_RDONLY)
os.dup2(null, 0)
os.dup2(log, 1)
os.dup2(log, 2)
os.execv(sys.argv[2], sys.argv[2:])
"""


RAYLET = "raylet"             # the raylet's process name
OMP_THREADS = "OMP_NUM_THREADS"
MAX_ANCESTORS = 16


def find_raylet(environ: Mapping[str, str], parent: int,
                read: Callable[[int], ProcStat | None] = read_stat) -> int:
    """This node's raylet, the daemon's lifeline: Ray's $RAY_RAYLET_PID, else the first
    `raylet` among the worker's ancestors. The worker's parent is the raylet only when nothing
    runs between them: a runtime env's `py_executable` (`uv run`, nsys) puts its wrapper there,
    and a wrapper that ends with the actor would stop every engine. Neither found: the parent,
    with a warning (the daemon stops when it ends)."""
    def raylet(stat: ProcStat | None) -> bool:
        return stat is not None and stat.comm == RAYLET and stat.alive

    if (named := environ.get("RAY_RAYLET_PID", "")).isdigit() and raylet(read(int(named))):
        return int(named)
    ancestor = parent
    for _ in range(MAX_ANCESTORS):
        stat = read(ancestor) if ancestor > 1 else None
        if stat is None:
            break
        if raylet(stat):
            return ancestor
        ancestor = stat.ppid
    stat = read(parent)
    log.warning("no raylet found (RAY_RAYLET_PID, the worker's ancestors): the node daemon's "
                "lifeline is the worker's parent %d (%r), and it stops when that ends",
                parent, stat and stat.comm)
    return parent


def daemon_environment(environ: Mapping[str, str],
                       node_environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The daemon's environment, which its engines inherit: the worker's, without Ray's
    accelerator visibility, and without the OMP_NUM_THREADS that Ray gives a worker
    (its num_cpus, 1 for the watchdog's 0) unless the node's own environment (`node_environ`,
    the raylet's) has that value: an engine would run its CPU ops on one thread."""
    env = {k: v for k, v in environ.items() if k not in RAY_VISIBILITY_VARS}
    threads = env.get(OMP_THREADS)
    if node_environ is not None and threads is not None \
            and node_environ.get(OMP_THREADS) != threads:
        del env[OMP_THREADS]
    return env


def process_environ(pid: int) -> dict[str, str] | None:
    """A process's environment as it started (/proc/PID/environ); None if it cannot be
    read (gone, another user's)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in pairs}


def daemon_argv(config_path: Path) -> list[str]:
    return [sys.executable, "-m", "rollout_watchdog", "run", "--config", str(config_path)]


def daemons_of(namespace: str, node_id: str) -> dict[ProcKey, Path]:
    """The daemons that watchdogs of Ray node `node_id` started in `namespace`, with their
    configs: found by their command line (`daemon_argv` of .../<namespace>/node-<id>/node.toml),
    for when the watchdog that knows its daemon does not answer."""
    tail = ("-m", "rollout_watchdog", "run", "--config")
    suffix = f"/{namespace}/node-{node_id}/node.toml"
    found = {}
    for pid in process_table():
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().decode(errors="replace").split("\0")[:-1]
        except OSError:
            continue
        if len(argv) == 6 and tuple(argv[1:5]) == tail and argv[5].endswith(suffix) \
                and (key := proc_key(pid)) is not None:
            found[key] = Path(argv[5])
    return found


def stop_daemons_of(namespace: str, node_id: str, timeout_s: float) -> list[int]:
    """Take the launched engines out of the books of each daemon of `daemons_of`, and stop it
    (`stop`); the pids of those that did not stop in time (killed: their engines may be left).
    For `shutdown` on the node of a watchdog actor that hangs."""
    late = []
    for key, config_path in daemons_of(namespace, node_id).items():
        try:
            control = load_config(config_path, check_commands=False).control
        except ConfigError as exc:
            log.warning("node daemon %d: no control socket in %s (%s): stopped without its "
                        "launched engines forgotten", key.pid, config_path, exc)
        else:
            forget_launched(control, timeout_s)
        if not stop(key, timeout_s):
            late.append(key.pid)
    return late


def spawn_detached(argv: Sequence[str], env: Mapping[str, str], log_path: Path,
                   timeout_s: float = LAUNCH_TIMEOUT_S) -> ProcKey:
    """Start `argv` double-forked in a new session, its output appended to `log_path`; its
    identity. RuntimeError naming the cause if it could not be started."""
    try:
        done = subprocess.run([sys.executable, "-c", _LAUNCHER, str(log_path), *argv],
                              env=dict(env), stdin=subprocess.DEVNULL, capture_output=True,
                              start_new_session=True, check=True,
                              timeout=timeout_s)
        pid = int(done.stdout)
    except (OSError, ValueError, subprocess.SubprocessError) as exc:
        raise RuntimeError(f"cannot start {argv[0]}: {exc}") from exc
    key = proc_key(pid)
    if key is None:
        raise RuntimeError(f"{' '.join(argv)} exited at once: see {log_path}")
    return key


def held_lock_pid(lock_path: Path) -> int | None:
    """The pid written in a daemon's state-dir lock while a daemon holds it, else None."""
    try:
        fd = os.open(lock_path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            text = os.pread(fd, 32, 0).decode(errors="replace").strip()
            return int(text) if text.isdigit() else 0
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def ping(control: str, node_id: str, timeout_s: float) -> bool:
    """The daemon of `node_id` answers on `control`."""
    try:
        answer = ControlClient(control, timeout_s).call("ping")
    except ControlError:
        return False
    return isinstance(answer, dict) and answer.get("node_id") == node_id


def forget_launched(control: str, timeout_s: float) -> bool:
    """Take every engine launched at run time out of the daemon's books (`remove`: its spec
    leaves launched.json at once, and its stop begins), so that no later daemon on this state
    dir brings it back; whether the daemon answered. One that does not is logged: its own stop
    still stops every engine."""
    client = ControlClient(control, timeout_s)
    try:
        for engine in client.call("status")["engines"]:
            if engine.get("origin") == "launched":
                client.call("remove", {"engine": engine["id"]})
    except (ControlError, KeyError, TypeError) as exc:
        log.warning("cannot remove the launched engines at %s: %s", control, exc)
        return False
    return True


def wait_gone(key: ProcKey, timeout_s: float) -> bool:
    """Whether the process ended (a zombie counts) within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while is_alive(key):
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_S)
    return True


def stop(key: ProcKey, timeout_s: float) -> bool:
    """SIGTERM the daemon (it stops its engines, whole trees, and exits); whether it ended in
    time. SIGKILL after the bound: the caller names what may be left."""
    try:
        os.kill(key.pid, signal.SIGTERM)
    except ProcessLookupError:
        return True
    if wait_gone(key, timeout_s):
        return True
    log.error("node daemon %d did not stop within %.0f s: killed (its engines may be left)",
              key.pid, timeout_s)
    if is_alive(key):
        os.kill(key.pid, signal.SIGKILL)
    return False
