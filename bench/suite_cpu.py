"""Where a command's CPU goes, by kind of process: the test suite's, above all (issue 13).

Runs the command with this process as its subreaper (so daemons that double-fork, and Ray's
raylets, stay its descendants), samples every descendant's CPU time each --interval seconds,
and at the end prints the CPU of each kind of process (KINDS, by command line), how many of
them ran, and the share of the whole. A process's CPU is its last sample (a zombie's is
final), so one that ran less than an interval is missed, and one SIGKILLed loses at most an
interval's CPU; children this process reaps itself are counted exactly (wait4's rusage).

    PYTHONPATH=<checkout> python bench/suite_cpu.py [--interval 0.7] [--json F] -- CMD...

e.g. `python bench/suite_cpu.py -- bash scripts/test.sh`. The sampler's own CPU is printed
with the figures (it is not in them); run nothing else beside it.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import psutil

PR_SET_CHILD_SUBREAPER = 36
# (kind, test of the command line), the first that matches names the process.
KINDS: list[tuple[str, Callable[[str], bool]]] = [
    ("emulator scheduler child (torch, unless --no-model)",
     lambda c: "multiprocessing.spawn" in c),
    ("multiprocessing resource tracker", lambda c: "multiprocessing.resource_tracker" in c),
    ("emulator main process", lambda c: "rollout_watchdog.emulator" in c),
    ("node daemon", lambda c: "rollout_watchdog run" in c or "rollout-watchdog run" in c),
    ("coordinator", lambda c: "coordinator" in c and "rollout" in c),
    ("ray workers", lambda c: "ray::" in c or "default_worker.py" in c),
    ("ray system", lambda c: any(s in c for s in ("raylet", "gcs_server", "dashboard",
                                                  "log_monitor", "ray/_private",
                                                  "ray/autoscaler"))),
    ("sglang-router", lambda c: "router" in c and "sglang" in c),
    ("pytest and its xdist workers", lambda c: " -m pytest" in c or "xdist" in c
     or "exec(eval(sys.stdin.readline()))" in c),   # (execnet's bootstrap: a worker's first)
    ("trainer and test helper scripts", lambda c: "/tests/" in c or " tests/" in c),
    ("examples and benchmarks", lambda c: "/examples/" in c or "/bench/" in c),
    ("lint and types (ruff, mypy, lint-imports)",
     lambda c: any(s in c for s in ("ruff", "mypy", "lint-imports"))),
    ("other rollout-watchdog commands", lambda c: "rollout_watchdog" in c
     or "rollout-watchdog" in c),
]


def kind_of(cmdline: str) -> str:
    return next((kind for kind, test in KINDS if test(cmdline)), "other")


@dataclass
class Seen:
    """A descendant as last sampled: its command line (the first read) and CPU seconds."""

    cmdline: str
    cpu_s: float


class Sampler:
    """The last CPU time seen of every descendant, by (pid, start time)."""

    def __init__(self) -> None:
        self.me = psutil.Process()
        self.seen: dict[tuple[int, float], Seen] = {}

    def sample(self) -> None:
        for proc in self.me.children(recursive=True):
            try:
                with proc.oneshot():
                    key = (proc.pid, proc.create_time())
                    times = proc.cpu_times()
                    known = self.seen.get(key)
                    cmdline = known.cmdline if known and known.cmdline \
                        else " ".join(proc.cmdline())
            except psutil.Error:
                continue
            self.seen[key] = Seen(cmdline, times.user + times.system)

    def reap(self, keep: int) -> None:
        """Reap the orphans handed to this subreaper (not `keep`, the command), with their
        exact CPU."""
        for proc in self.me.children():
            try:
                if proc.pid == keep or proc.status() != psutil.STATUS_ZOMBIE:
                    continue
                pid, _, usage = os.wait4(proc.pid, os.WNOHANG)
            except (psutil.Error, ChildProcessError):
                continue
            mine = [key for key in self.seen if key[0] == pid]
            if mine:   # (the latest process of that pid)
                entry = self.seen[max(mine, key=lambda key: key[1])]
                entry.cpu_s = max(entry.cpu_s, usage.ru_utime + usage.ru_stime)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--interval", type=float, default=0.7, help="seconds between samples")
    parser.add_argument("--json", help="also write every process seen: [pid, cmdline, cpu s]")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given (after --)")
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        print("suite_cpu: cannot become a subreaper; daemons that detach are missed",
              file=sys.stderr)
    sampler = Sampler()
    started = time.monotonic()
    child = subprocess.Popen(command)
    while child.poll() is None:
        sampler.sample()
        sampler.reap(child.pid)
        time.sleep(args.interval)
    sampler.sample()
    sampler.reap(child.pid)
    wall = time.monotonic() - started
    cpu: defaultdict[str, float] = defaultdict(float)
    count: Counter[str] = Counter()
    for seen in sampler.seen.values():
        kind = kind_of(seen.cmdline)
        cpu[kind] += seen.cpu_s
        count[kind] += 1
    own = sampler.me.cpu_times()
    total = sum(cpu.values())
    print(f"\nsuite_cpu: {' '.join(command)[:80]}: exit {child.returncode}, {wall:.0f} s wall, "
          f"{total:.0f} s CPU in {sum(count.values())} processes "
          f"({total / wall if wall else 0:.2f} cores on average); the sampler's own CPU "
          f"{own.user + own.system:.1f} s")
    for kind, seconds in sorted(cpu.items(), key=lambda item: -item[1]):
        print(f"  {seconds:8.1f} s  {100 * seconds / total if total else 0:5.1f} %  "
              f"{count[kind]:5d} processes  {kind}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump([[key[0], seen.cmdline, seen.cpu_s]
                       for key, seen in sampler.seen.items()], out)
    return child.returncode


if __name__ == "__main__":
    sys.exit(main())
