"""Incarnation numbers: one number names one process of an engine id on this node, forever.

The one rule every launch and registration goes through (`Incarnations.next`): the next number
is one above the highest ever handed out for that engine id. The marks are kept in the state
file and never forgotten, not when an engine is unregistered, stopped or removed from the
config, not on a clean stop: a number never comes back while the state file lives. A
configured engine's first launch is incarnation 1 and each relaunch the next (DESIGN.md). A
daemon that lost its state file takes the marks of the processes still running (their
environment markers, adoption.py) and starts the others over; the coordinator then tells new
processes from old by their `process` identity (docs/protocol.md, "Weights"), so a fresh
process never inherits the weights a refit gave an old one.
"""

from __future__ import annotations

from typing import Any


class Incarnations:
    """The high-water mark of the incarnations handed out, per engine id."""

    def __init__(self, issued: dict[str, int] | None = None) -> None:
        self.issued: dict[str, int] = dict(issued or {})

    def next(self, engine_id: str) -> int:
        """Hand out the next incarnation of `engine_id`: never one handed out before."""
        number = self.issued.get(engine_id, 0) + 1
        self.issued[engine_id] = number
        return number

    def seen(self, engine_id: str, incarnation: int) -> None:
        """An incarnation that exists already (adopted from a state file that predates the
        marks): later ones must be above it."""
        if incarnation > self.issued.get(engine_id, 0):
            self.issued[engine_id] = incarnation

    def to_json(self) -> dict[str, int]:
        return dict(self.issued)

    @classmethod
    def from_json(cls, data: Any) -> Incarnations:
        """Parse the state file's marks; ValueError names a bad entry."""
        if not isinstance(data, dict):
            raise ValueError(f"'incarnations' is not an object: {str(data)[:80]}")
        for engine_id, mark in data.items():
            if isinstance(mark, bool) or not isinstance(mark, int) or mark < 0:
                raise ValueError(f"bad incarnation mark {mark!r:.40} for engine {engine_id!r:.80}")
        return cls(data)
