"""How a refit cuts the trainer's tensors into buckets (SGLANG.md, "Weight refit"): consecutive
runs under a byte limit, read lazily, so a generator of tensors is consumed as it is sent."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    import torch

T = TypeVar("T")


def buckets(named_tensors: Iterable[tuple[str, torch.Tensor]],
             limit: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive runs of at most ``limit`` bytes (one tensor may exceed it alone)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > limit:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def with_last(items: Iterator[T]) -> Iterator[tuple[T, bool]]:
    """Each item with whether it is the last one (looks one ahead, so generators stay lazy)."""
    previous = next(items, None)
    while previous is not None:
        current = next(items, None)
        yield previous, current is None
        previous = current


def dtype_name(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")  # SGLang does getattr(torch, name)
