"""`start`, `fleet` and `shutdown`: the fleet's life on a Ray cluster (docs/ray.md)."""

from __future__ import annotations

import contextlib
import inspect
import ipaddress
import logging
import time
from collections.abc import Mapping
from typing import Any

import ray
from ray.exceptions import ActorUnschedulableError, GetTimeoutError, RayActorError, RayError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from rollout_watchdog.common.errors import RolloutWatchdogError
from rollout_watchdog.ray import daemon_process
from rollout_watchdog.ray.actors import NODE_PREFIX, CoordinatorActor, client_of
from rollout_watchdog.ray.layout import check_extra
from rollout_watchdog.ray.runtime import COORDINATOR, alive_nodes, remote
from rollout_watchdog.refit_bridge.client import FleetClient
from rollout_watchdog.refit_bridge.coordinator import Coordinator

log = logging.getLogger(__name__)
NAMESPACE = "rollout-watchdog"
START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 60.0
WATCH_S = 2.0            # how often the coordinator actor looks for new Ray nodes
DAEMON_CHECK_S = 1.0     # how often a watchdog actor checks that its daemon lives
_POLL_S = 0.2


def start(namespace: str = NAMESPACE, router_url: str | None = None,
          state_dir: str | None = None, keys: str | bool | None = None, *,
          log_dir: str | None = None, node_timeout_s: float | None = None,
          node_config: Mapping[str, Any] | None = None,
          timeout_s: float = START_TIMEOUT_S, watch_s: float = WATCH_S,
          daemon_check_s: float = DAEMON_CHECK_S,
          coordinator_options: Mapping[str, Any] | None = None) -> FleetClient:
    """Run the fleet on the Ray cluster of `ray.init()`, or join the one running in
    `namespace` (then the other arguments are the running fleet's, not these); its client
    once every alive node's daemon is reachable, at most `timeout_s` (else TimeoutError).

    `keys`: None for CURVE unless every Ray node's address is a loopback one, True for CURVE,
    False for none, or the directory of the coordinator's keys (made if missing). `state_dir`
    and `log_dir` are roots on every node (default: the Ray session's dir and its log dir).
    `node_config`: node config keys for every daemon (`[probe]`, `[restart]`, ...).
    `node_timeout_s` and `coordinator_options`: the embedded `Coordinator`'s arguments.
    `watch_s`: how often the coordinator actor looks for new Ray nodes; `daemon_check_s`: how
    often each watchdog actor checks that its daemon lives (one that died is replaced)."""
    if not ray.is_initialized():
        raise RuntimeError("call ray.init() before rollout_watchdog.ray.start()")
    check_extra(node_config or {})   # here, not in an actor on every node
    for name, value in (("timeout_s", timeout_s), ("watch_s", watch_s),
                        ("daemon_check_s", daemon_check_s), ("node_timeout_s", node_timeout_s)):
        if value is not None and not (isinstance(value, (int, float)) and value > 0):
            raise ValueError(f"{name} must be a number of seconds > 0, got {value!r}")
    known = set(inspect.signature(Coordinator).parameters) - {"bind", "keys", "insecure",
                                                              "router_url", "state_dir"}
    if unknown := sorted(set(coordinator_options or {}) - known):
        raise ValueError(f"coordinator_options: unknown {', '.join(unknown)} (known: "
                         f"{', '.join(sorted(known))})")
    options = dict(coordinator_options or {})
    if node_timeout_s is not None:
        options["node_timeout_s"] = node_timeout_s
    settings = {"namespace": namespace, "router_url": router_url, "state_dir": state_dir,
                "log_dir": log_dir, "keys": keys if isinstance(keys, str) else None,
                "curve": _curve_wanted(keys), "node_config": dict(node_config or {}),
                "coordinator_options": options, "timeout_s": timeout_s, "watch_s": watch_s,
                "daemon_check_s": daemon_check_s}
    here = ray.get_runtime_context().get_node_id()
    coordinator = remote(CoordinatorActor).options(
        name=COORDINATOR, namespace=namespace, get_if_exists=True, lifetime="detached",
        num_cpus=0, num_gpus=0, max_restarts=-1, max_concurrency=8,
        scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False),
    ).remote(settings)
    deadline = time.monotonic() + timeout_s
    try:
        names = _answer(coordinator.ensure_nodes, namespace, timeout_s)
    except RayActorError as exc:   # its constructor failed (its port taken, say)
        raise RuntimeError(f"the coordinator actor did not start: {exc}") from exc
    client = client_of(_answer(coordinator.info, namespace,
                               max(1.0, deadline - time.monotonic())))
    up = _watchdogs_up(namespace, names, max(1.0, deadline - time.monotonic()))
    wait_reachable(client, up, max(1.0, deadline - time.monotonic()))
    return client


