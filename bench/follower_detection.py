"""Follower detection: how soon `rollout-watchdog events` notices that its daemon is gone.

Measured per repetition: the time from just before kill(2) of the daemon to the follower's line
"waiting for the daemon: ..." on its stderr (read by a thread here, stamped on arrival), which
also names how it noticed: the connection closing (a SIGKILLed daemon) or the silence (a
SIGSTOPped one, `--fault sigstop`: after the follower's --timeout + --poll). After each
SIGKILL a new daemon starts on the same control socket (adopting the engine); the follower must
print its events (shown: new daemon answering -> its events printed), and at the end it must
have printed every event of every boot, each once. Goal (issue 13): SIGKILL noticed in a median
<= 1 s (it was --timeout + the long poll's wait, 5 + 5 s, before the socket monitor).

Settings: one emulator engine (its adoption is each new daemon's first event); the follower at
its defaults unless --timeout / --poll say otherwise.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import threading
import time
from functools import partial
from typing import IO

from _common import Fleet, bench_main, engines, goal, parse_args, step, summary, wait_for

PROBE = {"liveness_interval_s": 1.0, "health_interval_s": 0.5, "health_timeout_s": 5.0,
         "failure_threshold": 3, "startup_timeout_s": 120.0}
RESTART = {"grace_s": 5.0, "backoff_initial_s": 0.0, "backoff_max_s": 0.0, "max_restarts": 1000,
           "window_s": 600.0, "kill_timeout_s": 10.0, "release_timeout_s": 30.0}
HEALTHY_DEADLINE_S = 120.0
GONE, SILENT = "closed the connection", "no answer from the daemon"


class Lines:
    """The lines of a pipe, each with the monotonic time it was read (a reader thread)."""

    def __init__(self, pipe: IO[str] | None) -> None:
        self.lines: list[tuple[float, str]] = []
        self._thread = threading.Thread(target=self._read, args=(pipe,), daemon=True)
        self._thread.start()

    def _read(self, pipe: IO[str] | None) -> None:
        for line in pipe or ():
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def first(self, index: int) -> tuple[float, str] | None:
        """The line at `index` (with its time), once it was read."""
        return self.lines[index] if len(self.lines) > index else None


def main(args: argparse.Namespace) -> int:
    detection: list[float] = []
    caught_up: list[float] = []
    paths: dict[str, int] = {}
    kill = signal.SIGKILL if args.fault == "sigkill" else signal.SIGSTOP
    options = ["--timeout", f"{args.timeout:g}", "--poll", f"{args.poll:g}"]
    print(f"setup: 1 emulator engine, {args.repeat} {args.fault.upper()}(s) of the daemon under "
          f"`events --json {' '.join(options)}`, probe {PROBE}")
    with Fleet("follower", engines(1), probe=PROBE, restart=RESTART, keep=args.keep) as fleet:
        node = fleet.node
        with step("first boot"):
            fleet.wait_all_healthy(HEALTHY_DEADLINE_S)
        follower = subprocess.Popen(
            [sys.executable, "-m", "rollout_watchdog", "events", "--json", "--control",
             node.control, *options], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            out, err = Lines(follower.stdout), Lines(follower.stderr)
            expected: list[dict[str, object]] = []

            def printed() -> list[dict[str, object]]:
                return [json.loads(line) for _, line in out.lines]

            def catch_up(what: str) -> None:
                """Until the follower printed every event so far of every boot, each once."""
                wait_for(lambda: printed() == expected + node.events(), 30, what, interval=0.01)

            catch_up("the follower to print the first boot's events")
            for i in range(args.repeat):
                if kill == signal.SIGKILL:  # this boot's events, all printed (caught up)
                    expected = printed()
                mark = len(err.lines)
                killed = time.monotonic()
                assert node.proc is not None
                node.proc.send_signal(kill)
                try:
                    seen, line = wait_for(partial(err.first, mark),
                                          args.timeout + args.poll + 30, "the follower to "
                                          "notice", interval=0.001)
                finally:
                    if kill == signal.SIGSTOP:
                        node.proc.send_signal(signal.SIGCONT)
                detection.append((seen - killed) * 1000)
                path = "disconnect" if GONE in line else "silence" if SILENT in line else line
                paths[path] = paths.get(path, 0) + 1
                if kill == signal.SIGKILL:
                    node.proc.wait(timeout=10)
                    node.start()
                    up = time.monotonic()
                    catch_up("the follower to print the new daemon's events")
                    caught_up.append((time.monotonic() - up) * 1000)
                else:
                    fleet.call("pause", {"engine": "e0", "deadline_s": 60})  # an event after
                    catch_up("the follower to go on once the daemon runs again")
                print(f"  rep {i + 1:>2}: noticed after {detection[-1]:8.2f} ms by the {path}"
                      + (f"; new daemon's events printed {caught_up[-1]:.0f} ms after it "
                         "answered" if caught_up else ""), flush=True)
            doubled = len(out.lines) - len({line for _, line in out.lines})
        finally:
            follower.kill()
            follower.wait(timeout=10)

    print(f"\nresults: {args.fault.upper()} of the daemon -> the follower's 'waiting for the "
          "daemon' line")
    s = summary(f"{args.fault} -> noticed", detection, "ms", digits=2)
    if caught_up:
        summary("  new daemon answering -> its events printed", caught_up, "ms", digits=0)
    print(f"    noticed by: {', '.join(f'{k} x{v}' for k, v in sorted(paths.items()))}; "
          f"{len(out.lines)} event(s) printed, {doubled} doubled")
    ok = goal("no event printed twice, none lost", doubled == 0)
    if kill == signal.SIGKILL:
        ok &= goal("every SIGKILL noticed by the disconnect", paths == {"disconnect":
                                                                     args.repeat})
        ok &= goal("median <= 1 s", s.median <= 1000)
    return 0 if ok else 2


def _options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--fault", choices=("sigkill", "sigstop"), default="sigkill",
                        help="sigkill (default): the disconnect path; sigstop: the silence path")
    parser.add_argument("--timeout", type=float, default=5.0,
                        help="the follower's --timeout (default 5)")
    parser.add_argument("--poll", type=float, default=5.0, help="the follower's --poll "
                        "(default 5)")


if __name__ == "__main__":
    bench_main(main, parse_args(__doc__ or "", repeat=10, quick_repeat=2, time_limit=600,
                                extra=_options))
