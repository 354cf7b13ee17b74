"""The fleet wire protocol: every kind survives a round trip, and every bad frame is refused
with one ProtocolError that names the problem (never another exception)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from rollout_watchdog.common.frames import ack_frame, command_frames
from rollout_watchdog.common.protocol import (
    MAJOR,
    MAX_MESSAGE_BYTES,
    Ack,
    Command,
    Event,
    Events,
    Heartbeat,
    Hello,
    Message,
    ProtocolError,
    Reply,
    ResumePoint,
    Run,
    Subscribe,
    decode,
    encode,
)

ENGINE = {"id": "e0", "state": "serving", "paused": False, "pid": 4242, "incarnation": 3,
          "restarts": 1, "url": "http://127.0.0.1:30000",
          "last_failure": {"cause": "crash", "detail": "exit 9 ü", "ts": 1700000000.5}}
EVENT = {"ts": 1700000001.25, "node_id": "n1", "engine": "e0", "incarnation": 3, "kind": "state",
         "from": "starting", "to": "serving", "cause": None, "detail": ""}

EVERY_KIND: list[Message] = [
    Hello(node_id="n1", boot="b-77", engines=[ENGINE, {**ENGINE, "id": "e1"}], last_seq=12),
    Event(node_id="n1", boot="b-77", seq=13, event=EVENT),
    Run(node_id="n1", boot="b-77", seq=14, events=[EVENT, {**EVENT, "kind": "paused"}],
        statuses=[ENGINE, None], common={"ts": 1700000001.25, "node_id": "n1"}),
    Ack(boot="b-77", seq=13, batches=True, runs=True, common=True, lines=True),
    Heartbeat(sent_at=1700000002.5),
    Command(request_id="r-1", cmd="pause", args={"timeout_s": 30}, node="n1", engine="e0",
            timeout_s=2.5),
    Reply(request_id="r-1", status="error", reason="no engine e9", result={"n1": [1, "x"]},
          code="BAD_ARGS"),
    Subscribe(resume={"n1": ResumePoint(boot="b-77", seq=13), "n2": ResumePoint("b-1", 0)},
              batches=True, runs=True, common=True),
]


def frame(obj: object) -> bytes:
    return json.dumps(obj).encode()


def refused(data: bytes) -> str:
    with pytest.raises(ProtocolError) as caught:
        decode(data)
    return str(caught.value)


@pytest.mark.parametrize("msg", EVERY_KIND, ids=lambda m: m.KIND)
def test_every_kind_round_trips_with_every_field(msg: Message) -> None:
    data = encode(msg)
    assert decode(data) == msg
    sent = json.loads(data)
    assert sent["v"] == [1, 6] and sent["kind"] == msg.KIND


def test_a_reply_code_is_understood_both_ways_with_a_1_1_peer() -> None:
    """1.2 added the reply's `code`: a 1.1 peer's error reply (no code) decodes with none, and
    what we send a 1.1 peer is a 1.1 reply plus a field it ignores (its decoder skips unknown
    fields, as ours does). A later minor's code is kept but not known."""
    old = decode(frame({"v": [1, 1], "kind": "reply", "request_id": "r", "status": "error",
                        "reason": "lease lost: token 3 is not the current holder's"}))
    assert isinstance(old, Reply) and old.code is None and old.known_code is None
    ours = json.loads(encode(Reply("r", "error", "no", None, "LEASE_LOST")))
    assert {k: v for k, v in ours.items() if k not in ("v", "code")} == {
        "kind": "reply", "request_id": "r", "status": "error", "reason": "no", "result": None}
    later = decode(frame({"v": [1, 9], "kind": "reply", "request_id": "r", "status": "error",
                          "reason": "x", "code": "SOMETHING_NEW"}))
    assert isinstance(later, Reply) and later.code == "SOMETHING_NEW" and later.known_code is None


@pytest.mark.parametrize(("body", "problem"), [
    ({"status": "ok", "code": "LOCK_HELD"}, "'code' must be null in an \"ok\" reply"),
    ({"status": "error", "reason": "x", "code": 7}, "'code' must be a non-empty string"),
    ({"status": "error", "reason": "x", "code": ""}, "'code' must be a non-empty string"),
    ({"status": "error", "reason": "x", "code": "C" * 65}, "'code' must be at most 64"),
])
def test_a_bad_reply_code_is_refused_by_name(body: dict[str, Any], problem: str) -> None:
    assert problem in refused(frame({"v": [1, 2], "kind": "reply", "request_id": "r", **body}))


