"""Containment at the OS edge, with real processes: the subreaper catches a helper that
daemonized (double fork plus setsid), the marker names it, and reaping leaves no zombie."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest

from rollout_watchdog.emulator.testing import wait_until
from rollout_watchdog.watchdog.containment import (
    MARKER_ENV,
    Marker,
    marker_prefix,
    marker_value,
    parse_marker,
    read_marker,
    with_marker,
)
from rollout_watchdog.watchdog.process import read_stat

ROOT = str(Path(__file__).resolve().parent.parent)

# An engine that daemonizes a helper and exits: fork, setsid, fork again; the middle process
# prints the helper's pid and exits, so the helper is orphaned at once.
DAEMONIZER = """
import os, sys, time
if os.fork() == 0:
    os.setsid()
    helper = os.fork()
    if helper == 0:
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        time.sleep(120)
        os._exit(0)
    print(helper, flush=True)
    os._exit(0)
os.wait()
"""

# Stands in for the daemon: optionally a subreaper, launches the daemonizer with the marker in
# its environment, never reaps it (as the daemon peeks its engines' exit status), and reaps
# everything else on "reap" from stdin.
SUPERVISOR = """
import json, os, subprocess, sys
from rollout_watchdog.watchdog.containment import reap_children, set_child_subreaper, with_marker
subreaper = set_child_subreaper() if sys.argv[1] == "1" else False
env = with_marker(os.environ, sys.argv[2])
child = subprocess.Popen([sys.executable, "-c", sys.argv[3]], env=env, stdout=subprocess.PIPE)
helper = int(child.stdout.readline())
print(json.dumps({"subreaper": subreaper, "child": child.pid, "helper": helper}), flush=True)
for line in sys.stdin:
    print(json.dumps(reap_children(keep={child.pid})), flush=True)
