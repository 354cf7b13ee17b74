"""refit_bridge.sockets: which of this process's sockets an abort may shut down. While the group
is built, only its rendezvous's (to or from its port), never another thread's connection."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from rollout_watchdog.refit_bridge import sockets


@pytest.fixture
def pair() -> Iterator[tuple[int, list[socket.socket]]]:
    """A listener's port and its connections: a client and the accepted end."""
    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listener.getsockname())
    accepted, _ = listener.accept()
    try:
        yield listener.getsockname()[1], [client, accepted]
    finally:
        for sock in (client, accepted, listener):
            sock.close()


def test_the_rendezvous_port_selects_its_connections_only(
        pair: tuple[int, list[socket.socket]]) -> None:
    port, ends = pair
    other = socket.create_server(("127.0.0.1", 0))
    stranger = socket.create_connection(other.getsockname())   # another thread's, say
    stranger_end, _ = other.accept()
    try:
        mine = {sockets.inode_of(s) for s in ends}
        theirs = {sockets.inode_of(s) for s in (stranger, stranger_end)}
        assert mine | theirs <= sockets.connected_tcp_inodes()
        selected = sockets.connected_tcp_inodes(port)
        assert mine <= selected and not theirs & selected
        before = set(sockets.socket_inodes().values()) - mine - theirs
        assert sockets.shutdown_new_sockets(before, set(), only=selected) == 2
        assert stranger.send(b"x") == 1                              # left alone
        with pytest.raises(OSError):
            ends[0].send(b"x" * 100_000)                             # shut down
    finally:
        for sock in (stranger, stranger_end, other):
            sock.close()
