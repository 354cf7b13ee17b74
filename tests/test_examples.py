"""The files in examples/ work as shipped (issue 13 §4.3, §4.4): the emulator node config passes
`check-config`, and the training loop runs to its end against emulators and the real router."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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
