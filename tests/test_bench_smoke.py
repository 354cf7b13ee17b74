"""The fleet benchmark runs end to end at a small scale: every phase prints its figure and the
run cleans up. Its goals are not asserted here (throughput at a few thousand events offered
says nothing); exit status 2 means a goal was missed, 1 an error."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def bench(script: str, *args: str, timeout: float) -> tuple[int, str]:
    """Run bench/`script` with `args` as a user would; its exit status and its output."""
    run = subprocess.run([sys.executable, str(REPO / "bench" / script), *args],
                         capture_output=True, text=True, timeout=timeout,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    return run.returncode, run.stdout + run.stderr


def test_fleet_scale_quick_runs_every_phase() -> None:
    rc, out = bench("fleet_scale.py", "--quick", "--nodes", "12", "--engines", "2", "--workers",
                    "2", "--pin", "--time-limit", "120", timeout=180)
    assert rc in (0, 2), out
    for figure in ("pushed (node -> coordinator -> subscriber)", "polling every node's status",
                   "pause, every node acknowledged", "into the coordinator",
                   "out to one subscriber", "kill -> client", "every engine listed",
                   "peak RSS", "0 dropped from outboxes, 0 bad messages",
                   "pinned: the coordinator on CPU",
                   "the coordinator's CPU per pause net of its idle rate is"):
        assert figure in out, f"{figure!r} missing:\n{out}"


def test_the_benches_p99_is_the_nearest_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """p99 of 100 round trips is the second longest, not the longest (one slow outlier in a
    hundred is what p99 allows); of 20, the longest."""
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    from _common import percentile

    assert percentile([float(v) for v in range(100, 0, -1)], 99) == 99.0
    assert percentile([float(v) for v in range(1, 21)], 99) == 20.0
    assert percentile([7.0], 99) == percentile([7.0], 50) == 7.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.0


def test_follower_detection_quick_runs() -> None:
    """Each SIGKILLed daemon is noticed by the disconnect, and every event printed once; the
    median's goal is not asserted (a loaded machine's figure)."""
    rc, out = bench("follower_detection.py", "--quick", "--time-limit", "150", timeout=200)
    assert rc in (0, 2), out
    assert "noticed by: disconnect x2;" in out and " 0 doubled" in out, out


def test_ray_start_quick_runs() -> None:
    """The fleet starts on a 3-node Ray cluster, every watchdog reachable, and engine kills
    reach the client; the latency goal is not asserted (a loaded machine's figure)."""
    # (its own waits are bounded: engines healthy within 180 s, each kill's event within 10 s;
    # the limit only stops a hang. Beside the heavy pass's other Ray clusters, at a load of 17,
    # a run went past 150 s after its start() took 7.8 s; alone it takes ~25 s.)
    rc, out = bench("ray_start.py", "--quick", "--time-limit", "420", timeout=480)
    assert rc in (0, 2), out
    assert "start() -> every watchdog reachable, 3 nodes" in out, out
    assert "engine SIGKILL -> client event, 3 nodes" in out and "(n=3)" in out, out


def test_transport_floor_runs_each_variant() -> None:
    """The transport's floor of a pause prints a figure for each variant, on a few DEALERs."""
    rc, out = bench("transport_floor.py", "--nodes", "20", "--rounds", "2", "--repeat", "1",
                    timeout=120)
    assert rc == 0, out
    for variant in ("two messages ", "one message (a turn)", "two messages, with an ACK"):
        assert f"  {variant}" in out and "libzmq's I/O thread" in out, out


def test_pause_wire_measures_both_ways_of_answering() -> None:
    """The coordinator's CPU per pause over real sockets prints a figure for nodes that send
    their run and reply as one frame of lines and as a frame each, on a few nodes, every answer
    made before its command came (so that they come at once, as a fleet's do)."""
    rc, out = bench("pause_wire.py", "--nodes", "20", "--engines", "2", "--repeat", "2",
                    timeout=120)
    assert rc == 0, out
    for mode in ("lines ", "separate "):
        assert f"  {mode}" in out and "main thread" in out and "round trip" in out, out
        assert ", p99 " in out, out
    assert "lines / separate: x" in out, out
    # 2 ways x 3 rounds (one warms up) x a pause and a resume x 20 nodes
    assert "answers made beforehand: 240, on the spot: 0" in out, out


def test_pause_wire_can_build_each_answer_when_its_command_comes() -> None:
    rc, out = bench("pause_wire.py", "--nodes", "20", "--engines", "2", "--repeat", "1",
                    "--modes", "lines", "--built-answers", timeout=120)
    assert rc == 0, out
    assert "answers made beforehand: 0, on the spot: 80" in out, out


def test_suite_cpu_counts_a_detached_daemon_and_keeps_the_exit_status(tmp_path: Path) -> None:
    """A process that double-forks away from the command (as a daemon or a raylet does) is
    still counted, under its kind, and the command's exit status is suite_cpu's. (The command
    waits for the detached process's marker, not for a time: a loaded machine may give it its
    0.5 s of CPU late.)"""
    done = tmp_path / "burnt"
    burn = ("import os, sys, time\nif os.fork(): os._exit(0)\nt = time.process_time()\n"
            "while time.process_time() - t < 0.5: pass\nopen(sys.argv[1], 'w').close()\n")
    rc, out = bench("suite_cpu.py", "--interval", "0.1", "--", "bash", "-c",
                    f"{sys.executable} -c \"{burn}\" {done}; "
                    f"for _ in $(seq 500); do [ -e {done} ] && exit 3; sleep 0.1; done; exit 1",
                    timeout=90)
    assert rc == 3, out
    line = next(x for x in out.splitlines() if x.endswith("processes  other"))
    assert float(line.split()[0]) >= 0.4, out
