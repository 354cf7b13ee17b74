"""Today's approach to engine faults on Ray, re-implemented for bench/churn.py the way
bench/hang_detection.py re-implemented the monitor (docs/refit.md names the originals).

- Engines in Ray actors: one `EngineActor` per placement-group bundle starts its server as a
  child process on ports picked at each launch (slime's / miles' `SGLangEngine`, NeMo-RL's
  `SGLangGeneration._start_engines`), and waits for it to answer `/health_generate`.
- The monitor: `RolloutHealthMonitor`, the sequential probe of bench/hang_detection.py
  (`SequentialMonitor`, imported), active only while generating (`health_monitoring_resume()` in
  `generate`, `health_monitoring_pause()` around train and refit), killing a failed engine
  through Ray (`ray.kill` of its actor) and skipping it from then on.
- Recovery only at the next refit, inside it: `recover_updatable_engines` ->
  `ServerGroup.start_engines` boots a new actor in the dead engine's bundle (new ports), then the
  trainer rebuilds the weight-update group (`connect_rollout_engines_from_distributed`) and
  broadcasts (`update_weights_from_distributed`), all under `rollout_engine_lock`: a plain lock
  actor, no owner, lease or timeout.
- Rollouts round-robin over the engines the monitor believes alive, each retried on another.

The engine HTTP calls are rollout_watchdog.refit_bridge.engine_calls', the group is built by
rollout_watchdog.common.torch_group (SGLang's construction), as the bridge does.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
import torch.distributed as dist
from hang_detection import SequentialMonitor
from ray.util.placement_group import remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from ray_grpo import Learner, free_port, generate_one

from rollout_watchdog.common.torch_group import (
    destroy_process_group,
    init_custom_process_group,
    tcp_init_method,
)
from rollout_watchdog.refit_bridge import engine_calls
from rollout_watchdog.refit_bridge.buckets import buckets, dtype_name, with_last

# slime's `--rollout-health-check-interval` / `-timeout` defaults (30 s each; PR #3187 ports the
# same loop) scaled down 10x, so that a 30 s kill period meets several rounds; threshold 1 as
# shipped (an engine is killed at its first failed probe).
MONITOR_INTERVAL_S = 3.0
MONITOR_TIMEOUT_S = 3.0
MONITOR_THRESHOLD = 1
# torch's default process-group timeout (30 min, what slime's and NeMo-RL's groups use) scaled
# down 30x: how long the trainer waits in a group behind a dead member.
GROUP_TIMEOUT_S = 60.0
BOOT_TIMEOUT_S = 180.0   # slime waits for the server without a bound
HTTP_TIMEOUT_S = 10.0


@ray.remote(num_cpus=0, num_gpus=1)
class EngineActor:
    """slime's `SGLangEngine`: launches the server as its child, on new ports each time."""

    def __init__(self, command: list[str], env: dict[str, str], log_path: str) -> None:
        self.command, self.env, self.log_path = command, env, log_path
        self.proc: subprocess.Popen[bytes] | None = None

    def launch(self, attempts: int = 3) -> tuple[str, int]:
        """Start the server, wait until `/health_generate` answers; (url, pid). A server that
        exits while booting is started again on other ports (a port picked free may be taken
        before the server binds it: a race of this one-host benchmark, not of the approach)."""
        host = ray.util.get_node_ip_address()
        deadline = time.monotonic() + BOOT_TIMEOUT_S
        for _ in range(attempts):
            port = free_port()
            with open(self.log_path, "ab") as out:
                self.proc = subprocess.Popen(
                    [*self.command, "--host", host, "--port", str(port)],
                    env={**os.environ, **self.env}, stdin=subprocess.DEVNULL, stdout=out,
                    stderr=out)
            url = f"http://{host}:{port}"
            while self.proc.poll() is None and time.monotonic() < deadline:
                with contextlib.suppress(engine_calls.EngineCallError):
                    engine_calls.get(url, "/health_generate", MONITOR_TIMEOUT_S)
                    return url, self.proc.pid
                time.sleep(0.2)
        raise RuntimeError(f"engine {self.log_path} did not boot (its log says why)")


