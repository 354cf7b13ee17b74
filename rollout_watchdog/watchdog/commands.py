"""The command table of the node daemon, and the commands' implementations. Each handler's
docstring is both its wire spec and the help text of the matching CLI command; its arguments
are declared with it and checked before it runs (`common.commands`: a malformed one is refused
naming it).

Every transport (the local control socket, the agent) dispatches here, so remote commands run
through exactly the paths of local ones. The commands see the node through the `Node`
protocol; the core never imports this module.

Wire format (ZMQ, JSON, one frame): request `{"v": 1, "id": ANY, "cmd": NAME, "args": {...}}`,
reply `{"v": 1, "id": ANY, "status": "ok"|"error", "reason": str|null, "result": ...}`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, Protocol

from rollout_watchdog.common.commands import (
    Arg,
    Registry,
    choice,
    flag,
    integer,
    number,
    rule,
    text,
)
from rollout_watchdog.common.events import EventLog
from rollout_watchdog.common.replies import CommandError, Deferred
from rollout_watchdog.common.states import Cause, EngineState
from rollout_watchdog.common.validate import check_engine_id, shown
from rollout_watchdog.config import EngineConfig, NodeConfig
from rollout_watchdog.config.engine_argv import url_port
from rollout_watchdog.watchdog.engine import AfterKill, EngineRuntime, Pause
from rollout_watchdog.watchdog.launched import LaunchedSpecs
from rollout_watchdog.watchdog.previous_run import PreviousRun
from rollout_watchdog.watchdog.process import ProcessOps
from rollout_watchdog.watchdog.status import Reported, node_status
from rollout_watchdog.watchdog.timers import PROBE_SLACK_S

S = EngineState
MAX_EVENTS_WAIT_S = 30.0
DEFAULT_PAUSE_S = 600.0
MAX_PAUSE_S = 86400.0
# Commands that would bring an engine (back) up: refused while the daemon is stopping.
REFUSED_WHILE_STOPPING = frozenset({"restart", "reset", "register", "launch", "remove"})


class Node(Reported, Protocol):
    """What the commands need of the node: the supervisor, seen from the command layer (what
    its status is made of, and more)."""

    events: EventLog
    previous_run: PreviousRun | None
    stopping: bool
    dirty: bool
    ops: ProcessOps
    config: NodeConfig
    launched: LaunchedSpecs

    def launch_when_released(self, engine: EngineRuntime, cause: Cause, detail: str) -> None: ...
    def emit(self, engine: EngineRuntime | None, kind: str, **fields: Any) -> None: ...
    def transition(self, engine: EngineRuntime, new: EngineState, cause: Cause,
                   detail: str, **extra: Any) -> None: ...
    def launch(self, engine: EngineRuntime, cause: Cause) -> None: ...
    def start_kill(self, engine: EngineRuntime, cause: Cause, detail: str,
                   after: AfterKill, **extra: Any) -> None: ...
    def fail(self, engine: EngineRuntime, cause: Cause, detail: str,
             evidence_at: float) -> None: ...
    def fail_if_budget_spent(self, engine: EngineRuntime, cause: Cause) -> bool: ...
    def count_relaunch(self, engine: EngineRuntime, cause: Cause, at: float) -> None: ...
    def release_problems(self, engine: EngineRuntime) -> list[str]: ...
    def probe_in_flight(self, engine_id: str) -> bool: ...
    def forget(self, engine: EngineRuntime, kind: str, detail: str) -> None: ...
    def unconfigured_engine(self, engine_id: str, url: str) -> EngineConfig: ...
    def next_incarnation(self, engine_id: str) -> int: ...
    def track(self, engine: EngineRuntime) -> None: ...


Handler = Callable[[Node, dict[str, Any]], "dict[str, Any] | Deferred"]
COMMANDS: Registry[Handler] = Registry("the node")
command = COMMANDS.command

# The arguments several commands take.
ENGINE = Arg("engine", rule(lambda v: None if isinstance(v, str) else
                            f"must name an engine (a string), got {shown(v)}"))
ALL = Arg("all", flag)
OWNER = Arg("owner", text(100))


def dispatch(node: Node, name: str, args: dict[str, Any]) -> dict[str, Any] | Deferred:
    """Run one command: the one entry point of every transport (control socket, agent)."""
    spec = COMMANDS.lookup(name)
    if node.stopping and name in REFUSED_WHILE_STOPPING:
        raise CommandError("the daemon is stopping")
    return spec.handler(node, spec.validate(args))


def dispatcher(node: Node) -> Callable[[str, dict[str, Any]], dict[str, Any] | Deferred]:
    return lambda name, args: dispatch(node, name, args)


def engine_ids(node: Node, args: dict[str, Any]) -> list[str]:
    """The engines a command names (validated as ENGINE and ALL): `engine` or `all: true`."""
    if args.get("all") is True:
        return list(node.engines)
    engine = args.get("engine")
    if engine is None:
        raise CommandError("name an engine ('engine') or all engines ('all': true)")
    if engine not in node.engines:
        known = ", ".join(node.engines) or "none"
        raise CommandError(f"no engine {engine!r:.80} on this node (engines: {known})")
    return [engine]


def one_engine(node: Node, args: dict[str, Any]) -> EngineRuntime:
    (engine_id,) = engine_ids(node, {"engine": args.get("engine")})
    return node.engines[engine_id]


@command("status")
def status(node: Node, args: dict[str, Any]) -> dict[str, Any]:
    """Show every engine: state, pause, pid, incarnation, restarts, last failure.

    args: {}. result: {"node_id", "boot_id", "engines": [{"id", "state", "paused", "pid",
    "process", "incarnation", "restarts", "url", "last_failure": {"cause", "detail", "ts"} |
    null, ...}]} ("process" names the main process: kernel boot, pid, start time),
    plus, with a coordinator configured, "link": {"coordinator", "connected", "outbox",
    "unsent", "dropped", "bad_messages", "failed_handshakes" (since the daemon started),
    "handshake_failure" (why the last handshake failed, null once one passed)}
    """
    return node_status(node)


@command("events", Arg("since", number(0), 0.0), Arg("boot", text()),
         Arg("wait_s", number(0), 5.0))
def events(node: Node, args: dict[str, Any]) -> dict[str, Any] | Deferred:
    """Follow the event stream (long poll).

    args: {"since": SEQ (default 0), "boot": BOOT_ID or null, "wait_s": S (default 5, max 30)}.
    result: {"boot": BOOT_ID, "next": SEQ, "events": [EVENT, ...]}; answers as soon as there is
    an event after SEQ, or with no events after wait_s. A `boot` of the daemon's previous run
    (it restarted) gets the rest of that run's events first (read back from events.jsonl,
    previous_run.py), under that boot; then, as any other `boot` that is not this daemon's,
    this run's from its first event. A follower so far behind that events were dropped from
    memory first gets an event of kind "gap" that says how many.
    """
    since = int(args["since"])
    previous = node.previous_run
    if previous is not None and args["boot"] == previous.boot and since < previous.last_seq:
        earlier = previous.since(since)
        return {"boot": previous.boot, "next": earlier[-1][0], "events": _with_gap(
            node, since, earlier[0][0], earlier[0][1].get("ts"), [e for _, e in earlier])}
    if args["boot"] not in (None, node.boot_id):
        since = 0
    wait_s = min(args["wait_s"], MAX_EVENTS_WAIT_S)

    def ready() -> dict[str, Any] | None:
        found = node.events.since(since)
        if not found:
            return None
        return {"boot": node.boot_id, "next": found[-1][0], "events": _with_gap(
            node, since, found[0][0], found[0][1].ts, [e.to_json() for _, e in found])}

    def empty() -> dict[str, Any]:
        return {"boot": node.boot_id, "next": since, "events": []}

    return ready() or Deferred(ready, node.clock.monotonic() + wait_s, empty)


def _with_gap(node: Node, since: int, first: int, ts: object,
              events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`events` (the first numbered `first`), after an event of kind "gap" when the follower
    (at `since`) fell behind what the daemon keeps."""
    lost = first - since - 1
    if lost <= 0:
        return events
    return [{"ts": ts, "node_id": node.node_id, "engine": None, "incarnation": None,
             "kind": "gap", "from": None, "to": None, "cause": None,
             "detail": f"{lost} event(s) lost: this follower fell behind the daemon's "
                       "in-memory log (see events.jsonl)"}, *events]


