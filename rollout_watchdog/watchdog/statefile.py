"""The daemon's state file: what a restarted daemon needs to adopt running engines.

Written atomically (temp file, fsync, rename) so a crash mid-write leaves the previous version;
an unreadable file is set aside and reported, and the daemon starts fresh.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)
VERSION = 1


def save_state(path: Path, data: dict[str, Any]) -> bool:
    """Write the state; False (and a log line) if the disk refused."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "w") as f:
            json.dump({"version": VERSION, **data}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        return True
    except OSError as exc:
        log.error("cannot write state file %s: %s (engines cannot be adopted across a daemon "
                  "restart until this is fixed)", path, exc.strerror or exc)
        return False


def load_state(path: Path) -> dict[str, Any] | None:
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as exc:
        log.error("cannot read state file %s: %s; starting fresh", path, exc.strerror or exc)
        return None
    try:
        data = json.loads(text)
        if not isinstance(data, dict) or data.get("version") != VERSION:
            raise ValueError(f"unknown state file version {data.get('version')!r}"
                             if isinstance(data, dict) else "not a JSON object")
        return data
    except ValueError as exc:
        aside = path.with_name(path.name + ".corrupt")
        log.error("state file %s is unusable (%s); moved to %s, starting fresh", path, exc, aside)
        with contextlib.suppress(OSError):
            os.replace(path, aside)
        return None
