"""cgroup v2 containment: a real cgroup where this machine lets the tests make one (root with a
writable cgroup2 mount), skipped with the reason otherwise; the parsing everywhere."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rollout_watchdog.emulator.testing import wait_until
from rollout_watchdog.watchdog.cgroup import (
    DAEMON_LEAF,
    MODE_CGROUP,
    MODE_SUBREAPER,
    CgroupError,
    CgroupManager,
    cgroup2_mount,
    cgroup_dir,
    mode_of,
    own_cgroup,
)
from rollout_watchdog.watchdog.process import read_stat

ROOT = str(Path(__file__).resolve().parent.parent)

# The engine: a plain child, and a helper that escapes by double fork plus setsid. It reports
# both pids and stays up.
ENGINE = """
import json, os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
read, write = os.pipe()
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.write(write, str(os.getpid()).encode())
        time.sleep(120)
    os._exit(0)
helper = int(os.read(read, 32))
print(json.dumps({"child": child.pid, "helper": helper}), flush=True)
time.sleep(120)
"""

# The daemon: waits until the test has put it in its cgroup, detects the delegated root, moves
# itself to its leaf, launches the engine in a cgroup of its own, kills it on request.
DAEMON = """
import json, os, subprocess, sys, time
from rollout_watchdog.watchdog.cgroup import CgroupManager, probe_delegated_root
sys.stdin.readline()
root, why = probe_delegated_root()
assert root is not None, why
cgroups = CgroupManager(root, "o1")
cgroups.prepare()
path = cgroups.create("e0", 1, "t0")
engine = subprocess.Popen(cgroups.command(path, [sys.executable, "-c", sys.argv[1]]),
                          stdout=subprocess.PIPE, start_new_session=True)
pids = json.loads(engine.stdout.readline())
print(json.dumps({"root": str(root), "path": str(path), "main": engine.pid, **pids,
                  "own": open("/proc/self/cgroup").read()}), flush=True)
sys.stdin.readline()
started = time.monotonic()
killed = cgroups.kill(path)
while cgroups.populated(path) and time.monotonic() - started < 10:
    time.sleep(0.005)
print(json.dumps({"killed": killed, "populated": cgroups.populated(path),
                  "seconds": time.monotonic() - started,
                  "main_state": open(f"/proc/{engine.pid}/stat").read().split(") ")[1][0]}),
      flush=True)
