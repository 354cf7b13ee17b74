"""The supervisor driven through its seams, without engines: a clock that the test moves, an
OS double, the timers, the persisted fields, the fatal-process rule."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import zmq
from daemon_harness import IGNORES_SIGTERM, ignores_sigterm, run_command

from rollout_watchdog.common.clock import Clock
from rollout_watchdog.common.states import Cause, EngineState
from rollout_watchdog.config import parse_config
from rollout_watchdog.emulator.testing import free_port, wait_until
from rollout_watchdog.watchdog import statefile, timers
from rollout_watchdog.watchdog.adoption import adopt, record_of
from rollout_watchdog.watchdog.cgroup import CgroupManager
from rollout_watchdog.watchdog.containment import marker_value, read_marker, with_marker
from rollout_watchdog.watchdog.daemon import Daemon
from rollout_watchdog.watchdog.engine import AfterKill, EngineRuntime, Failure, KillJob, Pause
from rollout_watchdog.watchdog.policy import long_lived
from rollout_watchdog.watchdog.probe import ProbeResult
from rollout_watchdog.watchdog.process import (
    PF_KTHREAD,
    ProcessOps,
    ProcKey,
    ProcStat,
    is_alive,
    proc_key,
    process_table,
)
from rollout_watchdog.watchdog.statefile import DERIVED, EngineRecord, load_state, save_state
from rollout_watchdog.watchdog.timers import Timer, engine_timers
from rollout_watchdog.watchdog.tracker import ProcessTracker

S = EngineState


class FakeClock(Clock):
    """Both clocks under the test's control."""

    def __init__(self) -> None:
        self.mono, self.wall_now = 1000.0, 1_800_000_000.0

    def monotonic(self) -> float:
        return self.mono

    def wall(self) -> float:
        return self.wall_now


class NoGpus:
    def compute_pids(self, gpu: int) -> set[int]:
        return set()


class PortsTaken(ProcessOps):
    """An OS where the engines' ports are in use (until `taken` is cleared)."""

    def __init__(self) -> None:
        self.taken = True

    def port_bindable(self, port: int) -> bool:  # type: ignore[override]
        return not self.taken


def make_daemon(tmp_path: Path, clock: Clock | None = None, ops: ProcessOps | None = None,
                **engine_keys: Any) -> Daemon:
    engine = {"id": "e0", "url": f"http://127.0.0.1:{free_port()}", "command": ["true"],
              **engine_keys}
    config = parse_config({"state_dir": str(tmp_path), "control": f"ipc://{tmp_path}/c",
                           "engine": [engine]})
    return Daemon(config, inspector=NoGpus(), rng=random.Random(0), clock=clock, ops=ops)


def healthy(daemon: Daemon) -> EngineRuntime:
    engine = daemon.engines["e0"]
    engine.state, engine.incarnation = S.HEALTHY, 1
    return engine


# ------------------------------------------------------------------ clocks

@pytest.mark.parametrize("step_s", [86400.0, -3600.0])
def test_a_pause_follows_the_monotonic_clock_not_the_wall_clock(tmp_path: Path,
                                                                step_s: float) -> None:
    """A wall clock stepped a day forward must not end a 600 s pause at once, nor one stepped
    an hour back keep a 5 s pause for an hour."""
    clock = FakeClock()
    daemon = make_daemon(tmp_path, clock=clock)
    engine = healthy(daemon)
    deadline_s = 600.0 if step_s > 0 else 5.0
    run_command(daemon, "pause", engine="e0", deadline_s=deadline_s)
    clock.wall_now += step_s
    clock.mono += deadline_s - 1
    daemon.supervisor.tick(engine, clock.mono)
    assert engine.paused is not None, "expired by a step of the wall clock"
    clock.mono += 1
    daemon.supervisor.tick(engine, clock.mono)
    assert engine.paused is None
    assert [e.kind for _, e in daemon.events.since(0)] == ["paused", "pause_expired"]


