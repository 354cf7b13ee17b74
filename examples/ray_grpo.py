"""A GRPO-shaped loop on Ray, under churn (docs/ray.md), runnable on one CPU machine.

    python examples/ray_grpo.py [--steps 6] [--clean-steps 3] [--no-faults]

This is also `bash scripts/demo.sh --ray`. It starts, all on this machine:

- a local Ray cluster of 3 nodes (`ray.cluster_utils.Cluster`), each declaring 2 GPUs it does
  not have, so that placement-group bundles get GPU ids as on a real cluster;
- the fleet, with `rollout_watchdog.ray.start()`: the coordinator in a detached actor, a node
  watchdog on every Ray node, and the real `sglang-router` whose membership it owns;
- 2 emulated SGLang engines per node, placed by the trainer's placement group and launched with
  `launch_in_placement_group` (the frameworks' engine start, as one call);
- a trainer actor holding a small torch model, which refits every engine at every step with
  `fleet.refit()` through its pickled `FleetClient` (gloo; "nccl" on GPUs).

Each step generates rollouts through the router, trains, and refits. The first `--clean-steps`
run with no faults (the baseline step time). Then a churn injector, one fault a step: an engine
SIGKILLed during generation, one node's watchdog actor `ray.kill`ed, a Ray node removed, another
engine SIGKILLed. The run ends with the steps completed and failed, the rollouts served, and the
stale-weight responses: a response whose `meta_info.weight_version` is not the version of the
weights its step generates with. There must be none: the coordinator keeps a relaunched engine
out of the router until a refit gives it the current weights.

Needs `pip install 'rollout-watchdog[ray,emulator,router]'` (ray, torch and sglang-router; no
GPU, and not the `sglang` extra, which installs SGLang itself).
Everything it starts is stopped at the end, and its files are removed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
import torch
from ray.cluster_utils import Cluster
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from torch import nn

import rollout_watchdog.ray as rw_ray
from rollout_watchdog import EngineLost, EngineSpec, EngineView, FleetClient, LeaseLost, NoMembers
from rollout_watchdog.emulator import write_weight_spec

NODES, GPUS_PER_NODE = 3, 2
NAMESPACE = "rw-grpo"
PROMPTS_PER_STEP = 12
FAULTS = ("engine", "watchdog", "node", "engine")   # one a step, after the clean steps
T0 = time.monotonic()
log = logging.getLogger("grpo")


def say(text: str) -> None:
    print(f"[{time.monotonic() - T0:7.2f} s] {text}", flush=True)


class Policy(nn.Module):
    """The model being trained; the emulators accept exactly its parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Linear(16, 32)
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.encoder(x)))


# ---------------------------------------------------------------------------------- trainer

class Learner:
    """The policy and its optimizer (bench/churn.py's trainer of today's approach shares it)."""

    def __init__(self) -> None:
        self.model = Policy()
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01)

    def train(self, rewards: list[float]) -> float:
        """One optimizer step on a toy objective (a real loop computes GRPO's advantages)."""
        x = torch.randn(len(rewards), 16)
        target = torch.tensor(rewards).unsqueeze(1).expand(-1, 4)
        loss = nn.functional.mse_loss(self.model(x), target)
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        return float(loss.detach())


@ray.remote(num_cpus=0)
class Trainer(Learner):
    """The policy's Ray actor: trains, then refits every engine through the pickled client."""

    def __init__(self, fleet: FleetClient) -> None:
        super().__init__()
        self.fleet = fleet

    def refit(self, version: str, attempts: int = 4) -> int:
        """Broadcast the weights as `version`; returns the attempts it took. A member lost
        mid-refit is restarted by its watchdog; the retry goes on without it."""
        address = ray.util.get_node_ip_address()
        for attempt in range(1, attempts + 1):
            try:
                with self.fleet.refit(version, lease_s=30.0, timeout_s=120.0, backend="gloo",
                                      master_address=address) as r:
                    r.update_weights((n, p.detach()) for n, p in self.model.named_parameters())
                return attempt
            except (EngineLost, LeaseLost) as exc:
                log.warning("refit %s, attempt %d: %s", version, attempt, exc)
            except NoMembers:
                self.fleet.wait_until(lambda v: any(e.state == "healthy" for e in v), 300.0)
        raise RuntimeError(f"refit {version} failed {attempts} times")


