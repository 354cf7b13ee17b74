"""The `rollout-watchdog` command line."""

from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from rollout_watchdog import __version__
from rollout_watchdog.cli import fleet, runtime
from rollout_watchdog.cli.client import ControlClient, ControlError
from rollout_watchdog.cli.render import event_line, result_line, status_table
from rollout_watchdog.config import ConfigError, load_config

EXIT_OK, EXIT_ERROR, EXIT_USAGE = 0, 1, 2


def _doc(name: str) -> str:
    """The wire-spec docstring of a control command (indentation removed): the description."""
    from rollout_watchdog.watchdog.commands import COMMANDS

    return inspect.cleandoc(COMMANDS[name].__doc__ or "")


def cmd_run(args: argparse.Namespace) -> int:
    from rollout_watchdog.logs import setup_logging
    from rollout_watchdog.node import node_daemon

    setup_logging(args.log_level, args.log_format)
    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print("\n".join(exc.problems), file=sys.stderr)
        return EXIT_ERROR
    if args.control:
        from dataclasses import replace

        config = replace(config, control=args.control)
    try:
        return node_daemon(config).run()
    except (RuntimeError, OSError) as exc:
        # the control socket taken by another daemon, an unwritable state_dir, a metrics port
        # in use: the operator's to fix, so a message rather than a traceback
        print(f"rollout-watchdog: cannot run: {exc}", file=sys.stderr)
        return EXIT_ERROR


def cmd_check_config(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.file)
    except ConfigError as exc:
        print("\n".join(exc.problems), file=sys.stderr)
        return EXIT_ERROR
    print(f"{args.file}: OK, node {config.node_id}, {len(config.engines)} engine(s): "
          f"{', '.join(e.id for e in config.engines) or 'none'}")
    return EXIT_OK


def _seconds(text: str) -> float:
    """A finite, positive number of seconds (argparse type)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text!r}")
    return value


def _at_least_two(text: str) -> int:
    if not text.isdigit() or int(text) < 2:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 2, got {text!r}")
    return int(text)


# What a command keeps of its --timeout for its own exit (printing, closing its sockets).
EXIT_MARGIN_S = 0.2


def _answer_wait(timeout_s: float) -> float:
    """How long to wait for the answer (in tenths, as the messages show it): --timeout counts
    from this process's start, less EXIT_MARGIN_S, so that "each answers within 5 s or exits
    non-zero" holds as its caller times it, however long the interpreter took to start (0.1 s,
    a second under load). At least a tenth of the timeout is left for the answer."""
    from rollout_watchdog.common.clock import Clock
    from rollout_watchdog.watchdog.process import read_stat

    stat = read_stat(os.getpid())
    started_ago = 0.0 if stat is None else max(0.0, Clock().since_boot() - stat.start_time)
    return max(timeout_s / 10, math.floor((timeout_s - started_ago - EXIT_MARGIN_S) * 10) / 10)


def _client(args: argparse.Namespace) -> ControlClient:
    return ControlClient(args.control, timeout_s=args.timeout)


def _target(args: argparse.Namespace) -> dict[str, Any]:
    if getattr(args, "all", False):
        if args.engine:
            raise ControlError("name an ENGINE or --all, not both")
        return {"all": True}
    if not args.engine:
        raise ControlError("name an ENGINE or --all")
    return {"engine": args.engine}


def cmd_status(args: argparse.Namespace) -> int:
    result = _client(args).call("status")
    print(json.dumps(result) if args.json else status_table(result))
    return EXIT_OK


def cmd_events(args: argparse.Namespace) -> int:
    """Follow the daemon's events; survive its restarts (a new boot id starts over).

    A daemon that dies is noticed at once (its connection closes: DaemonGone); one that stops
    answering, after --timeout + --poll seconds of silence. Either way the follower tries again
    every --retry seconds and asks for what came after the last event it printed.
    """
    client = _client(args)
    since, boot = 0, None
    waiting_said = False
    while True:
        try:
            wait_s = args.poll if args.follow else 0.0  # the long poll's own wait
            result = client.call("events", {"since": since, "boot": boot, "wait_s": wait_s},
                                 timeout_s=args.timeout + wait_s)
        except ControlError as exc:
            if not args.follow:
                raise
            if not waiting_said:
                print(f"waiting for the daemon: {exc}", file=sys.stderr, flush=True)
                waiting_said = True
            time.sleep(args.retry)
            continue
        waiting_said = False
        boot, since = result["boot"], result["next"]
        for event in result["events"]:
            print(json.dumps(event) if args.json else event_line(event), flush=True)
        if not args.follow and not result["events"]:
            return EXIT_OK


def _simple(cmd: str) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        request = _target(args)
        if cmd == "pause":
            # the daemon answers (with a clear error if probes are still out) before we give up
            request.update(deadline_s=args.deadline, wait_s=max(0.0, args.timeout - 1.0))
        _say(_client(args).call(cmd, request))
        return EXIT_OK
    return run


def _say(result: dict[str, Any]) -> None:
    print(result_line(result))


def cmd_register(args: argparse.Namespace) -> int:
    _say(_client(args).call("register", {"engine": args.engine, "url": args.url,
                                         "pid": args.pid}))
    return EXIT_OK


def cmd_keygen(args: argparse.Namespace) -> int:
    from rollout_watchdog.common.keys import KeygenError, keygen

    try:
        public, secret = keygen(args.dir, args.name)
    except KeygenError as exc:
        print(f"rollout-watchdog keygen: {exc}", file=sys.stderr)
        return EXIT_ERROR
    print(f"public key {public} (give it to the other side)\nkeypair {secret} (mode 0600, keep "
          "it here)")
    return EXIT_OK


def cmd_emulator(args: argparse.Namespace) -> int:
    """Parse the emulator's own options here, so that no other command loads the emulator."""
    from rollout_watchdog.emulator import build_parser, run

    parser = build_parser(argparse.ArgumentParser(prog="rollout-watchdog emulator"))
    return run(parser.parse_args(args.emulator_argv))


