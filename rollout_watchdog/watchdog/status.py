"""The node's answer to `status` and each engine's object in it (DESIGN.md, `status --json`).

It exists apart from the supervisor because describing a node is not deciding about it: the
commands, the node link (which sends an engine's object with each of its events) and the daemon
all read the supervisor's records through these functions, so the shape of the answer is written
once, and a change to it never touches the decisions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from rollout_watchdog.common.clock import Clock
from rollout_watchdog.common.states import EngineState
from rollout_watchdog.watchdog.cgroup import CgroupManager, mode_of
from rollout_watchdog.watchdog.engine import EngineRuntime
from rollout_watchdog.watchdog.process import ProcKey

S = EngineState


class Reported(Protocol):
    """What a node's status is made of: the supervisor's identity, records and parts."""

    node_id: str
    boot_id: str
    kernel_boot: str            # the kernel's boot id, cut: part of every process identity
    clock: Clock
    cgroups: CgroupManager | None
    engines: dict[str, EngineRuntime]
    # More objects of `status`, by key, from the daemon's parts (the node link's "link")
    status_parts: dict[str, Callable[[], Any]]


def node_status(node: Reported) -> dict[str, Any]:
    return {"node_id": node.node_id, "boot_id": node.boot_id,
            "containment": mode_of(node.cgroups),
            "engines": [engine_status(e, node.clock, node.kernel_boot)
                        for e in node.engines.values()],
            **{key: part() for key, part in node.status_parts.items()}}


def engine_status(e: EngineRuntime, clock: Clock, kernel_boot: str) -> dict[str, Any]:
    running = (e.state.running or e.state == S.STOPPING) and e.main not in e.dead
    next_launch = None
    if e.backoff_until is not None and e.state == S.BACKOFF:
        next_launch = clock.to_wall(e.backoff_until)
    return {
        "id": e.id, "state": str(e.state), "paused": e.paused is not None,
        "pid": e.main.pid if e.main and running else None,
        "process": process_identity(kernel_boot, e.main) if e.main and running else None,
        "incarnation": e.incarnation, "restarts": e.restarts, "url": e.cfg.url,
        "last_failure": e.last_failure.to_json() if e.last_failure else None,
        "since": e.state_since, "external": e.external,
        "restart_policy": e.cfg.restart_policy, "deferred_waiting": e.deferred_waiting,
        "next_launch": next_launch,
        "pause_deadline": e.paused.deadline if e.paused else None,
        "gpus": list(e.cfg.gpus), "ports": list(e.cfg.ports),
        "group": e.cfg.group, "tp_size": e.tp_size, "origin": e.origin,
        "kill": {"phase": e.kill.phase.value, "waiting_for": e.kill.problems}
        if e.kill else None,
    }


def process_identity(kernel_boot: str, key: ProcKey) -> str:
    """Names the incarnation's main process, never another one (pid, its start time and the
    kernel's boot): the coordinator keys the weights a refit gave on it, so a fresh process can
    never inherit them, even from a daemon that lost its state file."""
    return f"{kernel_boot}:{key.pid}:{key.start_time!r}"
