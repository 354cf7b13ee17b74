"""sd_notify against a real AF_UNIX datagram socket standing in for systemd."""

from __future__ import annotations

import logging
import os
import socket
import tempfile
import uuid
from collections.abc import Iterator

import pytest

from rollout_watchdog.watchdog.sdnotify import SystemdNotifier


def _receiver(address: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(address)
    sock.settimeout(5.0)  # a deadline, not a sleep: recv returns as soon as a datagram arrives
    return sock


@pytest.fixture
def fs_socket() -> Iterator[tuple[str, socket.socket]]:
    # A short directory: pytest's tmp_path can exceed the 108-byte limit of AF_UNIX paths.
    with tempfile.TemporaryDirectory(prefix="rw-") as tmp:
        path = os.path.join(tmp, "notify")
        sock = _receiver(path)
        yield path, sock
        sock.close()


@pytest.fixture
def abstract_socket() -> Iterator[tuple[str, socket.socket]]:
    name = f"rollout-watchdog-test-{uuid.uuid4().hex}"
    sock = _receiver("\0" + name)
    yield "@" + name, sock
    sock.close()


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
        monkeypatch.delenv(var, raising=False)


@pytest.mark.parametrize("kind", ["fs_socket", "abstract_socket"])
def test_messages_arrive_verbatim(kind: str, request: pytest.FixtureRequest) -> None:
    path, sock = request.getfixturevalue(kind)
    notifier = SystemdNotifier(path)
    assert notifier.enabled
    assert notifier.ready()
    assert sock.recv(4096) == b"READY=1"
    assert notifier.status("2/2 engines healthy")
    assert sock.recv(4096) == b"STATUS=2/2 engines healthy"
    assert notifier.watchdog()
    assert sock.recv(4096) == b"WATCHDOG=1"
    assert notifier.stopping()
    assert sock.recv(4096) == b"STOPPING=1"
    assert notifier.notify(READY="1", STATUS="up")
    assert sock.recv(4096) == b"READY=1\nSTATUS=up"
    assert notifier.send("EXTEND_TIMEOUT_USEC=5000000")
    assert sock.recv(4096) == b"EXTEND_TIMEOUT_USEC=5000000"
    assert notifier.errors == 0
    notifier.close()


def test_status_stays_one_line(fs_socket: tuple[str, socket.socket]) -> None:
    path, sock = fs_socket
    SystemdNotifier(path).status("e0 failed:\nexited with code 1")
    assert sock.recv(4096) == b"STATUS=e0 failed: exited with code 1"


def test_default_is_the_environment(
    fs_socket: tuple[str, socket.socket], monkeypatch: pytest.MonkeyPatch
) -> None:
    path, sock = fs_socket
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    assert SystemdNotifier().ready()
    assert sock.recv(4096) == b"READY=1"


@pytest.mark.parametrize("value", [None, ""])
def test_noop_without_socket(value: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    if value is not None:
        monkeypatch.setenv("NOTIFY_SOCKET", value)
    notifier = SystemdNotifier()
    assert not notifier.enabled
    assert not notifier.ready()
    assert not notifier.watchdog()
    assert notifier.errors == 0


def test_gone_socket_does_not_raise(
    fs_socket: tuple[str, socket.socket], caplog: pytest.LogCaptureFixture
) -> None:
    path, sock = fs_socket
    notifier = SystemdNotifier(path)
    assert notifier.ready()
    sock.close()
    os.unlink(path)
    with caplog.at_level(logging.WARNING, logger="rollout_watchdog.watchdog.sdnotify"):
        assert not notifier.watchdog()
        assert not notifier.watchdog()
        assert not notifier.stopping()
    assert notifier.errors == 3
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, "a failing socket is logged once, not at every keep-alive"

    # systemd comes back (same path): sending works again without a new notifier.
    revived = _receiver(path)
    try:
        assert notifier.watchdog()
        assert revived.recv(4096) == b"WATCHDOG=1"
    finally:
        revived.close()


def test_unbound_abstract_socket_does_not_raise() -> None:
    notifier = SystemdNotifier(f"@rollout-watchdog-test-nobody-{uuid.uuid4().hex}")
    assert not notifier.ready()
    assert notifier.errors == 1


def test_full_socket_does_not_block(fs_socket: tuple[str, socket.socket]) -> None:
    """Nobody reads the socket: once its queue is full, sends fail at once instead of blocking."""
    path, _sock = fs_socket
    notifier = SystemdNotifier(path)
    sent = 0
    while notifier.watchdog():
        sent += 1
        assert sent < 1_000_000, "the receive queue never filled up"
    assert notifier.errors == 1


def test_watchdog_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    notifier = SystemdNotifier("")
    assert notifier.watchdog_interval_s() is None
    monkeypatch.setenv("WATCHDOG_USEC", "30000000")
    assert notifier.watchdog_interval_s() == 15.0
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    assert notifier.watchdog_interval_s() == 15.0
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid() + 1))
    assert notifier.watchdog_interval_s() is None, "inherited from another process"
    monkeypatch.delenv("WATCHDOG_PID")
    for bad in ("0", "-5", "soon"):
        monkeypatch.setenv("WATCHDOG_USEC", bad)
        assert notifier.watchdog_interval_s() is None