def start_trainer(fleet: FleetClient) -> Any:
    """The trainer actor on this (the head) node, which the churn never removes; the client
    travels to it pickled."""
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    return Trainer.options(scheduling_strategy=here).remote(fleet)  # type: ignore[attr-defined]


# ---------------------------------------------------------------------------------- rollouts

def generate_one(router_url: str, prompt: str, attempts: int = 20) -> dict[str, Any]:
    """One rollout through the router, retried: a request on an engine that dies fails."""
    body = json.dumps({"text": prompt, "sampling_params": {"max_new_tokens": 64}}).encode()
    for attempt in range(1, attempts + 1):
        request = urllib.request.Request(f"{router_url}/generate", data=body,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=30) as answer:
                out: dict[str, Any] = json.loads(answer.read())
            return out
        except (OSError, ValueError) as exc:     # HTTPError, URLError, a torn body
            log.info("rollout %r, attempt %d: %s", prompt, attempt, exc)
        time.sleep(min(0.2 * attempt, 1.0))
    raise RuntimeError(f"rollout {prompt!r} failed {attempts} times")


def generate(router_url: str, step: int, during: Callable[[], None] | None,
             one: Callable[[str, str], dict[str, Any]] = generate_one
             ) -> list[dict[str, Any]]:
    """The step's rollouts, 4 at a time, each by `one(router_url, prompt)`."""
    prompts = [f"step {step}, question {i}: what is {i} + {step}?"
               for i in range(PROMPTS_PER_STEP)]
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(one, router_url, p) for p in prompts]
        if during is not None:
            during()
        return [f.result() for f in futures]


# ---------------------------------------------------------------------------------- churn

@dataclass
class Churn:
    """The faults, one a step; each is said on the timeline as it is injected."""

    fleet: FleetClient
    cluster: Cluster
    rng: random.Random = field(default_factory=lambda: random.Random(7))
    removed: set[str] = field(default_factory=set)   # Ray node ids

    def inject(self, kind: str) -> Callable[[], None]:
        return {"engine": self.kill_engine, "watchdog": self.kill_watchdog,
                "node": self.remove_node}[kind]

    def kill_engine(self) -> None:
        engines = [e for e in self.fleet.engines() if e.serving and e.pid and e.reachable]
        victim = self.rng.choice(engines)
        os.kill(victim.pid or 0, signal.SIGKILL)
        say(f"churn: SIGKILL to engine {short(victim)} (pid {victim.pid}) during generation")

    def kill_watchdog(self) -> None:
        node_id = self.rng.choice(sorted({e.node_id for e in self.fleet.engines()}))
        ray.kill(ray.get_actor(f"node-{node_id}", namespace=NAMESPACE), no_restart=False)
        say(f"churn: ray.kill of watchdog actor node-{node_id[:8]} (its daemon and engines "
            "keep running)")

    def remove_node(self) -> None:
        worker = self.cluster.worker_nodes and sorted(
            self.cluster.worker_nodes, key=lambda n: n.unique_id)[-1]
        if not worker:
            return
        self.removed.add(worker.node_id)
        self.cluster.remove_node(worker)
        say(f"churn: Ray node {worker.node_id[:8]} removed (its daemon stops its engines "
            "and exits)")

    def expected_engines(self) -> int:
        return GPUS_PER_NODE * (NODES - len(self.removed))


# ---------------------------------------------------------------------------------- the loop

@dataclass
class Tally:
    steps: int = 0
    failed_steps: int = 0
    rollouts: int = 0
    stale: int = 0
    step_s: list[float] = field(default_factory=list)

    def completed(self, rollouts: int, stale: int, started: float) -> float:
        """Count a completed step begun at `started` (monotonic); its duration."""
        self.steps += 1
        self.rollouts += rollouts
        self.stale += stale
        self.step_s.append(time.monotonic() - started)
        return self.step_s[-1]


@dataclass
class Weights:
    """The versions of the run: what the engines serve, and what the trainer holds (ahead of
    it after a step whose refit failed)."""

    committed: str = "0"
    held: str = "0"


