"""Helpers for tests that run the emulator as a real subprocess, and its fault client.

:func:`inject_fault` and :func:`emulator_info` are the one client of the emulator's private
endpoints (tests, the demo and the benchmarks use them). Stdlib only (no requests, no torch),
so any test module can use them:

    port = free_port()
    proc = start_emulator(port, "--enable-metrics", env={"SGLANG_HEALTH_CHECK_TIMEOUT": "1"})
    try:
        ...
    finally:
        stop_emulator(proc)

The emulator is started in its own session (process group == its pid), so the whole engine
(main process, scheduler, multiprocessing's resource tracker) can be killed with one killpg
without touching the test runner. Orphans (fault ``orphan``) live in their own sessions; pass
their pids to :func:`stop_emulator` to kill them too.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

from rollout_watchdog.common.ports import free_port
from rollout_watchdog.emulator.common import NO_MODEL_ENV, ORPHAN_MARKER

T = TypeVar("T")
MAX_POLL_S = 0.1   # wait_until's longest pause between polls

__all__ = [
    "ORPHAN_MARKER",
    "emulator_command",
    "emulator_info",
    "free_port",
    "http_request",
    "inject_fault",
    "pid_alive",
    "port_open",
    "start_emulator",
    "stop_emulator",
    "wait_until",
]


def emulator_command(port: int, *args: str) -> list[str]:
    """argv that starts the emulator with this interpreter; with ``--no-model`` when
    ``$RW_EMULATOR_NO_MODEL`` is 1 (the test suite's speed knob for tests without weights)."""
    no_model = ("--no-model",) if os.environ.get(NO_MODEL_ENV) == "1" else ()
    return [sys.executable, "-m", "rollout_watchdog.emulator", "--port", str(port), *no_model,
            *args]


def wait_until(
    predicate: Callable[[], T], timeout: float, interval: float = 0.02, what: str = "condition"
) -> T:
    """Poll ``predicate`` until it returns something truthy (returned) or raise TimeoutError.

    The pause between polls starts at ``interval`` and grows by half each time, up to
    MAX_POLL_S (or ``interval``, if longer): a short wait ends quickly, a long one (an engine
    booting, a refit) polls a few times a second. A poll is seldom free: a daemon's status over
    its control socket costs ~3 ms of CPU on both sides, so 50 polls a second while four test
    workers wait kept a core busy with nothing but asking."""
    deadline = time.monotonic() + timeout
    pause, longest = interval, max(interval, MAX_POLL_S)
    while True:
        value = predicate()
        if value:
            return value
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"timed out after {timeout:.1f} s waiting for {what}")
        time.sleep(min(pause, left))
        pause = min(pause * 1.5, longest)


def http_request(
    url: str, method: str = "GET", body: Any = None, timeout: float = 5.0
) -> tuple[int | None, bytes]:
    """(status, body) of one request; status None when the connection failed or timed out.

    ``body`` is sent as JSON unless it is bytes.
    """
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return int(resp.status), resp.read()
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read()
    except (OSError, ValueError):
        return None, b""


def port_open(port: int, host: str = "127.0.0.1", timeout: float = 0.5) -> bool:
    """Whether something accepts TCP connections on host:port."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie (a zombie has exited)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as fh:
            stat = fh.read()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] not in ("Z", "X")


def start_emulator(
    port: int,
    *args: str,
    env: Mapping[str, str] | None = None,
    wait: str = "health",
    timeout: float = 60.0,
    host: str = "127.0.0.1",
    stdout: Any = None,
    stderr: Any = None,
) -> subprocess.Popen[bytes]:
    """Start ``python -m rollout_watchdog.emulator --port PORT *args`` in its own session.

    ``env`` extends the current environment. ``wait``: "health" (default) returns once
    /health_generate answers 200, "port" once the port accepts connections, "none" at once.
    If the process exits or the deadline passes while waiting, it is killed and RuntimeError /
    TimeoutError is raised.
    """
    if wait not in ("health", "port", "none"):
        raise ValueError(f"wait must be 'health', 'port' or 'none', not {wait!r}")
    full_env = dict(os.environ)
    full_env.update(env or {})
    proc = subprocess.Popen(
        emulator_command(port, *args),
        env=full_env,
        stdin=subprocess.DEVNULL,
        stdout=stdout,
        stderr=stderr,
        start_new_session=True,
    )
    if wait == "none":
        return proc
    url = f"http://{host}:{port}/health_generate"
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            stop_emulator(proc)
            raise RuntimeError(f"emulator exited with {proc.returncode} during start-up")
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            stop_emulator(proc)
            raise TimeoutError(f"emulator on port {port} not ready after {timeout:.0f} s")
        if wait == "port":
            if port_open(port, host, timeout=min(0.5, remaining)):
                return proc
        elif http_request(url, timeout=min(5.0, remaining))[0] == 200:
            return proc
        time.sleep(0.05)


def stop_emulator(
    proc: subprocess.Popen[bytes], extra_pids: Iterable[int] = (), timeout: float = 10.0
) -> int | None:
    """SIGKILL the emulator's process group and any ``extra_pids`` (orphans); reap the main
    process (bounded). Returns its exit status, or None if it could not be reaped in time.

    Extra pids are killed only if they still look like emulator orphans (pid reuse guard).
    """
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)  # works while any group member is left
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout)
    for pid in extra_pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                is_orphan = ORPHAN_MARKER.encode() in fh.read()
        except OSError:
            continue
        if is_orphan:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
    return proc.returncode


def emulator_info(base_url: str, timeout: float = 5.0) -> dict[str, Any]:
    """GET /_emulator/info as a dict (raises RuntimeError if it does not answer 200)."""
    status, body = http_request(f"{base_url}/_emulator/info", timeout=timeout)
    if status != 200:
        raise RuntimeError(f"/_emulator/info answered {status}")
    return dict(json.loads(body))


def inject_fault(base_url: str, fault: str, timeout: float = 5.0, **params: Any) -> dict[str, Any]:
    """POST /_emulator/fault; returns the answer (raises RuntimeError unless 200).

    For "crash" the process dies right after answering.
    """
    status, body = http_request(
        f"{base_url}/_emulator/fault", "POST", {"fault": fault, **params}, timeout=timeout
    )
    if status != 200:
        raise RuntimeError(f"fault {fault!r} answered {status}: {body[:200]!r}")
    return dict(json.loads(body))
