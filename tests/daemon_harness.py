"""Runs the real node daemon (a subprocess) against real emulator engines, and waits on what a
user would watch: `status`, `events`, processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import psutil
import requests

from rollout_watchdog.cli.client import ControlClient, ControlError
from rollout_watchdog.emulator.testing import emulator_command, free_port, wait_until
from rollout_watchdog.watchdog.containment import marker_node, marker_prefix, read_marker
from rollout_watchdog.watchdog.process import ProcKey, is_alive, proc_key

T = TypeVar("T")

# Fast settings so a fault plays out in seconds; every bound is still a bound.
FAST_PROBE = {"liveness_interval_s": 0.2, "health_interval_s": 0.2, "health_timeout_s": 1.0,
              "failure_threshold": 2, "startup_timeout_s": 60.0}
FAST_RESTART = {"grace_s": 2.0, "backoff_initial_s": 0.1, "backoff_max_s": 0.5,
                "max_restarts": 5, "window_s": 600.0, "kill_timeout_s": 5.0,
                "release_timeout_s": 10.0}
# The emulator's own /health_generate timeout (SGLang's is 20 s), below the probe timeout.
EMULATOR_ENV = {"SGLANG_HEALTH_CHECK_TIMEOUT": "0.8", "OMP_NUM_THREADS": "1"}


def wait_for(predicate: Callable[[], T | None], timeout: float, what: str,
             interval: float = 0.02) -> T:
    """`wait_until`, tolerating the errors of a daemon or engine that is between lives."""
    last_error: list[Exception] = []

    def attempt() -> T | None:
        try:
            return predicate()
        except (ControlError, requests.RequestException, psutil.Error) as exc:
            last_error[:] = [exc]
            return None

    try:
        return wait_until(attempt, timeout, interval, what)
    except TimeoutError as exc:
        raise AssertionError(f"{exc}" + (f" (last error: {last_error[0]})"
                                         if last_error else "")) from None


def toml_value(value: Any) -> str:
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + " }"
    return json.dumps(value)


@dataclass
class EngineSpec:
    id: str
    port: int = field(default_factory=free_port)
    flags: tuple[str, ...] = ()
    command: list[str] | None = None
    extra: dict[str, Any] = field(default_factory=dict)   # other [[engine]] keys

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


class Node:
    """A daemon with its config, state dir and control socket in `tmp`."""

    def __init__(self, tmp: Path, engines: list[EngineSpec], *, probe: dict[str, Any] | None = None,
                 restart: dict[str, Any] | None = None, top: dict[str, Any] | None = None,
                 env: dict[str, str] | None = None, node_id: str = "test-node") -> None:
        self.tmp = tmp
        tmp.mkdir(parents=True, exist_ok=True)
        self.engines = {e.id: e for e in engines}
        self.control = f"ipc://{tmp}/control"
        self.config_path = tmp / "node.toml"
        self.state_dir = tmp / "state"
        self.node_id = node_id
        self.env = {**os.environ, **EMULATOR_ENV, **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None
        self.client = ControlClient(self.control, timeout_s=5.0)
        self.seen: set[ProcKey] = set()
        lines = [f'node_id = "{node_id}"', f'control = "{self.control}"',
                 f'state_dir = "{self.state_dir}"', 'gpu_check = "none"']
        lines += [f"{k} = {toml_value(v)}" for k, v in (top or {}).items()]
        lines += ["[probe]"] + [f"{k} = {toml_value(v)}" for k, v in
                                {**FAST_PROBE, **(probe or {})}.items()]
        lines += ["[restart]"] + [f"{k} = {toml_value(v)}" for k, v in
                                  {**FAST_RESTART, **(restart or {})}.items()]
        for e in engines:
            command = e.command or emulator_command(e.port, *e.flags)
            lines += ["[[engine]]", f'id = "{e.id}"', f'url = "{e.url}"',
                      f"command = {toml_value(command)}"]
            lines += [f"{k} = {toml_value(v)}" for k, v in e.extra.items()
                      if not isinstance(v, dict)]
            for k, v in e.extra.items():
                if isinstance(v, dict):
                    lines += [f"[engine.{k}]"] + [f"{kk} = {toml_value(vv)}"
                                                  for kk, vv in v.items()]
        self.config_path.write_text("\n".join(lines) + "\n")

    # -- the daemon

    def start(self, *extra_args: str, wrap: list[str] | None = None,
              stdout: int | None = None) -> Node:
        """Start the daemon (its command line prefixed by `wrap`, its output to `stdout` or
        to daemon.log)."""
        with open(self.tmp / "daemon.log", "ab") as log:
            self.proc = subprocess.Popen(
                [*(wrap or []), sys.executable, "-m", "rollout_watchdog", "run", "--config",
                 str(self.config_path), "--log-format", "json", *extra_args],
                stdout=log if stdout is None else stdout, stderr=subprocess.STDOUT,
                env=self.env)
        wait_for(lambda: self.client.call("ping", timeout_s=1.0), 15, "the daemon to answer")
        return self

    def kill_daemon(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop_daemon(self, timeout: float = 30.0) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=timeout)

    def log_text(self) -> str:
        try:
            return (self.tmp / "daemon.log").read_text(errors="replace")
        except FileNotFoundError:
            return ""

    # -- what a user looks at

    def status(self) -> dict[str, Any]:
        return self.client.call("status")

    def engine(self, engine_id: str) -> dict[str, Any]:
        for e in self.status()["engines"]:
            if e["id"] == engine_id:
                if e["pid"] and (key := proc_key(e["pid"])):
                    self.seen.add(key)
                return e
        raise KeyError(engine_id)

    def events(self, engine_id: str | None = None) -> list[dict[str, Any]]:
        found = self.client.call("events", {"since": 0, "wait_s": 0})["events"]
        return [e for e in found if engine_id is None or e["engine"] == engine_id]

    def wait_state(self, engine_id: str, state: str, timeout: float = 30.0,
                   incarnation: int | None = None) -> dict[str, Any]:
        def check() -> dict[str, Any] | None:
            e = self.engine(engine_id)
            if e["state"] == state and (incarnation is None or e["incarnation"] == incarnation):
                return e
            return None
        what = f"engine {engine_id} to be {state}" + (
            f" (incarnation {incarnation})" if incarnation else "")
        return wait_for(check, timeout, what)

    def wait_event(self, engine_id: str, timeout: float = 30.0,
                   **match: Any) -> dict[str, Any]:
        def check() -> dict[str, Any] | None:
            for e in self.events(engine_id):
                if all(e.get(k) == v for k, v in match.items()):
                    return e
            return None
        return wait_for(check, timeout, f"an event of {engine_id} with {match}")

    def emulator(self, engine_id: str, path: str, body: dict[str, Any] | None = None,
                 timeout: float = 5.0) -> requests.Response:
        url = self.engines[engine_id].url + path
        if body is None:
            return requests.get(url, timeout=timeout)
        return requests.post(url, json=body, timeout=timeout)

    def cleanup(self) -> None:
        """Leave nothing behind, whatever the test did: the daemon, engines, orphans."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        known = {key.pid for key in self.seen | _engine_procs_from_state(self.state_dir)
                 if is_alive(key)}
        # and the engines its markers name: one launched just before the daemon was killed is
        # in no state file yet
        prefix = marker_prefix(marker_node(self.node_id, self.state_dir))
        marked = {p.pid for p in psutil.process_iter()
                  if (read_marker(p.pid) or "").startswith(prefix)}
        for pid in known | marked:
            try:
                proc = psutil.Process(pid)
                for p in [*proc.children(recursive=True), proc]:
                    p.kill()
            except psutil.Error:
                pass


