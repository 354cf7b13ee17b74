"""The fleet test harness itself: the TCP relay holds bytes while paused and resets connections
when cut; a node daemon started by the harness dials its coordinator (here a bare ROUTER)
through the relay and says HELLO again after a cut; a coordinator process answers ping."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
from daemon_harness import Node, wait_for
from fleet_harness import TcpRelay, start_coordinator_process, start_node_process

from rollout_watchdog.common import protocol
from rollout_watchdog.emulator.testing import free_port


@pytest.fixture
def echo_port() -> Iterator[int]:
    """A TCP echo server on loopback (one thread per connection, each ends with its peer)."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)
    stop = threading.Event()

    def serve(conn: socket.socket) -> None:
        with conn:
            try:
                while data := conn.recv(65536):
                    conn.sendall(data)
            except OSError:
                return

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield server.getsockname()[1]
    stop.set()
    thread.join(5)
    server.close()


def recv_exactly(conn: socket.socket, n: int, timeout: float) -> bytes:
    conn.settimeout(timeout)
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    return data


def test_relay_forwards_holds_while_paused_and_resets_when_cut(echo_port: int) -> None:
    with TcpRelay(target=("127.0.0.1", echo_port)) as relay:
        conn = socket.create_connection(("127.0.0.1", relay.port), timeout=5)
        conn.sendall(b"hello")
        assert recv_exactly(conn, 5, 5) == b"hello"
        relay.pause()
        conn.sendall(b"during the blip")
        conn.settimeout(0.5)
        with pytest.raises(TimeoutError):  # held, not lost, and the connection stays open
            conn.recv(100)
        assert relay.connections == 1
        relay.resume()
        assert recv_exactly(conn, 15, 5) == b"during the blip"
        big = bytes(range(256)) * 8192  # 2 MiB: more than the relay buffers per direction
        threading.Thread(target=conn.sendall, args=(big,), daemon=True).start()
        assert recv_exactly(conn, len(big), 10) == big
        relay.cut()
        conn.settimeout(5)
        with pytest.raises((ConnectionResetError, ConnectionError)):
            if not conn.recv(100):
                raise ConnectionError("closed")
        conn.close()
        assert relay.connections == 0 and relay.accepted == 1
        again = socket.create_connection(("127.0.0.1", relay.port), timeout=5)
        again.sendall(b"back")
        assert recv_exactly(again, 4, 5) == b"back"
        again.close()


def test_relay_refuses_a_port_out_of_range() -> None:
    with pytest.raises(ValueError, match="target port"):
        TcpRelay(target=("127.0.0.1", 0))


def test_a_node_process_dials_through_the_relay_and_says_hello_again_after_a_cut(
        tmp_path: Path) -> None:
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.linger = 0
    port = router.bind_to_random_port("tcp://127.0.0.1")
    relay = TcpRelay(target=("127.0.0.1", port))
    node: Node | None = None

    def hellos() -> list[protocol.Hello]:
        found = []
        while router.poll(10):
            routing_id, data = router.recv_multipart()
            message = protocol.decode(data)
            if isinstance(message, protocol.Hello):
                assert routing_id == b"n7" and message.node_id == "n7"
                found.append(message)
        return found

    try:
        node = start_node_process("n7", relay.endpoint, tmp_path, engines=2)
        first = wait_for(hellos, 20, "a HELLO through the relay")[0]
        assert [e["id"] for e in first.engines] == ["e0", "e1"]
        assert node.status()["node_id"] == "n7"
        relay.cut()
        again = wait_for(hellos, 20, "a HELLO after the cut")[0]
        assert again.boot == first.boot and relay.accepted >= 2
    finally:
        if node is not None:
            node.cleanup()
        relay.close()
        router.close(linger=0)
        ctx.term()


def test_a_coordinator_process_answers_ping_and_is_gone_after_a_kill(tmp_path: Path) -> None:
    pytest.importorskip("rollout_watchdog.refit_bridge.coordinator",
                        reason="the coordinator has not landed on this branch yet")
    bind = f"tcp://127.0.0.1:{free_port()}"
    coordinator = start_coordinator_process(bind, log_path=tmp_path / "coordinator.log")
    try:
        assert coordinator.call("ping").result["nodes"] == 0
        coordinator.kill()
        with pytest.raises(TimeoutError):
            coordinator.call("ping", timeout_s=0.5)
    finally:
        coordinator.cleanup()
