"""`free_port`: a TCP port for a server started a moment later (the demos, the benchmarks, the
tests and each Ray node's metrics port pick theirs here)."""

from __future__ import annotations

import os
import random
import socket

_handed_out: set[int] = set()
_pick = random.Random()
LOWEST_PORT = 10_000
# Ports that engines and trainers take by default, never handed out: torch.distributed's
# MASTER_PORT (29500), SGLang's server (30000, and the 30000 + i of one per GPU) and the
# ports it derives from its own. A Ray node's metrics port picked there would make a later
# engine's launch refused (or a trainer's rendezvous fail).
ENGINE_PORTS = (range(29_500, 29_600), range(30_000, 31_000))


def _ephemeral_start() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768   # Linux's default


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def _port_range() -> tuple[int, int]:
    """The ports this process picks from: below the ephemeral range, and under pytest-xdist a
    slice of its own per worker (two workers never hand out the same port)."""
    low, top = LOWEST_PORT, _ephemeral_start() - 1
    worker = os.environ.get("PYTEST_XDIST_WORKER", "").removeprefix("gw")
    count = os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if worker.isdigit() and count.isdigit() and int(count) > 1 and top > low:
        width = (top - low + 1) // int(count)
        low += width * int(worker)
        top = low + width - 1
    return low, top


def _engine_port(port: int) -> bool:
    return any(port in band for band in ENGINE_PORTS)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free now, for a server started a moment later: never one this process
    handed out before, and below the kernel's ephemeral range where it can (that is where
    bind(0) and every outgoing connection take theirs, so one of them could take it meanwhile),
    and none of ENGINE_PORTS."""
    low, top = _port_range()
    for _ in range(200 if top > low else 0):
        port = _pick.randint(low, top)
        if port not in _handed_out and not _engine_port(port) and _bindable(host, port):
            _handed_out.add(port)
            return port
    for _ in range(1000):   # no room below the ephemeral range: let the kernel choose
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
            port = int(sock.getsockname()[1])
        if port not in _handed_out:
            _handed_out.add(port)
            return port
    raise RuntimeError(f"no free port found on {host}")