@ray.remote(num_cpus=0)
class PlainLock:
    """slime's `Lock` actor (`rollout_engine_lock`): no owner, no lease, no timeout."""

    def __init__(self) -> None:
        self.held = False

    def acquire(self) -> bool:
        if self.held:
            return False
        self.held = True
        return True

    def release(self) -> None:
        self.held = False


@dataclass
class Slot:
    """One bundle's engine, as the rollout manager sees it."""

    name: str
    actor: Any = None
    url: str = ""
    pid: int = 0
    alive: bool = False


class EnginePool:
    """The rollout manager's engines: started per bundle, killed through Ray, recovered."""

    def __init__(self, pg: Any, count: int, command: list[str], env: dict[str, str],
                 log_dir: Path) -> None:
        self.pg, self.command, self.env, self.log_dir = pg, command, env, log_dir
        self.slots = [Slot(f"e{i}") for i in range(count)]
        self.turn = itertools.count()
        self.lock = threading.Lock()

    def start_engines(self, indices: list[int]) -> None:
        """`ServerGroup.start_engines`: a new actor in each bundle, every boot awaited."""
        actors = {i: EngineActor.options(  # type: ignore[attr-defined]
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=self.pg, placement_group_bundle_index=i)).remote(
            self.command, self.env, str(self.log_dir / f"e{i}.log")) for i in indices}
        started = dict(zip(actors, ray.get([a.launch.remote() for a in actors.values()],
                                           timeout=BOOT_TIMEOUT_S + 30), strict=True))
        with self.lock:
            for i, (url, pid) in started.items():
                slot = self.slots[i]
                slot.actor, slot.url, slot.pid, slot.alive = actors[i], url, pid, True

    def recover(self) -> list[int]:
        """`recover_updatable_engines`: the dead engines booted again; their indices."""
        dead = [i for i, s in enumerate(self.slots) if not s.alive]
        if dead:
            self.start_engines(dead)
        return dead

    def kill(self, name: str) -> None:
        """The monitor's kill through Ray."""
        with self.lock:
            slot = next(s for s in self.slots if s.name == name)
            slot.alive, actor = False, slot.actor
        if actor is not None:
            ray.kill(actor)

    def urls(self) -> dict[str, str]:
        with self.lock:
            return {s.name: s.url for s in self.slots if s.alive}

    def pids(self) -> dict[str, int]:
        with self.lock:
            return {s.name: s.pid for s in self.slots if s.alive}

    def rollout(self, _router_url: str, prompt: str, attempts: int = 20) -> dict[str, Any]:
        """One rollout round-robin over the engines believed alive, retried on the next."""
        for _ in range(attempts):
            urls = sorted(self.urls().values())
            if not urls:
                time.sleep(0.5)
                continue
            with contextlib.suppress(RuntimeError):
                return generate_one(urls[next(self.turn) % len(urls)], prompt, attempts=1)
        raise RuntimeError(f"rollout {prompt!r} failed {attempts} times")

    def shutdown(self) -> None:
        for slot in self.slots:
            if slot.actor is not None:
                with contextlib.suppress(Exception):
                    ray.kill(slot.actor)
        remove_placement_group(self.pg)


class RayMonitor(SequentialMonitor):
    """`RolloutHealthMonitor` with its pause, killing through Ray; `revive` after a recovery
    (the recovered engine is probed again, at its new url)."""

    def __init__(self, pool: EnginePool) -> None:
        super().__init__({s.name: "" for s in pool.slots}, interval_s=MONITOR_INTERVAL_S,
                         timeout_s=MONITOR_TIMEOUT_S, threshold=MONITOR_THRESHOLD)
        self.pool = pool
        self.urls = pool.urls()
        self.paused = threading.Event()
        self.paused.set()

    def _check(self, engine_id: str, url: str) -> None:
        if self.paused.is_set() or engine_id not in self.urls:
            return
        super()._check(engine_id, url)
        if engine_id in self.declared:
            self.pool.kill(engine_id)

    def revive(self) -> None:
        self.urls = self.pool.urls()
        for name in self.urls:
            if self.declared.pop(name, None) is not None:
                self.failures[name] = 0


