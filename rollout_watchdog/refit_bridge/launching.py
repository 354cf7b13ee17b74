"""`FleetClient.launch` and `FleetClient.remove`: engines added to a node and taken away at run
time, through the coordinator, which forwards the node commands `launch` and `remove`
(watchdog/runtime_engines.py) to the node named. Kept out of client.py, which holds the
connection machinery."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from rollout_watchdog.common import protocol
from rollout_watchdog.common.errors import (
    CommandRefused,
    CoordinatorUnavailable,
    RolloutWatchdogError,
)
from rollout_watchdog.common.spec import EngineSpec
from rollout_watchdog.refit_bridge.client import GATHER_SHARE, POLL_INTERVAL_S, FleetClient
from rollout_watchdog.refit_bridge.views import EngineView, FleetResult


def launch_engine(client: FleetClient, node_id: str, spec: EngineSpec | Mapping[str, Any],
                  wait_s: float | None, timeout_s: float | None) -> EngineView:
    """Launch `spec` on `node_id`; its view, once healthy with `wait_s` (see FleetClient)."""
    if not isinstance(node_id, str) or not node_id or "/" in node_id:
        raise ValueError(f"name the node by its node_id, got {node_id!r}")
    if wait_s is not None and not wait_s > 0:
        raise ValueError(f"wait_s must be > 0, got {wait_s!r}")
    table = spec.to_table() if isinstance(spec, EngineSpec) else dict(spec)
    request_id, result = client.call("launch", {"spec": table}, node=node_id,
                                     timeout_s=timeout_s)
    answer = FleetResult.from_json(request_id, result).nodes.get(node_id)
    status = answer.result.get("status") if answer and isinstance(answer.result, dict) else None
    if not isinstance(status, dict):
        raise RolloutWatchdogError(f"node {node_id} answered the launch without the engine's "
                                   f"status: {str(answer)[:80]}")
    view = EngineView.from_json(node_id, True, status)
    if wait_s is None:
        return view
    return _wait_healthy(client, view, wait_s)


def _wait_healthy(client: FleetClient, launched: EngineView, wait_s: float) -> EngineView:
    """The engine's view from the coordinator once it is healthy (this launch's incarnation or
    a later one); TimeoutError naming what was last seen otherwise."""
    deadline = time.monotonic() + wait_s
    last, problem = None, ""
    first = max(1, launched.incarnation)
    while True:
        left = deadline - time.monotonic()
        try:
            views = client.engines(node=launched.node_id,
                                   timeout_s=max(0.1, min(client.timeout_s, left)))
        except CoordinatorUnavailable:
            views = []
        except CommandRefused as exc:   # a coordinator restarted without a state dir knows
            if exc.code != protocol.UNKNOWN_NODE:   # the node again once it says hello
                raise
            views = []
        for view in views:
            if view.id == launched.id:
                last = view
                if view.state == "healthy" and view.incarnation >= first:
                    return view
        if left <= 0:
            break
        time.sleep(max(0.0, min(POLL_INTERVAL_S, deadline - time.monotonic())))
    if last is not None:
        failure = last.last_failure or {}
        problem = f"; it is {last.state}, incarnation {last.incarnation}" + (
            f", last failure {failure.get('cause')}: {failure.get('detail')}" if failure else "")
    raise TimeoutError(f"engine {launched.name} was not healthy within {wait_s:g} s{problem}")


def remove_engine(client: FleetClient, target: str, node: str | None, wait_s: float | None,
                  timeout_s: float | None) -> FleetResult:
    """`remove` NODE/ENGINE; with `wait_s`, the node answers once the engine is gone."""
    wait = client.timeout_s if timeout_s is None else timeout_s
    args: dict[str, Any] = {}
    if wait_s is not None:
        args["wait_s"] = wait_s
        wait += wait_s / GATHER_SHARE   # the coordinator gathers for longer than the node waits
    return client.command("remove", target, node=node, args=args, timeout_s=wait)
