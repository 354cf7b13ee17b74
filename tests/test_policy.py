"""Restart policy as pure functions: backoff with jitter, restart budget, probe threshold,
probe interval, progress stall."""

from __future__ import annotations

import random
import statistics

import pytest

from rollout_watchdog.common.states import EngineState
from rollout_watchdog.config import ProbeConfig, RestartConfig
from rollout_watchdog.watchdog.policy import (
    ProbeVerdict,
    ProgressVerdict,
    backoff_delay,
    budget_exhausted,
    judge_probe,
    judge_progress,
    probe_interval,
    relaunches_in_window,
)


class FixedRandom(random.Random):
    """A Random whose random() always returns `value`: 0.5 is no jitter, 0.0 / ~1.0 the edges."""

    def __init__(self, value: float) -> None:
        super().__init__(0)
        self.value = value

    def random(self) -> float:
        return self.value


NO_JITTER = FixedRandom(0.5)


# ------------------------------------------------------------------ backoff


def test_backoff_doubles_from_initial_and_is_capped_at_max() -> None:
    restart = RestartConfig(backoff_initial_s=1.0, backoff_max_s=60.0)  # DESIGN.md defaults
    delays = [backoff_delay(n, restart, NO_JITTER) for n in range(1, 10)]
    assert delays == pytest.approx([1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0, 60.0])


def test_backoff_uses_the_configured_initial_and_max() -> None:
    restart = RestartConfig(backoff_initial_s=0.25, backoff_max_s=1.5)
    delays = [backoff_delay(n, restart, NO_JITTER) for n in range(1, 6)]
    assert delays == pytest.approx([0.25, 0.5, 1.0, 1.5, 1.5])


def test_backoff_stays_capped_after_very_many_failures() -> None:
    restart = RestartConfig(backoff_initial_s=1.0, backoff_max_s=60.0)
    assert backoff_delay(10_000, restart, NO_JITTER) == pytest.approx(60.0)


def test_backoff_is_zero_when_initial_is_zero() -> None:
    restart = RestartConfig(backoff_initial_s=0.0, backoff_max_s=60.0)
    for n in (1, 2, 10):
        assert backoff_delay(n, restart, random.Random(n)) == 0.0


def test_no_failure_means_no_delay() -> None:
    assert backoff_delay(0, RestartConfig(), random.Random(1)) == 0.0


@pytest.mark.parametrize(("draw", "factor"), [(0.0, 0.8), (0.5, 1.0), (0.999999, 1.2)])
def test_jitter_edges_are_plus_minus_twenty_percent(draw: float, factor: float) -> None:
    restart = RestartConfig(backoff_initial_s=2.0, backoff_max_s=60.0)
    assert backoff_delay(3, restart, FixedRandom(draw)) == pytest.approx(8.0 * factor, rel=1e-5)


@pytest.mark.parametrize("failures", [1, 3, 7, 20])
def test_jitter_stays_within_twenty_percent_over_many_samples(failures: int) -> None:
    restart = RestartConfig(backoff_initial_s=1.0, backoff_max_s=60.0)
    base = min(60.0, 2.0 ** (failures - 1))
    rng = random.Random(1234)
    samples = [backoff_delay(failures, restart, rng) for _ in range(5000)]
    assert all(0.8 * base <= d <= 1.2 * base for d in samples)
    # It really is jittered: spread over the whole band, centred on the base delay.
    assert min(samples) < 0.82 * base
    assert max(samples) > 1.18 * base
    assert statistics.mean(samples) == pytest.approx(base, rel=0.02)
    assert len(set(samples)) > 4000


def test_jitter_is_reproducible_with_a_seeded_random() -> None:
    restart = RestartConfig()
    a = [backoff_delay(n, restart, random.Random(42)) for n in range(1, 8)]
    b = [backoff_delay(n, restart, random.Random(42)) for n in range(1, 8)]
    assert a == b


def test_engines_that_failed_together_do_not_relaunch_in_step() -> None:
    restart = RestartConfig()
    rng = random.Random(7)
    delays = {backoff_delay(1, restart, rng) for _ in range(16)}
    assert len(delays) == 16


def test_backoff_without_rng_uses_the_module_random_within_bounds() -> None:
    restart = RestartConfig(backoff_initial_s=1.0, backoff_max_s=60.0)
    for _ in range(200):
        assert 3.2 <= backoff_delay(3, restart) <= 4.8


# ------------------------------------------------------------------ restart budget


def test_budget_counts_relaunches_within_the_window() -> None:
    restart = RestartConfig(max_restarts=3, window_s=600.0)
    now = 10_000.0
    assert relaunches_in_window([], now, restart) == 0
    assert relaunches_in_window([now - 500, now - 100, now - 1], now, restart) == 3
    assert relaunches_in_window([now - 601, now - 100], now, restart) == 1


