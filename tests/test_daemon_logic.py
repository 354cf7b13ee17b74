"""The daemon's decisions driven in-process, without engines: pause acknowledgement, release
verification with a fake GPU inspector, recovery decisions."""

from __future__ import annotations

import dataclasses
import random
import time
from pathlib import Path

import pytest
from daemon_harness import run_command

from rollout_watchdog.common.states import Cause, EngineState
from rollout_watchdog.config import parse_config
from rollout_watchdog.emulator.testing import free_port
from rollout_watchdog.watchdog.daemon import Daemon
from rollout_watchdog.watchdog.engine import AfterKill, EngineRuntime
from rollout_watchdog.watchdog.probe import ProbeResult


class FakeGpus:
    def __init__(self, holders: dict[int, set[int]]) -> None:
        self.holders = holders

    def compute_pids(self, gpu: int) -> set[int]:
        return set(self.holders.get(gpu, set()))


def make_daemon(tmp_path: Path, inspector: FakeGpus | None = None,
                **engine_keys: object) -> Daemon:
    engine = {"id": "e0", "url": f"http://127.0.0.1:{free_port()}", "command": ["true"],
              "gpus": [0], **engine_keys}
    config = parse_config({"state_dir": str(tmp_path), "control": f"ipc://{tmp_path}/c",
                           "restart": {"release_timeout_s": 1.0, "backoff_initial_s": 1.0},
                           "engine": [engine]})
    return Daemon(config, inspector=inspector or FakeGpus({}), rng=random.Random(0))


def healthy(daemon: Daemon) -> EngineRuntime:
    engine = daemon.engines["e0"]
    engine.state = EngineState.HEALTHY
    engine.incarnation = 1
    return engine


def test_pause_is_acknowledged_only_after_the_inflight_probe(tmp_path: Path) -> None:
    daemon = make_daemon(tmp_path)
    engine = healthy(daemon)
    daemon.supervisor.start_probe = lambda e, now: None  # type: ignore[method-assign]
    engine.probe_id, engine.probe_started = 7, time.monotonic()
    engine.probes_out.add(7)
    deferred = run_command(daemon, "pause", engine="e0", deadline_s=60.0)
    assert deferred.poll() is None            # a probe is still out: no acknowledgement yet
    assert not engine.probing                 # but no new probe will start
    daemon.supervisor.on_probe_result(ProbeResult("e0", 7, True, "HTTP 200", 0.0, 0.1))
    result = deferred.poll()
    assert result is not None and result["paused"] == ["e0"]


def test_a_pause_never_shortens_one_in_place(tmp_path: Path) -> None:
    """finish_generation's long pause, then a refit's shorter one: the longer holds (the
    engine may have no KV cache until prepare_for_generation); a longer pause extends it, and
    resume ends it whatever its deadline."""
    daemon = make_daemon(tmp_path)
    engine = healthy(daemon)
    run_command(daemon, "pause", engine="e0", deadline_s=600.0, wait_s=0.0).poll()
    assert engine.paused is not None
    long = (engine.paused.deadline, engine.paused.expires)
    kinds: list[str] = []
    daemon.supervisor.publisher.subscribe(lambda event: kinds.append(event.kind))
    run_command(daemon, "pause", engine="e0", deadline_s=60.0, wait_s=0.0).poll()
    assert (engine.paused.deadline, engine.paused.expires) == long and kinds == []
    run_command(daemon, "pause", engine="e0", deadline_s=900.0, wait_s=0.0).poll()
    assert engine.paused.expires > long[1]
    assert kinds == ["pause_extended"]   # said, with its deadline: the fleet view shows it
    run_command(daemon, "resume", engine="e0")
    assert engine.paused is None


def test_late_probe_result_of_an_abandoned_probe_is_ignored(tmp_path: Path) -> None:
    daemon = make_daemon(tmp_path)
    engine = healthy(daemon)
    engine.probe_id, engine.probe_started = 3, time.monotonic()
    daemon.supervisor.on_probe_result(ProbeResult("e0", 2, False, "late", 0.0, 0.1))
    assert engine.state == EngineState.HEALTHY and engine.probe_failures == 0


def kill_without_processes(daemon: Daemon, engine: EngineRuntime) -> None:
    """Drive the kill sequence of an engine whose processes are already gone."""
    daemon.supervisor.start_kill(engine, Cause.EXITED, "test", AfterKill.RECOVER)


def test_gpu_still_held_blocks_relaunch_then_marks_failed(tmp_path: Path) -> None:
    daemon = make_daemon(tmp_path, FakeGpus({0: {4242}}))
    engine = healthy(daemon)
    kill_without_processes(daemon, engine)
    assert engine.state == EngineState.STOPPING
    assert engine.kill is not None and engine.kill.problems == [
        "GPU 0 still has compute process(es) [4242]"]
    daemon.supervisor.advance_kill(engine, time.monotonic() + 2.0)   # past release_timeout_s
    assert engine.state == EngineState.FAILED
    assert engine.last_failure is not None
    assert engine.last_failure.cause == Cause.GPU_NOT_RELEASED


def test_gpu_released_in_time_lets_the_engine_recover(tmp_path: Path) -> None:
    gpus = FakeGpus({0: {4242}})
    daemon = make_daemon(tmp_path, gpus)
    engine = healthy(daemon)
    kill_without_processes(daemon, engine)
    gpus.holders = {}
    daemon.supervisor.advance_kill(engine, time.monotonic() + 0.5)
    assert engine.state == EngineState.BACKOFF and engine.restarts == 1


def test_shared_gpu_ignores_processes_that_were_never_the_engines(tmp_path: Path) -> None:
    """A deferred (colocated) engine shares its GPUs with the trainer: the trainer's process
    must not block the engine's cleanup."""
    daemon = make_daemon(tmp_path, FakeGpus({0: {4242}}), restart_policy="deferred")
    engine = healthy(daemon)
    kill_without_processes(daemon, engine)
    assert engine.state == EngineState.BACKOFF and engine.deferred_waiting


@pytest.mark.parametrize("max_restarts,expected", [(0, EngineState.FAILED),
                                                   (1, EngineState.BACKOFF)])
def test_budget_decides_between_backoff_and_failed(tmp_path: Path, max_restarts: int,
                                                   expected: EngineState) -> None:
    daemon = make_daemon(tmp_path, restart={"max_restarts": max_restarts,
                                            "backoff_initial_s": 1.0})
    engine = healthy(daemon)
    kill_without_processes(daemon, engine)
    assert engine.state == expected


def test_an_environment_no_process_can_take_fails_the_launch_and_keeps_the_daemon(
        tmp_path: Path) -> None:
    """An env key with '=' (check-config refuses it now; an engine spec from an older daemon's
    state may still hold one) made Popen raise ValueError, which crashed `run` and left the
    engines launched before it unsupervised (hostile run 5). It is a failed launch, named."""
    daemon = make_daemon(tmp_path)
    engine = daemon.engines["e0"]
    engine.cfg = dataclasses.replace(engine.cfg, env={"A=B": "1"})
    daemon.supervisor.launch(engine, Cause.LAUNCHED)
    assert engine.state == EngineState.FAILED
    assert engine.last_failure is not None and engine.last_failure.cause == Cause.LAUNCH_FAILED
    assert "command, env or cwd" in engine.last_failure.detail
