"""Commands fanned out to nodes and their replies gathered under a deadline (pure logic).

A client's command becomes one command per target node, whose request id is a digest of the
client's with the node appended, so a node that hears it twice (a retry, a coordinator
restart) runs it once (agent/link.py). The gathered reply is complete when every target
answered or went unreachable, or when the deadline passes; then it names each node that
answered an error or nothing. Until then a node's command is sent again on each of its HELLOs:
one sent while its daemon restarted (to a connection already gone, or none yet) reaches the
daemon that comes back. One that could not be sent (no connection yet, or the node's queue
full) is tried again at each heartbeat too.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rollout_watchdog.common import frames, protocol
from rollout_watchdog.common.replies import REPLIES_KEPT, RecentReplies

DEFAULT_TIMEOUT_S = 5.0
REPLIES_BYTES = 16 << 20        # a fleet-wide reply holds one answer per node
REASON_CHARS = 200              # per node, in a reply trimmed to fit one message
REASONS_CHARS = 20_000          # the joined reason of such a reply


def node_request_id(request_id: str, node_id: str) -> str:
    """The request id of a client's command as sent to one node: a digest of the client's,
    the same at every send (a node runs each once, across coordinator restarts too), from
    which no node can tell the client's own (a node that sent that again, as a client, would
    be answered in the client's place: a refit's fencing token)."""
    digest = hashlib.blake2b(request_id.encode(), digest_size=16).hexdigest()
    return f"{digest}/{node_id}"


def _waits(cmd: protocol.Command) -> bool:
    wait = cmd.args.get("wait_s")
    return isinstance(wait, (int, float)) and not isinstance(wait, bool)


def shortened(cmd: protocol.Command, by: float, *, timeout: bool = False) -> protocol.Command:
    """`cmd` asking `by` seconds less of the node's wait (`wait_s`) and, with `timeout`, of
    its gathering (`timeout_s`): what is left of them after a delay (never below zero, nor
    below a tenth of a second for the gathering)."""
    args = {**cmd.args, "wait_s": max(0.0, cmd.args["wait_s"] - by)} if _waits(cmd) else cmd.args
    timeout_s = cmd.timeout_s
    if timeout:
        timeout_s = max(0.1, (timeout_s or DEFAULT_TIMEOUT_S) - by)
    return protocol.Command(cmd.request_id, cmd.cmd, args, cmd.node, cmd.engine, timeout_s)


@dataclass
class Gathering:
    """One client command in flight."""

    client: bytes | None              # None: the coordinator's own (a group restart)
    command: protocol.Command
    targets: list[str]
    deadline: float                   # monotonic
    answers: dict[str, dict[str, Any]] = field(default_factory=dict)
    gone: set[str] = field(default_factory=set)
    finished: bool = False                # complete or expired: its final reply made ...
    final: protocol.Reply | None = None   # ... (None: its finisher answers by itself) ...
    frame: bytes = b""                    # ... and encoded, once
    commands: dict[str, bytes] = field(default_factory=dict)   # node -> its command, encoded
    unsent: set[str] = field(default_factory=set)   # nodes it could not be sent to yet
    # Makes the final reply out of the gathered one (a refit's lock reply after its pause);
    # None: the finisher answers by itself, later (nothing is sent or kept for repeats here).
    finish: Callable[[Gathering], protocol.Reply | None] | None = None

    def complete(self) -> bool:
        """O(gone), not O(answers): asked at each of a fleet-wide command's 1,000 answers."""
        gone = sum(1 for node in self.gone if node not in self.answers)
        return len(self.answers) + gone >= len(self.targets)

    def reply(self) -> protocol.Reply:
        missing = [n for n in self.targets if n not in self.answers]
        failed = [n for n in self.targets if self.answers.get(n, {}).get("status") == "error"]
        problems = [f"{n}: {self.answers[n].get('reason')}" for n in failed]
        late = [n for n in missing if n not in self.gone]
        if late:
            timeout = self.command.timeout_s or DEFAULT_TIMEOUT_S
            problems.append(f"no answer within {timeout:g} s from {', '.join(late)}")
        if len(late) < len(missing):
            problems.append("unreachable before answering: "
                            + ", ".join(n for n in missing if n in self.gone))
        result = {"nodes": self.answers, "missing": missing}
        if problems:
            return protocol.Reply(self.command.request_id, "error", "; ".join(problems), result,
                                  protocol.NODE_ERRORS)
        return protocol.Reply(self.command.request_id, "ok", None, result)


