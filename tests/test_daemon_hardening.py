"""Hardening found in a second review of the daemon and CLI: fast-forking engines, adopted
external engines, probes that raise, registered pids that must never be signalled, the restart
budget of deferred engines, CLI time bounds."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from daemon_harness import IGNORES_SIGTERM, ignores_sigterm, run_command
from test_daemon_regressions import cleanup, make_daemon, record, write_state

from rollout_watchdog.common.states import Cause, EngineState
from rollout_watchdog.emulator.testing import free_port, wait_until
from rollout_watchdog.watchdog.control import CommandError
from rollout_watchdog.watchdog.probe import ProbeRunner
from rollout_watchdog.watchdog.process import is_alive, proc_key, process_table

S = EngineState


def drive(daemon: Any, until: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not until() and time.monotonic() < deadline:
        now = time.monotonic()
        for engine in list(daemon.engines.values()):
            daemon.supervisor.tick(engine, now)
        daemon.tracker.handle({fd for fd, (_, key) in daemon.tracker.pidfds.items()
                               if not is_alive(key)})
        time.sleep(0.02)


def group_members(pgid: int) -> list[int]:
    return [s.pid for s in process_table().values() if s.pgrp == pgid and s.alive]


# ------------------------------------------------------------------ A. orphans of a fast crash

def test_group_member_born_after_the_last_sweep_is_killed_when_main_exits(
        tmp_path: Path) -> None:
    """The main process forks a worker and exits before a sweep saw the worker. The worker
    stays in the engine's process group, but engine_group() only names the group while a
    *known* live process is in it: no SIGTERM, no SIGKILL, the worker survives every kill and
    every crash-loop relaunch adds one more (each holding GPU memory in real life)."""
    daemon = make_daemon(tmp_path, engines=[{
        "id": "e0", "url": f"http://127.0.0.1:{free_port()}",
        "command": ["sh", "-c", "sleep 100 & sleep 0.3; exit 3"]}],
        restart={"grace_s": 0.5, "kill_timeout_s": 1.0, "backoff_initial_s": 60.0})
    engine = daemon.engines["e0"]
    pgid = None
    try:
        daemon.supervisor.launch(engine, Cause.LAUNCHED)
        assert engine.main is not None
        pgid = engine.main.pid
        engine.popen.wait()                       # main exited (code 3); no sweep ran
        daemon.supervisor.process_gone(engine, engine.main)
        drive(daemon, lambda: engine.kill is None)
        assert engine.state == S.BACKOFF
        wait_until(lambda: not group_members(pgid), 10,
                   what=f"engine group {pgid} to have no live member after the kill")
    finally:
        cleanup(daemon)
        if pgid is not None:
            for pid in group_members(pgid):
                os.kill(pid, signal.SIGKILL)


# ------------------------------------------------------------------ B/C. adopting external engines

@pytest.fixture
def stubborn() -> Any:
    """A process that ignores SIGTERM (an external engine, say)."""
    p = subprocess.Popen([sys.executable, "-c",
                          "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN);"
                          " print('ready', flush=True); time.sleep(100)"],
                         stdout=subprocess.PIPE)
    assert p.stdout is not None and p.stdout.readline().strip() == b"ready"
    yield p
    p.kill()
    p.wait()


def test_adopting_an_external_engine_that_was_being_stopped_keeps_stopping_it(
        tmp_path: Path, stubborn: subprocess.Popen[bytes]) -> None:
    """`stop x` on a registered engine, then the daemon restarts (crash, upgrade) during the
    grace period. _adopt_unconfigured re-registers every external record that is running *or
    stopping* as a fresh `starting` engine: the stop is forgotten, the engine is probed as if
    nothing happened, and a SIGTERM-ignoring process is never SIGKILLed."""
    key = proc_key(stubborn.pid)
    assert key is not None
    write_state(tmp_path, {"x": record(key.to_json(), "stopping", external=True,
                                       url=f"http://127.0.0.1:{free_port()}",
                                       kill_cause="commanded", kill_after="stop")})
    daemon = make_daemon(tmp_path, engines=[],
                         restart={"grace_s": 0.3, "kill_timeout_s": 1.0})
    try:
        daemon.adopt_or_launch()
        engine = daemon.engines["x"]
        drive(daemon, lambda: engine.kill is None and not engine.state.running, timeout=10.0)
        assert engine.state == S.STOPPED, f"adopted as {engine.state}: the stop was dropped"
        assert stubborn.poll() is not None
    finally:
        cleanup(daemon)


def test_adopting_an_external_engine_keeps_its_pause(
        tmp_path: Path, stubborn: subprocess.Popen[bytes]) -> None:
    """DESIGN: 'A pause is kept in the state file and survives a daemon restart.' The record of
    an external engine has its pause, but _register_external builds a fresh runtime: after a
    daemon restart in the middle of a refit, deep probes of a registered (Ray) engine resume
    while its memory is released."""
    key = proc_key(stubborn.pid)
    assert key is not None
    write_state(tmp_path, {"x": record(key.to_json(), "healthy", external=True,
                                       url=f"http://127.0.0.1:{free_port()}",
                                       paused={"deadline": time.time() + 300,
                                               "source": "coordinator"})})
    daemon = make_daemon(tmp_path, engines=[])
    try:
        daemon.adopt_or_launch()
        engine = daemon.engines["x"]
        assert engine.paused is not None, "pause of the external engine lost on adoption"
        assert not engine.probing
    finally:
        cleanup(daemon)


# ------------------------------------------------------------------ D. a probe that raises

def test_a_probe_that_raises_still_reports(tmp_path: Path) -> None:
    """A probe whose request raises something unexpected (here: a port out of range, which
    urlsplit rejects) must still post a failed result: otherwise its id stays in probes_out for
    ever and no later `pause` of that engine is ever acknowledged."""
    runner = ProbeRunner(max_workers=1)
    try:
        runner.submit("x", 1, "http://127.0.0.1:99999/health_generate", 1.0)
        results = wait_until(runner.drain, 5, what="the probe's result")
        assert [(r.probe_id, r.ok) for r in results] == [(1, False)]
        assert "probe error" in results[0].detail
    finally:
        runner.close()


# ------------------------------------------------------------------ E/F. CLI bounds

@pytest.fixture
def mute_daemon(tmp_path: Path) -> Any:
    """A control socket that accepts requests and never answers (a SIGSTOPped daemon)."""
    import zmq

    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    endpoint = f"ipc://{tmp_path}/control"
    sock.bind(endpoint)
    yield endpoint
    sock.close()


def run_cli(*argv: str, limit: float = 20.0) -> tuple[int, float, str]:
    started = time.monotonic()
    try:
        p = subprocess.run([sys.executable, "-m", "rollout_watchdog", *argv],
                           capture_output=True, text=True, timeout=limit)
    except subprocess.TimeoutExpired:
        return -999, time.monotonic() - started, "still running"
    return p.returncode, time.monotonic() - started, p.stderr


def test_events_no_follow_answers_within_timeout(mute_daemon: str) -> None:
    """DESIGN: each command 'answers within 5 s or exits non-zero'. `events --no-follow` waits
    args.timeout + 5 s (the long-poll allowance, though it asks for wait_s = 0)."""
    rc, took, err = run_cli("events", "--no-follow", "--control", mute_daemon, "--timeout", "1")
    # the wait it gave up after: --timeout (less the command's own start), not the 6 s of the
    # long-poll allowance
    assert rc != 0 and "no answer" in err, f"{took:.1f} s: {err[-200:]}"
    waited = float(err.split(" within ")[1].split()[0])
    assert 0.1 <= waited <= 1.0, err


def test_a_negative_timeout_does_not_wait_forever(mute_daemon: str) -> None:
    """--timeout -1 becomes zmq poll(-1000): wait for ever."""
    rc, took, err = run_cli("status", "--control", mute_daemon, "--timeout", "-1", limit=8.0)
    assert rc not in (0, -999), f"rc {rc} after {took:.1f} s: {err[-200:]}"


# ------------------------------------------------------------------ G. probe pool vs. register

def test_registered_engines_are_not_starved_of_probe_threads(tmp_path: Path) -> None:
    """The probe pool is sized from the config (max(4, 2 x configured engines)) once, at start.
    A node whose engines are all registered (Ray actors: nothing in the config) has 4 threads;
    with 8 hung engines every probe of a healthy fifth one waits in the pool's queue, is judged
    'no answer' at timeout + 1 s after submission, and the healthy engine is killed."""
    import http.server
    import random
    import socket
    import threading

    from test_daemon_regressions import NoGpus

    from rollout_watchdog.config import parse_config
    from rollout_watchdog.watchdog.daemon import Daemon

    class Ok(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    good = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Ok)
    threading.Thread(target=good.serve_forever, daemon=True).start()
    hung = []
    for _ in range(8):   # accept (backlog) and never answer: a hung engine
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        s.listen(16)
        hung.append(s)
    procs = [subprocess.Popen(["sleep", "100"]) for _ in range(9)]
    config = parse_config({"state_dir": str(tmp_path), "control": f"ipc://{tmp_path}/c",
                           "probe": {"health_interval_s": 0.2, "health_timeout_s": 2.0,
                                     "failure_threshold": 2}, "engine": []})
    daemon = Daemon(config, inspector=NoGpus(), rng=random.Random(0))
    try:
        for i, s in enumerate(hung):
            run_command(daemon, "register", engine=f"h{i}",
                        url=f"http://127.0.0.1:{s.getsockname()[1]}", pid=procs[i].pid)
        run_command(daemon, "register", engine="ok",
                    url=f"http://127.0.0.1:{good.server_address[1]}", pid=procs[8].pid)
        ok = daemon.engines["ok"]
        verdicts: list[str] = []
        real = daemon.supervisor.judge_probe

        def spy(engine: Any, result: Any) -> None:
            if engine.id == "ok" and result.probe_id == engine.probe_id \
                    and engine.probe_started is not None:
                verdicts.append(result.detail)
            real(engine, result)

        daemon.supervisor.judge_probe = spy  # type: ignore[method-assign]
        deadline = time.monotonic() + 6.0
        while time.monotonic() < deadline:
            for result in daemon.probes.drain():
                daemon.supervisor.on_probe_result(result)
            now = time.monotonic()
            for engine in list(daemon.engines.values()):
                if engine.kill is None and engine.state.running:
                    daemon.supervisor.tick(engine, now)
            time.sleep(0.02)
        assert ok.state in (S.STARTING, S.HEALTHY, S.SUSPECT)
        assert ok.state == S.HEALTHY and all(v == "HTTP 200" for v in verdicts), verdicts
    finally:
        cleanup(daemon)
        daemon.probes.close()
        good.shutdown()
        for s in hung:
            s.close()
        for p in procs:
            p.kill()
            p.wait()


# ------------------------------------------------------------------ H. register --pid 1

def test_pid_1_is_never_an_engine_and_group_1_never_signalled(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Registering pid 1 would make the kill call killpg(1, ...), i.e. kill(-1, ...): every
    process on the node, the daemon running as root. It is refused, and the group guard holds
    on its own. Signals are recorded, not sent, here."""
    from rollout_watchdog.watchdog import process as process_mod

    sent: list[tuple[str, int, int]] = []
    monkeypatch.setattr(os, "killpg", lambda pg, sig: sent.append(("killpg", pg, sig)))
    monkeypatch.setattr(os, "kill", lambda pid, sig: sent.append(("kill", pid, sig)))
    daemon = make_daemon(tmp_path, engines=[], restart={"grace_s": 0.0, "kill_timeout_s": 0.2})
    with pytest.raises(CommandError, match="init, this daemon or one of its ancestors"):
        run_command(daemon, "register", engine="x", url=f"http://127.0.0.1:{free_port()}", pid=1)
    assert not process_mod.signal_group(1, signal.SIGKILL)  # and never kill(-1, ...) anyway
    assert not any(call[0] == "killpg" and call[1] <= 1 for call in sent), sent
    assert not any(call[1] == 1 for call in sent), sent


