"""The daemon's state file: what a restarted daemon needs to adopt running engines.

Written atomically (temp file, then rename) so a crash mid-write leaves the previous version. No
fsync: the file is for surviving a daemon crash, which keeps the page cache; after a power loss
or reboot the kernel boot id differs and every recorded process is known to be gone. An
unreadable file is set aside and reported, and the daemon starts fresh.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollout_watchdog.watchdog.engine import AfterKill, Failure, Pause
from rollout_watchdog.watchdog.process import ProcKey
from rollout_watchdog.watchdog.states import Cause, EngineState

log = logging.getLogger(__name__)
VERSION = 1


def kernel_boot_id() -> str:
    """Changes at every boot: pids recorded under another boot id are not this boot's."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return "unknown"


@dataclass
class EngineRecord:
    """One engine as the state file keeps it."""

    state: EngineState
    incarnation: int
    state_since: float = 0.0
    restarts: int = 0
    relaunch_times: list[float] = field(default_factory=list)
    consecutive_failures: int = 0
    main: ProcKey | None = None
    procs: dict[ProcKey, bool] = field(default_factory=dict)
    launched_at: float = 0.0                 # wall clock
    paused: Pause | None = None
    last_failure: Failure | None = None
    deferred_waiting: bool = False
    kill_cause: Cause | None = None
    kill_after: AfterKill | None = None
    external: bool = False
    url: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "state": str(self.state), "incarnation": self.incarnation,
            "state_since": self.state_since, "restarts": self.restarts,
            "relaunch_times": self.relaunch_times,
            "consecutive_failures": self.consecutive_failures,
            "main": self.main.to_json() if self.main else None,
            "procs": [[k.to_json(), fatal] for k, fatal in self.procs.items()],
            "launched_at": self.launched_at,
            "paused": {"deadline": self.paused.deadline, "source": self.paused.source}
            if self.paused else None,
            "last_failure": self.last_failure.to_json() if self.last_failure else None,
            "deferred_waiting": self.deferred_waiting,
            "kill_cause": str(self.kill_cause) if self.kill_cause else None,
            "kill_after": self.kill_after.value if self.kill_after else None,
            "external": self.external, "url": self.url,
        }

    @classmethod
    def from_json(cls, data: Any) -> EngineRecord:
        """Parse one record; ValueError (with the reason) for anything unusable."""
        try:
            pause = data.get("paused")
            failure = data.get("last_failure")
            record = cls(
                state=EngineState(data["state"]),
                incarnation=int(data["incarnation"]),
                state_since=_finite(data.get("state_since", 0.0)),
                restarts=int(data.get("restarts", 0)),
                relaunch_times=[_finite(t) for t in data.get("relaunch_times", [])],
                consecutive_failures=int(data.get("consecutive_failures", 0)),
                main=ProcKey.from_json(data["main"]) if data.get("main") else None,
                procs={ProcKey.from_json(k): bool(fatal) for k, fatal in data.get("procs", [])},
                launched_at=_finite(data.get("launched_at", 0.0)),
                paused=Pause(_finite(pause["deadline"]), str(pause.get("source", "local")))
                if pause else None,
                last_failure=Failure(Cause(failure["cause"]), str(failure["detail"]),
                                     _finite(failure["ts"])) if failure else None,
                deferred_waiting=bool(data.get("deferred_waiting", False)),
                kill_cause=Cause(data["kill_cause"]) if data.get("kill_cause") else None,
                kill_after=AfterKill(data["kill_after"]) if data.get("kill_after") else None,
                external=bool(data.get("external", False)),
                url=str(data.get("url", "")),
            )
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
            raise ValueError(f"{type(exc).__name__}: {exc}") from None
        if record.main is not None:
            record.procs.setdefault(record.main, True)
        return record


def _finite(value: Any) -> float:
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"not a finite number: {value!r}")
    return number


@dataclass
class SavedState:
    engines: dict[str, dict[str, Any]]   # raw records: each is parsed (and may fail) on its own
    same_boot: bool


def save_state(path: Path, node_id: str, engines: dict[str, EngineRecord]) -> bool:
    """Write the state; False (and a log line) if the disk refused."""
    tmp = path.with_name(path.name + ".tmp")
    data = {"version": VERSION, "node_id": node_id, "boot_id": kernel_boot_id(),
            "engines": {i: r.to_json() for i, r in engines.items()}}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "w") as f:
            json.dump(data, f)
        os.replace(tmp, path)
        return True
    except OSError as exc:
        log.error("cannot write state file %s: %s (engines cannot be adopted across a daemon "
                  "restart until this is fixed)", path, exc.strerror or exc)
        return False


def load_state(path: Path) -> SavedState | None:
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as exc:
        log.error("cannot read state file %s: %s; starting fresh", path, exc.strerror or exc)
        return None
    try:
        data = json.loads(text)
        if not isinstance(data, dict) or data.get("version") != VERSION:
            raise ValueError(f"unknown state file version {data.get('version')!r}"
                             if isinstance(data, dict) else "not a JSON object")
        engines = data.get("engines", {})
        if not isinstance(engines, dict):
            raise ValueError("'engines' is not an object")
    except (ValueError, RecursionError) as exc:
        aside = path.with_name(path.name + ".corrupt")
        log.error("state file %s is unusable (%s); moved to %s, starting fresh", path, exc, aside)
        with contextlib.suppress(OSError):
            os.replace(path, aside)
        return None
    return SavedState(engines, same_boot=data.get("boot_id") == kernel_boot_id())