def test_the_loop_sleeps_until_exactly_the_timer_that_fires(tmp_path: Path) -> None:
    """The loop's deadline and the firing come from one function: every timer set is due at
    the moment the loop wakes for it, pause expiry and the stable reset included."""
    clock = FakeClock()
    daemon = make_daemon(tmp_path, clock=clock, probe={"health_path": ""},
                         restart={"stable_s": 7.0})
    engine = healthy(daemon)
    engine.healthy_since, engine.consecutive_failures = clock.mono, 2
    engine.paused = Pause(clock.wall_now + 2.0, clock.mono + 2.0)
    fired = []
    while len(fired) < 2:
        wake = timers.next_deadline(engine)
        assert wake is not None and wake > clock.mono
        clock.mono = wake
        before = {t for t, _ in engine_timers(engine)}
        daemon.supervisor.tick(engine, clock.mono)
        fired += sorted(before - {t for t, _ in engine_timers(engine)})
    assert fired == [Timer.PAUSE_EXPIRY, Timer.STABLE]
    assert engine.consecutive_failures == 0 and engine.paused is None


# ------------------------------------------------------------------ persisted fields

def every_field_set() -> EngineRecord:
    """A record in which every field differs from its default."""
    main = ProcKey(1234, 56.25)
    return EngineRecord(
        state=EngineState.SUSPECT, incarnation=7, state_since=1.5, restarts=2,
        relaunch_times=[10.0, 20.0], consecutive_failures=1,
        last_failure=Failure(Cause.EXITED, "boom", 4.0), deferred_waiting=True, external=True,
        marker="n:abc/e0/7/tok", cgroup="/sys/fs/cgroup/x/engine-e0-7-tok", main=main,
        procs={main: True, ProcKey(1240, 57.0): False}, launched_at=3.0, paused=99.0,
        kill_cause=Cause.PROBE_FAILED, kill_after=AfterKill.RESTART,
        url="http://127.0.0.1:30000")


def test_every_persisted_field_survives_the_state_file(tmp_path: Path) -> None:
    record = every_field_set()
    for f in dataclasses.fields(EngineRecord):
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
        assert getattr(record, f.name) != default, f"{f.name} is left at its default"
    assert save_state(tmp_path / "state.json", "n", {"e0": record})
    saved = load_state(tmp_path / "state.json")
    assert saved is not None
    assert EngineRecord.from_json(saved.engines["e0"]) == record


def test_every_copied_field_goes_from_the_engine_to_the_file_and_back(tmp_path: Path) -> None:
    clock = FakeClock()
    daemon = make_daemon(tmp_path, clock=clock)
    engine = healthy(daemon)
    record = every_field_set()
    for name in statefile.COPIED:
        setattr(engine, name, getattr(record, name))
    engine.state = S.FAILED  # adopted as it is, without processes
    engine.kill = None
    saved = record_of(engine, clock)
    fresh = EngineRuntime(cfg=engine.cfg)
    adopt(daemon.supervisor, fresh, EngineRecord.from_json(saved.to_json()), same_boot=True)
    for name in statefile.COPIED:
        assert getattr(fresh, name) == getattr(engine, name), name
    assert set(statefile.COPIED) | DERIVED == {f.name for f in dataclasses.fields(EngineRecord)}


def test_a_full_disk_gives_up_the_reserve_for_the_state_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "state.json"
    assert statefile.make_reserve(path)
    real, calls = statefile.write_json, []

    def full_once(target: Path, data: dict[str, Any]) -> None:
        calls.append(target)
        if len(calls) == 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(target, data)

    monkeypatch.setattr(statefile, "write_json", full_once)
    assert save_state(path, "n", {"e0": every_field_set()})
    assert not statefile.reserve_path(path).exists() and len(calls) == 2
    monkeypatch.setattr(statefile, "write_json", lambda *_: (_ for _ in ()).throw(
        OSError(errno.ENOSPC, "No space left on device")))
    assert not save_state(path, "n", {})  # no reserve left: reported, not raised


# ------------------------------------------------------------------ the OS seam

