"""The standalone coordinator's collector settings (common/gc_tuning.py), in a process of their
own: start-up's objects frozen out of collections, young passes after GEN0_THRESHOLD."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_a_service_process_freezes_start_up_and_collects_young_objects_less_often() -> None:
    script = ("import gc\n"
              "from rollout_watchdog.common.gc_tuning import GEN0_THRESHOLD, tune_for_service\n"
              "before = gc.get_threshold()\n"
              "tune_for_service()\n"
              "print(before[0], gc.get_threshold() == (GEN0_THRESHOLD, *before[1:]),"
              " gc.get_freeze_count() > 1000)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)}, check=True)
    assert out.stdout.split() == ["700", "True", "True"], out
