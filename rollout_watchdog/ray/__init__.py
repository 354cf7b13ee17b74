"""Rollout-watchdog on a Ray cluster (DESIGN.md, "Ray"; docs/ray.md): the coordinator and a
watchdog on every Ray node as detached actors, engines launched into the trainer's placement
group. The only package that imports ray; the node daemon never does.

    import ray, rollout_watchdog.ray as rw_ray
    ray.init(address="auto")
    fleet = rw_ray.start()
    views = rw_ray.launch_in_placement_group(fleet, pg, make_spec, wait_s=600)
    rw_ray.shutdown()
"""

from rollout_watchdog.ray.deploy import NAMESPACE, fleet, shutdown, start
from rollout_watchdog.ray.placement import bundle_locations, launch_in_placement_group

__all__ = ["NAMESPACE", "bundle_locations", "fleet", "launch_in_placement_group", "shutdown",
           "start"]
