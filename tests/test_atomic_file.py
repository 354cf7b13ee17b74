"""common.atomic_file: a file is replaced whole or not at all, private, durable on request."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from rollout_watchdog.common.atomic_file import write_atomically


@pytest.mark.parametrize("durable", [False, True])
def test_a_file_is_replaced_whole_and_private(tmp_path: Path, durable: bool) -> None:
    path = tmp_path / "dir" / "state.json"
    write_atomically(path, b"first", durable=durable)
    write_atomically(path, b"second", durable=durable)
    assert path.read_bytes() == b"second"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert sorted(p.name for p in path.parent.iterdir()) == ["state.json"]


def test_a_failed_write_leaves_the_old_file(tmp_path: Path) -> None:
    path = tmp_path / "launched.json"
    write_atomically(path, b"old")
    (tmp_path / "launched.json.tmp").mkdir()   # the temporary file cannot be made
    with pytest.raises(OSError):
        write_atomically(path, b"new", durable=True)
    assert path.read_bytes() == b"old"
