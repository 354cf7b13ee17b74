"""Commands fanned out to nodes and their replies gathered, driven with plain messages and an
explicit clock (no sockets): one command per node under its own request id, a gathered reply
once every node answered or went unreachable or the deadline passed, naming each node that
failed (docs/protocol.md, "The coordinator's side")."""

from __future__ import annotations

import json
from typing import Any

import pytest

from rollout_watchdog.agent import fanout as fanout_module
from rollout_watchdog.agent.fanout import Fanout, Gathering
from rollout_watchdog.agent.fanout import node_request_id as per_node
from rollout_watchdog.common.protocol import Command, Reply, decode, encode

T0 = 1000.0
CLIENT = b"client"


def gathering(request_id: str, targets: list[str], timeout_s: float | None = None,
              node: str | None = None, engine: str | None = None) -> Gathering:
    cmd = Command(request_id, "restart", {"force": True}, node, engine, timeout_s)
    return Gathering(CLIENT, cmd, targets, T0 + (timeout_s or 5.0))


def test_each_node_gets_its_own_request_id_with_the_engine_in_its_args() -> None:
    fanout = Fanout()
    frames = fanout.start(gathering("r1", ["n1"], timeout_s=2.5, node="n1", engine="e0"))
    assert frames == [("n1", encode(Command(per_node("r1", "n1"), "restart",
                                            {"force": True, "engine": "e0"}, "n1", "e0", 2.5)))]
    decoded = [(node, decode(frame)) for node, frame in fanout.start(gathering("r2", ["n1", "n2"]))]
    sent = [(node, cmd) for node, cmd in decoded if isinstance(cmd, Command)]
    assert [(node, cmd.request_id, cmd.node, cmd.args) for node, cmd in sent] == [
        ("n1", per_node("r2", "n1"), "n1", {"force": True}),
        ("n2", per_node("r2", "n2"), "n2", {"force": True})]
    assert len({cmd.request_id for _, cmd in sent}) == 2


def test_the_gathering_completes_when_every_node_answered() -> None:
    fanout = Fanout()
    fanout.start(gathering("r1", ["n1", "n2"]))
    assert fanout.answered(Reply(per_node("r1", "n2"), "ok", None, {"restarted": ["e0"]}),
                           "n2") is None
    done = fanout.answered(Reply(per_node("r1", "n1"), "ok", None, {"restarted": ["e1"]}), "n1")
    assert done is not None and done.final is not None
    assert done.final == Reply("r1", "ok", None, {
        "nodes": {"n1": {"status": "ok", "reason": None, "result": {"restarted": ["e1"]}},
                  "n2": {"status": "ok", "reason": None, "result": {"restarted": ["e0"]}}},
        "missing": []})
    assert fanout.pending == {} and fanout.next_deadline() is None
    assert fanout.answered(Reply(per_node("r1", "n1"), "ok"), "n1") is None   # a late duplicate


def test_the_gathering_completes_when_the_rest_went_unreachable() -> None:
    fanout = Fanout()
    fanout.start(gathering("r1", ["n1", "n2", "n3"]))
    fanout.answered(Reply(per_node("r1", "n1"), "ok"), "n1")
    assert fanout.node_gone("n2") == []
    assert fanout.node_gone("n1") == []                  # it answered already: not waited for
    (done,) = fanout.node_gone("n3")
    assert done.final is not None and done.final.status == "error"
    assert done.final.result["missing"] == ["n2", "n3"]
    assert done.final.reason == "unreachable before answering: n2, n3"   # not "within 5 s"


def test_a_gathering_with_every_target_gone_settles_at_once() -> None:
    fanout = Fanout()
    g = gathering("r1", ["n1"])
    fanout.start(g)
    assert fanout.settle(g) is False
    g.gone.add("n1")                                     # it went unreachable
    assert fanout.settle(g) is True
    assert g.final is not None and g.final.result == {"nodes": {}, "missing": ["n1"]}
    assert fanout.known("r1") == encode(g.final)


def test_expire_names_the_nodes_that_did_not_answer() -> None:
    fanout = Fanout()
    fanout.start(gathering("r1", ["n1", "n2", "n3"], timeout_s=2.0))
    fanout.start(gathering("r2", ["n1"], timeout_s=9.0))
    fanout.answered(Reply(per_node("r1", "n2"), "ok"), "n2")
    assert fanout.next_deadline() == T0 + 2.0
    assert fanout.expire(T0 + 1.9) == []
    (expired,) = fanout.expire(T0 + 2.0)
    reply = expired.final
    assert reply is not None and reply.request_id == "r1" and reply.status == "error"
    assert reply.result["missing"] == ["n1", "n3"]
    assert "n1, n3" in str(reply.reason) and "2 s" in str(reply.reason)
    assert "n2" not in str(reply.reason)
    assert fanout.answered(Reply(per_node("r1", "n1"), "ok"), "n1") is None        # too late
    assert list(fanout.pending) == ["r2"]


