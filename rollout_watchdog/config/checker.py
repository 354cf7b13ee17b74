"""Reading one table of the node config: each value checked against its type and bound, every
problem collected as one line that names the key (the config collects them all, then raises)."""

from __future__ import annotations

import math
from typing import Any

from rollout_watchdog.common.validate import URL_PATH, shown, text_problem

_DAY = 86400.0
# Upper bound of every timing key, with the words the message uses. Values beyond these are
# mistakes (and some, like 1e10, overflow the OS timeouts the probes use).
_MAX_SECONDS: dict[str, tuple[float, str]] = {
    "liveness_interval_s": (_DAY, "1 day"),
    "health_interval_s": (_DAY, "1 day"),
    "health_timeout_s": (_DAY, "1 day"),
    "startup_timeout_s": (7 * _DAY, "7 days"),
    "progress_timeout_s": (_DAY, "1 day"),
    "grace_s": (_DAY, "1 day"),
    "backoff_initial_s": (_DAY, "1 day"),
    "backoff_max_s": (_DAY, "1 day"),
    "window_s": (30 * _DAY, "30 days"),
    "stable_s": (7 * _DAY, "7 days"),
    "kill_timeout_s": (_DAY, "1 day"),
    "release_timeout_s": (_DAY, "1 day"),
}

def type_name(value: object) -> str:
    return {bool: "boolean", int: "integer", float: "number", str: "string", list: "array",
            dict: "table"}.get(type(value), type(value).__name__)


class Checker:
    """Collects problems while reading one table; `where` prefixes every line."""

    def __init__(self, problems: list[str], where: str, table: dict[str, Any]) -> None:
        self.problems = problems
        self.where = where
        self.table = table
        self.failed: set[str] = set()  # keys that had a problem

    def problem(self, key: str, text: str) -> None:
        self.failed.add(key)
        self.problems.append(f"{self.where}key '{key}' {text}")

    def unknown(self, allowed: set[str]) -> None:
        for key in self.table:
            if key not in allowed:
                self.problems.append(f"{self.where}unknown key '{key}'")

    def seconds(self, key: str, default: float, *, zero_ok: bool = False) -> float:
        """A duration: a finite number above 0 (or 0 if `zero_ok`) and within the key's bound."""
        value = self.table.get(key, default)
        maximum, words = _MAX_SECONDS[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            self.problem(key, f"must be a number, got {type_name(value)}")
            return default
        if not math.isfinite(value) or value > maximum:
            self.problem(key, f"must be a finite number of seconds, at most {maximum:.0f} "
                              f"({words}), got {value}")
            return default
        if value < 0 or (value == 0 and not zero_ok):
            self.problem(key, f"must be {'>= 0' if zero_ok else '> 0'}, got {value}")
            return default
        return float(value)

    def integer(self, key: str, default: int | None, *, minimum: int = 0,
                maximum: int | None = None) -> int | None:
        value = self.table.get(key, default)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            self.problem(key, f"must be an integer, got {type_name(value)}")
            return default
        if value < minimum or (maximum is not None and value > maximum):
            bound = f"between {minimum} and {maximum}" if maximum is not None else f">= {minimum}"
            self.problem(key, f"must be {bound}, got {value}")
            return default
        return value

    def string(self, key: str, default: str | None, *, choices: tuple[str, ...] = ()
               ) -> str | None:
        value = self.table.get(key, default)
        if value is None:
            return None
        if not isinstance(value, str):
            self.problem(key, f"must be a string, got {type_name(value)}")
            return default
        if choices and value not in choices:
            self.problem(key, f"must be one of {', '.join(choices)}, got {value!r}")
            return default
        return value

    def int_list(self, key: str, *, maximum: int) -> tuple[int, ...]:
        value = self.table.get(key, [])
        if not isinstance(value, list) or any(
                isinstance(v, bool) or not isinstance(v, int) for v in value):
            self.problem(key, "must be a list of integers")
            return ()
        if bad := [v for v in value if not 0 <= v <= maximum]:
            self.problem(key, f"has values out of the range 0 to {maximum}: {shown(bad)}")
            return ()
        return tuple(value)

    def url_path(self, key: str, default: str, *, off: str) -> str:
        """An HTTP path for a probe, or "" (`off` says what "" means)."""
        path = self.string(key, default) or ""
        if path and not URL_PATH.fullmatch(path):
            self.problem(key, f"must start with '/' and hold only printable ASCII without spaces "
                              f"(or be \"\" {off}), got {shown(path)}")
            return default
        return path

    def name(self, key: str, default: str) -> str:
        """A non-empty string without control characters (a node id, a directory)."""
        value = self.string(key, default) or ""
        if problem := text_problem(value):
            self.problem(key, problem)
            return default
        return value
