"""What every message of the wire protocol shares (protocol.py is the spec): its version, the
JSON mapping of its fields, and the field checks whose errors name the field."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import MISSING, Field, dataclass, fields
from typing import Any, ClassVar, TypeVar

from rollout_watchdog.common.json_frame import ProtocolError

MAJOR = 1
MINOR = 6
VERSION = (MAJOR, MINOR)
_INT_LIMIT = 1 << 63


def _fail(kind: str, name: str, expected: str, value: object) -> ProtocolError:
    shown = repr(value)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    return ProtocolError(f"{kind}: field {name!r} must be {expected}, got {shown}")


def _missing(kind: str, name: str) -> ProtocolError:
    """The error for a message without a required field (`from_json`'s, each message kind's)."""
    return ProtocolError(f"{kind}: missing required field {name!r}")


def _check_str(kind: str, name: str, value: object, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not isinstance(value, str) or not value:
        raise _fail(kind, name, "a non-empty string", value)


def _check_int(kind: str, name: str, value: object, minimum: int) -> None:
    if (isinstance(value, int) and value >= _INT_LIMIT) or (
            type(value) is float and abs(value) >= _INT_LIMIT and value.is_integer()):
        # (an integer beyond 64 bits unsigned is parsed as a float: json_frame)
        raise ProtocolError(f"{kind}: field {name!r}: integer does not fit in 64 bits")
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value:
        raise _fail(kind, name, f"an integer >= {minimum}", value)


def _as_float(kind: str, name: str, value: object, *, positive: bool = False) -> float:
    """A finite number as a float (JSON writes 1.0 as 1); refused otherwise."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
        if math.isfinite(number) and (number > 0 or not positive):
            return number
    raise _fail(kind, name, "a positive finite number" if positive else "a finite number", value)


def _check_bool(kind: str, name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise _fail(kind, name, "true or false", value)


def _check_object(kind: str, name: str, value: object) -> None:
    """A JSON object (keys from the wire are strings: JSON has no others)."""
    if not isinstance(value, dict):
        raise _fail(kind, name, "an object", value)


def _plain_version(version: object) -> bool:
    """Whether `version` is plainly [MAJOR, any minor] (the common case, in one check)."""
    return (type(version) is list and len(version) == 2 and version[0] == MAJOR
            and type(version[0]) is int and type(version[1]) is int and version[1] >= 0)


def _plain_event(node_id: object, boot: object, seq: object, event: object, status: object
                 ) -> bool:
    """Whether an event's fields are plainly valid (the common case, checked in one go: the
    coordinator's hot path); anything else gets Event's full checks and their exact error."""
    return (type(node_id) is str and node_id != "" and type(boot) is str and boot != ""
            and type(seq) is int and 1 <= seq < _INT_LIMIT and type(event) is dict
            and (status is None or (type(status) is dict and type(status.get("id")) is str
                                    and status["id"] != "")))


_M = TypeVar("_M", bound="_Message")


_FIELDS: dict[type, tuple[Field[Any], ...]] = {}
_NAMES: dict[type, tuple[tuple[str, bool], ...]] = {}


def _fields_of(cls: type) -> tuple[Field[Any], ...]:
    """A message class's fields (dataclasses.fields() costs a lookup on every message)."""
    found = _FIELDS.get(cls)
    if found is None:
        found = _FIELDS[cls] = fields(cls)
    return found


def _field_names(cls: type) -> tuple[tuple[str, bool], ...]:
    """(name, required) of each of a message class's fields."""
    found = _NAMES.get(cls)
    if found is None:
        found = _NAMES[cls] = tuple(
            (f.name, f.default is MISSING and f.default_factory is MISSING)
            for f in _fields_of(cls))
    return found


@dataclass(frozen=True)
class _Message:
    """Common JSON mapping: a message's fields are its JSON fields, plus "v" and "kind"."""

    KIND: ClassVar[str]

    def to_json(self) -> dict[str, Any]:
        body = {f.name: getattr(self, f.name) for f in _fields_of(type(self))}
        return {"v": list(VERSION), "kind": self.KIND, **body}

    @classmethod
    def from_json(cls: type[_M], obj: Mapping[str, Any]) -> _M:
        """The message in `obj` (its envelope already checked); unknown fields are ignored,
        and an optional one that is null is as if absent (the spec's "?": its default)."""
        known: dict[str, Any] = {}
        for name, required in _field_names(cls):
            if name in obj and (required or obj[name] is not None):
                known[name] = obj[name]
            elif required:
                raise _missing(cls.KIND, name)
        return cls(**known)
