"""Control commands of the node daemon. Each handler's docstring is both its wire spec and the
help text of the matching CLI command.

Wire format (ZMQ, JSON, one frame): request `{"v": 1, "id": ANY, "cmd": NAME, "args": {...}}`,
reply `{"v": 1, "id": ANY, "status": "ok"|"error", "reason": str|null, "result": ...}`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rollout_watchdog.config import url_port
from rollout_watchdog.watchdog.control import CommandError, Deferred

if TYPE_CHECKING:
    from rollout_watchdog.watchdog.daemon import Daemon

Handler = Callable[["Daemon", dict[str, Any]], "dict[str, Any] | Deferred"]
COMMANDS: dict[str, Handler] = {}
MAX_EVENTS_WAIT_S = 30.0
DEFAULT_PAUSE_S = 600.0
MAX_PAUSE_S = 86400.0


def command(name: str) -> Callable[[Handler], Handler]:
    def register(func: Handler) -> Handler:
        COMMANDS[name] = func
        return func
    return register


def dispatch(daemon: Daemon, name: str, args: dict[str, Any]) -> dict[str, Any] | Deferred:
    handler = COMMANDS.get(name)
    if handler is None:
        raise CommandError(f"unknown command {name!r} (commands: {', '.join(sorted(COMMANDS))})")
    return handler(daemon, args)


def engine_ids(daemon: Daemon, args: dict[str, Any]) -> list[str]:
    """The engines a command names: `engine` (one id) or `all: true`."""
    if args.get("all"):
        return list(daemon.engines)
    engine = args.get("engine")
    if not isinstance(engine, str):
        raise CommandError("name an engine ('engine') or all engines ('all': true)")
    if engine not in daemon.engines:
        known = ", ".join(daemon.engines) or "none"
        raise CommandError(f"no engine {engine!r} on this node (engines: {known})")
    return [engine]


def _number(args: dict[str, Any], key: str, default: float) -> float:
    value = args.get(key, default)
    try:
        number = float(value)
    except (TypeError, ValueError, OverflowError):
        number = math.nan
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(number) or number < 0:
        raise CommandError(f"'{key}' must be a finite number >= 0, got {str(value)[:40]}")
    return number


@command("status")
def status(daemon: Daemon, args: dict[str, Any]) -> dict[str, Any]:
    """Show every engine: state, pause, pid, incarnation, restarts, last failure.

    args: {}. result: {"node_id", "boot_id", "engines": [{"id", "state", "paused", "pid",
    "incarnation", "restarts", "url", "last_failure": {"cause", "detail", "ts"} | null, ...}]}
    """
    return daemon.status()


@command("events")
def events(daemon: Daemon, args: dict[str, Any]) -> dict[str, Any] | Deferred:
    """Follow the event stream (long poll).

    args: {"since": SEQ (default 0), "boot": BOOT_ID or null, "wait_s": S (default 5, max 30)}.
    result: {"boot": BOOT_ID, "next": SEQ, "events": [EVENT, ...]}; answers as soon as there is
    an event after SEQ, or with no events after wait_s. A `boot` that is not this daemon's (it
    restarted) starts from its first event.
    """
    since = int(_number(args, "since", 0))
    if args.get("boot") not in (None, daemon.boot_id):
        since = 0
    wait_s = min(_number(args, "wait_s", 5.0), MAX_EVENTS_WAIT_S)

    def ready() -> dict[str, Any] | None:
        found = daemon.events.since(since)
        if not found:
            return None
        return {"boot": daemon.boot_id, "next": found[-1][0],
                "events": [e.to_json() for _, e in found]}

    def empty() -> dict[str, Any]:
        return {"boot": daemon.boot_id, "next": since, "events": []}

    return ready() or Deferred(ready, time.monotonic() + wait_s, empty)


@command("pause")
def pause(daemon: Daemon, args: dict[str, Any]) -> Deferred:
    """Pause deep probes of ENGINE (or all) until resumed or until the deadline passes.

    args: {"engine": ID} or {"all": true}, optional "deadline_s" (default 600), optional
    "wait_s": how long to wait for in-flight probes before answering with an error (the pause
    stays recorded). Answered only once no probe of those engines is in flight. Liveness is
    never paused.
    result: {"paused": [ID, ...], "deadline": EPOCH_SECONDS}
    """
    deadline_s = _number(args, "deadline_s", DEFAULT_PAUSE_S)
    if not 0 < deadline_s <= MAX_PAUSE_S:
        raise CommandError(f"the pause deadline must be more than 0 and at most "
                           f"{MAX_PAUSE_S:g} s (probing must come back), got {deadline_s:g}")
    wait_s = _number(args, "wait_s", 0.0) if "wait_s" in args else None
    return daemon.pause(engine_ids(daemon, args), deadline_s, wait_s,
                        str(args.get("source", "local")))


@command("resume")
def resume(daemon: Daemon, args: dict[str, Any]) -> dict[str, Any]:
    """Resume deep probes of ENGINE (or all).

    args: {"engine": ID} or {"all": true}. result: {"resumed": [ID, ...]}
    """
    return {"resumed": daemon.resume(engine_ids(daemon, args))}


@command("restart")
def restart(daemon: Daemon, args: dict[str, Any]) -> dict[str, Any]:
    """Kill ENGINE (if running) and relaunch it at once; uses no restart budget.

    Also relaunches a `deferred` engine waiting after a failure, or a stopped one.
    args: {"engine": ID}. result: {"engine": ID, "action": TEXT}
    """
    (engine,) = engine_ids(daemon, {"engine": args.get("engine")})
    return {"engine": engine, "action": daemon.restart(engine)}


@command("stop")
def stop(daemon: Daemon, args: dict[str, Any]) -> dict[str, Any]:
    """Kill ENGINE and keep it down until `restart` or `reset`.

    args: {"engine": ID}. result: {"engine": ID, "action": TEXT}
    """
    (engine,) = engine_ids(daemon, {"engine": args.get("engine")})
    return {"engine": engine, "action": daemon.stop(engine)}


@command("reset")
def reset(daemon: Daemon, args: dict[str, Any]) -> dict[str, Any]:
    """Clear ENGINE's restart budget; a `failed` engine is relaunched.

    args: {"engine": ID}. result: {"engine": ID, "action": TEXT}
    """
    (engine,) = engine_ids(daemon, {"engine": args.get("engine")})
    return {"engine": engine, "action": daemon.reset(engine)}


@command("register")
def register(daemon: Daemon, args: dict[str, Any]) -> dict[str, Any]:
    """Watch an engine started by someone else: probed and killed, never relaunched.

    args: {"engine": ID, "url": URL, "pid": PID}. result: {"engine": ID, "action": TEXT}
    """
    engine, url, pid = args.get("engine"), args.get("url"), args.get("pid")
    if not isinstance(engine, str) or not engine:
        raise CommandError("'engine' must be a non-empty string")
    if not isinstance(url, str) or url_port(url) is None:
        raise CommandError(f"'url' must be an http URL with a host and a valid port, got "
                           f"{str(url)[:80]!r}")
    if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
        raise CommandError("'pid' must be a positive integer")
    return {"engine": engine, "action": daemon.register(engine, url, pid)}


@command("unregister")
def unregister(daemon: Daemon, args: dict[str, Any]) -> dict[str, Any]:
    """Stop watching an external engine (it is not killed).

    args: {"engine": ID}. result: {"engine": ID, "action": TEXT}
    """
    engine = args.get("engine")
    if not isinstance(engine, str):
        raise CommandError("'engine' must be a string")
    return {"engine": engine, "action": daemon.unregister(engine)}


@command("ping")
def ping(daemon: Daemon, args: dict[str, Any]) -> dict[str, Any]:
    """Check that the daemon answers. args: {}. result: {"node_id", "boot_id"}"""
    return {"node_id": daemon.node_id, "boot_id": daemon.boot_id}
