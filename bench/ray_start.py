"""The fleet on Ray: `rollout_watchdog.ray.start()` to every node's watchdog reachable, at 3 and
at 8 Ray nodes; and an engine's SIGKILL to the client's event under Ray.

Each size is a fresh local `ray.cluster_utils.Cluster` (head + workers, one host). A
repetition times `start()` (it returns once every alive node's daemon is reachable at the
coordinator) and checks, from the fleet view, that every Ray node is listed and reachable; then
`shutdown()` stops the daemons and the coordinator for the next repetition. At the first size,
one emulator engine per node is launched with `launch_in_placement_group`, and the engine
SIGKILLed --kills times: kill(2) to the client's `state -> stopping` event (a thread following
`fleet.events()`, stamped as it arrives), the engine relaunched by its watchdog in between.
Goal: kill -> client median <= 50 ms (as without Ray, bench/README.md).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import threading
import time

from _common import REPO, bench_main, goal, parse_args, raise_interrupt, summary, wait_for

sys.path.insert(0, str(REPO / "examples"))
os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])

import ray  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402
from ray_grpo import engine_bundles, free_port  # noqa: E402

import rollout_watchdog.ray as rw_ray  # noqa: E402
from rollout_watchdog import EngineSpec, FleetClient, FleetEvent  # noqa: E402

NAMESPACE = "rw-start"
KILL_GOAL_MS = 50.0
# Every engine is killed several times in a few minutes: a budget that lasts, a short backoff.
NODE_CONFIG = {"restart": {"max_restarts": 1000, "window_s": 600.0, "backoff_initial_s": 0.2}}


class Follower(threading.Thread):
    """Every fleet event, with the wall clock at which this client got it."""

    def __init__(self, fleet: FleetClient) -> None:
        super().__init__(name="events", daemon=True)
        self.fleet = fleet
        self.seen: list[tuple[float, FleetEvent]] = []
        self.lock = threading.Lock()

    def run(self) -> None:
        for event in self.fleet.events(resume=False):
            with self.lock:
                self.seen.append((time.time(), event))

    def find(self, after: float, engine: str, incarnation: int) -> float | None:
        with self.lock:
            return next((at for at, e in self.seen if at >= after and e.engine == engine
                         and e.incarnation == incarnation and e.kind == "state"
                         and e.to == "stopping"), None)


def reachable_nodes(fleet: FleetClient) -> set[str]:
    return {n.node_id for n in fleet.nodes() if n.reachable}


def kills(fleet: FleetClient, count: int) -> list[float]:
    """SIGKILL an engine `count` times (each node's in turn); ms to the client's event."""
    pg = engine_bundles(len(ray.nodes()))

    def make_spec(index: int, node_id: str, gpu_ids: list[int], host: str) -> EngineSpec:
        port = free_port()
        return EngineSpec(id=f"e{index}", url=f"http://{host}:{port}", gpus=gpu_ids,
                          command=[sys.executable, "-m", "rollout_watchdog.emulator",
                                   "--host", host, "--port", str(port),
                                   "--no-model"])   # (no weights here: no torch to load)

    started = time.monotonic()
    names = [v.name for v in rw_ray.launch_in_placement_group(fleet, pg, make_spec,
                                                               wait_s=180)]
    print(f"  {len(names)} engines launched in the placement group, healthy in "
          f"{time.monotonic() - started:.1f} s", flush=True)   # (a slow phase named if cut)
    follower = Follower(fleet)
    follower.start()
    time.sleep(1.0)   # the subscription is in place before the first kill
    latencies = []
    for i in range(count):
        name = names[i % len(names)]
        view = wait_for(lambda n=name: next((e for e in fleet.engines() if e.name == n
                                             and e.state == "healthy" and e.pid), None),
                        120, f"{name} healthy", interval=0.1)
        killed_at = time.time()
        os.kill(view.pid or 0, signal.SIGKILL)
        seen = wait_for(lambda v=view, t=killed_at: follower.find(t, v.id, v.incarnation),
                        10, f"the client's event of {name}'s kill", interval=0.005)
        latencies.append(1000 * (seen - killed_at))
    ray.util.remove_placement_group(pg)
    return latencies


def one_size(nodes: int, repeat: int, kill_count: int) -> tuple[list[float], list[float]]:
    print(f"\n== {nodes} Ray nodes", flush=True)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 1})
    starts: list[float] = []
    latencies: list[float] = []
    try:
        for _ in range(nodes - 1):
            cluster.add_node(num_cpus=1, num_gpus=1)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, logging_level=logging.ERROR, log_to_driver=False)
        signal.signal(signal.SIGTERM, raise_interrupt)   # ray.init() put its own in place
        ray_nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        for rep in range(repeat):
            started = time.monotonic()
            fleet = rw_ray.start(namespace=NAMESPACE, node_config=NODE_CONFIG)
            starts.append(time.monotonic() - started)
            missing = ray_nodes - reachable_nodes(fleet)
            if missing:
                raise AssertionError(f"start() returned with nodes not reachable: {missing}")
            print(f"rep {rep + 1}: start() -> {len(ray_nodes)} watchdogs reachable in "
                  f"{starts[-1]:.2f} s", flush=True)
            if kill_count and rep == repeat - 1:
                latencies = kills(fleet, kill_count)
                print(f"  kills -> client: {' '.join(f'{v:.1f}' for v in latencies)} ms",
                      flush=True)
            rw_ray.shutdown(namespace=NAMESPACE)
    finally:
        with contextlib.suppress(Exception):
            ray.shutdown()
        cluster.shutdown()
    return starts, latencies


def main(args: argparse.Namespace) -> int:
    sizes = [3] if args.quick else args.sizes
    kill_count = min(args.kills, 3) if args.quick else args.kills
    results = {n: one_size(n, args.repeat, kill_count if i == 0 else 0)
               for i, n in enumerate(sizes)}
    print("\nresults:")
    for n, (starts, _) in results.items():
        summary(f"start() -> every watchdog reachable, {n} nodes", starts, "s", digits=2)
    latencies = results[sizes[0]][1]
    if not latencies:
        return 0
    s = summary(f"engine SIGKILL -> client event, {sizes[0]} nodes", latencies, "ms", digits=1)
    return 0 if goal(f"median <= {KILL_GOAL_MS:g} ms", s.median <= KILL_GOAL_MS) else 2


def extra_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", type=int, nargs="+", default=[3, 8],
                        help="Ray node counts (default 3 8; --quick: 3)")
    parser.add_argument("--kills", type=int, default=20,
                        help="engine SIGKILLs at the first size (default 20; 0: none)")


if __name__ == "__main__":
    bench_main(main, parse_args(__doc__ or "", repeat=3, quick_repeat=1, time_limit=1200,
                                extra=extra_args))
