"""Refit bridge: its cost over a raw broadcast, and how fast it fails and recovers (issue 7).

One node daemon with 4 emulator engines (`--hidden-size`, ~100 MB of fp32 weights by default),
an embedded coordinator with the real sglang-router, and this process as the trainer (rank 0)
over gloo. Figures, each with its goal, measured side by side in one run:
- the time a whole refit takes (`with fleet.refit(v) as r: r.update_weights(tensors)`: the lock,
  the fleet-wide probe pause, generation paused, the broadcast, the version set and read back
  on every engine, the commit, the release), with the weight-update group already built (it is
  rebuilt only when membership changes), against the raw torch.distributed broadcast of the
  same tensors from rank 0 to 4 plain receiver processes in a group built the same way: the
  ratio (<= 1.1x). Also against the same broadcast where each receiver loads what it got into
  its model (a copy, as an engine must): the bridge's own share. The first refit's group build
  is reported apart;
- from an engine's SIGKILL in the middle of a refit's broadcast to the refit raising EngineLost
  (<= 2 s);
- from an engine's SIGKILL to its return to the router, through its relaunch by the watchdog and
  the next refit (report).
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from typing import Any

from _common import EngineSpec, Fleet, bench_main, goal, parse_args, step, summary, wait_for
from router_harness import Router

from rollout_watchdog import Coordinator, EngineLost, FleetClient
from rollout_watchdog.emulator.model import named_weights
from rollout_watchdog.emulator.testing import free_port
from rollout_watchdog.refit_bridge.router import RouterClient, normalize_url

PROBE = {"health_interval_s": 1.0, "health_timeout_s": 30.0, "startup_timeout_s": 300.0}
RESTART = {"backoff_initial_s": 0.0, "backoff_max_s": 0.0, "max_restarts": 1000}
ENGINES = 4
RECEIVER = r"""
import datetime, sys, torch
from rollout_watchdog.common.torch_group import init_custom_process_group
from rollout_watchdog.emulator.model import build_model
port, rank, world, hidden, rounds, load = (int(a) for a in sys.argv[1:7])
pg = init_custom_process_group("gloo", f"tcp://127.0.0.1:{port}", datetime.timedelta(minutes=30),
                               world, rank, sys.argv[7])
params = [p.detach() for p in build_model(hidden_size=hidden).parameters()]
for _ in range(rounds):
    for p in params:
        received = torch.empty_like(p)
        torch.distributed.broadcast(received, src=0, group=pg)
        if load:                  # what an engine must do too: load it into the model
            p.copy_(received)
    torch.distributed.barrier(group=pg)
