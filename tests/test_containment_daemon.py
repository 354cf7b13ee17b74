"""Nothing of an incarnation survives it: a helper that daemonizes (double fork plus setsid)
just before the engine's main process is SIGKILLed is gone before the relaunch, whether the
daemon launched the engine or adopted it, and whether a cgroup or the subreaper and the marker
keep it findable."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytest
from daemon_harness import EngineSpec, Node, pid_gone, wait_for

from rollout_watchdog.watchdog.containment import marker_prefix, parse_marker, read_marker

# An engine watched by liveness alone. On SIGUSR1 it leaves a helper behind: a double fork, the
# middle process in a new session exits at once, so the helper is nobody's descendant any more
# (as a leaked GPU worker would be). The helper writes its pid to the file named in argv[1].
ESCAPER = r"""
import os, signal, sys, time
out = sys.argv[1]
def escape(signum, frame):
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            with open(out + ".tmp", "w") as f:
                f.write(str(os.getpid()))
            os.rename(out + ".tmp", out)
            while True:
                signal.pause()
        os._exit(0)
    os.wait()
def fork_child(signum, frame):
    if os.fork() == 0:  # stays in the engine's group and session: a plain child
        with open(out + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.rename(out + ".tmp", out)
        while True:
            signal.pause()
signal.signal(signal.SIGUSR1, escape)
signal.signal(signal.SIGUSR2, fork_child)
open(out + f".ready.{os.getpid()}", "w").close()
while True:
    time.sleep(1)
"""
# No sweep in between: the helper is found only on the kill's own path.
SLOW_SWEEP = {"liveness_interval_s": 30.0, "health_path": ""}


def escaper(tmp: Path) -> EngineSpec:
    return EngineSpec("e0", command=[sys.executable, "-c", ESCAPER, str(tmp / "helper.pid")])


def escape_then_kill_main(node: Node, tmp: Path,
                          how: int = signal.SIGUSR1) -> tuple[int, int]:
    """Make the engine leave a helper (SIGUSR1: one that daemonized; SIGUSR2: a plain child),
    then SIGKILL its main process at once. The helper's pid and process group."""
    main = node.wait_state("e0", "healthy")["pid"]
    pid_file = tmp / "helper.pid"
    pid_file.unlink(missing_ok=True)
    wait_ready(tmp, main)
    os.kill(main, how)
    helper = int(wait_for(lambda: pid_file.exists() and pid_file.read_text(), 10,
                          "the helper to start"))
    group = os.getpgid(helper)
    assert read_marker(helper) is not None  # it carries its incarnation's marker
    os.kill(main, signal.SIGKILL)
    return helper, group


def signalled(event: dict[str, Any], pid: int, group: int) -> bool:
    """A signal_sent event that reached the process: by its pid, or by its group."""
    words = event["detail"].replace("[", " ").replace("]", " ").replace(",", " ").split()
    return str(pid) in words or f"group {group}" in event["detail"]


def wait_ready(tmp: Path, main: int) -> None:
    wait_for(lambda: (tmp / f"helper.pid.ready.{main}").exists(), 10,
             "the engine to be ready to escape")


def assert_gone_before_relaunch(node: Node, helper: int, group: int, incarnation: int) -> None:
    """The helper's signal is in the record before the next incarnation started, and the
    kill that relaunched the engine completed (every process it knew was gone)."""
    node.wait_state("e0", "healthy", incarnation=incarnation + 1)
    assert pid_gone(helper)
    events = node.events("e0")
    killed = next((i for i, e in enumerate(events) if e["kind"] == "signal_sent"
                   and e["incarnation"] == incarnation and signalled(e, helper, group)), None)
    started = next(i for i, e in enumerate(events) if e["kind"] == "state"
                   and e["to"] == "starting" and e["incarnation"] == incarnation + 1)
    assert killed is not None and killed < started, [
        (e["kind"], e["incarnation"], e["detail"]) for e in events]


def marked_processes(prefix: str) -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()
            and (read_marker(int(p)) or "").startswith(prefix)]


def test_a_helper_that_daemonizes_just_before_the_sigkill_is_gone_before_the_relaunch(
        make_node: Any, tmp_path: Path) -> None:
    node = make_node([escaper(tmp_path)], probe=SLOW_SWEEP).start()
    assert node.status()["containment"] == "subreaper"
    # this daemon's markers (node id and state dir): other tests' daemons are test-node too
    ours = parse_marker(read_marker(node.wait_state("e0", "healthy")["pid"]) or "")
    assert ours is not None
    helper, group = escape_then_kill_main(node, tmp_path)
    assert_gone_before_relaunch(node, helper, group, incarnation=1)
    # and the daemon's stop leaves no process of any incarnation behind
    again, _ = escape_then_kill_main(node, tmp_path)
    node.wait_state("e0", "healthy", incarnation=3)
    assert node.stop_daemon() == 0
    assert pid_gone(again)
    assert marked_processes(marker_prefix(ours.node_id)) == []


@pytest.mark.parametrize("how", [signal.SIGUSR1, signal.SIGUSR2],
                         ids=["daemonized-helper", "child-forked-before-the-exit"])