def test_budget_is_exhausted_after_max_restarts_within_window() -> None:
    restart = RestartConfig(max_restarts=3, window_s=600.0)
    now = 10_000.0
    assert not budget_exhausted([], now, restart)
    assert not budget_exhausted([now - 30, now - 20], now, restart)
    assert budget_exhausted([now - 30, now - 20, now - 10], now, restart)
    assert budget_exhausted([now - 40, now - 30, now - 20, now - 10], now, restart)


def test_old_relaunches_fall_out_of_the_window() -> None:
    restart = RestartConfig(max_restarts=2, window_s=60.0)
    relaunches = [1000.0, 1010.0]
    assert budget_exhausted(relaunches, 1020.0, restart)
    # 60 s after the first relaunch only the second still counts.
    assert relaunches_in_window(relaunches, 1060.5, restart) == 1
    assert not budget_exhausted(relaunches, 1060.5, restart)
    # Just inside the window both count.
    assert budget_exhausted(relaunches, 1059.9, restart)
    # Long after, none count.
    assert relaunches_in_window(relaunches, 5000.0, restart) == 0
    assert not budget_exhausted(relaunches, 5000.0, restart)


def test_max_restarts_zero_means_never_relaunch() -> None:
    restart = RestartConfig(max_restarts=0, window_s=600.0)
    assert budget_exhausted([], 100.0, restart)
    assert budget_exhausted([], 1e9, restart)


def test_budget_accepts_any_iterable_of_times() -> None:
    restart = RestartConfig(max_restarts=2, window_s=600.0)
    assert budget_exhausted(iter([90.0, 95.0]), 100.0, restart)
    assert relaunches_in_window((t for t in (90.0, 95.0)), 100.0, restart) == 2


# ------------------------------------------------------------------ probe threshold


def test_one_failure_makes_suspect_without_declaring_failure() -> None:
    assert judge_probe(False, 0, 3) == ProbeVerdict(failures=1, suspect=True,
                                                    declare_failed=False)


def test_threshold_consecutive_failures_declare_failure() -> None:
    failures = 0
    verdicts = []
    for _ in range(3):
        verdict = judge_probe(False, failures, 3)
        failures = verdict.failures
        verdicts.append(verdict)
    assert [v.failures for v in verdicts] == [1, 2, 3]
    assert [v.suspect for v in verdicts] == [True, True, True]
    assert [v.declare_failed for v in verdicts] == [False, False, True]


def test_one_passing_probe_clears_suspicion() -> None:
    assert judge_probe(True, 2, 3) == ProbeVerdict(failures=0, suspect=False,
                                                   declare_failed=False)
    # After clearing, it takes the full threshold again.
    assert not judge_probe(False, judge_probe(True, 2, 3).failures, 3).declare_failed


def test_passing_probe_on_a_healthy_engine_changes_nothing() -> None:
    assert judge_probe(True, 0, 3) == ProbeVerdict(0, False, False)


def test_threshold_of_one_declares_on_the_first_failure() -> None:
    verdict = judge_probe(False, 0, 1)
    assert verdict.declare_failed and verdict.suspect and verdict.failures == 1


def test_failures_beyond_threshold_stay_declared() -> None:
    assert judge_probe(False, 5, 3).declare_failed


@pytest.mark.parametrize(("state", "interval", "took", "expected"), [
    (EngineState.STARTING, 5.0, 0.1, 1.0),     # boot completion seen within a second
    (EngineState.STARTING, 0.5, 0.1, 0.5),     # a shorter interval stands
    (EngineState.HEALTHY, 5.0, 30.0, 5.0),
    (EngineState.SUSPECT, 5.0, 30.0, 0.0),     # timeouts back to back: a hang is declared
    (EngineState.SUSPECT, 5.0, 1.0, 4.0),      # fast failures spread over the intervals
])
def test_probe_interval_by_state(state: EngineState, interval: float, took: float,
                                 expected: float) -> None:
    assert probe_interval(state, ProbeConfig(health_interval_s=interval), took) == expected


def test_progress_count_starts_on_the_first_reading_a_move_or_an_idle_engine() -> None:
    assert judge_progress(10, 2, None, 0.0, 100.0, 60.0) == ProgressVerdict(10, 100.0, None)
    assert judge_progress(11, 2, 10, 0.0, 100.0, 60.0) == ProgressVerdict(11, 100.0, None)
    assert judge_progress(10, 0, 10, 0.0, 100.0, 60.0) == ProgressVerdict(10, 100.0, None)


def test_progress_stalls_once_the_counter_stood_still_for_the_timeout() -> None:
    assert judge_progress(10, 2, 10, 50.0, 109.9, 60.0) == ProgressVerdict(10, 50.0, None)
    stalled = judge_progress(10, 2, 10, 50.0, 110.0, 60.0)
    assert stalled == ProgressVerdict(10, 50.0, 60.0)
