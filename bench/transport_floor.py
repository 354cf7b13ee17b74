"""The transport's own cost of a fleet-wide pause: what a coordinator pays before any of its
Python runs (issue 13).

A bare pyzmq ROUTER (this process) and --nodes DEALERs (one other process, over loopback TCP),
set up as the hub and the nodes' links are, exchange a fleet-wide pause's messages and nothing
else: a command to every node, then from each its run (--run-bytes: a 1.5 run of 8 `paused`
events is ~400 bytes) and its reply (--reply-bytes), received with the hub's calls (`recv`,
`get(RCVMORE)`), no JSON. Printed: the ROUTER process's CPU per round, its main thread's and the
rest (libzmq's I/O thread: syscalls, loopback TCP, wake-ups). Variants, each measured in the same
run: `one message` (the run and the reply as one two-part message, a "turn"), and `with an ACK`
(an ACK frame back to each node, as a 1.4 coordinator sent at once). bench/fleet_scale.py's
"CPU per pause" of the real coordinator is this floor plus its Python.

    python bench/transport_floor.py [--nodes 1000] [--rounds 20]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import resource
import statistics
import time
from multiprocessing.synchronize import Event as EventType

import zmq

_NOBLOCK, _SNDMORE, _RCVMORE = int(zmq.NOBLOCK), int(zmq.SNDMORE), int(zmq.RCVMORE)
MODES = {"two messages": ("two", False), "one message (a turn)": ("one", False),
         "two messages, with an ACK": ("two", True)}


def _raise_fd_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def nodes_main(endpoint: str, nodes: int, run: bytes, reply: bytes, ready: EventType) -> None:
    """The DEALERs: each answers a command with a run and a reply, as its mode says."""
    _raise_fd_limit()
    ctx = zmq.Context()
    ctx.max_sockets = nodes + 64
    socks = []
    for i in range(nodes):
        sock = ctx.socket(zmq.DEALER)
        sock.linger, sock.routing_id = 0, b"n%d" % i
        sock.connect(endpoint)
        socks.append(sock)
    for sock in socks:
        sock.send(b"hello")
    ready.set()
    poller = zmq.Poller()
    for sock in socks:
        poller.register(sock, zmq.POLLIN)
    while True:
        for sock, _ in poller.poll(1000):
            command = sock.recv()
            if command == b"stop":
                ctx.destroy(0)
                return
            if command == b"one":
                sock.send(run, _SNDMORE)
                sock.send(reply)
            elif command == b"two":
                sock.send(run)
                sock.send(reply)


def measure(router: zmq.Socket[bytes], peers: list[bytes], mode: str, ack: bool,
            rounds: int) -> tuple[float, float, float]:
    """(process CPU, main-thread CPU, wall) in seconds per round."""
    command = mode.encode()
    expected = len(peers) * (1 if mode == "one" else 2)
    cpu, main, wall = time.process_time(), time.thread_time(), time.monotonic()
    for _ in range(rounds):
        for peer in peers:
            router.send(peer, _SNDMORE)
            router.send(command)
        for _ in range(expected):
            router.recv()   # (the peer)
            router.recv()
            while router.get(_RCVMORE):
                router.recv()
        if ack:
            for peer in peers:
                router.send(peer, _SNDMORE)
                router.send(b"ack")
    return ((time.process_time() - cpu) / rounds, (time.thread_time() - main) / rounds,
            (time.monotonic() - wall) / rounds)


def bare_rounds(nodes: int, rounds: int, repeat: int, run_bytes: int = 400,
                reply_bytes: int = 150, modes: tuple[str, ...] = tuple(MODES)
                ) -> dict[str, list[tuple[float, float, float]]]:
    """For each of `modes` (names of MODES), `repeat` runs of `rounds` rounds, alternated:
    (process CPU, main-thread CPU, wall) in seconds per round of each run."""
    _raise_fd_limit()
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.linger = 0
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    ready = mp.get_context("spawn").Event()
    proc = mp.get_context("spawn").Process(
        target=nodes_main, args=(f"tcp://127.0.0.1:{port}", nodes, b"r" * run_bytes,
                                 b"p" * reply_bytes, ready), daemon=True)
    proc.start()
    try:
        peers = [router.recv_multipart()[0] for _ in range(nodes)]
        figures: dict[str, list[tuple[float, float, float]]] = {name: [] for name in modes}
        measure(router, peers, "two", False, 2)   # warm-up
        for _ in range(repeat):
            for name in modes:
                mode, ack = MODES[name]
                figures[name].append(measure(router, peers, mode, ack, rounds))
        for peer in peers:   # the nodes' process ends at the first: the later peers may be
            try:             # gone already (ROUTER_MANDATORY: EHOSTUNREACH), which is the aim
                router.send(peer, _SNDMORE)
                router.send(b"stop")
            except zmq.ZMQError:
                break
        return figures
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
        ctx.destroy(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--repeat", type=int, default=3, help="runs of each variant, alternated")
    parser.add_argument("--run-bytes", type=int, default=400)
    parser.add_argument("--reply-bytes", type=int, default=150)
    args = parser.parse_args()
    figures = bare_rounds(args.nodes, args.rounds, args.repeat, args.run_bytes,
                          args.reply_bytes)
    print(f"{args.nodes} DEALERs over loopback TCP, {args.rounds} rounds x {args.repeat} "
          f"runs each; run {args.run_bytes} B, reply {args.reply_bytes} B")
    print("the ROUTER process's CPU per round (a fleet-wide pause's messages, no Python "
          "work), median of the runs:")
    base = statistics.median(c for c, _, _ in figures["two messages"])
    for name, runs in figures.items():
        cpu = statistics.median(c for c, _, _ in runs)
        main_thread = statistics.median(m for _, m, _ in runs)
        wall = statistics.median(w for _, _, w in runs)
        print(f"  {name:<28} {1000 * cpu:6.1f} ms (main thread {1000 * main_thread:5.1f}, "
              f"libzmq's I/O thread {1000 * (cpu - main_thread):5.1f}), wall "
              f"{1000 * wall:6.1f} ms; x{cpu / base:.2f} of two messages")


if __name__ == "__main__":
    main()
