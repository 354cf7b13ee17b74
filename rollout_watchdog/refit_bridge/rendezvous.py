"""Where the engines reach the trainer's rendezvous (the weight-update group's TCPStore).

DESIGN.md: the trainer's address toward the coordinator. With a coordinator embedded in the
trainer (a loopback endpoint) while the engines are on other hosts, that would be loopback:
then the address toward the engines.
"""

from __future__ import annotations

import socket
from urllib.parse import urlparse

LOOPBACK = ("localhost", "127.0.0.1", "::1", "*", "0.0.0.0")


def address_toward(endpoint: str) -> str:
    """This host's address on the route to `endpoint`'s host (a tcp:// or http:// URL)."""
    host = urlparse(endpoint.replace("tcp://", "http://", 1)).hostname or "127.0.0.1"
    if host in LOOPBACK:
        return "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, 9))   # no packet is sent: this only picks the route
            return str(probe.getsockname()[0])
    except OSError:
        return socket.gethostbyname(socket.gethostname())


def master_address_for(coordinator: str, engine_urls: list[str]) -> str:
    """Where engines reach the trainer's rendezvous: this host's address toward the
    coordinator (DESIGN.md), unless that is loopback while an engine is on another host (a
    coordinator embedded in the trainer, engines elsewhere): then the address toward it."""
    toward = address_toward(coordinator)
    if toward != "127.0.0.1":
        return toward
    remote = [u for u in engine_urls if (urlparse(u).hostname or "127.0.0.1") not in LOOPBACK]
    return address_toward(remote[0]) if remote else toward


def free_port(address: str) -> int:
    """A free TCP port on `address` (the group's rendezvous); ValueError naming the address
    when it is not one of this machine's (or does not resolve): the TCPStore listens there."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET) as probe:
            probe.bind((address, 0))
            port: int = probe.getsockname()[1]
            return port
    except OSError as exc:
        raise ValueError(f"master_address {address!r} is not an address of this machine "
                         f"(the trainer's rendezvous listens there): {exc}") from None


__all__ = ["address_toward", "free_port", "master_address_for"]
