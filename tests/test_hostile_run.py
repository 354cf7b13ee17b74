"""What a hostile run found (issue 5, part 3), each injected again: trickling engines, a daemon
out of file descriptors, a stderr nobody reads, a follower far behind, world-readable files, a
helper that comes and goes."""

from __future__ import annotations

import os
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from daemon_harness import EngineSpec, fd_limit, run_command, wait_for
from test_supervisor_seams import healthy, make_daemon

from rollout_watchdog.common.events import Event, EventLog
from rollout_watchdog.watchdog.process import proc_key

# ------------------------------------------------------------------ trickling engines


def trickler() -> tuple[socket.socket, threading.Event]:
    """An engine whose /health_generate sends one byte every 0.2 s and never a status line."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    stop = threading.Event()

    def serve(conn: socket.socket) -> None:
        try:
            while not stop.is_set():
                conn.sendall(b"H")
                time.sleep(0.2)
        except OSError:
            pass
        finally:
            conn.close()

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    return server, stop


def test_trickling_engines_neither_pile_up_threads_nor_starve_a_healthy_one(
        make_node: Any) -> None:
    """Six engines trickle bytes and never answer; a seventh is healthy. Each holds at most
    one probe, each probe ends at its deadline, so the daemon's threads stay bounded and the
    healthy engine's probes keep passing (before: 34 -> 259 threads in 95 s, and healthy
    engines relaunched for 'no answer')."""
    servers = [trickler() for _ in range(6)]
    try:
        node = make_node([EngineSpec("ok")]).start()
        node.wait_state("ok", "healthy")
        sleepers = [subprocess.Popen(["sleep", "60"]) for _ in servers]
        for i, ((server, _), sleeper) in enumerate(zip(servers, sleepers, strict=True)):
            node.client.call("register", {"engine": f"t{i}", "pid": sleeper.pid,
                                          "url": f"http://127.0.0.1:{server.getsockname()[1]}"})
        assert node.proc is not None
        threads = []
        deadline = time.monotonic() + 6.0
        while time.monotonic() < deadline:
            threads.append(len(os.listdir(f"/proc/{node.proc.pid}/task")))
            # never taken for dead (one slow answer on a loaded host may make it suspect)
            assert node.engine("ok")["state"] in ("healthy", "suspect")
            time.sleep(0.2)
        # the loop, the log writer, a probe per engine at most, and a few of the runtime's own
        assert max(threads) <= 7 + 8, threads
        assert node.engine("ok")["incarnation"] == 1
        for sleeper in sleepers:
            sleeper.kill()
            sleeper.wait()
    finally:
        for server, stop in servers:
            stop.set()
            server.close()


# ------------------------------------------------------------------ out of file descriptors

FORKER = r"""
import subprocess, time
children = [subprocess.Popen(["sleep", "120"]) for _ in range(300)]
while True:
    time.sleep(1)
"""


def test_out_of_descriptors_no_healthy_engine_is_taken_for_dead(make_node: Any) -> None:
    """Open-file limit 256 (soft and hard), one engine with 300 children (a pidfd each, once):
    an unrelated healthy engine stays healthy, and a real exit is still seen and acted on."""
    node = make_node([EngineSpec("many", command=[sys.executable, "-c", FORKER],
                                 extra={"probe": {"health_path": ""}}),
                      EngineSpec("ok")])
    node.start(wrap=fd_limit(256))
    first = node.wait_state("ok", "healthy")
    many = node.wait_state("many", "healthy")["pid"]
    wait_for(lambda: len(subprocess.run(["pgrep", "-P", str(many)], capture_output=True,
                                        text=True).stdout.split()) >= 300, 30,
             "300 children of the forking engine")
    deadline = time.monotonic() + 4.0  # a few sweeps (0.2 s each) take the children in
    while time.monotonic() < deadline:
        e = node.engine("ok")   # never taken for dead (suspect: one slow answer, a loaded host)
        assert e["state"] in ("healthy", "suspect") and e["incarnation"] == 1, e
        time.sleep(0.2)
    # past its pidfd budget, the daemon polls (and says so, through its log-writer thread)
    wait_for(lambda: "by polling" in node.log_text(), 15, "the log line")
    os.kill(first["pid"], signal.SIGKILL)
    again = node.wait_state("ok", "healthy", incarnation=2)
    assert again["last_failure"]["cause"] == "exited"
    assert node.engine("many")["incarnation"] == 1
    assert node.stop_daemon() == 0
    assert proc_key(many) is None or not any(
        proc_key(int(p)) for p in subprocess.run(["pgrep", "-P", str(many)],
                                                 capture_output=True, text=True).stdout.split())


# ------------------------------------------------------------------ a stderr nobody reads

def test_a_stalled_log_reader_never_blocks_the_loop(make_node: Any, tmp_path: Path) -> None:
    """The daemon's stderr is a pipe nobody reads (a stalled journald): it still answers, and
    an engine's death is still acted on at once (before: the loop blocked in a pipe write
    after ~490 log lines)."""
    node = make_node([EngineSpec("e0")])
    read_end, write_end = os.pipe()  # never read
    try:
        node.start(stdout=write_end)
        first = node.wait_state("e0", "healthy")
        for _ in range(700):  # each one logs a line or more
            node.client.call("resume", {"engine": "e0"})
        assert node.client.call("ping", timeout_s=10.0)
        os.kill(first["pid"], signal.SIGKILL)
        node.wait_state("e0", "healthy", incarnation=2, timeout=20)
    finally:
        os.close(read_end)
        os.close(write_end)


# ------------------------------------------------------------------ engine logs

CHATTY = r"""
import sys, time
line = "x" * 1023 + "\n"
while True:
    sys.stdout.write(line * 64)
    sys.stdout.flush()
    time.sleep(0.01)
