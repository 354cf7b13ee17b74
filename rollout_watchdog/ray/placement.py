"""`launch_in_placement_group`: the frameworks' engine start, as one call (docs/ray.md); and
`PlacedEngines`, the engines each placement group's bundles hold, which the coordinator actor
removes once Ray removes the group."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rollout_watchdog.common.atomic_file import write_atomically
from rollout_watchdog.common.errors import RolloutWatchdogError
from rollout_watchdog.common.spec import EngineSpec
from rollout_watchdog.ray.runtime import COORDINATOR, node_ip
from rollout_watchdog.refit_bridge.client import FleetClient
from rollout_watchdog.refit_bridge.views import EngineView

log = logging.getLogger(__name__)
PLACEMENT_TIMEOUT_S = 600.0   # for the group to be placed (it may wait for resources)
LOOKUP_TIMEOUT_S = 120.0      # for the tasks that ask each placed bundle's GPUs
MakeSpec = Callable[[int, str, list[int], str], EngineSpec]


@ray.remote(num_cpus=0)
def _bundle_info() -> tuple[str, list[str], str]:
    """Where this task runs: its Ray node id, the GPU ids Ray gave it, the node's address."""
    ids = [str(i) for i in ray.get_gpu_ids()]
    return ray.get_runtime_context().get_node_id(), ids, node_ip()