@command("pause", ENGINE, ALL, Arg("deadline_s", number(0, above=True, maximum=MAX_PAUSE_S),
                                   DEFAULT_PAUSE_S), Arg("wait_s", number(0)), OWNER)
def pause(node: Node, args: dict[str, Any]) -> Deferred:
    """Pause deep probes of ENGINE (or all) until resumed or until the deadline passes.

    args: {"engine": ID} or {"all": true}, optional "deadline_s" (default 600), optional
    "wait_s": how long to wait for in-flight probes before answering with an error (the pause
    stays recorded), optional "owner": who pauses (a refit tags its pause so that its resume
    lifts its own pause only). Answered only once no probe of those engines is in flight, so
    no probe can overlap a release_memory_occupation that follows. Liveness is never paused. A
    pause never shortens one already in place (the later deadline holds: a refit's pause must
    not cut short `finish_generation`'s, whose engine may have no KV cache yet; a later one is
    a "pause_extended" event); the engine stays paused until every owner resumed it (or a
    resume without an owner, or the deadline); each owner's part ends at its own deadline
    (once a later owner resumed, the pause ends with the longest part left).
    result: {"paused": [ID, ...], "deadline": EPOCH_SECONDS}
    """
    deadline_s: float = args["deadline_s"]   # (at most MAX_PAUSE_S: probing must come back)
    wait_s: float | None = args["wait_s"]
    owner: str = args["owner"] or ""
    ids = engine_ids(node, args)
    clock = node.clock
    deadline = clock.wall() + deadline_s
    expires = clock.monotonic() + deadline_s
    for engine_id in ids:
        engine = node.engines[engine_id]
        before = engine.paused
        extended = before is not None and before.expires < expires
        if before is None:
            engine.paused = Pause(deadline, expires, {owner: (deadline, expires)})
        else:
            before.add(owner, deadline, expires)
        engine.progress_tokens = None  # paused generation is not a stall
        if before is None:
            node.emit(engine, "paused", detail=f"deep probes paused for {deadline_s:g} s",
                      deadline=deadline)
        elif extended:
            node.emit(engine, "pause_extended", detail=f"deep probes paused for {deadline_s:g} "
                      "s from now", deadline=deadline)
    node.dirty = True

    def inflight() -> list[str]:
        return [i for i in ids if node.probe_in_flight(i)
                or ((e := node.engines.get(i)) is not None and e.probes_out)]

    def ready() -> dict[str, Any] | None:
        return None if inflight() else {"paused": ids, "deadline": deadline}

    def late() -> dict[str, Any]:
        raise CommandError(f"pause recorded, but probes of {', '.join(inflight())} are "
                           "still in flight; ask again to wait for them")

    if wait_s is None:
        wait_s = max((node.engines[i].cfg.probe.health_timeout_s for i in ids), default=0.0)
        wait_s += PROBE_SLACK_S  # every probe ends at its deadline
    return Deferred(ready, clock.monotonic() + wait_s, late)


