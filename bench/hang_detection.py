"""Hang detection latency with many engines of which half hang at once: the daemon vs today's
sequential health monitor, on the same engines in the same run.

What is measured, per hung engine: the wall clock just before the fault is injected to the moment
the failure is declared. Ours: the `ts` of the daemon's event `state -> stopping` with cause
`probe_failed`. Today's approach: the moment the re-implemented monitor (below) reaches its failure
threshold for that engine. Goal (issue 2): every hung engine declared within
failure_threshold x (health_interval_s + health_timeout_s) + 1 s, independent of the engine count.

Settings (realistic but short, the same for both approaches): health_interval_s = 1,
health_timeout_s = 2, failure_threshold = 3, so the bound is 3 x (1 + 2) + 1 = 10 s. The engines
run with SGLANG_HEALTH_CHECK_TIMEOUT = 20 (SGLang's default, above the probe timeout), so the
probe's own timeout rules, as in production.

The hang: `stall_generation` by default (the scheduler stops producing output while the HTTP
server keeps answering: a stuck forward pass or collective, the common real hang, and the one
/health_generate exists for); `--fault sigstop` freezes the engine's main process instead (no
HTTP answer at all). The engines to hang are drawn at random (seeded) at each repetition.

Sequencing on one fleet (same engines, same machine load for both approaches):
 1. ours: inject, wait until the daemon declared every hung engine. Engines use restart_policy
    "deferred", so the killed engines are not relaunched while the others are still being
    measured (a boot storm on a 2-core machine would otherwise distort the figures);
 2. restore: `restart` the failed engines, wait until all are healthy;
 3. today's approach: `pause --all` the daemon's deep probes (its liveness watch stays, it kills
    nothing that only hangs), start the monitor, wait one clean round plus a random delay (so the
    injection falls anywhere in its cycle), inject on the same engines, wait until the monitor
    declared every hung engine. The monitor only watches (the real one kills through Ray inside
    the same thread, which would only delay it further);
 4. restore: `restart` the hung engines, `resume --all`, wait until all are healthy.
Running both detectors at the same time was rejected: once the daemon kills a hung engine, the
monitor would see a refused connection at once instead of a timeout, flattering it.

Then the same scenario with 4 engines of which 2 hang (skipped with --quick), to show that our
latency does not depend on the engine count while the sequential monitor's does.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import requests
from _common import (
    Fleet,
    bench_main,
    engines,
    fault,
    goal,
    parse_args,
    step,
    summary,
    wait_for,
)

INTERVAL_S = 1.0
TIMEOUT_S = 2.0
THRESHOLD = 3
BOUND_S = THRESHOLD * (INTERVAL_S + TIMEOUT_S) + 1.0
PROBE = {"liveness_interval_s": 1.0, "health_path": "/health_generate",
         "health_interval_s": INTERVAL_S, "health_timeout_s": TIMEOUT_S,
         "failure_threshold": THRESHOLD, "startup_timeout_s": 600.0}
RESTART = {"grace_s": 5.0, "backoff_initial_s": 0.5, "backoff_max_s": 2.0, "max_restarts": 1000,
           "window_s": 600.0, "kill_timeout_s": 10.0, "release_timeout_s": 30.0}
ENGINE_ENV = {"SGLANG_HEALTH_CHECK_TIMEOUT": "20"}
BOOT_DEADLINE_S = 600.0
RESTORE_DEADLINE_S = 300.0


class SequentialMonitor(threading.Thread):
    """Today's approach, re-implemented: one driver thread probes the engines one after another.

    Faithful to slime's RolloutHealthMonitor (THUDM/slime, slime/utils/health_monitor.py:
    `_health_monitor_loop` -> `_run_health_checks` -> `_check_engine_health`, a `for` loop over
    the engines calling `ray.get(engine.health_generate.remote(timeout=...))`, then
    `self._stop_event.wait(self._check_interval)` between rounds) and to SGLangEngine.
    health_generate (slime/backends/sglang_utils/sglang_engine.py: `requests.get(
    f"http://{host}:{port}/health_generate", timeout=timeout)` then `raise_for_status()`).
    NeMo-RL's RolloutHealthMonitor (nemo_rl/models/generation/sglang) is a port of the same loop
    (it adds an outer `ray.get(..., timeout=2 * timeout)`); miles (radixark/miles,
    miles/utils/health_monitor.py) came from it and has since moved to parallel `ray.wait`.

    The original kills on the first failed probe and then skips that engine (`all_engines[i] =
    None`). `threshold` counts consecutive failed probes per engine so the comparison can use
    the same threshold as ours; threshold 1 is the original. Ray's call overhead and the kill
    (done inside the same thread in the original) are left out, which only favours it.
    """

    def __init__(self, urls: dict[str, str], *, interval_s: float, timeout_s: float,
                 threshold: int) -> None:
        super().__init__(name=f"sequential-monitor-t{threshold}", daemon=True)
        self.urls = urls
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.threshold = threshold
        self.failures = dict.fromkeys(urls, 0)
        self.declared: dict[str, float] = {}        # engine -> epoch seconds
        self.rounds: list[tuple[float, float]] = []   # (epoch start, seconds)
        self.stop_event = threading.Event()

    def run(self) -> None:
        while not self.stop_event.is_set():
            started, epoch = time.monotonic(), time.time()
            for engine_id, url in self.urls.items():
                if self.stop_event.is_set():
                    return
                if engine_id in self.declared:
                    continue  # the original set the engine to None after killing it
                self._check(engine_id, url)
            self.rounds.append((epoch, time.monotonic() - started))
            if self.stop_event.wait(self.interval_s):
                return

    def _check(self, engine_id: str, url: str) -> None:
        try:
            response = requests.get(f"{url}/health_generate", timeout=self.timeout_s)
            response.raise_for_status()
        except Exception:
            self.failures[engine_id] += 1
            if self.failures[engine_id] >= self.threshold:
                self.declared[engine_id] = time.time()
        else:
            self.failures[engine_id] = 0


@dataclass
class Results:
    """Detection latencies (s) of one scale, pooled over the repetitions."""

    ours: list[float] = field(default_factory=list)
    baseline: dict[int, list[float]] = field(default_factory=dict)   # threshold -> latencies
    false_positives: dict[str, list[str]] = field(default_factory=dict)
    round_s: list[float] = field(default_factory=list)


def inject(fleet: Fleet, ids: list[str], how: str) -> dict[str, float]:
    """Hang `ids` at once; returns the epoch time taken just before each injection."""
    status = fleet.status()
    barrier = threading.Barrier(len(ids))

    def one(engine_id: str) -> tuple[str, float]:
        barrier.wait(timeout=10)
        at = time.time()
        if how == "sigstop":
            os.kill(status[engine_id]["pid"], signal.SIGSTOP)
        else:
            fault(fleet.url(engine_id), "stall_generation")
        return engine_id, at

    with ThreadPoolExecutor(len(ids)) as pool:
        return dict(pool.map(one, ids))


def restore(fleet: Fleet) -> None:
    """Relaunch what failed or hangs, resume deep probes, until every engine is healthy."""
    def settled() -> bool:
        engines = fleet.status()
        for engine_id, e in engines.items():
            if e["state"] == "backoff" and e.get("deferred_waiting"):
                fleet.call("restart", {"engine": engine_id})
        return all(e["state"] == "healthy" and not e["paused"] for e in engines.values())
    wait_for(settled, RESTORE_DEADLINE_S, "every engine healthy again", interval=0.5)


def measure_ours(fleet: Fleet, hung: list[str], how: str, results: Results) -> None:
    fleet.events.pull()
    incarnation = {i: e["incarnation"] for i, e in fleet.status().items()}
    injected = inject(fleet, hung, how)
    for engine_id in hung:
        event = fleet.events.wait(BOUND_S * 3 + 30, engine=engine_id, kind="state",
                                  to="stopping", incarnation=incarnation[engine_id])
        if event["cause"] != "probe_failed":
            raise AssertionError(f"{engine_id}: unexpected failure event {event}")
        results.ours.append(event["ts"] - injected[engine_id])
    fleet.events.pull()
    results.false_positives.setdefault("ours", []).extend(
        e["engine"] for e in fleet.events.seen
        if e["kind"] == "state" and e["to"] == "stopping" and e["engine"] not in hung
        and e["incarnation"] == incarnation.get(e["engine"]))
    for engine_id in hung:
        fleet.call("restart", {"engine": engine_id})


def measure_baseline(fleet: Fleet, hung: list[str], how: str, rng: random.Random,
                     results: Results, thresholds: tuple[int, ...]) -> None:
    fleet.call("pause", {"all": True, "deadline_s": 900}, timeout_s=TIMEOUT_S + 15)
    urls = {i: fleet.url(i) for i in fleet.ids}
    monitors = [SequentialMonitor(urls, interval_s=INTERVAL_S, timeout_s=TIMEOUT_S,
                                  threshold=t) for t in thresholds]
    try:
        for m in monitors:
            m.start()
        wait_for(lambda: all(m.rounds for m in monitors), 60, "one clean monitor round")
        if any(m.declared for m in monitors):
            raise AssertionError("the sequential monitor failed a healthy engine")
        time.sleep(rng.uniform(0, INTERVAL_S + max(m.rounds[0][1] for m in monitors)))
        injected = inject(fleet, hung, how)
        limit = max(thresholds) * (len(hung) * TIMEOUT_S + len(urls) + INTERVAL_S) * 2 + 30
        wait_for(lambda: all(set(hung) <= set(m.declared) for m in monitors), limit,
                 "the sequential monitor to declare every hung engine", interval=0.1)
    finally:
        for m in monitors:
            m.stop_event.set()
        for m in monitors:
            m.join(timeout=TIMEOUT_S + 5)
    for m in monitors:
        results.baseline.setdefault(m.threshold, []).extend(
            m.declared[i] - injected[i] for i in hung)
        results.false_positives.setdefault(f"sequential t{m.threshold}", []).extend(
            i for i in m.declared if i not in hung)
        if m.threshold == THRESHOLD:  # rounds that began with hung engines in the fleet
            first = min(injected.values())
            results.round_s.extend(seconds for start, seconds in m.rounds if start >= first)
    for engine_id in hung:
        fleet.call("restart", {"engine": engine_id})
    fleet.call("resume", {"all": True})


def run_scale(args: argparse.Namespace, n: int, h: int, rng: random.Random) -> Results:
    results = Results()
    thresholds = (THRESHOLD, 1)
    print(f"\n== {n} engines, {h} hang at once ({args.fault}), {args.repeat} repetition(s)")
    with Fleet(f"hang{n}", engines(n, restart_policy="deferred"), probe=PROBE, restart=RESTART,
               env=ENGINE_ENV, keep=args.keep) as fleet:
        with step(f"boot {n} engines"):
            fleet.wait_all_healthy(BOOT_DEADLINE_S)
        for rep in range(args.repeat):
            hung = sorted(rng.sample(fleet.ids, h), key=lambda i: int(i[1:]))
            print(f"rep {rep + 1}: hanging {', '.join(hung)}", flush=True)
            with step("  ours: inject, wait for every failure event"):
                measure_ours(fleet, hung, args.fault, results)
            with step("  restore"):
                restore(fleet)
            with step("  sequential monitor: pause ours, inject, wait for every declaration"):
                measure_baseline(fleet, hung, args.fault, rng, results, thresholds)
            with step("  restore"):
                restore(fleet)
            last = results.ours[-h:]
            print(f"  ours: {fmt(last)}; sequential (t{THRESHOLD}): "
                  f"{fmt(results.baseline[THRESHOLD][-h:])}", flush=True)
    return results


def fmt(values: list[float]) -> str:
    return " ".join(f"{v:.1f}" for v in values) + " s"


def report(n: int, h: int, how: str, r: Results) -> bool:
    print(f"\nresults: {n} engines, {h} hung at once by {how}; interval {INTERVAL_S:g} s, "
          f"timeout {TIMEOUT_S:g} s, threshold {THRESHOLD}; bound {BOUND_S:g} s")
    ours = summary("ours (daemon, parallel probes)", r.ours, "s", digits=2)
    base = summary(f"sequential monitor, threshold {THRESHOLD} (same)", r.baseline[THRESHOLD],
                   "s", digits=2)
    summary("sequential monitor as shipped (threshold 1)", r.baseline[1], "s", digits=2)
    if r.round_s:
        summary("  its rounds after the injection", r.round_s, "s", digits=2)
    print(f"  ratio sequential (threshold {THRESHOLD}) / ours: median "
          f"{base.median / ours.median:.1f}x, max {base.max / ours.max:.1f}x")
    print(f"  false positives (healthy engines declared failed): "
          f"{ {k: len(v) for k, v in r.false_positives.items()} }")
    ok = goal(f"every hung engine declared within {BOUND_S:g} s (ours)", ours.max <= BOUND_S)
    ok &= goal("no false positive (ours)", not r.false_positives.get("ours"))
    return ok


def main(args: argparse.Namespace) -> int:
    rng = random.Random(args.seed)
    scales = [(16, 8)] if args.quick else [(16, 8), (4, 2)]
    print(f"setup: probe {PROBE}, restart {RESTART}, engine env {ENGINE_ENV}, "
          f"restart_policy deferred, seed {args.seed}")
    results = {scale: run_scale(args, *scale, rng) for scale in scales}
    ok = all([report(n, h, args.fault, r) for (n, h), r in results.items()])
    if len(results) > 1:
        big, small = (results[s] for s in scales)
        print(f"\nengine count ({scales[0][0]} vs {scales[1][0]} engines), median: ours "
              f"{statistics.median(big.ours):.2f} s vs {statistics.median(small.ours):.2f} s; "
              f"sequential (threshold {THRESHOLD}) "
              f"{statistics.median(big.baseline[THRESHOLD]):.2f} s vs "
              f"{statistics.median(small.baseline[THRESHOLD]):.2f} s")
    return 0 if ok else 2


def extra_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--fault", choices=("stall", "sigstop"), default="stall",
                        help="how engines hang: stall_generation (default) or SIGSTOP of the "
                             "main process")
    parser.add_argument("--seed", type=int, default=1, help="seed of the draw of hung engines")


if __name__ == "__main__":
    bench_main(main, parse_args(__doc__ or "", repeat=3, quick_repeat=1, time_limit=900,
                                extra=extra_args))
