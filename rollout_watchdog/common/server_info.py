"""What an engine's `GET /server_info` says that the fleet uses, read the same way by the node
(for `status`) and by the refit (to size the weight-update group)."""

from __future__ import annotations

SERVER_INFO_PATH = "/server_info"
DEFAULT_TP_SIZE = 1
READ_LIMIT = 1 << 20   # bytes of an answer read at most


def tp_size_of(info: object) -> int:
    """The ranks the engine takes in a weight-update group: its `tp_size`, else 1 (DESIGN)."""
    size = info.get("tp_size") if isinstance(info, dict) else None
    return (size if isinstance(size, int) and not isinstance(size, bool) and size > 0
            else DEFAULT_TP_SIZE)
