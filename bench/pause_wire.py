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

Each pause is measured twice, alternated in the same run: the nodes sending their run and reply
as one frame of lines (1.6, what a node sends to this coordinator) and as a frame each (1.5
nodes). Printed: the coordinator's CPU per pause (process, and its main thread), gross and net
of its idle fleet's rate (heartbeats), and the ratio of the two ways.

    PYTHONPATH=<checkout> python bench/pause_wire.py [--nodes 1000] [--engines 8]
        [--repeat 20] [--modes lines,separate] [--coordinator-path <another checkout>]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import zmq
from _common import wait_for  # (first: it puts tests/ on the path, for fleet_harness)
from _cpu import CpuMeter
from fleet_harness import CoordinatorProcess, start_coordinator_process
from pause_cpu import engine
from transport_floor import _raise_fd_limit

from rollout_watchdog.common import lines, protocol
from rollout_watchdog.common.events import Event as NodeEvent
from rollout_watchdog.emulator.testing import free_port

MODES = ("lines", "separate")
_NOBLOCK = int(zmq.NOBLOCK)


class LightNodes:
    """The DEALERs of `nodes` nodes, answering as cheaply as a node can."""

    def __init__(self, endpoint: str, nodes: int, engines: int) -> None:
        _raise_fd_limit()
        self.ctx = zmq.Context()
        self.ctx.max_sockets = nodes + 64
        self.engines = engines
        self.names = [f"wire-{i:04d}" for i in range(nodes)]
        self.seq = [0] * nodes
        self.mode = MODES[0]
        self.socks: dict[zmq.Socket[bytes], int] = {}
        for i, name in enumerate(self.names):
            sock = self.ctx.socket(zmq.DEALER)
            sock.linger, sock.routing_id = 0, name.encode()
            sock.connect(endpoint)
            self.socks[sock] = i
            sock.send(protocol.encode(protocol.Hello(name, f"{name}-boot",
                                                     [engine(e) for e in range(engines)], 0)))

    def serve(self, pipe: Connection) -> None:
        poller = zmq.Poller()
        for sock in self.socks:
            poller.register(sock, zmq.POLLIN)
        next_beat = time.monotonic()
        while True:
            if pipe.poll(0):
                order = pipe.recv()
                if order == "stop":
                    break
                self.mode = order
                pipe.send("ok")
            if time.monotonic() >= next_beat:   # every node is alive to the coordinator
                beat = protocol.encode(protocol.Heartbeat(time.time()))
                for sock in self.socks:
                    sock.send(beat, _NOBLOCK)
                next_beat += 1.0
            for sock, _ in poller.poll(50):
                while sock.poll(0):
                    message = json.loads(sock.recv(_NOBLOCK))
                    if message.get("kind") == "command":
                        self._answer(sock, self.socks[sock], message)
        self.ctx.destroy(0)

    def _answer(self, sock: zmq.Socket[bytes], i: int, command: dict[str, Any]) -> None:
        kind = {"pause": "paused", "resume": "resumed"}[command["cmd"]]
        name, ids = self.names[i], [f"e{e}" for e in range(self.engines)]
        deadline = time.time() + 60
        events = []
        for engine_id in ids:
            self.seq[i] += 1
            event = NodeEvent(time.time(), name, engine_id, 1, kind, detail=f"deep probes {kind}",
                              extra={"deadline": deadline} if kind == "paused" else None)
            events.append(protocol.Event(name, f"{name}-boot", self.seq[i], event.to_json()))
        run = protocol.encode(protocol.Run.of(events, common=True))
        result = {"paused": ids, "deadline": deadline} if kind == "paused" else {"resumed": ids}
        reply = protocol.encode(protocol.Reply(command["request_id"], "ok", None, result))
        if self.mode == "lines":
            sock.send(lines.NEWLINE.join([run, reply]), _NOBLOCK)
        else:
            sock.send(run, _NOBLOCK)
            sock.send(reply, _NOBLOCK)


def nodes_main(pipe: Connection, endpoint: str, nodes: int, engines: int) -> None:
    LightNodes(endpoint, nodes, engines).serve(pipe)


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
                pipe.send(mode)
                assert pipe.recv() == "ok"
                before, started = cpu(), time.monotonic()
                reply = conn.call("pause", {"deadline_s": 60, "all": True}, timeout_s=30,
                                  gather_s=10)
                after, wall = cpu(), time.monotonic() - started
                assert reply.status == "ok" and not reply.result["missing"], reply
                if k:
                    figures[mode].append((after[0] - before[0], after[1] - before[1], wall))
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
            target=nodes_main, args=(theirs, coord.endpoint, args.nodes, args.engines),
            daemon=True)
        nodes.start()
        try:
            figures = measure(coord, mine, args.nodes, args.repeat, modes)
        finally:
            mine.send("stop")
            nodes.join(10)
            if nodes.is_alive():
                nodes.kill()
            coord.kill()
    idle = figures.pop("idle")[0][0]
    print(f"{args.nodes} nodes x {args.engines} engines answering at almost no cost, "
          f"{args.repeat} pauses each way, alternated; the coordinator's idle rate "
          f"(heartbeats) {100 * idle:.1f} % of a core")
    print("the coordinator's CPU per fleet-wide pause, ms: mean (psutil counts in 10 ms "
          "ticks), gross and net of the idle rate over the pause's wall time; its main thread")
    means = {}
    for mode, runs in figures.items():
        means[mode] = 1000 * sum(t for t, _, _ in runs) / len(runs)
        net = means[mode] - 1000 * idle * sum(w for _, _, w in runs) / len(runs)
        main_thread = 1000 * sum(m for _, m, _ in runs) / len(runs)
        print(f"  {mode:<9} process {means[mode]:6.1f}, net {net:6.1f}; main thread "
              f"{main_thread:6.1f}")
    if len(means) == 2:
        ratio = (f"{means['lines'] / means['separate']:.2f}" if means["separate"] else
                 "- (a pause under psutil's 10 ms tick: more nodes or pauses)")
        print(f"  lines / separate: x{ratio}")


if __name__ == "__main__":
    main()
