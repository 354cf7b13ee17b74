"""Simulated nodes for the fleet benchmark: real `NodeLink`s over fake engine state, many per
process, each process one loop (the node daemon's loop, without the engines).

A simulated node answers `status`, `pause` (after a simulated in-flight probe, on a share of the
nodes), `resume` and `ping` like the daemon's command table, emits `paused`/`resumed`/`state`
events like it, and (for the baseline) serves the same commands on a TCP control socket: the
daemon's own `ControlServer`, bound to tcp://127.0.0.1 instead of its ipc path.

The loop is cheap, so that the benchmark measures the coordinator and not the simulation: a
process holds a few hundred nodes, each with two loop participants (its link and its control
server) of two sockets each. The daemon polls its few sockets with a `zmq.Poller` and ticks
every participant each turn; done so here, every turn would cost O(all sockets) (zmq_poll over
~1,000 sockets is ~0.4 ms) and O(all participants). Instead:
- one epoll over the sockets' ZMQ_FDs says which may have changed; a socket counts as readable
  when its ZMQ_EVENTS says POLLIN (the way pyzmq's own event-loop integration works). That fd
  is edge-like: an operation on the socket can take in a message without signalling it again,
  so after each turn the sockets of every participant that ran are asked for POLLIN again, and
  those with messages left are handled next turn without waiting;
- a heap of deadlines, one live entry per participant (its `next_deadline()` after it ran;
  entries it moved are skipped as stale), plus wake-ups for the simulated probes that a parked
  pause reply waits on;
- a turn runs only the participants with work: a readable socket, a due deadline or wake-up,
  or an event or command made for their node. Those get the daemon's turn, in its order:
  `handle(ready)`, then `tick(now)`, then `after_save()` (which sends what the turn made).
`NodeLink` and `ControlServer` are used unchanged; ticking one that is not due is harmless, as
the daemon does it every turn.

A worker is driven by its parent through a `multiprocessing` pipe: (verb, args) in, one answer
out per request. Verbs: endpoints, emit, flip, outbox, stats, stop.
"""

from __future__ import annotations

import heapq
import random
import resource
import select
from collections.abc import Callable
from functools import partial
from multiprocessing.connection import Connection
from typing import Any, Protocol

import zmq

from rollout_watchdog.agent.link import NodeLink
from rollout_watchdog.common.clock import Clock
from rollout_watchdog.common.events import Event
from rollout_watchdog.common.gc_tuning import tune_for_service
from rollout_watchdog.common.replies import CommandError, Deferred
from rollout_watchdog.watchdog.control import ControlServer

PROBE_IN_FLIGHT_SHARE = 0.25   # nodes with a deep probe in flight when a pause arrives ...
PROBE_REMAINING_S = 0.020      # ... ending within this long (uniform)
PAUSE_WAIT_S = 5.0
EMIT_BATCH = 500               # events made per loop turn at most, so replies are not starved
MAX_SLEEP_S = 1.0              # the daemon's longest wait too
# Plain ints: pyzmq's flag enums cost ~0.6 us per test, and this loop tests every socket it ran.
ZMQ_EVENTS, ZMQ_POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)


class Participant(Protocol):
    """A loop participant of the node daemon (`NodeLink`, `ControlServer`)."""

    def pollables(self) -> list[Any]: ...
    def handle(self, ready: Any) -> None: ...
    def tick(self, now: float) -> None: ...
    def next_deadline(self) -> float | None: ...
    def after_save(self) -> None: ...
    def close(self) -> None: ...


class SimNode:
    """One node's fake engines, with the command table's behaviour for the commands used.
    `touch()` says that its link has something to send this turn; `wake(t)` that a parked
    reply's condition turns true at monotonic time t."""

    def __init__(self, node_id: str, engines: int, clock: Clock, rng: random.Random,
                 touch: Callable[[], None], wake: Callable[[float], None]) -> None:
        self.node_id, self.clock, self.rng = node_id, clock, rng
        self._touch, self._wake = touch, wake
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
        self._touch()

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
        for i in ids:   # as the daemon does: the status changes, then the event goes with it
            fresh = not self.engines[i]["paused"]
            self.engines[i].update(paused=True, pause_deadline=deadline)
            if fresh:
                self.emit(i, "paused", detail="deep probes paused", extra={"deadline": deadline})
        result = {"paused": ids, "deadline": deadline}
        if self.rng.random() >= PROBE_IN_FLIGHT_SHARE:
            return result
        probe_done = self.clock.monotonic() + self.rng.uniform(0, PROBE_REMAINING_S)
        self._wake(probe_done)

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


