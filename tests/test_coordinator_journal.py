"""The coordinator's journal (`--state-dir`): an event the coordinator acknowledged to its node
but had not delivered to a client when it was SIGKILLed is still delivered after its restart."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import zmq
from daemon_harness import EngineSpec, Node, wait_for
from fleet_harness import start_coordinator_process

from rollout_watchdog import FleetClient
from rollout_watchdog.agent.journal import JOURNAL, Journal
from rollout_watchdog.agent.relay import Relayed
from rollout_watchdog.common import protocol
from rollout_watchdog.emulator.testing import free_port
from rollout_watchdog.refit_bridge.coordinator import Coordinator


def relayed(node: str, boot: str, seq: int) -> Relayed:
    frame = protocol.encode(protocol.Event(node, boot, seq, {"kind": "state", "seq": seq}))
    return Relayed(node, boot, seq, frame)


def test_the_journal_keeps_the_newest_events_across_a_restart(tmp_path: Path) -> None:
    journal = Journal(str(tmp_path / "state"), keep=5, max_bytes=2_000)
    assert journal.load() == []
    items = [relayed("n1", "b1", seq) for seq in range(1, 21)]
    for item in items:
        journal.append([item], lambda seq=item.seq: items[:seq][-5:])
    assert journal.path.stat().st_size < 2_000 + 200           # compacted, not grown
    journal.close()
    with open(journal.path, "ab") as file:
        file.write(b'{"v":[1,0],"kind":"ev')                   # cut short by a crash
    again = Journal(str(tmp_path / "state"), keep=5)
    assert [i.seq for i in again.load()] == [16, 17, 18, 19, 20]
    again.close()


def test_a_nodes_batch_or_run_is_one_line_and_comes_back_as_one_item(tmp_path: Path) -> None:
    """What came as a node's "run" or "events" frame, all relayed, is journaled as that frame
    (one line, nothing encoded again) and loaded back as one item, still relayed whole; an
    "events" line whose events are not one node's run of seqs comes back event by event."""
    run = protocol.Run("n1", "b1", 1, [{"kind": "paused", "n": n} for n in range(3)])
    events = protocol.Events([protocol.Event("n2", "b1", seq, {"kind": "x"}) for seq in (7, 8)])
    items = [Relayed("n1", "b1", 1, protocol.encode(run), 3, "run"), relayed("n3", "b1", 1),
             Relayed("n2", "b1", 7, protocol.encode(events), 2, "events")]
    journal = Journal(str(tmp_path), keep=100)
    journal.load()
    journal.append(items, lambda: items)
    assert journal.path.read_bytes().splitlines() == [i.frame for i in items]
    journal.close()
    again = Journal(str(tmp_path), keep=100)
    loaded = again.load()
    assert [(i.node_id, i.boot, i.seq, i.frame, i.count, i.kind) for i in loaded] == [
        (i.node_id, i.boot, i.seq, i.frame, i.count, i.kind) for i in items]
    again.close()
    mixed = protocol.Events([protocol.Event("n1", "b1", 4, {}), protocol.Event("n2", "b1", 1, {})])
    journal.path.write_bytes(protocol.encode(mixed) + b"\n")
    split = Journal(str(tmp_path), keep=100).load()
    assert [(i.node_id, i.seq, i.count, i.frame) for i in split] == [
        (e.node_id, e.seq, 1, protocol.encode(e)) for e in mixed.events]


def test_a_failing_disk_turns_the_journal_off_without_stopping(tmp_path: Path) -> None:
    journal = Journal(str(tmp_path), keep=5)
    journal.load()
    os.chmod(tmp_path, 0o500)  # compaction cannot write its temporary file
    try:
        journal.max_bytes = 0
        journal.append([relayed("n1", "b1", 1)], lambda: [relayed("n1", "b1", 1)])
        if os.geteuid() != 0:   # root writes anyway: then nothing failed
            assert journal.failed is not None and "relay" in journal.failed
        journal.append([relayed("n1", "b1", 2)], list)            # never raises
    finally:
        os.chmod(tmp_path, 0o700)