# ------------------------------------------------------------------ I. deferred budget bypass

def test_deferred_restart_during_the_failure_cleanup_uses_the_budget(tmp_path: Path) -> None:
    """A deferred engine's relaunch after a failure uses the budget (restart() says so), but
    only when the `restart` arrives after the cleanup. One that arrives while the failure's
    kill is still running (grace period: up to 30 s by default; the coordinator restarts at
    the next refit, which may be right away) turns the job into AfterKill.RESTART: relaunched
    uncounted, so a colocated engine that crash-loops this way never reaches `failed`."""
    daemon = make_daemon(tmp_path, engines=[{
        "id": "e0", "url": f"http://127.0.0.1:{free_port()}", "command": IGNORES_SIGTERM,
        "restart_policy": "deferred"}], restart={"max_restarts": 1, "grace_s": 0.2,
                                                 "kill_timeout_s": 2.0})
    engine = daemon.engines["e0"]
    try:
        daemon.supervisor.launch(engine, Cause.LAUNCHED)
        wait_until(lambda: engine.main is not None and ignores_sigterm(engine.main.pid), 10,
                   what="the engine ignoring SIGTERM")
        for _ in range(4):
            if engine.state == S.FAILED:
                break
            time.sleep(0.2)
            # a fatal failure (a probe threshold, say) while the main process still runs
            daemon.supervisor.fail(engine, Cause.PROBE_FAILED, "injected", time.monotonic())
            assert engine.kill is not None
            # the coordinator's restart, during the cleanup
            run_command(daemon, "restart", engine="e0")
            drive(daemon, lambda: engine.kill is None)
        assert engine.state == S.FAILED, (
            f"{engine.incarnation} incarnations, restarts {engine.restarts}, budget 1")
    finally:
        cleanup(daemon)