class NoPidfds(ProcessOps):
    """A host out of file descriptors: no pidfd can be had, and /proc reads fail now and
    then."""

    def __init__(self) -> None:
        self.flaky = False

    def open_pidfd(self, key: ProcKey) -> int | None:  # type: ignore[override]
        raise OSError(errno.EMFILE, "Too many open files")

    def is_alive(self, key: ProcKey) -> bool:  # type: ignore[override]
        if self.flaky:
            raise OSError(errno.EMFILE, "Too many open files")
        return ProcessOps.is_alive(key)


def test_without_pidfds_processes_are_polled_and_an_error_is_never_an_exit() -> None:
    ops = NoPidfds()
    sleeper = subprocess.Popen(["sleep", "30"])
    gone: list[ProcKey] = []
    try:
        key = proc_key(sleeper.pid)
        assert key is not None
        engine = EngineRuntime(cfg=parse_config({"engine": [
            {"id": "e0", "url": "http://127.0.0.1:1", "command": ["true"]}]},
            check_commands=False).engines[0])
        tracker = ProcessTracker({"e0": engine}, zmq.Poller(), ops,
                                 lambda e, k: gone.append(k))
        tracker.watch(engine, key)
        assert tracker.polled == {key: "e0"}
        ops.flaky = True
        for i in range(5):
            tracker.poll_unwatched(float(i))
        assert gone == []  # "cannot tell" is not "exited"
        ops.flaky = False
        sleeper.kill()
        sleeper.wait()
        tracker.poll_unwatched(10.0)
        assert gone == [key] and not tracker.polled
    finally:
        sleeper.kill()
        sleeper.wait()


# ------------------------------------------------------------------ what is fatal

def stat(pid: int, ppid: int, start: float, comm: str = "python") -> ProcStat:
    return ProcStat(pid, b"S", ppid, 100, start, comm)


def test_only_the_engines_own_long_lived_processes_are_fatal() -> None:
    main = ProcKey(100, 50.0)
    up_for = 60.0  # healthy 60 s after the launch
    assert long_lived(stat(101, 100, 52.0), main, up_for)                 # a scheduler child
    assert long_lived(stat(102, 101, 75.0, "sglang::detoken"), main, up_for)  # by its name
    assert not long_lived(stat(103, 100, 108.0), main, up_for)  # a helper started lately
    assert not long_lived(stat(104, 101, 52.0), main, up_for)   # a grandchild without a name


def test_stop_during_the_release_wait_ends_in_stopped(tmp_path: Path) -> None:
    """The release wait exists only for a relaunch: a stop (or the daemon's SIGTERM) in the
    middle of it ends the kill at once, in `stopped`."""
    clock = FakeClock()
    daemon = make_daemon(tmp_path, clock=clock, ops=PortsTaken())
    engine = healthy(daemon)
    daemon.supervisor.start_kill(engine, Cause.EXITED, "test", AfterKill.RECOVER)
    assert engine.kill is not None and engine.kill.problems  # waiting for the port
    run_command(daemon, "stop", engine="e0")
    clock.mono += 0.1
    daemon.supervisor.tick(engine, clock.mono)
    assert engine.state == S.STOPPED and engine.kill is None


def test_a_first_launch_waits_for_the_engines_ports(tmp_path: Path) -> None:
    """Before the first launch too: a copy left running must not answer the new one's probes
    (and the new one die of EADDRINUSE)."""
    ports = PortsTaken()
    clock = FakeClock()
    daemon = make_daemon(tmp_path, clock=clock, ops=ports, command=["sleep", "30"])
    daemon.adopt_or_launch()
    engine = daemon.engines["e0"]
    assert engine.state == S.STOPPED and isinstance(engine.kill, KillJob)
    assert engine.popen is None
    ports.taken = False
    clock.mono += 0.1
    try:
        daemon.supervisor.tick(engine, clock.mono)
        assert engine.state == S.STARTING and engine.popen is not None
    finally:
        if engine.popen is not None:
            engine.popen.kill()
            engine.popen.wait()