"""


def test_engine_logs_are_rotated_not_grown_without_limit(make_node: Any) -> None:
    """An engine writing about 6 MiB/s into a log capped at 256 KiB with 2 copies: the disk
    used stays near (2 + 1) x 256 KiB (before: 7.8 GiB in 20 s)."""
    node = make_node([EngineSpec("e0", command=[sys.executable, "-c", CHATTY],
                                 extra={"probe": {"health_path": ""}})],
                     top={"engine_log": "file", "engine_log_max_bytes": 256 * 1024,
                          "engine_log_backups": 2}).start()
    node.wait_state("e0", "healthy")
    logs = node.state_dir / "logs"
    wait_for(lambda: (logs / "e0.log.2").exists(), 20, "two rotated copies")
    peak = 0
    deadline = time.monotonic() + 3.0
    while time.monotonic() < deadline:
        peak = max(peak, sum(f.stat().st_size for f in logs.glob("e0.log*") if f.exists()))
        time.sleep(0.05)
    # the rotator looks once a second: the slack is about two seconds of output (6 MiB/s), one
    # look late on a loaded host; growth without a limit is 6 MiB more every second
    assert peak <= 3 * 256 * 1024 + 16 * 1024 * 1024, peak


# ------------------------------------------------------------------ minor findings

def test_a_follower_that_fell_behind_is_told_how_many_events_it_lost(tmp_path: Path) -> None:
    daemon = make_daemon(tmp_path)
    daemon.supervisor.events = EventLog(None, capacity=5)
    for _ in range(10):
        daemon.supervisor.events.append(Event(ts=0.0, node_id="n", engine="e0",
                                              incarnation=1, kind="resumed"))
    answer = run_command(daemon, "events", since=2)
    assert answer["events"][0]["kind"] == "gap"
    assert answer["events"][0]["detail"].startswith("3 event(s) lost")
    assert [e["kind"] for e in answer["events"][1:]] == ["resumed"] * 5


def test_the_daemons_files_are_private(make_node: Any) -> None:
    node = make_node([EngineSpec("e0")]).start()
    node.wait_state("e0", "healthy")
    modes = {name: stat.S_IMODE(os.stat(node.state_dir / name).st_mode)
             for name in ("state.json", "events.jsonl", "logs/e0.log")}
    assert modes == {"state.json": 0o600, "events.jsonl": 0o600, "logs/e0.log": 0o640}


def test_a_helper_that_ended_is_forgotten_not_fatal(tmp_path: Path) -> None:
    """Processes seen and gone that were never fatal are pruned, not kept for the whole
    incarnation; their exit fails nothing."""
    daemon = make_daemon(tmp_path)
    engine = healthy(daemon)
    helper = subprocess.Popen(["sleep", "0.1"])
    key = proc_key(helper.pid)
    assert key is not None
    main = proc_key(os.getpid())
    assert main is not None
    engine.main, engine.procs = main, {main: True, key: False}
    helper.wait()
    daemon.supervisor.process_gone(engine, key)
    assert key not in engine.procs and engine.state.value == "healthy"
