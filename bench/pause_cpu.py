"""The coordinator's own CPU per fleet-wide pause, in one process, without sockets (issue 13).

A real `Coordinator` (not started: its hub's socket is a stand-in that hands it prepared frames
and keeps what it sends) with --nodes nodes of --engines engines said HELLO and one subscriber
taking "events" frames with runs. Each round is what the coordinator's loop does for `pause
--all` (then `resume --all`): the client's command fanned out to every node, every node's "run"
frame (one `paused` event per engine, as a node's link encodes it) and its reply taken in,
ACKed and relayed, the gathered reply sent. A node's run and reply come in one frame of lines
(1.6); the same pause with a frame each (1.5 nodes) is measured alternately, for the ratio. The
frames are made beforehand; only the coordinator's work is timed (process CPU time, with its
garbage collections). No libzmq I/O thread, no heartbeats, no other process: the part of
bench/fleet_scale.py's "CPU per pause" that is the coordinator's Python, and much less
sensitive to a loaded machine.

    PYTHONPATH=<checkout> python bench/pause_cpu.py [--nodes 1000] [--engines 8] [--repeat 10]
        [--journal]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
import time
from typing import Any

import zmq

from rollout_watchdog.agent.fanout import node_request_id
from rollout_watchdog.common import lines, protocol
from rollout_watchdog.common.events import Event as NodeEvent
from rollout_watchdog.common.gc_tuning import tune_for_service
from rollout_watchdog.refit_bridge.coordinator import Coordinator

_SNDMORE = int(zmq.SNDMORE)


class StandInFrame:
    """A received frame, as the hub reads one (`bytes`, `more`, `get`)."""

    def __init__(self, data: bytes, more: bool) -> None:
        self.bytes, self.more = data, more

    def get(self, name: str) -> str:
        return "stand-in"


class StandInSocket:
    """Just what the coordinator's loop calls on its ROUTER."""

    def __init__(self) -> None:
        self.inbox: list[list[bytes]] = []    # messages to receive, the next one last
        self.sent: list[list[bytes]] = []
        self._parts: list[bytes] = []
        self._peer = b""

    def recv(self, flags: int = 0, copy: bool = True) -> bytes | StandInFrame:
        if not self._parts:
            if not self.inbox:
                raise zmq.Again()
            self._parts = self.inbox.pop()
        data = self._parts.pop(0)
        return data if copy else StandInFrame(data, bool(self._parts))

    def send(self, frame: bytes, flags: int = 0) -> None:
        if flags & _SNDMORE:   # (an int: `&` on pyzmq's Flag enum costs ~6 % of a round)
            self._peer = frame
        else:
            self.sent.append([self._peer, frame])


def engine(i: int) -> dict[str, Any]:
    return {"id": f"e{i}", "state": "healthy", "paused": False, "pid": 10_000 + i,
            "incarnation": 1, "restarts": 0, "url": f"http://10.0.0.1:{30000 + i}",
            "last_failure": None, "since": time.time(), "external": False,
            "restart_policy": "immediate", "deferred_waiting": False, "next_launch": None,
            "pause_deadline": None, "gpus": [i], "ports": [], "group": None, "tp_size": 1,
            "kill": None}