@pytest.mark.parametrize(("body", "problem"), [   # each one step from a plain "ok" reply
    ({"status": "ok"}, "missing required field 'request_id'"),
    ({"request_id": "r"}, "missing required field 'status'"),
    ({"request_id": "", "status": "ok"}, "'request_id' must be a non-empty string"),
    ({"request_id": 7, "status": "ok"}, "'request_id' must be a non-empty string"),
    ({"request_id": None, "status": "ok"}, "'request_id' must be a non-empty string"),
    ({"request_id": "r", "status": "OK"}, "'status' must be \"ok\" or \"error\""),
    ({"request_id": "r", "status": "ok", "reason": ""}, "'reason' must be a non-empty string"),
    ({"request_id": "r", "status": "ok", "reason": 7}, "'reason' must be a non-empty string"),
    ({"request_id": "r", "status": "error"}, "'reason' must be a non-empty string"),
])
def test_a_bad_reply_is_refused_by_name(body: dict[str, Any], problem: str) -> None:
    assert problem in refused(frame({"v": [1, 2], "kind": "reply", **body}))


def test_optional_fields_default_when_absent() -> None:
    assert decode(frame({"v": [1, 0], "kind": "command", "request_id": "r", "cmd": "status"})) \
        == Command(request_id="r", cmd="status", args={}, node=None, engine=None, timeout_s=None)
    assert decode(frame({"v": [1, 0], "kind": "reply", "request_id": "r", "status": "ok"})) \
        == Reply(request_id="r", status="ok")
    assert decode(frame({"v": [1, 0], "kind": "subscribe", "resume": None})) == Subscribe()
    # JSON writes a whole float as an int: still a float on our side
    beat = decode(frame({"v": [1, 0], "kind": "heartbeat", "sent_at": 5}))
    assert isinstance(beat, Heartbeat) and isinstance(beat.sent_at, float)


def test_unknown_fields_ignored_and_newer_minor_accepted() -> None:
    obj: dict[str, Any] = {**Ack(boot="b", seq=4).to_json(), "v": [1, 7], "priority": "high"}
    assert decode(frame(obj)) == Ack(boot="b", seq=4)


GOOD_ACK = {"v": [1, 0], "kind": "ack", "boot": "b", "seq": 1}


