"""Supervision decisions as pure functions: backoff, the restart budget, the probe interval and
threshold, the progress stall, and which processes of an engine are fatal."""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass

from rollout_watchdog.common.states import EngineState
from rollout_watchdog.config import ProbeConfig, RestartConfig
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


def probe_interval(state: EngineState, probe: ProbeConfig, took_s: float = 0.0) -> float:
    """The wait from a probe's end to the next one's start (`took_s`: how long that probe
    ran). While starting, at least every second: boot completion should be seen quickly.
    While suspect, the next probe starts `health_interval_s` after the last one *started*:
    timeouts run back to back, so a hang is declared after `failure_threshold` timeouts (issue
    5's floor), while failures that come fast (a refused connection, a 503 while draining) are
    still spread over the threshold's intervals, not declared within milliseconds."""
    interval = probe.health_interval_s
    if state == EngineState.SUSPECT:
        return max(0.0, interval - took_s)
    return min(interval, 1.0) if state == EngineState.STARTING else interval


@dataclass(frozen=True)
class ProgressVerdict:
    tokens: float              # the token counter to remember
    since: float               # since when it has not moved
    stalled_s: float | None    # how long it stood still with requests running, once that is
                               # progress_timeout_s or more; else None


def judge_progress(tokens: float, running: float, last_tokens: float | None, since: float,
                   now: float, timeout_s: float) -> ProgressVerdict:
    """The progress probe: a token counter that does not move while requests run means a
    stuck engine, even one whose health probe still passes. The count starts again whenever
    the counter moves or nothing runs."""
    if last_tokens is None or tokens != last_tokens or running == 0:
        return ProgressVerdict(tokens, now, None)
    stuck_s = now - since
    return ProgressVerdict(tokens, since, stuck_s if stuck_s >= timeout_s else None)


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
