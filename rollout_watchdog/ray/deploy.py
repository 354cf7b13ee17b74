"""`start`, `fleet` and `shutdown`: the fleet's life on a Ray cluster (docs/ray.md)."""

from __future__ import annotations

import ipaddress
import logging
import time
from collections.abc import Mapping
from typing import Any

import ray
from ray.exceptions import RayError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from rollout_watchdog.common.errors import RolloutWatchdogError
from rollout_watchdog.common.keys import ClientKeys
from rollout_watchdog.ray.actors import COORDINATOR, NODE_PREFIX, CoordinatorActor
from rollout_watchdog.ray.runtime import alive_nodes, remote
from rollout_watchdog.refit_bridge.client import FleetClient
from rollout_watchdog.refit_bridge.keyed_client import KeyedFleetClient

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
          coordinator_options: Mapping[str, Any] | None = None) -> FleetClient:
    """Run the fleet on the Ray cluster of `ray.init()`, or join the one running in
    `namespace` (then the other arguments are the running fleet's, not these); its client
    once every alive node's daemon is reachable, at most `timeout_s` (else TimeoutError).

    `keys`: None for CURVE unless every Ray node's address is a loopback one, True for CURVE,
    False for none, or the directory of the coordinator's keys (made if missing). `state_dir`
    and `log_dir` are roots on every node (default: the Ray session's dir and its log dir).
    `node_config`: node config keys for every daemon (`[probe]`, `[restart]`, ...).
    `node_timeout_s` and `coordinator_options`: the embedded `Coordinator`'s arguments."""
    if not ray.is_initialized():
        raise RuntimeError("call ray.init() before rollout_watchdog.ray.start()")
    options = dict(coordinator_options or {})
    if node_timeout_s is not None:
        options["node_timeout_s"] = node_timeout_s
    settings = {"namespace": namespace, "router_url": router_url, "state_dir": state_dir,
                "log_dir": log_dir, "keys": keys if isinstance(keys, str) else None,
                "curve": _curve_wanted(keys), "node_config": dict(node_config or {}),
                "coordinator_options": options, "timeout_s": timeout_s, "watch_s": watch_s,
                "daemon_check_s": DAEMON_CHECK_S}
    here = ray.get_runtime_context().get_node_id()
    coordinator = remote(CoordinatorActor).options(
        name=COORDINATOR, namespace=namespace, get_if_exists=True, lifetime="detached",
        num_cpus=0, num_gpus=0, max_restarts=-1, max_concurrency=8,
        scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False),
    ).remote(settings)
    deadline = time.monotonic() + timeout_s
    names = ray.get(coordinator.ensure_nodes.remote(), timeout=timeout_s)
    client = _client(ray.get(coordinator.info.remote(), timeout=timeout_s))
    infos = ray.get([ray.get_actor(n, namespace=namespace).info.remote() for n in names],
                    timeout=max(1.0, deadline - time.monotonic()))
    wait_reachable(client, [i["node_id"] for i in infos], max(1.0, deadline - time.monotonic()))
    return client


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


def _client(info: dict[str, Any]) -> FleetClient:
    if info["keys"] is None:
        return FleetClient(info["endpoint"])
    public, secret, server = (k.encode() for k in info["keys"])
    return KeyedFleetClient(info["endpoint"], ClientKeys(public, secret, server))


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


def fleet(namespace: str = NAMESPACE) -> FleetClient:
    """The client of the fleet running in `namespace`, from any driver, task or actor of the
    cluster; RolloutWatchdogError when none runs there."""
    try:
        coordinator = ray.get_actor(COORDINATOR, namespace=namespace)
    except ValueError:
        raise RolloutWatchdogError(f"no rollout-watchdog fleet runs in Ray namespace "
                                   f"{namespace!r}: call rollout_watchdog.ray.start()") from None
    return _client(ray.get(coordinator.info.remote(), timeout=START_TIMEOUT_S))


def shutdown(namespace: str = NAMESPACE, timeout_s: float = STOP_TIMEOUT_S) -> None:
    """Remove the launched engines, stop every node daemon (each stops what is left of its
    engines) and the coordinator, and end their actors. Nothing runs in `namespace` after."""
    try:
        coordinator = ray.get_actor(COORDINATOR, namespace=namespace)
    except ValueError:
        return
    ray.get(coordinator.stop_watching.remote(), timeout=timeout_s)   # no new watchdogs
    client = _client(ray.get(coordinator.info.remote(), timeout=timeout_s))
    try:
        remove_launched(client)
    except RolloutWatchdogError as exc:   # the daemons stop their engines anyway
        log.warning("cannot remove the launched engines: %s", exc)
    finally:
        client.close()
    for name in sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                       if a["namespace"] == namespace and a["name"].startswith(NODE_PREFIX)):
        try:
            actor = ray.get_actor(name, namespace=namespace)
        except ValueError:
            continue
        try:
            if not ray.get(actor.stop.remote(timeout_s), timeout=timeout_s + 30):
                log.error("%s: its daemon did not stop within %g s", name, timeout_s)
        except RayError as exc:   # its node is gone, and its daemon with it (the lifeline)
            log.warning("%s: %s", name, exc)
        ray.kill(actor, no_restart=True)
    try:
        ray.get(coordinator.stop.remote(), timeout=timeout_s)
    finally:
        ray.kill(coordinator, no_restart=True)


def remove_launched(client: FleetClient) -> None:
    """`fleet.remove` every engine launched at run time on a reachable node."""
    for node in client.status()["nodes"]:
        if not node.get("reachable"):
            continue
        for engine in node.get("engines", []):
            if engine.get("origin") == "launched":
                client.remove(f"{node['node_id']}/{engine['id']}")