def test_a_process_that_takes_an_engine_name_later_becomes_fatal() -> None:
    """A scheduler renames itself once it runs, possibly after the engine turned healthy
    (liveness-only followers are healthy at once): from the sweep that sees the name on, its
    exit is fatal."""
    main, child = ProcKey(100, 50.0), ProcKey(101, 51.0)
    engine = EngineRuntime(cfg=parse_config({"engine": [
        {"id": "e0", "url": "http://127.0.0.1:1", "command": ["true"]}]},
        check_commands=False).engines[0], state=S.HEALTHY, main=main,
        procs={main: True, child: False})
    tracker = ProcessTracker({"e0": engine}, zmq.Poller(), ProcessOps(), lambda e, k: None)
    table = {100: ProcStat(100, b"S", 1, 100, 50.0, "python"),
             101: ProcStat(101, b"S", 100, 100, 51.0, "python")}
    tracker.sweep([engine], table)
    assert engine.procs[child] is False
    table[101] = ProcStat(101, b"S", 100, 100, 51.0, "sglang::schedul")
    assert tracker.sweep([engine], table)
    assert engine.procs[child] is True


def test_a_zombie_main_process_with_a_watched_pidfd_is_left_to_its_pidfd() -> None:
    """The leader of a multi-threaded engine reads as a zombie before its other threads have
    exited, and its exit status cannot be read yet: the sweep must not report its exit then
    (it was reported as "exit status unknown"); the pidfd does, once the status is there. A
    zombie main process without a pidfd is still reported by the sweep."""
    main = ProcKey(100, 50.0)
    engine = EngineRuntime(cfg=parse_config({"engine": [
        {"id": "e0", "url": "http://127.0.0.1:1", "command": ["true"]}]},
        check_commands=False).engines[0], state=S.HEALTHY, main=main, procs={main: True})
    gone: list[ProcKey] = []
    tracker = ProcessTracker({"e0": engine}, zmq.Poller(), ProcessOps(),
                             lambda e, k: gone.append(k))
    zombie = {100: ProcStat(100, b"Z", 1, 100, 50.0, "python")}
    read_end, write_end = os.pipe()   # stands in for the main process's pidfd
    try:
        tracker.pidfds[read_end] = ("e0", main)
        tracker.sweep([engine], zombie)
        assert gone == []
        del tracker.pidfds[read_end]
        tracker.sweep([engine], zombie)
        assert gone == [main]
    finally:
        os.close(read_end)
        os.close(write_end)


class Environs(ProcessOps):
    """An OS whose processes' environments the test sets: "" reads as empty (mid-exec)."""

    def __init__(self, markers: dict[int, str | None]) -> None:
        self.markers = markers
        self.reads: list[int] = []

    def read_marker(self, pid: int) -> str | None:  # type: ignore[override]
        self.reads.append(pid)
        return self.markers.get(pid)


def test_an_escapee_caught_mid_exec_is_looked_at_again() -> None:
    """A process outside every engine tree whose environment reads empty is not written off as
    unmarked: the next sweep reads its marker and finds it. Unmarked processes and kernel
    threads are read once in their life."""
    ops = Environs({300: "", 301: None, 2: ""})
    tracker = ProcessTracker({}, zmq.Poller(), ops, lambda e, k: None)
    tracker.marker_prefix = "node-a/"
    table = {pid: ProcStat(pid, b"S", 1, pid, float(pid), "python") for pid in (300, 301)}
    table[2] = ProcStat(2, b"S", 0, 0, 0.0, "kthreadd", PF_KTHREAD)
    assert tracker.escapees(table) == []
    ops.markers[300] = "node-a/e0/1/b"
    assert tracker.escapees(table) == [(table[300], "node-a/e0/1/b")]
    assert sorted(ops.reads) == [2, 300, 300, 301]


def test_a_tracker_without_its_node_prefix_finds_no_escapees() -> None:
    """An empty prefix matches every marker on the host: every other daemon's engines would be
    escapees, and killed. Until the node's prefix is set, nothing is one."""
    ops = Environs({300: "node-b:0123abcd/e0/1/b"})
    tracker = ProcessTracker({}, zmq.Poller(), ops, lambda e, k: None)
    table = {300: ProcStat(300, b"S", 1, 300, 300.0, "python")}
    assert tracker.escapees(table) == []