def _watchdogs_up(namespace: str, names: list[str], timeout_s: float) -> list[str]:
    """The node ids whose watchdog runs its daemon. A node that died meanwhile (its actor
    unschedulable: hard affinity) is left out, logged; TimeoutError names the slow ones."""
    refs = {}
    for name in names:
        try:
            refs[name] = ray.get_actor(name, namespace=namespace).info.remote()
        except ValueError:   # its node died, and the actor with it
            log.warning("%s: gone before it started", name)
    ready, slow = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
    if slow:
        raise TimeoutError(f"watchdog(s) not up within {timeout_s:g} s: " + ", ".join(
            name for name, ref in refs.items() if ref in slow))
    up = []
    for name, ref in refs.items():
        try:
            up.append(ray.get(ref)["node_id"])
        except ActorUnschedulableError as exc:
            log.warning("%s left out: %s", name, exc)
        except RayError as exc:
            raise RuntimeError(f"the watchdog {name} did not start: {exc}") from exc
    return up


def _curve_wanted(keys: str | bool | None) -> bool:
    if isinstance(keys, bool):
        return keys
    if keys is not None:
        return True
    return not all(_loopback(n["NodeManagerAddress"]) for n in alive_nodes())


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def wait_reachable(client: FleetClient, node_ids: list[str], timeout_s: float) -> None:
    """Until every node of `node_ids` is reachable at the coordinator; TimeoutError naming the
    others."""
    deadline = time.monotonic() + timeout_s
    while True:
        reachable = {n.node_id for n in client.nodes() if n.reachable}
        missing = sorted(set(node_ids) - reachable)
        if not missing:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"node(s) not reachable within {timeout_s:g} s: "
                               f"{', '.join(missing)}")
        time.sleep(_POLL_S)


def fleet(namespace: str = NAMESPACE, timeout_s: float = START_TIMEOUT_S) -> FleetClient:
    """The client of the fleet running in `namespace`, from any driver, task or actor of the
    cluster; RolloutWatchdogError when none runs there, TimeoutError when its coordinator
    actor does not answer within `timeout_s` (starting still, or its node hangs)."""
    coordinator = _named(COORDINATOR, namespace)
    if coordinator is None:
        raise RolloutWatchdogError(f"no rollout-watchdog fleet runs in Ray namespace "
                                   f"{namespace!r}: call rollout_watchdog.ray.start()")
    return client_of(_answer(coordinator.info, namespace, timeout_s))


def _answer(method: Any, namespace: str, timeout_s: float) -> Any:
    """The coordinator actor's answer to `method()`; TimeoutError naming it after
    `timeout_s` (Ray's own says only "Get timed out: some object(s) not ready")."""
    try:
        return ray.get(method.remote(), timeout=timeout_s)
    except GetTimeoutError as exc:
        raise TimeoutError(f"the coordinator actor ({COORDINATOR!r} in Ray namespace "
                           f"{namespace!r}) did not answer within {timeout_s:g} s (its "
                           "worker or node hangs, say; `ray list actors` shows its state)"
                           ) from exc


