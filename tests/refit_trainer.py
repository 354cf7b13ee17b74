"""The refit tests' trainer: one `fleet.refit(version)` with the emulator model's weights built
from a seed, over gloo. `refit_outcome` runs it in the caller's process (`refit_harness.
run_trainer`); as a script, in a process of its own, for a trainer a test kills or stops. The
script prints one JSON line: the outcome (unless it is killed first).

    python tests/refit_trainer.py EP VERSION SEED [--hold | --stall | --gate-commit |
        --die-before CMD | --die-after CMD | --stop-before CMD] [--hold-after CMD,...]
        [--lease-s S]
        [--timeout-s S]

`--hold` takes the lock, prints {"token": N} and then waits to be killed (a trainer that dies
holding the lock). `--stall` goes further: its update has paused the members' generation and
opened their update sessions when it prints {"token": N, "paused": true} and waits to be
killed or stopped (a trainer that dies or stalls mid-refit). `--gate-commit` prints
{"updated": true} once its update went out whole and commits once a line comes on its stdin
(a trainer stopped just before its commit); `--die-before refit_commit` SIGKILLs itself just
before it sends that lock call, `--die-after` once it has its answer; `--stop-before` SIGSTOPs
itself there (a trainer stopped between its checks and its commit). `--hold-after`, with
`--gate-commit`: past the gate, once a call to the coordinator of one of those commands
ended, prints {"held_after": CMD} and goes on once a line comes on its stdin."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

from rollout_watchdog import EngineLost, FleetClient, RolloutWatchdogError
from rollout_watchdog.emulator.model import named_weights
from rollout_watchdog.refit_bridge.lock_holder import LockHolder
from rollout_watchdog.refit_bridge.refit import Refit


def stalled(token: object, seed: int) -> Iterator[tuple[str, Any]]:
    """Three tensors, then nothing: the update has paused generation, opened the session and
    broadcast the first tensor when it asks for the fourth (it looks two ahead)."""
    yield from list(named_weights(seed))[:3]
    print(json.dumps({"token": token, "paused": True}), flush=True)
    while True:
        time.sleep(1)


def refit_outcome(fleet: FleetClient, version: str, seed: int, lease_s: float = 30.0,
                  timeout_s: float = 120.0, before: Callable[[Refit], None] | None = None,
                  after: Callable[[Refit], None] | None = None) -> dict[str, Any]:
    """One `fleet.refit(version)` with the seed's weights, as a trainer runs it: the outcome.
    `before(refit)` runs inside the refit, before the update (--hold, --stall); `after(refit)`
    after it (--gate-commit)."""
    try:
        with fleet.refit(version, lease_s=lease_s, timeout_s=timeout_s, backend="gloo") as refit:
            if before is not None:
                before(refit)
            refit.update_weights(named_weights(seed))
            if after is not None:
                after(refit)
            members = [e.name for e in refit.engines]
    except EngineLost as exc:
        return {"error": "EngineLost", "lost": exc.lost, "message": str(exc)}
    except RolloutWatchdogError as exc:
        return {"error": type(exc).__name__, "message": str(exc)}
    return {"ok": True, "members": members}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("coordinator")
    parser.add_argument("version")
    parser.add_argument("seed", type=int)
    parser.add_argument("--hold", action="store_true")
    parser.add_argument("--stall", action="store_true")
    parser.add_argument("--gate-commit", action="store_true")
    parser.add_argument("--die-before", metavar="CMD")
    parser.add_argument("--die-after", metavar="CMD")
    parser.add_argument("--stop-before", metavar="CMD")
    parser.add_argument("--hold-after", metavar="CMD,...", default="")
    parser.add_argument("--lease-s", type=float, default=30.0)
    parser.add_argument("--timeout-s", type=float, default=120.0)
    args = parser.parse_args()

    def hold(refit: Refit) -> None:
        print(json.dumps({"token": refit.token}), flush=True)
        while True:
            time.sleep(1)

    def stall(refit: Refit) -> None:   # one tensor a bucket: the first is broadcast first
        refit.update_weights(stalled(refit.token, args.seed), bucket_bytes=1)

    gated = []

    def gate(refit: Refit) -> None:
        print(json.dumps({"updated": True}), flush=True)
        sys.stdin.readline()
        gated.append(True)

    if args.hold_after:
        client_call = FleetClient.call

        def holding(client: FleetClient, cmd: str, *rest: Any, **kwargs: Any) -> tuple[str, Any]:
            try:
                return client_call(client, cmd, *rest, **kwargs)
            finally:
                if gated and cmd in args.hold_after.split(","):
                    print(json.dumps({"held_after": cmd}), flush=True)
                    sys.stdin.readline()

        FleetClient.call = holding  # type: ignore[method-assign]

    if args.die_before or args.die_after or args.stop_before:
        call = LockHolder.call

        def dying(holder: LockHolder, cmd: str, *rest: Any, **kwargs: Any) -> dict[str, Any]:
            if cmd == args.die_before:
                os.kill(os.getpid(), signal.SIGKILL)
            if cmd == args.stop_before:
                os.kill(os.getpid(), signal.SIGSTOP)
            answer = call(holder, cmd, *rest, **kwargs)
            if cmd == args.die_after:
                os.kill(os.getpid(), signal.SIGKILL)
            return answer

        LockHolder.call = dying  # type: ignore[method-assign,assignment]

    before = hold if args.hold else stall if args.stall else None
    outcome = refit_outcome(FleetClient(args.coordinator), args.version, args.seed,
                            args.lease_s, args.timeout_s, before,
                            gate if args.gate_commit else None)
    print(json.dumps(outcome))
    return 0 if outcome.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main())
