"""The fleet side of the command line: the control commands with `--coordinator` (DESIGN.md,
"Fleet (driver side)"), through `FleetClient`, and the `coordinator` command itself."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from rollout_watchdog.cli.client import ControlError
from rollout_watchdog.cli.render import event_line, fleet_table, result_line
from rollout_watchdog.refit_bridge.durable import STATE_WRITE_TIMEOUT_S
from rollout_watchdog.refit_bridge.lock import HOLDER_TIMEOUT_S

if TYPE_CHECKING:
    from rollout_watchdog.refit_bridge.client import FleetClient
    from rollout_watchdog.refit_bridge.views import FleetResult

Command = Callable[[argparse.Namespace], int]
FleetCommand = Callable[["FleetClient", argparse.Namespace], int]
EXIT_OK, EXIT_ERROR = 0, 1
FLEET_COMMANDS = ("status", "events", "pause", "resume", "restart", "stop", "reset", "launch",
                  "remove")


def add_options(parser: argparse.ArgumentParser, exclusive: argparse._ActionsContainer) -> None:
    """--coordinator (in `exclusive`, beside --control) and the options that go with it."""
    exclusive.add_argument("--coordinator", metavar="ENDPOINT",
                           help="act on the fleet through this coordinator, not the local daemon")
    parser.add_argument("--key", metavar="FILE",
                        help="with --coordinator, for CURVE: this client's NAME.key_secret")
    parser.add_argument("--coordinator-key", metavar="FILE",
                        help="with --coordinator, for CURVE: the coordinator's public .key")
    parser.add_argument("--node", help="with --coordinator: only this node's engines")


def either(name: str, local: Command, remote: FleetCommand | None = None) -> Command:
    """The command `name`: on the fleet with --coordinator (`remote`, default this module's),
    else `local` (the node daemon)."""
    def run(args: argparse.Namespace) -> int:
        if args.coordinator:
            return _fleet_call(remote or _FLEET[name], args)
        strays = [o for o, v in (("--node", args.node), ("--key", args.key),
                                 ("--coordinator-key", args.coordinator_key)) if v]
        if strays:
            raise ControlError(f"only with --coordinator: {', '.join(strays)}")
        return local(args)
    return run


def _fleet_call(func: FleetCommand, args: argparse.Namespace
                ) -> int:
    """Run `func` with a FleetClient; every error of ours becomes one line (ControlError)."""
    from rollout_watchdog.common.errors import CommandRefused, RolloutWatchdogError
    from rollout_watchdog.refit_bridge.client import FleetClient

    try:
        client = FleetClient(args.coordinator, key=args.key,
                             coordinator_key=args.coordinator_key, timeout_s=args.timeout)
    except (OSError, ValueError) as exc:
        raise ControlError(f"cannot use the keys: {exc}") from exc
    try:
        return func(client, args)
    except CommandRefused as exc:
        silent = [n for n in exc.missing if n not in exc.reason]
        raise ControlError(exc.reason + (f" (did not answer: {', '.join(silent)})"
                                         if silent else "")) from None
    except (RolloutWatchdogError, ValueError) as exc:
        raise ControlError(str(exc)) from None


def _status(client: FleetClient, args: argparse.Namespace) -> int:
    result = client.status(node=args.node)
    print(json.dumps(result) if args.json else fleet_table(result))
    return EXIT_OK


def _events(client: FleetClient, args: argparse.Namespace) -> int:
    """Follow the fleet's events for ever, across coordinator restarts, each once."""
    from rollout_watchdog.common.errors import CoordinatorUnavailable

    if not args.follow:
        raise ControlError("--no-follow is for the local daemon: the coordinator's stream has "
                           "no history to print")
    try:
        client.call("ping")
    except CoordinatorUnavailable as exc:  # said once; the stream keeps trying
        print(f"waiting for the coordinator: {exc}", file=sys.stderr)
    with client.events() as stream:
        for event in stream:
            if args.node is not None and event.node_id != args.node:
                continue
            data = event.to_json()
            print(json.dumps(data) if args.json else event_line(data), flush=True)
    return EXIT_OK


def _report(result: FleetResult) -> int:
    """One line per node that answered."""
    for node, reply in sorted(result.nodes.items()):
        print(f"{node}: {result_line(reply.result)}")
    return EXIT_OK


def _pause(client: FleetClient, args: argparse.Namespace) -> int:
    return _report(client.pause(args.engine, node=args.node, all=args.all,
                                deadline_s=args.deadline))


def _resume(client: FleetClient, args: argparse.Namespace) -> int:
    return _report(client.resume(args.engine, node=args.node, all=args.all))


def _one(cmd: str) -> FleetCommand:
    def run(client: FleetClient, args: argparse.Namespace) -> int:
        return _report(getattr(client, cmd)(args.engine, node=args.node))
    return run


_FLEET: dict[str, FleetCommand] = {
    "status": _status, "events": _events, "pause": _pause, "resume": _resume,
    "restart": _one("restart"), "stop": _one("stop"), "reset": _one("reset")}


def cmd_coordinator(args: argparse.Namespace) -> int:
    import zmq

    from rollout_watchdog.common.gc_tuning import tune_for_service
    from rollout_watchdog.logs import setup_logging
    from rollout_watchdog.refit_bridge.coordinator import Coordinator

    setup_logging(args.log_level, args.log_format)
    try:
        coordinator = Coordinator(bind=args.bind, keys=args.keys, insecure=args.insecure,
                                  router_url=args.router_url, state_dir=args.state_dir,
                                  node_timeout_s=args.node_timeout,
                                  holder_timeout_s=args.holder_timeout,
                                  state_write_timeout_s=args.state_write_timeout,
                                  metrics_port=args.metrics_port,
                                  metrics_host=args.metrics_host,
                                  route_after_first_refit=args.route_after_first_refit,
                                  router_verify_s=args.router_verify_interval,
                                  handshake_timeout_s=args.handshake_timeout)
        # (once the journal is restored: frozen with start-up's objects)
        return int(coordinator.run(opened=tune_for_service))
    except (ValueError, OSError, zmq.ZMQError) as exc:  # a refused bind, keys, an address in use
        print(f"rollout-watchdog coordinator: {exc}", file=sys.stderr)
        return EXIT_ERROR


def add_coordinator_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser],
                           seconds: Callable[[str], float]) -> None:
    from rollout_watchdog.common.handshakes import HANDSHAKE_TIMEOUT_S
    from rollout_watchdog.refit_bridge.router_sync import VERIFY_S  # (requests: not at import)

    p = sub.add_parser("coordinator", help="run the fleet's coordinator", description=(
        "Run a standalone coordinator: nodes and clients connect to ENDPOINT. DIR holds "
        "coordinator.key_secret and authorized/ (the public keys let in). A non-loopback bind "
        "without --keys is refused unless --insecure."))
    p.add_argument("--bind", required=True, metavar="ENDPOINT", help="e.g. tcp://0.0.0.0:5555")
    p.add_argument("--keys", metavar="DIR", help="CURVE keys (see `keygen`)")
    p.add_argument("--insecure", action="store_true",
                   help="allow a non-loopback bind without keys (no authentication)")
    p.add_argument("--router-url", metavar="URL", help="the SGLang router to keep in step")
    p.add_argument("--router-verify-interval", type=seconds, default=VERIFY_S, metavar="S",
                   help="seconds between checks that every routed engine reports the fleet's "
                        "weight version itself (one GET /model_info each); one that does not "
                        f"is pulled from the router (default {VERIFY_S:g})")
    p.add_argument("--state-dir", metavar="DIR", help=(
        "keep a journal of relayed events here, so a restart loses none a client lacks, and "
        "the refit state (refit.json: fencing token, each engine's weight version)"))
    p.add_argument("--node-timeout", type=seconds, default=5.0, metavar="S",
                   help="seconds of silence after which a node is unreachable (default 5)")
    p.add_argument("--holder-timeout", type=seconds, default=HOLDER_TIMEOUT_S, metavar="S",
                   help="seconds of silence after which the refit lock's holder is taken for "
                        f"gone and the lock released (default {HOLDER_TIMEOUT_S:g})")
    p.add_argument("--handshake-timeout", type=seconds, default=HANDSHAKE_TIMEOUT_S,
                   metavar="S", help="seconds a connection has to finish its ZMTP (and CURVE) "
                   "handshake before it is dropped and counted (default "
                   f"{HANDSHAKE_TIMEOUT_S:g})")
    p.add_argument("--state-write-timeout", type=seconds, default=STATE_WRITE_TIMEOUT_S,
                   metavar="S", help=(
                       "seconds a refit reply waits for refit.json to be on disk before it "
                       f"fails, naming the file (default {STATE_WRITE_TIMEOUT_S:g})"))
    p.add_argument("--route-after-first-refit", action="store_true", help=(
        "route no engine until a refit commits (a run resumed from a checkpoint: engines "
        "booted from the base model are stale); by default engines are routed at the weights "
        "they loaded from disk until then"))
    p.add_argument("--metrics-port", type=_port, metavar="P", help=(
        "serve Prometheus metrics on this port: nodes reachable, engines by state, serving and "
        "pending, the weight version, the lock holder and its lease, refit durations and "
        "outcomes, relay counters"))
    p.add_argument("--metrics-host", default="127.0.0.1", metavar="HOST",
                   help="the metrics port's address (default 127.0.0.1)")
    p.add_argument("--log-format", choices=("text", "json"), default="text",
                   help="json: one JSON object a line (default: text)")
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error"),
                   default="info", help="default: info")
    p.set_defaults(func=cmd_coordinator)


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0..65535 (0: any free one), got {text!r}")
    return port
