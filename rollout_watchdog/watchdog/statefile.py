"""The daemon's state file: what a restarted daemon needs to adopt running engines.

Written atomically (temp file, then rename) so a crash mid-write leaves the previous version. No
fsync: the file is for surviving a daemon crash, which keeps the page cache; after a power loss
or reboot the kernel boot id differs and every recorded process is known to be gone. An
unreadable file is set aside and reported, and the daemon starts fresh.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import math
import os
from collections.abc import Callable
from dataclasses import MISSING, Field, dataclass, field, fields
from pathlib import Path
from typing import Any

from rollout_watchdog.common.atomic_file import write_atomically
from rollout_watchdog.common.lograte import worth_logging
from rollout_watchdog.common.states import Cause, EngineState
from rollout_watchdog.watchdog.engine import AfterKill, Failure
from rollout_watchdog.watchdog.incarnations import Incarnations
from rollout_watchdog.watchdog.process import ProcKey

log = logging.getLogger(__name__)
VERSION = 1
RESERVE_BYTES = 1024 * 1024


def kernel_boot_id() -> str:
    """Changes at every boot: pids recorded under another boot id are not this boot's."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return "unknown"


@dataclass
class EngineRecord:
    """One engine as the state file keeps it. This class is the one list of persisted fields:
    each is written and read through the codec of its type (CODECS), and every field that is
    not DERIVED is copied to and from the runtime attribute of the same name. Adding a
    persisted field is one line here (plus that attribute)."""

    state: EngineState
    incarnation: int
    state_since: float = 0.0
    restarts: int = 0
    relaunch_times: list[float] = field(default_factory=list)
    consecutive_failures: int = 0
    last_failure: Failure | None = None
    deferred_waiting: bool = False
    external: bool = False
    marker: str = ""
    cgroup: str = ""
    # derived from the runtime state rather than copied (see record_of / adoption)
    main: ProcKey | None = None
    procs: dict[ProcKey, bool] = field(default_factory=dict)
    launched_at: float = 0.0                 # wall clock
    # the pause's wall-clock deadline, kept as {"deadline": ...} as version 1 always was
    paused: float | None = field(default=None, metadata={"codec": "pause"})
    kill_cause: Cause | None = None
    kill_after: AfterKill | None = None
    url: str = ""

    def to_json(self) -> dict[str, Any]:
        return {f.name: _codec(f)[0](getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def from_json(cls, data: Any) -> EngineRecord:
        """Parse one record; ValueError (with the reason) for anything unusable."""
        if not isinstance(data, dict):
            raise ValueError("a record is a JSON object")
        values = {}
        try:
            for f in fields(cls):
                if f.name in data:
                    values[f.name] = _codec(f)[1](data[f.name])
                elif f.default is MISSING and f.default_factory is MISSING:
                    raise KeyError(f.name)
            record = cls(**values)
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
            raise ValueError(f"{type(exc).__name__}: {exc}") from None
        if record.main is not None:
            record.procs.setdefault(record.main, True)
        return record


def _finite(value: Any) -> float:
    if isinstance(value, bool):
        raise ValueError(f"not a number: {value!r}")
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"not a finite number: {value!r}")
    return number


def _strict_int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
        raise ValueError(f"not an integer: {value!r}")
    return int(value)


def _bool(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"not a boolean: {value!r}")
    return value


def _str(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"not a string: {value!r}")
    return value


def _procs(value: Any) -> dict[ProcKey, bool]:
    if not isinstance(value, list):
        raise ValueError(f"not a list of processes: {value!r:.80}")
    return {ProcKey.from_json(k): _bool(fatal) for k, fatal in value}


def _failure(value: Any) -> Failure:
    return Failure(Cause(value["cause"]), _str(value["detail"]), _finite(value["ts"]))


Codec = tuple[Callable[[Any], Any], Callable[[Any], Any]]


def _optional(encode: Callable[[Any], Any], decode: Callable[[Any], Any]) -> Codec:
    return ((lambda v: None if v is None else encode(v)),
            (lambda v: None if v is None else decode(v)))


# (encode, decode) by the annotation of the field, as written in EngineRecord.
CODECS: dict[str, Codec] = {
    "EngineState": (str, EngineState),
    "int": (int, _strict_int),
    "float": (float, _finite),
    "bool": (bool, _bool),
    "str": (str, _str),
    "list[float]": (list, lambda v: [_finite(t) for t in v]),
    "Failure | None": _optional(Failure.to_json, _failure),
    "ProcKey | None": _optional(ProcKey.to_json, ProcKey.from_json),
    "dict[ProcKey, bool]": (lambda v: [[k.to_json(), fatal] for k, fatal in v.items()], _procs),
    "float | None": _optional(float, _finite),
    "Cause | None": _optional(str, Cause),
    "AfterKill | None": _optional(lambda v: v.value, AfterKill),
    "pause": _optional(lambda v: {"deadline": v}, lambda v: _finite(v["deadline"])),
}


def _codec(f: Field[Any]) -> Codec:
    return CODECS[f.metadata.get("codec", str(f.type))]
DERIVED = frozenset({"main", "procs", "launched_at", "paused", "kill_cause", "kill_after", "url"})
COPIED = tuple(f.name for f in fields(EngineRecord) if f.name not in DERIVED)


@dataclass
class SavedState:
    engines: dict[str, dict[str, Any]]   # raw records: each is parsed (and may fail) on its own
    same_boot: bool
    # the high-water marks of incarnations handed out, per engine id (incarnations.py)
    incarnations: dict[str, int] = field(default_factory=dict)


def reserve_path(path: Path) -> Path:
    return path.with_name(path.name + ".reserve")


def make_reserve(path: Path) -> bool:
    """Set aside RESERVE_BYTES of disk beside the state file, for the day the disk fills up
    (engine logs are a realistic way): the state file is then written in the reserve's
    place, so a relaunch is never left unrecorded. True if the reserve is there."""
    reserve = reserve_path(path)
    if reserve.exists():
        return True
    try:
        fd = os.open(reserve, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            os.posix_fallocate(fd, 0, RESERVE_BYTES)
        finally:
            os.close(fd)
    except OSError as exc:
        with contextlib.suppress(OSError):
            reserve.unlink()
        log.debug("cannot reserve %d bytes beside the state file %s: %s", RESERVE_BYTES, path,
                  exc.strerror or exc)
        return False
    return True


def save_state(path: Path, node_id: str, engines: dict[str, EngineRecord],
               incarnations: dict[str, int] | None = None,
               journal: dict[str, Any] | None = None) -> bool:
    """Write the state; False (and a log line) if the disk refused. A full disk gives up the
    reserve (make_reserve) and tries once more. `incarnations` (the marks of incarnations.py)
    are kept even when `engines` is empty (a clean stop): a number never comes back.
    `journal`: where the event journal ends now (previous_run.Anchor)."""
    data = {"version": VERSION, "node_id": node_id, "boot_id": kernel_boot_id(),
            "engines": {i: r.to_json() for i, r in engines.items()},
            "incarnations": dict(incarnations or {}), "events": journal}
    try:
        write_json(path, data)
        return _written(path)
    except OSError as exc:
        error = exc
    if error.errno in (errno.ENOSPC, errno.EDQUOT) and reserve_path(path).exists():
        with contextlib.suppress(OSError):
            reserve_path(path).unlink()
        log.error("the disk under %s is full: the state file takes the reserved space; free "
                  "some disk", path.parent)
        try:
            write_json(path, data)
            return _written(path)
        except OSError as exc:
            error = exc
    failures = _FAILED_SAVES[path] = _FAILED_SAVES.get(path, 0) + 1
    if worth_logging(failures):   # (the daemon saves many times a second: not a line each)
        log.error("cannot write state file %s: %s (engines cannot be adopted across a daemon "
                  "restart until this is fixed; failure #%d in a row)", path,
                  error.strerror or error, failures)
    return False


# The saves of each state file that failed in a row (their log lines are rate-limited).
_FAILED_SAVES: dict[Path, int] = {}


def _written(path: Path) -> bool:
    failures = _FAILED_SAVES.pop(path, 0)
    if failures:
        log.warning("state file %s written again, after %d failed save(s)", path, failures)
    return True


def write_json(path: Path, data: dict[str, Any], *, durable: bool = False) -> None:
    """Write `data` as JSON to `path` atomically (common.atomic_file), mode 0600."""
    write_atomically(path, json.dumps(data).encode(), durable=durable)


def journal_anchor(path: Path) -> Any:
    """The state file's anchor of the event journal, unparsed (None when there is none, or no
    readable file: load_state says why)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError):
        return None
    return data.get("events") if isinstance(data, dict) else None


def set_journal_anchor(path: Path, anchor: dict[str, Any]) -> None:
    """Put this run's anchor of the event journal in the state file at once, the rest of it as
    it is (adoption reads it next): lines this run writes before its first save must not be
    read back as the previous run's by the next start."""
    try:
        data = json.loads(path.read_text())
        if isinstance(data, dict):
            write_json(path, {**data, "events": anchor})
    except FileNotFoundError:
        return
    except (OSError, ValueError, RecursionError) as exc:
        log.warning("cannot anchor the event journal in %s (%s): a restart before the first "
                    "save may show this run's first events as the previous run's", path, exc)


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
    try:
        marks = Incarnations.from_json(data.get("incarnations", {})).issued
    except ValueError as exc:   # the records still count; adoption takes marks from them
        log.error("state file %s: %s; incarnation marks taken from the records alone",
                  path, exc)
        marks = {}
    return SavedState(engines, same_boot=data.get("boot_id") == kernel_boot_id(),
                      incarnations=marks)
