"""CPU by part and by phase for the fleet benchmark (bench/fleet_scale.py): which process
bounds a figure on a machine whose cores are all busy."""

from __future__ import annotations

import os
import time
from typing import Any

import psutil


class CpuMeter:
    """CPU by phase (% of one core) of the coordinator, the node processes together, the
    subscriber's thread and the whole machine; the coordinator's peak RSS."""

    PARTS = ("coordinator", "nodes", "subscriber", "machine")

    def __init__(self) -> None:
        self.proc: psutil.Process | None = None
        self.nodes: list[psutil.Process] = []
        self.subscriber: int | None = None   # the subscriber thread's native id
        self.peak_rss = 0
        self.phases: list[tuple[str, float, dict[str, float]]] = []  # name, seconds, CPU s

    def attach(self, pid: int) -> None:
        self.proc = psutil.Process(pid)

    def measure(self, name: str, fn: Any, *fargs: Any) -> Any:
        before, started = self.seconds(), time.monotonic()
        result = fn(*fargs)
        after, elapsed = self.seconds(), time.monotonic() - started
        self.phases.append((name, elapsed, {k: after[k] - before[k] for k in self.PARTS}))
        self.sample()
        return result

    def sample(self) -> None:
        if self.proc is not None:
            self.peak_rss = max(self.peak_rss, self.proc.memory_info().rss)

    def report(self) -> None:
        print(f"  {'CPU, % of one core, during':<44}" + "".join(f"{k:>12}" for k in self.PARTS))
        for name, elapsed, used in self.phases:
            self.line(name, elapsed, used)

    def line(self, name: str, elapsed: float, used: dict[str, float]) -> None:
        """One row; "-" for a phase too short for the 10 ms accounting of CPU time."""
        print(f"  {name:<44}" + "".join(
            f"{100 * used[k] / elapsed:12.1f}" if elapsed >= 0.1 else f"{'-':>12}"
            for k in self.PARTS))

    def main_thread_seconds(self) -> float:
        """CPU seconds of the coordinator's main thread (its loop; the rest of the process
        is libzmq's I/O thread, its ZAP handler and the refit state's writer)."""
        assert self.proc is not None
        return sum(t.user_time + t.system_time for t in self.proc.threads()
                   if t.id == self.proc.pid)

    def seconds(self) -> dict[str, float]:
        """CPU seconds used so far by each part."""
        assert self.proc is not None
        machine = psutil.cpu_times()
        thread = [t for t in psutil.Process().threads() if t.id == self.subscriber]
        return {"coordinator": _busy(self.proc.cpu_times()),
                "nodes": sum(_busy(p.cpu_times()) for p in self.nodes),
                "subscriber": sum(t.user_time + t.system_time for t in thread),
                "machine": sum(machine) - machine.idle - getattr(machine, "iowait", 0.0)}


def _busy(times: Any) -> float:
    return float(times.user + times.system)


def pin_apart(alone: int, others: list[int]) -> str:
    """Every thread of process `alone` on the first CPU it may use, every thread of `others`
    on the rest: the coordinator's CPU with no simulated node on its core, as in a fleet whose
    nodes are other machines (its threads still share that one core). What was done, said."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise SystemExit("--pin needs 2 CPUs or more")
    for pid, where in [(alone, {cpus[0]}), *((pid, set(cpus[1:])) for pid in others)]:
        for thread in psutil.Process(pid).threads():
            os.sched_setaffinity(thread.id, where)
    return (f"pinned: the coordinator on CPU {cpus[0]}, the simulated nodes and the subscriber "
            f"on CPU {','.join(map(str, cpus[1:]))}")
