"""The emulator's faults, as one table.

Each :class:`Fault` names the fault, its argument and what it does. The table drives:
- the start-up flags (``--NAME`` switches, ``--NAME-after S`` timers): ``options.py`` adds
  them from the table, :func:`apply_at_start` and :func:`apply_at_ready` apply them;
- the runtime endpoint ``POST /_emulator/fault {"fault": NAME, ARG: ..., "after_s": S}``:
  :func:`inject`;
- the report in ``GET /_emulator/info``: :func:`report`.

A fault only sets state; the behaviour hooks read it: ``server.hang_http`` (every HTTP request,
and the SIGTERM drain), ``server.ignore_sigterm`` (the SIGTERM handler), and the shared flags
the scheduler child reads on every loop turn (stall, SIGTERM, token latency).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rollout_watchdog.emulator.common import (
    HANG_STAGES,
    ORPHAN_MARKER,
    SLOT_HANG_WEIGHT_UPDATE,
    SLOT_IGNORE_SIGTERM,
    SLOT_STALL,
    SLOT_TOKEN_LATENCY_MS,
    log,
)
from rollout_watchdog.emulator.protocol import BadRequest

if TYPE_CHECKING:
    from rollout_watchdog.emulator.server import EmulatorServer

ORPHAN_CODE = "import time\nwhile True:\n    time.sleep(1)\n"

# (extra fields of the answer, an action to run once the answer is sent: crash, exit)
Applied = tuple[dict[str, Any], Callable[[], None] | None]


@dataclass(frozen=True)
class FaultArg:
    """The one argument a fault takes at runtime (a start-up flag has its own option)."""

    name: str
    parse: Callable[[Any], Any]  # raises BadRequest naming the problem
    default: Any = None


@dataclass(frozen=True)
class Fault:
    """One fault: its name, argument, effect, and how it can be triggered and seen."""

    name: str
    does: str  # what it does, for --help
    act: Callable[[EmulatorServer, Any], Applied]  # (server, parsed argument)
    arg: FaultArg | None = None
    timed: bool = False  # may be delayed: "after_s" at runtime, --NAME-after S at start-up
    switch: str | None = None  # start-up switch --NAME, applied at "start" or at "ready"
    state: Callable[[EmulatorServer], Any] | None = None  # reported by /_emulator/info

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


def _exit_code(value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise BadRequest("code must be an integer")
    return value


def _latency_ms(value: Any) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
        raise BadRequest("ms must be a number >= 0")
    return float(value)


def _hang_stage(value: Any) -> str:
    if value not in HANG_STAGES:
        raise BadRequest(f"stage must be one of {', '.join(HANG_STAGES)}, not {value!r}")
    return str(value)


def _hang_weight_update(server: EmulatorServer, stage: str | None) -> Applied:
    stage = stage or HANG_STAGES[0]
    server.shared[SLOT_HANG_WEIGHT_UPDATE] = float(HANG_STAGES.index(stage) + 1)
    return {"stage": stage}, None


def _weight_update_hang_state(server: EmulatorServer) -> str | None:
    slot = int(server.shared[SLOT_HANG_WEIGHT_UPDATE])
    return HANG_STAGES[slot - 1] if slot else None


def _crash(server: EmulatorServer, _: Any) -> Applied:
    return {}, lambda: os.kill(os.getpid(), signal.SIGKILL)


def _crash_scheduler(server: EmulatorServer, _: Any) -> Applied:
    pid = server.proc.pid
    if server.proc.exitcode is None:
        os.kill(pid, signal.SIGKILL)
    return {"scheduler_pid": pid}, None


def _hang_http(server: EmulatorServer, _: Any) -> Applied:
    # At once, not after answering: a request sent right after this answer must hang.
    # (This request already passed the check, so it is still answered.)
    server.hang_http = True
    return {}, None


def _set_stall(on: bool) -> Callable[[EmulatorServer, Any], Applied]:
    def act(server: EmulatorServer, _: Any) -> Applied:
        server.shared[SLOT_STALL] = 1.0 if on else 0.0
        return {}, None
    return act


def _set_ignore_sigterm(on: bool) -> Callable[[EmulatorServer, Any], Applied]:
    def act(server: EmulatorServer, _: Any) -> Applied:
        server.ignore_sigterm = on
        server.shared[SLOT_IGNORE_SIGTERM] = 1.0 if on else 0.0
        return {}, None
    return act


def _orphan(server: EmulatorServer, _: Any) -> Applied:
    """A long-lived child in its own session, without PDEATHSIG: it outlives the engine."""
    proc = subprocess.Popen(
        [sys.executable, "-c", ORPHAN_CODE, ORPHAN_MARKER],
        start_new_session=True,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        close_fds=True,
    )
    with server.lock:
        server.orphans.append(proc)
    log(f"orphan spawned: pid {proc.pid}")
    return {"orphan_pid": proc.pid}, None


def _exit(server: EmulatorServer, code: int) -> Applied:
    return {"code": code}, lambda: server.exit(code & 0xFF)


def _token_latency(server: EmulatorServer, ms: float) -> Applied:
    server.shared[SLOT_TOKEN_LATENCY_MS] = ms
    return {"ms": ms}, None


FAULTS: dict[str, Fault] = {f.name: f for f in (
    Fault("crash", "SIGKILL the main process", _crash, timed=True),
    Fault("crash_scheduler", "SIGKILL the scheduler child", _crash_scheduler, timed=True),
    Fault("hang_http", "every HTTP request blocks forever", _hang_http, timed=True,
          switch="ready", state=lambda s: s.hang_http),
    Fault("stall_generation", "the scheduler stops producing output", _set_stall(True),
          timed=True, switch="ready", state=lambda s: s.shared[SLOT_STALL] >= 0.5),
    Fault("unstall", "the scheduler produces output again", _set_stall(False)),
    Fault("hang_weight_update",
          "the next update_weights_from_distributed never answers, nor any control call "
          "after it, while generation and /health go on; STAGE join (default): it never "
          "joins the broadcast, finish: it receives the tensors, then hangs",
          _hang_weight_update, arg=FaultArg("stage", _hang_stage, default=HANG_STAGES[0]),
          switch="start", state=_weight_update_hang_state),
    Fault("ignore_sigterm", "main process and scheduler ignore SIGTERM",
          _set_ignore_sigterm(True), switch="start", state=lambda s: s.ignore_sigterm),
    Fault("honor_sigterm", "SIGTERM works again", _set_ignore_sigterm(False)),
    Fault("orphan", "leave a child in its own session that outlives us", _orphan,
          switch="ready"),
    Fault("exit", "exit at once with code CODE", _exit,
          arg=FaultArg("code", _exit_code, default=1)),
    Fault("token_latency", "one decode step costs MS milliseconds", _token_latency,
          arg=FaultArg("ms", _latency_ms)),
)}


def _switched_on(args: argparse.Namespace, when: str) -> list[Fault]:
    return [f for f in FAULTS.values() if f.switch == when and getattr(args, f.name)]


def apply_at_start(server: EmulatorServer) -> None:
    """Start-up switches that hold from the first moment (before the scheduler starts)."""
    for fault in _switched_on(server.args, "start"):
        fault.act(server, None)


def apply_at_ready(server: EmulatorServer) -> None:
    """Start-up switches that hold from 'ready', and the ``--NAME-after S`` timers."""
    for fault in _switched_on(server.args, "ready"):
        fault.act(server, None)
    now = time.monotonic()
    with server.lock:
        for fault in FAULTS.values():
            delay = getattr(server.args, f"{fault.name}_after", None) if fault.timed else None
            if delay is not None:
                server.timers.append((now + delay, fault.name))
    server.wake.set()


def inject(server: EmulatorServer, name: Any, params: dict[str, Any]) -> Applied:
    """Apply fault ``name`` now, or schedule it (``after_s``); raises BadRequest."""
    fault = FAULTS.get(name) if isinstance(name, str) else None
    if fault is None:
        raise BadRequest(f"unknown fault {name!r}; known: {', '.join(FAULTS)}")
    after = params.get("after_s")
    if after is not None and fault.timed:
        if not isinstance(after, (int, float)) or after < 0:
            raise BadRequest("after_s must be a number >= 0")
        with server.lock:
            server.timers.append((time.monotonic() + float(after), fault.name))
        server.wake.set()
        return {"after_s": float(after)}, None
    value = fault.arg.parse(params.get(fault.arg.name, fault.arg.default)) if fault.arg else None
    return fault.act(server, value)


def report(server: EmulatorServer) -> dict[str, Any]:
    """The faults' state for /_emulator/info: each reportable fault, and the pending timers."""
    state = {f.name: f.state(server) for f in FAULTS.values() if f.state is not None}
    return {**state, "pending": sorted(name for _, name in server.timers)}