"""


class RawBroadcast:
    """Rank 0 of a plain group (built the same way) over ENGINES receiver processes: the
    baseline, one round (every tensor broadcast, then a barrier) at a time."""

    def __init__(self, hidden: int, rounds: int, load: bool) -> None:
        import datetime

        from rollout_watchdog.common.torch_group import init_custom_process_group
        port, world, name = free_port(), ENGINES + 1, f"raw-{uuid.uuid4().hex[:8]}"
        self.procs = [subprocess.Popen([sys.executable, "-c", RECEIVER, str(port), str(rank),
                                        str(world), str(hidden), str(rounds), str(int(load)),
                                        name])
                      for rank in range(1, world)]
        self.pg = init_custom_process_group("gloo", f"tcp://127.0.0.1:{port}",
                                            datetime.timedelta(minutes=30), world, 0, name)

    def round(self, weights: list[tuple[str, Any]]) -> float:
        import torch
        began = time.monotonic()
        for _, tensor in weights:
            torch.distributed.broadcast(tensor, src=0, group=self.pg)
        torch.distributed.barrier(group=self.pg)   # every receiver has every tensor
        return time.monotonic() - began

    def close(self) -> None:
        for proc in self.procs:
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()


def refit_once(fleet: FleetClient, version: str, weights: Any) -> float:
    began = time.monotonic()
    with fleet.refit(version, backend="gloo", timeout_s=300) as refit:
        refit.update_weights(weights)
    return time.monotonic() - began


def main(args: argparse.Namespace) -> int:
    hidden = args.hidden_size
    weights = named_weights(1, hidden)
    size_mb = sum(t.numel() * t.element_size() for _, t in weights) / 1e6
    print(f"weights: {len(weights)} tensors, {size_mb:.0f} MB; {ENGINES} engines; gloo")
    router = Router.start()
    try:
        with Coordinator(bind="tcp://127.0.0.1:0", router_url=router.url) as coordinator, \
                Fleet("refit", [EngineSpec(f"e{i}", flags=("--hidden-size", str(hidden)),
                                           extra={"tp_size": 1}) for i in range(ENGINES)],
                      probe=PROBE, restart=RESTART, top={"coordinator": coordinator.endpoint},
                      keep=args.keep):
            fleet = FleetClient(coordinator.endpoint)
            step("waiting for 4 healthy engines")
            fleet.wait_until(lambda v: len(v) == ENGINES and all(
                e.state == "healthy" for e in v), 300)
            first = refit_once(fleet, "warm-0", weights)
            print(f"first refit (group built): {first:.2f} s")
            refits, raws, loads = [], [], []
            raw, loaded = RawBroadcast(hidden, args.repeat, False), \
                RawBroadcast(hidden, args.repeat, True)
            try:
                for i in range(args.repeat):   # interleaved: the same load for all three
                    refits.append(refit_once(fleet, f"v{i}", weights))
                    raws.append(raw.round(weights))
                    loads.append(loaded.round(weights))
            finally:
                raw.close()
                loaded.close()
            ratio = statistics.median(refits) / statistics.median(raws)
            summary("refit (group reused)", refits, "s", 3)
            summary("raw broadcast", raws, "s", 3)
            summary("raw broadcast + load into the model", loads, "s", 3)
            goal(f"refit / raw broadcast = {ratio:.2f}x (<= 1.1x)", ratio <= 1.1)
            print(f"  refit / (raw broadcast + load) = "
                  f"{statistics.median(refits) / statistics.median(loads):.2f}x (the bridge's "
                  "own share: lock, probe pause, HTTP, version check, commit)")

            deaths, returns = [], []
            for i in range(args.deaths):
                lost_after, back_after = death_mid_refit(fleet, router.url, weights, i)
                deaths.append(lost_after)
                returns.append(back_after)
            summary("engine SIGKILLed mid-broadcast -> EngineLost", deaths, "s", 3)
            goal("death mid-refit -> raised error <= 2 s", max(deaths) <= 2.0)
            summary("engine SIGKILLed -> back in the router after the next refit", returns,
                    "s", 2)
            return 0
    finally:
        router.stop()


def death_mid_refit(fleet: FleetClient, router_url: str, weights: list[tuple[str, Any]],
                    i: int) -> tuple[float, float]:
    victim = next(e for e in fleet.engines() if e.id == "e1")
    killed_at = 0.0

    def killing() -> Iterator[tuple[str, Any]]:
        nonlocal killed_at
        for k, item in enumerate(weights):
            if k == len(weights) - 1:   # read one ahead: buckets 0-2 are sent by now
                assert victim.pid is not None
                killed_at = time.monotonic()
                os.kill(victim.pid, signal.SIGKILL)
            yield item
    try:
        with fleet.refit(f"d{i}", backend="gloo", timeout_s=300) as refit:
            refit.update_weights(killing(), bucket_bytes=1)
    except EngineLost:
        lost_after = time.monotonic() - killed_at
    else:
        raise RuntimeError("the refit did not notice the SIGKILL")
    url = normalize_url(str(victim.url))
    fleet.wait_until(lambda v: any(e.name == victim.name and e.incarnation > victim.incarnation
                                   and e.state == "healthy" for e in v), 300)
    with fleet.refit(f"r{i}", backend="gloo", timeout_s=300) as refit:
        refit.update_weights(weights)
    wait_for(lambda: url in RouterClient(router_url).urls(), 60, "the engine back in the router")
    return lost_after, time.monotonic() - killed_at


if __name__ == "__main__":
    def extra(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--hidden-size", type=int, default=3400,
                            help="the emulator model's hidden size (3400: ~100 MB fp32)")
        parser.add_argument("--deaths", type=int, default=3,
                            help="engine deaths mid-refit to measure (default 3)")
    bench_main(main, parse_args(__doc__ or "", repeat=5, quick_repeat=2, time_limit=1800,
                                extra=extra))
