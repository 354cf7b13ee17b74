"""Simulated nodes for the fleet benchmark: real `NodeLink`s over fake engine state, many per
process, each process one `zmq.Poller` loop (the node daemon's loop, without the engines).

A simulated node answers `status`, `pause` (after a simulated in-flight probe, on a share of the
nodes), `resume` and `ping` like the daemon's command table, emits `paused`/`resumed`/`state`
events like it, and (for the baseline) serves the same commands on a TCP control socket: the
daemon's own `ControlServer`, bound to tcp://127.0.0.1 instead of its ipc path.

A worker is driven by its parent through a `multiprocessing` pipe: (verb, args) in, one answer
out per request. Verbs: endpoints, emit, flip, outbox, stats, stop.
"""

from __future__ import annotations

import heapq
import random
import resource
import time
from multiprocessing.connection import Connection
from typing import Any

import zmq

from rollout_watchdog.agent.link import NodeLink
from rollout_watchdog.watchdog.clock import Clock
from rollout_watchdog.watchdog.control import ControlServer
from rollout_watchdog.watchdog.events import Event
from rollout_watchdog.watchdog.replies import CommandError, Deferred

PROBE_IN_FLIGHT_SHARE = 0.25   # nodes with a deep probe in flight when a pause arrives ...
PROBE_REMAINING_S = 0.020      # ... ending within this long (uniform)
PAUSE_WAIT_S = 5.0
EMIT_BATCH = 500               # events made per loop turn at most, so replies are not starved


class SimNode:
    """One node's fake engines, with the command table's behaviour for the commands used."""

    def __init__(self, node_id: str, engines: int, clock: Clock, rng: random.Random,
                 wake: list[float]) -> None:
        self.node_id, self.clock, self.rng, self._wake = node_id, clock, rng, wake
        self.boot = f"{node_id}-{rng.getrandbits(32):08x}"
        self.link: NodeLink | None = None
        self.engines: dict[str, dict[str, Any]] = {f"e{i}": {
            "id": f"e{i}", "state": "healthy", "paused": False, "pid": 10_000 + i,
            "incarnation": 1, "restarts": 0, "url": f"http://10.0.0.1:{30000 + i}",
            "last_failure": None, "since": clock.wall(), "external": False,
            "restart_policy": "immediate", "deferred_waiting": False, "next_launch": None,
            "pause_deadline": None, "gpus": [i], "ports": [], "group": None, "tp_size": 1,
            "kill": None} for i in range(engines)}

    def engine_status(self, engine_id: str) -> dict[str, Any] | None:
        """What a real node sends along with each event (the engine's status object)."""
        engine = self.engines.get(engine_id)
        return dict(engine) if engine is not None else None

    def snapshot(self) -> list[dict[str, Any]]:
        return [dict(e) for e in self.engines.values()]

    def emit(self, engine: str, kind: str, **fields: Any) -> None:
        assert self.link is not None
        e = self.engines[engine]
        self.link.on_event(Event(self.clock.wall(), self.node_id, engine, e["incarnation"],
                                 kind, **fields))

    def set_state(self, engine: str, to: str) -> None:
        e = self.engines[engine]
        was, e["state"], e["since"] = e["state"], to, self.clock.wall()
        self.emit(engine, "state", from_=was, to=to,
                  cause="probe_failed" if to == "suspect" else None)

    def dispatch(self, cmd: str, args: dict[str, Any]) -> dict[str, Any] | Deferred:
        if cmd == "ping":
            return {"node_id": self.node_id}
        if cmd == "status":
            return {"node_id": self.node_id, "boot_id": self.boot, "engines": self.snapshot()}
        ids = self._ids(args)
        if cmd == "resume":
            resumed = [i for i in ids if self.engines[i]["paused"]]
            for i in resumed:
                self.engines[i].update(paused=False, pause_deadline=None)
                self.emit(i, "resumed", detail="deep probes resumed")
            return {"resumed": resumed}
        if cmd != "pause":
            raise CommandError(f"unknown command {cmd!r} (simulated node)")
        deadline = self.clock.wall() + float(args.get("deadline_s", 600))
        for i in ids:
            if not self.engines[i]["paused"]:
                self.emit(i, "paused", detail="deep probes paused")
            self.engines[i].update(paused=True, pause_deadline=deadline)
        result = {"paused": ids, "deadline": deadline}
        if self.rng.random() >= PROBE_IN_FLIGHT_SHARE:
            return result
        probe_done = self.clock.monotonic() + self.rng.uniform(0, PROBE_REMAINING_S)
        heapq.heappush(self._wake, probe_done)

        def late() -> dict[str, Any]:
            raise CommandError("pause recorded, but a probe is still in flight")
        return Deferred(lambda: result if self.clock.monotonic() >= probe_done else None,
                        self.clock.monotonic() + PAUSE_WAIT_S, late)

    def _ids(self, args: dict[str, Any]) -> list[str]:
        if args.get("all") is True or args.get("engine") is None:
            return list(self.engines)
        if args["engine"] not in self.engines:
            raise CommandError(f"no engine {args['engine']!r} on this node")
        return [args["engine"]]


