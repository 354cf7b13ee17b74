"""Fake nodes that speak the protocol: real `NodeLink`s (the node daemon's own link) over fake
engine state, all in one thread of the test process, one loop as the daemon's (handle what is
ready, tick, send). They say HELLO with their engines, heartbeat, and answer `pause` and
`resume` as the command table does, so a real coordinator can take the refit lock over
thousands of engines without an engine process. Names and URLs can be made long: what lowers
the number of members one message holds."""

from __future__ import annotations

import threading
import time
from typing import Any

import zmq

from rollout_watchdog.agent.link import NodeLink
from rollout_watchdog.common.clock import Clock
from rollout_watchdog.common.replies import CommandError, Deferred

POLL_MS = 50


class FakeNode:
    def __init__(self, node_id: str, engines: int, host: str, first_port: int) -> None:
        self.node_id = node_id
        self.engines = {f"e{i}": {   # (each engine a URL of its own, as on real hosts)
            "id": f"e{i}", "state": "healthy", "paused": False, "pid": 10_000 + i,
            "incarnation": 1, "restarts": 0, "url": f"http://{host}:{first_port + i}",
            "last_failure": None, "since": time.time(), "group": None, "tp_size": 1,
            "process": f"{node_id}-boot:{10_000 + i}:1"} for i in range(engines)}
        self.commands: list[str] = []

    def snapshot(self) -> list[dict[str, Any]]:
        return [dict(e) for e in self.engines.values()]

    def dispatch(self, cmd: str, args: dict[str, Any]) -> dict[str, Any] | Deferred:
        self.commands.append(cmd)
        if cmd in ("pause", "resume"):
            paused = cmd == "pause"
            for engine in self.engines.values():
                engine["paused"] = paused
            return {"paused" if paused else "resumed": list(self.engines)}
        if cmd == "restart":
            return {"action": "none (fake node)"}
        raise CommandError(f"unknown command {cmd!r} (fake node)")


class FakeNodes:
    """`count` fake nodes of `engines` engines each, linked to `endpoint`, served by one
    thread until `close()`."""

    def __init__(self, endpoint: str, count: int, engines: int, *, prefix: str = "node",
                 host: str = "127.0.0.1") -> None:
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.ctx.max_sockets = 4 * count + 64
        clock = Clock()
        assert count * engines <= 40_000, "more engines than ports on one host"
        self.nodes = [FakeNode(f"{prefix}-{i:04d}", engines, host, 20_000 + i * engines)
                      for i in range(count)]
        self.links = [NodeLink(self.ctx, endpoint=endpoint, node_id=n.node_id,
                               boot=f"{n.node_id}-boot", snapshot=n.snapshot,
                               dispatch=n.dispatch, clock=clock) for n in self.nodes]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="fake-nodes")
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        for link in self.links:
            for sock in link.pollables():
                poller.register(sock, zmq.POLLIN)
        while not self._stop.is_set():
            ready = {sock for sock, _ in poller.poll(POLL_MS)}
            now = time.monotonic()
            for link in self.links:
                if ready.intersection(link.pollables()):
                    link.handle(ready)
                link.tick(now)
                link.after_save()
        for link in self.links:
            link.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self.ctx.term()

    def __enter__(self) -> FakeNodes:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
