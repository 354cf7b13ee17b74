"""The daemon's own cost: CPU (user + system, % of one core) and memory (RSS) while it watches 16
healthy engines with the default probe settings of DESIGN.md.

Measured with psutil on the daemon process only (its threads included, its engines excluded):
CPU time consumed over each window divided by the window's wall time, and RSS sampled every
second; the peak is both the largest sample and the kernel's high-water mark (VmHWM, which also
covers start-up). The windows start after every engine is healthy and a settling period has
passed; nothing talks to the daemon during a window (its state is checked after the last one).
Goal (issue 2): <= 1 % of one core, <= 80 MB RSS (MB = 10^6 bytes here).

Settings: the defaults (liveness_interval_s 1, health_interval_s 5, health_timeout_s 30,
failure_threshold 3; restart defaults); engines with SGLANG_HEALTH_CHECK_TIMEOUT 20 (SGLang's
default). --quick: one 15 s window instead of --repeat windows of 60 s.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import psutil
from _common import Fleet, bench_main, engines, goal, parse_args, step, summary

from rollout_watchdog.config import ProbeConfig, RestartConfig
from rollout_watchdog.watchdog.process import descendants

ENGINES = 16
PROBE = dataclasses.asdict(ProbeConfig())
RESTART = dataclasses.asdict(RestartConfig())
ENGINE_ENV = {"SGLANG_HEALTH_CHECK_TIMEOUT": "20"}
DESIGN_DEFAULTS = {"liveness_interval_s": 1.0, "health_interval_s": 5.0, "health_timeout_s": 30.0,
                   "failure_threshold": 3}
MB = 1e6


def cpu_seconds(proc: psutil.Process) -> float:
    times = proc.cpu_times()
    return times.user + times.system


def vm_hwm_bytes(pid: int) -> int:
    """The kernel's peak RSS of the process since it started."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/PID/status")


def thread_cpu(proc: psutil.Process) -> dict[int, float]:
    """CPU seconds (user + system) of each thread of the process."""
    return {t.id: t.user_time + t.system_time for t in proc.threads()}


def wakeups(pid: int) -> int:
    """Voluntary context switches of the main thread: about one per main-loop wait."""
    with open(f"/proc/{pid}/task/{pid}/status") as f:
        for line in f:
            if line.startswith("voluntary_ctxt_switches:"):
                return int(line.split()[1])
    return 0


def scan_cost_ms(roots: list[int], times: int = 20) -> float:
    """What one liveness sweep's scan of the process table costs (measured here, not in the
    daemon): it grows with the number of processes on the node, not with the engines."""
    samples = []
    for _ in range(times):
        started = time.perf_counter()
        descendants(roots)
        samples.append((time.perf_counter() - started) * 1000)
    return statistics.median(samples)


def main(args: argparse.Namespace) -> int:
    mismatched = {k: (v, PROBE[k]) for k, v in DESIGN_DEFAULTS.items() if PROBE[k] != v}
    if mismatched:
        print(f"note: the code's probe defaults differ from DESIGN.md: {mismatched}; using "
              f"DESIGN.md's")
        PROBE.update(DESIGN_DEFAULTS)
    if args.liveness_interval is not None:
        PROBE["liveness_interval_s"] = args.liveness_interval
        print(f"note: liveness_interval_s = {args.liveness_interval:g} (not the default), to see "
              "what the liveness sweep costs")
    window_s = 15.0 if args.quick else args.window
    print(f"setup: {ENGINES} emulator engines, probe {PROBE}, restart {RESTART}, engine env "
          f"{ENGINE_ENV}; {args.repeat} window(s) of {window_s:g} s after {args.settle:g} s "
          f"settling")
    cpu_pct: list[float] = []
    rss_mb: list[float] = []
    main_share: list[float] = []
    wake_rate: list[float] = []
    with Fleet("cost", engines(ENGINES), probe=PROBE, restart=RESTART, env=ENGINE_ENV,
               keep=args.keep) as fleet:
        with step(f"boot {ENGINES} engines"):
            fleet.wait_all_healthy(600)
        with step("settle"):
            time.sleep(args.settle)
        proc = psutil.Process(fleet.daemon_pid)
        for w in range(args.repeat):
            window_rss = []
            threads0, wake0 = thread_cpu(proc), wakeups(proc.pid)
            started, cpu0 = time.monotonic(), cpu_seconds(proc)
            while (elapsed := time.monotonic() - started) < window_s:
                window_rss.append(proc.memory_info().rss / MB)
                time.sleep(min(1.0, max(0.0, window_s - elapsed)))
            cpu1, wall = cpu_seconds(proc), time.monotonic() - started
            threads1, wake1 = thread_cpu(proc), wakeups(proc.pid)
            cpu_pct.append((cpu1 - cpu0) / wall * 100)
            rss_mb.extend(window_rss)
            main_cpu = threads1.get(proc.pid, 0.0) - threads0.get(proc.pid, 0.0)
            main_share.append(main_cpu / max(cpu1 - cpu0, 1e-9) * 100)
            wake_rate.append((wake1 - wake0) / wall)
            print(f"  window {w + 1}: {wall:.1f} s, CPU {cpu1 - cpu0:.3f} s = "
                  f"{cpu_pct[-1]:.3f} % of one core ({main_share[-1]:.0f} % of it in the main "
                  f"loop, {wake_rate[-1]:.1f} wake-ups/s), RSS {min(window_rss):.1f}-"
                  f"{max(window_rss):.1f} MB", flush=True)
        hwm = vm_hwm_bytes(proc.pid) / MB
        threads, fds = proc.num_threads(), proc.num_fds()
        status = fleet.status()
        scan_ms = scan_cost_ms([e["pid"] for e in status.values() if e["pid"]])
        host_procs = len(psutil.pids())
        troubled = {i: (e["state"], e["incarnation"]) for i, e in status.items()
                    if e["state"] != "healthy" or e["incarnation"] != 1}

    print(f"\nresults: the daemon with {ENGINES} healthy engines ({threads} threads, {fds} fds)")
    cpu = summary("CPU, % of one core (per window)", cpu_pct, "%", digits=3)
    rss = summary("RSS (1 s samples)", rss_mb, "MB", digits=1)
    print(f"  peak RSS: {max(rss_mb):.1f} MB sampled, {hwm:.1f} MB high-water mark (VmHWM, "
          "since start)")
    summary("  share of it in the main loop thread", main_share, "%", digits=0)
    summary("  main-loop wake-ups per second", wake_rate, "/s", digits=1)
    print(f"  one scan of the process table (the liveness sweep, once per liveness_interval_s): "
          f"{scan_ms:.2f} ms here, with {host_procs} processes on this host")
    if troubled:
        print(f"  engines not healthy in their first incarnation at the end: {troubled}")
    ok = goal("CPU <= 1 % of one core (every window)", cpu.max <= 1.0)
    ok &= goal("RSS <= 80 MB (peak, VmHWM)", max(hwm, rss.max) <= 80)
    ok &= goal("all engines stayed healthy", not troubled)
    return 0 if ok else 2


def extra_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--window", type=float, default=60.0,
                        help="seconds per measurement window (default 60)")
    parser.add_argument("--liveness-interval", type=float, default=None,
                        help="override liveness_interval_s (diagnosis: the sweep's share)")
    parser.add_argument("--settle", type=float, default=10.0,
                        help="seconds to wait after every engine is healthy (default 10)")


if __name__ == "__main__":
    bench_main(main, parse_args(__doc__ or "", repeat=3, quick_repeat=1, time_limit=600,
                                extra=extra_args))
