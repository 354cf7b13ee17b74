"""Adoption: what a daemon that (re)starts does with the engines a previous daemon left behind.

The state file says which processes were which engine's (pid plus start time, so a reused pid
is never taken for ours). A recorded engine still running is supervised exactly as before; one
that died while no daemon watched is an exit seen now; an engine the config no longer lists is
stopped. A state file that is missing, unusable or behind (a full disk) does not get live
engines killed: the newest incarnation whose processes carry an engine's environment marker is
adopted instead, and every marked number counts as handed out. `record_of` is the other half:
what the state file keeps of an engine.
"""

from __future__ import annotations

import logging
from typing import Any

from rollout_watchdog.common.clock import Clock
from rollout_watchdog.common.states import Cause, EngineState
from rollout_watchdog.watchdog.containment import parse_marker
from rollout_watchdog.watchdog.engine import AfterKill, EngineRuntime, Pause
from rollout_watchdog.watchdog.incarnations import Incarnations
from rollout_watchdog.watchdog.process import ProcStat
from rollout_watchdog.watchdog.statefile import COPIED, EngineRecord, SavedState
from rollout_watchdog.watchdog.supervisor import Supervisor

log = logging.getLogger("rollout_watchdog.watchdog")
S = EngineState


def record_of(e: EngineRuntime, clock: Clock) -> EngineRecord:
    """What the state file keeps of an engine."""
    return EngineRecord(
        **{name: getattr(e, name) for name in COPIED},
        main=e.main, procs={k: fatal for k, fatal in e.procs.items() if k not in e.dead},
        launched_at=clock.to_wall(e.launched_at),
        paused=e.paused.deadline if e.paused else None,
        kill_cause=e.kill.cause if e.kill else None, kill_after=e.kill.after if e.kill else None,
        url=e.cfg.url)


def adopt_or_launch(sup: Supervisor, saved: SavedState | None) -> None:
    """Adopt what the state file records, launch the rest; no process is taken for an
    escapee until every engine is restored (Escapees.ready)."""
    sup.escapees.ready = False
    try:
        _adopt_or_launch(sup, saved)
    finally:
        sup.escapees.ready = True


def _adopt_or_launch(sup: Supervisor, saved: SavedState | None) -> None:
    records = saved.engines if saved else {}
    same_boot = saved is not None and saved.same_boot
    sup.incarnations = Incarnations(saved.incarnations if saved else None)
    if saved and not same_boot:
        log.warning("the state file is from before a reboot: no recorded process is alive")
    running = _marked(sup)
    for engine in list(sup.engines.values()):
        record = _parse_record(engine.id, records.get(engine.id))
        newer = running.get(engine.id)
        if newer is not None and (record is None or not same_boot
                                  or newer.incarnation > record.incarnation):
            log.warning("engine %s: incarnation %d still runs (its processes carry its marker) "
                        "but the state file does not record it: adopted, its probes decide",
                        engine.id, newer.incarnation)
            adopt(sup, engine, newer, same_boot=True)
        elif record is None:
            sup.launch_when_released(engine, Cause.LAUNCHED,
                                     "waiting for the engine's ports and GPUs to be free")
        else:
            adopt(sup, engine, record, same_boot=same_boot)
    if not same_boot:
        return
    for engine_id, raw in records.items():
        if engine_id in sup.engines:
            continue
        record = _parse_record(engine_id, raw)
        if record is not None and (record.state.running or record.state == S.STOPPING):
            _adopt_unconfigured(sup, engine_id, record)


def _marked(sup: Supervisor) -> dict[str, EngineRecord]:
    """The newest launch of each engine whose processes still run, as their environment marker
    says (node, state dir, engine, incarnation, launch): a state file that is missing,
    unusable or behind (a full disk) must not get live engines killed as escapees and their
    numbers handed out again. Every marked incarnation's number is taken as seen. Its main
    process is the one that leads its process group (each launch starts a session of its own);
    without it (the main died, children live) the record names none, and adopting it fails it
    as exited at once, its processes killed."""
    table = sup.ops.process_table()
    launches: dict[str, list[ProcStat]] = {}   # marker -> its processes
    for stat, value in sup.tracker.escapees(table):
        marker = parse_marker(value)
        if marker is not None and marker.node_id == sup.marker_node:
            sup.incarnations.seen(marker.engine_id, marker.incarnation)
            launches.setdefault(value, []).append(stat)
    newest: dict[str, tuple[tuple[int, float], str]] = {}   # engine -> (its rank, marker)
    for value, stats in launches.items():
        marker = parse_marker(value)
        assert marker is not None
        rank = (marker.incarnation, min(s.start_time for s in stats))   # (two launches of
        if marker.engine_id not in newest or rank > newest[marker.engine_id][0]:   # one number)
            newest[marker.engine_id] = (rank, value)
    out = {}
    for engine_id, ((incarnation, _), value) in newest.items():
        stats = launches[value]
        main = next((s.key for s in stats if s.pid == s.pgrp), None)
        token = value.rsplit("/", 1)[1]
        cgroup = sup.cgroups.path(engine_id, incarnation, token) if sup.cgroups else None
        out[engine_id] = EngineRecord(
            EngineState.STARTING, incarnation, marker=value, main=main,
            procs={s.key: s.key == main for s in stats}, launched_at=sup.clock.wall(),
            cgroup=str(cgroup) if cgroup is not None and cgroup.is_dir() else "")
    return out