def cmd_demo(args: argparse.Namespace) -> int:
    if args.fleet:
        from rollout_watchdog.cli.demo_fleet import run_fleet_demo

        return run_fleet_demo(args)
    from rollout_watchdog.cli.demo import run_demo

    return run_demo(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rollout-watchdog", description=(
        "Keeps the SGLang engines of an RL rollout fleet alive."))
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def control_command(name: str, help_text: str, func: Callable[[argparse.Namespace], int],
                        remote: fleet.FleetCommand | None = None) -> argparse.ArgumentParser:
        # The summary is the docstring's whole first paragraph, which may wrap over lines.
        summary = " ".join(help_text.split("\n\n")[0].split())
        p = sub.add_parser(name, help=summary, description=help_text,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        where = p.add_mutually_exclusive_group() if name in fleet.FLEET_COMMANDS else p
        where.add_argument("--control", help="control endpoint (default: "
                           "$ROLLOUT_WATCHDOG_CONTROL or ipc:///run/rollout-watchdog/control)")
        if name in fleet.FLEET_COMMANDS:  # also on the fleet, through a coordinator
            fleet.add_options(p, where)
            func = fleet.either(name, func, remote)
        p.add_argument("--timeout", type=_seconds, default=5.0,
                       help="seconds to wait for the answer, counted from the command's start "
                       "(default 5)")
        p.set_defaults(func=func)
        return p

    p = sub.add_parser("run", help="run the node daemon (what the systemd unit starts)")
    p.add_argument("--config", required=True, help="node config (TOML)")
    p.add_argument("--control", help="override the config's control endpoint")
    p.add_argument("--log-format", choices=("text", "json"), default="text",
                   help="json: one JSON object a line (default: text)")
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error"),
                   default="info", help="default: info")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("check-config", help="validate a node config; one line per problem")
    p.add_argument("file", help="node config (TOML)")
    p.set_defaults(func=cmd_check_config)

    p = control_command("status", _doc("status"), cmd_status)
    p.add_argument("--json", action="store_true", help="print the status JSON")

    p = control_command("events", _doc("events"), cmd_events)
    p.add_argument("--json", action="store_true", help="one JSON object a line")
    p.add_argument("--no-follow", dest="follow", action="store_false",
                   help="local daemon: print the events so far and exit")
    p.add_argument("--poll", type=_seconds, default=5.0, metavar="S",
                   help="local daemon: how long one request waits there for a new event "
                   "(default 5; the daemon caps it at 30). A daemon that dies is noticed at "
                   "once; one that stops answering after --timeout + --poll s of silence")
    p.add_argument("--retry", type=_seconds, default=0.5, metavar="S",
                   help="local daemon: seconds between tries while it is away (default 0.5)")

    for name in ("pause", "resume"):
        p = control_command(name, _doc(name), _simple(name))
        p.add_argument("engine", nargs="?", help="engine id (NODE/ENGINE with --coordinator)")
        p.add_argument("--all", action="store_true", help="every engine of the node (with "
                       "--coordinator: of every reachable node, or of --node)")
        if name == "pause":
            p.add_argument("--deadline", type=_seconds, default=600.0,
                           help="seconds after which probing resumes by itself (default 600, "
                                "at most 86400)")
    for name in ("restart", "stop", "reset", "unregister"):
        p = control_command(name, _doc(name), _simple(name))
        p.add_argument("engine", help="engine id" + (
            " (NODE/ENGINE with --coordinator)" if name in fleet.FLEET_COMMANDS else ""))

    p = control_command("register", _doc("register"), cmd_register)
    p.add_argument("engine", help="an id for the engine")
    p.add_argument("--url", required=True, help="the engine's HTTP address (probed)")
    p.add_argument("--pid", type=int, required=True,
                   help="the engine's main process (its tree is watched and killed)")

    p = control_command("launch", _doc("launch"), runtime.cmd_launch, runtime.fleet_launch)
    runtime.add_launch_options(p, _seconds)
    p = control_command("remove", _doc("remove"), runtime.cmd_remove, runtime.fleet_remove)
    runtime.add_remove_options(p, _seconds)

    fleet.add_coordinator_parser(sub, _seconds)

    p = sub.add_parser("keygen", help="write a CURVE keypair for the fleet link", description=(
        "Write DIR/NAME.key (the public key: give it to the other side, e.g. the coordinator's "
        "authorized/ directory) and DIR/NAME.key_secret (the keypair, mode 0600), in pyzmq's "
        "certificate format. An existing key is never overwritten."))
    p.add_argument("dir", help="directory for the key files (created 0700 if missing)")
    p.add_argument("name", help="the key's name: a node id, a client or 'coordinator'")
    p.set_defaults(func=cmd_keygen)

    # Its options (and its -h) are the emulator's own: main() hands them over unparsed.
    p = sub.add_parser("emulator", help="an SGLang-compatible engine for tests (no GPU)",
                       add_help=False)
    p.set_defaults(func=cmd_emulator)

    p = sub.add_parser("demo", help="a crash injected, detected and recovered, on this machine")
    p.add_argument("--fleet", action="store_true", help="a two-node fleet instead: a "
                   "coordinator, two node daemons and a client, over CURVE")
    p.add_argument("--engines", type=_at_least_two, default=2,
                   help="emulated engines (per node with --fleet), at least 2: one crashes, "
                   "one hangs; default 2")
    p.add_argument("--keep", action="store_true", help="keep the demo's directory")
    p.set_defaults(func=cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.command == "emulator":
        args.emulator_argv = rest
    elif args.command == "launch" and (problem := runtime.take_command(args, rest)):
        parser.error(problem)
    elif rest and args.command != "launch":
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if argv is None and isinstance(getattr(args, "timeout", None), float):
        args.timeout = _answer_wait(args.timeout)   # (the command's own process only)
    try:
        return int(args.func(args))
    except ControlError as exc:
        print(f"rollout-watchdog {args.command}: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `status | head`: the reader left; not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
