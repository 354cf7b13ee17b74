"""`EngineSpec`: one engine to launch at run time, the fields of one `[[engine]]` table.

Plain data on the caller's side: the node daemon validates it with the config file's own code
(every error names the field), so a spec is never checked twice by two rule sets that drift.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class EngineSpec:
    """An engine for `fleet.launch(node_id, spec)` or the node command `launch`.

    `gpus` are the engine's GPU indices on its node: the daemon sets `CUDA_VISIBLE_DEVICES`
    from them (never from its own environment). `probe` and `restart` override the node's
    `[probe]`/`[restart]` defaults for this engine, as `[engine.probe]`/`[engine.restart]` do.
    """

    id: str
    url: str
    command: Sequence[str]
    gpus: Sequence[int] = ()
    env: Mapping[str, str] | None = None
    tp_size: int | None = None
    restart_policy: str = "immediate"
    probe: Mapping[str, Any] | None = field(default=None, kw_only=True)
    restart: Mapping[str, Any] | None = field(default=None, kw_only=True)

    def to_table(self) -> dict[str, Any]:
        """The spec as the `[[engine]]` table it stands for (JSON-ready): unset fields left
        out, so the node's defaults apply."""
        table: dict[str, Any] = {"id": self.id, "url": self.url, "command": list(self.command)}
        if self.gpus:
            table["gpus"] = list(self.gpus)
        if self.env:
            table["env"] = dict(self.env)
        if self.tp_size is not None:
            table["tp_size"] = self.tp_size
        if self.restart_policy != "immediate":
            table["restart_policy"] = self.restart_policy
        if self.probe:
            table["probe"] = dict(self.probe)
        if self.restart:
            table["restart"] = dict(self.restart)
        return table
