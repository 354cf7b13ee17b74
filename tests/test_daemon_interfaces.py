"""What operators and tools see of a running daemon: systemd notifications, Prometheus metrics,
JSON logs, the CLI, the control socket's permissions, and adoption's guard against pid reuse."""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
import requests
import zmq
from daemon_harness import EngineSpec, Node, free_port, pid_gone, wait_for

from rollout_watchdog.cli.client import ControlError
from rollout_watchdog.watchdog.control import bind_control
from rollout_watchdog.watchdog.process import proc_key
from rollout_watchdog.watchdog.statefile import kernel_boot_id

MakeNode = Callable[..., Node]


def cli(node: Node, *args: str, timeout: float = 20.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "rollout_watchdog", *args,
                           "--control", node.control], capture_output=True, text=True,
                          timeout=timeout)


def test_sd_notify_ready_watchdog_status_stopping(make_node: MakeNode, tmp_path: Path) -> None:
    path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(0.2)
    received: list[str] = []
    done = threading.Event()

    def read() -> None:
        """Read as systemd does, at once: a datagram queue holds only a few messages."""
        while not done.is_set():
            try:
                received.append(sock.recv(4096).decode())
            except TimeoutError:
                continue

    reader = threading.Thread(target=read, daemon=True)
    reader.start()

    def messages() -> list[str]:
        return list(received)

    def seen(text: str) -> bool:
        return any(text in m for m in messages())

    node = make_node([EngineSpec("e0")], env={"NOTIFY_SOCKET": path,
                                              "WATCHDOG_USEC": "400000"}).start()
    try:
        wait_for(lambda: seen("READY=1"), 10, "READY=1")
        node.wait_state("e0", "healthy")
        wait_for(lambda: seen("STATUS=1 engine(s): 1 healthy"), 10, "a STATUS line")
        count = sum(m == "WATCHDOG=1" for m in messages())
        wait_for(lambda: sum(m == "WATCHDOG=1" for m in messages()) >= count + 3, 10,
                 "the main loop to keep pinging the watchdog")
        # the engine does not inherit the daemon's systemd handshake
        engine_env = psutil.Process(node.engine("e0")["pid"]).environ()
        assert "NOTIFY_SOCKET" not in engine_env and "WATCHDOG_USEC" not in engine_env
        assert node.stop_daemon() == 0
        wait_for(lambda: seen("STOPPING=1"), 5, "STOPPING=1")
    finally:
        done.set()
        reader.join(timeout=5)
        sock.close()


def test_prometheus_metrics(make_node: MakeNode) -> None:
    port = free_port()
    node = make_node([EngineSpec("e0")], top={"metrics_port": port}).start()
    first = node.wait_state("e0", "healthy")
    os.kill(first["pid"], signal.SIGKILL)
    node.wait_state("e0", "healthy", incarnation=2)
    healthy = 'rollout_watchdog_engine_state{engine="e0",state="healthy"} 1.0'

    # (healthy at the scrape: one slow probe on a loaded host passes)
    def scrape() -> str | None:
        text = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
        return text if healthy in text else None
    text = wait_for(scrape, 30, "a scrape with e0 healthy")
    assert 'rollout_watchdog_restarts_total{cause="exited",engine="e0"} 1.0' in text
    assert 'rollout_watchdog_detection_latency_seconds_count{cause="exited",engine="e0"} 1.0' \
        in text
    assert 'rollout_watchdog_probe_latency_seconds_count{engine="e0"}' in text
    assert 'rollout_watchdog_engine_incarnation{engine="e0"} 2.0' in text


def test_json_logs_one_object_a_line(make_node: MakeNode) -> None:
    node = make_node([EngineSpec("e0")]).start()
    node.wait_state("e0", "healthy")
    node.stop_daemon()
    lines = [json.loads(line) for line in node.log_text().splitlines() if line.strip()]
    transitions = [entry for entry in lines if entry.get("kind") == "state"]
    assert transitions and all(entry["engine"] == "e0" for entry in transitions)
    assert {"ts", "level", "logger", "msg"} <= set(transitions[0])


def test_control_socket_is_private(make_node: MakeNode) -> None:
    node = make_node([]).start()
    mode = os.stat(node.control[len("ipc://"):]).st_mode
    assert stat.S_IMODE(mode) == 0o600


