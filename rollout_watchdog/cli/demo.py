"""`rollout-watchdog demo`: a node daemon supervising emulated SGLang engines on this machine.

One engine is SIGKILLed and another one's generation is stalled (its HTTP stays up); the demo
prints the timeline of what the daemon saw and did, then stops the daemon, which stops every
engine. Everything is real: processes, signals, HTTP probes, the control socket.

The helpers above `run_demo` are shared with the fleet demo (`demo_fleet.py`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from rollout_watchdog.cli.client import ControlClient, ControlError
from rollout_watchdog.common.states import EngineState
from rollout_watchdog.emulator.testing import free_port, inject_fault

STEP_TIMEOUT_S = 60.0   # the bound on every step of a demo
STOP_TIMEOUT_S = 30.0   # the bound on a daemon's orderly stop (then SIGKILL)
# Set in the environment of every process a demo starts (engines inherit it from their
# daemon): the demo's directory, so that its teardown finds whatever is left, wherever it went.
DEMO_TAG_ENV = "ROLLOUT_WATCHDOG_DEMO"


def node_config(node_dir: Path, node_id: str, ports: list[int], top: Sequence[str] = ()
                ) -> str:
    """A node config for emulated engines e0, e1, ... on `ports`, with fast probes and
    backoff so that a fault plays out in seconds; `top` adds top-level TOML lines."""
    lines = [
        f'node_id = "{node_id}"', f'control = "ipc://{node_dir}/control"',
        f'state_dir = "{node_dir}/state"', 'gpu_check = "none"', *top,
        "[probe]", "liveness_interval_s = 0.5", "health_interval_s = 0.5",
        "health_timeout_s = 2.0", "failure_threshold = 2", "startup_timeout_s = 120.0",
        "[restart]", "grace_s = 3.0", "backoff_initial_s = 0.5", "backoff_max_s = 5.0",
    ]
    for i, port in enumerate(ports):
        command = [sys.executable, "-m", "rollout_watchdog.emulator", "--port", str(port)]
        lines += ["[[engine]]", f'id = "e{i}"', f'url = "http://127.0.0.1:{port}"',
                  "command = [" + ", ".join(f'"{a}"' for a in command) + "]"]
    return "\n".join(lines) + "\n"


def start_daemon(config: Path, workdir: Path, log_path: Path) -> subprocess.Popen[bytes]:
    """`rollout-watchdog run --config CONFIG`, its output appended to `log_path`. In a session
    of its own: a Ctrl-C at the terminal reaches the demo, whose teardown stops the daemons."""
    env = {**os.environ, "SGLANG_HEALTH_CHECK_TIMEOUT": "1.5", "OMP_NUM_THREADS": "1",
           DEMO_TAG_ENV: str(workdir)}
    with open(log_path, "ab") as log:
        return subprocess.Popen([sys.executable, "-m", "rollout_watchdog", "run", "--config",
                                 str(config)], stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)


def stop_daemon(daemon: subprocess.Popen[bytes]) -> int:
    """SIGTERM (the daemon stops its engines), then SIGKILL after STOP_TIMEOUT_S; its exit
    code."""
    if daemon.poll() is None:
        daemon.send_signal(signal.SIGTERM)
        try:
            return daemon.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            daemon.kill()
    return daemon.wait(timeout=STOP_TIMEOUT_S)


def sweep(workdir: Path) -> list[int]:
    """SIGKILL every process still tagged with this demo's directory (an engine orphaned by a
    killed daemon, a daemon that would not stop) until none is left (at most STOP_TIMEOUT_S);
    the pids killed. A killed process is gone once it has exited: its environment can no
    longer be read."""
    killed: list[int] = []
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while (found := _tagged(workdir)) and time.monotonic() < deadline:
        for pid in found:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                if pid not in killed:
                    killed.append(pid)
        time.sleep(0.05)
    return killed


def _tagged(workdir: Path) -> list[int]:
    needle = f"{DEMO_TAG_ENV}={workdir}".encode()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    found.append(int(name))
        except OSError:  # gone, or not ours to read
            continue
    return found


def interrupt_on_sigterm() -> Callable[[], None]:
    """Make SIGTERM interrupt the demo as Ctrl-C does (so its teardown runs); the function
    that puts the previous handler back."""
    def interrupt(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt
    previous = signal.signal(signal.SIGTERM, interrupt)

    def restore() -> None:
        signal.signal(signal.SIGTERM, previous)
    return restore


@contextlib.contextmanager
def shielded() -> Iterator[None]:
    """SIGINT and SIGTERM ignored meanwhile: a second Ctrl-C must not cut a teardown short."""
    previous = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def describe(event: dict[str, Any]) -> str:
    """What an event says, after who it is about: `from -> to [cause]  detail`."""
    what = f"{event['from']} -> {event['to']}" if event["kind"] == "state" else event["kind"]
    cause = f" [{event['cause']}]" if event.get("cause") else ""
    detail = f"  {event['detail']}" if event.get("detail") else ""
    return what + cause + detail


class Narrator:
    """The demo's voice: its own lines and events, stamped with the time since it started, and
    its steps, each waited on with a deadline while `pump` shows what happens meanwhile."""

    def __init__(self) -> None:
        self.t0 = time.time()

    def stamp(self, ts: float) -> str:
        return f"  +{ts - self.t0:7.3f}s"

    def say(self, text: str) -> None:
        print(f"{self.stamp(time.time())}  ---- {text}", flush=True)

    def pump(self) -> None:
        """Show what happened since the last call, waiting a little for it."""
        raise NotImplementedError

    def until(self, what: str, predicate: Callable[[], bool],
              timeout_s: float = STEP_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while not predicate():
            if time.monotonic() > deadline:
                raise TimeoutError(f"demo step timed out after {timeout_s:g} s: {what}")
            self.pump()
        self.pump()


class Timeline(Narrator):
    """Prints each event of the local daemon once."""

    def __init__(self, client: ControlClient) -> None:
        super().__init__()
        self.client = client
        self.since = 0
        self.events: list[dict[str, Any]] = []

    def pump(self) -> None:
        try:
            result = self.client.call("events", {"since": self.since, "wait_s": 0.2})
        except ControlError:
            return
        self.since = result["next"]
        for e in result["events"]:
            self._show(e)

    def _show(self, e: dict[str, Any]) -> None:
        self.events.append(e)
        who = f"{e['engine']}#{e['incarnation']}" if e["engine"] else "daemon"
        print(f"{self.stamp(e['ts'])}  {who:<8} {describe(e)}", flush=True)

    def replay(self, path: Path) -> None:
        """Print the events of the daemon's event log not shown yet (it has exited)."""
        last = self.events[-1]["ts"] if self.events else 0.0
        with open(path) as f:
            for line in f:
                event = json.loads(line)
                if event["ts"] > last:
                    self._show(event)


