"""Regressions found in review of the node daemon, each driven in-process (no emulator)."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import zmq
from daemon_harness import run_command

from rollout_watchdog.common.states import Cause, EngineState
from rollout_watchdog.config import parse_config
from rollout_watchdog.emulator.testing import free_port, wait_until
from rollout_watchdog.node import node_daemon
from rollout_watchdog.watchdog.commands import CommandError
from rollout_watchdog.watchdog.control import ControlServer
from rollout_watchdog.watchdog.daemon import Daemon
from rollout_watchdog.watchdog.process import (
    ProcessOps,
    ProcStat,
    is_alive,
    is_kernel_thread,
    proc_key,
)
from rollout_watchdog.watchdog.statefile import kernel_boot_id

S = EngineState


class NoGpus:
    def compute_pids(self, gpu: int) -> set[int]:
        return set()


def make_daemon(tmp_path: Path, engines: list[dict[str, Any]] | None = None,
                restart: dict[str, Any] | None = None) -> Daemon:
    engines = engines if engines is not None else [
        {"id": "e0", "url": f"http://127.0.0.1:{free_port()}", "command": ["sleep", "100"]}]
    config = parse_config({"state_dir": str(tmp_path), "control": f"ipc://{tmp_path}/c",
                           "restart": {"release_timeout_s": 1.0, "backoff_initial_s": 1.0,
                                       **(restart or {})},
                           "engine": engines})
    return node_daemon(config, inspector=NoGpus(), rng=random.Random(0))


def cleanup(daemon: Daemon) -> None:
    """Kill every process the daemon launched or was told about (tests only)."""
    for engine in daemon.engines.values():
        for key in list(engine.procs):
            if is_alive(key):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(key.pid, signal.SIGKILL)
        if engine.popen is not None:
            engine.popen.kill()
            engine.popen.wait()


@pytest.fixture
def live(tmp_path: Path) -> Iterator[tuple[Daemon, zmq.Socket]]:
    """A daemon with its control socket bound (no engines launched) and a DEALER client."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR2)}
    daemon = make_daemon(tmp_path)
    daemon.setup()
    client = zmq.Context.instance().socket(zmq.DEALER)
    client.setsockopt(zmq.LINGER, 0)
    client.connect(daemon.config.control)
    try:
        yield daemon, client
    finally:
        client.close()
        cleanup(daemon)
        daemon.teardown()
        for s, h in saved.items():
            signal.signal(s, h)


def send_and_step(daemon: Daemon, client: zmq.Socket, *payloads: bytes) -> list[dict[str, Any]]:
    for payload in payloads:
        client.send(payload)
    replies: list[dict[str, Any]] = []
    deadline = time.monotonic() + 10
    while len(replies) < len(payloads) and time.monotonic() < deadline:
        daemon.step()
        while client.poll(10):
            replies.append(json.loads(client.recv()))
    return replies


# ---------------------------------------------------------------- 1. exceptions escaping step()

@pytest.mark.parametrize("payload", [
    b'{"v": 1, "id": 1, "cmd": "events", "args": {"since": 1e400}}',          # inf -> int()
    b'{"v": 1, "id": 1, "cmd": "events", "args": {"since": Infinity}}',
    b'{"v": 1, "id": 1, "cmd": "pause", "args": {"all": true, "deadline_s": 1'
    + b"0" * 400 + b"}}",                                                     # float(10**400)
    b"[" * 50000,                                                            # RecursionError
], ids=["since-1e400", "since-Infinity", "deadline-huge-int", "deep-nesting"])
def test_garbage_on_the_control_socket_does_not_crash_the_loop(
        live: tuple[Daemon, zmq.Socket], payload: bytes) -> None:
    daemon, client = live
    replies = send_and_step(daemon, client, payload)   # raises today: the daemon would die
    assert replies and replies[0]["status"] == "error"