def run_steps(fleet: FleetClient, trainer: Any, router_url: str, steps: range,
              faults: dict[int, Callable[[], None]], tally: Tally, weights: Weights,
              after_step: Callable[[int], None] | None = None) -> None:
    """Generate with the committed weights, train, refit as version str(step); a rollout not
    at the committed version is stale. `after_step(step)` after each step, failed or not
    (bench/churn.py counts engines there)."""
    for step in steps:
        started = time.monotonic()
        try:
            catch_up(fleet, trainer, weights)
            fleet.prepare_for_generation()
            fleet.wait_router_synced(timeout_s=60)
            rollouts = generate(router_url, step, faults.get(step))
            fleet.finish_generation(deadline_s=600, timeout_s=40)
            stale = [r["meta_info"]["weight_version"] for r in rollouts
                     if r["meta_info"]["weight_version"] != weights.committed]
            version = weights.committed
            loss = ray.get(trainer.train.remote([float(len(r["text"]) % 7) for r in rollouts]))
            weights.held = str(step)
            attempts = ray.get(trainer.refit.remote(weights.held))
            weights.committed = weights.held
        except Exception as exc:   # noqa: BLE001 - a failed step is counted, and the run goes on
            tally.failed_steps += 1
            say(f"step {step} FAILED: {exc!r}")
        else:
            took = tally.completed(len(rollouts), len(stale), started)
            say(f"step {step}: {len(rollouts)} rollouts at v{version}"
                f"{f', {len(stale)} STALE: {stale}' if stale else ''}, loss {loss:.3f}, "
                f"refit v{step} committed ({attempts} attempt(s)), "
                f"{took:.2f} s; {describe(fleet.engines())}")
        if after_step is not None:
            after_step(step)


def catch_up(fleet: FleetClient, trainer: Any, weights: Weights) -> None:
    """No engine serves (every one died since the last refit, or that refit failed): one
    refit of the weights the trainer holds admits the relaunched engines to the router, so
    the step can generate at all."""
    if any(e.serving and e.reachable for e in fleet.engines()):
        return
    fleet.wait_until(lambda v: any(e.state == "healthy" and e.reachable for e in v), 300.0)
    ray.get(trainer.refit.remote(weights.held))
    weights.committed = weights.held
    say(f"no engine was serving: catch-up refit v{weights.held} committed")


def short(engine: EngineView) -> str:
    """NODE/ENGINE with the first 8 digits of the Ray node id (56 hex digits in all)."""
    return f"{engine.node_id[:8]}/{engine.id}"


def describe(view: list[EngineView]) -> str:
    serving = sum(e.serving for e in view if e.reachable)
    return f"{serving}/{len(view)} engines serving"


# ---------------------------------------------------------------------------------- set-up

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@contextlib.contextmanager
def router(workdir: Path) -> Iterator[str]:
    """The real sglang-router, its own health checks off: the coordinator owns its members."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with open(workdir / "router.log", "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
             "--port", str(port), "--prometheus-port", str(free_port()),
             "--policy", "round_robin", "--disable-health-check",
             "--worker-startup-timeout-secs", "10", "--log-level", "warn"],
            stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{url}/workers", timeout=2):
                    break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError(f"sglang-router did not start: see {workdir}/router.log"
                                       ) from None
                time.sleep(0.1)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def engine_bundles(count: int) -> Any:
    """The trainer's placement group for `count` engines, one GPU a bundle, once ready."""
    pg = placement_group([{"GPU": 1, "CPU": 0.01}] * count, strategy="PACK")
    ray.get(pg.ready(), timeout=120)
    return pg


