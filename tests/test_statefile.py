"""The state file and the event log under bad conditions: a full disk, a corrupt file, a record
from another version, a reboot."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import pytest

from rollout_watchdog.common.events import Event, EventLog
from rollout_watchdog.common.states import Cause, EngineState
from rollout_watchdog.watchdog.engine import AfterKill, Failure
from rollout_watchdog.watchdog.process import ProcKey
from rollout_watchdog.watchdog.statefile import (
    EngineRecord,
    journal_anchor,
    kernel_boot_id,
    load_state,
    save_state,
    set_journal_anchor,
)


def full_record() -> EngineRecord:
    main = ProcKey(1234, 1700000000.25)
    return EngineRecord(
        state=EngineState.STOPPING, incarnation=7, state_since=1.5, restarts=2,
        relaunch_times=[10.0, 20.0], consecutive_failures=1, main=main,
        procs={main: True, ProcKey(1240, 1700000001.0): False}, launched_at=3.0,
        paused=99.0, last_failure=Failure(Cause.EXITED, "boom", 4.0),
        deferred_waiting=False, kill_cause=Cause.PROBE_FAILED, kill_after=AfterKill.RESTART,
        external=False, url="http://127.0.0.1:30000")


def test_a_record_survives_the_round_trip(tmp_path: Path) -> None:
    assert save_state(tmp_path / "state.json", "n", {"e0": full_record()})
    saved = load_state(tmp_path / "state.json")
    assert saved is not None and saved.same_boot
    assert EngineRecord.from_json(saved.engines["e0"]) == full_record()


def test_state_from_before_a_reboot_is_marked(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    path.write_text(json.dumps({"version": 1, "boot_id": "another-boot", "engines": {}}))
    saved = load_state(path)
    assert saved is not None and not saved.same_boot
    assert kernel_boot_id() != "another-boot"


@pytest.mark.parametrize("mutation", [
    {"state": "dancing"}, {"incarnation": "seven"}, {"kill_cause": "a-cause-from-the-future"},
    {"paused": {"deadline": "Infinity"}}, {"main": [1]}, {"procs": "none"},
])
def test_an_unusable_record_is_a_clear_value_error(mutation: dict) -> None:
    data = {**full_record().to_json(), **mutation}
    with pytest.raises(ValueError):
        EngineRecord.from_json(data)


def test_a_corrupt_file_is_set_aside(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "state.json"
    path.write_text('{"version": 1, "engines": ')
    with caplog.at_level(logging.ERROR):
        assert load_state(path) is None
    assert (tmp_path / "state.json.corrupt").exists() and not path.exists()
    assert "unusable" in caplog.text


def test_an_unwritable_state_dir_is_reported_not_fatal(tmp_path: Path,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    with caplog.at_level(logging.ERROR):
        assert not save_state(blocker / "state.json", "n", {"e0": full_record()})
    assert "cannot write state file" in caplog.text


def test_a_state_file_that_cannot_be_written_is_not_a_line_at_every_save(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The daemon saves many times a second: a disk that stays full logged the same error 30
    times a second (hostile run 5). The first 10 failures in a row are logged, then the 16th,
    32nd, 64th..., each with its count, and the recovery once."""
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    with caplog.at_level(logging.WARNING):
        for _ in range(100):
            assert not save_state(blocker / "state.json", "n", {"e0": full_record()})
        lines = [r.getMessage() for r in caplog.records if "cannot write" in r.getMessage()]
        assert len(lines) == 10 + 3 and "failure #64 in a row" in lines[-1]
        blocker.unlink()
        blocker.mkdir()
        assert save_state(blocker / "state.json", "n", {"e0": full_record()})
    assert "written again, after 100 failed save(s)" in caplog.text


def test_a_full_disk_keeps_events_in_memory(caplog: pytest.LogCaptureFixture) -> None:
    log = EventLog(Path("/dev/full"))  # every write fails with ENOSPC
    event = Event(ts=time.time(), node_id="n", engine="e0", incarnation=1, kind="state",
                  from_="healthy", to="stopping", cause="exited", detail="x")
    with caplog.at_level(logging.ERROR):
        log.append(event)
        log.append(event)
    assert [e for _, e in log.since(0)] == [event, event]
    assert log.write_errors == 2
    assert caplog.text.count("cannot write event log") == 1  # said once, not per event
    assert "No space left on device" in caplog.text


def test_a_runs_journal_anchor_is_set_at_its_start_and_the_records_stay(tmp_path: Path) -> None:
    """A run that wrote events and died before its first save: the next start read them back
    as the run before's (a review of previous_run.py). Each run anchors the journal at its
    start, before any event of its own, leaving the records for its adoption to read."""
    path = tmp_path / "state.json"
    assert save_state(path, "n", {"e0": full_record()}, {"e0": 3}, {"boot": "z", "seq": 9})
    set_journal_anchor(path, {"boot": "a", "seq": 0})
    assert journal_anchor(path) == {"boot": "a", "seq": 0}
    saved = load_state(path)
    assert saved is not None and saved.engines.keys() == {"e0"} and saved.incarnations == {
        "e0": 3}
    set_journal_anchor(tmp_path / "none.json", {"boot": "a", "seq": 0})   # (no file: none)
    assert not (tmp_path / "none.json").exists()