def test_pause_then_unregister_in_one_batch_does_not_crash_the_loop(
        live: tuple[Daemon, zmq.Socket]) -> None:
    """A parked pause acknowledgement looks its engines up by id; unregister removed it."""
    daemon, client = live
    ext = subprocess.Popen(["sleep", "100"])
    try:
        run_command(daemon, "register", engine="x", url=f"http://127.0.0.1:{free_port()}",
                    pid=ext.pid)
        replies = send_and_step(
            daemon, client,
            b'{"v": 1, "id": 1, "cmd": "pause", "args": {"engine": "x"}}',
            b'{"v": 1, "id": 2, "cmd": "unregister", "args": {"engine": "x"}}')
        assert {r["id"] for r in replies} == {1, 2}
    finally:
        ext.kill()
        ext.wait()


# ---------------------------------------------------------------- 2. adoption

def dead_key() -> list[float]:
    p = subprocess.Popen(["true"])
    key = proc_key(p.pid)
    p.wait()
    assert key is not None
    return key.to_json()


def write_state(tmp_path: Path, engines: dict[str, dict[str, Any]],
                boot_id: str | None = None) -> None:
    (tmp_path / "state.json").write_text(json.dumps({
        "version": 1, "node_id": "n", "boot_id": boot_id or kernel_boot_id(),
        "engines": engines}))


def record(main: list[float], state: str, **extra: Any) -> dict[str, Any]:
    return {"state": state, "state_since": time.time(), "incarnation": 3, "restarts": 0,
            "relaunch_times": [], "consecutive_failures": 0, "main": main,
            "procs": [[main, True]], "launched_at": time.time() - 10, "paused": None,
            "last_failure": None, "deferred_waiting": False, "kill_cause": None,
            "kill_after": None, "external": False, **extra}


def test_adopting_a_commanded_restart_whose_processes_are_gone(tmp_path: Path) -> None:
    """Daemon SIGKILLed while `restart e0` was killing the engine; the old processes died
    meanwhile. The adopted kill completes at once and relaunches (incarnation 4); then _adopt
    goes on watching the *old* process keys and _process_gone does engine.procs[old] ->
    KeyError, before the loop even starts (and before the state file is rewritten: the daemon
    crash-loops, launching one more engine each time)."""
    write_state(tmp_path, {"e0": record(dead_key(), "stopping", kill_cause="commanded",
                                        kill_after="restart")})
    daemon = make_daemon(tmp_path)
    try:
        daemon.adopt_or_launch()
        assert daemon.engines["e0"].state == S.STARTING
        assert daemon.engines["e0"].incarnation == 4
    finally:
        cleanup(daemon)


def test_adopting_with_zero_backoff_and_a_dead_engine(tmp_path: Path) -> None:
    """Same KeyError through the recover path when backoff_initial_s = 0 (allowed by config)."""
    main = dead_key()
    rec = record(main, "healthy")
    rec["procs"] = [[main, True], [dead_key(), True]]
    write_state(tmp_path, {"e0": rec})
    daemon = make_daemon(tmp_path, restart={"backoff_initial_s": 0.0})
    try:
        daemon.adopt_or_launch()
        assert daemon.engines["e0"].state == S.STARTING
    finally:
        cleanup(daemon)


def test_unknown_kill_cause_in_the_state_file_does_not_crash_startup(tmp_path: Path) -> None:
    """Cause(...)/AfterKill(...) of a stopping record are parsed outside the try: a state file
    from a newer version (a new cause name) crashes every start (downgrade = crash loop)."""
    write_state(tmp_path, {"e0": record(dead_key(), "stopping", kill_cause="progress_stalled",
                                        kill_after="recover")})
    daemon = make_daemon(tmp_path)
    try:
        daemon.adopt_or_launch()
    finally:
        cleanup(daemon)


def test_stale_state_after_reboot_never_signals_a_reused_pid_group(tmp_path: Path) -> None:
    """After a power loss the state file still names the old pids. If one of them now belongs
    to an unrelated group leader, the kill of the 'dead' engine waits for that group (grace)
    and then killpg(SIGKILL)s it: `_sigkill_all` signals main.pid's group unconditionally."""
    victim = subprocess.Popen(["sleep", "100"], start_new_session=True)  # some other service
    try:
        key = proc_key(victim.pid)
        assert key is not None
        stale = [victim.pid, key.start_time - 1000.0]  # same pid, previous boot
        write_state(tmp_path, {"e0": record(stale, "healthy")})
        daemon = make_daemon(tmp_path, restart={"grace_s": 0.5})
        try:
            daemon.adopt_or_launch()
            engine = daemon.engines["e0"]
            for _ in range(3):
                if engine.kill is not None:
                    daemon.supervisor.advance_kill(engine, time.monotonic() + 5.0)
            time.sleep(0.2)
            assert victim.poll() is None, f"unrelated process group killed ({victim.poll()})"
        finally:
            cleanup(daemon)
    finally:
        victim.kill()
        victim.wait()


