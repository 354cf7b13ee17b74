"""The control socket against hostile users, with a real daemon: a connection flood at a low fd
limit (libzmq aborts the process when its ipc listener meets EMFILE), and a user who may not
connect at all."""

from __future__ import annotations

import json
import os
import resource
import signal
import socket
import stat
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest
import zmq
from daemon_harness import EngineSpec, Node, fd_limit, wait_for

from rollout_watchdog.cli.client import ControlClient, ControlError
from rollout_watchdog.emulator.testing import wait_until
from rollout_watchdog.watchdog.containment import read_marker
from rollout_watchdog.watchdog.control import FD_SHARE, REOPEN_AFTER_S, ControlServer

MakeNode = Callable[..., Node]
DAEMON_FD_LIMIT = 512
RAW_CONNECTIONS = 1100
ZMQ_CONNECTIONS = 300
NOBODY = 65534


def start_with_fd_limit(node: Node, limit: int) -> Node:
    """`Node.start`, with the daemon's soft and hard RLIMIT_NOFILE at `limit` (the daemon may
    raise its soft limit to the hard one, so both are set)."""
    return node.start(wrap=fd_limit(limit))


@pytest.fixture
def many_fds() -> Iterator[None]:
    """This process opens about 2,000 sockets for the flood."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = RAW_CONNECTIONS + 3 * ZMQ_CONNECTIONS + 500
    if hard != resource.RLIM_INFINITY and hard < need:
        pytest.skip(f"the flood needs {need} open files; the hard limit here is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, need), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def raw_flood(path: str, count: int) -> list[socket.socket]:
    """`count` plain AF_UNIX connects that never speak ZMTP; the refused ones are closed."""
    opened = []
    for _ in range(count):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(0.5)
        try:
            sock.connect(path)
        except OSError:  # the endpoint is closed (no file) or its backlog is full
            sock.close()
        else:
            opened.append(sock)
    return opened


def test_a_connection_flood_neither_kills_nor_blinds_the_daemon(
        make_node: MakeNode, many_fds: None) -> None:
    """1,100 raw connections and 300 ZMQ clients at a limit of 512 files: before the bound,
    libzmq aborted the daemon ("Too many open files", ipc_listener.cpp). Now the daemon stays
    up, supervises through the flood, and answers once it ends."""
    node = start_with_fd_limit(make_node([EngineSpec("e0")]), DAEMON_FD_LIMIT)
    assert node.proc is not None
    first = node.wait_state("e0", "healthy")
    path = node.control[len("ipc://"):]
    daemon = psutil.Process(node.proc.pid)
    assert daemon.rlimit(psutil.RLIMIT_NOFILE) == (DAEMON_FD_LIMIT, DAEMON_FD_LIMIT)

    ctx = zmq.Context()
    raw: list[socket.socket] = []
    try:
        raw = raw_flood(path, RAW_CONNECTIONS)
        assert len(raw) >= DAEMON_FD_LIMIT // FD_SHARE  # the flood reached the bound
        for n in range(ZMQ_CONNECTIONS):  # clients that never read; they reconnect when cut
            dealer = ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(node.control)
            dealer.send(b'{"v": 1, "id": %d, "cmd": "status"}' % n)
        os.kill(first["pid"], signal.SIGKILL)
        # the engine's death is seen and it is relaunched while the flood goes on
        # (the daemon's children also include what re-parented to it, the subreaper: the
        # relaunch is the child that carries the second incarnation's marker)
        wait_for(lambda: any("/e0/2/" in (read_marker(p.pid) or "") for p in daemon.children()),
                 30, "the relaunch of e0 during the flood")
        raw += raw_flood(path, RAW_CONNECTIONS - len(raw))
        assert node.proc.poll() is None
        flood_ended = time.time()
    finally:
        for sock in raw:
            sock.close()
        ctx.destroy(linger=0)

    again = wait_for(lambda: node.engine("e0"), REOPEN_AFTER_S + 15,
                     "the daemon to answer after the flood")
    assert again["incarnation"] == 2 and again["last_failure"]["cause"] == "exited"
    down = node.wait_event("e0", kind="state", to="stopping")
    assert down["cause"] == "exited" and down["ts"] < flood_ended
    node.wait_state("e0", "healthy", incarnation=2)
    # the daemon's log lines are written by a thread of their own: wait for them
    wait_for(lambda: all(line in node.log_text() for line in (
        "reached the bound", "accepting connections again")), 15, "the flood's two log lines")
    assert "Too many open files" not in node.log_text()
    assert node.proc.poll() is None  # it never exited
    assert node.stop_daemon() == 0


def test_a_user_who_may_not_connect_is_told_permission_denied(tmp_path: Path) -> None:
    """EACCES on the socket is not "no daemon": a listener whose socket this user may not
    use (mode 000; as root, the client runs as nobody)."""
    path = tmp_path / "control"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen()
    os.chmod(path, 0)
    os.chmod(tmp_path, 0o755)
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child reports through the pipe
        try:
            os.close(read_end)
            if os.geteuid() == 0:
                os.setgid(NOBODY)
                os.setuid(NOBODY)
            try:
                ControlClient(f"ipc://{path}", timeout_s=1.0).call("status")
                message = "no error"
            except ControlError as exc:
                message = str(exc)
            os.write(write_end, message.encode())
        finally:
            os._exit(0)
    os.close(write_end)
    try:
        with os.fdopen(read_end, "rb") as reader:
            message = reader.read().decode()
        os.waitpid(child, 0)
    finally:
        listener.close()
    assert message.startswith(f"permission denied on ipc://{path}"), message
    assert "no daemon" not in message


def test_at_the_bound_the_endpoint_closes_and_reopens_private(tmp_path: Path) -> None:
    """The bound, in-process: its connections are dropped, no new one can start, and the
    socket comes back 0600 and answering after `REOPEN_AFTER_S`."""
    endpoint = f"ipc://{tmp_path}/control"
    path = str(tmp_path / "control")
    server = ControlServer(zmq.Context.instance(), endpoint, lambda cmd, args: {"cmd": cmd},
                           lambda why: None, max_connections=4)
    raw: list[socket.socket] = []
    try:
        raw = raw_flood(path, 4)
        assert len(raw) == 4

        def closed() -> bool:
            server.count_connections()
            return not server.bound

        wait_until(closed, 5, 0.01, "the server to stop accepting")
        assert not os.path.exists(path)
        raw[0].settimeout(5)
        assert raw[0].recv(64) and raw[0].recv(64) == b""  # a greeting, then closed
        server.tick(100.0)
        assert server.next_deadline() == 100.0 + REOPEN_AFTER_S
        server.tick(100.0 + REOPEN_AFTER_S)
        assert server.bound and stat.S_IMODE(os.stat(path).st_mode) == 0o600
        client: zmq.SyncSocket = zmq.Context.instance().socket(zmq.DEALER)
        client.setsockopt(zmq.LINGER, 0)
        client.connect(endpoint)
        client.send(b'{"v": 1, "id": 1, "cmd": "ping"}')
        deadline = time.monotonic() + 5
        while not client.poll(10) and time.monotonic() < deadline:
            server.handle(server.pollables())
            server.after_save()
        assert json.loads(client.recv())["result"] == {"cmd": "ping"}
        client.close()
    finally:
        for sock in raw:
            sock.close()
        server.close()
