"""Constants and helpers shared by the emulator's main process and its scheduler child.

Nothing here imports torch: both processes import this module.
"""

from __future__ import annotations

import contextlib
import os
import sys

# The SGLang release whose HTTP behaviour the emulator reproduces (reported as "version").
EMULATED_SGLANG_VERSION = "0.5.23"

# Byte-level "tokenizer": token id == byte value.
VOCAB_SIZE = 256
EOS_TOKEN_ID = 0
CONTEXT_LENGTH = 4096
MAX_RUNNING_REQUESTS = 256

HEALTH_CHECK_RID_PREFIX = "HEALTH_CHECK"
# emulator.testing.emulator_command adds --no-model when this is "1" (a test suite speed knob)
NO_MODEL_ENV = "RW_EMULATOR_NO_MODEL"

# In the argv of orphan processes (fault "orphan"), so cleanup code can recognise them.
ORPHAN_MARKER = "rollout-watchdog-emulator-orphan"

# Slots of the shared float array (multiprocessing RawArray) between main and scheduler.
# Flags are written by the main process and read by the scheduler on every loop turn, so they
# work even while the scheduler does not read its pipe (stalled).
SLOT_STALL = 0  # 1.0: the scheduler stops reading input and producing output
SLOT_IGNORE_SIGTERM = 1  # 1.0: the scheduler ignores SIGTERM
SLOT_TOKEN_LATENCY_MS = 2  # time one decode step costs
# Gauges written by the scheduler (like SGLang's scheduler metrics).
SLOT_NUM_RUNNING = 3
SLOT_NUM_QUEUE = 4
SLOT_GEN_THROUGHPUT = 5
# Fault hang_weight_update: 0 off, else one of HANG_STAGES (index + 1); read by the scheduler.
SLOT_HANG_WEIGHT_UPDATE = 6
SHARED_SLOTS = 8

# Where a weight update hangs (fault hang_weight_update): instead of joining the broadcast, or
# after receiving the tensors (before loading them and answering).
HANG_STAGES = ("join", "finish")

# First releases with a behaviour the emulator reproduces (see shared/SGLANG.md).
WEIGHT_SESSION_SINCE = (0, 5, 21)  # begin_weight_update / end_weight_update
FLUSH_FAILURE_ANSWERED_SINCE = (0, 5, 22)  # before: a refused flush crashes the server


def version_tuple(text: str) -> tuple[int, ...]:
    """"0.5.23" -> (0, 5, 23); raises ValueError naming the text (suffixes like rc1 refused)."""
    try:
        parts = tuple(int(p) for p in text.split("."))
    except ValueError:
        raise ValueError(f"not a version like 0.5.23: {text!r}") from None
    if len(parts) < 2 or any(p < 0 for p in parts):
        raise ValueError(f"not a version like 0.5.23: {text!r}")
    return parts


def encode(text: str) -> list[int]:
    """Byte-level tokenization (UTF-8 bytes)."""
    return list(text.encode("utf-8"))


def decode(ids: list[int]) -> str:
    """Inverse of :func:`encode`; invalid UTF-8 becomes U+FFFD, as with a real detokenizer."""
    return bytes(i & 0xFF for i in ids).decode("utf-8", errors="replace")


def log(msg: str) -> None:
    """One line on stderr, tagged with the pid (the main process's diagnostics)."""
    # Also called from signal handlers: a re-entrant write to stderr must not raise.
    with contextlib.suppress(RuntimeError, OSError, ValueError):
        print(f"[emulator {os.getpid()}] {msg}", file=sys.stderr, flush=True)