def test_engine_removed_from_config_is_not_left_running_unsupervised(tmp_path: Path) -> None:
    """Design gap: an engine that was in the state file but not in the new config keeps running
    with nobody watching it (holding its GPUs and ports); not killed, not even reported."""
    old = subprocess.Popen(["sleep", "100"], start_new_session=True)
    try:
        key = proc_key(old.pid)
        assert key is not None
        write_state(tmp_path, {"old": record(key.to_json(), "healthy")})
        daemon = make_daemon(tmp_path)
        try:
            daemon.adopt_or_launch()
            assert any(e.engine == "old" and e.kind == "removed_from_config"
                       for _, e in daemon.events.since(0))

            def stopped() -> bool:
                for engine in list(daemon.engines.values()):
                    if engine.kill is not None:
                        daemon.supervisor.advance_kill(engine, time.monotonic() + 60.0)
                return old.poll() is not None

            wait_until(stopped, 10, what="the removed engine to be stopped")
        finally:
            cleanup(daemon)
    finally:
        old.kill()
        old.wait()


# ---------------------------------------------------------------- 2. budget and backoff

def crash(daemon: Daemon, engine_id: str) -> None:
    engine = daemon.engines[engine_id]
    assert engine.popen is not None and engine.main is not None
    engine.popen.kill()
    engine.popen.wait()
    daemon.supervisor.process_gone(engine, engine.main)


def test_deferred_engine_that_crash_loops_exhausts_its_budget(tmp_path: Path) -> None:
    """DESIGN: 'no restart budget: a crash-looping engine is restarted forever' is a defect to
    fix. A deferred engine's relaunch after a failure (restart at the next refit) never counts:
    relaunch_times/restarts are only updated on the immediate path, so it never gets `failed`."""
    daemon = make_daemon(tmp_path, engines=[{
        "id": "e0", "url": f"http://127.0.0.1:{free_port()}", "command": ["sleep", "100"],
        "restart_policy": "deferred"}], restart={"max_restarts": 2})
    engine = daemon.engines["e0"]
    try:
        daemon.supervisor.launch(engine, Cause.LAUNCHED)
        for _ in range(6):
            crash(daemon, "e0")
            if engine.state == S.FAILED:
                break
            assert engine.state == S.BACKOFF and engine.deferred_waiting
            # what the coordinator does at the next refit
            run_command(daemon, "restart", engine="e0")
        assert engine.state == S.FAILED, (
            f"incarnation {engine.incarnation}, restarts {engine.restarts}")
    finally:
        cleanup(daemon)


def test_shutdown_does_not_spin_on_a_stale_backoff_timer(tmp_path: Path) -> None:
    """_begin_shutdown moves a backoff engine to stopped but keeps backoff_until: once that time
    passes, _next_deadline is in the past and the loop polls with timeout 0 (100 % CPU, each
    turn rescanning /proc for the engines still being killed) until shutdown ends."""
    daemon = make_daemon(tmp_path)
    engine = daemon.engines["e0"]
    engine.state = S.BACKOFF
    engine.backoff_until = time.monotonic() + 0.01
    daemon.shutdown_requested = "stop"
    daemon.begin_shutdown()
    assert engine.state == S.STOPPED
    time.sleep(0.05)
    now = time.monotonic()
    daemon.supervisor.tick(engine, now)
    assert daemon.next_deadline(now) > now


# ---------------------------------------------------------------- 3. external engines

