"""The weight-update endpoints on the main process's side (SGLang's tokenizer manager).

Parses the bodies, takes the model-update lock where SGLang does (the update and the begin/end
session calls), aborts requests and records the weight version; the collective work happens in
the scheduler child (:mod:`weight_sync`). Every call waits for the scheduler without a timeout,
like SGLang's control calls: an update blocks until its broadcast completes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rollout_watchdog.emulator.protocol import BadRequest

if TYPE_CHECKING:
    from rollout_watchdog.emulator.server import EmulatorServer

DEFAULT_GROUP = "weight_update_group"
LOAD_FORMATS = (None, "flattened_bucket")
OPS = {
    "/init_weights_update_group": "init_weights_update_group",
    "/destroy_weights_update_group": "destroy_weights_update_group",
    "/begin_weight_update": "begin_weight_update",
    "/end_weight_update": "end_weight_update",
    "/update_weights_from_distributed": "update_weights_from_distributed",
}
SESSION_PATHS = frozenset({"/begin_weight_update", "/end_weight_update"})  # 0.5.21+
LOCKED_OPS = frozenset(
    {"begin_weight_update", "end_weight_update", "update_weights_from_distributed"}
)

_REQUIRED = object()
_TYPE_ERRORS = {
    int: ("int_type", "Input should be a valid integer"),
    str: ("string_type", "Input should be a valid string"),
    bool: ("bool_type", "Input should be a valid boolean"),
    list: ("list_type", "Input should be a valid list"),
}


def _invalid(kind: str, loc: tuple[str, ...], msg: str, value: Any) -> BadRequest:
    """A FastAPI-style validation error (400, like the emulator's other bodies)."""
    return BadRequest(
        f"[{{'type': {kind!r}, 'loc': {('body', *loc)!r}, 'msg': {msg!r}, 'input': {value!r}}}]",
        validation=True,
    )


def _field(obj: dict[str, Any], name: str, kind: type, default: Any = _REQUIRED) -> Any:
    """``obj[name]`` checked against ``kind``; missing: ``default`` (None stays None when
    the default is None, i.e. an optional field)."""
    if name not in obj:
        if default is _REQUIRED:
            raise _invalid("missing", (name,), "Field required", obj)
        return default
    value = obj[name]
    if value is None and default is None:
        return None
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        code, msg = _TYPE_ERRORS[kind]
        raise _invalid(code, (name,), msg, value)
    return value


def _str_list(obj: dict[str, Any], name: str) -> list[str]:
    values = _field(obj, name, list)
    for i, value in enumerate(values):
        if not isinstance(value, str):
            raise _invalid("string_type", (name, str(i)), _TYPE_ERRORS[str][1], value)
    return list(values)


def _shapes(obj: dict[str, Any]) -> list[list[int]]:
    shapes = _field(obj, "shapes", list)
    for i, shape in enumerate(shapes):
        if not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) for d in shape
        ):
            raise _invalid("list_type", ("shapes", str(i)),
                           "Input should be a valid list of integers", shape)
    return [list(s) for s in shapes]


def parse(op: str, obj: dict[str, Any]) -> dict[str, Any]:
    """The scheduler's arguments for ``op`` from a request body; raises BadRequest."""
    if op == "init_weights_update_group":
        args = {
            "master_address": _field(obj, "master_address", str),
            "master_port": _field(obj, "master_port", int),
            "rank_offset": _field(obj, "rank_offset", int),
            "world_size": _field(obj, "world_size", int),
            "group_name": _field(obj, "group_name", str, DEFAULT_GROUP),
            "backend": _field(obj, "backend", str, "nccl"),
        }
        if not args["group_name"]:
            raise BadRequest("Group name cannot be empty")
        return args
    if op == "destroy_weights_update_group":
        return {"group_name": _field(obj, "group_name", str, DEFAULT_GROUP)}
    if op in ("begin_weight_update", "end_weight_update"):
        return {}
    names, dtypes, shapes = _str_list(obj, "names"), _str_list(obj, "dtypes"), _shapes(obj)
    if not len(names) == len(dtypes) == len(shapes):
        # SGLang zips them (the shortest wins) and the trainer hangs; say so instead.
        raise BadRequest(
            f"names, dtypes and shapes must have the same length "
            f"(got {len(names)}, {len(dtypes)}, {len(shapes)})"
        )
    load_format = _field(obj, "load_format", str, None)
    if load_format not in LOAD_FORMATS:
        raise BadRequest(f"load_format must be null or 'flattened_bucket', not {load_format!r}")
    return {
        "names": names,
        "dtypes": dtypes,
        "shapes": shapes,
        "group_name": _field(obj, "group_name", str, DEFAULT_GROUP),
        "flush_cache": _field(obj, "flush_cache", bool, True),
        "abort_all_requests": _field(obj, "abort_all_requests", bool, False),
        "weight_version": _field(obj, "weight_version", str, None),
        "load_format": load_format,
    }


def handle(emu: EmulatorServer, path: str, obj: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """Run one weight-update call to its end; (status, ``{"success", "message"}``)."""
    op = OPS[path]
    args = parse(op, obj)
    if args.get("abort_all_requests"):
        emu.abort(abort_all=True)
    if op in LOCKED_OPS:
        with emu.model_update():
            result = emu.control(op, args)
    else:
        result = emu.control(op, args)
    success, message = bool(result.get("success")), str(result.get("message", ""))
    version = args.get("weight_version")
    if success and version is not None:
        with emu.lock:
            emu.weight_version = version
        message += f" Weight version updated to {version}."
    return (200 if success else 400), {"success": success, "message": message}