sys.stdin.readline()
engine.wait()
print(json.dumps({"removed": cgroups.remove(path), "exists": path.exists()}), flush=True)
sys.stdin.readline()
"""


def _write(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _gone(pid: int) -> bool:
    stat = read_stat(pid)
    return stat is None or stat.state == b"Z"


def test_cgroup_kill_takes_the_whole_incarnation(test_cgroup: Path) -> None:
    daemon = subprocess.Popen(
        [sys.executable, "-c", DAEMON, ENGINE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        text=True, env={**os.environ, "PYTHONPATH": ROOT},
    )
    assert daemon.stdin is not None and daemon.stdout is not None

    def ask(line: str = "\n") -> dict[str, object]:
        assert daemon.stdin is not None and daemon.stdout is not None
        daemon.stdin.write(line)
        daemon.stdin.flush()
        answer = daemon.stdout.readline()
        assert answer, f"the daemon exited with {daemon.wait(timeout=10)}"
        return dict(json.loads(answer))

    try:
        _write(test_cgroup / "cgroup.procs", str(daemon.pid))  # as systemd would start it
        info = ask()
        path = Path(str(info["path"]))
        main, child, helper = (int(str(info[k])) for k in ("main", "child", "helper"))
        assert Path(str(info["root"])) == test_cgroup
        assert str(info["own"]).endswith(f"/{test_cgroup.name}/{DAEMON_LEAF}\n")
        assert path == test_cgroup / "engine-e0-1-t0-o1"
        assert CgroupManager(test_cgroup, "o1").existing() == [path]
        assert CgroupManager(test_cgroup, "o2").existing() == []  # another daemon's
        # The helper left the engine's session and its parent died; the kernel still has it.
        assert os.getsid(helper) != os.getsid(main)
        wait_until(lambda: CgroupManager.pids(path) == sorted((main, child, helper)), 10,
                   what="exactly the engine's three processes in its cgroup")
        assert CgroupManager.populated(path)
        with pytest.raises(CgroupError, match="already holds processes"):
            CgroupManager(test_cgroup, "o1").create("e0", 1, "t0")

        killed = ask()
        assert killed["killed"] is True
        assert killed["populated"] is False, killed
        # Populated 0 while the main process is still an unreaped zombie of the daemon: the
        # daemon may read "everything is gone" before it reaps.
        assert killed["main_state"] == "Z"
        wait_until(lambda: _gone(child) and _gone(helper), 10, what="the child and the helper "
                   "to be gone")
        assert daemon.poll() is None, "cgroup.kill reached the daemon's own cgroup"

        assert ask() == {"removed": True, "exists": False}
    finally:
        daemon.kill()
        daemon.wait(timeout=10)


def test_parsing_and_fallback(tmp_path: Path) -> None:
    hybrid = (
        "30 25 0:26 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"
        "35 25 0:31 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n"
    )
    unified = (
        "35 25 0:31 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n"
        "36 25 0:32 /x /sys/fs/cgroup rw shared:9 - cgroup2 cgroup2 rw,nsdelegate\n"
        "37 25 0:33 / /mnt/cg\\040v2 rw - cgroup2 none rw\n"
    )
    assert cgroup2_mount(hybrid) == (Path("/sys/fs/cgroup/unified"), "/")
    assert cgroup2_mount(unified) == (Path("/sys/fs/cgroup"), "/x")
    assert cgroup2_mount(unified.splitlines()[2]) == (Path("/mnt/cg v2"), "/")
    assert cgroup2_mount(hybrid.splitlines()[0]) is None
    assert own_cgroup("1:cpu:/\n0::/system.slice/rw.service\n") == "/system.slice/rw.service"
    assert own_cgroup("4:memory:/a\n") is None
    mount = Path("/sys/fs/cgroup")
    assert cgroup_dir(mount, "/", "/system.slice/a") == mount / "system.slice/a"
    assert cgroup_dir(mount, "/x", "/x/a") == mount / "a"
    assert cgroup_dir(mount, "/x", "/xy/a") is None

    assert mode_of(None) == MODE_SUBREAPER
    assert mode_of(CgroupManager(tmp_path, "o1")) == MODE_CGROUP
    assert not CgroupManager.populated(tmp_path / "gone")
    assert CgroupManager.pids(tmp_path / "gone") == []
    for name in ("engine-e0-1-t0-o1", "engine-a-b-12-t1-o1", "engine-e0-1-t0-o2", "daemon",
                 "other"):
        (tmp_path / name).mkdir()
    assert sorted(CgroupManager(tmp_path, "o1").existing()) == [
        tmp_path / "engine-a-b-12-t1-o1", tmp_path / "engine-e0-1-t0-o1"]
    for owner in ("", "a-b", "a/b"):
        with pytest.raises(ValueError, match="owner"):
            CgroupManager(tmp_path, owner)
    with pytest.raises(FileNotFoundError):
        CgroupManager.command(tmp_path, ["no-such-engine-binary"], {"PATH": "/usr/bin"})
    # Where the join fails (here: the cgroup is gone), the command must not run at all.
    marker = tmp_path / "ran"
    argv = CgroupManager.command(tmp_path / "gone", ["touch", str(marker)], None)
    result = subprocess.run(argv, capture_output=True, timeout=10)
    assert result.returncode == 125 and not marker.exists()
    argv = CgroupManager.command(tmp_path, ["touch", str(marker)], None)
    assert subprocess.run(argv, timeout=10).returncode == 0 and marker.exists()