class Fanout:
    def __init__(self) -> None:
        self.pending: dict[str, Gathering] = {}
        # (per-node request id, node) -> the client's request id
        self.by_node_request: dict[tuple[str, str], str] = {}
        self.done: RecentReplies[bytes] = RecentReplies(REPLIES_KEPT, REPLIES_BYTES, len)

    def start(self, gathering: Gathering) -> list[tuple[str, bytes]]:
        """Register a command; the per-node commands to send, encoded (ProtocolError if they
        cannot be)."""
        cmd = gathering.command
        args = dict(cmd.args)
        if cmd.engine is not None:
            args["engine"] = cmd.engine
        targets = [(node_request_id(cmd.request_id, node), node) for node in gathering.targets]
        template = protocol.Command(cmd.request_id, cmd.cmd, args, cmd.node, cmd.engine,
                                    cmd.timeout_s)
        per_node = frames.command_frames(template, targets)
        self.pending[cmd.request_id] = gathering
        for rid, node in targets:
            self.by_node_request[rid, node] = cmd.request_id
        sends = [(node, frame) for (_, node), frame in zip(targets, per_node, strict=True)]
        gathering.commands = dict(sends)
        return sends

    def unanswered(self, node: str) -> list[Gathering]:
        """The gatherings whose command `node` has not answered (nor gone unreachable since):
        to send again when it says HELLO."""
        return [g for g in self.pending.values()
                if node in g.commands and node not in g.answers and node not in g.gone]

    @staticmethod
    def again(gathering: Gathering, node: str, now: float) -> bytes:
        """`node`'s command of `gathering` to send again at `now`: a wait it asks of the node
        (`wait_s`: a pause's for its probes, a remove's for its engine) shortened by the time
        gone since the first send, so that the node's answer still comes within the deadline
        (and says what it is waiting for, rather than being missing)."""
        frame = gathering.commands[node]
        timeout = gathering.command.timeout_s or DEFAULT_TIMEOUT_S
        gone_by = now - (gathering.deadline - timeout)
        if not _waits(gathering.command) or gone_by <= 0:
            return frame
        sent = protocol.decode(frame)
        assert isinstance(sent, protocol.Command)
        return protocol.encode(shortened(sent, gone_by))

    def unsent(self) -> list[tuple[str, Gathering]]:
        """(node, gathering) for each command still waiting to be sent (no connection to its
        node, or its queue full), its node neither answered nor unreachable."""
        return [(node, g) for g in self.pending.values() for node in g.unsent
                if node not in g.answers and node not in g.gone]

    def answered(self, reply: protocol.Reply, node: str) -> Gathering | None:
        """A reply from `node` (its sender); the gathering it completes, if any. A reply from
        anyone but the node the command went to is no answer."""
        request_id = self.by_node_request.get((reply.request_id, node))
        if request_id is None:
            return None
        gathering = self.pending.get(request_id)
        if gathering is None:
            return None
        gathering.answers[node] = {"status": reply.status, "reason": reply.reason,
                                   "result": reply.result}
        if reply.code is not None:   # (1.2: a node's error says what it is)
            gathering.answers[node]["code"] = reply.code
        return self._finish(gathering) if gathering.complete() else None

    def node_gone(self, node: str) -> list[Gathering]:
        """A node became unreachable: the gatherings that no longer wait for it."""
        out = []
        for gathering in list(self.pending.values()):
            if node in gathering.targets and node not in gathering.answers:
                gathering.gone.add(node)
                if gathering.complete():
                    out.append(self._finish(gathering))
        return out

    def settle(self, gathering: Gathering) -> bool:
        """Finish a gathering that is complete already (every target gone, or none at all);
        whether it has a final reply to send."""
        if gathering.complete() and not gathering.finished:
            self._finish(gathering)
        return gathering.final is not None

    def expire(self, now: float) -> list[Gathering]:
        return [self._finish(g) for g in list(self.pending.values()) if now >= g.deadline]

    def next_deadline(self) -> float | None:
        return min((g.deadline for g in self.pending.values()), default=None)

    def known(self, request_id: str) -> bytes | Gathering | None:
        """A repeated request id: its (encoded) reply if done, its gathering if in flight."""
        return self.done.get(request_id) or self.pending.get(request_id)

    def _finish(self, gathering: Gathering) -> Gathering:
        request_id = gathering.command.request_id
        self.pending.pop(request_id, None)
        for node in gathering.targets:
            self.by_node_request.pop((node_request_id(request_id, node), node), None)
        gathering.finished = True
        gathering.commands, gathering.unsent = {}, set()   # (a fleet-wide one: 1,000 frames)
        gathering.final = (gathering.finish(gathering) if gathering.finish is not None
                           else gathering.reply())
        if gathering.final is not None:   # (a plain gathered reply is made of parsed answers)
            gathering.frame = self.remember(gathering.final, finite=gathering.finish is None)
        return gathering

    def remember(self, reply: protocol.Reply, finite: bool = False) -> bytes:
        """Keep a reply for repeats of its request id (the newest ones, bounded in number and
        in bytes); its frame. `finite`: as protocol.encode's."""
        frame = encode_reply(reply, finite)
        self.done.put(reply.request_id, frame)
        return frame


