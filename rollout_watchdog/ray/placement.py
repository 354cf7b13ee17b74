"""`launch_in_placement_group`: the frameworks' engine start, as one call (docs/ray.md)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rollout_watchdog.common.spec import EngineSpec
from rollout_watchdog.ray.runtime import node_ip
from rollout_watchdog.refit_bridge.client import FleetClient
from rollout_watchdog.refit_bridge.views import EngineView

PLACEMENT_TIMEOUT_S = 600.0
MakeSpec = Callable[[int, str, list[int], str], EngineSpec]


@ray.remote(num_cpus=0)
def _bundle_info() -> tuple[str, list[int], str]:
    """Where this task runs: its Ray node id, the GPU ids Ray gave it, the node's address."""
    ids = [int(i) for i in ray.get_gpu_ids()]
    return ray.get_runtime_context().get_node_id(), ids, node_ip()


def bundle_locations(pg: PlacementGroup, timeout_s: float = PLACEMENT_TIMEOUT_S
                     ) -> list[tuple[str, list[int], str]]:
    """(node id, GPU ids, host) of every bundle of `pg`, in bundle order: a task in each
    bundle, taking the bundle's GPUs, asks Ray (as miles' InfoActor does)."""
    ray.get(pg.ready(), timeout=timeout_s)
    bundles: Sequence[dict[str, Any]] = pg.bundle_specs
    return list(ray.get([
        _bundle_info.options(
            num_gpus=bundle.get("GPU", 0),
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                pg, placement_group_bundle_index=index)).remote()
        for index, bundle in enumerate(bundles)], timeout=timeout_s))


def launch_in_placement_group(fleet: FleetClient, pg: PlacementGroup, make_spec: MakeSpec,
                              wait_s: float | None = None) -> list[EngineView]:
    """Launch `make_spec(bundle_index, node_id, gpu_ids, host)` on each bundle's node, in
    bundle order (`make_spec` runs here, in the caller); the engines' views. With `wait_s`,
    once every engine is healthy (TimeoutError otherwise). The engines belong to their node
    daemons, not to Ray: they hold the bundle's GPUs without a Ray actor of their own."""
    views = []
    for index, (node_id, gpus, host) in enumerate(bundle_locations(pg)):
        views.append(fleet.launch(node_id, make_spec(index, node_id, gpus, host)))
    if wait_s is None:
        return views
    names = {(v.node_id, v.id) for v in views}
    fleet.wait_until(lambda engines: sum(e.state == "healthy" for e in engines
                                         if (e.node_id, e.id) in names) == len(names), wait_s)
    current = {(e.node_id, e.id): e for e in fleet.engines()}
    return [current[(v.node_id, v.id)] for v in views]


__all__ = ["bundle_locations", "launch_in_placement_group"]
