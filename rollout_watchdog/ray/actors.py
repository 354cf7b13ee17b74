"""The two Ray actors of a fleet: the coordinator, and one node watchdog per Ray node.

`CoordinatorActor` embeds the `Coordinator` (a thread of its own in the actor) and keeps a
watchdog actor on every alive Ray node: at `start`, then every `watch_s` from a thread, so a
node that joins later gets its own within seconds. With CURVE it holds the keys: its own
keypair, the clients' keypair (handed out with `info`), and `authorized/`, where each node
watchdog registers its node's public key.

`NodeWatchdog` runs its node's daemon (`rollout-watchdog run`) as a process apart
(`daemon_process`): the actor is not the engines' lifeline. A restarted actor keeps the running
daemon, and replaces one that died (the new one adopts the engines from the state dir).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import RayError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from rollout_watchdog.common.errors import CommandRefused, RolloutWatchdogError
from rollout_watchdog.common.keys import ClientKeys, keygen, load_keypair, load_public
from rollout_watchdog.common.ports import free_port
from rollout_watchdog.common.protocol import NODE_ERRORS
from rollout_watchdog.common.validate import check_engine_id
from rollout_watchdog.ray import daemon_process
from rollout_watchdog.ray.layout import (
    NodeLayout,
    flocked,
    node_config,
    tail,
    tcp_endpoint,
    to_toml,
    write_atomic,
)
from rollout_watchdog.ray.placement import PlacedEngines
from rollout_watchdog.ray.runtime import COORDINATOR, alive_nodes, node_ip, ray_dirs, remote
from rollout_watchdog.refit_bridge.client import FleetClient
from rollout_watchdog.refit_bridge.coordinator import Coordinator
from rollout_watchdog.refit_bridge.keyed_client import KeyedFleetClient
from rollout_watchdog.watchdog.process import ProcKey, is_alive, proc_key

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

log = logging.getLogger(__name__)
NODE_PREFIX = "node-"
CLIENT_KEY = "ray-client"
COORDINATOR_PUBLIC = "coordinator.key"
MAX_RECREATE_S = 300.0   # the longest wait before a watchdog that keeps dying is made again
REAUTHORIZE_S = 10.0     # asking the coordinator again for keys a watchdog already has
FORGET_TIMEOUT_S = 5.0   # each control call that takes a launched engine out of the books
DYING_S = 2.0            # a daemon that dropped the connection to stop() is gone within this
STABLE_S = 600.0         # a watchdog alive this long since it was made starts afresh


def gone_for_good(refusal: CommandRefused, ray_node_alive: bool) -> bool:
    """Whether an engine whose `remove` was refused can be forgotten: its node answered (no
    such engine: removed already), or its Ray node died (its engines went with the raylet).
    Not when the node did not answer (unreachable, unknown yet to a restarted coordinator,
    silent): it may still run."""
    answered = refusal.code == NODE_ERRORS and not refusal.missing
    return answered or not ray_node_alive


def recreate_due(tries: int, last: float, now: float, watch_s: float) -> bool:
    """Whether to make a node's watchdog again, `tries` made already (the last at `last`)
    and gone: at once the first time, then after a wait that doubles from 2 x `watch_s` up to
    MAX_RECREATE_S (one whose daemon cannot start was made again every `watch_s`)."""
    return tries == 0 or now >= last + min(MAX_RECREATE_S, watch_s * 2 ** tries)


def node_actor_name(node_id: str) -> str:
    return f"{NODE_PREFIX}{node_id}"


def _roots(settings: dict[str, Any]) -> tuple[Path, Path]:
    """(state root, log root) of this node: `start`'s, else the Ray session's."""
    session, logs = ray_dirs()
    state = Path(settings["state_dir"]) if settings["state_dir"] else session / "rollout_watchdog"
    return state, Path(settings["log_dir"]) if settings["log_dir"] else logs


def client_of(info: dict[str, Any]) -> FleetClient:
    """A client of the fleet, from a coordinator actor's `info()`."""
    if info["keys"] is None:
        return FleetClient(info["endpoint"])
    public, secret, server = (k.encode() for k in info["keys"])
    return KeyedFleetClient(info["endpoint"], ClientKeys(public, secret, server))


