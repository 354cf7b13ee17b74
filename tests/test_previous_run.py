"""The previous daemon run's tail read back from its journal (watchdog/previous_run.py), on files
written by hand: no daemon."""

from __future__ import annotations

import json
import os
from pathlib import Path

from rollout_watchdog.watchdog.previous_run import Anchor, read_previous


def lines(*numbers: int, run: str = "b") -> bytes:
    return b"".join(json.dumps({"kind": "state", "detail": f"{run}{n}"}).encode() + b"\n"
                    for n in numbers)


def details(previous: object) -> list[tuple[int, str]]:
    assert previous is not None
    return [(seq, event["detail"]) for seq, event in previous.events]   # type: ignore[attr-defined]


def test_the_tail_is_numbered_from_the_anchor_both_ways(tmp_path: Path) -> None:
    """The run's lines are the last `seq` before the anchor's offset (an older run's before
    them are not), then every line after it; the newest `capacity` are kept."""
    journal = tmp_path / "events.jsonl"
    journal.write_bytes(lines(1, 2, run="a") + lines(1, 2, 3))
    anchor = Anchor.of("b", 3, journal, write_errors=0)
    assert anchor is not None
    with journal.open("ab") as f:
        f.write(lines(4, 5))
    assert details(read_previous(anchor, journal, 100)) == [
        (1, "b1"), (2, "b2"), (3, "b3"), (4, "b4"), (5, "b5")]
    assert details(read_previous(anchor, journal, 2)) == [(4, "b4"), (5, "b5")]
    again = Anchor.from_json(json.loads(json.dumps(anchor.to_json())))
    assert again == anchor


def test_a_journal_rotated_since_the_anchor_is_read_across_both_files(tmp_path: Path) -> None:
    journal = tmp_path / "events.jsonl"
    journal.write_bytes(lines(1, 2))
    anchor = Anchor.of("b", 2, journal, write_errors=0)
    with journal.open("ab") as f:
        f.write(lines(3))
    os.replace(journal, tmp_path / "events.jsonl.1")   # (as EventLog rotates it)
    journal.write_bytes(lines(4))
    assert details(read_previous(anchor, journal, 100)) == [
        (1, "b1"), (2, "b2"), (3, "b3"), (4, "b4")]


def test_nothing_is_made_up_from_a_journal_that_cannot_be_trusted(tmp_path: Path) -> None:
    """Lines lost to a failing disk, a journal replaced by another file, garbage in it, an
    anchor that is not one: no previous run (a follower then starts with the new run's)."""
    journal = tmp_path / "events.jsonl"
    journal.write_bytes(lines(1))
    assert Anchor.of("b", 1, journal, write_errors=1) is None
    anchor = Anchor.of("b", 1, journal, write_errors=0)
    journal.unlink()
    journal.write_bytes(lines(1, 2, run="c"))   # (another file, maybe under the same inode)
    assert read_previous(anchor, journal, 100) is None
    anchor = Anchor.of("b", 2, journal, write_errors=0)
    with journal.open("ab") as f:
        f.write(b"{not json\n")
    assert read_previous(anchor, journal, 100) is None
    for bad in (None, [], {"boot": "b", "seq": -1, "inode": 1, "offset": 0},
                {"boot": 7, "seq": 1, "inode": 1, "offset": 0}, {"boot": "b", "seq": True,
                                                                 "inode": 1, "offset": 0}):
        assert Anchor.from_json(bad) is None
