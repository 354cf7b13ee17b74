"""The refit part of `rollout-watchdog demo --fleet`: a real sglang-router (when installed),
this process as the trainer (rank 0 of a gloo weight-update group), refits that sync every
engine, and a crashed engine kept out of the router until the next refit gives it the weights."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import time
from pathlib import Path

from rollout_watchdog.emulator.testing import free_port, http_request
from rollout_watchdog.refit_bridge.client import FleetClient
from rollout_watchdog.refit_bridge.router import RouterClient, launch_argv

PROMPT = "The rollout fleet"
ROUTER_START_S = 30.0


class DemoRouter:
    """`python -m sglang_router.launch_router`, with its own health checks off (the coordinator
    owns membership), or None when the package is not installed."""

    def __init__(self, workdir: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        log = open(workdir / "router.log", "ab")   # noqa: SIM115 - the child keeps it
        self.proc = subprocess.Popen(launch_argv("127.0.0.1", self.port, free_port()),
                                     stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                     start_new_session=True)
        log.close()
        deadline = time.monotonic() + ROUTER_START_S
        while http_request(f"{self.url}/workers", timeout=2.0)[0] != 200:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"sglang-router did not start; see {workdir}/router.log")
            time.sleep(0.1)

    @staticmethod
    def available() -> bool:
        return importlib.util.find_spec("sglang_router") is not None

    def workers(self) -> set[str]:
        """The (normalized) URLs of the workers it lists."""
        return RouterClient(self.url).urls()

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)


def refit(client: FleetClient, version: str, seed: int) -> tuple[float, list[str]]:
    """One refit from this process; (seconds, the members' names)."""
    from rollout_watchdog.emulator.model import named_weights
    began = time.monotonic()
    with client.refit(version, backend="gloo", timeout_s=120) as session:
        session.update_weights(named_weights(seed))
        names = [e.name for e in session.engines]
    return time.monotonic() - began, names


def generate(url: str) -> tuple[str, str | None]:
    """(text, weight_version) of one greedy generation at `url`."""
    status, body = http_request(f"{url}/generate", "POST", {
        "text": PROMPT, "sampling_params": {"max_new_tokens": 12, "temperature": 0}},
        timeout=10.0)
    if status != 200:
        return f"(HTTP {status})", None
    answer = json.loads(body)
    return str(answer["text"]), answer["meta_info"].get("weight_version")
