"""Property tests of the wire protocol: decode() refuses every bad frame with a ProtocolError
and nothing else (arbitrary bytes, arbitrary JSON, valid messages with fields removed, mistyped
or mutated), every valid message survives a round trip, unknown fields are ignored and an
unknown MAJOR is refused by its number. The "events" kind (1.1) likewise, and event frames
packed into one by EventsFrame decode to the same events, in order, split by size."""

from __future__ import annotations

import json
import os
from typing import Any

from hypothesis import example, given, settings
from hypothesis import strategies as st

from rollout_watchdog.common import json_frame, protocol
from rollout_watchdog.common.frames import EventsFrame
from rollout_watchdog.common.plain import PlainRun, decode_plain
from rollout_watchdog.common.protocol import (
    MAJOR,
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

# Hypothesis's default of 100 examples a property in the suite (each run draws new ones);
# RW_FUZZ_EXAMPLES=2000 for a deeper search before a protocol change lands.
FAST = settings(max_examples=int(os.environ.get("RW_FUZZ_EXAMPLES", "100")), deadline=None)

names = st.text(min_size=1, max_size=20)
seqs = st.integers(min_value=0, max_value=(1 << 63) - 1)
finite = st.floats(allow_nan=False, allow_infinity=False)
json_scalars = st.none() | st.booleans() | st.integers(-(1 << 63), (1 << 63) - 1) | finite \
    | st.text(max_size=20)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=12)
json_objects = st.dictionaries(st.text(max_size=8), json_values, max_size=5)
engines = st.lists(json_objects.flatmap(lambda o: names.map(lambda i: {**o, "id": i})),
                   max_size=4)
positive = st.floats(min_value=1e-6, max_value=1e9, allow_nan=False)

events = st.builds(Event, node_id=names, boot=names, seq=st.integers(1, (1 << 63) - 1),
                   event=json_objects,
                   engine_status=st.none() | json_objects.map(lambda o: {**o, "id": "e0"}))
# A node's run (1.4), with its shared fields said once (1.5) or not: the events of one boot, in
# order, some sharing fields (a pause's "paused" events share all but the engine and the time)
shared_bodies = st.tuples(json_objects, st.lists(json_objects, min_size=1, max_size=4)).map(
    lambda c: [{**c[0], **own} for own in c[1]])
runs = st.builds(
    lambda node, boot, seq, bodies, statuses, common: Run.of(
        [Event(node, boot, seq + i, body, statuses[i % len(statuses)])
         for i, body in enumerate(bodies)], common),
    names, names, st.integers(1, 1 << 40), shared_bodies,
    st.sampled_from([[None], [{"id": "e0"}], [None, {"id": "e1", "x": [1]}]]), st.booleans())
messages: st.SearchStrategy[Message] = st.one_of(
    st.builds(Hello, node_id=names, boot=names, engines=engines, last_seq=seqs),
    events,
    st.builds(Events, events=st.lists(events, min_size=1, max_size=4)),
    runs,
    st.builds(Ack, boot=names, seq=seqs, batches=st.booleans()),
    st.builds(Heartbeat, sent_at=finite),
    st.builds(lambda r, c, a, n, e, t: Command(r, c, a, n, e if n else None, t),
              names, names, json_objects, st.none() | names, st.none() | names,
              st.none() | positive),
    st.builds(Reply, request_id=names, status=st.just("ok"), reason=st.none() | names,
              result=json_values),
    st.builds(Reply, request_id=names, status=st.just("error"), reason=names,
              result=json_values, code=st.none() | names),
    st.builds(Subscribe, resume=st.none() | st.dictionaries(
        names, st.builds(ResumePoint, boot=names, seq=seqs), max_size=3),
        batches=st.booleans()),
)


def decodes_or_refuses(data: bytes) -> Message | None:
    """decode()'s only two outcomes: a message, or a ProtocolError that says something."""
    try:
        return decode(data)
    except ProtocolError as exc:
        assert str(exc)
        return None


