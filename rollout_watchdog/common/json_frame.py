"""The JSON layer of a protocol frame (protocol.py is the messages): a strict parse (UTF-8, a
size bound, finite numbers, 64-bit integers) and the one encoder, both built once."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any


class ProtocolError(ValueError):
    """A message that is not valid under this protocol; the text says what is wrong."""


def _parse_float(text: str) -> float:
    number = float(text)
    if not math.isfinite(number):
        raise ProtocolError(f"non-finite number {text[:40]!r}")
    return number


def _parse_constant(text: str) -> Any:
    raise ProtocolError(f"non-finite number {text!r}")


# One decoder, built once (json.loads with hooks builds one per call). Floats are checked as
# they are parsed: 1e999 would otherwise become infinity, which JSON cannot carry onwards.
_DECODER = json.JSONDecoder(parse_float=_parse_float, parse_constant=_parse_constant)
# Messages are made by this package: no cycles to look for (a RecursionError says so anyway).
_SCAN: Callable[[str, int], tuple[Any, int]] = _DECODER.scan_once  # type: ignore[attr-defined]
_ENCODER = json.JSONEncoder(allow_nan=False, separators=(",", ":"), check_circular=False)


def parse(data: bytes, max_bytes: int) -> object:
    """The JSON value in a frame of at most `max_bytes`, numbers checked; ProtocolError for
    anything else."""
    if len(data) > max_bytes:
        raise ProtocolError(f"message of {len(data)} bytes exceeds the limit of "
                            f"{max_bytes} bytes")
    try:
        text = bytes(data).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ProtocolError(f"not UTF-8: {exc.reason} at byte {exc.start}") from None
    try:
        obj = _loads(text)
    except ProtocolError:
        raise
    except RecursionError:
        raise ProtocolError("JSON nested too deeply") from None
    except ValueError as exc:
        if "integer string conversion" in str(exc):  # Python's own limit, 4300 digits
            raise ProtocolError("an integer does not fit in 64 bits") from None
        raise ProtocolError(f"not JSON: {exc}") from None
    return obj


def _loads(text: str) -> object:
    """_DECODER.decode(text), with the C scanner called directly for a frame as this package
    writes it (no whitespace around the value: a third less time on a heartbeat)."""
    try:
        obj, end = _SCAN(text, 0)
    except StopIteration:   # no value at 0: the decoder skips blanks, or says what is wrong
        return _DECODER.decode(text)
    return obj if end == len(text) else _DECODER.decode(text)
