"""rollout-watchdog: keeps the SGLang engines of an RL rollout fleet alive.

The fleet's Python API (DESIGN.md, "Python") is exported from here, loaded on first use, so
that `import rollout_watchdog` (the node daemon, the CLI) pays for none of it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_LAZY = {
    "Coordinator": "rollout_watchdog.agent.coordinator",
    "FleetClient": "rollout_watchdog.agent.client",
    "EngineView": "rollout_watchdog.agent.views",
    "FleetEvent": "rollout_watchdog.agent.views",
    "FleetResult": "rollout_watchdog.agent.views",
    "RolloutWatchdogError": "rollout_watchdog.errors",
    "CoordinatorUnavailable": "rollout_watchdog.errors",
    "CommandRefused": "rollout_watchdog.errors",
    "EngineLost": "rollout_watchdog.errors",
    "LeaseLost": "rollout_watchdog.errors",
}
__all__ = ["CommandRefused", "Coordinator", "CoordinatorUnavailable", "EngineLost", "EngineView",
           "FleetClient", "FleetEvent", "FleetResult", "LeaseLost", "RolloutWatchdogError",
           "__version__"]

if TYPE_CHECKING:
    from rollout_watchdog.agent.client import FleetClient
    from rollout_watchdog.agent.views import EngineView, FleetEvent, FleetResult
    from rollout_watchdog.errors import (
        CommandRefused,
        CoordinatorUnavailable,
        EngineLost,
        LeaseLost,
        RolloutWatchdogError,
    )


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # looked up once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