class Bench:
    def __init__(self, nodes: int, engines: int, state_dir: str | None = None) -> None:
        self.coordinator = Coordinator("tcp://127.0.0.1:0", state_dir=state_dir)
        self.sock = StandInSocket()
        self.coordinator.hub.sock = self.sock  # type: ignore[assignment]
        self.engines = engines
        self.nodes = [f"sim-{i:04d}" for i in range(nodes)]
        self.seq = dict.fromkeys(self.nodes, 0)
        for node in self.nodes:
            hello = protocol.Hello(node, f"{node}-boot", [engine(i) for i in range(engines)], 0)
            self.sock.inbox.insert(0, [node.encode(), protocol.encode(hello)])
        subscribe = protocol.Subscribe(batches=True, runs=True, common=True)
        self.sock.inbox.insert(0, [b"client", protocol.encode(subscribe)])
        self.turns()
        assert len(self.coordinator.view.nodes) == nodes

    def turns(self) -> None:
        """Loop turns until every message is taken and the subscriber has every event."""
        c = self.coordinator.hub
        while self.sock.inbox:
            c._receive_some()
            c.relay.pump(c._send_or_wait, time.monotonic())
        while c.relay.pump(c._send_or_wait, time.monotonic()):
            pass

    def round(self, cmd: str, kind: str, request_id: str, joined: bool = True) -> float:
        """CPU seconds of one fleet-wide `cmd` whose nodes each send `kind` for every engine,
        and their reply (`joined`: in one frame of lines, 1.6)."""
        deadline = time.time() + 60
        frames: list[list[bytes]] = []
        for node in self.nodes:
            events = []
            for i in range(self.engines):
                self.seq[node] += 1
                extra = {"deadline": deadline} if kind == "paused" else None
                event = NodeEvent(time.time(), node, f"e{i}", 1, kind,
                                  detail=f"deep probes {kind}", extra=extra)
                events.append(protocol.Event(node, f"{node}-boot", self.seq[node],
                                             event.to_json()))
            run = protocol.encode(protocol.Run.of(events, common=True))
            ids = [f"e{i}" for i in range(self.engines)]
            result = {"paused": ids, "deadline": deadline} if cmd == "pause" else {"resumed": ids}
            reply = protocol.encode(protocol.Reply(node_request_id(request_id, node), "ok",
                                                   None, result))
            if joined:   # as a node sends them to a 1.6 coordinator: one frame of lines
                frames.insert(0, [node.encode(), lines.NEWLINE.join([run, reply])])
            else:        # to a 1.5 one: a frame each
                frames[0:0] = [[node.encode(), reply], [node.encode(), run]]
        command = protocol.Command(request_id, cmd, {"all": True, "deadline_s": 60})
        self.sock.sent.clear()
        self.sock.inbox = [[b"client", protocol.encode(command)]]
        started = time.process_time()
        self.coordinator.hub._receive_some()   # the fan-out
        self.sock.inbox = frames
        self.turns()
        spent = time.process_time() - started
        assert any(peer == b"client" and b'"kind":"reply"' in frame
                   for peer, frame in self.sock.sent), "no gathered reply"
        return spent


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--engines", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--journal", action="store_true",
                        help="with a state dir (in a temporary directory): every relayed "
                             "event journaled, as a coordinator with --state-dir does")
    parser.add_argument("--default-gc", action="store_true",
                        help="keep Python's collector settings (an embedded coordinator's), "
                             "not the standalone coordinator's (common/gc_tuning.py)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="rwbench-pause-") as state_dir:
        run(args, state_dir if args.journal else None)


class Collections:
    """The garbage collector's passes (gc.callbacks) while `on`: their time, and how many."""

    def __init__(self) -> None:
        self.on = False
        self.seconds: list[float] = []
        self.full = 0
        self._started = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if not self.on:
            return
        if phase == "start":
            self._started = time.process_time()
            return
        self.seconds.append(time.process_time() - self._started)
        self.full += info["generation"] == 2


def run(args: argparse.Namespace, state_dir: str | None) -> None:
    bench = Bench(args.nodes, args.engines, state_dir)
    if not args.default_gc:
        tune_for_service()   # as `rollout-watchdog coordinator` does once started
    gc.collect()
    collections = Collections()
    pauses, resumes, separate = [], [], []
    for k in range(args.repeat):
        collections.on = True
        pauses.append(1000 * bench.round("pause", "paused", f"p{k}"))
        collections.on = False
        resumes.append(1000 * bench.round("resume", "resumed", f"r{k}"))
        separate.append(1000 * bench.round("pause", "paused", f"s{k}", joined=False))
        bench.round("resume", "resumed", f"sr{k}", joined=False)
    settings = "Python's default collector" if args.default_gc else "the coordinator's collector"
    for name, values in (("pause", pauses), ("resume", resumes),
                         ("pause, run and reply a frame each (1.5 nodes)", separate)):
        print(f"coordinator CPU per fleet-wide {name} ({args.nodes} x {args.engines}"
              f"{', journaled' if state_dir else ''}, {settings}), ms: "
              f"min {min(values):.1f} / median {statistics.median(values):.1f} / max "
              f"{max(values):.1f} (n={args.repeat})")
    print(f"  pause with lines (1.6) / a frame each (1.5), alternated: min "
          f"x{min(pauses) / min(separate):.2f}, median "
          f"x{statistics.median(pauses) / statistics.median(separate):.2f}")
    passes = collections.seconds
    print(f"  of the pauses, garbage collection: {1000 * sum(passes) / args.repeat:.1f} ms a "
          f"pause ({len(passes)} passes, {collections.full} of them full; the longest "
          f"{1000 * max(passes, default=0):.1f} ms)")


if __name__ == "__main__":
    main()