@command("resume", ENGINE, ALL, OWNER, Arg("keep", text(100)))
def resume(node: Node, args: dict[str, Any]) -> dict[str, Any]:
    """Resume deep probes of ENGINE (or all).

    args: {"engine": ID} or {"all": true}, optional "owner": lift that owner's pause only (an
    engine another owner paused too stays paused); without "owner", optional "keep": lift
    every owner's pause but that one's (the coordinator adds the refit's own while a refit
    holds the lock: a prepare_for_generation then must not lift it). result: {"resumed":
    [ID, ...]}
    """
    owner, keep = args["owner"], args["keep"]
    resumed = []
    for engine_id in engine_ids(node, args):
        engine = node.engines[engine_id]
        if engine.paused is not None and owner is not None and engine.paused.owners:
            if engine.paused.keep_only(set(engine.paused.owners) - {owner}):
                continue
        elif engine.paused is not None and keep is not None and keep in engine.paused.owners:
            engine.paused.keep_only({keep})
            continue
        if engine.paused is not None:
            engine.paused = None
            engine.next_probe = node.clock.monotonic()
            node.emit(engine, "resumed", detail="deep probes resumed")
            resumed.append(engine_id)
    node.dirty = True
    return {"resumed": resumed}


@command("restart", ENGINE, Arg("cause", choice(Cause.REFIT_WEDGED.value)),
         Arg("incarnation", integer(0)), Arg("detail", text(empty=True)))
