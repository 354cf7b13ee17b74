"""The JSON layer of a protocol frame (protocol.py is the messages): a strict parse (UTF-8, a
size bound, finite numbers, 64-bit integers) and the one encoder, both built once.

Frames are parsed with orjson (a third of the stdlib's time: a fleet-wide pause parses 2,000
frames at the coordinator, and every event is parsed again by each subscriber). What it refuses
is parsed again by the stdlib's parser, which says what is wrong in this module's words, and
takes what orjson alone refuses (an escaped lone surrogate, which the encoder writes for a text
that came from undecodable bytes). An integer beyond 64 bits (unsigned) and within 1e308 reads
as a float, where the stdlib's parser read an int: the protocol's integer fields refuse it as
not fitting in 64 bits (message_base), and a free-form value (a result) holds it as a float."""

from __future__ import annotations

import json
import math
from typing import Any

import orjson


class ProtocolError(ValueError):
    """A message that is not valid under this protocol; the text says what is wrong."""


class MessageTooBig(ProtocolError):
    """A message that would be valid but exceeds the size limit of one frame."""


def _parse_float(text: str) -> float:
    number = float(text)
    if not math.isfinite(number):
        raise ProtocolError(f"non-finite number {text[:40]!r}")
    return number


def _parse_constant(text: str) -> Any:
    raise ProtocolError(f"non-finite number {text!r}")


# The slow path's decoder, built once (json.loads with hooks builds one per call). Floats are
# checked as they are parsed: 1e999 would otherwise become infinity, which JSON cannot carry.
_DECODER = json.JSONDecoder(parse_float=_parse_float, parse_constant=_parse_constant)
# Messages are made by this package: no cycles to look for (a RecursionError says so anyway).
_ENCODER = json.JSONEncoder(allow_nan=False, separators=(",", ":"), check_circular=False)


def dumps(obj: object, finite: bool = False) -> bytes:
    """`obj` as one frame's JSON text, as `_ENCODER` writes it (ValueError for a non-finite
    number, TypeError for what JSON cannot carry). With `finite`, the caller knows that every
    number in it is finite (it is made of parsed frames, which hold no other, and of this
    process's own clock and counts): then orjson writes it, in a fifth of the stdlib's time (a
    fleet-wide pause's gathered reply holds a thousand nodes' answers). orjson would write
    NaN as null, hence only then; what it refuses (a lone surrogate, an integer beyond 64
    bits, a key that is not a string) or writes otherwise (text beyond ASCII, which the
    stdlib escapes) is the stdlib's to write."""
    if finite:
        try:
            data = orjson.dumps(obj)
        except orjson.JSONEncodeError:
            data = b""
        if data and data.isascii():
            return data
    return _ENCODER.encode(obj).encode("ascii")  # ensure_ascii: lone surrogates stay escapes


def parse(data: bytes, max_bytes: int) -> object:
    """The JSON value in a frame of at most `max_bytes`, numbers checked; ProtocolError for
    anything else."""
    if len(data) > max_bytes:
        raise ProtocolError(f"message of {len(data)} bytes exceeds the limit of "
                            f"{max_bytes} bytes")
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        pass   # said again below, in this module's words (or taken: see the docstring)
    try:
        text = bytes(data).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ProtocolError(f"not UTF-8: {exc.reason} at byte {exc.start}") from None
    try:
        obj = _DECODER.decode(text)
    except ProtocolError:
        raise
    except RecursionError:
        raise ProtocolError("JSON nested too deeply") from None
    except ValueError as exc:
        if "integer string conversion" in str(exc):  # Python's own limit, 4300 digits
            raise ProtocolError("an integer does not fit in 64 bits") from None
        raise ProtocolError(f"not JSON: {exc}") from None
    return obj