def bundle_locations(pg: PlacementGroup, timeout_s: float = PLACEMENT_TIMEOUT_S,
                     lookup_s: float = LOOKUP_TIMEOUT_S) -> list[tuple[str, list[int], str]]:
    """(node id, GPU ids, host) of every bundle of `pg`, in bundle order: a task in each
    bundle, taking the bundle's GPUs, asks Ray (as miles' InfoActor does). TimeoutError when
    the group is not placed within `timeout_s`, or the tasks do not run within `lookup_s`
    (another actor holds part of a bundle's GPUs); ValueError for GPU ids that are not
    numbers (UUIDs, MIG devices); RolloutWatchdogError when the group is removed meanwhile."""
    try:
        ray.get(pg.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise
    except ray.exceptions.RayError as exc:
        raise _removed(pg, exc) from exc
    bundles: Sequence[dict[str, Any]] = pg.bundle_specs
    tasks = [_bundle_info.options(
        num_gpus=bundle.get("GPU", 0),
        scheduling_strategy=PlacementGroupSchedulingStrategy(
            pg, placement_group_bundle_index=index)).remote()
        for index, bundle in enumerate(bundles)]
    try:
        found = ray.get(tasks, timeout=lookup_s)
    except ray.exceptions.TaskPlacementGroupRemoved as exc:
        raise _removed(pg, exc) from exc
    except ray.exceptions.GetTimeoutError:
        for task in tasks:
            ray.cancel(task, force=True)
        raise TimeoutError(
            f"the GPUs of the placement group's bundles could not be asked within {lookup_s:g} "
            "s. The task in each bundle takes its bundle's whole GPUs, so it cannot run while "
            "another actor holds part of them (a colocated layout, a trainer actor with "
            "num_gpus=0.5 in the bundle: launch with fleet.launch() and the GPU ids your "
            "framework gave the bundle); or its worker took longer to start (a runtime env "
            "being built: give lookup_s more)") from None
    out = []
    for index, (node_id, ids, host) in enumerate(found):
        if not all(i.isdigit() for i in ids):
            raise ValueError(f"bundle {index}: Ray's GPU ids {ids} are not device numbers "
                             "(UUIDs or MIG devices): an engine spec takes numbers")
        out.append((node_id, [int(i) for i in ids], host))
    return out


def _removed(pg: PlacementGroup, exc: Exception) -> RolloutWatchdogError:
    return RolloutWatchdogError(f"placement group {pg.id.hex()} was removed before its "
                                f"bundles could be asked (nothing was launched): {exc}")


def launch_in_placement_group(fleet: FleetClient, pg: PlacementGroup, make_spec: MakeSpec,
                              wait_s: float | None = None,
                              lookup_s: float = LOOKUP_TIMEOUT_S,
                              placement_s: float = PLACEMENT_TIMEOUT_S) -> list[EngineView]:
    """Launch `make_spec(bundle_index, node_id, gpu_ids, host)` on each bundle's node, in
    bundle order (`make_spec` runs here, in the caller), once the group is placed (within
    `placement_s`, else TimeoutError); the engines' views. With `wait_s`,
    once every engine is healthy (TimeoutError otherwise). A refusal raises CommandRefused;
    the engines of the bundles before it stay launched. The engines belong to their node
    daemons, not to Ray: they hold the bundle's GPUs without a Ray actor of their own. Each
    is tracked with the group as soon as its launch is answered, before the next bundle's
    `make_spec`: a driver SIGKILLed mid-way leaves none that outlives the group."""
    views: list[EngineView] = []
    locations = bundle_locations(pg, placement_s, lookup_s)
    track = _tracker(fleet, pg.id.hex())
    for index, (node_id, gpus, host) in enumerate(locations):
        views.append(fleet.launch(node_id, make_spec(index, node_id, gpus, host)))
        track(views[-1].name)
    if wait_s is None:
        return views
    names = {(v.node_id, v.id) for v in views}
    fleet.wait_until(lambda engines: sum(e.state == "healthy" for e in engines
                                         if (e.node_id, e.id) in names) == len(names), wait_s)
    current = {(e.node_id, e.id): e for e in fleet.engines()}
    return [current[(v.node_id, v.id)] for v in views]


def _tracker(fleet: FleetClient, group: str) -> Callable[[str], None]:
    """track(name): tell the coordinator actor of `fleet` (found by its endpoint, in any
    namespace, once) that this engine holds a bundle of placement group `group`."""
    coordinator = _coordinator_of(fleet)

    def track(name: str) -> None:
        if coordinator is None:
            log.warning("no coordinator actor serves %s: engine %s stays when placement group "
                        "%s is removed", fleet.address, name, group)
            return
        try:
            ray.get(coordinator.track.remote(group, [name]), timeout=30)
        except ray.exceptions.RayError as exc:
            log.warning("the coordinator actor did not take engine %s of placement group %s "
                        "(it stays when the group is removed): %s", name, group, exc)

    return track


def _coordinator_of(fleet: FleetClient) -> Any:
    """The coordinator actor whose endpoint `fleet` dials, or None."""
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if actor["name"] != COORDINATOR:
            continue
        try:
            coordinator = ray.get_actor(actor["name"], namespace=actor["namespace"])
            if ray.get(coordinator.info.remote(), timeout=30)["endpoint"] == fleet.address:
                return coordinator
        except (ValueError, ray.exceptions.RayError) as exc:
            log.warning("cannot ask the coordinator actor in %r: %s", actor["namespace"], exc)
    return None


class PlacedEngines:
    """The launched engines each placement group's bundles hold (group id hex -> engine
    names), kept in a file (a restarted coordinator actor goes on). A group that Ray removed
    (its job ended, `remove_placement_group`) gives its GPUs back in Ray's books: its engines
    must go too, or the next group on those GPUs would share them. Thread-safe (the actor's
    calls and its watcher)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        try:
            self.groups: dict[str, list[str]] = json.loads(path.read_text())
        except FileNotFoundError:
            self.groups = {}

    def add(self, group: str, names: list[str]) -> None:
        """These engines hold `group`'s bundles now: an engine id launched again in another
        group is that group's alone (an engine is placed once)."""
        with self._lock:
            moved = set(names)
            self.groups = {g: kept for g, held in self.groups.items()
                           if (kept := [n for n in held if n not in moved])}
            self.groups[group] = sorted({*self.groups.get(group, []), *names})
            self._save()

    def clear(self) -> None:
        """The fleet's end: a later fleet on this state dir starts with no placements."""
        with self._lock:
            self.groups = {}
            self.path.unlink(missing_ok=True)

    def removed(self, table: Mapping[str, Mapping[str, Any]]) -> dict[str, list[str]]:
        """The groups of `table` (Ray's placement group table) that are gone, with their
        engines."""
        with self._lock:
            return {group: names for group, names in self.groups.items()
                    if table.get(group, {}).get("state", "REMOVED") == "REMOVED"}

    def forget(self, group: str) -> None:
        with self._lock:
            self.groups.pop(group, None)
            self._save()

    def _save(self) -> None:
        write_atomically(self.path, json.dumps(self.groups).encode(), durable=True)


__all__ = ["PlacedEngines", "bundle_locations", "launch_in_placement_group"]