def _parse_record(engine_id: str, raw: Any) -> EngineRecord | None:
    if raw is None:
        return None
    try:
        return EngineRecord.from_json(raw)
    except ValueError as exc:
        log.error("the saved state of engine %s is unusable (%s): starting it fresh",
                  engine_id, exc)
        return None


def adopt(sup: Supervisor, engine: EngineRuntime, record: EngineRecord, *,
          same_boot: bool) -> None:
    """Take over an engine recorded by a previous daemon: the same processes if they still
    run (the same processes: pid plus start time), else its death is an exit seen now."""
    clock = sup.clock
    for name in COPIED:
        setattr(engine, name, getattr(record, name))
    sup.incarnations.seen(engine.id, record.incarnation)   # a state file without the marks
    engine.state_since = record.state_since or clock.wall()
    if record.state in (S.FAILED, S.STOPPED, S.BACKOFF):
        if record.state == S.BACKOFF and not record.deferred_waiting:
            engine.backoff_until = clock.monotonic()
        sup.emit(engine, "adopted", to=str(engine.state),
                 detail=f"kept {record.state} from the previous daemon")
        if (record.state == S.STOPPED and record.kill_after == AfterKill.RESTART
                and engine.cfg.command):
            # it was waiting for its ports before a launch: it still is
            sup.launch_when_released(engine, record.kill_cause or Cause.LAUNCHED,
                                     "waiting for the engine's ports and GPUs to be free")
        return
    now = clock.monotonic()
    if same_boot:
        engine.main = record.main
        engine.procs = dict(record.procs)
    engine.launched_at = clock.to_monotonic(record.launched_at)
    engine.next_probe = now
    if record.state in (S.HEALTHY, S.SUSPECT):
        engine.healthy_since = now
    if record.paused is not None and record.paused > clock.wall():
        engine.paused = Pause(record.paused, clock.to_monotonic(record.paused))
    alive = engine.main is not None and sup.ops.is_alive(engine.main)
    sup.emit(engine, "adopted", to=str(engine.state), detail=(
        f"pid {engine.main.pid} still running, kept in {record.state}"
        if alive and engine.main else "its main process is gone"))
    if record.state == S.STOPPING:  # resume the kill the previous daemon had begun
        sup.tracker.watch_all(engine)
        sup.start_kill(engine, record.kill_cause or Cause.COMMANDED,
                       "kill resumed after a daemon restart",
                       record.kill_after or AfterKill.RECOVER)
        return
    # A process that died while the daemon was down is an exit seen now.
    sup.tracker.watch_all(engine)
    if engine.main is None and engine.state.running:
        sup.fail(engine, Cause.EXITED, "its processes did not survive a reboot"
                 if not same_boot else "no main process recorded", now)


def _adopt_unconfigured(sup: Supervisor, engine_id: str, record: EngineRecord) -> None:
    """An engine the state file knows but the config does not: an external one is watched
    again; one removed from the config is stopped, not left running unwatched."""
    engine = EngineRuntime(cfg=sup.unconfigured_engine(engine_id, record.url),
                           external=record.external)
    sup.engines[engine_id] = engine
    if record.external:  # watched exactly as before: state, pause, kill in progress
        adopt(sup, engine, record, same_boot=True)
        return
    engine.state, engine.incarnation = S.STOPPING, record.incarnation
    sup.incarnations.seen(engine_id, record.incarnation)
    engine.main, engine.procs = record.main, dict(record.procs)
    sup.emit(engine, "removed_from_config", detail="stopping it")
    sup.tracker.watch_all(engine)
    sup.start_kill(engine, Cause.COMMANDED, "removed from the config", AfterKill.STOP)
