"""The coordinator's CPU per fleet-wide pause over real sockets, with nodes that cost almost
nothing (issue 13).

bench/fleet_scale.py's simulated nodes run the real node link: ~450 ms of CPU per pause on this
2-core machine, so the coordinator shares its cores with them through every pause and its CPU
figure swings by a tenth from run to run. Here a real standalone coordinator (its own process,
as `rollout-watchdog coordinator` runs) serves --nodes DEALERs in one other process that answer
with frames made as cheaply as they can be: each node's HELLO once, a heartbeat a second, and to
each fan-out of `pause`/`resume` its run of one event per engine (1.5 `common`, as a node's link
encodes it) and its reply. What the coordinator does is what it does for real nodes; what the
nodes do is next to nothing, so the cores are the coordinator's.

The nodes answer at once, as a fleet of separate machines does: each node's answers to its next
`pause` and `resume` are made while the fleet is idle, and a command only puts its request id
in. Built on the spot instead (--built-answers, how this bench answered before 2026-12-03),
the one process's answers trickle in ~0.1 ms apart: the coordinator, faster than they come,
waits between them ~500 times a pause, and on this VM each wait costs the next message a
cold cache (bench/README.md, "Stop of 2026-12-03, 06:09-09:09"): that figure is the trickle's.

Each pause is measured twice, alternated in the same run: the nodes sending their run and reply
as one frame of lines (1.6, what a node sends to this coordinator) and as a frame each (1.5
nodes). Printed: the coordinator's CPU per pause (process, and its main thread), gross and net
of its idle fleet's rate (heartbeats), the pause's round trip, and the ratio of the two ways.

    PYTHONPATH=<checkout> python bench/pause_wire.py [--nodes 1000] [--engines 8]
        [--repeat 20] [--modes lines,separate] [--built-answers]
        [--coordinator-path <another checkout>]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import zmq
from _common import percentile, wait_for  # (first: it puts tests/ on the path, for fleet_harness)
from _cpu import CpuMeter
from fleet_harness import CoordinatorProcess, start_coordinator_process
from pause_cpu import engine
from transport_floor import _raise_fd_limit

from rollout_watchdog.common import lines, protocol
from rollout_watchdog.common.events import Event as NodeEvent
from rollout_watchdog.emulator.testing import free_port

MODES = ("lines", "separate")
CMDS = {"pause": "paused", "resume": "resumed"}   # a command, and the kind of its events
_REQUEST_ID_SLOT = "@request-id@"   # where a prepared reply's request id goes
ORDER_TIMEOUT_S = 60.0   # the nodes' answers made, at most (a dead process: an error, no hang)
SETTLE_S = 0.2           # then the coordinator takes in the heartbeats they sent meanwhile
_NOBLOCK = int(zmq.NOBLOCK)


class LightNodes:
    """The DEALERs of `nodes` nodes, answering as cheaply as a node can."""

    def __init__(self, endpoint: str, nodes: int, engines: int, built: bool) -> None:
        _raise_fd_limit()
        self.ctx = zmq.Context()
        self.ctx.max_sockets = nodes + 64
        self.engines, self.built = engines, built
        self.names = [f"wire-{i:04d}" for i in range(nodes)]
        self.seq = [0] * nodes
        self.mode = MODES[0]
        # each node's answer to the command the bench said comes next: (command, the seq it
        # follows on, run, reply); used only while the node's seq is still that one
        self.ready: list[tuple[str, int, bytes, bytes] | None] = [None] * nodes
        self.answered = {"beforehand": 0, "on the spot": 0}   # how each answer was made
        self.socks: dict[zmq.Socket[bytes], int] = {}
        for i, name in enumerate(self.names):
            sock = self.ctx.socket(zmq.DEALER)
            sock.linger, sock.routing_id = 0, name.encode()
            sock.connect(endpoint)
            self.socks[sock] = i
            sock.send(protocol.encode(protocol.Hello(name, f"{name}-boot",
                                                     [engine(e) for e in range(engines)], 0)))

    def serve(self, pipe: Connection) -> None:
        """Answer commands. An order down `pipe` (the mode, and the command that comes next) is
        answered once every node's answer to that command is made (unless --built-answers) and
        the heartbeats that fell due meanwhile are sent: the bench then lets the coordinator
        take them in, and sends the command."""
        poller = zmq.Poller()
        for sock in self.socks:
            poller.register(sock, zmq.POLLIN)
        next_beat = time.monotonic()
        while True:
            if pipe.poll(0):
                order = pipe.recv()
                if order == "stop":
                    pipe.send(self.answered)
                    break
                self.mode, cmd = order
                self._prepare(cmd)
                next_beat = self._beat(next_beat)
                pipe.send("ok")
            next_beat = self._beat(next_beat)
            for sock, _ in poller.poll(50):
                while sock.poll(0):
                    message = json.loads(sock.recv(_NOBLOCK))
                    if message.get("kind") == "command":
                        self._answer(sock, self.socks[sock], message)
        self.ctx.destroy(0)

    def _beat(self, next_beat: float) -> float:
        """Every node's heartbeat when due (every node is alive to the coordinator); the next
        time one is due."""
        if time.monotonic() < next_beat:
            return next_beat
        beat = protocol.encode(protocol.Heartbeat(time.time()))
        for sock in self.socks:
            sock.send(beat, _NOBLOCK)
        return max(next_beat + 1.0, time.monotonic())

    def _prepare(self, cmd: str) -> None:
        if self.built:
            return
        for i, seq in enumerate(self.seq):
            ready = self.ready[i]
            if ready is None or ready[:2] != (cmd, seq):
                self.ready[i] = (cmd, seq, *self._made(i, cmd))

    def _made(self, i: int, cmd: str) -> tuple[bytes, bytes]:
        """Node i's run and reply to its next `cmd`, the reply's request id a placeholder."""
        kind = CMDS[cmd]
        name, ids = self.names[i], [f"e{e}" for e in range(self.engines)]
        deadline = time.time() + 60
        events = []
        for k, engine_id in enumerate(ids, start=1):
            event = NodeEvent(time.time(), name, engine_id, 1, kind, detail=f"deep probes {kind}",
                              extra={"deadline": deadline} if kind == "paused" else None)
            events.append(protocol.Event(name, f"{name}-boot", self.seq[i] + k,
                                         event.to_json()))
        run = protocol.encode(protocol.Run.of(events, common=True))
        result = {"paused": ids, "deadline": deadline} if kind == "paused" else {"resumed": ids}
        reply = protocol.encode(protocol.Reply(_REQUEST_ID_SLOT, "ok", None, result))
        return run, reply

    def _answer(self, sock: zmq.Socket[bytes], i: int, command: dict[str, Any]) -> None:
        ready, self.ready[i] = self.ready[i], None
        if ready is not None and ready[:2] == (command["cmd"], self.seq[i]):
            self.answered["beforehand"] += 1
            run, reply = ready[2:]
        else:   # (none made, or made for another command or an older seq)
            self.answered["on the spot"] += 1
            run, reply = self._made(i, command["cmd"])
        self.seq[i] += self.engines
        reply = reply.replace(_REQUEST_ID_SLOT.encode(),
                              json.dumps(command["request_id"])[1:-1].encode())
        if self.mode == "lines":
            sock.send(lines.NEWLINE.join([run, reply]), _NOBLOCK)
        else:
            sock.send(run, _NOBLOCK)
            sock.send(reply, _NOBLOCK)


def nodes_main(pipe: Connection, endpoint: str, nodes: int, engines: int, built: bool) -> None:
    LightNodes(endpoint, nodes, engines, built).serve(pipe)


def _order(pipe: Connection, order: tuple[str, str]) -> None:
    """Tell the nodes the mode and the command that comes next; once they are ready, give the
    coordinator SETTLE_S to take in the heartbeats they sent meanwhile (out of the window)."""
    pipe.send(order)
    if not pipe.poll(ORDER_TIMEOUT_S):
        raise RuntimeError(f"the nodes' process did not answer within {ORDER_TIMEOUT_S:g} s")
    assert pipe.recv() == "ok"
    time.sleep(SETTLE_S)


def measure(coord: CoordinatorProcess, pipe: Connection, nodes: int, repeat: int,
            modes: list[str]) -> dict[str, list[tuple[float, float, float]]]:
    """Per mode, (process, main thread) CPU seconds and the wall seconds of each pause, the
    modes alternated; "idle": the process's idle rate (CPU seconds per second)."""
    meter = CpuMeter()
    meter.attach(coord.proc.pid)

    def cpu() -> tuple[float, float]:
        """(process, main thread) CPU seconds so far."""
        return meter.seconds()["coordinator"], meter.main_thread_seconds()
    conn = coord.connect()
    figures: dict[str, list[tuple[float, float, float]]] = {mode: [] for mode in modes}
    try:
        wait_for(lambda: conn.result("ping", timeout_s=5)["reachable"] == nodes, 120,
                 f"{nodes} nodes reachable", interval=0.05)
        for k in range(repeat + 1):   # (the first round warms up)
            for mode in modes:
                _order(pipe, (mode, "pause"))
                before, started = cpu(), time.monotonic()
                reply = conn.call("pause", {"deadline_s": 60, "all": True}, timeout_s=30,
                                  gather_s=10)
                after, wall = cpu(), time.monotonic() - started
                assert reply.status == "ok" and not reply.result["missing"], reply
                if k:
                    figures[mode].append((after[0] - before[0], after[1] - before[1], wall))
                _order(pipe, (mode, "resume"))
                reply = conn.call("resume", {"all": True}, timeout_s=30, gather_s=10)
                assert reply.status == "ok", reply
        idle_before, started = cpu(), time.monotonic()
        time.sleep(5)
        idle = (cpu()[0] - idle_before[0]) / (time.monotonic() - started)
        figures["idle"] = [(idle, 0.0, 0.0)]
    finally:
        conn.close()
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--engines", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=20, help="pauses of each way")
    parser.add_argument("--modes", default=",".join(MODES),
                        help="the ways the nodes answer, alternated (default: both)")
    parser.add_argument("--built-answers", action="store_true",
                        help="nodes build each answer when its command comes (they trickle in "
                             "~0.1 ms apart), not beforehand (at once, as a fleet answers)")
    parser.add_argument("--coordinator-path", metavar="CHECKOUT", default=None,
                        help="run the coordinator from this checkout (its PYTHONPATH): another "
                             "commit's code, for an A/B in the same minutes ('separate' only "
                             "for a coordinator below protocol 1.6)")
    args = parser.parse_args()
    modes = args.modes.split(",")
    if not set(modes) <= set(MODES):
        parser.error(f"--modes: each of {', '.join(MODES)}")
    _raise_fd_limit()
    bind = f"tcp://127.0.0.1:{free_port()}"
    with tempfile.TemporaryDirectory(prefix="rwbench-wire-") as tmp:
        env = None if args.coordinator_path is None else {"PYTHONPATH": args.coordinator_path}
        coord = start_coordinator_process(bind, log_path=Path(tmp) / "coordinator.log", env=env)
        mine, theirs = mp.get_context("spawn").Pipe()
        nodes = mp.get_context("spawn").Process(
            target=nodes_main, args=(theirs, coord.endpoint, args.nodes, args.engines,
                                     args.built_answers), daemon=True)
        nodes.start()
        theirs.close()   # (ours closed: a dead nodes' process is an EOF here, not a hang)
        try:
            figures = measure(coord, mine, args.nodes, args.repeat, modes)
        finally:
            try:
                mine.send("stop")
                answered = mine.recv() if mine.poll(10) else {}
            except (OSError, EOFError):   # the nodes' process is gone
                answered = {}
            nodes.join(10)
            if nodes.is_alive():
                nodes.kill()
            coord.kill()
    idle = figures.pop("idle")[0][0]
    answers = ("built when each command comes (a trickle)" if args.built_answers
               else "made beforehand (at once, as a fleet answers)")
    print(f"{args.nodes} nodes x {args.engines} engines answering at almost no cost, their "
          f"answers {answers}, {args.repeat} pauses each way, alternated; the coordinator's "
          f"idle rate (heartbeats) {100 * idle:.1f} % of a core; answers made "
          + (", ".join(f"{how}: {count}" for how, count in answered.items())
             or "unknown (the nodes' process did not say)"))
    print("the coordinator's CPU per fleet-wide pause, ms: mean (psutil counts in 10 ms "
          "ticks), gross and net of the idle rate over the pause's wall time; its main thread; "
          "the pause's round trip, median, p99 (nearest rank: the max for 20 or fewer) and max "
          "(n=--repeat)")
    means = {}
    for mode, runs in figures.items():
        means[mode] = 1000 * sum(t for t, _, _ in runs) / len(runs)
        net = means[mode] - 1000 * idle * sum(w for _, _, w in runs) / len(runs)
        main_thread = 1000 * sum(m for _, m, _ in runs) / len(runs)
        walls = [1000 * w for _, _, w in runs]
        print(f"  {mode:<9} process {means[mode]:6.1f}, net {net:6.1f}; main thread "
              f"{main_thread:6.1f}; round trip {statistics.median(walls):6.1f}, p99 "
              f"{percentile(walls, 99):6.1f}, max {max(walls):6.1f}")
    if len(means) == 2:
        ratio = (f"{means['lines'] / means['separate']:.2f}" if means["separate"] else
                 "- (a pause under psutil's 10 ms tick: more nodes or pauses)")
        print(f"  lines / separate: x{ratio}")


if __name__ == "__main__":
    main()