@FAST
@given(st.binary(max_size=512))
def test_arbitrary_bytes_never_raise_anything_else(data: bytes) -> None:
    decodes_or_refuses(data)


@FAST
@given(json_values)
def test_arbitrary_json_never_raises_anything_else(value: Any) -> None:
    decodes_or_refuses(json.dumps(value).encode())


@FAST
@given(json_objects, st.sampled_from(sorted(protocol.KINDS)))
def test_arbitrary_objects_of_every_kind_never_raise_anything_else(obj: dict[str, Any],
                                                                   kind: str) -> None:
    decodes_or_refuses(json.dumps({**obj, "v": [MAJOR, 0], "kind": kind}).encode())


@FAST
@given(messages)
def test_every_valid_message_round_trips(msg: Message) -> None:
    assert decode(encode(msg)) == msg


@FAST
@given(messages, st.data())
def test_mutated_fields_are_refused_or_still_valid(msg: Message, data: st.DataObject) -> None:
    obj = msg.to_json()
    name = data.draw(st.sampled_from(sorted(obj)), label="field")
    change = data.draw(st.sampled_from(["remove", "retype", "scramble"]), label="change")
    if change == "remove":
        del obj[name]
    elif change == "retype":
        obj[name] = data.draw(json_values.filter(lambda v: type(v) is not type(obj[name])),
                              label="value")
    else:  # the raw text of one field's value, cut short: often no JSON at all
        raw = json.dumps(obj[name])
        obj[name] = raw[: data.draw(st.integers(0, len(raw)), label="cut")]
    decodes_or_refuses(json.dumps(obj).encode())


@FAST
@given(messages, st.data())
def test_truncated_frames_are_refused(msg: Message, data: st.DataObject) -> None:
    frame = encode(msg)
    cut = data.draw(st.integers(0, len(frame) - 1), label="cut")
    assert decodes_or_refuses(frame[:cut]) is None  # a prefix of an object is never one


@FAST
@given(messages, json_objects)
def test_unknown_fields_are_ignored(msg: Message, extra: dict[str, Any]) -> None:
    obj = msg.to_json()
    unknown = {f"x-{k}": v for k, v in extra.items()}
    assert decode(json.dumps({**unknown, **obj}).encode()) == msg


@FAST
@given(messages, st.integers(0, 1 << 40).filter(lambda n: n != MAJOR), st.integers(0, 1 << 40))
def test_an_unknown_major_is_refused_by_its_number(msg: Message, major: int,
                                                   minor: int) -> None:
    obj = {**msg.to_json(), "v": [major, minor]}
    try:
        decode(json.dumps(obj).encode())
    except ProtocolError as exc:
        assert f"unsupported protocol version {major}.{minor}" in str(exc)
    else:
        raise AssertionError(f"major {major} was accepted")


@FAST
@given(messages, st.integers(0, 1 << 40))
def test_any_minor_of_this_major_is_accepted(msg: Message, minor: int) -> None:
    assert decode(json.dumps({**msg.to_json(), "v": [MAJOR, minor]}).encode()) == msg


@FAST
@given(st.lists(events, min_size=1, max_size=4), st.integers(0, 3), json_values)
def test_a_bad_event_in_a_batch_refuses_the_batch_naming_it(batch: list[Event], at: int,
                                                            bad: Any) -> None:
    items: list[Any] = [e.to_json() for e in batch]
    at = min(at, len(items) - 1)
    items[at] = bad if not isinstance(bad, dict) else {**bad, "v": [MAJOR, 1], "kind": "ack"}
    data = json.dumps({"v": [MAJOR, 1], "kind": "events", "events": items}).encode()
    try:
        decode(data)
    except ProtocolError as exc:
        assert f"events[{at}]" in str(exc)
    else:
        raise AssertionError("a batch with a bad event was accepted")


@FAST
@given(events, st.one_of(json_values, st.lists(st.one_of(
    st.integers(-1, 3), st.booleans(), st.floats(0, 2)), max_size=3)))