def test_register_does_not_abandon_the_kill_of_the_previous_external_engine(
        tmp_path: Path) -> None:
    """register() only refuses a *running* existing external engine; one in `stopping` (its kill
    in progress) is silently replaced, its KillJob dropped: a process that ignores SIGTERM never
    gets SIGKILL."""
    stubborn = subprocess.Popen([sys.executable, "-c",
                                 "import signal, time; signal.signal(signal.SIGTERM, "
                                 "signal.SIG_IGN); print('ready', flush=True); time.sleep(100)"],
                                stdout=subprocess.PIPE)
    assert stubborn.stdout is not None and stubborn.stdout.readline().strip() == b"ready"
    other = subprocess.Popen(["sleep", "100"])
    daemon = make_daemon(tmp_path, restart={"grace_s": 0.5, "kill_timeout_s": 1.0})
    try:
        run_command(daemon, "register", engine="x", url=f"http://127.0.0.1:{free_port()}",
                    pid=stubborn.pid)
        run_command(daemon, "stop", engine="x")
        assert daemon.engines["x"].state == S.STOPPING
        with pytest.raises(CommandError, match="being stopped"):
            run_command(daemon, "register", engine="x", url=f"http://127.0.0.1:{free_port()}",
                        pid=other.pid)

        def killed() -> bool:
            engine = daemon.engines["x"]
            if engine.kill is not None:
                daemon.supervisor.advance_kill(engine, time.monotonic() + 5.0)
            return stubborn.poll() is not None

        wait_until(killed, 10, what="the SIGTERM-ignoring process to be SIGKILLed")
    finally:
        for p in (stubborn, other):
            p.kill()
            p.wait()


# ---------------------------------------------------------------- 5. performance


def test_one_process_table_scan_per_liveness_interval(tmp_path: Path) -> None:
    """Engines relaunched at different times must not each get their own sweep: one scan of
    the process table per liveness interval serves them all."""
    engines = [{"id": f"e{i}", "url": f"http://127.0.0.1:{free_port()}",
                "command": ["sleep", "100"], "probe": {"health_path": ""}} for i in range(4)]
    config = parse_config({"state_dir": str(tmp_path), "control": f"ipc://{tmp_path}/c",
                           "probe": {"liveness_interval_s": 0.2}, "engine": engines})
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR2)}
    scans: list[int] = []

    class CountingOps(ProcessOps):
        def process_table(self) -> dict[int, ProcStat]:  # type: ignore[override]
            scans.append(1)
            return super().process_table()

    daemon = Daemon(config, inspector=NoGpus(), rng=random.Random(0), ops=CountingOps())
    daemon.setup()
    try:
        for engine in daemon.engines.values():
            daemon.supervisor.launch(engine, Cause.LAUNCHED)
            time.sleep(0.03)  # launched at different times, as after relaunches
        scans.clear()
        started = time.monotonic()
        while time.monotonic() - started < 2.0:
            daemon.step()
        assert all(e.state == S.HEALTHY for e in daemon.engines.values())
        assert len(scans) <= 2.0 / 0.2 + 5, f"{len(scans)} process-table scans in 2 s"
    finally:
        cleanup(daemon)
        daemon.teardown()
        for s, h in saved.items():
            signal.signal(s, h)


def test_a_signal_late_in_a_step_still_stops_the_engines(tmp_path: Path) -> None:
    """SIGTERM handled after the step's shutdown check: the loop must not see itself finished
    (no kill started yet) and exit leaving every engine running."""
    daemon = make_daemon(tmp_path)
    engine = daemon.engines["e0"]
    daemon.supervisor.launch(engine, Cause.LAUNCHED)
    try:
        daemon.shutdown_requested = "stop"      # what the signal handler does
        assert not daemon.finished()
        daemon.begin_shutdown()
        assert engine.state in (S.STOPPING, S.STOPPED)  # the kill began (or is already done)
    finally:
        cleanup(daemon)


# ---------------------------------------------------------------- 6. hostile control clients

def request(request_id: int, cmd: str, **args: Any) -> bytes:
    return json.dumps({"v": 1, "id": request_id, "cmd": cmd, "args": args}).encode()