def launch_engines(fleet: FleetClient, spec_file: Path, count: int = NODES * GPUS_PER_NODE,
                   options: tuple[str, ...] = ()) -> list[EngineView]:
    """An engine launched on each bundle's node with the bundle's GPU (what NeMo-RL's
    `_start_engines` does, as one call); `options` go to every emulator."""
    pg = engine_bundles(count)

    def make_spec(index: int, node_id: str, gpu_ids: list[int], host: str) -> EngineSpec:
        port = free_port()   # this example's nodes share one host; a real cluster uses a band
        return EngineSpec(
            id=f"e{index}", url=f"http://{host}:{port}", gpus=gpu_ids,
            command=[sys.executable, "-m", "rollout_watchdog.emulator", "--host", host,
                     "--port", str(port), "--weight-spec", str(spec_file), *options])

    views = rw_ray.launch_in_placement_group(fleet, pg, make_spec, wait_s=180)
    for v in views:
        say(f"launched {short(v)} on node {v.node_id[:8]}, GPUs of its bundle, url {v.url}")
    return views   # the group stays: its bundles keep Ray from placing other work on the GPUs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=len(FAULTS) + 2,
                        help="steps with the churn injector on")
    parser.add_argument("--clean-steps", type=int, default=3,
                        help="fault-free steps first: the baseline step time")
    parser.add_argument("--no-faults", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")

    workdir = Path(tempfile.mkdtemp(prefix="rw-grpo-"))
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "num_gpus": GPUS_PER_NODE})
    try:
        for _ in range(NODES - 1):
            cluster.add_node(num_cpus=2, num_gpus=GPUS_PER_NODE)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, logging_level=logging.WARNING)
        say(f"Ray cluster up: {len(ray.nodes())} nodes at {cluster.address}")
        spec_file = workdir / "policy-spec.json"
        write_weight_spec(str(spec_file), Policy().named_parameters())
        with router(workdir) as router_url:
            fleet = rw_ray.start(namespace=NAMESPACE, router_url=router_url)
            say("fleet started: coordinator and a watchdog on every Ray node")
            launch_engines(fleet, spec_file)
            trainer = start_trainer(fleet)
            ray.get(trainer.refit.remote("0"))     # every engine at the trainer's weights
            say("refit v0 committed: the run begins")
            tally, clean, weights = Tally(), Tally(), Weights()
            run_steps(fleet, trainer, router_url, range(1, args.clean_steps + 1), {}, clean,
                      weights)
            churn = Churn(fleet, cluster)
            first = args.clean_steps + 1
            faults = {} if args.no_faults else {
                first + i: churn.inject(kind) for i, kind in enumerate(FAULTS)}
            run_steps(fleet, trainer, router_url, range(first, first + args.steps), faults,
                      tally, weights)
            settle(fleet, trainer, weights, churn.expected_engines())
            report(clean, tally, churn, fleet)
            rw_ray.shutdown(namespace=NAMESPACE)
            say("shutdown: engines removed, daemons and coordinator stopped")
        return 0 if tally.failed_steps == 0 and tally.stale == 0 and clean.stale == 0 else 1
    finally:
        with contextlib.suppress(Exception):
            ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(workdir, ignore_errors=True)


def settle(fleet: FleetClient, trainer: Any, weights: Weights, expected: int) -> None:
    """Every engine of the live nodes healthy again; one that came back after the last refit
    is admitted by one more refit of the same weights."""
    view = fleet.wait_until(lambda v: sum(e.state == "healthy" for e in v if e.reachable)
                            >= expected, 180.0)
    if any(e.reachable and not e.serving for e in view):
        ray.get(trainer.refit.remote(weights.held))
        say(f"catch-up refit v{weights.held}: the engines relaunched since the last refit "
            "got the current weights")


def report(clean: Tally, churned: Tally, churn: Churn, fleet: FleetClient) -> None:
    total = Tally(clean.steps + churned.steps, clean.failed_steps + churned.failed_steps,
                  clean.rollouts + churned.rollouts, clean.stale + churned.stale)
    print(f"\nsteps completed: {total.steps}, failed steps: {total.failed_steps}, "
          f"rollouts served: {total.rollouts}, stale-weight responses: {total.stale}")
    if clean.step_s and churned.step_s:
        base, faulty = statistics.median(clean.step_s), statistics.median(churned.step_s)
        print(f"step time (median): {faulty:.2f} s under churn, {base:.2f} s with no faults "
              f"({faulty / base:.2f}x)")
    serving = sum(e.serving for e in fleet.engines() if e.reachable)
    print(f"engines serving at the end: {serving} of the {churn.expected_engines()} on live "
          "nodes", flush=True)


if __name__ == "__main__":
    sys.exit(main())
