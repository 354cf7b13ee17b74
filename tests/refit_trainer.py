"""A trainer process for the refit tests: one `fleet.refit(version)` with the emulator model's
weights built from a seed, over gloo. Prints one JSON line: the outcome.

    python tests/refit_trainer.py EP VERSION SEED [--hold | --stall] [--lease-s S] [--timeout-s S]

`--hold` takes the lock, prints {"token": N} and then waits to be killed (a trainer that dies
holding the lock). `--stall` goes further: its update has paused the members' generation and
opened their update sessions when it prints {"token": N, "paused": true} and waits to be
killed or stopped (a trainer that dies or stalls mid-refit)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator
from typing import Any

from rollout_watchdog import EngineLost, FleetClient, RolloutWatchdogError
from rollout_watchdog.emulator.model import named_weights


def stalled(token: object, seed: int) -> Iterator[tuple[str, Any]]:
    """Three tensors, then nothing: the update has paused generation, opened the session and
    broadcast the first tensor when it asks for the fourth (it looks two ahead)."""
    yield from list(named_weights(seed))[:3]
    print(json.dumps({"token": token, "paused": True}), flush=True)
    while True:
        time.sleep(1)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("coordinator")
    parser.add_argument("version")
    parser.add_argument("seed", type=int)
    parser.add_argument("--hold", action="store_true")
    parser.add_argument("--stall", action="store_true")
    parser.add_argument("--lease-s", type=float, default=30.0)
    parser.add_argument("--timeout-s", type=float, default=120.0)
    args = parser.parse_args()
    fleet = FleetClient(args.coordinator)
    try:
        with fleet.refit(args.version, lease_s=args.lease_s, timeout_s=args.timeout_s,
                         backend="gloo") as refit:
            if args.hold:
                print(json.dumps({"token": refit.token}), flush=True)
                while True:
                    time.sleep(1)
            if args.stall:   # one tensor a bucket: the first is broadcast before the stall
                refit.update_weights(stalled(refit.token, args.seed), bucket_bytes=1)
            refit.update_weights(named_weights(args.seed))
            members = [e.name for e in refit.engines]
    except EngineLost as exc:
        print(json.dumps({"error": "EngineLost", "lost": exc.lost, "message": str(exc)}))
        return 1
    except RolloutWatchdogError as exc:
        print(json.dumps({"error": type(exc).__name__, "message": str(exc)}))
        return 1
    print(json.dumps({"ok": True, "members": members}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
