"""The coordinator's event relay, driven with plain frames and a recording `send` (no sockets):
each subscriber gets the events in order, each once, at its own pace, and a resuming one gets
exactly what it lacks (docs/protocol.md, "The coordinator's side")."""

from __future__ import annotations

import pytest

from rollout_watchdog.agent import relay as relay_module
from rollout_watchdog.agent.relay import Relay, Relayed
from rollout_watchdog.common import protocol
from rollout_watchdog.common.protocol import ResumePoint, Subscribe

T0 = 1000.0
A, B, C = b"client-a", b"client-b", b"client-c"


def item(node: str, seq: int, boot: str = "b1") -> Relayed:
    return Relayed(node, boot, seq, f"{node}/{boot}/{seq}".encode())


def frames(*items: Relayed) -> list[bytes]:
    return [i.frame for i in items]


class Clients:
    """The other side of `send`: what each client got; a client can be made to block (its
    queue is full) or to be gone."""

    def __init__(self) -> None:
        self.got: dict[bytes, list[bytes]] = {}
        self.room: dict[bytes, int] = {}      # frames a client takes before blocking
        self.gone: set[bytes] = set()

    def send(self, client: bytes, frame: bytes) -> bool:
        if client in self.gone:
            raise LookupError(client)
        if client in self.room:
            if self.room[client] == 0:
                return False
            self.room[client] -= 1
        self.got.setdefault(client, []).append(frame)
        return True


def filled(*items: Relayed, capacity: int = 100) -> Relay:
    relay = Relay(capacity=capacity)
    for i in items:
        relay.add(i)
    return relay


def test_subscribers_get_every_event_in_order_each_once() -> None:
    relay, clients = Relay(), Clients()
    relay.subscribe(A, Subscribe(), T0)
    relay.subscribe(B, Subscribe(), T0)
    events = [item("n1", 1), item("n2", 1), item("n1", 2)]
    for e in events[:2]:
        relay.add(e)
    assert relay.pump(clients.send, T0) is False
    relay.add(events[2])
    relay.pump(clients.send, T0)
    relay.pump(clients.send, T0)
    assert clients.got == {A: frames(*events), B: frames(*events)}


def test_a_subscriber_without_resume_gets_only_new_events() -> None:
    relay, clients = filled(item("n1", 1), item("n1", 2)), Clients()
    relay.subscribe(A, Subscribe(), T0)
    relay.pump(clients.send, T0)
    assert clients.got == {}
    relay.add(item("n1", 3))
    relay.pump(clients.send, T0)
    assert clients.got == {A: frames(item("n1", 3))}


def test_resume_skips_what_the_client_has_by_its_point_in_the_buffer() -> None:
    """Everything of that node up to its point is had, even events of an earlier boot; other
    nodes' events are all sent, and so are the coordinator's own events about the node: its
    point says nothing of them (a restarted coordinator makes them anew, before the node's
    resent events; a client drops one it has by its boot and seq)."""
    own = Relayed("n1", "coord", 1, b"n1/coord/1", own=True)
    buffered = [item("n1", 7, boot="old"), item("n1", 1), item("n2", 1), own, item("n1", 2),
                item("n2", 2), item("n1", 3)]
    relay, clients = filled(*buffered), Clients()
    relay.subscribe(A, Subscribe({"n1": ResumePoint("b1", 2)}), T0)
    relay.pump(clients.send, T0)
    relay.add(item("n1", 4))
    relay.pump(clients.send, T0)
    assert clients.got[A] == [item("n2", 1).frame, own.frame] + frames(
        item("n2", 2), item("n1", 3), item("n1", 4))


