"""The README's first command: the demo runs end to end and tells its story."""

from __future__ import annotations

import subprocess
import sys


def test_demo_injects_detects_and_recovers() -> None:
    out = subprocess.run([sys.executable, "-m", "rollout_watchdog", "demo"], capture_output=True,
                         text=True, timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout
    assert "e0#1     healthy -> stopping [exited]" in text
    assert "e0#2     starting -> healthy" in text
    assert "e1#1     suspect -> stopping [probe_failed]" in text
    assert "e1#2     starting -> healthy" in text
    assert "crash detected" in text and "daemon exit code 0" in text
