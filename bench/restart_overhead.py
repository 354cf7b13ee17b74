"""Restart overhead: from the daemon declaring a failure to the replacement process spawned.

Measured per repetition, from the daemon's own events: `ts` of `state -> stopping` (the
detection) to `ts` of `state -> starting` of the next incarnation (emitted once the new process
is spawned; its detail says `pid N`), split into the kill/verify part (stopping -> backoff:
processes gone, ports bindable) and the spawn part (backoff -> starting). Engine boot is
excluded. (A pid's create_time is no cross-check here: psutil derives it from the boot time,
which /proc gives in whole seconds.)

The fault is a SIGKILL of the engine's main process, so nothing needs the grace period: grace_s
stays at its default (30 s) to show it is not waited out; backoff_initial_s = 0 so the backoff
is not counted (the config accepts 0). Goal (issue 2): <= 300 ms.
"""

from __future__ import annotations

import argparse

from _common import Fleet, bench_main, engines, goal, kill_and_follow, parse_args, step, summary

PROBE = {"liveness_interval_s": 1.0, "health_interval_s": 0.2, "health_timeout_s": 5.0,
         "failure_threshold": 3, "startup_timeout_s": 120.0}
RESTART = {"grace_s": 30.0, "backoff_initial_s": 0.0, "backoff_max_s": 60.0,
           "max_restarts": 1000, "window_s": 600.0, "kill_timeout_s": 10.0,
           "release_timeout_s": 60.0}
HEALTHY_DEADLINE_S = 120.0


def main(args: argparse.Namespace) -> int:
    total: list[float] = []
    kill_part: list[float] = []
    spawn_part: list[float] = []
    print(f"setup: 1 emulator engine, {args.repeat} SIGKILL(s) of its main process, "
          f"probe {PROBE}, restart {RESTART}")
    with Fleet("restart", engines(1), probe=PROBE, restart=RESTART, keep=args.keep) as fleet:
        with step("first boot"):
            fleet.wait_all_healthy(HEALTHY_DEADLINE_S)
        for i in range(args.repeat):
            record = kill_and_follow(fleet, "e0", "main")
            nxt = record.incarnation + 1
            starting = fleet.events.wait(10.0, engine="e0", kind="state", to="starting",
                                         incarnation=nxt)
            backoff = fleet.events.wait(1.0, engine="e0", kind="state", to="backoff",
                                        incarnation=record.incarnation)
            t0 = record.stopping["ts"]
            total.append((starting["ts"] - t0) * 1000)
            kill_part.append((backoff["ts"] - t0) * 1000)
            spawn_part.append((starting["ts"] - backoff["ts"]) * 1000)
            print(f"  rep {i + 1:>2}: detection -> new process {total[-1]:7.2f} ms "
                  f"(kill+verify {kill_part[-1]:.2f}, spawn {spawn_part[-1]:.2f}; "
                  f"{starting['detail']})", flush=True)
            fleet.wait_all_healthy(HEALTHY_DEADLINE_S)

    print("\nresults: event to 'stopping' -> event to 'starting' of the next incarnation")
    s = summary("detection -> new process spawned", total, "ms", digits=2)
    summary("  kill + verify (stopping -> backoff)", kill_part, "ms", digits=2)
    summary("  spawn (backoff -> starting)", spawn_part, "ms", digits=2)
    ok = goal("<= 300 ms (every repetition)", s.max <= 300)
    return 0 if ok else 2


if __name__ == "__main__":
    bench_main(main, parse_args(__doc__ or "", repeat=20, quick_repeat=5, time_limit=600))