class OnlyThese(ProcessOps):
    """The real OS, but a process table that holds only the test's own processes: whatever the
    code under test decides to kill, nothing else on the host is within its reach."""

    def __init__(self) -> None:
        self.pids: set[int] = set()

    def process_table(self) -> dict[int, ProcStat]:  # type: ignore[override]
        return {pid: s for pid, s in process_table().items() if pid in self.pids}


def test_a_daemon_not_yet_running_kills_only_escapees_of_its_own_node(tmp_path: Path) -> None:
    """A daemon built but not run (embedded, as in these tests) kills an escapee only by a
    marker of its own node and state dir. It once had no prefix until `run` set it, and took
    every marked process on the host for a stale one of its own: while the suite ran, an
    engine kill in one test SIGKILLed the engines of every other daemon on the machine."""
    ops = OnlyThese()
    sup = make_daemon(tmp_path, ops=ops).supervisor
    stale = marker_value(sup.marker_node, "e0", 1, "0ldb00t")   # ours, an incarnation over
    other = marker_value(f"{sup.node_id}:0123abcd", "e0", 1, "b")  # same node id, other dir
    procs = {marker: subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                                      env=with_marker(os.environ, marker))
             for marker in (stale, other)}
    try:
        ops.pids.update(p.pid for p in procs.values())
        wait_until(lambda: all(read_marker(p.pid) == m for m, p in procs.items()), 30,
                   what="both markers to be readable")
        sup.escapees.take_in(ops.process_table())
        assert procs[stale].wait(timeout=30) == -9
        assert procs[other].poll() is None, "another daemon's engine was killed"
        killed = [e.detail for _, e in sup.events.since(0) if e.kind == "escapee_killed"]
        assert killed == [f"SIGKILL to pid(s) [{procs[stale].pid}]: marked {stale}, an "
                          "incarnation that is over"]
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait(timeout=10)


def test_leftover_cgroups_of_another_daemon_under_the_same_root_are_not_killed(
        tmp_path: Path, test_cgroup: Path) -> None:
    """Two daemons in one delegated cgroup share the root of their engine cgroups. Each cleans
    (and cgroup.kills) only the leftovers of its own state dir: the other's running engines are
    not launches that are over."""
    sup = make_daemon(tmp_path).supervisor
    sup.cgroups = CgroupManager(test_cgroup, sup.state_tag)
    other = CgroupManager(test_cgroup, "0123abcd")
    procs = {}
    for name, manager in (("ours", sup.cgroups), ("other", other)):
        path = manager.create("e0", 1, "0ldb00t")
        procs[name] = subprocess.Popen(manager.command(
            path, [sys.executable, "-c", "import time; time.sleep(60)"]))
        wait_until(lambda p=path: CgroupManager.populated(p), 30, what=f"{name} to join")
    try:
        sup.escapees.clean_cgroups(sup.cgroups)
        assert procs["ours"].wait(timeout=30) == -9   # a launch of ours that is over
        assert procs["other"].poll() is None, "another daemon's engine was killed"

        def cleaned() -> bool:
            sup.escapees.clean_cgroups(sup.cgroups)   # each sweep's: removed once empty
            return sup.cgroups is not None and sup.cgroups.existing() == []
        wait_until(cleaned, 30, what="our leftover cgroup to be removed")
        assert procs["other"].poll() is None
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait(timeout=10)


class Exiting(ProcessOps):
    """An OS where the engine's main process is on its way out (or not)."""

    def __init__(self) -> None:
        self.exiting = False

    def has_exited(self, key: ProcKey) -> bool:  # type: ignore[override]
        return self.exiting


def test_a_probe_failure_of_a_dying_engine_waits_for_its_exit(tmp_path: Path) -> None:
    """SIGKILLed, an engine's sockets close before its exit is seen: the probes then fail
    (connection reset). They must not fail the engine as probe_failed: its exit, seen a moment
    later, says what happened. A live engine's failures count as ever."""
    ops = Exiting()
    daemon = make_daemon(tmp_path, ops=ops, probe={"failure_threshold": 2})
    engine = healthy(daemon)
    engine.main = ProcKey(4242, 1.0)
    sup = daemon.supervisor

    def fail(probe_id: int) -> None:
        engine.probe_id, engine.probe_started = probe_id, time.monotonic()
        sup.judge_probe(engine, ProbeResult("e0", probe_id, False,
                                            "probe error: connection reset", 0.0, 0.1))

    ops.exiting = True
    fail(1)
    fail(2)
    assert engine.state == S.HEALTHY and engine.probe_failures == 0
    ops.exiting = False
    fail(3)
    assert engine.state == S.SUSPECT
    fail(4)
    assert engine.state in (S.STOPPING, S.BACKOFF)   # (no process here: the kill is done)
    assert engine.last_failure is not None and engine.last_failure.cause == Cause.PROBE_FAILED


