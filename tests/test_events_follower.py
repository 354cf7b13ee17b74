"""`rollout-watchdog events` following the local daemon through its faults: a SIGKILLed daemon is
noticed through its connection closing (not after a silence), a SIGSTOPped one through the
silence; either way the follower resumes and prints every event once."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import zmq
from daemon_harness import EngineSpec, Node, wait_for

from rollout_watchdog.cli.client import ControlClient, DaemonGone, peer_gone
from rollout_watchdog.watchdog.control import bind_control

MakeNode = Callable[..., Node]
GONE = "closed the connection"          # what the follower says when it saw the disconnect
SILENT = "no answer from the daemon"    # ... and when only the silence told


class Follower:
    """`rollout-watchdog events --json` on the node's control socket, its output in files."""

    def __init__(self, node: Node, *options: str) -> None:
        self.out, self.err = node.tmp / "follower.out", node.tmp / "follower.err"
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "rollout_watchdog", "events", "--json", "--control",
                 node.control, *options], stdout=out, stderr=err)

    def printed(self) -> list[str]:
        return self.out.read_text().splitlines()

    def events(self) -> list[dict]:
        return [json.loads(line) for line in self.printed()]

    def said(self) -> str:
        return self.err.read_text()

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=10)


@contextmanager
def follow(node: Node, *options: str) -> Iterator[Follower]:
    follower = Follower(node, *options)
    try:
        yield follower
    finally:
        follower.close()


def wait_printed(follower: Follower, expected: Callable[[], list[dict]], what: str,
                 timeout: float = 30.0) -> list[dict]:
    """Until the follower has printed exactly `expected()` (a doubled event never matches)."""
    return wait_for(lambda: (e := expected()) == follower.events() and e, timeout, what)


def test_a_sigkilled_daemon_is_noticed_by_its_disconnect(make_node: MakeNode) -> None:
    """The silence bound is 65 s here (--timeout 60 + --poll 5): only the disconnect can bring
    the follower to the new daemon within the deadlines below."""
    node = make_node([EngineSpec("e0")]).start()
    node.wait_state("e0", "healthy")
    with follow(node, "--timeout", "60") as follower:
        old = wait_printed(follower, node.events, "the follower to print the first boot")
        node.kill_daemon()
        wait_for(lambda: GONE in follower.said(), 30, "the follower to notice the death")
        node.start()
        node.wait_event("e0", kind="adopted")
        wait_printed(follower, lambda: old + node.events(),
                     "the follower to print the new daemon's events after the old ones")
        node.client.call("pause", {"engine": "e0", "deadline_s": 60})
        wait_printed(follower, lambda: old + node.events(), "the pause, once")
        assert SILENT not in follower.said()
        printed = follower.printed()
        assert len(set(printed)) == len(printed)
        assert {"ts", "node_id", "engine", "incarnation", "kind", "from", "to", "cause",
                "detail"} == set(follower.events()[0])


def test_a_sigstopped_daemon_is_noticed_by_its_silence(make_node: MakeNode) -> None:
    """A stopped daemon keeps its socket open: only the silence (here --timeout 1 + --poll 1)
    tells; once it runs again, the follower goes on from where it was, nothing doubled."""
    node = make_node([EngineSpec("e0")]).start()
    node.wait_state("e0", "healthy")
    assert node.proc is not None
    with follow(node, "--timeout", "1", "--poll", "1", "--retry", "0.2") as follower:
        wait_printed(follower, node.events, "the follower to print the first events")
        node.proc.send_signal(signal.SIGSTOP)
        try:
            wait_for(lambda: SILENT in follower.said(), 30, "the follower to notice the silence")
        finally:
            node.proc.send_signal(signal.SIGCONT)
        assert GONE not in follower.said()
        node.client.call("pause", {"engine": "e0", "deadline_s": 60}, timeout_s=20)
        events = wait_printed(follower, node.events, "the pause, once, after the first events")
        assert "paused" in [e["kind"] for e in events]


# ---------------------------------------------------------------------- the client alone

def _one_request_then(tmp_path: Path, answer: bool) -> tuple[ControlClient, threading.Thread]:
    """A control ROUTER in a thread that takes one request, answers it or not, and closes."""
    endpoint = f"ipc://{tmp_path}/control"
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    bind_control(sock, endpoint)

    def serve() -> None:
        try:
            if sock.poll(30_000):
                identity, _request = sock.recv_multipart()
                if answer:
                    sock.send_multipart([identity, b'{"v": 1, "status": "ok", "result": 7}'])
        finally:
            sock.close(linger=1000 if answer else 0)

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    return ControlClient(endpoint, timeout_s=60.0), server


def test_a_call_ends_at_once_when_the_daemon_closes(tmp_path: Path) -> None:
    client, server = _one_request_then(tmp_path, answer=False)
    with pytest.raises(DaemonGone, match=GONE):
        client.call("ping")  # silence would end it only after 60 s, as a plain ControlError
    server.join(timeout=10)


def test_an_answer_sent_just_before_the_close_is_the_answer(tmp_path: Path) -> None:
    client, server = _one_request_then(tmp_path, answer=True)
    assert client.call("ping") == 7
    server.join(timeout=10)


def test_a_failed_connect_means_gone_only_when_nobody_listens(tmp_path: Path) -> None:
    """A connect can also fail on a full listen backlog: the daemon is there, just busy."""
    endpoint = f"ipc://{tmp_path}/control"
    path = endpoint[len("ipc://"):]
    assert peer_gone(zmq.EVENT_DISCONNECTED, path)
    assert peer_gone(zmq.EVENT_CLOSED, path)  # no socket file
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    try:
        bind_control(sock, endpoint)
        assert not peer_gone(zmq.EVENT_CLOSED, path)
    finally:
        sock.close(linger=0)
    assert peer_gone(zmq.EVENT_CLOSED, None)  # tcp: a refused connect
