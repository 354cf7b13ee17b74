"""Which processes hold compute contexts on a GPU, behind an interface tests can fake.

A killed SGLang server can keep GPU memory for tens of seconds (or forever, as an orphan); a
relaunch before it is released fails to allocate or, worse, fits and runs out later.
"""

from __future__ import annotations

import logging
from typing import Protocol

log = logging.getLogger(__name__)


class GpuInspector(Protocol):
    def compute_pids(self, gpu: int) -> set[int]:
        """Pids with a compute context on this GPU index."""
        ...


class NoGpuInspector:
    """Used where there is no NVML: nothing to check."""

    def compute_pids(self, gpu: int) -> set[int]:
        return set()


class NvmlInspector:
    def __init__(self) -> None:
        import pynvml  # from nvidia-ml-py; optional

        pynvml.nvmlInit()
        self._nvml = pynvml

    def compute_pids(self, gpu: int) -> set[int]:
        handle = self._nvml.nvmlDeviceGetHandleByIndex(gpu)
        return {p.pid for p in self._nvml.nvmlDeviceGetComputeRunningProcesses(handle)}


def make_inspector(mode: str) -> GpuInspector:
    """`auto`: NVML if it loads, else nothing; `nvml`: NVML or an error; `none`: nothing."""
    if mode == "none":
        return NoGpuInspector()
    try:
        return NvmlInspector()
    except Exception as exc:  # ImportError, or NVMLError when there is no driver
        if mode == "nvml":
            raise RuntimeError(f"gpu_check = \"nvml\" but NVML is not usable: {exc}") from exc
        log.info("NVML not available (%s): GPU release is not checked", exc)
        return NoGpuInspector()


def gpu_holders(inspector: GpuInspector, gpus: tuple[int, ...], known_pids: set[int],
                shared: bool) -> dict[int, set[int]]:
    """Processes still holding each of the engine's GPUs.

    An engine that owns its GPUs (`shared=False`) needs them empty: any process there, ours or an
    orphan we never saw, blocks a relaunch. On GPUs shared with the trainer (`deferred` policy)
    only processes that were in the engine's tree count.
    """
    holders: dict[int, set[int]] = {}
    for gpu in gpus:
        pids = inspector.compute_pids(gpu)
        if shared:
            pids &= known_pids
        if pids:
            holders[gpu] = pids
    return holders