class CoordinatorActor:
    """The fleet's coordinator as a detached named actor (see the module docstring)."""

    def __init__(self, settings: dict[str, Any]) -> None:
        self.settings = settings
        self.namespace: str = settings["namespace"]
        state_root, _ = _roots(settings)
        self.dir = state_root / self.namespace / "coordinator"
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.host = node_ip()
        self.keys = self._keys() if settings["curve"] else None
        # one registration at a time: calls run in threads (max_concurrency), and two for one
        # node (queued while this actor did not answer) raced on their files
        self._authorizing = threading.Lock()
        self._node_actor = remote(NodeWatchdog)
        port_file = self.dir / "port"   # a restarted actor binds the same port: nodes redial it
        saved = int(port_file.read_text()) if port_file.exists() else None
        try:
            self.coordinator = self._serving_on(saved or free_port(self.host))
        except ValueError as exc:   # taken meanwhile: a fresh port, the nodes told of it
            if saved is None:
                raise
            log.warning("%s: serving on a fresh port", exc)
            self.coordinator = self._serving_on(free_port(self.host))
        write_atomic(port_file, self.coordinator.endpoint.rsplit(":", 1)[1])
        # This actor's endpoint, and since when: a node watchdog keeps the newest it was told
        self.since = time.time()
        self._pointed: set[str] = set()   # node watchdogs told of this endpoint
        self._pointing: dict[str, Any] = {}   # watchdog: its point_to call, until it answers
        self._made: dict[str, tuple[int, float]] = {}   # watchdog: (times made, when last)
        self.placed = PlacedEngines(self.dir / "placed.json")
        self._stop = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="rw-ray-nodes", daemon=True)
        self._watcher.start()

    def _serving_on(self, port: int) -> Coordinator:
        coordinator = Coordinator(
            bind=tcp_endpoint(self.host, port), keys=str(self.keys) if self.keys else None,
            insecure=self.keys is None, router_url=self.settings["router_url"],
            state_dir=str(self.dir / "state"), **self.settings["coordinator_options"])
        coordinator.start()   # (ValueError if the port cannot be bound)
        return coordinator

    def _keys(self) -> Path:
        """The keys dir: the coordinator's and the clients' keypairs, `authorized/`."""
        keys = Path(self.settings["keys"]) if self.settings["keys"] else self.dir / "keys"
        for name in (COORDINATOR, CLIENT_KEY):
            if not (keys / f"{name}.key_secret").exists():
                keygen(keys, name)
        authorized = keys / "authorized"
        authorized.mkdir(mode=0o700, exist_ok=True)
        write_atomic(authorized / f"{CLIENT_KEY}.key", (keys / f"{CLIENT_KEY}.key").read_text())
        return keys

    def info(self) -> dict[str, Any]:
        """What a client needs: the endpoint, and with CURVE the keys (z85 text)."""
        keys = None
        if self.keys is not None:
            public, secret = load_keypair(self.keys / f"{CLIENT_KEY}.key_secret")
            server = load_public(self.keys / f"{COORDINATOR}.key")
            keys = [public.decode(), secret.decode(), server.decode()]
        return {"endpoint": self.coordinator.endpoint, "keys": keys,
                "node_id": ray.get_runtime_context().get_node_id()}

    def authorize(self, node_id: str, public_key: str) -> str | None:
        """Let node `node_id` in with this public key (a NAME.key file's text); the
        coordinator's public key file text for its config (None without CURVE)."""
        if self.keys is None:
            return None
        if (problem := check_engine_id(node_id)) is not None:
            raise ValueError(f"node id: {problem}")
        received = self.dir / f"{node_id}.key.received"
        with self._authorizing:
            write_atomic(received, public_key)
            load_public(received)   # ValueError if not a key: authorized/ stays readable
            received.replace(self.keys / "authorized" / f"{node_id}.key")
            self.coordinator.reload_keys()
        return (self.keys / f"{COORDINATOR}.key").read_text()

    def ensure_nodes(self) -> list[str]:
        """A watchdog actor on every alive Ray node (get it by name, else create it: Ray's
        `get_if_exists` settles a race of two creators); the names of those actors."""
        self._settle_pointing()
        names = []
        endpoint = self.coordinator.endpoint
        node_settings = {**self.settings, "coordinator": endpoint, "coordinator_since": self.since}
        existing = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                    if a["namespace"] == self.namespace}   # one call, not one per node
        now = time.monotonic()
        for node in alive_nodes():
            name = node_actor_name(node["NodeID"])
            names.append(name)
            tries, last = self._made.get(name, (0, 0.0))
            if name in existing:
                if tries and now - last >= STABLE_S:
                    del self._made[name]
                if name not in self._pointed:   # made by an earlier coordinator actor, maybe
                    with contextlib.suppress(ValueError):   # (elsewhere, or on another port)
                        self._pointing[name] = ray.get_actor(
                            name, namespace=self.namespace).point_to.remote(endpoint, self.since)
                        self._pointed.add(name)
                continue
            if not recreate_due(tries, last, now, self.settings["watch_s"]):
                continue   # it died since it was made: its daemon cannot start, say
            self._made[name] = (tries + 1, now)
            self._pointed.add(name)
            with contextlib.suppress(ValueError):   # alive here, gone a moment later
                self._node_actor.options(
                    name=name, namespace=self.namespace, get_if_exists=True,
                    lifetime="detached", num_cpus=0, num_gpus=0, max_restarts=-1,
                    max_concurrency=4,
                    scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"],
                                                                       soft=False),
                ).remote(node_settings)
        return names

    def _settle_pointing(self) -> None:
        """A watchdog whose point_to call failed is told again in this round: its actor died
        as the call came, and the one Ray made again dials where its creation said (an earlier
        coordinator's endpoint), for good if nobody tells it."""
        if not self._pointing:
            return
        calls = list(self._pointing.values())
        answered = set(ray.wait(calls, num_returns=len(calls), timeout=0)[0])
        for name, call in list(self._pointing.items()):
            if call not in answered:
                continue   # (a watchdog that hangs is told once it answers, or fails)
            self._pointing.pop(name, None)   # (a concurrent round may have taken it)
            try:
                ray.get(call)
            except RayError as exc:
                log.warning("%s was not told where the coordinator is (%s): telling it again",
                            name, exc)
                self._pointed.discard(name)

    def track(self, group: str, names: list[str]) -> None:
        """These launched engines hold the bundles of placement group `group` (hex id): they
        are removed once Ray removes the group."""
        self.placed.add(group, names)

    def _remove_unplaced(self) -> None:
        """Remove the engines of the placement groups that Ray removed. One its node says is
        gone already (the node answered an error: no such engine) is forgotten, as is one of
        a Ray node that died (its engines went with its raylet); one whose node does not
        answer now (unreachable, not heard from yet) is tried again next round."""
        if not self.placed.groups:
            return
        removed = self.placed.removed(ray.util.placement_group_table())
        if not removed:
            return
        alive = {node["NodeID"] for node in alive_nodes()}
        client = client_of(self.info())
        try:
            for group, names in removed.items():
                left = False
                for name in names:
                    try:
                        client.remove(name)
                        log.info("%s removed: its placement group %s is gone", name, group)
                    except CommandRefused as exc:
                        if gone_for_good(exc, name.split("/")[0] in alive):
                            log.warning("%s (placement group %s gone): %s", name, group, exc)
                        else:
                            log.warning("cannot remove %s yet: %s", name, exc)
                            left = True
                    except RolloutWatchdogError as exc:
                        log.warning("cannot remove %s yet: %s", name, exc)
                        left = True
                if not left:
                    self.placed.forget(group)
        finally:
            client.close()

    def _watch(self) -> None:
        while not self._stop.wait(self.settings["watch_s"]):
            try:
                self.ensure_nodes()
                self._remove_unplaced()
            except Exception:   # the GCS unreachable for a moment: the next round retries
                log.exception("cannot keep the fleet's watchdogs and placements")

    def stop_watching(self) -> None:
        """No more watchdogs (`shutdown`, before it stops them)."""
        self._stop.set()
        self._watcher.join(timeout=self.settings["watch_s"] + 30)

    def stop(self) -> None:
        """The fleet's end (`shutdown`): its port is let go for good (a later fleet binds a
        free one; this one may be someone else's by then)."""
        self.stop_watching()
        self.coordinator.stop()
        (self.dir / "port").unlink(missing_ok=True)
        self.placed.clear()