def test_a_suspect_engines_probes_start_an_interval_apart_unless_they_time_out(
        tmp_path: Path) -> None:
    """A suspect engine was probed again the moment a probe ended: one refusing connections
    for a moment (each probe failing in a millisecond) went healthy -> suspect -> failed in a
    few milliseconds, its failure_threshold worth nothing. Now the next probe starts
    health_interval_s after the last one started; a probe that ran that long (a timeout: a hang)
    is still followed at once."""
    clock = FakeClock()
    daemon = make_daemon(tmp_path, clock=clock, probe={"failure_threshold": 4,
                                                       "health_interval_s": 5.0})
    engine = healthy(daemon)
    sup = daemon.supervisor
    for probe_id, took_s, wait_s in ((1, 0.001, 4.999), (2, 0.001, 4.999), (3, 30.0, 0.0)):
        engine.probe_id, engine.probe_started = probe_id, clock.monotonic()
        sup.judge_probe(engine, ProbeResult("e0", probe_id, False,
                                            "probe error: connection refused", 100.0,
                                            100.0 + took_s))
        assert engine.state == S.SUSPECT
        assert engine.next_probe == pytest.approx(clock.monotonic() + wait_s)
        clock.mono += 5.0


class Vanished(ProcessOps):
    """An OS whose process table and cgroups no longer show the engine (once `vanished`),
    while its main process's exit is not waitable yet: the moment inside the kernel's exit."""

    def __init__(self) -> None:
        self.vanished = False

    def is_alive(self, key: ProcKey) -> bool:  # type: ignore[override]
        return not self.vanished and super().is_alive(key)

    def cgroup_populated(self, path: Path) -> bool:  # type: ignore[override]
        return not self.vanished and super().cgroup_populated(path)

    def process_group(self, key: ProcKey) -> int | None:  # type: ignore[override]
        return None if self.vanished else super().process_group(key)