def test_an_event_in_a_batch_is_judged_as_it_would_be_alone(event: Event, version: Any) -> None:
    """The batch's quick envelope check agrees with a lone event's full one, error included."""
    inner = {**event.to_json(), "v": version}
    alone: Any
    try:
        alone = decode(json.dumps(inner).encode())
    except ProtocolError as exc:
        alone = f"events[0]: {exc}"
    data = json.dumps({"v": [MAJOR, 1], "kind": "events", "events": [inner]}).encode()
    try:
        batched: Any = decode(data)
    except ProtocolError as exc:
        assert str(exc) == alone
    else:
        assert batched.events == [alone]


def decoded(data: bytes, decoder: Any = decode) -> Any:
    """A decoder's answer: the message (the Events of a PlainEvents, the Run of a PlainRun), or
    the refusal's text."""
    try:
        msg = decoder(data)
    except ProtocolError as exc:
        return str(exc)
    if isinstance(msg, PlainRun):
        return msg.run()
    return Events(msg.events()) if isinstance(msg, protocol.PlainEvents) else msg


@FAST
@given(messages, st.sampled_from(["", " ", "\n\t "]), st.sampled_from([None, ", ", ","]))
def test_the_hub_s_plain_decode_agrees_with_decode(msg: Message, blank: str,
                                                   separator: str | None) -> None:
    """decode_plain (a plain batch or a run taken without an object per event): the same
    message or refusal as decode, with or without blanks around and within the frame."""
    separators = None if separator is None else (separator, ":")
    data = (blank + json.dumps(msg.to_json(), separators=separators) + blank).encode()
    assert decoded(data, decode_plain) == decoded(data) == msg
    plain = decode_plain(data)
    assert isinstance(plain, protocol.PlainEvents) == isinstance(msg, Events)
    assert isinstance(plain, PlainRun) == isinstance(msg, Run)


@FAST
@given(st.lists(events, min_size=1, max_size=3), st.integers(0, 2), st.sampled_from(
    ["v", "kind", "node_id", "boot", "seq", "event", "engine_status"]),
    json_values | st.integers(-1, 2) | st.lists(st.one_of(
        st.integers(-1, 3), st.booleans(), st.floats(0, 2)), max_size=3))
@example([Event("n", "b", 1, {})], 0, "v", [1, 3.0])
@example([Event("n", "b", 1, {})], 0, "v", [True, 3])
@example([Event("n", "b", 1, {})], 0, "seq", 0)
@example([Event("n", "b", 1, {})], 0, "seq", True)
@example([Event("n", "b", 1, {})], 0, "node_id", "")
@example([Event("n", "b", 1, {})], 0, "engine_status", {"id": ""})
def test_a_mutated_event_in_a_batch_is_judged_alike_by_both_decoders(
        batch: list[Event], at: int, name: str, value: Any) -> None:
    """A non-plain batch is judged event by event as a lone event would be (both decoders)."""
    data = json.dumps({**batch[0].to_json(), name: value}).encode()
    alone = decoded(data)
    items = [e.to_json() for e in batch]
    items[min(at, len(items) - 1)][name] = value
    data = json.dumps({"v": [MAJOR, 3], "kind": "events", "events": items}).encode()
    assert decoded(data, decode_plain) == decoded(data)
    if at == 0 and isinstance(alone, str):
        assert decoded(data) == f"events[0]: {alone}"


@FAST
@given(runs, st.sampled_from(["v", "kind", "node_id", "boot", "seq", "events", "statuses",
                              "common", "events[0]", "statuses[0]"]),
       json_values | st.integers(-1, 2) | st.lists(json_objects, max_size=2))
@example(Run("n", "b", 1, [{}]), "common", 5)
@example(Run("n", "b", 1, [{}]), "statuses", [{"id": ""}])
@example(Run("n", "b", 1, [{}]), "seq", (1 << 63) - 1)
@example(Run("n", "b", 1, [{}, {}]), "statuses", [None])
def test_a_mutated_run_is_judged_alike_by_both_decoders(run: Run, name: str, value: Any
                                                        ) -> None:
    """The hub's run (decode_plain: common not merged) is the message decode gives, or the same
    refusal, whatever a node puts in it."""
    obj = run.to_json()
    if name.endswith("[0]"):
        items = obj.get(name[:-3]) or [None]
        obj[name[:-3]] = [value, *items[1:]]
    else:
        obj[name] = value
    data = json.dumps(obj).encode()
    assert decoded(data, decode_plain) == decoded(data)