def test_a_commanded_stop_reaches_children_forked_after_the_last_sweep(tmp_path: Path) -> None:
    """The same race on a commanded stop: the main process exits on SIGTERM, a child it forked
    (unseen by any sweep) ignores SIGTERM and must still get SIGKILL after the grace."""
    daemon = make_daemon(tmp_path, engines=[{
        "id": "e0", "url": f"http://127.0.0.1:{free_port()}",
        "command": ["sh", "-c", "(trap '' TERM; exec sleep 100) & wait"]}],
        restart={"grace_s": 0.5, "kill_timeout_s": 2.0})
    engine = daemon.engines["e0"]
    pgid = None
    try:
        daemon.supervisor.launch(engine, Cause.LAUNCHED)
        assert engine.main is not None
        pgid = engine.main.pid
        wait_until(lambda: len(group_members(pgid)) >= 2, 5, what="the forked child")
        engine.state = S.HEALTHY
        run_command(daemon, "stop", engine="e0")
        drive(daemon, lambda: engine.kill is None)
        assert engine.state == S.STOPPED
        assert not group_members(pgid), "a child that ignored SIGTERM outlived the stop"
    finally:
        cleanup(daemon)
        if pgid is not None:
            for pid in group_members(pgid):
                os.kill(pid, signal.SIGKILL)