@pytest.mark.parametrize(("data", "reason"), [
    (b"\xff\xfe{}", "not UTF-8"),
    (b"{\"v\": [1, 0], ", "not JSON"),
    (b"", "not JSON"),
    (frame([1, 2]), "a message is a JSON object, got list"),
    (frame({"v": [2, 0], "kind": "ack", "boot": "b", "seq": 1}),
     "unsupported protocol version 2.0: this side speaks 1"),
    (frame({"kind": "ack", "boot": "b", "seq": 1}), "missing or malformed version"),
    (frame({**GOOD_ACK, "v": "1.0"}), "missing or malformed version"),
    (frame({**GOOD_ACK, "v": [True, 0]}), "missing or malformed version"),
    (frame({"v": [1, 0], "boot": "b", "seq": 1}), "missing 'kind'"),
    (frame({**GOOD_ACK, "kind": "launch"}), "unknown kind 'launch' (known: ack, command"),
    (frame({**GOOD_ACK, "kind": 3}), "unknown kind 3"),
    (frame({"v": [1, 0], "kind": "ack", "boot": "b"}), "ack: missing required field 'seq'"),
    (frame({**GOOD_ACK, "seq": -1}), "ack: field 'seq' must be an integer >= 0, got -1"),
    (frame({**GOOD_ACK, "seq": "3"}), "ack: field 'seq' must be an integer >= 0, got '3'"),
    (frame({**GOOD_ACK, "seq": 2.0}), "field 'seq' must be an integer"),
    (frame({**GOOD_ACK, "seq": True}), "field 'seq' must be an integer"),
    (frame({**GOOD_ACK, "boot": ""}), "ack: field 'boot' must be a non-empty string"),
    (frame({**Event("n", "b", 1, {}).to_json(), "seq": 0}), "event: field 'seq' must be an "
     "integer >= 1"),
    (frame({**Event("n", "b", 1, {}).to_json(), "event": [1]}), "field 'event' must be an object"),
    (frame({**Hello("n", "b", [], 0).to_json(), "engines": {}}), "field 'engines' must be a list"),
    (frame({**Hello("n", "b", [], 0).to_json(), "engines": [{"state": "x"}]}),
     "field 'engines[0].id' must be a non-empty string"),
    (frame({**Hello("n", "b", [], 0).to_json(), "node_id": None}), "field 'node_id'"),
    (frame({"v": [1, 0], "kind": "heartbeat", "sent_at": "now"}), "'sent_at' must be a finite"),
    (frame({"v": [1, 0], "kind": "command", "request_id": "r", "cmd": "x", "engine": "e0"}),
     "engine 'e0' given without its node"),
    (frame({"v": [1, 0], "kind": "command", "request_id": "r", "cmd": "x", "timeout_s": 0}),
     "'timeout_s' must be a positive finite number"),
    (frame({"v": [1, 0], "kind": "command", "request_id": "r", "cmd": "x", "args": []}),
     "'args' must be an object"),
    (frame({"v": [1, 0], "kind": "reply", "request_id": "r", "status": "maybe"}),
     "'status' must be \"ok\" or \"error\""),
    (frame({"v": [1, 0], "kind": "reply", "request_id": "r", "status": "error"}),
     "field 'reason' must be a non-empty string"),
    (frame({"v": [1, 0], "kind": "subscribe", "resume": {"n1": {"boot": "b"}}}),
     "resume['n1'] lacks 'seq'"),
    (frame({"v": [1, 0], "kind": "subscribe", "resume": {"n1": {"boot": "b", "seq": -2}}}),
     "'resume.seq' must be an integer >= 0"),
    (frame({"v": [1, 0], "kind": "subscribe", "resume": [1]}), "'resume' must be an object"),
    (b'{"v": [1, 0], "kind": "heartbeat", "sent_at": NaN}', "non-finite number 'NaN'"),
    (b'{"v": [1, 0], "kind": "heartbeat", "sent_at": -Infinity}', "non-finite number"),
    (b'{"v": [1, 0], "kind": "heartbeat", "sent_at": 1e999}', "non-finite number '1e999'"),
    (b'{"v": [1, 0], "kind": "ack", "boot": "b", "seq": 99999999999999999999}',
     "does not fit in 64 bits"),
])
def test_bad_frames_are_refused_with_their_reason(data: bytes, reason: str) -> None:
    assert reason in refused(data)


