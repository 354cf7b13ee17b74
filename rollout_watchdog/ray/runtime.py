"""Typed wrappers of the few Ray calls whose stubs are missing or too narrow."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import ray

COORDINATOR = "coordinator"   # the coordinator actor's name, in its namespace


def node_ip() -> str:
    """This Ray node's address (what the other nodes reach it at)."""
    return str(ray.util.get_node_ip_address())  # type: ignore[no-untyped-call]


def alive_nodes() -> list[dict[str, Any]]:
    """The Ray nodes alive now, as `ray.nodes()` describes them."""
    return [n for n in ray.nodes() if n.get("Alive")]  # type: ignore[no-untyped-call]


def remote(cls: type) -> Any:
    """`ray.remote(cls)`: an actor class, whose `.options(...).remote(...)` make the actor."""
    return ray.remote(cls)


def ray_dirs() -> tuple[Path, Path]:
    """This Ray node's session dir and log dir (where `ray logs` and the dashboard look)."""
    node = ray._private.worker.global_worker.node
    if node is None:
        raise RuntimeError("not connected to Ray: call ray.init() first")
    return Path(node.get_session_dir_path()), Path(node.get_logs_dir_path())