class Emission:
    """The throughput phase's offered load in one process: `bursts` bursts of `burst` state
    events, burst k on node k mod nodes (its engines in turn), due at t0 + k * burst / rate.
    A burst is what one node's loop turn gathered, so it leaves as one frame."""

    def __init__(self, t0: float, rate: float, seconds: float, burst: int) -> None:
        self.t0, self.period, self.burst = t0, burst / rate, burst
        self.bursts = int(seconds * rate / burst)
        self.done = 0

    @property
    def events(self) -> int:
        return self.bursts * self.burst

    def due(self, now: float) -> range:
        """The bursts due by `now` and not made yet (a bounded number per turn)."""
        upto = min(self.bursts, int((now - self.t0) / self.period) + 1,
                   self.done + max(1, EMIT_BATCH // self.burst))
        due, self.done = range(self.done, max(self.done, upto)), max(self.done, upto)
        return due

    def next_at(self) -> float | None:
        return None if self.done >= self.bursts else self.t0 + self.done * self.period


class Worker:
    """Simulated nodes `first`..`first + count - 1` of one process, and its loop. Participant
    i < count is node i's link, count + i its control server."""

    def __init__(self, endpoint: str, first: int, count: int, engines: int, seed: int,
                 control: bool) -> None:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        self.ctx = zmq.Context()
        self.ctx.max_sockets = 8 * count + 64
        self.clock = Clock()
        self.touched: set[int] = set()       # participants with work this turn
        self.due: list[tuple[float, int]] = []           # (when, participant) deadlines
        self.wakes: list[tuple[float, int]] = []         # (when, node) probe ends
        rng = random.Random(seed)
        self.nodes = [SimNode(f"sim-{first + i:04d}", engines, self.clock, rng,
                              partial(self.touched.add, i), partial(self._wake, i))
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
        self.participants: list[Participant] = [*self.links, *self.controls]
        self.scheduled: list[float | None] = [None] * len(self.participants)
        self.owner = {s: i for i, p in enumerate(self.participants) for s in p.pollables()}
        self.by_fd = {s.getsockopt(zmq.FD): s for s in self.owner}
        self.carry: set[Any] = set()         # sockets with messages left after their turn
        self.emitting: Emission | None = None

    def _wake(self, node: int, when: float) -> None:
        heapq.heappush(self.wakes, (when, node))

    def endpoints(self) -> list[tuple[str, str]]:
        return [(n.node_id, c.socket.getsockopt_string(zmq.LAST_ENDPOINT))
                for n, c in zip(self.nodes, self.controls, strict=True)]

    def run(self, pipe: Connection) -> None:
        epoll = select.epoll()
        for fd in self.by_fd:
            epoll.register(fd, select.EPOLLIN)
        epoll.register(pipe.fileno(), select.EPOLLIN)
        self.touched.update(range(len(self.participants)))  # everyone's first turn
        running = True
        while running:
            fired = epoll.poll(0 if self.carry else self._timeout())
            ready, self.carry = self.carry, set()
            for fd, _ in fired:
                sock = self.by_fd.get(fd)
                if sock is not None and sock.getsockopt(ZMQ_EVENTS) & ZMQ_POLLIN:
                    ready.add(sock)
            for i in {self.owner[s] for s in ready}:
                self.participants[i].handle(ready)
                self.touched.add(i)
            if pipe.poll(0):
                verb, args = pipe.recv()
                running = verb != "stop"
                pipe.send(self._request(verb, args))
            self._emit_due()
            self._turn(self.clock.monotonic())
        for participant in self.participants:
            participant.close()
        epoll.close()
        self.ctx.term()

    def _turn(self, now: float) -> None:
        """The daemon's tick and send for every participant with work, then their next
        deadlines, and which of their sockets still hold messages."""
        while self.due and self.due[0][0] <= now:
            when, i = heapq.heappop(self.due)
            if self.scheduled[i] == when:
                self.scheduled[i] = None
                self.touched.add(i)
        while self.wakes and self.wakes[0][0] <= now:
            _, node = heapq.heappop(self.wakes)
            self.touched.add(node)
            if self.controls:
                self.touched.add(len(self.nodes) + node)
        touched = list(self.touched)
        self.touched.clear()
        for i in touched:
            self.participants[i].tick(now)
        for i in touched:
            self.participants[i].after_save()
        for i in touched:
            participant = self.participants[i]
            deadline = participant.next_deadline()
            if deadline != self.scheduled[i]:
                self.scheduled[i] = deadline
                if deadline is not None:
                    heapq.heappush(self.due, (deadline, i))
            for sock in participant.pollables():
                if sock.getsockopt(ZMQ_EVENTS) & ZMQ_POLLIN:
                    self.carry.add(sock)

    def _timeout(self) -> float:
        """Seconds until the next deadline, wake-up or burst (stale deadlines dropped)."""
        while self.due and self.scheduled[self.due[0][1]] != self.due[0][0]:
            heapq.heappop(self.due)
        soonest = [self.clock.monotonic() + MAX_SLEEP_S]
        soonest += [heap[0][0] for heap in (self.due, self.wakes) if heap]
        if self.emitting is not None and (at := self.emitting.next_at()) is not None:
            soonest.append(at)
        return max(0.0, min(soonest) - self.clock.monotonic())

    def _request(self, verb: str, args: Any) -> Any:
        if verb == "endpoints":
            return self.endpoints()
        if verb == "emit":  # (rate per s, seconds, burst): the events it will make
            rate, seconds, burst = args
            self.emitting = Emission(self.clock.monotonic(), rate, seconds, burst)
            return self.emitting.events
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
        burst, engines = self.emitting.burst, len(self.nodes[0].engines)
        for k in self.emitting.due(self.clock.monotonic()):
            node = self.nodes[k % len(self.nodes)]
            first = (k // len(self.nodes)) * burst
            for engine in (f"e{(first + j) % engines}" for j in range(burst)):
                node.set_state(engine, "suspect" if node.engines[engine]["state"] == "healthy"
                               else "healthy")
        if self.emitting.next_at() is None:
            self.emitting = None


def worker_main(pipe: Connection, endpoint: str, first: int, count: int, engines: int,
                seed: int, control: bool) -> None:
    """A worker process: build the nodes, say "ready", serve the loop until "stop"."""
    worker = Worker(endpoint, first, count, engines, seed, control)
    # One process holds the state of hundreds of nodes: a full collection of its cyclic GC
    # would stall all of them at once (hundreds of ms), which no real node's daemon does.
    # The nodes' long-lived state is kept out of it, and young objects are collected as the
    # standalone coordinator collects them (a pause is a young pass for every few nodes
    # otherwise).
    tune_for_service()
    pipe.send("ready")
    worker.run(pipe)