def test_the_reason_tells_the_nodes_that_went_unreachable_from_the_silent_ones() -> None:
    fanout = Fanout()
    fanout.start(gathering("r1", ["n1", "n2", "n3"], timeout_s=2.0))
    fanout.answered(Reply(per_node("r1", "n2"), "error", "no engine e9"), "n2")
    assert fanout.node_gone("n3") == []
    (expired,) = fanout.expire(T0 + 2.0)
    assert expired.final is not None and expired.final.result["missing"] == ["n1", "n3"]
    assert expired.final.reason == ("n2: no engine e9; no answer within 2 s from n1; "
                                    "unreachable before answering: n3")


def test_a_node_gets_its_unanswered_commands_again_when_it_says_hello() -> None:
    """A command sent while a node's daemon restarted (its connection gone, or not back yet),
    or lost with a dropped connection, reaches the node on its next HELLO; one it answered, or
    whose gathering stopped waiting for it, does not."""
    fanout = Fanout()
    first, second = gathering("r1", ["n1", "n2"], timeout_s=2.0), gathering("r2", ["n1"], 9.0)
    assert dict(fanout.start(first)) == first.commands
    fanout.start(second)
    assert fanout.unanswered("n1") == [first, second]
    assert fanout.unanswered("n3") == []
    fanout.answered(Reply(per_node("r2", "n1"), "ok"), "n1")
    assert fanout.unanswered("n1") == [first]
    assert fanout.node_gone("n2") == []
    assert fanout.unanswered("n2") == []
    fanout.expire(T0 + 2.0)
    assert fanout.unanswered("n1") == [] and first.commands == {}   # its frames let go


def test_commands_not_sent_yet_are_listed_until_answered_or_given_up() -> None:
    fanout = Fanout()
    g = gathering("r1", ["n1", "n2", "n3"])
    fanout.start(g)
    g.unsent |= {"n1", "n2", "n3"}
    fanout.answered(Reply(per_node("r1", "n1"), "ok"), "n1")
    fanout.node_gone("n2")
    assert fanout.unsent() == [("n3", g)]
    fanout.answered(Reply(per_node("r1", "n3"), "ok"), "n3")
    assert fanout.unsent() == [] and g.unsent == set()


def test_error_replies_are_named_in_the_reason() -> None:
    fanout = Fanout()
    fanout.start(gathering("r1", ["n1", "n2", "n3"]))
    fanout.answered(Reply(per_node("r1", "n1"), "error", "no engine e9"), "n1")
    fanout.answered(Reply(per_node("r1", "n2"), "ok"), "n2")
    done = fanout.answered(Reply(per_node("r1", "n3"), "error", "engine e0 is external"), "n3")
    assert done is not None and done.final is not None
    assert done.final.status == "error"
    assert done.final.reason == "n1: no engine e9; n3: engine e0 is external"
    assert done.final.result["nodes"]["n2"]["status"] == "ok"
    assert done.final.result["missing"] == []


@pytest.mark.parametrize("result", [
    {"big": (1 << 64) - 1, "least": -(1 << 63), "t": 1e16, "small": 5e-324, "neg": -0.0},
    {"detail": "caf\u00e9 \u00fc"},    # beyond ASCII
    {"detail": "bytes \udcff"},         # a lone surrogate: a node's undecodable bytes
])
def test_a_gathered_reply_carries_every_answer_as_the_nodes_gave_it(
        result: dict[str, Any]) -> None:
    """The gathered reply is written by the fast encoder (its numbers come from parsed frames);
    64-bit integers, floats, text beyond ASCII and lone surrogates still come out as the
    stdlib's encoder writes them: ASCII, the same values."""
    fanout = Fanout()
    fanout.start(gathering("r1", ["n1", "n2"]))
    fanout.answered(Reply(per_node("r1", "n1"), "ok", None, result), "n1")
    done = fanout.answered(Reply(per_node("r1", "n2"), "error", "busy", {"n": 1}, "busy"), "n2")
    assert done is not None and done.final is not None
    assert done.frame.isascii()
    assert decode(done.frame) == done.final
    assert json.loads(done.frame)["result"]["nodes"]["n1"]["result"] == result


def test_a_repeated_request_id_gets_the_same_reply() -> None:
    fanout = Fanout()
    g = gathering("r1", ["n1"])
    fanout.start(g)
    assert fanout.known("r1") is g                              # in flight: the same gathering
    assert fanout.known("r2") is None
    fanout.answered(Reply(per_node("r1", "n1"), "ok", None, 7), "n1")
    assert g.final is not None and fanout.known("r1") == encode(g.final)
    assert g.final.result == {"nodes": {"n1": {"status": "ok", "reason": None, "result": 7}},
                              "missing": []}
    local = Reply("s1", "ok", None, {"nodes": []})              # the coordinator's own answer
    fanout.remember(local)
    assert fanout.known("s1") == encode(local)


def test_remembered_replies_are_bounded_oldest_forgotten_first(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fanout_module, "REPLIES_KEPT", 3)
    fanout = Fanout()
    for i in range(5):
        fanout.remember(Reply(f"r{i}", "ok"))
    assert [r for r in ("r0", "r1", "r2", "r3", "r4") if fanout.known(r)] == ["r2", "r3", "r4"]
    assert len(fanout.done) == 3