def test_the_same_after_the_daemon_restarted(make_node: Any, tmp_path: Path, how: int) -> None:
    """The daemon is SIGKILLed and restarted: it adopts the engine but is no longer its
    ancestor (nor does it hold its Popen): a helper that daemonized, or a plain child forked
    just before the main process died, re-parents elsewhere; its marker gives it away."""
    node = make_node([escaper(tmp_path)], probe=SLOW_SWEEP).start()
    node.wait_state("e0", "healthy")
    node.kill_daemon()
    node.start()
    node.wait_event("e0", kind="adopted")
    helper, group = escape_then_kill_main(node, tmp_path, how)
    assert_gone_before_relaunch(node, helper, group, incarnation=1)


@pytest.mark.parametrize("damage", ["lost", "truncated"])
def test_an_unrecorded_copy_is_adopted_not_duplicated(make_node: Any, damage: str) -> None:
    """The daemon dies between a launch and its state save (here: the state file is lost, or
    truncated by a full disk): the next daemon finds the running copy by its marker and adopts
    it, instead of running two (the old one answering the new one's probes, the new one dying
    of EADDRINUSE) or killing it (an earlier answer: a healthy engine's model loading lost,
    and its number handed out again; hostile run 5)."""
    node = make_node([EngineSpec("e0")]).start()
    old = node.wait_state("e0", "healthy")["pid"]
    node.kill_daemon()
    state = node.state_dir / "state.json"
    if damage == "lost":
        state.unlink()
    else:
        state.write_text(state.read_text()[:40])
    node.start()
    adopted = node.wait_state("e0", "healthy", timeout=60)
    assert (adopted["pid"], adopted["incarnation"]) == (old, 1) and not pid_gone(old)
    assert node.wait_event("e0", kind="adopted")
    assert not any(e["kind"] == "escapee_killed" for e in node.events("e0"))


def test_an_engine_adopted_by_its_marker_keeps_its_cgroup(make_node: Any,
                                                         test_cgroup: Path) -> None:
    """Under a delegated cgroup, an engine adopted by its marker (the state file lost) was
    taken for a left-over cgroup's and cgroup-killed at the first sweep (a review of the
    adoption): it keeps its incarnation's cgroup, and runs on."""
    node = make_node([EngineSpec("e0")], top={"containment": "cgroup"},
                     probe={"liveness_interval_s": 0.1})   # (a sweep each 0.1 s)
    wrap = ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', str(test_cgroup / "cgroup.procs")]
    node.start(wrap=wrap)
    old = node.wait_state("e0", "healthy")["pid"]
    node.kill_daemon()
    (node.state_dir / "state.json").unlink()
    owner = cgroup_of(old).rsplit("-", 1)[1]
    decoy = test_cgroup / f"engine-e9-1-decoy-{owner}"   # (an empty leftover: the sweep that
    decoy.mkdir()                                        # cleans leftovers removes it)
    node.start(wrap=wrap)
    node.wait_event("e0", kind="adopted")
    wait_for(lambda: not decoy.exists(), 30, "a sweep of leftover cgroups")
    assert not pid_gone(old), "the adopted engine was killed"
    assert node.wait_state("e0", "healthy", incarnation=1)["pid"] == old


def test_the_cgroup_takes_the_whole_incarnation(make_node: Any, tmp_path: Path,
                                                test_cgroup: Path) -> None:
    """Where a cgroup v2 is delegated (as systemd's Delegate=yes does), each incarnation runs
    in a cgroup of its own, killed with cgroup.kill and known empty from cgroup.events."""
    node = make_node([escaper(tmp_path)], probe=SLOW_SWEEP, top={"containment": "cgroup"})
    node.start(wrap=["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"',
                     str(test_cgroup / "cgroup.procs")])
    assert node.status()["containment"] == "cgroup"
    main = node.wait_state("e0", "healthy")["pid"]
    wait_ready(tmp_path, main)  # past the shim that joins the cgroup
    engine_cgroup = cgroup_of(main)
    assert engine_cgroup.startswith("engine-e0-1-")
    os.kill(main, signal.SIGUSR1)
    pid_file = tmp_path / "helper.pid"
    helper = int(wait_for(lambda: pid_file.exists() and pid_file.read_text(), 10,
                          "the helper to daemonize"))
    assert cgroup_of(helper) == engine_cgroup  # the kernel kept it in the incarnation's cgroup
    os.kill(main, signal.SIGKILL)
    again = node.wait_state("e0", "healthy", incarnation=2)
    assert pid_gone(helper)
    wait_ready(tmp_path, again["pid"])
    assert cgroup_of(again["pid"]).startswith("engine-e0-2-")
    wait_for(lambda: not (test_cgroup / engine_cgroup).exists(), 10,
             "the finished incarnation's cgroup to be removed")
    assert node.stop_daemon() == 0
    assert not [p for p in test_cgroup.iterdir() if p.name.startswith("engine-")]


def cgroup_of(pid: int) -> str:
    return Path(f"/proc/{pid}/cgroup").read_text().strip().rsplit("/", 1)[1]
