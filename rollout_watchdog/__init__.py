"""rollout-watchdog: keeps the SGLang engines of an RL rollout fleet alive.

The fleet's Python API (DESIGN.md, "Python") is exported from here, loaded on first use, so
that `import rollout_watchdog` (the node daemon, the CLI) pays for none of it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_LAZY = {
    "Coordinator": "rollout_watchdog.refit_bridge.coordinator",
    "FleetClient": "rollout_watchdog.refit_bridge.client",
    "EngineSpec": "rollout_watchdog.common.spec",
    "EngineView": "rollout_watchdog.refit_bridge.views",
    "FleetEvent": "rollout_watchdog.refit_bridge.views",
    "FleetResult": "rollout_watchdog.refit_bridge.views",
    "NodeView": "rollout_watchdog.refit_bridge.views",
    "RolloutWatchdogError": "rollout_watchdog.common.errors",
    "CoordinatorUnavailable": "rollout_watchdog.common.errors",
    "CommandRefused": "rollout_watchdog.common.errors",
    "EngineLost": "rollout_watchdog.common.errors",
    "LeaseLost": "rollout_watchdog.common.errors",
    "NoMembers": "rollout_watchdog.common.errors",
    "RefitTimeout": "rollout_watchdog.common.errors",
    "UpdateRefused": "rollout_watchdog.common.errors",
}
__all__ = ["CommandRefused", "Coordinator", "CoordinatorUnavailable", "EngineLost", "EngineSpec",
           "EngineView",
           "FleetClient", "FleetEvent", "FleetResult", "LeaseLost", "NodeView", "NoMembers",
           "RefitTimeout",
           "RolloutWatchdogError", "UpdateRefused", "__version__"]

if TYPE_CHECKING:
    from rollout_watchdog.common.errors import (
        CommandRefused,
        CoordinatorUnavailable,
        EngineLost,
        LeaseLost,
        NoMembers,
        RefitTimeout,
        RolloutWatchdogError,
        UpdateRefused,
    )
    from rollout_watchdog.common.spec import EngineSpec
    from rollout_watchdog.refit_bridge.client import FleetClient
    from rollout_watchdog.refit_bridge.views import EngineView, FleetEvent, FleetResult, NodeView


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # looked up once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
