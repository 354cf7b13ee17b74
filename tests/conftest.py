from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from daemon_harness import EngineSpec, Node  # noqa: E402


@pytest.fixture
def make_node(tmp_path: Path) -> Iterator[Callable[..., Node]]:
    """Build (and later tear down) a daemon over emulator engines: make_node(engines, ...)."""
    nodes: list[Node] = []

    def make(engines: list[EngineSpec], **kwargs: Any) -> Node:
        node = Node(tmp_path / f"n{len(nodes)}", engines, **kwargs)
        nodes.append(node)
        return node

    yield make
    for node in nodes:
        node.cleanup()
