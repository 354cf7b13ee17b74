"""The coordinator's refit state against a bad disk: refit.json is written durably off the loop,
a reply waits until what it reports is on disk, and a failing or hung disk gets an error that
names the file, while the coordinator goes on answering."""

from __future__ import annotations

import json
import os
import select
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from daemon_harness import wait_for
from test_coordinator import Peer

from rollout_watchdog.common import protocol
from rollout_watchdog.refit_bridge.coordinator import Coordinator
from rollout_watchdog.refit_bridge.durable import DurableWriter
from rollout_watchdog.refit_bridge.save_gate import SaveGate
from rollout_watchdog.refit_bridge.weights import RefitState


def wait_readable(fd: int, timeout_s: float = 10.0) -> None:
    ready, _, _ = select.select([fd], [], [], timeout_s)
    assert ready, f"fd {fd} not readable within {timeout_s} s"


def test_the_writer_writes_the_newest_content_and_names_a_failure(tmp_path: Path) -> None:
    path = tmp_path / "refit.json"
    writer = DurableWriter(path)
    try:
        generations = [writer.submit(json.dumps({"n": n}).encode()) for n in range(5)]
        assert generations == [1, 2, 3, 4, 5]
        while writer.outcome()[0] < 5:
            wait_readable(writer.wakeup_fd)
        assert json.loads(path.read_text()) == {"n": 4}
        (tmp_path / "refit.json.tmp").mkdir()   # the temporary file cannot be made: a failed write
        failing = writer.submit(b'{"n": 5}')
        while writer.outcome()[1] < failing:
            wait_readable(writer.wakeup_fd)
        written, failed, error = writer.outcome()
        assert (written, failed) == (5, failing) and str(tmp_path / "refit.json") in error
        assert json.loads(path.read_text()) == {"n": 4}   # the last good state is kept
        (tmp_path / "refit.json.tmp").rmdir()
        again = writer.submit(b'{"n": 6}')   # the next submission tries again
        while writer.outcome()[0] < again:
            wait_readable(writer.wakeup_fd)
        assert json.loads(path.read_text()) == {"n": 6}
    finally:
        writer.close()


@pytest.fixture
def coordinator(tmp_path: Path) -> Iterator[Coordinator]:
    with Coordinator(bind="tcp://127.0.0.1:0", state_dir=str(tmp_path / "state"),
                     state_write_timeout_s=1.0) as coordinator:
        yield coordinator


def call(peer: Peer, cmd: str, timeout: float = 10.0, **fields: Any) -> protocol.Reply:
    reply = peer.call(cmd, timeout, **fields)
    assert reply is not None, f"no reply to {cmd}"
    return reply


def test_a_failing_disk_refuses_the_lock_and_names_the_file(
        coordinator: Coordinator, tmp_path: Path) -> None:
    state = tmp_path / "state"
    blocker = state / "refit.json.tmp"
    client = Peer(coordinator.endpoint)
    try:
        blocker.mkdir()   # every write of refit.json fails from now on
        refused = call(client, "refit_acquire", args={"holder": "a", "version": "v1"})
        assert refused.status == "error", refused
        assert str(refused.reason).startswith("refit lock not taken: cannot write")
        assert str(state / "refit.json") in str(refused.reason)
        blocker.rmdir()   # the disk is back: the lock was never held
        taken = call(client, "refit_acquire", args={"holder": "b", "version": "v1"})
        assert taken.status == "ok", taken
        token = taken.result["token"]
        assert json.loads((state / "refit.json").read_text())["next_token"] \
            == int(token.split("-")[1]) + 1

        def blocked() -> bool:
            try:
                blocker.mkdir()
                return True
            except FileExistsError:   # the save of the members listed after the pause, still
                return False          # being written (its temporary file): it ends soon
        wait_for(blocked, 10, "the disk failing")
        commit = call(client, "refit_commit", args={"holder": "b", "token": token, "version": "v1",
                                                    "members": []})
        assert commit.status == "error"
        assert str(commit.reason).startswith("refit_commit took effect but is not saved")
        blocker.rmdir()
        released = call(client, "refit_release", args={"holder": "b", "token": token})
        assert released.status == "ok", released
        saved = json.loads((state / "refit.json").read_text())
        assert saved["weights"]["current"] == "v1" and saved["in_flight"] == []
    finally:
        client.close()


def test_a_hung_disk_never_blocks_the_loop_and_the_wait_is_bounded(tmp_path: Path) -> None:
    """A FIFO where the temporary file goes: the writer's open() hangs until a reader comes,
    as on a hung disk. The coordinator answers other requests meanwhile (well within the
    write's 6 s, which a blocked loop would make them wait), and the refit reply fails after
    those configured seconds."""
    fifo = tmp_path / "state" / "refit.json.tmp"
    with Coordinator(bind="tcp://127.0.0.1:0", state_dir=str(tmp_path / "state"),
                     state_write_timeout_s=6.0) as coordinator:
        os.mkfifo(fifo)
        holder, other = Peer(coordinator.endpoint), Peer(coordinator.endpoint)
        acquire = protocol.Command("acquire-1", "refit_acquire",
                                   {"holder": "a", "version": "v1"})
        try:
            holder.sock.send(protocol.encode(acquire))
            assert call(other, "status", timeout=3.0).status == "ok"   # while the write hangs
            # the same request again (a client's retry): it gets the one answer
            refused = call(holder, "refit_acquire", request_id="acquire-1", args=acquire.args)
            assert refused.status == "error"
            assert "was not written within 6 s" in str(refused.reason)
            assert call(other, "ping").result["refit"]["holder"] is None
        finally:
            holder.close()
            other.close()
            reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)   # lets the hung write end
            os.close(reader)


def test_a_save_nobody_waits_for_leaves_the_loop_nothing_to_wake_for(tmp_path: Path) -> None:
    """A state change with no reply waiting (a lease that ran out) is written too; once it
    is, the loop is woken once and its wakeup descriptor cleared, or every later poll would
    return at once (the loop spun at full CPU until the next refit call's save)."""
    gate = SaveGate(RefitState(str(tmp_path)), timeout_s=5.0)
    try:
        fd = gate.wakeup_fd
        assert fd is not None
        gate.submit(b'{"current": null, "held": []}')
        wait_for(lambda: select.select([fd], [], [], 0)[0], 10, "the write's wakeup")
        gate.saved(time.monotonic())
        assert select.select([fd], [], [], 0)[0] == []
    finally:
        gate.close()