"""


def _kill_if_ours(pid: int, marker: str) -> None:
    """Cleanup: SIGKILL ``pid`` only if it is still the process that carries our marker."""
    if read_marker(pid) == marker:
        os.kill(pid, signal.SIGKILL)


@pytest.fixture
def supervisor(request: pytest.FixtureRequest) -> Iterator[tuple[subprocess.Popen[str], dict[
        str, int], str]]:
    """(process, its first report, the marker) for a supervisor; param: subreaper or not."""
    marker = marker_value(f"node-{uuid.uuid4().hex[:8]}", "e0", 3, "boot1")
    env = {**os.environ, "PYTHONPATH": ROOT}
    proc = subprocess.Popen(
        [sys.executable, "-c", SUPERVISOR, "1" if request.param else "0", marker, DAEMONIZER],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
    )
    assert proc.stdout is not None
    info = json.loads(proc.stdout.readline())
    try:
        wait_until(lambda: (s := read_stat(info["child"])) is not None and s.state == b"Z", 10,
                   what="the engine's main process to exit (unreaped)")
        yield proc, info, marker
    finally:
        _kill_if_ours(info["helper"], marker)
        proc.kill()
        proc.wait(timeout=10)


def _ppid(pid: int) -> int | None:
    stat = read_stat(pid)
    return stat.ppid if stat else None


def _all_pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def find_marked(pids: Iterable[int] | None, prefix: str) -> dict[int, str]:
    """Every process among ``pids`` (all of /proc if None) whose marker starts with ``prefix``
    (the daemon reads markers one process at a time, as the tracker meets them)."""
    found: dict[int, str] = {}
    for pid in _all_pids() if pids is None else pids:
        marker = read_marker(pid)
        if marker and marker.startswith(prefix):
            found[pid] = marker
    return found


@pytest.mark.parametrize("supervisor", [True], indirect=True)
def test_daemonized_helper_reparents_to_the_subreaper_and_is_reaped(
        supervisor: tuple[subprocess.Popen[str], dict[str, int], str]) -> None:
    proc, info, marker = supervisor
    assert proc.stdin is not None and proc.stdout is not None
    assert info["subreaper"] is True
    helper, child = info["helper"], info["child"]
    wait_until(lambda: _ppid(helper) == proc.pid, 10, what="the helper to re-parent")
    # The helper left the engine's session and lost its parent; the marker still names it.
    assert os.getsid(helper) != os.getsid(proc.pid)
    assert read_marker(helper) == marker
    assert parse_marker(marker) == Marker(marker.split("/")[0], "e0", 3, "boot1")

    os.kill(helper, signal.SIGKILL)
    wait_until(lambda: (s := read_stat(helper)) is not None and s.state == b"Z", 10,
               what="the killed helper to be a zombie of the subreaper")
    proc.stdin.write("reap\n")
    proc.stdin.flush()
    reaped = json.loads(proc.stdout.readline())
    assert [helper, -signal.SIGKILL] in reaped
    assert read_stat(helper) is None, "the helper is still a zombie after reap_children"
    # The engine's main process exited too, but it is kept: the daemon peeks its status.
    assert child not in [pid for pid, _ in reaped]
    stat = read_stat(child)
    assert stat is not None and stat.state == b"Z" and stat.ppid == proc.pid


@pytest.mark.parametrize("supervisor", [False], indirect=True)
def test_without_the_subreaper_the_helper_escapes(
        supervisor: tuple[subprocess.Popen[str], dict[str, int], str]) -> None:
    """The control: without PR_SET_CHILD_SUBREAPER the helper re-parents elsewhere."""
    proc, info, marker = supervisor
    helper = info["helper"]

    def reparented() -> bool:
        """The middle process (a child of the engine) is gone and the helper has a new parent."""
        parent = _ppid(helper)
        return parent is not None and _ppid(parent) != info["child"]

    wait_until(reparented, 10, what="the helper to re-parent")
    assert _ppid(helper) != proc.pid
    assert read_marker(helper) == marker  # found only by a marker scan
    assert find_marked(None, marker_prefix(marker.split("/")[0])) == {helper: marker}


def test_marker_round_trip_and_rules() -> None:
    value = marker_value("rack3/node7", "e0.a-1", 12, "f00d")
    assert value == "rack3/node7/e0.a-1/12/f00d"
    assert parse_marker(value) == Marker("rack3/node7", "e0.a-1", 12, "f00d")
    assert value.startswith(marker_prefix("rack3/node7", "e0.a-1"))
    assert not marker_value("n", "e10", 1, "b").startswith(marker_prefix("n", "e1"))
    for bad in ("", "a/b", "n/e/x/b", "n/e//b"):
        assert parse_marker(bad) is None
    with pytest.raises(ValueError, match="engine id"):
        marker_value("n", "a/b", 1, "b")
    with pytest.raises(ValueError, match="boot token"):
        marker_value("n", "e0", 1, "")
    with pytest.raises(ValueError, match="incarnation"):
        marker_value("n", "e0", -1, "b")
    env = with_marker({"PATH": "/bin", MARKER_ENV: "old"}, value)
    assert list(env) == [MARKER_ENV, "PATH"] and env[MARKER_ENV] == value


def test_find_marked_and_read_marker_on_real_processes() -> None:
    node = f"node-{uuid.uuid4().hex[:8]}"
    # each says so once it runs: its environment is laid out by then
    sleep = [sys.executable, "-c", "import time; print(flush=True); time.sleep(60)"]

    def start(env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(sleep, env=env, stdout=subprocess.PIPE)
        assert proc.stdout is not None
        proc.stdout.readline()
        return proc

    procs = {name: start(with_marker(os.environ, marker_value(node, name, 1, "b")))
             for name in ("e0", "e1")}
    plain = start()
    try:
        pids = [p.pid for p in (*procs.values(), plain)]
        assert read_marker(plain.pid) is None
        assert find_marked(pids, marker_prefix(node, "e1")) == {
            procs["e1"].pid: f"{node}/e1/1/b"}
        assert find_marked(None, marker_prefix(node)) == {
            p.pid: f"{node}/{name}/1/b" for name, p in procs.items()}
    finally:
        for p in (*procs.values(), plain):
            p.kill()
            p.wait()
    assert read_marker(plain.pid) is None  # gone
    assert not read_marker(2)  # kthreadd: a kernel thread has no environment (ESRCH or "")


def test_a_marked_process_never_reads_as_unmarked_mid_exec() -> None:
    """Right after Popen returns, the exec may not have laid out the new environment yet: the
    read is then "" (look again), never None (no marker), which would let it escape."""
    marker = marker_value("n", "e0", 1, "b")
    seen = set()
    for _ in range(20):
        proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                                env=with_marker(os.environ, marker))
        try:
            seen.add(read_marker(proc.pid))
        finally:
            proc.kill()
            proc.wait()
    assert seen <= {marker, ""}


def _raise_in_child(soft: int) -> list[int]:
    code = (
        "import json, resource\n"
        "from rollout_watchdog.common.limits import raise_nofile_limit\n"
        "print(json.dumps([*raise_nofile_limit(), "
        "resource.getrlimit(resource.RLIMIT_NOFILE)[0]]))\n"
    )
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=30,
        env={**os.environ, "PYTHONPATH": ROOT},
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard)),
    )
    return list(json.loads(out.stdout))


def test_raise_nofile_limit_raises_soft_to_hard() -> None:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard <= 256:
        pytest.skip(f"the hard RLIMIT_NOFILE here is {hard}: nothing to raise to")
    assert _raise_in_child(256) == [256, hard, hard]
    assert _raise_in_child(hard) == [hard, hard, hard]