def test_resume_skips_by_seq_of_the_same_boot_when_its_point_is_not_buffered() -> None:
    """A restarted coordinator holds only what nodes resent: the events of the point's boot up
    to its seq are had; those of other boots (the client drops the ones it has seen) are sent."""
    buffered = [item("n1", 2), item("n1", 3), item("n1", 1, boot="coord"), item("n1", 5),
                item("n1", 6)]
    relay, clients = filled(*buffered), Clients()
    relay.subscribe(A, Subscribe({"n1": ResumePoint("b1", 4)}), T0)
    relay.pump(clients.send, T0)
    assert clients.got[A] == frames(item("n1", 1, boot="coord"), item("n1", 5), item("n1", 6))


def test_a_blocked_send_is_retried_from_the_same_place_nothing_lost_or_doubled() -> None:
    events = [item("n1", s) for s in range(1, 8)]
    relay, clients = Relay(), Clients()
    relay.subscribe(A, Subscribe(), T0)
    relay.subscribe(B, Subscribe(), T0)
    for e in events[:5]:
        relay.add(e)
    clients.room[A] = 2
    assert relay.pump(clients.send, T0) is True               # A is behind: come back soon
    assert clients.got[A] == frames(*events[:2])
    assert clients.got[B] == frames(*events[:5])           # one slow client holds up no other
    assert relay.pump(clients.send, T0) is True                 # still blocked: nothing moves
    assert clients.got[A] == frames(*events[:2])
    clients.room[A] = 1
    relay.pump(clients.send, T0)
    for e in events[5:]:
        relay.add(e)
    del clients.room[A]
    assert relay.pump(clients.send, T0) is False
    assert clients.got[A] == frames(*events)
    assert clients.got[B] == frames(*events)


