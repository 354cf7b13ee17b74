"""The OS edge of the watchdog: process identity, group liveness, trees, ports."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

from daemon_harness import wait_for

from rollout_watchdog.watchdog.process import (
    ProcKey,
    descendants,
    describe_exit,
    exit_fields,
    has_exited,
    is_alive,
    live_process_groups,
    open_pidfd,
    port_bindable,
    proc_key,
    read_stat,
    signal_proc,
)


def test_a_zombie_group_counts_as_gone() -> None:
    """A group whose only member exited but is not reaped yet holds nothing: don't wait on it."""
    child = subprocess.Popen(["sh", "-c", "exit 0"], start_new_session=True)
    key = proc_key(child.pid)
    wait_for(lambda: child.pid not in live_process_groups(), 5, "the group to count as gone")
    assert key is not None and not is_alive(key)
    assert child.poll() == 0  # it was a zombie until now


def test_a_live_group_member_keeps_the_group_alive() -> None:
    leader = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        assert leader.pid in live_process_groups()
    finally:
        leader.kill()
        leader.wait()
    assert leader.pid not in live_process_groups()


def test_identity_is_pid_plus_start_time() -> None:
    me = proc_key(os.getpid())
    assert me is not None and is_alive(me)
    assert not is_alive(ProcKey(me.pid, me.start_time - 50))  # same pid, another process
    assert open_pidfd(ProcKey(me.pid, me.start_time - 50)) is None


def test_a_signal_reaches_only_the_process_it_names() -> None:
    """signal_proc sends to the process of that pid and start time, never to another process
    holding the pid, and says whether it sent."""
    child = subprocess.Popen(["sleep", "30"])
    try:
        key = proc_key(child.pid)
        assert key is not None
        assert not signal_proc(ProcKey(key.pid, key.start_time - 50), signal.SIGKILL)
        assert child.poll() is None                     # another incarnation's key: untouched
        assert signal_proc(key, signal.SIGKILL)
        assert child.wait(10) == -signal.SIGKILL
        assert not signal_proc(key, signal.SIGKILL)     # reaped: gone
    finally:
        child.kill()
        child.wait()


def _exe(pid: int) -> str:
    try:
        return os.path.basename(os.readlink(f"/proc/{pid}/exe"))
    except OSError:
        return ""


def test_descendants_walk_the_whole_tree() -> None:
    outer = subprocess.Popen([sys.executable, "-c",
                              "import subprocess,sys; subprocess.run(['sleep', '30'])"])
    try:
        def sleeping() -> list[ProcKey] | None:
            # the grandchild is a python fork for a moment before it execs sleep
            tree = descendants([outer.pid])[outer.pid]
            return tree if any(_exe(k.pid) == "sleep" for k in tree) else None

        assert wait_for(sleeping, 10, "the grandchild, running sleep")
    finally:
        for key in descendants([outer.pid])[outer.pid]:
            os.kill(key.pid, signal.SIGKILL)
        outer.kill()
        outer.wait()


def test_port_bindable_sees_a_listener() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        assert not port_bindable(port)
    assert port_bindable(port)


def test_exit_descriptions() -> None:
    assert describe_exit(-9) == "killed by SIGKILL"
    assert describe_exit(3) == "exit code 3"
    assert describe_exit(None) == "exit status unknown"
    assert (exit_fields(-9), exit_fields(3), exit_fields(0), exit_fields(None)) == (
        {"exit_signal": "SIGKILL"}, {"exit_code": 3}, {"exit_code": 0}, {})


def test_has_exited_live_zombie_gone_and_reused() -> None:
    """A probe failure is set aside while the engine's main process has exited or is exiting:
    live is not exited; a zombie (killed, not reaped yet) and a gone process are; a key whose
    pid now names another process is too."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    key = wait_for(lambda: proc_key(proc.pid), 10, "the child's key")
    try:
        assert not has_exited(key)
        assert has_exited(ProcKey(key.pid, key.start_time + 1.0))   # another process
        os.kill(proc.pid, signal.SIGKILL)
        wait_for(lambda: (stat := read_stat(proc.pid)) is not None and stat.state == b"Z", 10,
                 "the zombie")
        assert has_exited(key)
    finally:
        proc.kill()
        proc.wait()
    assert has_exited(key)
