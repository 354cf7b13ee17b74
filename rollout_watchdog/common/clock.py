"""The daemon's two clocks, behind one object so that tests can drive time."""

from __future__ import annotations

import time


class Clock:
    """Monotonic time for every deadline; wall time only for display and the state file."""

    def monotonic(self) -> float:
        return time.monotonic()

    def wall(self) -> float:
        return time.time()

    def since_boot(self) -> float:
        """Seconds since boot: the clock of the kernel's process start times."""
        return time.clock_gettime(time.CLOCK_BOOTTIME)

    def to_wall(self, monotonic: float) -> float:
        """A monotonic moment on the wall clock (for display)."""
        return self.wall() + (monotonic - self.monotonic())

    def to_monotonic(self, wall: float) -> float:
        """A wall-clock moment read back from the state file, on the monotonic clock."""
        return self.monotonic() + (wall - self.wall())