@ray.remote(num_cpus=0)
class TodayTrainer(Learner):
    """slime's `UpdateWeightFromDistributed`: the group rebuilt when the engines changed
    (`connect_rollout_engines`), then each bucket's HTTP calls and the trainer's broadcasts."""

    def __init__(self) -> None:
        super().__init__()
        self.pg: Any = None
        self.urls: list[str] = []
        self.name = ""
        self.builds = 0

    def _connect(self, urls: list[str]) -> None:
        if self.pg is not None:   # disconnect_rollout_engines_from_distributed
            engine_calls.on_each(self.urls, lambda u: engine_calls.post(
                u, "/destroy_weights_update_group", {"group_name": self.name}, HTTP_TIMEOUT_S))
            destroy_process_group(self.pg)
        self.pg, self.urls = None, []
        self.builds += 1
        self.name = f"slime-pp_0-{self.builds}"
        address, port = ray.util.get_node_ip_address(), free_port()
        world = 1 + len(urls)
        with ThreadPoolExecutor(len(urls)) as pool:
            calls = [pool.submit(engine_calls.post, u, "/init_weights_update_group", {
                "master_address": address, "master_port": port, "rank_offset": 1 + i,
                "world_size": world, "group_name": self.name, "backend": "gloo"},
                GROUP_TIMEOUT_S) for i, u in enumerate(urls)]
            pg = init_custom_process_group("gloo", tcp_init_method(address, port),
                                           datetime.timedelta(seconds=GROUP_TIMEOUT_S), world,
                                           0, self.name)
            for call in calls:
                call.result()
        self.pg, self.urls = pg, list(urls)

    def refit(self, version: str, urls: list[str]) -> int:
        """Every engine in `urls` at `version`; returns the group builds so far. Any failure
        raises (slime has no retry), and the next refit builds a new group."""
        try:
            if urls != self.urls or self.pg is None:
                self._connect(urls)
            engine_calls.on_each(urls, lambda u: engine_calls.post(
                u, "/begin_weight_update", {}, HTTP_TIMEOUT_S))
            named = ((n, p.detach()) for n, p in self.model.named_parameters())
            for bucket, last in with_last(buckets(named, 256 << 20)):
                self._send(bucket, version if last else None, urls)
            errors = engine_calls.on_each(urls, lambda u: engine_calls.post(
                u, "/end_weight_update", {}, HTTP_TIMEOUT_S))
            if errors:
                raise RuntimeError(f"end_weight_update: {errors}")
        except Exception as exc:
            self.pg, self.urls = None, []   # a broken group is left, not destroyed (may hang)
            engine_calls.on_each(urls, lambda u: engine_calls.post(
                u, "/end_weight_update", {}, HTTP_TIMEOUT_S))
            raise RuntimeError(f"refit {version}: {type(exc).__name__}: {exc}") from None
        return self.builds

    def _send(self, bucket: list[tuple[str, Any]], version: str | None,
              urls: list[str]) -> None:
        body = {"names": [n for n, _ in bucket], "dtypes": [dtype_name(t) for _, t in bucket],
                "shapes": [list(t.shape) for _, t in bucket], "group_name": self.name,
                "flush_cache": version is not None, "weight_version": version}
        with ThreadPoolExecutor(len(urls)) as pool:
            calls = [pool.submit(engine_calls.post, u, "/update_weights_from_distributed",
                                 body, GROUP_TIMEOUT_S) for u in urls]
            for _, tensor in bucket:
                dist.broadcast(tensor.contiguous(), src=0, group=self.pg)
            for call in calls:
                call.result()


def emulator_command(spec_file: Path) -> list[str]:
    return [sys.executable, "-m", "rollout_watchdog.emulator", "--weight-spec", str(spec_file)]
