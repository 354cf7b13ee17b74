"""The files in examples/ work as shipped (issue 13 §4.3, §4.4): the emulator node config passes
`check-config`, and the training loop runs to its end against emulators and the real router."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"


def test_the_emulator_node_config_passes_check_config() -> None:
    # As a user runs it: from a shell whose `python` has rollout-watchdog (an activated venv).
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}"
           f"{os.environ.get('PATH', '')}"}
    done = subprocess.run([sys.executable, "-m", "rollout_watchdog", "check-config",
                           str(EXAMPLES / "emulator-node.toml")],
                          capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    assert "OK, node emu-node-0, 2 engine(s): e0, e1" in done.stdout


def quoted_loop() -> str:
    """The lines of examples/train_loop.py between its `--8<--` markers, dedented."""
    lines = (EXAMPLES / "train_loop.py").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if "--8<-- [start:loop]" in line)
    end = next(i for i, line in enumerate(lines) if "--8<-- [end:loop]" in line)
    return textwrap.dedent("\n".join(lines[start + 1:end]))


def test_the_guide_quotes_the_example_loop() -> None:
    assert quoted_loop() in (REPO / "docs" / "refit.md").read_text()


def test_the_example_training_loop_runs_to_its_end() -> None:
    """Coordinator, real router, 2 nodes x 2 emulators, 3 steps of generate / train / refit,
    an engine SIGKILLed during the generation of step 2 and brought back by a refit (3 steps,
    not the default 5: a clean step, the faulty one, and one after it show all of it)."""
    pytest.importorskip("sglang_router")
    pytest.importorskip("torch")
    done = subprocess.run([sys.executable, str(EXAMPLES / "train_loop.py"), "--steps", "3"],
                          capture_output=True, text=True, timeout=480, cwd=REPO)
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    out = done.stdout
    assert "fleet up:" in out
    killed = re.search(r"SIGKILL to (node-[ab]/e[01]) \(pid \d+\) during generation", out)
    assert killed, out
    for step in range(1, 4):
        assert f"step {step}: 8 rollouts at ['{step - 1 if step > 1 else 'default'}']" in out, \
            out
    assert "done: 3 steps;" in out and "the router lists 4 engines; every rollout at version " \
        "3" in out, out
    # The relaunched incarnation got the last weights.
    assert re.search(rf"{killed[1]}#([2-9]|\d\d+) at 3\b", out), out
    assert "Failed to initialize NumPy" not in done.stderr   # numpy comes with the torch extras


def test_the_ray_grpo_loop_runs_under_churn_with_no_stale_response() -> None:
    """`bash scripts/demo.sh --ray`: a 3-node Ray cluster, 6 engines launched from a placement
    group, the router, a trainer actor refitting through its pickled client; an engine
    SIGKILLed, a watchdog actor ray.kill'ed, a Ray node removed, another engine SIGKILLed: one
    clean step, then one step per fault (5 steps, not the default 9)."""
    pytest.importorskip("ray")
    pytest.importorskip("sglang_router")
    done = subprocess.run([sys.executable, str(EXAMPLES / "ray_grpo.py"), "--clean-steps", "1",
                           "--steps", "4"],
                          capture_output=True, text=True, timeout=600, cwd=REPO)
    out = done.stdout
    assert done.returncode == 0, f"{out[-3000:]}\n---- stderr\n{done.stderr[-3000:]}"
    assert len(re.findall(r"launched \w{8}/e\d on node", out)) == 6, out
    for fault in (r"churn: SIGKILL to engine \w{8}/e\d", r"churn: ray\.kill of watchdog actor",
                  r"churn: Ray node \w{8} removed"):
        assert re.search(fault, out), (fault, out)
    assert "steps completed: 5, failed steps: 0, rollouts served: 60, " \
           "stale-weight responses: 0" in out, out
    assert "engines serving at the end: 4 of the 4 on live nodes" in out, out
    assert "shutdown: engines removed, daemons and coordinator stopped" in out
