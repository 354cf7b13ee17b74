"""When the coordinator ACKs a node's events (agent/acks.py), without processes."""

from __future__ import annotations

from rollout_watchdog.agent.acks import AckSchedule


def test_a_hello_is_acknowledged_at_the_end_of_its_turn() -> None:
    acks = AckSchedule(after_events=4)
    acks.hello("n1")
    assert acks.due_now() == ["n1"] and acks.owed("n1")
    acks.sent("n1")
    assert not acks.owed("n1") and acks.due_now() == []


def test_events_wait_for_the_heartbeat_until_a_node_is_owed_the_bound() -> None:
    acks = AckSchedule(after_events=4)
    acks.took("n1", 3)
    acks.took("n2", 1)
    assert acks.due_now() == [] and acks.owed("n1") and acks.owed("n2")
    acks.took("n1", 1)   # 4 owed: at once
    assert acks.due_now() == ["n1"]
    acks.sent("n1")
    acks.took("n1", 3)   # counted afresh after an ACK
    assert acks.due_now() == [] and acks.owed("n1")


def test_an_ack_sent_with_a_heartbeat_takes_the_node_off_this_turns_list() -> None:
    acks = AckSchedule(after_events=2)
    acks.took("n1", 2)
    acks.sent("n1")   # the heartbeat came first
    assert acks.due_now() == [] and not acks.owed("n1")