def test_clients_that_never_read_their_replies_cannot_grow_the_daemon(
        live: tuple[Daemon, zmq.SyncSocket]) -> None:
    """3 clients send 1,500 `events` requests each and never read: the parked replies stay
    within their bounds, the unread answers within the per-peer queues, and a client that
    reads still gets its answers."""
    daemon, client = live
    for n in range(300):  # every immediate answer then carries 300 events (~100 KB)
        daemon.supervisor.emit(None, "filler", detail=f"{n:04d}" + "x" * 200)
    server = daemon.participants[0]
    assert isinstance(server, ControlServer)
    ctx: zmq.SyncContext = zmq.Context.instance()
    mutes = []
    for _ in range(3):
        mute = ctx.socket(zmq.DEALER)
        mute.setsockopt(zmq.LINGER, 0)
        mute.setsockopt(zmq.RCVHWM, 1)  # this process holds the mute clients' queues too
        mute.connect(daemon.config.control)
        mutes.append(mute)
    rss_before = psutil.Process().memory_info().rss
    most_parked = 0

    def serve_what_came() -> None:
        nonlocal most_parked
        deadline = time.monotonic() + 30
        while server.socket.poll(10) and time.monotonic() < deadline:
            daemon.step()
            most_parked = max(most_parked, len(server.pending))

    try:
        for n in range(1500):
            for mute in mutes:
                # half wait for an event that never comes (parked), half answer at once
                since = daemon.events.last_seq if n % 2 else 0
                mute.send(request(n, "events", since=since, wait_s=30))
            if n % 100 == 99:
                serve_what_came()
        serve_what_came()
        assert most_parked <= 3 * server.pending.per_client
        answers = send_and_step(daemon, client, request(1, "ping"), request(2, "status"))
        assert [a["status"] for a in answers] == ["ok", "ok"]
        growth = psutil.Process().memory_info().rss - rss_before
        assert growth < 50 * 2**20, f"RSS grew by {growth / 2**20:.0f} MiB"
    finally:
        for mute in mutes:
            mute.close()


@pytest.mark.parametrize("every", ["no", "true", 1, 0, [], {}])
def test_all_accepts_only_a_json_boolean(live: tuple[Daemon, zmq.SyncSocket], every: Any) -> None:
    """`{"all": "no"}` once paused every engine: only `true` means all."""
    daemon, client = live
    replies = send_and_step(daemon, client, request(1, "pause", all=every),
                            request(2, "resume", all=every))
    assert [r["status"] for r in replies] == ["error", "error"]
    assert all("'all' must be true or false" in r["reason"] or "name an engine" in r["reason"]
               for r in replies)
    assert daemon.engines["e0"].paused is None
    assert not [e for e in daemon.events.since(0) if e[1].kind == "paused"]


@pytest.mark.parametrize("engine_id", [
    "x" * 60000, "e0 ", "e0\n", "e\u202e0", "--all", "a/../../b", "", None, 7,
], ids=["60000-chars", "trailing-space", "newline", "rtl-override", "dash-dash-all",
        "path", "empty", "null", "number"])
def test_register_holds_ids_to_the_config_rule(live: tuple[Daemon, zmq.SyncSocket],
                                               engine_id: Any) -> None:
    daemon, client = live
    ext = subprocess.Popen(["sleep", "100"])
    try:
        (reply,) = send_and_step(daemon, client, request(
            1, "register", engine=engine_id, url=f"http://127.0.0.1:{free_port()}",
            pid=ext.pid))
    finally:
        ext.kill()
        ext.wait()
    assert reply["status"] == "error"
    assert reply["reason"].startswith("'engine' must be a string of at most 64 letters")
    assert len(reply["reason"]) < 300  # a 60,000-character id still makes one short line
    assert set(daemon.engines) == {"e0"}


def test_register_refuses_a_kernel_thread(live: tuple[Daemon, zmq.SyncSocket]) -> None:
    if not is_kernel_thread(2):
        pytest.skip("pid 2 is not kthreadd here (a pid namespace without kernel threads)")
    daemon, client = live
    (reply,) = send_and_step(daemon, client, request(
        1, "register", engine="k2", url=f"http://127.0.0.1:{free_port()}", pid=2))
    assert reply["status"] == "error" and "kernel thread" in reply["reason"]
    assert set(daemon.engines) == {"e0"}
