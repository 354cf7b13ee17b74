"""The previous daemon run's last events, for an `events` follower that was behind when it stopped.

A follower names the boot it follows and the last seq it saw. A restarted daemon numbers its own
events from 1, so a follower of the previous run was served from the new run's first event, and
the tail of the previous run it had not seen yet was lost to it (hostile run 5). The state file
anchors the journal: at each save, the run's boot, its last seq, and where events.jsonl ended
then (its inode, its size, a digest of its last bytes). At the next start, the lines of
events.jsonl before that offset are that run's events up to that seq, those after it the events
it wrote since; the last `capacity` of them are served to a follower of that boot before the new
run's. A journal that lost lines (a failing disk), was replaced, or rotated twice since,
anchors nothing: the follower then starts with the new run's, as before.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


CHECKED_BYTES = 256   # the journal's bytes before the offset that the anchor's digest covers


@dataclass(frozen=True)
class Anchor:
    boot: str
    seq: int
    inode: int
    offset: int
    check: str   # a digest of the CHECKED_BYTES before the offset: the same file, unchanged

    @classmethod
    def of(cls, boot: str, seq: int, journal: Path, write_errors: int) -> Anchor | None:
        """Where the journal ends now (None: it has no trustworthy end: lines were lost)."""
        if write_errors:
            return None
        try:
            with journal.open("rb") as f:
                stat = os.fstat(f.fileno())
                f.seek(max(0, stat.st_size - CHECKED_BYTES))
                return cls(boot, seq, stat.st_ino, stat.st_size, _digest(f.read()))
        except OSError:
            return None

    def to_json(self) -> dict[str, Any]:
        return {"boot": self.boot, "seq": self.seq, "inode": self.inode, "offset": self.offset,
                "check": self.check}

    @classmethod
    def from_json(cls, data: object) -> Anchor | None:
        if not isinstance(data, dict):
            return None
        boot, check = data.get("boot"), data.get("check")
        numbers = [data.get(k) for k in ("seq", "inode", "offset")]
        if not isinstance(boot, str) or not isinstance(check, str):
            return None
        counts = [v for v in numbers if isinstance(v, int) and not isinstance(v, bool) and v >= 0]
        if len(counts) != 3:
            return None
        return cls(boot, counts[0], counts[1], counts[2], check)


def _digest(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=8).hexdigest()


@dataclass(frozen=True)
class PreviousRun:
    boot: str
    events: list[tuple[int, dict[str, Any]]]   # (seq, event), seq ascending

    @property
    def last_seq(self) -> int:
        return self.events[-1][0] if self.events else 0

    def since(self, seq: int, limit: int = 1000) -> list[tuple[int, dict[str, Any]]]:
        return [(s, e) for s, e in self.events if s > seq][:limit]


def read_previous(anchor: Anchor | None, journal: Path, capacity: int) -> PreviousRun | None:
    """The previous run's last `capacity` events, numbered, from the journal it wrote."""
    if anchor is None:
        return None
    try:
        parts = _split(anchor, journal)
    except OSError as exc:
        log.warning("the previous run's events cannot be read from %s (%s): a follower of it "
                    "starts with this run's", journal, exc.strerror or exc)
        return None
    if parts is None:
        return None
    before, after = parts
    # The run's own lines are the last `seq` before the offset (fewer when the journal rotated
    # during the run: all of them are its), then every line after it.
    head = before.splitlines()[-min(anchor.seq, capacity):] if anchor.seq else []
    lines = list(enumerate(head + after.splitlines(), anchor.seq - len(head) + 1))
    events = []
    for seq, line in lines[-capacity:]:
        try:
            event = json.loads(line)
        except (ValueError, RecursionError):
            return None
        if not isinstance(event, dict):
            return None
        events.append((seq, event))
    return PreviousRun(anchor.boot, events)


def _split(anchor: Anchor, journal: Path) -> tuple[bytes, bytes] | None:
    """The journal's bytes before the anchor's offset and after it (None: not the same file
    any more, and not its rotated copy either)."""
    rotated = journal.with_suffix(journal.suffix + ".1")
    for path, following in ((journal, None), (rotated, journal)):
        try:
            if os.stat(path).st_ino != anchor.inode:
                continue
        except FileNotFoundError:
            continue
        data = path.read_bytes()
        if len(data) < anchor.offset or _digest(
                data[max(0, anchor.offset - CHECKED_BYTES):anchor.offset]) != anchor.check:
            continue   # (another file under a reused inode number)
        rest = data[anchor.offset:] + (following.read_bytes() if following is not None
                                        and following.exists() else b"")
        return data[:anchor.offset], rest
    return None


__all__ = ["Anchor", "PreviousRun", "read_previous"]