def restart(node: Node, args: dict[str, Any]) -> dict[str, Any]:
    """Kill ENGINE (if running) and relaunch it at once; uses no restart budget.

    Also relaunches a `deferred` engine waiting after a failure, or a stopped one.
    With `"cause": "refit_wedged"` (the coordinator, for an engine stuck in an aborted refit)
    the running engine is failed with that cause instead: killed, then relaunched as after any
    failure (backoff, restart budget, `deferred` policy).
    args: {"engine": ID, "cause"?: "refit_wedged", "incarnation"?: N, "detail"?: TEXT}
    (with `incarnation`, only that incarnation is failed; a newer one is left alone).
    result: {"engine": ID, "action": TEXT}
    """
    engine = one_engine(node, args)
    if args["cause"] is None:
        return {"engine": engine.id, "action": _restart(node, engine)}
    if engine.kill is not None or not engine.state.running:
        return {"engine": engine.id, "action": f"not running ({engine.state}): nothing to do"}
    wanted = args["incarnation"]
    if wanted is not None and wanted != engine.incarnation:
        return {"engine": engine.id, "action": f"incarnation {engine.incarnation} is not the "
                                               f"wedged {wanted}: nothing to do"}
    node.fail(engine, Cause.REFIT_WEDGED, (args["detail"] or "wedged in a refit")[:500],
              node.clock.monotonic())
    return {"engine": engine.id, "action": "failed (refit_wedged): killing, then recovering"}


def _restart(node: Node, engine: EngineRuntime) -> str:
    require_launchable(engine)
    if engine.kill is not None:
        if engine.kill.after == AfterKill.RECOVER:
            # It follows a failure: relaunched at once but within the restart budget.
            engine.restart_requested = True
        else:
            engine.kill.after = AfterKill.RESTART
        return "relaunch after the kill in progress"
    if engine.state.running:
        node.start_kill(engine, Cause.COMMANDED, "restart commanded", AfterKill.RESTART)
        return "killing, then relaunching"
    require_released(node, engine)
    if engine.deferred_waiting:
        # The relaunch a deferred engine waited for: it follows a failure, so it uses the
        # restart budget (a crash-looping colocated engine must end in `failed` too).
        cause = engine.last_failure.cause if engine.last_failure else Cause.COMMANDED
        if node.fail_if_budget_spent(engine, cause):
            return "restart budget exhausted: failed; `reset` to try again"
        node.count_relaunch(engine, cause, node.clock.wall())
    node.launch(engine, Cause.COMMANDED)
    return "relaunched"


def require_launchable(engine: EngineRuntime) -> None:
    if engine.external:
        raise CommandError(f"engine {engine.id} is external: its owner relaunches it")
    if not engine.cfg.command:
        raise CommandError(f"engine {engine.id} is not in the config any more")


def require_released(node: Node, engine: EngineRuntime) -> None:
    """Before a commanded launch of an engine that is down: its ports and GPUs must be free
    (a stop skips this check, as nothing was to be relaunched then)."""
    problems = node.release_problems(engine)
    if problems:
        raise CommandError(f"engine {engine.id} not relaunched: " + "; ".join(problems))


@command("stop", ENGINE)
def stop(node: Node, args: dict[str, Any]) -> dict[str, Any]:
    """Kill ENGINE and keep it down until `restart` (`reset` clears the budget only).

    args: {"engine": ID}. result: {"engine": ID, "action": TEXT}
    """
    engine = one_engine(node, args)
    action = "stopped"
    if engine.kill is not None:
        engine.kill.after = AfterKill.STOP
        action = "stopping"
    elif engine.state.running:
        node.start_kill(engine, Cause.COMMANDED, "stop commanded", AfterKill.STOP)
        action = "stopping"
    elif engine.state in (S.BACKOFF, S.FAILED):
        engine.backoff_until = None
        engine.deferred_waiting = False
        node.transition(engine, S.STOPPED, Cause.COMMANDED, "stop commanded")
    return {"engine": engine.id, "action": action}


@command("reset", ENGINE)
def reset(node: Node, args: dict[str, Any]) -> dict[str, Any]:
    """Clear ENGINE's restart budget; a `failed` engine is relaunched.

    args: {"engine": ID}. result: {"engine": ID, "action": TEXT}
    """
    engine = one_engine(node, args)
    engine.relaunch_times = []
    engine.consecutive_failures = 0
    node.dirty = True
    if engine.state != S.FAILED:
        return {"engine": engine.id,
                "action": f"restart budget cleared (engine is {engine.state})"}
    require_launchable(engine)
    require_released(node, engine)
    node.launch(engine, Cause.RESET)
    return {"engine": engine.id, "action": "restart budget cleared; relaunched"}


