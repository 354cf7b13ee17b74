"""Goodput under churn on Ray: ours against today's approach, side by side in one run.

One local Ray cluster (`ray.cluster_utils.Cluster`: --nodes nodes, each declaring
--gpus-per-node GPUs it does not have, so placement-group bundles get GPU ids), one emulator
engine per bundle (8 by default: 4 nodes x 2), the same GRPO-shaped loop on both sides
(examples/ray_grpo.py: rollouts, a train step in a trainer actor holding a small torch model,
a refit of every engine to the step's version), first --clean-steps without faults (the
baseline), then --steps with one engine SIGKILLed every --period seconds (same seed, same period
on both sides; the victim drawn among the engine processes alive at that moment).

- Ours: `rollout_watchdog.ray.start()`, engines launched with `launch_in_placement_group`, the
  real `sglang-router`, `fleet.refit()` every step from the trainer actor's pickled client
  (examples/ray_grpo.py's `run_steps` and `Trainer`).
- Today's: bench/_today.py (engines in Ray actors, the sequential monitor killing through Ray,
  recovery booted inside the next refit, a plain lock; its docstring says what is whose).

Figures, each side: step time under churn against its own fault-free run (mean, i.e. the
phase's wall time over its completed steps: goodput; and median), failed steps,
stale-weight responses (a rollout whose `meta_info.weight_version` is not the step's
version), and for each death the refits after the step it died in (and the seconds) until
every engine serves the current weights again. Goals for ours: <= 1.15x, 0 failed, 0 stale,
back to full within one refit. `--quick`: 2 clean and 6 churn steps, a SIGKILL every 12 s
(a few minutes: no smoke test). bench/README.md has the figures and the scaled-down values.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _common import (
    MARKER_ENV,
    REPO,
    bench_main,
    goal,
    kill_marked,
    marked,
    parse_args,
    raise_interrupt,
    summary,
)

sys.path.insert(0, str(REPO / "examples"))
# Ray's workers import this benchmark's modules by name (the actor classes pickled by value
# refer to them): the raylets, and so the workers, inherit this environment.
os.environ["PYTHONPATH"] = os.pathsep.join(
    [str(REPO / "bench"), str(REPO / "examples"), str(REPO), os.environ.get("PYTHONPATH", "")])

import psutil  # noqa: E402
import ray  # noqa: E402
import ray_grpo  # noqa: E402
from _today import (  # noqa: E402
    MONITOR_INTERVAL_S,
    MONITOR_THRESHOLD,
    MONITOR_TIMEOUT_S,
    EnginePool,
    PlainLock,
    RayMonitor,
    TodayTrainer,
    emulator_command,
)
from ray.cluster_utils import Cluster  # noqa: E402
from ray_grpo import Policy, Tally, generate, say  # noqa: E402

from rollout_watchdog.emulator import write_weight_spec  # noqa: E402
from rollout_watchdog.refit_bridge import engine_calls  # noqa: E402

NAMESPACE = "rw-churn"
STEP_GOAL = 1.15


class Injector(threading.Thread):
    """SIGKILL one live engine process every `period_s`, drawn by a seeded generator."""

    def __init__(self, period_s: float, seed: int,
                 victims: Callable[[], dict[str, int]]) -> None:
        super().__init__(name="churn", daemon=True)
        self.period_s, self.rng, self.victims = period_s, random.Random(seed), victims
        self.deaths: list[tuple[float, str]] = []   # (monotonic time, engine)
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(self.period_s):
            alive = {n: p for n, p in sorted(self.victims().items()) if running(p)}
            if not alive:
                continue
            name = self.rng.choice(list(alive))
            with contextlib.suppress(ProcessLookupError):
                os.kill(alive[name], signal.SIGKILL)
                self.deaths.append((time.monotonic(), name))
                say(f"churn: SIGKILL to engine {name} (pid {alive[name]})")


def running(pid: int) -> bool:
    try:
        return bool(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def current(urls: list[str], version: str) -> int:
    """How many of `urls` answer with `version` as their weights."""
    answers: dict[str, str | None] = {}

    def ask(url: str) -> None:
        answers[url] = engine_calls.weight_version(url, 5.0)
    engine_calls.on_each(urls, ask)
    return sum(v == version for v in answers.values())


@dataclass
class Side:
    """One approach's run: its two phases, its deaths, and the engines serving after each
    step (step, monotonic time, engines up and in the rotation at the step's weights)."""

    name: str
    engines: int
    clean: Tally = field(default_factory=Tally)
    churned: Tally = field(default_factory=Tally)
    clean_s: float = 0.0
    churn_s: float = 0.0
    deaths: list[tuple[float, str]] = field(default_factory=list)
    skipped: int = 0   # steps not run: --side-limit reached
    orphans: int | None = None   # engine processes left running by dead engines
    after: list[tuple[int, float, int]] = field(default_factory=list)

    def recoveries(self) -> list[tuple[int, float] | None]:
        """For each death: (steps, seconds) until every engine served the current weights
        again, in refits after the step it happened in (0: that step's own refit had it back,
        1: the next step's); None: never. A death in the last step is not counted when it
        was not back at its end (nothing came after to show it)."""
        out: list[tuple[int, float] | None] = []
        last = self.after[-1][0] if self.after else None
        for at, _name in self.deaths:
            during = next((s for s, end, _ in self.after if end >= at), None)
            if during is None:
                continue   # after the last step
            back = next(((s, end) for s, end, n in self.after
                         if s >= during and end >= at and n == self.engines), None)
            if back is not None:
                out.append((back[0] - during, back[1] - at))
            elif during != last:
                out.append(None)
        return out


def phases(side: Side, args: argparse.Namespace, victims: Callable[[], dict[str, int]],
           step: Callable[[int, Tally], None]) -> None:
    """The clean steps, then the churn steps with the injector on; `--side-limit` stops a
    phase that runs longer (its steps not run are counted as skipped)."""
    def run(steps: range, tally: Tally) -> None:
        deadline = time.monotonic() + args.side_limit
        for number in steps:
            if time.monotonic() > deadline:
                say(f"{side.name}: --side-limit {args.side_limit:g} s reached; steps "
                    f"{number}-{steps.stop - 1} not run")
                side.skipped += steps.stop - number
                return
            step(number, tally)

    first = 1 + args.clean_steps
    started = time.monotonic()
    run(range(1, first), side.clean)
    side.clean_s = time.monotonic() - started
    injector = Injector(args.period, args.seed, victims)
    started = time.monotonic()
    injector.start()
    try:
        run(range(first, first + args.steps), side.churned)
    finally:
        injector.stop.set()
        injector.join(5)
        side.churn_s = time.monotonic() - started
        side.deaths = injector.deaths


# ---------------------------------------------------------------------------------- today's

def run_today(args: argparse.Namespace, spec_file: Path, workdir: Path) -> Side:
    side = Side("today's approach", args.engines)
    token = uuid.uuid4().hex
    pool = EnginePool(ray_grpo.engine_bundles(args.engines), args.engines,
                      [*emulator_command(spec_file), *engine_options(args)],
                      {MARKER_ENV: token}, workdir)
    monitor = RayMonitor(pool)
    try:
        pool.start_engines(list(range(args.engines)))
        monitor.urls = pool.urls()
        monitor.start()
        lock, trainer = PlainLock.remote(), TodayTrainer.remote()  # type: ignore[attr-defined]
        ray.get(trainer.refit.remote("0", list(pool.urls().values())))
        say(f"today's: {args.engines} engines booted in their actors, refit v0 done")

        def after(step: int) -> None:
            side.after.append((step, time.monotonic(),
                               current(list(pool.urls().values()), str(step))))

        def step(number: int, tally: Tally) -> None:
            today_step(number, pool, monitor, trainer, lock, tally)
            after(number)
        phases(side, args, pool.pids, step)
    finally:
        monitor.stop_event.set()
        live = set(pool.pids().values())
        side.orphans = len([p for p in marked(token) if p.pid not in live
                            and (p.ppid() if p.is_running() else None) not in live])
        pool.shutdown()
        kill_marked(token)
    return side


def today_step(step: int, pool: EnginePool, monitor: RayMonitor, trainer: Any, lock: Any,
               tally: Tally) -> None:
    """slime's step: generate with monitoring on; train; under the lock, recover the dead
    engines (boot included) and refit."""
    started, version = time.monotonic(), str(step - 1)
    try:
        monitor.paused.clear()       # health_monitoring_resume
        try:
            rollouts = generate("", step, None, one=pool.rollout)
        finally:
            monitor.paused.set()     # health_monitoring_pause
        stale = [r["meta_info"]["weight_version"] for r in rollouts
                 if r["meta_info"]["weight_version"] != version]
        ray.get(trainer.train.remote([float(len(r["text"]) % 7) for r in rollouts]))
        while not ray.get(lock.acquire.remote()):
            time.sleep(0.05)
        try:
            recovered = pool.recover()
            monitor.revive()
            ray.get(trainer.refit.remote(str(step), list(pool.urls().values())))
        finally:
            ray.get(lock.release.remote())
    except Exception as exc:   # noqa: BLE001 - a failed step is counted, and the run goes on
        tally.failed_steps += 1
        say(f"today's step {step} FAILED after {time.monotonic() - started:.1f} s: "
            f"{str(exc).strip().splitlines()[-1][:400]}")
        return
    took = tally.completed(len(rollouts), len(stale), started)
    say(f"today's step {step}: {len(rollouts)} rollouts at v{version}"
        f"{f', {len(stale)} STALE' if stale else ''}, refit v{step}"
        f"{f' after booting {len(recovered)} engine(s)' if recovered else ''}, {took:.2f} s")


# ---------------------------------------------------------------------------------- ours

def run_ours(args: argparse.Namespace, spec_file: Path, workdir: Path) -> Side:
    import rollout_watchdog.ray as rw_ray

    side = Side("ours", args.engines)
    with ray_grpo.router(workdir) as router_url:
        fleet = rw_ray.start(namespace=NAMESPACE, router_url=router_url)
        try:
            ray_grpo.launch_engines(fleet, spec_file, args.engines, engine_options(args))
            trainer = ray_grpo.start_trainer(fleet)
            ray.get(trainer.refit.remote("0"))
            weights = ray_grpo.Weights()
            say(f"ours: {args.engines} engines launched by the watchdogs, refit v0 committed")

            def victims() -> dict[str, int]:
                return {e.name: e.pid or 0 for e in fleet.engines()
                        if e.reachable and e.state == "healthy"}

            def after(step: int) -> None:
                urls = [e.url for e in fleet.engines() if e.reachable and e.serving]
                side.after.append((step, time.monotonic(), current(urls, weights.committed)))

            def step(number: int, tally: Tally) -> None:
                ray_grpo.run_steps(fleet, trainer, router_url, range(number, number + 1), {},
                                   tally, weights, after)
            phases(side, args, victims, step)
        finally:
            rw_ray.shutdown(namespace=NAMESPACE)
    return side


# ---------------------------------------------------------------------------------- figures

def report(side: Side) -> bool:
    """Print one side's figures; True when the goals (asked of ours) are met."""
    clean, churned = side.clean, side.churned
    print(f"\n{side.name}: {side.engines} engines, {len(side.deaths)} SIGKILLs")
    base = side.clean_s / max(1, clean.steps)
    mean = side.churn_s / max(1, churned.steps)
    summary("step time, fault-free", clean.step_s, "s", digits=2)
    summary("step time, under churn", churned.step_s, "s", digits=2)
    ratio = mean / base
    median_ratio = (statistics.median(churned.step_s) / statistics.median(clean.step_s)
                    if clean.step_s and churned.step_s else float("inf"))
    print(f"  goodput: {base:.2f} s a completed step fault-free, {mean:.2f} s under churn "
          f"({ratio:.2f}x; medians {median_ratio:.2f}x)")
    if side.skipped:
        print(f"  {side.skipped} step(s) not run: --side-limit reached")
    print(f"  failed steps: {clean.failed_steps + churned.failed_steps}; stale-weight "
          f"responses: {clean.stale + churned.stale} of {clean.rollouts + churned.rollouts}")
    back = side.recoveries()
    done = [b for b in back if b is not None]
    summary("back to full, refits after each death's step", [float(s) for s, _ in done], "steps",
            digits=0)
    summary("back to full, seconds after each death", [t for _, t in done], "s", digits=1)
    if len(done) < len(back):
        print(f"  never back to full: {len(back) - len(done)} death(s)")
    if side.orphans is not None:
        print(f"  engine processes left running by the engines killed (orphaned schedulers "
              f"of servers SIGKILLed or killed through Ray): {side.orphans}")
    ok = goal(f"step time <= {STEP_GOAL}x the fault-free run ({ratio:.2f}x)",
              ratio <= STEP_GOAL)
    ok &= goal("0 failed steps", clean.failed_steps + churned.failed_steps == 0)
    ok &= goal("0 stale-weight responses", clean.stale + churned.stale == 0)
    ok &= goal("engines back to full within one refit after each death's step",
               len(done) == len(back) and all(s <= 1 for s, _ in done))
    return ok


def engine_options(args: argparse.Namespace) -> tuple[str, ...]:
    return ("--token-latency-ms", f"{args.token_latency_ms:g}")


def main(args: argparse.Namespace) -> int:
    if args.quick:
        args.clean_steps, args.steps, args.period = 2, 6, min(args.period, 12.0)
        args.side_limit = min(args.side_limit, 120.0)
    args.engines = args.nodes * args.gpus_per_node
    print(f"setup: {args.nodes} Ray nodes x {args.gpus_per_node} GPUs (declared) = "
          f"{args.engines} engines; {args.clean_steps} fault-free steps, then {args.steps} with "
          f"an engine SIGKILL every {args.period:g} s (seed {args.seed}); emulator "
          f"--token-latency-ms {args.token_latency_ms:g}; today's monitor: interval "
          f"{MONITOR_INTERVAL_S:g} s, timeout {MONITOR_TIMEOUT_S:g} s, threshold "
          f"{MONITOR_THRESHOLD}", flush=True)
    logging.basicConfig(level=logging.ERROR)
    workdir = Path(tempfile.mkdtemp(prefix="rwbench-churn-"))
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "num_gpus": args.gpus_per_node})
    try:
        for _ in range(args.nodes - 1):
            cluster.add_node(num_cpus=2, num_gpus=args.gpus_per_node)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, logging_level=logging.ERROR, log_to_driver=False)
        signal.signal(signal.SIGTERM, raise_interrupt)   # ray.init() put its own in place
        spec_file = workdir / "policy-spec.json"
        write_weight_spec(str(spec_file), Policy().named_parameters())
        ok = True
        if args.side in ("both", "today"):
            report(run_today(args, spec_file, workdir))   # printed now: ours may not finish
        if args.side in ("both", "ours"):
            ok = report(run_ours(args, spec_file, workdir))
        return 0 if ok else 2
    finally:
        with contextlib.suppress(Exception):
            ray.shutdown()
        cluster.shutdown()
        if args.keep:
            print(f"  (files kept in {workdir})")
        else:
            shutil.rmtree(workdir, ignore_errors=True)


def extra_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nodes", type=int, default=4, help="Ray nodes (default 4)")
    parser.add_argument("--gpus-per-node", type=int, default=2,
                        help="GPUs each node declares: engines per node (default 2)")
    parser.add_argument("--clean-steps", type=int, default=6,
                        help="fault-free steps first (default 6)")
    parser.add_argument("--steps", type=int, default=40,
                        help="steps with the injector on (default 40)")
    parser.add_argument("--period", type=float, default=30.0,
                        help="seconds between engine SIGKILLs (default 30)")
    parser.add_argument("--token-latency-ms", type=float, default=20.0,
                        help="the emulators' time per decode step: the generation's length "
                             "(default 20 ms: ~4 s of a step)")
    parser.add_argument("--side-limit", type=float, default=900.0,
                        help="stop a side's steps after this many seconds of a phase (default 900)")
    parser.add_argument("--seed", type=int, default=1, help="seed of the victims' draw")
    parser.add_argument("--side", choices=("both", "today", "ours"), default="both",
                        help="run both approaches (default), or one")


if __name__ == "__main__":
    bench_main(main, parse_args(__doc__ or "", repeat=1, quick_repeat=1, time_limit=3600,
                                extra=extra_args))