def shutdown(namespace: str = NAMESPACE, timeout_s: float = STOP_TIMEOUT_S) -> None:
    """Stop every node daemon (each takes its launched engines out of its books, then stops
    its engines and exits: every node at once) and the coordinator, and end their actors.
    Nothing runs in `namespace` after, even when the coordinator's actor is gone or does not
    answer (its node died, say). A watchdog actor that does not answer within `timeout_s`
    (its worker hangs) is killed, and a task on its node stops its daemon."""
    coordinator = _named(COORDINATOR, namespace)
    if coordinator is not None:
        try:
            ray.get(coordinator.stop_watching.remote(), timeout=timeout_s)   # no new watchdogs
        except RayError as exc:   # ended first: once it answered again, its watch's next
            log.warning("the coordinator actor does not answer (%s): killed, and the node "
                        "watchdogs stopped all the same", exc)   # round would make them again
            ray.kill(coordinator, no_restart=True)
            coordinator = None
    names = sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                   if a["namespace"] == namespace and a["name"].startswith(NODE_PREFIX))
    nodes = [(name, actor) for name in names if (actor := _named(name, namespace)) is not None]
    deadline = time.monotonic() + 4 * timeout_s + 60   # (a watchdog's own stop: its watch's
    # last round, a replacement daemon if the last died, the launched engines forgotten, the
    # daemon's stop, and one more daemon's if it had to be killed)
    nodes, hung = _answering(nodes, timeout_s)
    stops = [actor.stop.remote(timeout_s) for _, actor in nodes]   # every node at once
    stops_hung = [_stop_hung(namespace, name, actor, timeout_s) for name, actor in hung]
    for (name, actor), stopped in zip(nodes, stops, strict=True):
        try:
            if not ray.get(stopped, timeout=max(0.1, deadline - time.monotonic())):
                log.error("%s: its daemon did not stop within %g s", name, timeout_s)
        except RayError as exc:   # its node is gone, and its daemon with it (the lifeline)
            log.warning("%s: %s", name, exc)
        ray.kill(actor, no_restart=True)
    for (name, _), stopped in zip(hung, stops_hung, strict=True):
        if stopped is None:
            continue
        try:
            if late := ray.get(stopped, timeout=max(0.1, deadline - time.monotonic())):
                log.error("%s: daemon(s) %s did not stop within %g s: killed (their engines "
                          "may be left)", name, late, timeout_s)
        except RayError as exc:   # (cancelled: run late, it would stop a later fleet's)
            log.error("%s: its daemon may be left running: %s", name, exc)
            with contextlib.suppress(RayError, ValueError, TypeError):
                ray.cancel(stopped, force=True)
    if coordinator is None:
        return
    try:
        ray.get(coordinator.stop.remote(), timeout=timeout_s)
    except RayError as exc:
        log.warning("the coordinator actor did not stop: %s", exc)
    finally:
        ray.kill(coordinator, no_restart=True)


def _answering(nodes: list[tuple[str, Any]], timeout_s: float
               ) -> tuple[list[tuple[str, Any]], list[tuple[str, Any]]]:
    """(the watchdog actors that answer within `timeout_s`, those that do not): one that
    hangs (its worker stopped) would hold shutdown() for the whole of its stop's bound."""
    calls = [actor.info.remote() for _, actor in nodes]
    answered = set(ray.wait(calls, num_returns=len(calls), timeout=timeout_s)[0]) \
        if calls else set()
    return ([node for node, call in zip(nodes, calls, strict=True) if call in answered],
            [node for node, call in zip(nodes, calls, strict=True) if call not in answered])


def _stop_hung(namespace: str, name: str, actor: Any, timeout_s: float) -> Any:
    """Kill a watchdog actor that does not answer, and stop its node's daemon from a task on
    that node (`daemon_process.stop_daemons_of`); the task's ref, None if its node is gone
    (and its daemon with it: the lifeline)."""
    log.warning("%s does not answer within %g s: killed, and its node's daemon stopped by a "
                "task there", name, timeout_s)
    ray.kill(actor, no_restart=True)
    node_id = name[len(NODE_PREFIX):]
    if node_id not in {node["NodeID"] for node in alive_nodes()}:
        return None
    return ray.remote(daemon_process.stop_daemons_of).options(
        num_cpus=0, max_retries=0,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
    ).remote(namespace, node_id, timeout_s)


def _named(name: str, namespace: str) -> Any:
    """The named actor, or None if there is none (gone, or never created)."""
    try:
        return ray.get_actor(name, namespace=namespace)
    except ValueError:
        return None
