"""Engines launched at run time (the `launch` command): their specs on disk, the rule that keeps
them apart from the node's other engines, and their return when the daemon starts.

Each spec is kept, as the `[[engine]]` table it was launched with, in `launched.json` beside
the state file, written (atomically) before the reply, so a daemon SIGKILLed right after it
still knows the engine. The state file says which process is which engine's, as for configured
engines; this file only says that the engine exists. It is left alone by a clean stop: a
launched engine, like a configured one, comes back when the daemon starts again, until
`remove` forgets it. A spec is read again at each start by the config file's rules, merged
with the node's current `[probe]`/`[restart]` defaults, as a configured engine is.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from rollout_watchdog.config import ConfigError, EngineConfig, NodeConfig, read_engine
from rollout_watchdog.config.engine_argv import url_port
from rollout_watchdog.watchdog.engine import EngineRuntime
from rollout_watchdog.watchdog.statefile import write_json

log = logging.getLogger("rollout_watchdog.watchdog")
LAUNCHED_FILE = "launched.json"
VERSION = 1


class LaunchedSpecs:
    """The specs of the launched engines, by id, and the file that keeps them."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.tables: dict[str, dict[str, Any]] = {}

    def load(self) -> dict[str, dict[str, Any]]:
        """The specs on disk; an unreadable file is set aside (named in the log) and none
        are restored from it."""
        try:
            data = json.loads(self.path.read_text())
            if not isinstance(data, dict) or data.get("version") != VERSION:
                raise ValueError("not a version 1 file of launched engines")
            tables = data.get("engines")
            if not isinstance(tables, dict) or not all(
                    isinstance(t, dict) for t in tables.values()):
                raise ValueError("'engines' is not an object of [[engine]] tables")
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, RecursionError) as exc:
            aside = self.path.with_name(self.path.name + ".corrupt")
            log.error("%s is unusable (%s); moved to %s: no launched engine restored",
                      self.path, exc, aside)
            with contextlib.suppress(OSError):
                self.path.replace(aside)
            return {}
        self.tables = {str(k): v for k, v in tables.items()}
        return dict(self.tables)

    def put(self, engine_id: str, table: dict[str, Any]) -> None:
        """Keep a spec (OSError if the disk refused: then it is not kept)."""
        self._write({**self.tables, engine_id: table})

    def drop(self, engine_id: str) -> None:
        """Forget a spec (OSError if the disk refused: then it is still kept)."""
        if engine_id in self.tables:
            self._write({k: v for k, v in self.tables.items() if k != engine_id})

    def _write(self, tables: dict[str, dict[str, Any]]) -> None:
        write_json(self.path, {"version": VERSION, "engines": tables}, durable=True)
        self.tables = tables


def conflicts(new: EngineConfig, others: Iterable[EngineRuntime],
              metrics_port: int | None = None) -> list[str]:
    """Why `new` cannot join the node's engines `others` (configured, launched or
    registered), each problem naming the other engine; [] if it can."""
    problems = []
    for other in others:
        if other.id == new.id:
            problems.append(f"engine id {new.id} is already on this node ({other.origin} "
                            f"engine {other.id}, {other.state})")
            continue
        url = url_port(other.cfg.url)
        for port in new.ports:
            if port == url:
                problems.append(f"port {port} is already in engine {other.id}'s url "
                                f"({other.cfg.url})")
            elif port in other.cfg.ports:
                problems.append(f"port {port} is already one of engine {other.id}'s ports")
        problems += [f"GPU {gpu} is already in engine {other.id}'s gpus"
                     for gpu in new.gpus if gpu in other.cfg.gpus]
    if metrics_port is not None and metrics_port in new.ports:
        problems.append(f"port {metrics_port} is the node's metrics_port")
    return problems


def restore(specs: LaunchedSpecs, config: NodeConfig,
            engines: dict[str, EngineRuntime]) -> list[EngineRuntime]:
    """At start, before adoption: the launched engines back among `engines` (the configured
    ones), so that adoption takes over their processes (same incarnation) or launches them.
    The config wins: a spec whose id, port or GPU a configured engine now holds is dropped,
    and the log says so."""
    restored = []
    for engine_id, table in specs.load().items():
        try:
            cfg = read_engine(table, config.probe, config.restart, check_commands=False)
            if cfg.id != engine_id:
                raise ConfigError([f"kept under id {engine_id!r}, but its table says "
                                   f"{cfg.id!r}"])
        except ConfigError as exc:
            log.error("launched engine %s is dropped, its spec is no longer valid: %s",
                      engine_id, "; ".join(exc.problems))
            _drop(specs, engine_id)
            continue
        problems = conflicts(cfg, engines.values(), config.metrics_port)
        if problems:
            log.warning("launched engine %s is dropped: the config wins (%s)", engine_id,
                        "; ".join(problems))
            _drop(specs, engine_id)
            continue
        engine = EngineRuntime(cfg=cfg, launched=True)
        engines[engine_id] = engine
        restored.append(engine)
    return restored


def _drop(specs: LaunchedSpecs, engine_id: str) -> None:
    try:
        specs.drop(engine_id)
    except OSError as exc:
        log.error("cannot forget the spec of %s in %s: %s", engine_id, specs.path,
                  exc.strerror or exc)
