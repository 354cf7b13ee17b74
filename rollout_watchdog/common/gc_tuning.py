"""The garbage collector's settings for a process of ours that serves a loop for long (the
standalone coordinator), where a collection is a stall of the loop.

With CPython's defaults (a young-generation pass after 700 net allocations of containers), a
fleet-wide pause of 1,000 x 8 engines runs about six young passes, and every few pauses a full
one that scans every object the process holds (the fleet view, the relay buffer, every module
imported): tens of milliseconds in the middle of a pause (`bench/pause_cpu.py` prints the
collections' share). Our loop's garbage is freed by reference counting as it goes; the
collector only looks for cycles. So: what start-up made (modules, a restored journal) is
frozen out of every collection, and the young generation is collected after GEN0_THRESHOLD net
allocations. Not for a library caller's process: the embedded `Coordinator` leaves the
trainer's collector alone.
"""

from __future__ import annotations

import gc

GEN0_THRESHOLD = 10_000


def tune_for_service() -> None:
    """Freeze start-up's objects out of collections; young passes after GEN0_THRESHOLD."""
    gc.collect()
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(GEN0_THRESHOLD, gen1, gen2)
