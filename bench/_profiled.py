"""Run a command's Python module under cProfile, switched on and off by signals: the profile of
one phase of a long-lived process (bench/fleet_scale.py --profile: the coordinator's pauses).

    python bench/_profiled.py OUT.prof -- python -m MODULE ARGS...

SIGUSR1 starts (or continues) profiling the main thread; SIGUSR2 stops it and writes the stats
gathered so far to OUT.prof (pstats format), so a process later SIGKILLed still leaves them.
"""

from __future__ import annotations

import cProfile
import runpy
import signal
import sys
from types import FrameType


def main() -> None:
    out, sep, *command = sys.argv[1:]
    if sep != "--" or len(command) < 3 or command[1] != "-m":
        raise SystemExit("usage: _profiled.py OUT.prof -- python -m MODULE [ARGS...]")
    profile = cProfile.Profile()

    def start(signum: int, frame: FrameType | None) -> None:
        profile.enable()

    def stop(signum: int, frame: FrameType | None) -> None:
        profile.disable()
        profile.dump_stats(out)

    signal.signal(signal.SIGUSR1, start)
    signal.signal(signal.SIGUSR2, stop)
    sys.argv = [command[2], *command[3:]]
    runpy.run_module(command[2], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