def test_an_acknowledged_undelivered_event_survives_a_coordinator_sigkill(
        make_node: Callable[..., Node], tmp_path: Path) -> None:
    bind = f"tcp://127.0.0.1:{free_port()}"
    state = ["--state-dir", str(tmp_path / "coordinator")]
    coordinator = start_coordinator_process(bind, state, log_path=tmp_path / "c1.log")
    ctx = zmq.Context()
    sub = ctx.socket(zmq.DEALER)
    sub.linger = 0
    got: list[protocol.Event] = []

    def until(pred: Callable[[protocol.Event], bool], what: str) -> protocol.Event:
        def found() -> protocol.Event | None:
            while sub.poll(50):
                message = protocol.decode(sub.recv())
                if isinstance(message, protocol.Event) and message.node_id == "n1":
                    got.append(message)
            return next((e for e in got if pred(e)), None)
        return wait_for(found, 30, what)

    try:
        sub.connect(bind)
        sub.send(protocol.encode(protocol.Subscribe()))
        wait_for(lambda: coordinator.call("ping").result["subscribers"] == 1, 10,
                 "the subscription")
        node = make_node([EngineSpec("e0")], node_id="n1", top={"coordinator": bind}).start()
        point = until(lambda e: e.event.get("to") == "healthy", "e0 healthy, on the stream")
        sub.close()                                   # the client goes away for a while
        os.kill(node.engine("e0")["pid"], signal.SIGKILL)
        node.wait_state("e0", "healthy", timeout=60, incarnation=2)
        # relayed to nobody, acknowledged: the node has forgotten them
        wait_for(lambda: node.status()["link"]["outbox"] == 0, 20, "the node's outbox empty")
        coordinator.kill()
        coordinator = start_coordinator_process(bind, state, log_path=tmp_path / "c2.log")

        sub = ctx.socket(zmq.DEALER)
        sub.linger = 0
        sub.connect(bind)
        got.clear()
        sub.send(protocol.encode(protocol.Subscribe(
            {"n1": protocol.ResumePoint(point.boot, point.seq)})))
        until(lambda e: e.event.get("to") == "healthy" and e.event.get("incarnation") == 2,
              "the events after the client's point")
        mine = [e for e in got if e.boot == point.boot]
        seqs = [e.seq for e in mine]
        assert seqs == list(range(point.seq + 1, point.seq + 1 + len(seqs))), seqs
        assert mine[0].event["to"] == "stopping" and mine[0].event["cause"] == "exited"
        sub.close()
    finally:
        ctx.destroy(linger=0)   # closes whatever a failure left open
        coordinator.cleanup()


def test_the_journal_stays_within_its_byte_bound_and_is_not_rewritten_on_every_append(
        tmp_path: Path) -> None:
    """A buffer far bigger than the bound: the file stays within it (plus the last append),
    and compaction rewrites about as many bytes as were appended, not the buffer each turn."""
    journal = Journal(str(tmp_path), keep=100, max_bytes=1_000)
    journal.load()
    buffer = [relayed("n1", "b1", seq) for seq in range(1, 101)]   # far over 1,000 bytes
    line = len(buffer[-1].frame) + 1
    rewrites = 0
    for item in buffer:
        before = journal.path.stat().st_ino
        journal.append([item], lambda seq=item.seq: buffer[:seq])
        rewrites += journal.path.stat().st_ino != before
        assert journal.path.stat().st_size <= 1_000 + line
    assert rewrites <= 100 * line // 500 + 1      # each rewrite follows 500 bytes appended
    journal.close()
    again = Journal(str(tmp_path), keep=100, max_bytes=1_000)
    assert [i.seq for i in again.load()][-1] == 100                 # the newest kept
    again.close()