def test_a_kill_waits_for_the_main_process_exit_that_names_its_outcome(tmp_path: Path) -> None:
    """Gone from the process table and its cgroup before its exit can be waited for, a killed
    engine stays `stopping` until the exit is there: its status says how it ended (it was
    `exit status unknown` when the kill ended first)."""
    clock = FakeClock()
    ops = Vanished()
    daemon = make_daemon(tmp_path, clock=clock, ops=ops, command=["sleep", "30"],
                         restart={"grace_s": 5.0, "kill_timeout_s": 10.0})
    engine = daemon.engines["e0"]
    sup = daemon.supervisor
    sup.launch(engine, Cause.LAUNCHED)
    assert engine.popen is not None
    try:
        ops.vanished = True
        sup.start_kill(engine, Cause.COMMANDED, "test", AfterKill.STOP)
        for _ in range(3):
            clock.mono += 0.1
            daemon.tracker.new_turn()
            sup.tick(engine, clock.mono)
        assert engine.state == S.STOPPING and engine.popen.poll() is None
        engine.popen.kill()   # its exit, now
        wait_until(lambda: os.waitid(os.P_PID, engine.popen.pid,   # type: ignore[union-attr]
                                     os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None,
                   10, what="the engine's exit")
        clock.mono += 0.1
        daemon.tracker.new_turn()
        sup.tick(engine, clock.mono)
        assert engine.state == S.STOPPED
        assert daemon.events.since(0)[-1][1].detail.endswith("killed by SIGKILL")
    finally:
        engine.popen.kill()
        engine.popen.wait()


def test_a_kill_looks_again_soon_not_only_at_its_deadline(tmp_path: Path) -> None:
    """The grace period is a bound, not a wait: a kill looks again every CHECK_INTERVAL_S and
    completes once the processes are gone, long before a 30 s grace would end."""
    clock = FakeClock()
    # an engine that takes a moment to stop on SIGTERM (once its trap is set: it says so)
    ready = tmp_path / "trap-set"
    slow_stop = ["sh", "-c", f'trap "sleep 0.3; exit 0" TERM; touch {ready}; '
                 'while :; do sleep 0.05; done']
    daemon = make_daemon(tmp_path, clock=clock, command=slow_stop,
                         restart={"grace_s": 30.0, "kill_timeout_s": 10.0})
    engine = daemon.engines["e0"]
    sup = daemon.supervisor
    sup.launch(engine, Cause.LAUNCHED)
    try:
        set_by = time.monotonic() + 10.0
        while not ready.exists():   # a SIGTERM before the trap would end it at once
            assert time.monotonic() < set_by, "the engine's shell never set its trap"
            time.sleep(0.01)
        sup.start_kill(engine, Cause.COMMANDED, "test", AfterKill.STOP)
        assert engine.state == S.STOPPING
        wake = timers.next_deadline(engine)
        assert wake is not None and wake <= clock.mono + 0.05
        deadline = time.monotonic() + 5.0
        while engine.state == S.STOPPING and time.monotonic() < deadline:
            time.sleep(0.01)
            clock.mono += 0.05
            daemon.tracker.new_turn()
            sup.tick(engine, clock.mono)
        assert engine.state == S.STOPPED  # it stopped on its SIGTERM; no 30 s wait
    finally:
        if engine.popen is not None:
            engine.popen.kill()
            engine.popen.wait()


def test_a_stop_during_the_first_launchs_wait_ends_in_stopped(tmp_path: Path) -> None:
    """The first launch waits for the ports in `stopped`; a stop (or the daemon's SIGTERM)
    then ends that wait where it is, without a `stopped -> stopped` transition."""
    clock = FakeClock()
    daemon = make_daemon(tmp_path, clock=clock, ops=PortsTaken(), command=["sleep", "30"])
    daemon.adopt_or_launch()
    engine = daemon.engines["e0"]
    assert engine.state == S.STOPPED and engine.kill is not None
    run_command(daemon, "stop", engine="e0")
    clock.mono += 0.1
    daemon.supervisor.tick(engine, clock.mono)
    assert engine.state == S.STOPPED and engine.kill is None and engine.popen is None


def test_a_first_launch_still_waiting_survives_a_daemon_restart(tmp_path: Path) -> None:
    """Detached (or crashed) while the first launch waited for its ports: the next daemon
    waits on and launches, instead of keeping the engine stopped until someone restarts it."""
    clock = FakeClock()
    first = make_daemon(tmp_path, clock=clock, ops=PortsTaken(), command=["sleep", "30"])
    first.adopt_or_launch()
    first.save_state()
    second = make_daemon(tmp_path, clock=clock, command=["sleep", "30"])
    second.adopt_or_launch()
    engine = second.engines["e0"]
    try:
        assert engine.state == S.STARTING and engine.popen is not None
    finally:
        if engine.popen is not None:
            engine.popen.kill()
            engine.popen.wait()


def test_adoption_resuming_one_kill_leaves_a_later_engines_processes_alone(
        tmp_path: Path) -> None:
    """e0's restart had begun (its SIGTERM grace running) and e1 was healthy when the daemon
    went. The next daemon resumes e0's kill, which looks for escapees before e1 is restored:
    e1's processes, whose marker no engine carried yet, were SIGKILLed as a finished
    incarnation's, and e1 "adopted" dead. Now e1 is adopted alive, its pid unchanged."""
    config = parse_config({
        "state_dir": str(tmp_path), "control": f"ipc://{tmp_path}/c",
        "containment": "subreaper", "restart": {"grace_s": 30.0},
        "engine": [{"id": engine_id, "url": f"http://127.0.0.1:{free_port()}",
                    "command": IGNORES_SIGTERM} for engine_id in ("e0", "e1")]})
    first = Daemon(config, inspector=NoGpus(), rng=random.Random(0))
    second: Daemon | None = None
    try:
        first.adopt_or_launch()
        e0, e1 = first.engines["e0"], first.engines["e1"]

        def running() -> bool:   # (a first launch may wait a turn for its ports)
            for engine in (e0, e1):
                first.supervisor.tick(engine, first.clock.monotonic())
            return all(e.main is not None and read_marker(e.main.pid)
                       and ignores_sigterm(e.main.pid) for e in (e0, e1))
        wait_until(running, 10, what="both engines running with their markers")
        first.supervisor.start_kill(e0, Cause.COMMANDED, "restart", AfterKill.RESTART)
        first.save_state()   # the daemon goes: e0 stopping, e1 running
        e1_main = e1.main
        assert e1_main is not None and is_alive(e1_main)
        second = Daemon(config, inspector=NoGpus(), rng=random.Random(0))
        second.adopt_or_launch()
        adopted = second.engines["e1"]
        assert adopted.main == e1_main and adopted.state.running
        assert is_alive(e1_main), "a later engine's process was killed by the resumed kill"
        kinds = [json.loads(line)["kind"] for line in
                 second.events.path.read_text().splitlines()]
        assert "escapee_killed" not in kinds
    finally:
        for daemon in (first, second):
            for engine in (daemon.engines.values() if daemon else ()):
                for key in engine.procs:
                    with contextlib.suppress(OSError):
                        os.kill(key.pid, 9)


def test_a_detach_in_the_turn_a_backoff_ends_leaves_the_engine_to_the_next_daemon(
        tmp_path: Path) -> None:
    """SIGUSR2 (`systemctl restart`) arrives while the loop waits, in the turn an engine's
    backoff ends: that turn's launch, refused while the daemon goes, made the engine STOPPED,
    and the next daemon kept it stopped until someone restarted it. Now the turn ends at the
    detach, and the next daemon launches the engine."""
    first = make_daemon(tmp_path, command=["sleep", "30"])
    first.setup()
    second: Daemon | None = None
    try:
        engine = first.engines["e0"]
        engine.state, engine.incarnation = S.BACKOFF, 3
        engine.backoff_until = first.clock.monotonic()   # due in this turn
        first.shutdown_requested = "detach"              # as the signal handler sets it
        first.step()
        assert engine.state == S.BACKOFF
        first.save_state()
        second = make_daemon(tmp_path, command=["sleep", "30"])
        second.adopt_or_launch()
        again = second.engines["e0"]
        wait_until(lambda: (second.supervisor.tick(again, second.clock.monotonic()),
                            again.state == S.STARTING)[1], 10, what="the engine launched")
        assert again.incarnation > 3
    finally:
        first.teardown()
        for engine in (second.engines.values() if second else ()):
            if engine.popen is not None:
                engine.popen.kill()
                engine.popen.wait()


def test_a_stop_cut_short_leaves_its_kills_to_the_next_daemon(tmp_path: Path) -> None:
    """The loop left on an error while a stop's kills were still in progress: the state file
    was written clean (nothing to adopt), so those engines were forgotten, and the next daemon
    killed them as escapees. Now they stay in it, their kill for the next daemon to finish."""
    daemon = make_daemon(tmp_path, command=IGNORES_SIGTERM, restart={"grace_s": 30.0})
    daemon.setup()
    daemon.adopt_or_launch()
    engine = daemon.engines["e0"]
    try:   # (the first launch may wait a turn for its ports)
        wait_until(lambda: (daemon.supervisor.tick(engine, daemon.clock.monotonic()),
                            engine.state.running and engine.main is not None
                            and ignores_sigterm(engine.main.pid))[1],
                   10, what="the engine launched, ignoring SIGTERM")
        daemon.shutdown_requested = "stop"
        daemon.begin_shutdown()
        assert engine.kill is not None and not daemon.finished()
        daemon.teardown()   # as run()'s finally does when the loop raised
        saved = load_state(daemon.state_path)
        assert saved is not None and saved.engines["e0"]["state"] == "stopping"
    finally:
        if engine.popen is not None:
            engine.popen.kill()
            engine.popen.wait()
