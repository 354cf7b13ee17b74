"""The control messages of the wire protocol (protocol.py is the spec): a command, its reply
with the error codes, and a client's subscription to the event stream."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from rollout_watchdog.common.json_frame import ProtocolError
from rollout_watchdog.common.message_base import (
    _as_float,
    _check_bool,
    _check_int,
    _check_object,
    _check_str,
    _fail,
    _Message,
    _missing,
)

STATUSES = ("ok", "error")
# The reply's error codes (1.2), spelled out in the spec above.
LOCK_HELD = "LOCK_HELD"
LEASE_LOST = "LEASE_LOST"
BAD_ARGS = "BAD_ARGS"
UNKNOWN_COMMAND = "UNKNOWN_COMMAND"
UNKNOWN_NODE = "UNKNOWN_NODE"
NODE_UNREACHABLE = "NODE_UNREACHABLE"
NODE_ERRORS = "NODE_ERRORS"
NOT_SAVED = "NOT_SAVED"
TOO_BIG = "TOO_BIG"
INTERNAL = "INTERNAL"
BUSY = "BUSY"
CODES = (LOCK_HELD, LEASE_LOST, BAD_ARGS, UNKNOWN_COMMAND, UNKNOWN_NODE, NODE_UNREACHABLE,
         NODE_ERRORS, NOT_SAVED, TOO_BIG, INTERNAL, BUSY)
MAX_CODE_CHARS = 64


@dataclass(frozen=True)
class Command(_Message):
    """A control command, scoped to every node, one node, or one engine of one node."""

    KIND: ClassVar[str] = "command"
    request_id: str
    cmd: str
    args: dict[str, Any] = field(default_factory=dict)
    node: str | None = None
    engine: str | None = None
    timeout_s: float | None = None

    def __post_init__(self) -> None:
        _check_str(self.KIND, "request_id", self.request_id)
        _check_str(self.KIND, "cmd", self.cmd)
        _check_object(self.KIND, "args", self.args)
        _check_str(self.KIND, "node", self.node, optional=True)
        _check_str(self.KIND, "engine", self.engine, optional=True)
        if self.engine is not None and self.node is None:
            raise ProtocolError(f"command: engine {self.engine!r} given without its node (an "
                                "engine id is only unique within a node)")
        if self.timeout_s is not None:
            timeout = _as_float(self.KIND, "timeout_s", self.timeout_s, positive=True)
            object.__setattr__(self, "timeout_s", timeout)


@dataclass(frozen=True)
class Reply(_Message):
    """The answer to the command with the same request id."""

    KIND: ClassVar[str] = "reply"
    request_id: str
    status: str
    reason: str | None = None
    result: Any = None
    code: str | None = None   # 1.2

    def __post_init__(self) -> None:
        if (type(self.request_id) is str and self.request_id != "" and self.code is None
                and self.status == "ok" and (self.reason is None or (
                    type(self.reason) is str and self.reason != ""))):
            return   # a plain "ok" reply, checked in one go (a fleet-wide pause: 1,000 of them)
        _check_str(self.KIND, "request_id", self.request_id)
        if self.status not in STATUSES:
            raise _fail(self.KIND, "status", '"ok" or "error"', self.status)
        _check_str(self.KIND, "reason", self.reason, optional=self.status == "ok")
        if self.code is None:
            return
        if self.status == "ok":
            raise _fail(self.KIND, "code", "null in an \"ok\" reply", self.code)
        _check_str(self.KIND, "code", self.code)
        if len(self.code) > MAX_CODE_CHARS:
            raise _fail(self.KIND, "code", f"at most {MAX_CODE_CHARS} characters", self.code)

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> Reply:
        try:   # (_Message's, written out: a fleet-wide pause is a thousand of them)
            return cls(obj["request_id"], obj["status"], obj.get("reason"), obj.get("result"),
                       obj.get("code"))
        except KeyError as exc:   # the first missing one, in field order, as _Message says
            raise _missing(cls.KIND, exc.args[0]) from None

    def to_json(self) -> dict[str, Any]:
        """Without `code` when there is none: an "ok" reply is what a 1.1 peer sends."""
        body = super().to_json()
        if self.code is None:
            del body["code"]
        return body

    @property
    def known_code(self) -> str | None:
        """The code if this side knows it; None for none, or one of a later minor."""
        return self.code if self.code in CODES else None


@dataclass(frozen=True)
class ResumePoint:
    """The last event a client has from one node: (boot, seq)."""

    boot: str
    seq: int

    def __post_init__(self) -> None:
        _check_str(Subscribe.KIND, "resume.boot", self.boot)
        _check_int(Subscribe.KIND, "resume.seq", self.seq, 0)


@dataclass(frozen=True)
class Subscribe(_Message):
    """A client asks for the event stream, from `resume` on (None: from now on)."""

    KIND: ClassVar[str] = "subscribe"
    resume: dict[str, ResumePoint] | None = None
    batches: bool = False
    runs: bool = False   # 1.4
    common: bool = False   # 1.5

    def __post_init__(self) -> None:
        _check_bool(self.KIND, "batches", self.batches)
        _check_bool(self.KIND, "runs", self.runs)
        _check_bool(self.KIND, "common", self.common)
        if self.resume is None:
            return
        _check_object(self.KIND, "resume", self.resume)
        for node_id, point in self.resume.items():
            if not node_id or not isinstance(point, ResumePoint):
                raise _fail(self.KIND, f"resume[{node_id!r}]", "a resume point", point)

    def to_json(self) -> dict[str, Any]:
        resume = None if self.resume is None else {
            node: {"boot": p.boot, "seq": p.seq} for node, p in self.resume.items()}
        return {**super().to_json(), "resume": resume}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> Subscribe:
        raw = obj.get("resume")
        flags = [False if obj.get(name) is None else obj[name]   # null: the default, as absent
                 for name in ("batches", "runs", "common")]
        if raw is None:
            return cls(None, *flags)
        _check_object(cls.KIND, "resume", raw)
        points = {}
        for node_id, point in raw.items():
            _check_object(cls.KIND, f"resume[{node_id!r}]", point)
            for name in ("boot", "seq"):
                if name not in point:
                    raise ProtocolError(f"subscribe: resume[{node_id!r}] lacks {name!r}")
            points[node_id] = ResumePoint(point["boot"], point["seq"])
        return cls(points, *flags)
