"""Hang detection latency with many engines of which half hang at once: the daemon vs today's
sequential health monitor, on the same engines in the same run, at 16, 4 and 64 engines.

What is measured, per hung engine: the wall clock just before the fault is injected to the moment
the failure is declared. Ours: the `ts` of the daemon's event `state -> stopping` with cause
`probe_failed`. Today's approach: the moment the re-implemented monitor (below) reaches its failure
threshold for that engine.

Settings (realistic but short, the same for both approaches): health_interval_s = 1,
health_timeout_s = 2, failure_threshold = 3. The engines run with SGLANG_HEALTH_CHECK_TIMEOUT = 20
(SGLang's default, above the probe timeout), so the probe's own timeout rules, as in production.

Figures and goals, for ours:
- the floor: no probe-based detector can declare a hang before failure_threshold x
  health_timeout_s (6 s) have passed; each latency is also shown as a ratio to the floor and to
  the floor plus one interval (7 s), the most a hang can wait for its first failing probe;
  goal (issue 5): median <= 1.1 x (floor + one interval) = 7.7 s, at every engine count;
- issue 2's bound: every hung engine within threshold x (interval + timeout) + 1 s = 10 s;
- the ratio of the sequential monitor's latencies to ours (median and max) at each engine count:
  it grows with the number of hung engines, each of which costs the monitor a whole timeout.

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

Scales: 16 engines of which 8 hang (--repeat times), then 4 of which 2 hang (--repeat times), then
--large-engines (default 64) of which half hang (--large-repeat times, default 1: one repetition
already gives 32 latencies, and the sequential monitor needs minutes per repetition there). The
large fleet is made of real emulator engines too: one costs ~170 MB (torch scheduler child
included), ~1 s of CPU to boot and ~1 ms of CPU per probe, so 64 of them fit the 2-core, 24 GiB
machine (~11 GB). `--large-engines 0` skips that scale; --quick runs only 16 / 8, once. Each
scale's figures are printed as soon as it is measured, and a table by engine count at the end.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import requests
from _common import (
    Fleet,
    Summary,
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
BOUND_S = THRESHOLD * (INTERVAL_S + TIMEOUT_S) + 1.0   # issue 2's bound on every latency
FLOOR_S = THRESHOLD * TIMEOUT_S                         # no probe-based detector is faster
FLOOR_GOAL = 1.1                                        # issue 5: median / (floor + interval)
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

    engines: int
    hung: int
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


def run_scale(args: argparse.Namespace, n: int, h: int, repeat: int,
              rng: random.Random) -> Results:
    results = Results(n, h)
    thresholds = (THRESHOLD, 1)
    print(f"\n== {n} engines, {h} hang at once ({args.fault}), {repeat} repetition(s)")
    with Fleet(f"hang{n}", engines(n, restart_policy="deferred"), probe=PROBE, restart=RESTART,
               env=ENGINE_ENV, keep=args.keep) as fleet:
        with step(f"boot {n} engines"):
            fleet.wait_all_healthy(BOOT_DEADLINE_S)
        for rep in range(repeat):
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


def report(how: str, r: Results) -> bool:
    """Print one scale's figures (ours against the floor and the sequential monitor); True when
    every goal is met."""
    edge = FLOOR_S + INTERVAL_S
    print(f"\nresults: {r.engines} engines, {r.hung} hung at once by {how}; interval "
          f"{INTERVAL_S:g} s, timeout {TIMEOUT_S:g} s, threshold {THRESHOLD}; floor (threshold x "
          f"timeout) {FLOOR_S:g} s, floor + one interval {edge:g} s")
    ours = summary("ours (daemon, parallel probes)", r.ours, "s", digits=2)
    summary("  ours / floor", [v / FLOOR_S for v in r.ours], "x", digits=2)
    summary("  ours / (floor + one interval)", [v / edge for v in r.ours], "x", digits=2)
    base = summary(f"sequential monitor, threshold {THRESHOLD} (same)", r.baseline[THRESHOLD],
                   "s", digits=2)
    shipped = summary("sequential monitor as shipped (threshold 1)", r.baseline[1], "s",
                      digits=2)
    if r.round_s:
        summary("  its rounds after the injection", r.round_s, "s", digits=2)
    print(f"  ratio sequential (threshold {THRESHOLD}) / ours: median "
          f"{base.median / ours.median:.1f}x, max {base.max / ours.max:.1f}x; as shipped "
          f"(threshold 1) / ours: median {shipped.median / ours.median:.1f}x, max "
          f"{shipped.max / ours.max:.1f}x")
    print(f"  false positives (healthy engines declared failed): "
          f"{ {k: len(v) for k, v in r.false_positives.items()} }")
    ok = goal(f"median within {FLOOR_GOAL:g} x (floor + one interval) = "
              f"{FLOOR_GOAL * edge:.2f} s (ours; median is {ours.median / edge:.2f}x)",
              ours.median <= FLOOR_GOAL * edge)
    ok &= goal(f"every hung engine declared within {BOUND_S:g} s (ours)", ours.max <= BOUND_S)
    ok &= goal("no false positive (ours)", not r.false_positives.get("ours"))
    return ok


def by_engine_count(results: list[Results]) -> None:
    """The table users with large fleets look at: ours stays put, the sequential monitor not."""
    edge = FLOOR_S + INTERVAL_S
    print(f"\nby engine count (medians; max in brackets; sequential at threshold {THRESHOLD}):")
    print(f"  {'engines':>7} {'hung':>4}  {'ours s':>13}  {'ours/(floor+int)':>16}  "
          f"{'sequential s':>15}  {'sequential/ours':>15}")
    for r in sorted(results, key=lambda r: r.engines):
        ours, base = Summary("", r.ours, "s"), Summary("", r.baseline[THRESHOLD], "s")
        print(f"  {r.engines:>7} {r.hung:>4}  {ours.median:>5.2f} ({ours.max:5.2f})  "
              f"{ours.median / edge:>8.2f} ({ours.max / edge:4.2f})  "
              f"{base.median:>6.1f} ({base.max:6.1f})  "
              f"{base.median / ours.median:>6.1f}x ({base.max / ours.max:4.1f}x)", flush=True)


def main(args: argparse.Namespace) -> int:
    rng = random.Random(args.seed)
    scales = [(16, 8, args.repeat)]
    if not args.quick:
        scales.append((4, 2, args.repeat))
        if args.large_engines:
            scales.append((args.large_engines, args.large_engines // 2, args.large_repeat))
    print(f"setup: probe {PROBE}, restart {RESTART}, engine env {ENGINE_ENV}, "
          f"restart_policy deferred, seed {args.seed}; scales (engines, hung, repetitions): "
          f"{scales}")
    results, ok = [], True
    for n, h, repeat in scales:
        results.append(run_scale(args, n, h, repeat, rng))
        ok &= report(args.fault, results[-1])   # printed now: a later scale may hit the limit
    by_engine_count(results)
    return 0 if ok else 2


def count(low: int, *, zero: bool) -> Callable[[str], int]:
    """An argparse type: an integer >= low, or 0 too where `zero` (which skips the thing)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < low and not (zero and value == 0):
            raise argparse.ArgumentTypeError(
                f"must be {'0 or ' if zero else ''}>= {low}, not {value}")
        return value
    return parse


def extra_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--fault", choices=("stall", "sigstop"), default="stall",
                        help="how engines hang: stall_generation (default) or SIGSTOP of the "
                             "main process")
    parser.add_argument("--seed", type=int, default=1, help="seed of the draw of hung engines")
    parser.add_argument("--large-engines", type=count(2, zero=True), default=64, metavar="N",
                        help="engines of the large scale, half of them hung (default 64; 0: skip "
                             "it; never run with --quick)")
    parser.add_argument("--large-repeat", type=count(1, zero=False), default=1, metavar="R",
                        help="repetitions at the large scale (default 1)")


if __name__ == "__main__":
    bench_main(main, parse_args(__doc__ or "", repeat=3, quick_repeat=1, time_limit=1800,
                                extra=extra_args))
