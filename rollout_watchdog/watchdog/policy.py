"""Supervision decisions as pure functions: backoff, the restart budget, the probe threshold,
and which processes of an engine are fatal."""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass

from rollout_watchdog.config import RestartConfig
from rollout_watchdog.watchdog.process import ProcKey, ProcStat

JITTER = 0.2


def backoff_delay(consecutive_failures: int, restart: RestartConfig,
                  rng: random.Random | None = None) -> float:
    """Delay before relaunch number `consecutive_failures` (1-based): exponential, capped, +-20 %.

    The jitter keeps engines that failed together (a node-wide hiccup) from relaunching in step.
    """
    if consecutive_failures <= 0 or restart.backoff_initial_s == 0:
        return 0.0
    exponent = min(consecutive_failures - 1, 62)
    base = min(restart.backoff_max_s, restart.backoff_initial_s * (2.0 ** exponent))
    factor = 1.0 + JITTER * (2.0 * (rng or random).random() - 1.0)
    return base * factor


def relaunches_in_window(relaunch_times: Iterable[float], now: float,
                         restart: RestartConfig) -> int:
    return sum(1 for t in relaunch_times if now - t < restart.window_s)


def budget_exhausted(relaunch_times: Iterable[float], now: float, restart: RestartConfig) -> bool:
    """True when a fresh failure must not be relaunched: `max_restarts` relaunches already
    happened within `window_s`."""
    return relaunches_in_window(relaunch_times, now, restart) >= restart.max_restarts


@dataclass(frozen=True)
class ProbeVerdict:
    failures: int          # consecutive failed probes after this result
    suspect: bool          # the engine should be (or stay) suspect
    declare_failed: bool   # the threshold is reached: kill it


def judge_probe(ok: bool, failures_before: int, threshold: int) -> ProbeVerdict:
    """One passing probe clears suspicion; `threshold` consecutive failures declare a failure."""
    if ok:
        return ProbeVerdict(0, False, False)
    failures = failures_before + 1
    return ProbeVerdict(failures, True, failures >= threshold)


# SGLang names its own processes (sglang::scheduler, sglang::detokenizer,
# sglang::data_parallel_controller); the kernel keeps the first 15 bytes.
ENGINE_PROCESS_PREFIX = "sglang::"


def long_lived(stat: ProcStat, main: ProcKey, started_for: float) -> bool:
    """One of the engine's own processes, whose exit is fatal: recognized by its name, or a
    direct child of the main process that has lived through the start-up (started in its
    first half; a helper started just before the engine turned healthy is not)."""
    if stat.comm.startswith(ENGINE_PROCESS_PREFIX):
        return True
    return stat.ppid == main.pid and stat.start_time - main.start_time <= started_for / 2