def test_cli_status_table_and_json(make_node: MakeNode) -> None:
    node = make_node([EngineSpec("e0"), EngineSpec("e1")]).start()
    node.wait_state("e0", "healthy")
    node.wait_state("e1", "healthy")
    table = cli(node, "status")
    assert table.returncode == 0
    assert table.stdout.splitlines()[1].split()[:3] == ["ENGINE", "STATE", "PROBES"]
    # (suspect: one probe that a loaded host made slow, between the wait and the call)
    assert any(line.split()[:2] in (["e0", "healthy"], ["e0", "suspect"])
               for line in table.stdout.splitlines()), table.stdout
    status = json.loads(cli(node, "status", "--json").stdout)
    assert status["node_id"] == "test-node"
    assert {"id", "state", "paused", "pid", "incarnation", "restarts", "url",
            "last_failure"} <= set(status["engines"][0])


def test_cli_commands_pause_resume_stop_restart(make_node: MakeNode) -> None:
    node = make_node([EngineSpec("e0")]).start()
    node.wait_state("e0", "healthy")
    assert cli(node, "pause", "--all", "--deadline", "60").returncode == 0
    assert node.engine("e0")["paused"] is True
    assert cli(node, "resume", "e0").returncode == 0
    assert node.engine("e0")["paused"] is False
    assert cli(node, "stop", "e0").returncode == 0
    node.wait_state("e0", "stopped")
    assert cli(node, "restart", "e0").returncode == 0
    node.wait_state("e0", "healthy", incarnation=2)
    bad = cli(node, "pause", "nope")
    assert bad.returncode != 0 and "no engine 'nope'" in bad.stderr


