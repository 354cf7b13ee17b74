"""`lifeline_pid`: the daemon stops every engine and exits when that process ends (under Ray,
the raylet: nothing outlives its Ray node). A zombie counts as ended: a test Cluster's removed
raylet stays one, unreaped, as the lifeline here does."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

from daemon_harness import EngineSpec, Node

from rollout_watchdog.watchdog.process import is_alive, proc_key


def test_the_lifeline_killed_stops_the_engines_and_the_daemon(tmp_path: Path) -> None:
    lifeline = subprocess.Popen(["sleep", "600"])
    node = Node(tmp_path, [EngineSpec("e0")], top={"lifeline_pid": lifeline.pid})
    try:
        node.start()
        engine = node.wait_state("e0", "healthy", timeout=60)
        key = proc_key(engine["pid"])
        assert key is not None
        lifeline.send_signal(signal.SIGKILL)   # unreaped: a zombie (kill(pid, 0) says alive)
        assert node.proc is not None
        assert node.proc.wait(timeout=60) == 0
        assert not is_alive(key)
        assert "lifeline process" in node.log_text()
    finally:
        lifeline.kill()
        lifeline.wait()
        node.cleanup()


def test_a_lifeline_gone_at_start_launches_nothing(tmp_path: Path) -> None:
    """Before, such a daemon launched its engines, then stopped them: under Ray, a watchdog
    actor that outlived its raylet started one a second, and each made a new incarnation."""
    gone = subprocess.Popen(["true"])
    gone.wait()
    node = Node(tmp_path, [EngineSpec("e0")], top={"lifeline_pid": gone.pid})
    try:
        assert node.proc is None
        with open(tmp_path / "daemon.log", "ab") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "rollout_watchdog", "run", "--config",
                 str(node.config_path)],
                stdout=log, stderr=subprocess.STDOUT, env=node.env)
        assert proc.wait(timeout=60) == 0
        text = node.log_text()
        assert "lifeline process" in text and "-> starting" not in text, text
    finally:
        node.cleanup()
