"""Tearing down a gloo group's sockets from another thread: the only thing that frees it.

Measured with torch 2.13 (CPU, gloo): a rank-0 broadcast whose peer is alive but never joins
waits out the whole group timeout; ``ProcessGroup.abort()``, ``shutdown()`` and the backend's
``abort()`` return at once and free nothing. ``shutdown(SHUT_RDWR)`` of the group's connected
sockets makes gloo fail the pending work within milliseconds ("Connection closed by peer"), on
both sides. The same frees a rank 0 stuck in the rendezvous (its TCPStore connections).
Listening sockets are left alone: gloo aborts the whole process when its listener fails.

The group's sockets are found as the ones this process opened since a snapshot taken before
the group was built (Linux ``/proc``; elsewhere nothing is torn down), TCP only, minus
listeners and minus the sockets the caller says are not the group's (its own HTTP calls); and
while it is being built, only those to or from its rendezvous port (the TCPStore's), never
what another thread of the trainer opened meanwhile.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

_FD_DIR = Path("/proc/self/fd")
_TCP_TABLES = (Path("/proc/self/net/tcp"), Path("/proc/self/net/tcp6"))
_LISTEN = "0A"


def socket_inodes() -> dict[int, int]:
    """fd -> socket inode for every socket this process has open ({} without /proc)."""
    found: dict[int, int] = {}
    try:
        fds = os.listdir(_FD_DIR)
    except OSError:
        return found
    for fd in fds:
        try:
            target = os.readlink(_FD_DIR / fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            found[int(fd)] = int(target[8:-1])
    return found


def connected_tcp_inodes(port: int | None = None) -> set[int]:
    """Inodes of this network namespace's TCP sockets that are not listening (with `port`:
    only those whose local or remote port it is)."""
    connected: set[int] = set()
    for table in _TCP_TABLES:
        try:
            lines = table.read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and fields[3] != _LISTEN and (
                    port is None or port in (_port_of(fields[1]), _port_of(fields[2]))):
                connected.add(int(fields[9]))
    return connected


def _port_of(address: str) -> int:
    """The port of a /proc/net/tcp address ("0100007F:1F90")."""
    return int(address.rsplit(":", 1)[1], 16)


def inode_of(sock: socket.socket) -> int:
    """The inode that identifies this socket in /proc/self/fd."""
    return os.fstat(sock.fileno()).st_ino


def shutdown_new_sockets(before: set[int], keep: set[int], only: set[int] | None = None
                         ) -> int:
    """Shut down (both directions) every open, non-listening TCP socket whose inode is neither
    in ``before`` nor in ``keep`` (and is in ``only``, if given); returns how many. Never closes
    a descriptor it does not own."""
    wanted = connected_tcp_inodes() - before - keep
    if only is not None:
        wanted &= only
    count = 0
    for fd, inode in socket_inodes().items():
        if inode not in wanted:
            continue
        try:
            dup = os.dup(fd)
        except OSError:
            continue
        try:
            if os.fstat(dup).st_ino != inode:  # the fd was closed and reused meanwhile
                continue
            sock = socket.socket(fileno=dup)
            dup = -1  # owned by sock now
            try:
                sock.shutdown(socket.SHUT_RDWR)
                count += 1
            except OSError:
                pass  # not connected (any more): nothing to free
            finally:
                sock.close()
        finally:
            if dup >= 0:
                os.close(dup)
    return count
