"""The node commands `launch` and `remove`: engines added to a running daemon, and taken away,
without its config file (DESIGN.md, "Runtime engines"). Registered in the node's command
table (commands.py), so the control socket and the coordinator run them alike.

A launched engine is an engine like a configured one from its first launch on: the supervisor
knows no difference (same ports and GPUs on every relaunch, the restart budget, the kill of the
whole tree, adoption). What is its own: its spec lives in launched.json (launched.py), and only
`remove` ends it.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from rollout_watchdog.common.commands import Arg, number, rule
from rollout_watchdog.common.protocol import BAD_ARGS
from rollout_watchdog.common.replies import CommandError, Deferred
from rollout_watchdog.common.states import Cause
from rollout_watchdog.common.validate import shown
from rollout_watchdog.config import ConfigError, read_engine
from rollout_watchdog.watchdog.commands import ENGINE, Node, command
from rollout_watchdog.watchdog.engine import AfterKill, EngineRuntime
from rollout_watchdog.watchdog.launched import conflicts
from rollout_watchdog.watchdog.status import engine_status

MAX_REMOVE_WAIT_S = 600.0


def _table(value: Any) -> str | None:
    """The shape of a spec (its fields are the config's to judge, with the node's defaults)."""
    if isinstance(value, dict) and isinstance(value.get("id"), str):
        return None
    return ("must be an [[engine]] table: a JSON object with at least 'id', 'url' and "
            f"'command', got {shown(value, 80)}")


@command("launch", Arg("spec", rule(_table), required=True))
def launch(node: Node, args: dict[str, Any]) -> dict[str, Any]:
    """Launch a new engine from a spec and supervise it like a configured one.

    The spec is one [[engine]] table of the config file, as JSON: "id", "url", "command"
    (argv), and optionally "gpus", "env", "ports", "tp_size", "restart_policy", "group", "cwd",
    and "probe"/"restart" (overrides of the node's [probe]/[restart]). It is checked by the
    config file's rules (a problem names the field, as check-config does: code BAD_ARGS) and
    refused, naming the other engine, when its id is already on the node (configured,
    launched or registered), one of its ports is in another engine's url or ports, or one of
    its GPUs in another engine's gpus. It gets exactly its spec's GPUs (CUDA_VISIBLE_DEVICES
    from "gpus"; an empty inherited value is never passed on). The spec is kept in the state
    dir before the answer: a daemon restart adopts the engine (same incarnation) or launches
    it again, until `remove`. As for a configured engine, the first launch waits until the
    engine's ports and GPUs are free.
    args: {"spec": TABLE}. result: {"engine": ID, "action": TEXT, "status": the engine's
    object of `status`}
    """
    table: dict[str, Any] = args["spec"]
    config = node.config
    try:
        cfg = read_engine(table, config.probe, config.restart)
    except ConfigError as exc:
        raise CommandError("; ".join(exc.problems), BAD_ARGS) from None
    problems = conflicts(cfg, node.engines.values(), config.metrics_port)
    if problems:
        raise CommandError(f"engine {cfg.id} not launched: " + "; ".join(problems))
    try:
        node.launched.put(cfg.id, table)
    except OSError as exc:
        raise CommandError(f"engine {cfg.id} not launched: its spec cannot be kept in "
                           f"{node.launched.path}: {exc.strerror or exc}") from None
    engine = EngineRuntime(cfg=cfg, launched=True)
    node.engines[cfg.id] = engine
    node.emit(engine, "launched", detail=f"launched at run time: {' '.join(cfg.command)}"[:500])
    node.launch_when_released(engine, Cause.LAUNCHED,
                              "waiting for the engine's ports and GPUs to be free")
    action = (f"launched, incarnation {engine.incarnation}" if engine.incarnation else
              "waiting for its ports and GPUs to be free before its first launch")
    status = engine_status(engine, node.clock, node.kernel_boot)
    return {"engine": cfg.id, "action": action, "status": status}


@command("remove", Arg("engine", ENGINE.kind, required=True),
         Arg("wait_s", number(0, maximum=MAX_REMOVE_WAIT_S)))
def remove(node: Node, args: dict[str, Any]) -> dict[str, Any] | Deferred:
    """Stop a launched engine (its whole tree, within its grace) and forget it.

    It leaves `status`, the fleet view and the router, and a daemon restart does not bring it
    back. A configured engine is refused (the config owns it: take it out of the file); so is
    a registered one (its owner stops it: `unregister` it). One that is in neither the config
    nor the launched specs is being stopped for good already (a remove that the daemon before
    this one began, sent again by the coordinator): answered as removed, once it is gone.
    args: {"engine": ID, "wait_s"?: S: answer once it is gone, or with an error after S (it is
    still being stopped, and forgotten when it is)}. result: {"engine": ID, "action": TEXT}
    """
    engine_id: str = args["engine"]
    engine = node.engines.get(engine_id)
    if engine is None:
        raise CommandError(f"no engine {engine_id!r:.80} on this node (engines: "
                           f"{', '.join(node.engines) or 'none'})")
    if engine.external:
        raise CommandError(f"engine {engine_id} is registered, not launched: `unregister` it "
                           "(its owner stops it)")
    if not engine.launched and any(cfg.id == engine_id for cfg in node.config.engines):
        raise CommandError(f"engine {engine_id} is in the config: the config owns it (take it "
                           "out of the file)")
    if engine.launched:
        try:
            node.launched.drop(engine_id)
        except OSError as exc:
            raise CommandError(f"engine {engine_id} not removed: its spec cannot be taken out "
                               f"of {node.launched.path}: {exc.strerror or exc}") from None
    # (else: in neither the config nor the launched specs, it is being stopped for good already:
    # a remove the daemon before this one began, sent again by the coordinator; or an engine
    # taken out of the config)
    action = _stop_for_good(node, engine)
    wait_s: float | None = args["wait_s"]
    if wait_s is None:
        return {"engine": engine_id, "action": action}
    if engine_id not in node.engines:   # gone already: the kill ended as it began
        return {"engine": engine_id,
                "action": action if action == "forgotten" else "stopped and forgotten"}

    def ready() -> dict[str, Any] | None:
        return None if node.engines.get(engine_id) is engine else {
            "engine": engine_id, "action": "stopped and forgotten"}

    def late() -> dict[str, Any]:
        raise CommandError(f"engine {engine_id} is still being stopped ({engine.state}) after "
                           f"{wait_s:g} s; it is forgotten once it is")
    return Deferred(ready, node.clock.monotonic() + wait_s, late)


def _stop_for_good(node: Node, engine: EngineRuntime) -> str:
    """Kill it, then forget it: without a command, the end of the kill forgets it, as it does
    an engine taken out of the config (and so does adoption, after a daemon crash mid-kill)."""
    engine.cfg = replace(engine.cfg, command=())
    engine.restart_requested = False
    engine.deferred_waiting = False
    engine.backoff_until = None
    if engine.kill is not None:
        engine.kill.after = AfterKill.STOP
        return "stopping, then forgotten"
    if engine.state.running:
        node.start_kill(engine, Cause.COMMANDED, "remove commanded", AfterKill.STOP)
        return "stopping, then forgotten"
    node.forget(engine, "removed", f"forgotten ({engine.state})")
    return "forgotten"
