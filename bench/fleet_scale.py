"""Fleet at scale: 1,000 simulated nodes x 8 engines against one coordinator (issue 6).

The coordinator is a real `rollout-watchdog coordinator` process. The nodes are real `NodeLink`s
over fake engine state (bench/_fleet_sim.py), spread over --workers processes (2: more only
add context switches on a 2-core machine), each one loop that runs only the nodes with work, so
that the figures are the coordinator's and not the simulation's. One subscribed client (a
thread of this process) follows every event.

Figures, each with its goal:
- convergence: the coordinator SIGKILLed and started again on the same port; from the new
  process's start until `ping` shows every node reachable, and until `status` lists every
  engine (<= 5 s);
- fleet-wide pause round trip (client -> coordinator -> every node -> back), a quarter of the
  nodes finishing a simulated in-flight probe (<= 20 ms) first: median and p99 (p99 <= 250 ms);
- sustained event throughput: --event-rate offered for --event-seconds, into the coordinator
  (all acknowledged) and out to the subscriber (all received) (>= 20,000 events/s). The load
  comes in bursts of --burst events per node (default: one per engine, 8), each burst made in
  one loop turn of its node, so it leaves as one frame. Why: a fleet only makes events at such
  rates when something happens to many engines at once, and then a node's engines change
  together (a pause or resume, a driver or network fault on the node, a multi-engine group
  restarting), and the daemon's turn gathers what happened since the last one (all probe
  results that came in, all engines ticked) before it sends. 30,000 events/s spread evenly, one
  event per node per turn, is what 1,000 nodes would send only if each of them changed one
  engine's state 30 times a second, independently; --burst 1 measures that shape too;
- CPU per phase (% of one core): the coordinator, the node processes together, the subscribing
  client's thread and the whole machine (2 cores: 200 %), which says what bounds a figure (a
  single-threaded process near 100 %, or the machine near its total); the coordinator's peak
  RSS (<= 300 MB);
- end to end on real processes: a node daemon over an emulator engine, linked to the same
  coordinator; SIGKILL of the engine to the subscriber receiving `state -> stopping`: median
  and max (median <= 50 ms).
Side by side, the simplest alternative a user would write: the driver polling every node's
`status` in turn over TCP (the daemon's own control protocol and server, one kept-open DEALER
per node). State changes are injected on random engines while both watch; the figure is how
long each takes to see them, and the ratio. Also a sequential pause loop against the fan-out.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import pstats
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter, deque
from functools import partial
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import psutil
import zmq
from _common import (
    MARKER_ENV,
    Fleet,
    bench_main,
    engines,
    goal,
    kill_marked,
    parse_args,
    step,
    summary,
    wait_for,
)
from _cpu import CpuMeter, pin_apart
from _fleet_sim import worker_main
from fleet_harness import CoordinatorConnection, CoordinatorProcess, start_coordinator_process
from transport_floor import bare_rounds

from rollout_watchdog.common import protocol
from rollout_watchdog.emulator.testing import free_port

PROBE = {"liveness_interval_s": 1.0, "health_interval_s": 0.5, "health_timeout_s": 5.0,
         "failure_threshold": 3, "startup_timeout_s": 120.0}
RESTART = {"grace_s": 5.0, "backoff_initial_s": 0.0, "backoff_max_s": 0.0, "max_restarts": 1000,
           "window_s": 600.0, "kill_timeout_s": 10.0, "release_timeout_s": 30.0}


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nodes", type=int, default=None, help="simulated nodes (1000)")
    parser.add_argument("--engines", type=int, default=8, help="engines per node (8)")
    parser.add_argument("--workers", type=int, default=None, help="node processes (2)")
    parser.add_argument("--event-rate", type=float, default=None,
                        help="offered events/s in the throughput phase (30000)")
    parser.add_argument("--event-seconds", type=float, default=None, help="its length (5)")
    parser.add_argument("--burst", type=int, default=None,
                        help="events per node per loop turn in the throughput phase (--engines)")
    parser.add_argument("--flips", type=int, default=None,
                        help="state changes watched by push and by polling (30)")
    parser.add_argument("--kills", type=int, default=None, help="real engine kills (10)")
    parser.add_argument("--only-pauses", action="store_true",
                        help="measure the fleet-wide pauses only (after an idle window)")
    parser.add_argument("--profile", metavar="PATH", default=None,
                        help="profile the coordinator (cProfile) within the pause round trips "
                             "only, write the stats to PATH and print the costliest functions "
                             "(profiling slows it: its CPU figures are not comparable then)")
    parser.add_argument("--pin", action="store_true",
                        help="the coordinator alone on one CPU, the simulated nodes and the "
                             "subscriber on the others (the coordinator's CPU without the "
                             "nodes' contention, as in a real fleet; the pause round trip is "
                             "then the nodes' one CPU's; the coordinator started again in the "
                             "last phase is not pinned)")


class Subscriber(threading.Thread):
    """The client: subscribes (taking "events" frames, as FleetClient does), heartbeats, and
    notes when each event arrived (wall clock)."""

    def __init__(self, endpoint: str) -> None:
        super().__init__(daemon=True, name="subscriber")
        self.conn = CoordinatorConnection(endpoint)
        # (seen, node_id, engine, to, incarnation) of each event: flat tuples of atoms, which
        # the cyclic GC leaves alone. Holding the decoded events instead made this process's
        # full collections take hundreds of ms, stalling the client (and the pause it times)
        # as no real client that keeps nothing would be.
        self.received: deque[tuple[float, str, Any, Any, Any]] = deque(maxlen=1_000_000)
        self.count = 0
        self.kinds: Counter[str] = Counter()   # events received, by kind
        self.baseline = 0   # events the nodes had made when the subscription began
        self.stopping = threading.Event()
        self.conn.send(protocol.Subscribe(batches=True, runs=True, common=True))

    def run(self) -> None:
        next_beat = 0.0
        while not self.stopping.is_set():
            now = time.monotonic()
            if now >= next_beat:
                self.conn.send(protocol.Heartbeat(time.time()))
                next_beat = now + 1.0
            message = self.conn.recv(0.2)
            batch = [message] if isinstance(message, protocol.Event) else (
                message.events if isinstance(message, protocol.Events) else
                message.as_events() if isinstance(message, protocol.Run) else [])
            seen = time.time()
            self.received.extend((seen, e.node_id, e.event.get("engine"), e.event.get("to"),
                                  e.event.get("incarnation")) for e in batch)
            self.kinds.update(str(e.event.get("kind")) for e in batch)
            self.count += len(batch)
        self.conn.close()

    def find(self, after: float, node_id: str, engine: str, to: str,
             incarnation: int | None = None) -> float | None:
        """When the latest event since `after` with these fields arrived."""
        for seen, *fields in reversed(self.received):
            if seen < after:
                return None
            if fields[:3] == [node_id, engine, to] and incarnation in (None, fields[3]):
                return float(seen)
        return None


class Workers:
    """The simulated nodes' processes and their pipes."""

    def __init__(self, endpoint: str, nodes: int, engines: int, processes: int) -> None:
        ctx = mp.get_context("spawn")
        share = -(-nodes // processes)
        self.pipes: list[Connection] = []
        self.procs = []
        self.spans: list[tuple[int, int]] = []
        for w in range(processes):
            first, count = w * share, min(share, nodes - w * share)
            if count <= 0:
                break
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(target=worker_main, args=(theirs, endpoint, first, count,
                                                         engines, 1000 + w, True), daemon=True)
            proc.start()
            self.pipes.append(mine)
            self.procs.append(proc)
            self.spans.append((first, count))
        for pipe in self.pipes:
            if not pipe.poll(120) or pipe.recv() != "ready":
                raise RuntimeError("a worker did not start")

    def ask(self, verb: str, args: Any = None) -> list[Any]:
        for pipe in self.pipes:
            pipe.send((verb, args))
        return [pipe.recv() if pipe.poll(30) else _no_answer(verb) for pipe in self.pipes]

    def ask_one(self, node: int, verb: str, args: Any) -> Any:
        for pipe, (first, count) in zip(self.pipes, self.spans, strict=True):
            if first <= node < first + count:
                pipe.send((verb, (node - first, *args)))
                return pipe.recv() if pipe.poll(30) else _no_answer(verb)
        raise IndexError(node)

    def emitted(self) -> int:
        """Events the simulated nodes have made so far."""
        return sum(s["emitted"] for s in self.ask("stats"))

    def wait_acked(self, timeout: float) -> float:
        """Until every event is acknowledged and emission is over; the time it happened."""
        def acked() -> bool:
            return all(left == 0 and done for left, done in self.ask("outbox"))
        wait_for(acked, timeout, "every simulated node's outbox to empty", interval=0.01)
        return time.time()

    def stop(self) -> None:
        for pipe in self.pipes:
            pipe.send(("stop", None))
        for proc in self.procs:
            proc.join(10)


def _no_answer(verb: str) -> Any:
    raise RuntimeError(f"a worker did not answer {verb!r} within 30 s")


def poller_main(pipe: Connection, endpoints: list[tuple[str, str]], engines: int) -> None:
    """The alternative: the driver asks every node's `status` in turn, forever, and notes when
    it first sees each engine's new state. One kept-open DEALER per node."""
    ctx = zmq.Context()
    ctx.max_sockets = len(endpoints) + 64
    socks = []
    for _, endpoint in endpoints:
        sock = ctx.socket(zmq.DEALER)
        sock.linger = 0
        sock.connect(endpoint)
        socks.append(sock)
    last: dict[tuple[str, str], str] = {}
    changes: list[tuple[float, str, str, str]] = []
    sweeps: list[float] = []
    stopping = False
    while True:  # asked to stop: one more full sweep, so every change made before is seen
        stopping, last_sweep = pipe.poll(0), stopping
        if last_sweep:
            break
        if sweeps and len(sweeps) == 1:
            pipe.send("ready")  # one sweep done: it knows every engine's state
        started = time.monotonic()
        for (node_id, _), sock in zip(endpoints, socks, strict=True):
            result = control_call(sock, "status", {})
            seen = time.time()
            for e in result["engines"]:
                key = (node_id, e["id"])
                if key in last and last[key] != e["state"]:
                    changes.append((seen, node_id, e["id"], e["state"]))
                last[key] = e["state"]
        sweeps.append(time.monotonic() - started)
    pipe.recv()
    pipe.send((changes, sweeps))
    for sock in socks:
        sock.close(linger=0)
    ctx.term()


def control_call(sock: zmq.Socket[bytes], cmd: str, args: dict[str, Any]) -> Any:
    """One request on the daemon's control protocol (cli/client.py), on a kept-open socket."""
    sock.send(json.dumps({"v": 1, "id": uuid.uuid4().hex, "cmd": cmd, "args": args}).encode())
    if not sock.poll(5000):
        raise RuntimeError(f"no answer to {cmd} within 5 s")
    reply = json.loads(sock.recv())
    if reply["status"] != "ok":
        raise RuntimeError(f"{cmd}: {reply['reason']}")
    return reply["result"]


def fleet_ready(coord: CoordinatorProcess, nodes: int, engines: int, timeout: float
                ) -> tuple[float, float]:
    """When (wall clock) `ping` showed every node reachable, then `status` every engine."""
    conn = coord.connect()
    try:
        wait_for(lambda: (r := conn.call("ping", timeout_s=2)).status == "ok"
                 and r.result["reachable"] == nodes, timeout, f"{nodes} nodes reachable",
                 interval=0.02)
        reachable = time.time()

        def listed() -> bool:
            """The whole fleet view, page by page (as FleetClient.status reads it)."""
            count, after = 0, None
            while True:
                result = conn.result("status", {} if after is None else {"after": after},
                                     timeout_s=5)
                count += sum(len(n["engines"]) for n in result["nodes"] if n["reachable"])
                after = result.get("next")
                if after is None:
                    return count == nodes * engines
        wait_for(listed, timeout, f"{nodes * engines} engines listed", interval=0.05)
        return reachable, time.time()
    finally:
        conn.close()


def main(args: argparse.Namespace) -> int:
    quick = args.quick
    nodes = args.nodes or (40 if quick else 1000)
    n_workers = args.workers or 2  # on 2 cores, 4 cost the nodes ~25 % more CPU per event
    rate = args.event_rate or (2000.0 if quick else 30000.0)
    seconds = args.event_seconds or (1.0 if quick else 5.0)
    flips = args.flips or (4 if quick else 30)
    kills = args.kills or (1 if quick else 10)
    token = uuid.uuid4().hex
    os.environ[MARKER_ENV] = token
    tmp = Path(tempfile.mkdtemp(prefix="rwbench-fleet-"))
    bind = f"tcp://127.0.0.1:{free_port()}"
    burst = args.burst or args.engines
    print(f"setup: {nodes} simulated nodes x {args.engines} engines in {n_workers} processes, "
          f"coordinator {bind}; {args.repeat} pause(s), {rate:g} events/s offered for "
          f"{seconds:g} s in bursts of {burst} per node, {flips} watched changes, {kills} real "
          f"kill(s); files in {tmp}; load average {os.getloadavg()[0]:.2f}")
    cpu = CpuMeter()
    if args.profile is not None:
        args.profile = os.path.abspath(args.profile)
        with contextlib.suppress(FileNotFoundError):
            os.remove(args.profile)
    wrap = [] if args.profile is None else [sys.executable, str(Path(__file__).with_name(
        "_profiled.py")), args.profile, "--"]
    coord = start_coordinator_process(bind, log_path=tmp / "coordinator.log", wrap=wrap)
    workers: Workers | None = None
    ok, net = True, None
    try:
        cpu.attach(coord.proc.pid)
        with step(f"{nodes} simulated nodes start and say HELLO"):
            workers = Workers(coord.endpoint, nodes, args.engines, n_workers)
            fleet_ready(coord, nodes, args.engines, 300)
        cpu.nodes = [psutil.Process(proc.pid) for proc in workers.procs]
        sub = Subscriber(coord.endpoint)
        sub.start()
        wait_for(lambda: sub.native_id, 10, "the subscriber thread")
        cpu.subscriber = sub.native_id
        if args.pin:
            print(pin_apart(coord.proc.pid, [os.getpid(), *(p.pid for p in workers.procs)]))
        cpu.measure("idle fleet (heartbeats), 5 s" if not quick else "idle fleet, 1 s",
                    time.sleep, 1.0 if quick else 5.0)
        sub.baseline = workers.emitted()   # the subscription has begun, the fleet is quiet
        if not args.only_pauses:
            ok &= side_by_side(workers, sub, nodes, args.engines, flips)
        held, net = pauses(coord, workers, sub, cpu, args.repeat, args.profile)
        ok &= held
        if not args.only_pauses:
            ok &= throughput(coord, workers, sub, cpu, rate, seconds, burst)
            ok &= end_to_end(coord, sub, kills, args.keep)
        sub.stopping.set()
        sub.join(5)
        if not args.only_pauses:
            converged, coord = restart(coord, bind, tmp, cpu, nodes, args.engines)
            ok &= converged
        print(f"CPU (load average at the end {os.getloadavg()[0]:.2f}):")
        cpu.report()
        rss = cpu.peak_rss / 2**20
        print("coordinator:")
        print(f"  peak RSS (sampled at the end of each phase) {rss:.1f} MB")
        ok &= goal("coordinator RSS <= 300 MB", rss <= 300)
        stats = workers.ask("stats")
        print(f"nodes: {sum(s['emitted'] for s in stats)} events emitted, "
              f"{sum(s['dropped'] for s in stats)} dropped from outboxes, "
              f"{sum(s['bad_messages'] for s in stats)} bad messages")
    finally:
        if workers is not None:
            workers.stop()
        coord.cleanup()
        left = kill_marked(token)
        if left:
            print(f"  (cleanup: SIGKILLed {left} leftover process(es))")
    if net is not None and args.profile is None:
        report_in_floors(nodes, net)
    return 0 if ok else 2


def report_in_floors(nodes: int, net: float) -> None:
    """The pause's CPU in units of this machine's bare transport round, measured now (the fleet
    stopped): a figure that a slower or faster machine moves much less than milliseconds (this
    2-core VM's speed has swung twofold between sessions)."""
    runs = bare_rounds(nodes, rounds=20, repeat=3, modes=("two messages",))["two messages"]
    floor = statistics.median(cpu for cpu, _, _ in runs)
    print(f"transport floor (bench/transport_floor.py's bare round of a pause's messages over "
          f"{nodes} DEALERs, measured after the fleet stopped): {1000 * floor:.1f} ms; the "
          f"coordinator's CPU per pause net of its idle rate is {net / floor:.1f} floors")


def side_by_side(workers: Workers, sub: Subscriber, nodes: int, engines: int,
                 flips: int) -> bool:
    """Random engines change state; how soon the subscriber and the polling driver see it."""
    endpoints = [e for part in workers.ask("endpoints") for e in part]
    ctx = mp.get_context("spawn")
    mine, theirs = ctx.Pipe()
    poller = ctx.Process(target=poller_main, args=(theirs, endpoints, engines), daemon=True)
    poller.start()
    if not mine.poll(120) or mine.recv() != "ready":
        raise RuntimeError("the polling driver did not start")
    rng = random.Random(7)
    targets = rng.sample([(n, f"e{e}") for n in range(nodes) for e in range(engines)], flips)
    injected = []
    for node, engine in targets:
        ts = workers.ask_one(node, "flip", (engine, "suspect"))
        injected.append((ts, f"sim-{node:04d}", engine))
        time.sleep(rng.uniform(0.05, 0.3))
    pushed = []
    for ts, node_id, engine in injected:
        seen = wait_for(partial(sub.find, ts, node_id=node_id, engine=engine, to="suspect"),
                        10, f"{node_id}/{engine} at the subscriber")
        pushed.append(1000 * (seen - ts))
    mine.send("stop")
    if not mine.poll(120):
        raise RuntimeError("the polling driver did not finish its sweep within 120 s")
    changes, sweeps = mine.recv()
    polled_at = {(n, e): t for t, n, e, s in changes if s == "suspect"}
    poller.join(10)
    polled = [1000 * (polled_at[(n, e)] - ts) for ts, n, e in injected if (n, e) in polled_at]
    print("a state change on one engine, seen by the driver:")
    push = summary("pushed (node -> coordinator -> subscriber)", pushed, "ms", 2)
    poll = summary("polling every node's status in turn", polled, "ms", 1)
    summary("  one polling sweep over all nodes", [1000 * s for s in sweeps], "ms", 1)
    if poll.values and push.values:
        print(f"  ratio polling / pushed: {poll.median / push.median:.0f}x median, "
              f"{poll.max / push.max:.0f}x max")
    ok = goal("every change seen by polling too", len(polled) == len(injected))
    for _, node_id, engine in injected:  # back to healthy, for the phases that follow
        workers.ask_one(int(node_id[4:]), "flip", (engine, "healthy"))
    _sequential_pause(endpoints)
    return ok


def _sequential_pause(endpoints: list[tuple[str, str]]) -> None:
    """The alternative's fleet-wide pause: each node in turn, then resume likewise."""
    ctx = zmq.Context()
    ctx.max_sockets = len(endpoints) + 64
    socks = [ctx.socket(zmq.DEALER) for _ in endpoints]
    for sock, (_, endpoint) in zip(socks, endpoints, strict=True):
        sock.linger = 0
        sock.connect(endpoint)
    times = []
    for _ in range(3):
        started = time.monotonic()
        for sock in socks:
            control_call(sock, "pause", {"all": True, "deadline_s": 60})
        times.append(1000 * (time.monotonic() - started))
        for sock in socks:
            control_call(sock, "resume", {"all": True})
    for sock in socks:
        sock.close(linger=0)
    ctx.term()
    summary("sequential pause over every node's control socket", times, "ms", 1)
    _sequential_ms.extend(times)


_sequential_ms: list[float] = []


def pauses(coord: CoordinatorProcess, workers: Workers, sub: Subscriber, cpu: CpuMeter,
           repeat: int, profile: str | None = None) -> tuple[bool, float | None]:
    """Fleet-wide pause and resume, `repeat` times; with `profile`, the coordinator profiles
    each pause round trip (bench/_profiled.py: SIGUSR1 on, SIGUSR2 off and dump). Whether the
    p99 goal held, and the coordinator's CPU seconds per pause net of its idle rate."""
    conn = coord.connect()
    rtts, resumes = [], []
    loop = 0.0   # CPU seconds of the coordinator's main thread within the pause round trips
    used = dict.fromkeys(CpuMeter.PARTS, 0.0)   # CPU seconds within the pause round trips
    try:
        def one() -> None:
            nonlocal loop
            for _ in range(repeat):
                workers.wait_acked(60)
                if profile is not None:
                    coord.proc.send_signal(signal.SIGUSR1)
                before, started = cpu.seconds(), time.monotonic()
                loop_before = cpu.main_thread_seconds()
                reply = conn.call("pause", {"deadline_s": 60, "all": True}, timeout_s=30,
                                  gather_s=10)
                rtts.append(1000 * (time.monotonic() - started))
                loop += cpu.main_thread_seconds() - loop_before
                if profile is not None:
                    coord.proc.send_signal(signal.SIGUSR2)
                for part, spent in cpu.seconds().items():
                    used[part] += spent - before[part]
                assert reply.status == "ok" and not reply.result["missing"], reply
                workers.wait_acked(60)
                started = time.monotonic()
                reply = conn.call("resume", {"all": True}, timeout_s=30, gather_s=10)
                resumes.append(1000 * (time.monotonic() - started))
                assert reply.status == "ok", reply
        cpu.measure(f"{repeat} fleet-wide pause + resume", one)
    finally:
        conn.close()
    print("fleet-wide pause round trip (through the coordinator):")
    s = summary("pause, every node acknowledged", rtts, "ms", 1)
    summary("resume", resumes, "ms", 1)
    p99 = s.p99
    print(f"  CPU per pause: coordinator {1000 * used['coordinator'] / repeat:.0f} ms, nodes "
          f"{1000 * used['nodes'] / repeat:.0f} ms, subscriber "
          f"{1000 * used['subscriber'] / repeat:.0f} ms (the coordinator's main thread "
          f"{1000 * loop / repeat:.0f} ms); % of one core within the round trips:")
    cpu.line("pause round trips", sum(rtts) / 1000, used)
    idle = next(((elapsed, spent) for name, elapsed, spent in cpu.phases
                 if name.startswith("idle fleet")), None)
    net = None
    if idle is not None:   # what the pauses cost on top of the heartbeats they ran beside
        rate = idle[1]["coordinator"] / idle[0]
        net = (used["coordinator"] - rate * sum(rtts) / 1000) / repeat
        print(f"  CPU per pause, coordinator, net of its idle fleet's rate ({100 * rate:.1f} % "
              f"of a core: heartbeats): {1000 * net:.0f} ms")
    print(f"  pause p99 {p99:.1f} ms")
    if _sequential_ms:
        ratio = statistics.median(_sequential_ms) / s.median
        print(f"  ratio sequential loop / fan-out: {ratio:.1f}x median")
    if profile is not None:
        wait_for(lambda: os.path.exists(profile), 10, "the coordinator's profile")
        print(f"the coordinator's profile within the pauses ({profile}), by own time:")
        pstats.Stats(profile, stream=sys.stdout).sort_stats("tottime").print_stats(25)
    return goal("pause p99 <= 250 ms", p99 <= 250), net


def throughput(coord: CoordinatorProcess, workers: Workers, sub: Subscriber, cpu: CpuMeter,
               rate: float, seconds: float, burst: int) -> bool:
    """The offered load until the nodes have every ACK, then until the subscriber has every
    event (or none came for 3 s: the relay skipped those that fell out of its buffer); CPU is
    measured over each part alone."""
    def offer() -> tuple[int, float]:
        emitted = sum(workers.ask("emit", (rate / len(workers.pipes), seconds, burst)))
        return emitted, workers.wait_acked(120)

    def drain() -> int:
        last, still = -1, time.monotonic()
        while sub.count - before < emitted and time.monotonic() - still < 3.0:
            if sub.count != last:
                last, still = sub.count, time.monotonic()
            time.sleep(0.01)
        return sub.count - before

    workers.wait_acked(60)
    conn = coord.connect()
    try:  # the subscriber has had every earlier event (the pauses'), and the count starts
        earlier = workers.emitted() - sub.baseline
        wait_for(lambda: sub.count - sub.kinds["node_reachable"] - sub.kinds["node_unreachable"]
                 + conn.result("ping", {}, timeout_s=5)["relay_skipped"] >= earlier, 60,
                 "the subscriber to have every earlier event", interval=0.05)
        before, skipped = sub.count, conn.result("ping", {}, timeout_s=5)["relay_skipped"]
        kinds_before = Counter(sub.kinds)
        started = time.time()
        emitted, acked_at = cpu.measure("throughput: offered, until all acknowledged", offer)
        got = cpu.measure("throughput: then until the subscriber has all", drain)
        skipped = conn.result("ping", {}, timeout_s=5)["relay_skipped"] - skipped
    finally:
        conn.close()
    spent = {k: sum(used[k] for _, _, used in cpu.phases[-2:]) for k in CpuMeter.PARTS}
    into = emitted / (acked_at - started)
    out = got / (sub.received[-1][0] - started)
    print(f"event throughput, {emitted} events offered at {rate:g}/s, {burst} per node frame:")
    print(f"  into the coordinator (all acknowledged)      {into:10.0f} events/s")
    other = sub.kinds - kinds_before - Counter(state=emitted)
    label = f"out to one subscriber ({got} received)"
    print(f"  {label:<45}{out:10.0f} events/s")
    print(f"  the coordinator skipped {skipped} event(s): the subscriber fell behind its "
          "buffer")
    if other:
        print("  received besides the offered state changes: "
              + ", ".join(f"{n} {kind}" for kind, n in other.most_common()))
    print("  CPU per event (both parts), us: " + ", ".join(
        f"{k} {1e6 * spent[k] / emitted:.1f}" for k in CpuMeter.PARTS))
    return goal(">= 20,000 events/s in and out, every event received",
                min(into, out) >= 20_000 and got == emitted)


def end_to_end(coord: CoordinatorProcess, sub: Subscriber, kills: int, keep: bool) -> bool:
    lat = []
    with Fleet("fleet-e2e", engines(1), probe=PROBE, restart=RESTART,
               top={"coordinator": coord.endpoint}, keep=keep) as fleet:
        with step("a real node daemon, its engine healthy"):
            fleet.wait_all_healthy(120)
        for _ in range(kills):
            engine = fleet.wait_all_healthy(120)["e0"]
            killed_at = time.time()
            os.kill(engine["pid"], signal.SIGKILL)
            match = {"node_id": "test-node", "engine": "e0", "to": "stopping",
                     "incarnation": engine["incarnation"]}
            seen = wait_for(partial(sub.find, killed_at, **match), 10,
                            "the kill at the subscriber")
            lat.append(1000 * (seen - killed_at))
    print("end to end, SIGKILL of a real engine -> the subscriber has the event:")
    s = summary("kill -> client", lat, "ms", 2)
    return goal("median <= 50 ms", s.median <= 50)


def restart(coord: CoordinatorProcess, bind: str, tmp: Path, cpu: CpuMeter, nodes: int,
            engines: int) -> tuple[bool, CoordinatorProcess]:
    """SIGKILL, a new process on the same port; from its start (Python start-up included)
    until the fleet view is whole again."""
    coord.kill()
    new = start_coordinator_process(bind, log_path=tmp / "coordinator.log", ready_timeout_s=30)
    cpu.attach(new.proc.pid)
    started = psutil.Process(new.proc.pid).create_time()
    reach, listed = fleet_ready(new, nodes, engines, 60)
    cpu.sample()
    print("convergence after a coordinator restart (SIGKILL, new process, same port):")
    print(f"  from the new process's start: every node reachable {reach - started:.2f} s, "
          f"every engine listed {listed - started:.2f} s")
    return goal("every engine listed <= 5 s", listed - started <= 5), new


if __name__ == "__main__":
    bench_main(main, parse_args(__doc__ or "", repeat=40, quick_repeat=3, time_limit=1800,
                                extra=options))