def test_an_oversized_journal_is_loaded_within_its_bound(tmp_path: Path) -> None:
    """A journal written by an older coordinator that grew without bound: only the newest
    `max_bytes` of it are read back (the memory a restart takes stays bounded)."""
    big = [relayed("n1", "b1", seq) for seq in range(1, 201)]
    (tmp_path / "relay.jsonl").write_bytes(b"".join(i.frame + b"\n" for i in big))
    journal = Journal(str(tmp_path), keep=1_000, max_bytes=2_000)
    items = journal.load()
    assert sum(len(i.frame) + 1 for i in items) <= 2_000
    assert [i.seq for i in items] == list(range(201 - len(items), 201))
    assert journal.path.stat().st_size <= 2_000
    journal.close()


def test_an_unusable_state_dir_is_named_and_keeps_its_cause(tmp_path: Path) -> None:
    """An environment error (here the journal's path is a directory) is not hidden: the
    refusal names the state dir and carries the OSError as its cause."""
    (tmp_path / JOURNAL).mkdir()
    coord = Coordinator(bind="tcp://127.0.0.1:0", state_dir=str(tmp_path))
    with pytest.raises(ValueError, match="cannot use the state dir") as caught:
        coord.start()
    assert isinstance(caught.value.__cause__, IsADirectoryError)


def test_the_standalone_coordinators_start_up_hook_comes_after_the_journal_is_restored(
        tmp_path: Path) -> None:
    """`rollout-watchdog coordinator` freezes what start-up made out of the garbage collector
    in that hook (`common/gc_tuning.py`): the restored relay buffer must be there by then."""
    journal = Journal(str(tmp_path), keep=100)
    journal.load()
    items = [relayed("n1", "b1", seq) for seq in range(1, 4)]
    journal.append(items, lambda: items)
    journal.close()
    coord = Coordinator(bind="tcp://127.0.0.1:0", state_dir=str(tmp_path))
    seen: list[int] = []

    def opened() -> None:
        seen.append(len(coord.hub.relay.buffer))
        os.kill(os.getpid(), signal.SIGTERM)   # run() stops on it, as the service does

    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    try:
        assert coord.run(opened=opened) == 0
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    assert seen == [3]


def test_a_fleet_wide_pause_sent_to_a_restarted_coordinator_reaches_its_nodes_once_back(
        make_node: Callable[..., Node], tmp_path: Path) -> None:
    """Found by a hostile run: `pause(all=True)` right after a coordinator restart answered ok
    with no node in it, and paused nothing (the view was still empty). The journal names the
    fleet's nodes; the pause now waits for them (the node is held stopped until the pause is
    at the coordinator)."""
    bind = f"tcp://127.0.0.1:{free_port()}"
    state = ["--state-dir", str(tmp_path / "state"), "--node-timeout", "30"]
    coordinator = start_coordinator_process(bind, state, log_path=tmp_path / "c1.log")
    stopped = None
    try:
        node = make_node([EngineSpec("e0")], node_id="n1", top={"coordinator": bind}).start()
        client = FleetClient(bind, timeout_s=30.0)
        client.wait_until(lambda v: any(e.name == "n1/e0" and e.state == "healthy"
                                        for e in v), 60)
        wait_for(lambda: node.status()["link"]["outbox"] == 0, 20, "the node's events taken")
        coordinator.kill()
        assert node.proc is not None
        stopped = node.proc.pid
        os.kill(stopped, signal.SIGSTOP)               # it cannot say hello yet
        coordinator = start_coordinator_process(bind, state, log_path=tmp_path / "c2.log")
        with ThreadPoolExecutor(1) as pool:
            pausing = pool.submit(client.pause, all=True)
            wait_for(lambda: coordinator.call("ping").result["nodes"] == 0, 10, "a ping")
            os.kill(stopped, signal.SIGCONT)
            stopped = None
            result = pausing.result(timeout=60)
        assert sorted(result.nodes) == ["n1"] and result.nodes["n1"].status == "ok"
        assert node.engine("e0")["paused"]
    finally:
        if stopped is not None:
            os.kill(stopped, signal.SIGCONT)
        coordinator.cleanup()