def test_size_bound_on_both_sides() -> None:
    detail = "x" * (MAX_MESSAGE_BYTES // 2)
    fits = Event("n1", "b", 1, {**EVENT, "detail": detail})
    assert decode(encode(fits)) == fits
    too_big = Event("n1", "b", 1, {**EVENT, "detail": detail * 2})
    with pytest.raises(ProtocolError, match="exceeds the limit of 1048576 bytes"):
        encode(too_big)
    oversized = frame(too_big.to_json())
    assert "exceeds the limit" in refused(oversized)
    assert "exceeds the limit" in refused(b" " * (MAX_MESSAGE_BYTES + 1))


def test_a_snapshot_of_a_large_node_fits() -> None:
    engines = [{**ENGINE, "id": f"engine-{i:04d}", "url": f"http://10.0.0.1:{30000 + i}"}
               for i in range(1000)]
    hello = Hello("gpu-node-17", "b", engines, 10**9)
    assert decode(encode(hello)) == hello


@pytest.mark.parametrize(("data", "reason"), [
    (b"[" * 200_000, "nested too deeply"),
    (b'{"v": [1, 0], "kind": "command", "request_id": "r", "cmd": "x", "args": {"a": '
     + b"[" * 100_000 + b"]" * 100_000 + b"}}", "nested too deeply"),
    (b'{"v": [1, 0], "kind": "ack", "boot": "b", "seq": 1' + b"0" * 500_000 + b"}",
     "does not fit in 64 bits"),
    (b'{"v": [1, 0], "kind": "heartbeat", "sent_at": 1' + b"0" * 500_000 + b".5}",
     "non-finite number"),
])
def test_hostile_json_is_refused_not_crashing(data: bytes, reason: str) -> None:
    assert reason in refused(data)


def test_deep_but_parseable_value_in_a_refusal_does_not_crash() -> None:
    # nested just within the parser's reach, in a field whose refusal shows the value
    for depth in (100, 500, 900):
        data = b'{"v": [1, 0], "kind": "ack", "boot": "b", "seq": ' + b"[" * depth \
            + b"]" * depth + b"}"
        reason = refused(data)
        assert "ack: field 'seq'" in reason or "nested too deeply" in reason


def test_encode_refuses_what_json_cannot_carry() -> None:
    with pytest.raises(ProtocolError, match="cannot encode"):
        encode(Event("n", "b", 1, {"detail": float("nan")}))
    with pytest.raises(ProtocolError, match="cannot encode"):
        encode(Reply("r", "ok", result={1, 2}))


def test_constructing_an_invalid_message_is_refused_too() -> None:
    with pytest.raises(ProtocolError, match="'seq' must be an integer >= 0"):
        Ack(boot="b", seq=-1)
    with pytest.raises(ProtocolError, match="must be a resume point"):
        Subscribe(resume={"n1": {"boot": "b", "seq": 1}})  # type: ignore[dict-item]


def test_the_event_s_own_json_mapping_is_the_generic_one() -> None:
    """Event writes its to_json/from_json out (the hot path); they must say what the generic
    mapping of its fields says, so a field added later cannot be dropped on the wire."""
    from rollout_watchdog.common.protocol import _Message
    event = Event("n1", "boot-1", 7, EVENT, ENGINE)
    assert event.to_json() == _Message.to_json(event)
    assert Event.from_json(event.to_json()) == _Message.from_json.__func__(Event, event.to_json())
    for missing in ("node_id", "boot", "seq", "event"):
        obj = {k: v for k, v in event.to_json().items() if k != missing}
        with pytest.raises(ProtocolError, match=f"event: missing required field '{missing}'"):
            decode(json.dumps(obj).encode())


def test_the_hub_s_batch_encoders_write_what_encode_writes() -> None:
    """ack_frame and command_frames (a fleet-wide pause's 1,000 ACKs and commands, encoded
    together) must write the very frames encode() would, whatever the ids and args hold."""
    for boot, seq in (("b-77 ü\"", 13), ("b", 0)):
        assert ack_frame(boot, seq) == encode(Ack(boot, seq, batches=True, runs=True,
                                                  common=True, lines=True))
    targets = [("r-1/n1", "n1"), ("r-1/nœud \"2\"", "nœud \"2\"")]
    for args in ({"all": True, "deadline_s": 60}, {"x": "\x00request", "y": "\x00node"}):
        template = Command("r-1", "pause", args, None, None, 2.5)
        assert command_frames(template, targets) == [
            encode(Command(rid, "pause", args, node, None, 2.5)) for rid, node in targets]
    one = Command("r-2", "restart", {"engine": "e0"}, "n1", "e0")
    assert command_frames(one, [("r-2/n1", "n1")]) == [
        encode(Command("r-2/n1", "restart", {"engine": "e0"}, "n1", "e0"))]
    with pytest.raises(ProtocolError, match="over the limit"):
        command_frames(Command("r", "pause", {}), [("r/n", "n" * MAX_MESSAGE_BYTES)])
    with pytest.raises(ProtocolError, match="'node' must be a non-empty string"):
        command_frames(Command("r", "pause", {}), [("r/", "")])


def test_a_run_stands_for_its_events_in_order_alone_or_inside_an_events_frame() -> None:
    """A run (1.4) is the events seq, seq+1, ... of one boot, each with its status (none when
    `statuses` is left out); inside an "events" frame it decodes to those events in place."""
    run = Run("n1", "b-77", 14, [EVENT, {**EVENT, "kind": "paused"}], [ENGINE, None])
    assert run.as_events() == [Event("n1", "b-77", 14, EVENT, ENGINE),
                               Event("n1", "b-77", 15, {**EVENT, "kind": "paused"}, None)]
    plain = Run("n1", "b-77", 3, [EVENT, EVENT])
    assert "statuses" not in json.loads(encode(plain))
    assert [e.engine_status for e in plain.as_events()] == [None, None]
    assert Run.of(plain.as_events()) == plain and Run.of(run.as_events()) == run
    alone = encode(Event("n2", "b-1", 1, EVENT))
    mixed = (b'{"v":[1,4],"kind":"events","events":[' + alone + b"," + encode(run) + b","
             + encode(plain) + b"]}")
    decoded = decode(mixed)
    assert isinstance(decoded, Events) and [(e.node_id, e.seq) for e in decoded.events] \
        == [("n2", 1), ("n1", 14), ("n1", 15), ("n1", 3), ("n1", 4)]


def test_a_run_says_the_scalar_fields_its_events_share_once_to_a_peer_that_takes_that() -> None:
    """With `common` (1.5), a run's frame says once each scalar field that every event has with
    one value of one type (1 is not 1.0 or true), and each event only the rest; it decodes to
    the whole events, an event's own field winning over common's."""
    paused = [{"ts": 1700000001.25 + i, "node_id": "n1", "engine": f"e{i}", "incarnation": 1,
               "kind": "paused", "from": None, "deadline": 1700000061.5,
               "mixed": [1, 1.0][i % 2], "nested": {"a": 1}} for i in range(3)]
    events = [Event("n1", "b-1", 5 + i, body) for i, body in enumerate(paused)]
    run = Run.of(events, common=True)
    assert run.common == {"node_id": "n1", "incarnation": 1, "kind": "paused", "from": None,
                          "deadline": 1700000061.5}
    sent = json.loads(encode(run))
    assert sent["common"] == run.common and sent["events"][1] == {
        "ts": 1700000002.25, "engine": "e1", "mixed": 1.0, "nested": {"a": 1}}
    assert decode(encode(run)) == run and run.as_events() == events
    assert len(encode(run)) < len(encode(Run.of(events))) < len(encode(Events(events)))
    assert Run.of(events).common is None and Run.of(events[:1], common=True).common is None
    own = dict(sent, events=[{"kind": "resumed"}, {}, {}])
    assert [e["kind"] for e in decode(frame(own)).events] == ["resumed", "paused", "paused"]


@pytest.mark.parametrize(("fields", "error"), [
    ({"node_id": ""}, "run: field 'node_id' must be a non-empty string"),
    ({"seq": 0}, "run: field 'seq' must be an integer >= 1"),
    ({"events": []}, "run: field 'events' must be a non-empty list of events"),
    ({"events": [{}, "x"]}, "run: field 'events[1]' must be an object"),
    ({"seq": (1 << 63) - 1}, "run: field 'the last seq': integer does not fit in 64 bits"),
    ({"statuses": [None]}, "run: field 'statuses' must be null or a list of 2"),
    ({"statuses": [None, {"id": 5}]}, "run: field 'statuses[1].id' must be a non-empty string"),
    ({"common": 5}, "run: field 'common' must be an object"),
    ({"common": {}, "events": [{}, 7]}, "run: field 'events[1]' must be an object"),
])
def test_a_bad_run_is_refused_naming_the_field(fields: dict[str, Any], error: str) -> None:
    body = {"v": [1, 4], "kind": "run", "node_id": "n1", "boot": "b", "seq": 1,
            "events": [{}, {}], **fields}
    assert error in refused(frame(body))
    inside = {"v": [1, 4], "kind": "events", "events": [body]}
    assert refused(frame(inside)) == f"events[0]: {refused(frame(body))}"


def test_an_optional_field_that_is_null_takes_its_default() -> None:
    """The spec's "?": optional, may be null or absent. A peer that writes `"batches": null`
    (or `"args": null`) is understood as one that left it out; a wrong type is still refused."""
    def body(kind: str, **fields: Any) -> bytes:
        return json.dumps({"v": [MAJOR, 0], "kind": kind, **fields}).encode()

    ack = decode(body("ack", boot="b1", seq=3, batches=None, runs=True, common=None))
    assert isinstance(ack, Ack) and (ack.batches, ack.runs, ack.common) == (False, True, False)
    sub = decode(body("subscribe", resume=None, batches=True, runs=None, common=None))
    assert isinstance(sub, Subscribe) and (sub.batches, sub.runs, sub.common) == (
        True, False, False)
    command = decode(body("command", request_id="r1", cmd="ping", args=None))
    assert isinstance(command, Command) and command.args == {}
    with pytest.raises(ProtocolError, match="batches"):
        decode(body("ack", boot="b1", seq=3, batches=0))
