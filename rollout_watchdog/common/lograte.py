"""Rate limits on the logs of input that is dropped and counted (bad frames, refused messages,
replies that cannot be delivered): a flood must not flood the log too, yet the log still shows
that it goes on and how big it grew."""

from __future__ import annotations


def worth_logging(count: int) -> bool:
    """Whether the `count`th occurrence (1-based) of one kind of drop is logged: the first 10,
    then the 16th, 32nd, 64th... (the count is in each line)."""
    return count <= 10 or count & (count - 1) == 0