@command("register", Arg("engine", rule(check_engine_id), required=True),
         Arg("url", rule(lambda v: None if isinstance(v, str) and url_port(v) is not None else
                         f"must be an http URL with a host and a valid port, got {shown(v, 80)}"),
             required=True),
         Arg("pid", integer(1), required=True))
def register(node: Node, args: dict[str, Any]) -> dict[str, Any]:
    """Watch an engine started by someone else (a Ray actor): probed and killed like the
    node's own, never relaunched.

    Each registration is a new incarnation, never a number the engine id had before.
    args: {"engine": ID, "url": URL, "pid": PID}. result: {"engine": ID, "action": TEXT}
    """
    engine_id: str = args["engine"]
    url: str = args["url"]
    pid: int = args["pid"]
    key = node.ops.proc_key(pid)
    if key is None:
        raise CommandError(f"no process with pid {pid}")
    if node.ops.is_kernel_thread(pid):
        raise CommandError(f"pid {pid} is a kernel thread: never an engine")
    existing = node.engines.get(engine_id)
    if existing is not None and not existing.external:
        raise CommandError(f"engine {engine_id} is in the config; pick another id")
    if existing is not None and existing.kill is not None:
        raise CommandError(f"engine {engine_id} is being stopped; register it again once "
                           "it is stopped")
    if existing is not None and existing.state.running:
        raise CommandError(f"engine {engine_id} is already registered ({existing.state}); "
                           "unregister it first")
    if key.pid in protected_pids(node.ops):
        raise CommandError(f"pid {pid} is init, this daemon or one of its ancestors: "
                           "never an engine")
    for other in node.engines.values():
        if other.id == engine_id:
            continue
        if key in other.procs and key not in other.dead:
            raise CommandError(f"pid {pid} is already watched as part of engine {other.id}")
        if url_port(url) in other.cfg.ports or url.rstrip("/") == other.cfg.url:
            raise CommandError(f"{url} is engine {other.id}'s address")
    now = node.clock.monotonic()
    engine = EngineRuntime(cfg=node.unconfigured_engine(engine_id, url), external=True,
                           incarnation=node.next_incarnation(engine_id),
                           main=key, procs={key: True}, launched_at=now, next_probe=now)
    node.engines[engine_id] = engine
    node.transition(engine, S.STARTING, Cause.LAUNCHED, f"external pid {key.pid}")
    node.track(engine)
    return {"engine": engine_id, "action": f"registered, incarnation {engine.incarnation}"}


def protected_pids(ops: ProcessOps) -> set[int]:
    """Processes that must never be treated as an engine: killing one kills the node, or us."""
    pids = {0, 1}
    pid = os.getpid()
    while pid > 1 and pid not in pids:
        pids.add(pid)
        stat = ops.read_stat(pid)
        pid = stat.ppid if stat else 0
    return pids


@command("unregister", Arg("engine", text(), required=True))
def unregister(node: Node, args: dict[str, Any]) -> dict[str, Any]:
    """Stop watching an external engine (it is not killed); it leaves the fleet view and the
    router at once.

    args: {"engine": ID}. result: {"engine": ID, "action": TEXT}
    """
    engine_id: str = args["engine"]
    engine = node.engines.get(engine_id)
    if engine is None or not engine.external:
        raise CommandError(f"no external engine {engine_id!r:.80}")
    if engine.kill is not None:
        raise CommandError(f"engine {engine_id} is being killed; try again when it is "
                           "stopped")
    node.forget(engine, "unregistered", "no longer watched (not killed)")
    return {"engine": engine_id, "action": "unregistered"}


@command("ping")
def ping(node: Node, args: dict[str, Any]) -> dict[str, Any]:
    """Check that the daemon answers. args: {}. result: {"node_id", "boot_id"}"""
    return {"node_id": node.node_id, "boot_id": node.boot_id}


# `launch` and `remove` (engines added at run time) live in their own module, in this table.
from rollout_watchdog.watchdog import runtime_engines  # noqa: E402,F401