def encode_reply(reply: protocol.Reply, finite: bool = False) -> bytes:
    """The reply's frame; a reply too big for one message is never sent cut down as if whole:
    it becomes an error, code TOO_BIG, that names the limit. A fan-out's answers can outgrow
    one message on a big fleet: that error keeps the nodes that answered an error (reasons
    cut), those that did not answer and the count of the others, whose results are left out
    (`results_left_out`), after the reason it had. Any other result is left out whole.
    `finite`: as protocol.encode's."""
    try:
        return protocol.encode(reply, finite)
    except protocol.ProtocolError as exc:
        limit = f"{exc} (the message limit)"
    result = reply.result if isinstance(reply.result, dict) else {}
    nodes = result.get("nodes")
    if not isinstance(nodes, dict):   # not a fan-out: nothing of it can be kept
        return protocol.encode(protocol.Reply(
            reply.request_id, "error", f"the answer cannot be sent: {limit}"[:REASONS_CHARS],
            None, protocol.TOO_BIG))
    answers: dict[str, Any] = nodes
    slim = {n: {"status": a.get("status"), "reason": str(a.get("reason"))[:REASON_CHARS],
                "result": None}
            for n, a in answers.items() if a.get("status") != "ok"}
    reason = (f"the answers of {len(answers)} node(s) do not fit in one message: {limit}; "
              f"the results of the {len(answers) - len(slim)} that answered ok are left out"
              + ("" if reply.reason is None else f"; {reply.reason}"))[:REASONS_CHARS]
    trimmed = {"nodes": slim, "missing": result.get("missing", []),
               "ok": len(answers) - len(slim), "results_left_out": True}
    try:
        return protocol.encode(protocol.Reply(reply.request_id, "error", reason, trimmed,
                                              protocol.TOO_BIG))
    except protocol.ProtocolError:  # thousands of failing nodes: their count, not names
        return protocol.encode(protocol.Reply(
            reply.request_id, "error", reason,
            {"nodes": {}, "missing": [], "ok": len(answers) - len(slim),
             "failed": len(slim), "missing_count": len(result.get("missing", [])),
             "results_left_out": True}, protocol.TOO_BIG))