def run_demo(args: argparse.Namespace) -> int:
    workdir = Path(tempfile.mkdtemp(prefix="rollout-watchdog-demo-"))
    ports = [free_port() for _ in range(args.engines)]
    config = workdir / "node.toml"
    config.write_text(node_config(workdir, "demo-node", ports))
    print(f"demo: node daemon + {len(ports)} emulated SGLang engines, files in {workdir}")
    restore = interrupt_on_sigterm()
    daemon = start_daemon(config, workdir, workdir / "daemon.log")
    client = ControlClient(f"ipc://{workdir}/control", timeout_s=5.0)
    timeline = Timeline(client)

    def engine(engine_id: str) -> dict[str, Any]:
        try:
            status = client.call("status")
        except ControlError:
            return {}
        return next(e for e in status["engines"] if e["id"] == engine_id)

    def all_healthy(incarnations: dict[str, int]) -> bool:
        return all(engine(e).get("state") == EngineState.HEALTHY
                   and engine(e).get("incarnation") == n for e, n in incarnations.items())

    try:
        ids = [f"e{i}" for i in range(len(ports))]
        timeline.say("starting the daemon; it launches every engine")
        timeline.until("engines healthy", lambda: all_healthy({e: 1 for e in ids}))

        victim = engine("e0")
        timeline.say(f"injecting a crash: SIGKILL to e0's main process (pid {victim['pid']})")
        killed_at = time.time()
        os.kill(victim["pid"], signal.SIGKILL)
        timeline.until("e0 recovered", lambda: all_healthy({"e0": 2}))
        detected = next(e for e in timeline.events if e["engine"] == "e0"
                        and e.get("to") == EngineState.STOPPING)

        timeline.say("injecting a hang: e1's generation stalls while its HTTP server lives on")
        inject_fault(f"http://127.0.0.1:{ports[1]}", "stall_generation")
        timeline.until("e1 recovered", lambda: all_healthy({"e1": 2}))

        timeline.say("stopping the daemon (what `systemctl stop` does): it stops every engine")
        code = stop_daemon(daemon)
        timeline.replay(workdir / "state" / "events.jsonl")  # its last words, from its log
        print(f"\ncrash detected {1000 * (detected['ts'] - killed_at):.1f} ms after the SIGKILL;"
              f" daemon exit code {code}.")
        print("A real node runs the same daemon under systemd: see systemd/ and README.md.")
        return 0
    except (TimeoutError, ControlError, RuntimeError) as exc:
        print(f"demo failed: {exc}; daemon log: {workdir / 'daemon.log'}", file=sys.stderr)
        args.keep = True
        return 1
    finally:
        restore()
        with shielded():
            stop_daemon(daemon)
            sweep(workdir)
            if not args.keep:
                shutil.rmtree(workdir, ignore_errors=True)