def test_a_node_never_sees_the_clients_request_id() -> None:
    """A node that learnt a client's request id from its per-node command could send it again,
    as a client, and be answered in the client's place (a refit's fencing token: the hostile
    run). The per-node id is a digest: stable across sends and restarts, the client's hidden."""
    assert per_node("r1", "n1") == per_node("r1", "n1") != per_node("r2", "n1")
    assert "r1" not in per_node("r1", "n1").rsplit("/", 1)[0] and per_node("r1", "n1").endswith(
        "/n1")


def test_per_node_request_ids_never_collide() -> None:
    """'a/b' to node 'c' and 'a' to node 'b/c' (config forbids '/' in node ids anyway): the
    replying node tells them apart."""
    fanout = Fanout()
    first = gathering("a/b", ["c"])
    second = gathering("a", ["b/c"])
    fanout.start(first)
    fanout.start(second)
    done = fanout.answered(Reply(per_node("a/b", "c"), "ok", None, "from c"), "c")
    assert done is first
    assert first.final is not None and first.final.result["nodes"] == {
        "c": {"status": "ok", "reason": None, "result": "from c"}}
    assert second.final is None


def test_a_reply_from_anyone_but_the_target_node_is_no_answer() -> None:
    fanout = Fanout()
    fanout.start(gathering("r1", ["n1"]))
    assert fanout.answered(Reply(per_node("r1", "n1"), "ok"), "n2") is None
    assert fanout.answered(Reply(per_node("r1", "n1"), "ok"), "\x00client") is None
    assert "r1" in fanout.pending
    assert fanout.answered(Reply(per_node("r1", "n1"), "ok"), "n1") is not None


def test_remembered_replies_are_bounded_in_bytes_too(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fanout_module, "REPLIES_BYTES", 10_000)
    fanout = Fanout()
    for i in range(10):
        fanout.remember(Reply(f"r{i}", "ok", None, "x" * 3_000))
    assert fanout.done.size <= 10_000
    assert fanout.known("r9") is not None and fanout.known("r0") is None


def test_a_reply_too_big_for_one_message_keeps_its_errors_and_counts() -> None:
    answers = {f"n{i:05d}": {"status": "ok", "reason": None, "result": {"paused": ["e" * 50]}}
               for i in range(20_000)}
    answers["n99999"] = {"status": "error", "reason": "no engine e9", "result": None}
    reply = Reply("r1", "error", "n99999: no engine e9", {"nodes": answers, "missing": ["nX"]})
    frame = fanout_module.encode_reply(reply)
    result = decode(frame).result
    assert result["ok"] == 20_000 and result["missing"] == ["nX"]
    assert result["nodes"] == {"n99999": {"status": "error", "reason": "no engine e9",
                                          "result": None}}


def test_a_finisher_that_answers_by_itself_leaves_nothing_to_send_or_repeat() -> None:
    """A refit's lock reply goes out once its listing is on disk: its finisher answers by
    itself (None), so the gathering has no frame to send and keeps none for a repeat, whose
    request id then reaches the command again (which knows it is waiting)."""
    fanout, finished = Fanout(), []
    cmd = Command("r1", "pause", {"all": True})
    g = Gathering(CLIENT, cmd, ["n1"], T0 + 5, finish=lambda done: finished.append(done))
    fanout.start(g)
    done = fanout.answered(Reply(per_node("r1", "n1"), "ok"), "n1")
    assert done is g and finished == [g] and (g.finished, g.final, g.frame) == (True, None, b"")
    assert fanout.known("r1") is None
    assert fanout.settle(g) is False and finished == [g]   # finished once, not again
    none = Gathering(CLIENT, Command("r2", "pause", {"all": True}), [], T0 + 5,
                     finish=lambda done: finished.append(done))
    fanout.start(none)
    assert fanout.settle(none) is False and finished == [g, none]   # no node at all: at once
    assert fanout.settle(none) is False and finished == [g, none]


def test_a_command_sent_again_asks_the_node_to_wait_only_for_what_is_left() -> None:
    """A pause (or remove) asks the node to wait `wait_s` and answer within the gathering's
    deadline; sent again later (a HELLO, a heartbeat), it asks for that much less, so the
    answer still comes in time and says what the node waited for."""
    fanout = Fanout()
    g = Gathering(CLIENT, Command("r1", "pause", {"wait_s": 10.0, "all": True}, None, None,
                                  12.0), ["n1"], T0 + 12.0)
    fanout.start(g)
    assert fanout.again(g, "n1", T0) == g.commands["n1"]
    later = decode(fanout.again(g, "n1", T0 + 4.0))
    assert isinstance(later, Command) and later.node == "n1"
    assert later.request_id == per_node("r1", "n1")
    assert later.args == {"wait_s": 6.0, "all": True} and later.timeout_s == 12.0
    too_late = decode(fanout.again(g, "n1", T0 + 11.0))
    assert isinstance(too_late, Command) and too_late.args["wait_s"] == 0.0
    plain = gathering("r2", ["n1"])                # nothing to wait for: the same frame
    fanout.start(plain)
    assert fanout.again(plain, "n1", T0 + 3.0) == plain.commands["n1"]