def test_a_catching_up_subscriber_gets_a_share_per_turn(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(relay_module, "SENDS_PER_TURN", 3)
    events = [item("n1", s) for s in range(1, 8)]
    relay, clients = filled(*events), Clients()
    relay.subscribe(A, Subscribe({}), T0)                  # resume with no points: all of it
    assert relay.pump(clients.send, T0) is True
    assert clients.got[A] == frames(*events[:3])
    relay.pump(clients.send, T0)
    assert relay.pump(clients.send, T0) is False
    assert clients.got[A] == frames(*events)


def test_an_unreachable_client_keeps_its_place_until_its_subscription_expires() -> None:
    """libzmq answers EHOSTUNREACH for a gone peer, but also for a live one whose full queue
    has not been marked writable again yet: so no event is skipped, and a client that is
    really gone is dropped once silent past the timeout."""
    relay, clients = filled(), Clients()
    relay.subscribe(A, Subscribe(), T0)
    relay.subscribe(B, Subscribe(), T0)
    relay.add(item("n1", 1))
    clients.gone.add(A)
    assert relay.pump(clients.send, T0) is True               # A is behind, not dropped
    assert clients.got == {B: frames(item("n1", 1))}
    clients.gone.clear()
    assert relay.pump(clients.send, T0) is False
    assert clients.got[A] == frames(item("n1", 1))
    clients.gone.add(A)
    relay.heard(B, T0 + relay.subscriber_timeout_s)
    assert relay.expire(T0 + relay.subscriber_timeout_s + 1) == [A]
    assert list(relay.subscribers) == [B]


def test_a_subscriber_that_fell_out_of_the_buffer_is_counted_and_carries_on() -> None:
    relay, clients = Relay(capacity=3), Clients()
    relay.subscribe(A, Subscribe(), T0)
    relay.subscribe(B, Subscribe(), T0)
    clients.room[A] = 0
    events = [item("n1", s) for s in range(1, 6)]
    for e in events:
        relay.add(e)
        clients.room[B] = 1
        relay.pump(clients.send, T0)
    assert clients.got[B] == frames(*events)                # a keeping-up client lost nothing
    assert relay.skipped_behind == 2                        # A lost n1/1 and n1/2
    del clients.room[A]
    relay.pump(clients.send, T0)
    assert clients.got[A] == frames(*events[2:])


def test_subscriptions_expire_after_the_timeout_unless_heard() -> None:
    relay = Relay(subscriber_timeout_s=10.0)
    relay.subscribe(A, Subscribe(), T0)
    relay.subscribe(B, Subscribe(), T0)
    relay.heard(B, T0 + 8.0)
    relay.heard(b"stranger", T0 + 8.0)   # no subscription: none made
    assert relay.expire(T0 + 10.0) == []
    assert relay.expire(T0 + 10.5) == [A]
    assert list(relay.subscribers) == [B]
    assert relay.expire(T0 + 18.5) == [B]


def test_subscribing_again_replaces_the_subscription() -> None:
    relay, clients = filled(item("n1", 1)), Clients()
    relay.subscribe(A, Subscribe({}), T0)
    relay.subscribe(A, Subscribe({"n1": ResumePoint("b1", 1)}), T0)
    relay.add(item("n1", 2))
    relay.pump(clients.send, T0)
    assert clients.got == {A: frames(item("n1", 2))}


def test_a_client_still_taking_events_is_not_expired_for_late_heartbeats() -> None:
    relay, clients = filled(), Clients()
    relay.subscribe(A, Subscribe(), T0)
    later = T0 + relay.subscriber_timeout_s
    relay.add(item("n1", 1))
    relay.pump(clients.send, later)               # busy reading a burst, no heartbeat
    assert relay.expire(later + 1) == []
    assert relay.expire(later + relay.subscriber_timeout_s + 1) == [A]


def node_batch(node: str, seqs: range) -> Relayed:
    """The item of one node "events" frame, as the coordinator relays it."""
    events = [protocol.Event(node, "b1", s, {"kind": "state", "n": s}) for s in seqs]
    return Relayed(node, "b1", seqs[0], protocol.encode(protocol.Events(events)), len(seqs),
                   "events")


def seqs_in(frames: list[bytes]) -> list[tuple[str, int]]:
    out = []
    for data in frames:
        message = protocol.decode(data)
        batch = (message.events if isinstance(message, protocol.Events) else
                 message.as_events() if isinstance(message, protocol.Run) else [message])
        out += [(e.node_id, e.seq) for e in batch]   # type: ignore[union-attr]
    return out


def test_batches_are_spliced_whole_or_split_as_each_client_takes_them() -> None:
    """A client taking batches that lacks all of a node's batch gets its events spliced, with
    what follows, into one frame (no event encoded); one resumed mid-batch gets the rest, spliced
    likewise; a client without batches gets each event alone."""
    batch = node_batch("n1", range(1, 5))
    alone = [Relayed("n2", "b1", s, protocol.encode(protocol.Event("n2", "b1", s, {})))
             for s in (1, 2)]
    relay, clients = filled(batch, *alone), Clients()
    relay.subscribe(A, Subscribe({}, batches=True), T0)            # all of it
    relay.subscribe(B, Subscribe({"n1": ResumePoint("b1", 2)}, batches=True), T0)
    relay.subscribe(C, Subscribe({}), T0)                          # no batches
    assert relay.pump(clients.send, T0) is False
    assert len(clients.got[A]) == 1                              # n1's batch and n2's two
    assert len(clients.got[B]) == 1                              # n1 3-4 and n2 1-2 spliced
    assert len(clients.got[C]) == 6
    whole = [("n1", s) for s in range(1, 5)] + [("n2", 1), ("n2", 2)]
    assert seqs_in(clients.got[A]) == whole and seqs_in(clients.got[C]) == whole
    assert seqs_in(clients.got[B]) == whole[2:]
    assert clients.got[C][:4] == [batch.event_frame(part) for part in range(4)]   # split
    assert clients.got[C][:4] == [protocol.encode(e)
                                  for e in protocol.decode(batch.frame).events]  # type: ignore[union-attr]


def test_a_fleet_wide_burst_reaches_a_client_in_few_frames() -> None:
    """A thousand nodes' batches of 8 (a fleet-wide pause) go out joined, each frame within
    RELAYED_BATCH_EVENTS and protocol.BATCH_BYTES, every event once and in order."""
    batches = [node_batch(f"n{i:04d}", range(1, 9)) for i in range(1000)]
    relay, clients = filled(*batches, capacity=8000), Clients()
    relay.subscribe(A, Subscribe({}, batches=True), T0)
    while relay.pump(clients.send, T0):
        pass
    assert seqs_in(clients.got[A]) == [(f"n{i:04d}", s) for i in range(1000) for s in range(1, 9)]
    assert len(clients.got[A]) <= 8000 // relay_module.RELAYED_BATCH_EVENTS + 10
    assert all(len(frame) <= protocol.BATCH_BYTES for frame in clients.got[A])
    assert all(len(protocol.decode(frame).events) <= relay_module.RELAYED_BATCH_EVENTS  # type: ignore[union-attr]
               for frame in clients.got[A])


def test_a_run_goes_whole_to_a_client_taking_runs_and_split_to_the_others() -> None:
    """A node's "run" (1.4) is spliced as that very message into the "events" frame of a
    client taking runs; a client taking batches only gets the events it stands for, each
    spliced in as its own "event" message; one without batches gets each alone."""
    run = protocol.Run("n1", "b1", 1, [{"kind": "paused", "n": s} for s in range(1, 4)])
    frame = protocol.encode(run)
    relay, clients = filled(Relayed("n1", "b1", 1, frame, 3, "run"),
                            node_batch("n2", range(1, 3))), Clients()
    relay.subscribe(A, Subscribe({}, batches=True, runs=True), T0)
    relay.subscribe(B, Subscribe({}, batches=True), T0)
    relay.subscribe(C, Subscribe({}), T0)
    assert relay.pump(clients.send, T0) is False
    whole = [("n1", 1), ("n1", 2), ("n1", 3), ("n2", 1), ("n2", 2)]
    assert all(seqs_in(clients.got[c]) == whole for c in (A, B, C))
    assert len(clients.got[A]) == 1 and frame in clients.got[A][0]
    assert len(clients.got[B]) == 1 and b'"kind":"run"' not in clients.got[B][0]
    assert clients.got[C][:3] == [protocol.encode(e) for e in run.as_events()]


def test_a_run_saying_common_fields_once_goes_whole_only_to_a_client_taking_that() -> None:
    """A run with `common` (1.5) goes as it came only to a client that set `common`; a client
    taking runs without it (a 1.4 FleetClient) gets the whole events it stands for."""
    events = [protocol.Event("n1", "b1", s, {"kind": "paused", "engine": f"e{s}"})
              for s in range(1, 4)]
    run = protocol.Run.of(events, common=True)
    assert run.common == {"kind": "paused"}
    frame = protocol.encode(run)
    relay, clients = filled(Relayed("n1", "b1", 1, frame, 3, "run", common=True)), Clients()
    relay.subscribe(A, Subscribe({}, batches=True, runs=True, common=True), T0)
    relay.subscribe(B, Subscribe({}, batches=True, runs=True), T0)
    assert relay.pump(clients.send, T0) is False
    assert clients.got[A] == [b'{"v":[%d,%d],"kind":"events","events":[' % protocol.VERSION
                              + frame + b"]}"]
    assert b'"common"' not in clients.got[B][0]
    assert protocol.decode(clients.got[B][0]).events == events  # type: ignore[union-attr]


def test_a_batch_of_another_protocol_version_goes_as_it_came() -> None:
    """A node batch this package did not write (another minor version's envelope) is not
    spliced: it goes alone, as it came, between the runs spliced around it."""
    old_frame = protocol.encode(protocol.Events([protocol.Event("n1", "b1", s, {})
                                                 for s in (1, 2)])).replace(
        b'{"v":[%d,%d],"kind":"events"' % protocol.VERSION, b'{"v":[1,1],"kind":"events"', 1)
    old = Relayed("n1", "b1", 1, old_frame, 2, "events")
    relay, clients = filled(node_batch("n0", range(1, 3)), old, node_batch("n2", range(1, 3))
                            ), Clients()
    relay.subscribe(A, Subscribe({}, batches=True), T0)
    assert relay.pump(clients.send, T0) is False
    assert len(clients.got[A]) == 3 and clients.got[A][1] == old_frame
    assert [n for n, _ in seqs_in(clients.got[A])] == ["n0", "n0", "n1", "n1", "n2", "n2"]


def test_a_batch_is_not_forwarded_whole_past_a_clients_share(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(relay_module, "SENDS_PER_TURN", 3)
    relay, clients = filled(node_batch("n1", range(1, 6))), Clients()
    relay.subscribe(A, Subscribe({}, batches=True), T0)
    assert relay.pump(clients.send, T0) is True                  # 3 this turn, 2 the next
    assert seqs_in(clients.got[A]) == [("n1", s) for s in range(1, 4)]
    assert relay.pump(clients.send, T0) is False
    assert seqs_in(clients.got[A]) == [("n1", s) for s in range(1, 6)]


def test_the_buffer_is_bounded_by_bytes_and_a_client_that_fell_out_is_told_of_the_gap() -> None:
    """Big events push the oldest out by bytes long before the count bound; a client that was
    not reading gets a "gap" event with how many it lost, then the rest, in order."""
    gaps: list[int] = []

    def gap_frame(lost: int) -> bytes:
        gaps.append(lost)
        return b"gap %d" % lost

    big = [Relayed("n1", "b1", s, b"x" * 10_000) for s in range(1, 21)]
    relay, clients = Relay(capacity=1_000, max_bytes=50_000, gap_frame=gap_frame), Clients()
    relay.subscribe(A, Subscribe(), T0)
    relay.subscribe(B, Subscribe(), T0)
    clients.room[A] = 0                               # not reading
    for e in big:
        relay.add(e)
        assert relay.bytes <= relay.max_bytes
        relay.pump(clients.send, T0)
    assert clients.got[B] == frames(*big)             # one keeping up loses nothing
    kept = len(relay.buffer)
    assert kept == 4 and relay.bytes == sum(e.size for e in big[-kept:])
    clients.room[A] = 0                               # the gap waits for room, not lost
    relay.pump(clients.send, T0)
    assert A not in clients.got and relay.subscribers[A].lost == 20 - kept
    del clients.room[A]
    relay.pump(clients.send, T0)
    assert clients.got[A] == [b"gap 16", *frames(*big[-kept:])]
    assert relay.skipped_behind == 16 and gaps[-1] == 16
    relay.pump(clients.send, T0)
    assert clients.got[A][-1] == big[-1].frame        # told once


def test_one_event_bigger_than_the_byte_bound_is_still_relayed() -> None:
    relay, clients = Relay(max_bytes=1_000), Clients()
    relay.subscribe(A, Subscribe(), T0)
    relay.add(Relayed("n1", "b1", 1, b"x" * 5_000))
    relay.pump(clients.send, T0)
    assert len(clients.got[A]) == 1 and len(relay.buffer) == 1


def test_batches_leave_the_buffer_whole_and_keep_both_bounds() -> None:
    """A node's batch is one item: it leaves whole, oldest first, while the buffer is over
    either bound, and the counts (events, bytes, the first relay index) stay exact."""
    for capacity, max_bytes in ((20, 1 << 20), (1_000, 3_000)):
        relay = Relay(capacity=capacity, max_bytes=max_bytes)
        batches = [node_batch("n1", range(first, first + 8)) for first in range(1, 80, 8)]
        for batch in batches:
            relay.add(batch)
            kept = relay.buffer
            assert relay.events == sum(i.count for i in kept) == relay.end - relay.first
            assert relay.bytes == sum(i.size for i in kept)
            assert relay.events <= capacity and relay.bytes <= max(max_bytes, batch.size)
            assert kept[0].first == relay.first and kept[-1] is batch
            assert kept == batches[batches.index(batch) + 1 - len(kept):batches.index(batch) + 1]
        assert relay.first == 8 * (len(batches) - len(relay.buffer))