class Worker:
    """Simulated nodes `first`..`first + count - 1` of one process, and its loop."""

    def __init__(self, endpoint: str, first: int, count: int, engines: int, seed: int,
                 control: bool) -> None:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        self.ctx = zmq.Context()
        self.ctx.max_sockets = 8 * count + 64
        self.clock = Clock()
        self.wake: list[float] = []
        rng = random.Random(seed)
        self.nodes = [SimNode(f"sim-{first + i:04d}", engines, self.clock, rng, self.wake)
                      for i in range(count)]
        self.links: list[NodeLink] = []
        self.controls: list[ControlServer] = []
        for node in self.nodes:
            node.link = NodeLink(self.ctx, endpoint=endpoint, node_id=node.node_id,
                                 boot=node.boot, snapshot=node.snapshot,
                                 dispatch=node.dispatch, clock=self.clock,
                                 engine_status=node.engine_status)
            self.links.append(node.link)
            if control:
                self.controls.append(ControlServer(self.ctx, "tcp://127.0.0.1:*",
                                                   node.dispatch, lambda reason: None))
        self.participants: list[Any] = [*self.links, *self.controls]
        self.owner = {s: p for p in self.participants for s in p.pollables()}
        self.emitting: tuple[float, float, float, int] | None = None  # t0, rate, until, done

    def endpoints(self) -> list[tuple[str, str]]:
        return [(n.node_id, c.socket.getsockopt_string(zmq.LAST_ENDPOINT))
                for n, c in zip(self.nodes, self.controls, strict=True)]

    def run(self, pipe: Connection) -> None:
        poller = zmq.Poller()
        for sock in self.owner:
            poller.register(sock, zmq.POLLIN)
        poller.register(pipe.fileno(), zmq.POLLIN)
        running = True
        while running:
            ready = {s for s, _ in poller.poll(int(self._timeout() * 1000))}
            for participant in {self.owner[s] for s in ready if s in self.owner}:
                participant.handle(ready)
            if pipe.fileno() in ready:
                verb, args = pipe.recv()
                running = verb != "stop"
                pipe.send(self._request(verb, args))
            self._emit_due()
            now = self.clock.monotonic()
            while self.wake and self.wake[0] <= now:
                heapq.heappop(self.wake)
            for participant in self.participants:
                participant.tick(now)
                participant.after_save()
        for participant in self.participants:
            participant.close()
        self.ctx.term()

    def _timeout(self) -> float:
        soonest = min((d for p in self.participants if (d := p.next_deadline()) is not None),
                      default=time.monotonic() + 1.0)
        if self.wake:
            soonest = min(soonest, self.wake[0])
        if self.emitting is not None:
            return 0.005
        return min(1.0, max(0.0, soonest - self.clock.monotonic()))

    def _request(self, verb: str, args: Any) -> Any:
        if verb == "endpoints":
            return self.endpoints()
        if verb == "emit":  # (rate per s, seconds): state events round-robin over the engines
            rate, seconds = args
            now = self.clock.monotonic()
            self.emitting = (now, rate, now + seconds, 0)
            return None
        if verb == "flip":  # (node index, engine id, state): one state change, its event's ts
            index, engine, to = args
            self.nodes[index].set_state(engine, to)
            return float(self.clock.wall())
        if verb == "outbox":  # events not acknowledged yet, and whether emitting is done
            return sum(len(link.outbox) for link in self.links), self.emitting is None
        if verb == "stats":
            return {"emitted": sum(link.seq for link in self.links),
                    "dropped": sum(link.dropped for link in self.links),
                    "bad_messages": sum(link.bad_messages for link in self.links)}
        return None

    def _emit_due(self) -> None:
        if self.emitting is None:
            return
        t0, rate, until, done = self.emitting
        now = self.clock.monotonic()
        due = min(int((min(now, until) - t0) * rate) - done, EMIT_BATCH)
        engines = len(self.nodes[0].engines)
        for k in range(done, done + max(0, due)):
            node = self.nodes[k % len(self.nodes)]
            engine = f"e{(k // len(self.nodes)) % engines}"
            node.set_state(engine, "suspect" if node.engines[engine]["state"] == "healthy"
                           else "healthy")
        done += max(0, due)
        self.emitting = None if now >= until and done >= int((until - t0) * rate) else (
            t0, rate, until, done)


def worker_main(pipe: Connection, endpoint: str, first: int, count: int, engines: int,
                seed: int, control: bool) -> None:
    """A worker process: build the nodes, say "ready", serve the loop until "stop"."""
    worker = Worker(endpoint, first, count, engines, seed, control)
    pipe.send("ready")
    worker.run(pipe)
