"""A file replaced whole or not at all: written to a temporary name beside it, then renamed
over it. `durable` also waits for the disk (the data, then the rename), for a file whose loss
after a power cut would lose what it promises (a refit's committed weights, the engines
launched at run time); the node's state file, written every few turns, goes without it."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


def write_atomically(path: Path, content: bytes, *, durable: bool = False) -> None:
    """Replace `path` with `content` (mode 0600); the temporary file is removed on failure."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        with open(fd, "wb") as out:
            out.write(content)
            if durable:
                out.flush()
                os.fsync(out.fileno())
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    if durable:
        directory = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(directory)   # the rename itself
        finally:
            os.close(directory)