def _engine_procs_from_state(state_dir: Path) -> set[ProcKey]:
    try:
        data = json.loads((state_dir / "state.json").read_text())
    except (OSError, ValueError):
        return set()
    return {ProcKey.from_json(key) for record in data.get("engines", {}).values()
            for key, _fatal in record.get("procs", [])}


def pid_gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


# An engine that ignores SIGTERM, so that its kill takes the whole grace.
IGNORES_SIGTERM = [sys.executable, "-c",
                   "import signal, time; signal.signal(15, signal.SIG_IGN); time.sleep(60)"]


def ignores_sigterm(pid: int) -> bool:
    """Whether the process ignores SIGTERM now: a kill sent before its handler is in (a slow
    interpreter start under load) would end it at once."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("SigIgn:"):
                    return bool(int(line.split()[1], 16) >> (signal.SIGTERM - 1) & 1)
    except OSError:
        pass
    return False


def fd_limit(limit: int, hard: int | None = None) -> list[str]:
    """A wrap (argv prefix) that runs a process with soft RLIMIT_NOFILE `limit`, and hard
    `hard` (default: `limit` too, as the daemon raises its soft limit to the hard one)."""
    return [sys.executable, "-c",
            "import os, resource, sys; "
            f"resource.setrlimit(resource.RLIMIT_NOFILE, ({limit}, {hard or limit})); "
            "os.execvp(sys.argv[1], sys.argv[1:])"]


def run_command(daemon: Any, name: str, **args: Any) -> Any:
    """A control command run in-process against a Daemon, as the control socket would."""
    from rollout_watchdog.watchdog.commands import dispatch

    return dispatch(daemon.supervisor, name, args)
