"""The real sglang-router binary as a test subprocess, started the way the coordinator expects
(rollout_watchdog/refit_bridge/router.py): its own health checks off, a short startup timeout
for a pending registration, its own Prometheus port.

    router = Router.start()
    try:
        ... router.url ...
        router.kill(); router.restart()
    finally:
        router.stop()
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from rollout_watchdog.emulator.testing import free_port, http_request
from rollout_watchdog.refit_bridge.router import launch_argv


class Router:
    """One ``python -m sglang_router.launch_router`` process in its own session."""

    def __init__(self, port: int, prometheus_port: int, log: Path) -> None:
        self.port = port
        self.prometheus_port = prometheus_port
        self.log = log
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen[bytes] | None = None

    @classmethod
    def unstarted(cls) -> Router:
        """A router on free ports, not started yet (nothing listens on its URL)."""
        log = Path(tempfile.mkstemp(prefix="sglang-router-", suffix=".log")[1])
        return cls(free_port(), free_port(), log)

    @classmethod
    def start(cls, timeout: float = 30.0) -> Router:
        """A router on free ports, answering GET /workers (or TimeoutError / RuntimeError)."""
        router = cls.unstarted()
        router.restart(timeout)
        return router

    def restart(self, timeout: float = 30.0) -> None:
        """Start the process (again) on the same ports and wait until it answers."""
        argv = launch_argv("127.0.0.1", self.port, self.prometheus_port)
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                         start_new_session=True)
        deadline = time.monotonic() + timeout
        while http_request(f"{self.url}/workers", timeout=2.0)[0] != 200:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sglang-router exited with {self.proc.returncode}: "
                                   f"{self.log_tail()}")
            if time.monotonic() > deadline:
                self.kill()
                raise TimeoutError(f"sglang-router on {self.url} not ready after {timeout} s")
            time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL the router's process group and reap it (bounded)."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)

    def stop(self) -> None:
        """Kill it and drop its log."""
        self.kill()
        self.log.unlink(missing_ok=True)

    def failed_add_jobs(self, url: str) -> int:
        """How many of the router's own AddWorker jobs for ``url`` failed for good (its health
        checks of a booting worker gave up: "Failed job: type=AddWorker, worker=URL"). After one,
        the worker is not coming unless it is posted again."""
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return text.count(f"Failed job: type=AddWorker, worker={url},")

    def log_tail(self, lines: int = 20) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])