def test_an_empty_batch_is_refused() -> None:
    for empty in ([], None, {}):
        data = json.dumps({"v": [MAJOR, 1], "kind": "events", "events": empty}).encode()
        try:
            decode(data)
        except ProtocolError as exc:
            assert "'events' must be a non-empty list" in str(exc)
        else:
            raise AssertionError(f"events {empty!r} accepted")


def pack(batch: list[Event], max_events: int, max_bytes: int) -> list[bytes]:
    """The frames a sender makes of `batch` with EventsFrame, as the link and the relay do."""
    packed, out = EventsFrame(max_events, max_bytes), []
    for event in batch:
        frame = encode(event)
        if not packed.fits(frame):
            out.append(packed.take())
        packed.add(frame)
    out.append(packed.take())
    return out


@FAST
@given(st.lists(events, min_size=1, max_size=12), st.integers(1, 5), st.integers(0, 4000))
def test_packed_event_frames_decode_to_the_same_events_in_order_split_by_size(
        batch: list[Event], max_events: int, max_bytes: int) -> None:
    frames = pack(batch, max_events, max_bytes)
    got: list[Event] = []
    for data in frames:
        message = decode(data)
        if isinstance(message, Events):
            assert 2 <= len(message.events) <= max_events and len(data) <= max_bytes
            got += message.events
        else:   # one event alone stays an "event" frame, whatever its size
            assert isinstance(message, Event)
            got.append(message)
    assert got == batch


def test_a_long_run_is_split_under_the_frame_limit() -> None:
    """Events of 100 KB each: about ten to a 1 MiB frame, never over it, none lost."""
    batch = [Event("n1", "b1", seq, {"kind": "x", "detail": "x" * 100_000})
             for seq in range(1, 40)]
    frames = pack(batch, 1000, protocol.MAX_MESSAGE_BYTES)
    assert 4 <= len(frames) <= 5 and all(len(f) <= protocol.MAX_MESSAGE_BYTES for f in frames)
    seqs = [e.seq for f in frames for e in decode(f).events]   # type: ignore[union-attr]
    assert seqs == list(range(1, 40))


# Texts with lone surrogates, as a text decoded from a process's bytes with surrogateescape
# holds them: the encoder writes them as escapes, which orjson (the parser's fast path) refuses.
lone_surrogates = st.sampled_from(["\ud800", "\udbff", "\udc80", "\udcff", "\udfff"])
any_texts = st.lists(st.characters() | lone_surrogates, max_size=12).map("".join)
wide_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 63), (1 << 64) - 1) | finite | any_texts,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(any_texts, inner, max_size=4),
    max_leaves=12)


@FAST
@given(wide_values, st.booleans())
@example("detail: \udcff\udcfe", True)
@example([1, 1.0, -(1 << 63), (1 << 64) - 1, 1e308, 5e-324, -0.0], False)
@example([1, 1.0, -(1 << 63), (1 << 64) - 1, 1e308, 5e-324, -0.0, "é"], True)
def test_the_parser_reads_every_value_the_encoder_writes_as_the_stdlib_does(
        value: Any, finite: bool) -> None:
    """json_frame.parse (orjson, then the stdlib's parser for what orjson refuses) gives what
    json.loads gives for every frame text this package's encoder writes: the same values, of
    the same types (an int stays an int), lone surrogates included; and the encoder's orjson
    path (`finite`) writes ASCII text that reads as the stdlib's text does."""
    data = json_frame.dumps(value, finite)
    assert data.isascii()
    parsed = json_frame.parse(data, protocol.MAX_MESSAGE_BYTES)
    expected = json.loads(json.dumps(value, allow_nan=False))
    assert json.dumps(parsed) == json.dumps(expected) and parsed == expected
