"""`rollout-watchdog launch` and `remove`: engines added to a node daemon, and taken away, at run
time (DESIGN.md, "Runtime engines"): on the local daemon through its control socket, or on a
node of the fleet with --coordinator."""

from __future__ import annotations

import argparse
import time
from typing import TYPE_CHECKING, Any

from rollout_watchdog.cli.client import ControlClient, ControlError
from rollout_watchdog.cli.render import result_line
from rollout_watchdog.common.spec import EngineSpec
from rollout_watchdog.config import toml_value

if TYPE_CHECKING:
    from rollout_watchdog.refit_bridge.client import FleetClient

EXIT_OK = 0
POLL_S = 0.2


def _gpus(text: str) -> list[int]:
    """--gpus 0,1 (argparse type)."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts or not all(p.isdigit() for p in parts):
        raise argparse.ArgumentTypeError(f"must be GPU indices separated by commas, like 0,1, "
                                         f"got {text!r}")
    return [int(p) for p in parts]


def _env(text: str) -> tuple[str, str]:
    """--env K=V (argparse type)."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"must be NAME=VALUE, got {text!r}")
    return key, value


def _setting(text: str) -> tuple[str, Any]:
    """--probe/--restart KEY=VALUE (argparse type): VALUE as a TOML value where it is one
    (2, 0.5, true), else the text itself (/health); the node checks it as the config's
    `[engine.probe]`/`[engine.restart]` key and names what is wrong."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"must be KEY=VALUE, got {text!r}")
    return key.strip(), toml_value(value)


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}")
    return int(text)


def add_launch_options(p: argparse.ArgumentParser, seconds: Any) -> None:
    p.add_argument("engine", help="an id for the engine (NODE/ENGINE with --coordinator)")
    p.add_argument("--url", required=True, help="the engine's HTTP address (probed, routed)")
    p.add_argument("--gpus", type=_gpus, default=[], metavar="0,1",
                   help="its GPUs: CUDA_VISIBLE_DEVICES, and checked free before a relaunch")
    p.add_argument("--env", type=_env, action="append", default=[], metavar="K=V",
                   help="an environment variable of the engine (repeat for more)")
    p.add_argument("--tp-size", type=_positive, metavar="N",
                   help="its ranks in the weight-update group (default: its /server_info)")
    p.add_argument("--restart-policy", choices=("immediate", "deferred"), default="immediate",
                   help="relaunch after the backoff (immediate, default) or when told "
                        "(deferred: colocated with the trainer)")
    p.add_argument("--probe", type=_setting, action="append", default=[], metavar="K=V",
                   help="a [probe] setting for this engine only, like health_interval_s=2 "
                        "(repeat for more; the node's [probe] gives the rest)")
    p.add_argument("--restart", type=_setting, action="append", default=[], metavar="K=V",
                   help="a [restart] setting for this engine only, like max_restarts=3 "
                        "(repeat for more)")
    p.add_argument("--wait", type=seconds, metavar="S",
                   help="return once the engine is healthy; fail after S seconds")
    p.usage = ("%(prog)s ENGINE --url URL [--gpus 0,1] [--env K=V]... [--tp-size N] "
               "[--restart-policy P] [--probe K=V]... [--restart K=V]... [--wait S] "
               "[--control EP | --coordinator EP [--key FILE --coordinator-key FILE] "
               "[--node NODE]] [--timeout S] -- COMMAND...")
    p.epilog = "COMMAND: the engine's command line (its argv), after --."


def add_remove_options(p: argparse.ArgumentParser, seconds: Any) -> None:
    p.add_argument("engine", help="engine id (NODE/ENGINE with --coordinator)")
    p.add_argument("--wait", type=seconds, metavar="S",
                   help="return once the engine is stopped and forgotten; fail after S seconds "
                        "(at most 600)")


def take_command(args: argparse.Namespace, rest: list[str]) -> str | None:
    """Keep the engine's argv (what follows `--`) in `args.argv`; the problem, if any."""
    if rest and rest[0] != "--":
        return f"unrecognized arguments: {' '.join(rest)} (the engine's command goes after --)"
    args.argv = rest[1:]
    return None


def _spec(args: argparse.Namespace, engine_id: str) -> EngineSpec:
    argv = args.argv
    if not argv:
        raise ControlError("give the engine's command after --, like: launch e0 --url "
                           "http://127.0.0.1:30000 -- python -m sglang.launch_server ...")
    return EngineSpec(engine_id, args.url, argv, gpus=args.gpus, env=dict(args.env) or None,
                      tp_size=args.tp_size, restart_policy=args.restart_policy,
                      probe=dict(args.probe) or None, restart=dict(args.restart) or None)


def cmd_launch(args: argparse.Namespace) -> int:
    """On the local daemon: launch, then (with --wait) poll its status until healthy."""
    client = ControlClient(args.control, timeout_s=args.timeout)
    result = client.call("launch", {"spec": _spec(args, args.engine).to_table()})
    print(result_line(result))
    if args.wait is not None:
        first = max(1, int(result["status"].get("incarnation") or 0))
        deadline = time.monotonic() + args.wait
        last: dict[str, Any] = {}
        while time.monotonic() < deadline:
            found = [e for e in client.call("status")["engines"] if e["id"] == args.engine]
            last = found[0] if found else {}
            if last.get("state") == "healthy" and last.get("incarnation", 0) >= first:
                print(f"{args.engine}: healthy, incarnation {last['incarnation']}")
                return EXIT_OK
            time.sleep(POLL_S)
        raise ControlError(f"engine {args.engine} was not healthy within {args.wait:g} s "
                           f"(it is {last.get('state', 'gone')})")
    return EXIT_OK


def fleet_launch(client: FleetClient, args: argparse.Namespace) -> int:
    from rollout_watchdog.refit_bridge.client import split_target

    node, engine = split_target(args.engine, args.node)
    assert node is not None and engine is not None
    view = client.launch(node, _spec(args, engine), wait_s=args.wait)
    print(f"{view.name}: launched, {view.state}, incarnation {view.incarnation}")
    return EXIT_OK


def cmd_remove(args: argparse.Namespace) -> int:
    request: dict[str, Any] = {"engine": args.engine}
    if args.wait is not None:
        request["wait_s"] = args.wait
    client = ControlClient(args.control, timeout_s=args.timeout)
    print(result_line(client.call("remove", request,
                                  timeout_s=args.timeout + (args.wait or 0.0))))
    return EXIT_OK


def fleet_remove(client: FleetClient, args: argparse.Namespace) -> int:
    result = client.remove(args.engine, node=args.node, wait_s=args.wait)
    for node, reply in sorted(result.nodes.items()):
        print(f"{node}: {result_line(reply.result)}")
    return EXIT_OK