def test_cli_without_a_daemon_fails_fast_with_a_message(tmp_path: Path) -> None:
    """Told at once, not after the answer timeout (60 s here: the run's 30 s bound fails a
    client that waits for it)."""
    out = subprocess.run([sys.executable, "-m", "rollout_watchdog", "status", "--control",
                          f"ipc://{tmp_path}/none", "--timeout", "60"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode != 0 and "no daemon" in out.stderr


def test_adoption_does_not_trust_a_reused_pid(make_node: MakeNode) -> None:
    """A state file naming a pid that now belongs to another process (other create time): that
    process is left alone and the engine is relaunched."""
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        node = make_node([EngineSpec("e0")])
        started = proc_key(stranger.pid)
        assert started is not None
        node.state_dir.mkdir(parents=True)
        key = [stranger.pid, started.start_time - 100.0]
        (node.state_dir / "state.json").write_text(json.dumps({
            "version": 1, "node_id": "test-node", "boot_id": kernel_boot_id(),
            "engines": {"e0": {
                "state": "healthy", "incarnation": 4, "main": key, "procs": [[key, True]],
                "launched_at": time.time() - 100}}}))
        node.start()
        e = node.wait_state("e0", "healthy", incarnation=5)
        assert e["pid"] != stranger.pid
        assert stranger.poll() is None and not pid_gone(stranger.pid)
    finally:
        stranger.kill()
        stranger.wait()


def test_a_corrupt_state_file_is_set_aside(make_node: MakeNode) -> None:
    node = make_node([EngineSpec("e0")])
    node.state_dir.mkdir(parents=True)
    (node.state_dir / "state.json").write_text("{not json")
    node.start()
    node.wait_state("e0", "healthy", incarnation=1)
    assert (node.state_dir / "state.json.corrupt").read_text() == "{not json"
    wait_for(lambda: "unusable" in node.log_text(), 15, "the log line")  # written by a thread


def test_a_state_dir_or_control_socket_that_cannot_be_used_is_one_line_naming_it(
        tmp_path: Path) -> None:
    """A full state disk said only "cannot run: [Errno 28] No space left on device", and a
    control socket on a read-only directory gave a raw ZMQError traceback (hostile run 5)."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    config = tmp_path / "node.toml"
    config.write_text(f'node_id = "n1"\nstate_dir = "{blocker}/state"\ngpu_check = "none"\n'
                      f'control = "ipc://{tmp_path}/c"\n')
    out = subprocess.run([sys.executable, "-m", "rollout_watchdog", "run", "--config",
                          str(config)], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and f"cannot use state_dir {blocker}/state" in out.stderr
    assert "Traceback" not in out.stderr

    class ReadOnly:   # (a read-only filesystem needs a mount: its refusal, as ZeroMQ says it)
        def bind(self, endpoint: str) -> None:
            raise zmq.ZMQError(errno.EROFS)
    with pytest.raises(RuntimeError, match=r"cannot bind the control socket \('control' = "
                                           r"'ipc://.*/ro/c'\): Read-only file system"):
        bind_control(ReadOnly(), f"ipc://{tmp_path}/ro/c")   # type: ignore[arg-type]


def test_a_second_daemon_on_the_same_node_is_refused(make_node: MakeNode) -> None:
    node = make_node([]).start()
    assert node.proc is not None
    out = subprocess.run([sys.executable, "-m", "rollout_watchdog", "run", "--config",
                          str(node.config_path)], capture_output=True, text=True, timeout=30)
    assert out.returncode != 0
    assert f"state_dir {node.state_dir} is in use by another daemon (pid {node.proc.pid})" \
        in out.stderr
    assert "Traceback" not in out.stderr
    assert node.client.call("ping")  # the first one is untouched


def test_a_stale_socket_file_is_reported_at_once(tmp_path: Path) -> None:
    path = tmp_path / "control"
    leftover = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    leftover.bind(str(path))  # a daemon killed by SIGKILL leaves its socket file like this
    leftover.close()
    # at once, not after the answer timeout (60 s: the run's 30 s bound fails a client that
    # waits for it)
    out = subprocess.run([sys.executable, "-m", "rollout_watchdog", "status", "--control",
                          f"ipc://{path}", "--timeout", "60"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode != 0 and "nobody listening" in out.stderr


def test_user_mistakes_on_the_command_line_are_messages(tmp_path: Path) -> None:
    bad_level = subprocess.run([sys.executable, "-m", "rollout_watchdog", "run", "--config",
                                str(tmp_path / "x.toml"), "--log-level", "verbose"],
                               capture_output=True, text=True, timeout=20)
    assert bad_level.returncode == 2 and "invalid choice: 'verbose'" in bad_level.stderr
    bad_timeout = subprocess.run([sys.executable, "-m", "rollout_watchdog", "status",
                                  "--timeout", "-1"], capture_output=True, text=True, timeout=20)
    assert bad_timeout.returncode == 2 and "must be a number of seconds > 0" in bad_timeout.stderr
    for out in (bad_level, bad_timeout):
        assert "Traceback" not in out.stderr


def test_a_commanded_relaunch_waits_for_a_free_port(make_node: MakeNode) -> None:
    spec = EngineSpec("e0")
    node = make_node([spec]).start()
    node.wait_state("e0", "healthy")
    node.client.call("stop", {"engine": "e0"})
    node.wait_state("e0", "stopped")
    with socket.socket() as squatter:
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past TIME_WAIT
        squatter.bind(("127.0.0.1", spec.port))
        squatter.listen()
        out = cli(node, "restart", "e0")
        assert out.returncode != 0
        assert f"not relaunched: port {spec.port} is still in use" in out.stderr
        assert node.engine("e0")["state"] == "stopped"
    assert cli(node, "restart", "e0").returncode == 0
    node.wait_state("e0", "healthy", incarnation=2)


def test_register_refuses_what_is_not_a_separate_engine(make_node: MakeNode) -> None:
    spec = EngineSpec("e0")
    node = make_node([spec]).start()
    pid = node.wait_state("e0", "healthy")["pid"]
    other = subprocess.Popen(["sleep", "60"])
    for args, reason in (
            ({"engine": "x", "url": "http://127.0.0.1:1", "pid": pid},
             f"pid {pid} is already watched as part of engine e0"),
            ({"engine": "x", "url": spec.url, "pid": other.pid}, "is engine e0's address"),
            ({"engine": "x", "url": "http://127.0.0.1:2", "pid": node.proc.pid},
             "this daemon or one of its ancestors"),
            ({"engine": "x", "url": "http://127.0.0.1:99999", "pid": other.pid},
             "valid port")):
        try:
            node.client.call("register", args)
        except ControlError as exc:
            assert reason in str(exc), (reason, str(exc))
        else:
            raise AssertionError(f"register {args} was accepted")
    other.kill()
    other.wait()
