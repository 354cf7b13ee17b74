"""`rollout-watchdog demo`: a node daemon supervising emulated SGLang engines on this machine.

One engine is SIGKILLed and another one's generation is stalled (its HTTP stays up); the demo
prints the timeline of what the daemon saw and did, then stops the daemon, which stops every
engine. Everything is real: processes, signals, HTTP probes, the control socket.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rollout_watchdog.cli.client import ControlClient, ControlError
from rollout_watchdog.emulator.testing import free_port, inject_fault

STEP_TIMEOUT_S = 60.0


def _config(workdir: Path, ports: list[int]) -> str:
    lines = [
        'node_id = "demo-node"', f'control = "ipc://{workdir}/control"',
        f'state_dir = "{workdir}/state"', 'gpu_check = "none"',
        "[probe]", "liveness_interval_s = 0.5", "health_interval_s = 0.5",
        "health_timeout_s = 2.0", "failure_threshold = 2", "startup_timeout_s = 120.0",
        "[restart]", "grace_s = 3.0", "backoff_initial_s = 0.5", "backoff_max_s = 5.0",
    ]
    for i, port in enumerate(ports):
        command = [sys.executable, "-m", "rollout_watchdog.emulator", "--port", str(port)]
        lines += ["[[engine]]", f'id = "e{i}"', f'url = "http://127.0.0.1:{port}"',
                  "command = [" + ", ".join(f'"{a}"' for a in command) + "]"]
    return "\n".join(lines) + "\n"


class Timeline:
    """Prints each event once, with the time since the demo started."""

    def __init__(self, client: ControlClient) -> None:
        self.client = client
        self.t0 = time.time()
        self.since = 0
        self.events: list[dict[str, Any]] = []

    def say(self, text: str) -> None:
        print(f"  +{time.time() - self.t0:7.3f}s  ---- {text}", flush=True)

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
        what = f"{e['from']} -> {e['to']}" if e["kind"] == "state" else e["kind"]
        cause = f" [{e['cause']}]" if e.get("cause") else ""
        detail = f"  {e['detail']}" if e.get("detail") else ""
        print(f"  +{e['ts'] - self.t0:7.3f}s  {who:<8} {what}{cause}{detail}", flush=True)

    def replay(self, path: Path) -> None:
        """Print the events of the daemon's event log not shown yet (it has exited)."""
        last = self.events[-1]["ts"] if self.events else 0.0
        with open(path) as f:
            for line in f:
                event = json.loads(line)
                if event["ts"] > last:
                    self._show(event)

    def until(self, what: str, predicate: Callable[[], bool]) -> None:
        deadline = time.monotonic() + STEP_TIMEOUT_S
        while not predicate():
            if time.monotonic() > deadline:
                raise TimeoutError(f"demo step timed out: {what}")
            self.pump()
        self.pump()


def run_demo(args: argparse.Namespace) -> int:
    workdir = Path(tempfile.mkdtemp(prefix="rollout-watchdog-demo-"))
    ports = [free_port() for _ in range(args.engines)]
    config = workdir / "node.toml"
    config.write_text(_config(workdir, ports))
    env = {**os.environ, "SGLANG_HEALTH_CHECK_TIMEOUT": "1.5", "OMP_NUM_THREADS": "1"}
    print(f"demo: node daemon + {len(ports)} emulated SGLang engines, files in {workdir}")
    with open(workdir / "daemon.log", "ab") as log:
        daemon = subprocess.Popen([sys.executable, "-m", "rollout_watchdog", "run", "--config",
                                   str(config)], stdout=log, stderr=subprocess.STDOUT, env=env)
    client = ControlClient(f"ipc://{workdir}/control", timeout_s=5.0)
    timeline = Timeline(client)

    def engine(engine_id: str) -> dict[str, Any]:
        try:
            status = client.call("status")
        except ControlError:
            return {}
        return next(e for e in status["engines"] if e["id"] == engine_id)

    def all_healthy(incarnations: dict[str, int]) -> bool:
        return all(engine(e).get("state") == "healthy"
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
                        and e.get("to") == "stopping")

        timeline.say("injecting a hang: e1's generation stalls while its HTTP server lives on")
        inject_fault(f"http://127.0.0.1:{ports[1]}", "stall_generation")
        timeline.until("e1 recovered", lambda: all_healthy({"e1": 2}))

        timeline.say("stopping the daemon (what `systemctl stop` does): it stops every engine")
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(timeout=STEP_TIMEOUT_S)
        timeline.replay(workdir / "state" / "events.jsonl")  # its last words, from its log
        print(f"\ncrash detected {1000 * (detected['ts'] - killed_at):.1f} ms after the SIGKILL;"
              f" daemon exit code {daemon.returncode}.")
        print("A real node runs the same daemon under systemd: see systemd/ and README.md.")
        return 0
    except (TimeoutError, ControlError, RuntimeError) as exc:
        print(f"demo failed: {exc}; daemon log: {workdir / 'daemon.log'}", file=sys.stderr)
        args.keep = True
        return 1
    finally:
        if daemon.poll() is None:
            daemon.send_signal(signal.SIGTERM)
            try:
                daemon.wait(timeout=STEP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                daemon.kill()
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