class NodeWatchdog:
    """One Ray node's watchdog actor (see the module docstring)."""

    def __init__(self, settings: dict[str, Any]) -> None:
        self.settings = dict(settings)
        self.node_id = ray.get_runtime_context().get_node_id()
        self.host = node_ip()
        state_root, log_root = _roots(settings)
        self.layout = NodeLayout.of(self.node_id, state_root, log_root, settings["namespace"])
        self.layout.prepare()
        pointed = self._pointed_file()   # a restarted actor gets its creation's settings back
        if pointed is not None and pointed[1] > self.settings.get("coordinator_since", 0.0):
            self.settings["coordinator"], self.settings["coordinator_since"] = pointed
        self.raylet = daemon_process.find_raylet(os.environ, os.getppid())   # its lifeline
        self.raylet_key = proc_key(self.raylet)
        self.daemon: ProcKey | None = None
        self.metrics_port: int | None = None
        self.kept = False           # the daemon was running already when this actor began
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.ensure_daemon()
        self._watcher = threading.Thread(target=self._watch, name="rw-ray-daemon", daemon=True)
        self._watcher.start()

    def _pointed_file(self) -> tuple[str, float] | None:
        try:
            saved = json.loads((self.layout.node_dir / "coordinator.json").read_text())
            return str(saved["endpoint"]), float(saved["since"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def point_to(self, endpoint: str, since: float) -> bool:
        """The coordinator actor serving since `since` is at `endpoint`. When that is news (a
        coordinator actor made again elsewhere, or on another port), the daemon is told to go
        and leave its engines running (SIGUSR2), and the one that replaces it adopts them and
        dials `endpoint` (with CURVE, with the coordinator's key asked again). Whether the
        daemon is replaced."""
        with self._lock:
            if since <= self.settings.get("coordinator_since", 0.0):
                return False
            moved = endpoint != self.settings["coordinator"]
            self.settings["coordinator"], self.settings["coordinator_since"] = endpoint, since
            daemon = self.daemon
            try:   # for this actor made again by Ray (its creation names an older endpoint)
                write_atomic(self.layout.node_dir / "coordinator.json",
                              json.dumps({"endpoint": endpoint, "since": since}), 0o600)
            except OSError as exc:   # (a full disk): the daemon is re-pointed all the same
                log.error("cannot save where the coordinator is (%s): if Ray makes this actor "
                          "again, its daemon dials the endpoint of its creation", exc)
        if not moved or daemon is None or not is_alive(daemon):
            return False
        log.warning("the coordinator is at %s now: replacing node daemon %d (it leaves its "
                    "engines to the next)", endpoint, daemon.pid)
        os.kill(daemon.pid, signal.SIGUSR2)
        return True

    def _curve(self) -> tuple[str | None, str | None]:
        """This node's keypair (made once) registered with the coordinator; the key paths
        for the node config, or (None, None) without CURVE. A coordinator that does not
        answer (its node died, it is restarting) leaves the keys registered before: a daemon
        that died is replaced all the same, with what its predecessor had."""
        if not self.settings["curve"]:
            return None, None
        keys = self.layout.keys_dir
        secret, server_key = keys / f"{self.node_id}.key_secret", keys / COORDINATOR_PUBLIC
        if not secret.exists():
            keygen(keys, self.node_id)
        # with keys registered before, a coordinator that cannot answer (its node died: its
        # actor unschedulable) must not hold up a dead daemon's replacement for long
        wait = min(REAUTHORIZE_S, self.settings["timeout_s"]) if server_key.exists() \
            else self.settings["timeout_s"]
        try:
            coordinator = ray.get_actor(COORDINATOR, namespace=self.settings["namespace"])
            server = ray.get(coordinator.authorize.remote(
                self.node_id, (keys / f"{self.node_id}.key").read_text()), timeout=wait)
        except (ValueError, RayError) as exc:
            if not server_key.exists():
                raise
            log.warning("the coordinator actor does not answer (%s): the node keeps the keys "
                        "it registered before", exc)
        else:
            write_atomic(server_key, server)
        return str(secret), str(server_key)

    def ensure_daemon(self) -> None:
        """Keep the node's running daemon, else start one; never two (the spawn lock, and
        the daemon's own lock on its state dir)."""
        layout, timeout = self.layout, self.settings["timeout_s"]
        with self._lock, flocked(layout.spawn_lock):
            if (running := self._running(timeout)) is not None:
                self.daemon, self.kept = running, self.daemon is None
                config = tomllib.loads(layout.config_path.read_text())
                self.metrics_port = config.get("metrics_port")
                if config.get("coordinator") != self.settings["coordinator"]:
                    os.kill(running.pid, signal.SIGUSR2)   # it dials an old endpoint: the
                return                                     # watch replaces it (adopting)
            key, coordinator_key = self._curve()
            self.metrics_port = free_port(self.host)
            config = node_config(layout, coordinator=self.settings["coordinator"],
                                 metrics_host=self.host, metrics_port=self.metrics_port,
                                 lifeline_pid=self.raylet, key=key,
                                 coordinator_key=coordinator_key,
                                 extra=self.settings["node_config"])
            write_atomic(layout.config_path, to_toml(config), 0o600)
            started = daemon_process.spawn_detached(
                daemon_process.daemon_argv(layout.config_path),
                daemon_process.daemon_environment(
                    os.environ, daemon_process.process_environ(self.raylet)),
                layout.daemon_log)
            deadline = time.monotonic() + timeout
            while not daemon_process.ping(layout.control, self.node_id, 1.0):
                if not is_alive(started) or time.monotonic() > deadline:
                    raise RuntimeError(f"the node daemon did not come up ({layout.daemon_log}"
                                       f" ends with):\n{tail(layout.daemon_log)}")
                time.sleep(0.1)
            log.info("node daemon %d started on node %s", started.pid, self.node_id)
            self.daemon = started

    def _running(self, timeout_s: float) -> ProcKey | None:
        """The node's daemon if one runs: it holds its state dir's lock, and answers (a
        daemon still starting is waited for)."""
        deadline = time.monotonic() + timeout_s
        lock = self.layout.state_dir / "daemon.lock"
        while (pid := daemon_process.held_lock_pid(lock)) is not None:
            if pid and daemon_process.ping(self.layout.control, self.node_id, 1.0):
                return proc_key(pid)
            if time.monotonic() > deadline:
                raise RuntimeError(f"node daemon {pid} holds {self.layout.state_dir} but "
                                   f"does not answer on {self.layout.control}")
            time.sleep(0.1)
        return None

    def _watch(self) -> None:
        """Replace a daemon that died (it adopts the engines), until the raylet is gone: then
        the node is, and its daemon ended with it (its lifeline). This actor can outlive its
        raylet for minutes; a daemon started then would find its lifeline gone and exit, and
        the next, a second later, too (a suite run: 72 of them in 90 s, the node reachable
        throughout)."""
        while not self._stop.wait(self.settings["daemon_check_s"]):
            if self.daemon is None or is_alive(self.daemon):
                continue
            if self.raylet_key is None or not is_alive(self.raylet_key):
                log.warning("node daemon %d is gone with the raylet (%d): its node is gone, "
                            "and no daemon is started again", self.daemon.pid, self.raylet)
                return
            log.warning("node daemon %d is gone: starting another", self.daemon.pid)
            try:
                self.ensure_daemon()
            except Exception:
                log.exception("cannot start the node daemon; trying again")

    def info(self) -> dict[str, Any]:
        return {"node_id": self.node_id, "daemon_pid": self.daemon.pid if self.daemon else None,
                "kept": self.kept, "metrics_port": self.metrics_port,
                "control": self.layout.control, "state_dir": str(self.layout.state_dir),
                "log_dir": str(self.layout.log_dir), "raylet_pid": self.raylet,
                "actor_pid": os.getpid()}

    def stop(self, timeout_s: float) -> bool:
        """Watch no more, take the launched engines out of the daemon's books (no later
        daemon brings them back), and stop the daemon (it stops its engines first); whether it
        ended in time. One SIGKILLed after `timeout_s` (hung, stopped) leaves its engines
        running: a new daemon adopts them and is stopped in turn."""
        self._stop.set()
        self._watcher.join(timeout=self.settings["daemon_check_s"] + timeout_s)
        for _ in range(2):   # (the second: the engines of a daemon killed after timeout_s)
            self._forget_launched(timeout_s)
            with self._lock:
                daemon, self.daemon = self.daemon, None
            if daemon is None or daemon_process.stop(daemon, timeout_s):
                return True
            self.daemon = daemon   # dead now: the next round's daemon adopts its engines
        return False

    def _forget_launched(self, timeout_s: float) -> None:
        for _ in range(2):   # (a daemon found dying, SIGKILLed a moment ago: replaced once)
            if self.daemon is not None and not is_alive(self.daemon):
                try:   # its engines run on, unwatched: a daemon adopts them, to stop them
                    self.ensure_daemon()
                except Exception:
                    log.exception("cannot start a node daemon to stop the engines of the last")
            daemon = self.daemon
            if daemon is None or not is_alive(daemon):
                break
            if daemon_process.forget_launched(self.layout.control,
                                              min(FORGET_TIMEOUT_S, timeout_s)) \
                    or not daemon_process.wait_gone(daemon, DYING_S):
                break   # (it answered, or it lives on without answering: its stop stops all)
