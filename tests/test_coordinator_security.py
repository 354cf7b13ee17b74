"""The coordinator's guard rails, checked without binding anything: an open bind needs keys or
an explicit --insecure, and a keys directory that lacks a part is named before anything
starts."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
import zmq.auth
import zmq.utils.z85

from rollout_watchdog.agent.security import (
    NamedKeyAuthenticator,
    check_bind,
    curve_server,
    is_local_endpoint,
)
from rollout_watchdog.common.keys import keygen

OPEN = ["tcp://0.0.0.0:5555", "tcp://*:5555", "tcp://coordinator.example.com:5555",
        "tcp://eth0:5555", "tcp://[::]:5555", "tcp://10.1.2.3:5555"]
LOCAL = ["tcp://127.0.0.1:5555", "tcp://127.0.0.1:0", "tcp://[::1]:5555", "tcp://localhost:5555",
         "ipc:///tmp/rollout-watchdog.sock", "inproc://coordinator"]


@pytest.mark.parametrize("bind", OPEN)
def test_an_open_bind_without_keys_is_refused_with_the_way_out(bind: str) -> None:
    assert is_local_endpoint(bind) is False
    with pytest.raises(ValueError) as refused:
        check_bind(bind, None, insecure=False)
    message = str(refused.value)
    assert bind in message and "--keys" in message and "--insecure" in message


@pytest.mark.parametrize("bind", LOCAL)
def test_a_local_bind_needs_no_keys(bind: str) -> None:
    assert is_local_endpoint(bind) is True
    check_bind(bind, None, insecure=False)


@pytest.mark.parametrize("bind", OPEN + LOCAL)
def test_with_keys_or_insecure_any_endpoint_may_be_bound(bind: str) -> None:
    check_bind(bind, "/etc/rollout-watchdog/keys", insecure=False)
    check_bind(bind, None, insecure=True)


@pytest.mark.parametrize("bind", ["127.0.0.1:5555", "0.0.0.0"])
def test_a_bind_that_is_not_an_endpoint_is_named(bind: str) -> None:
    with pytest.raises(ValueError, match="not a ZMQ endpoint"):
        check_bind(bind, None, insecure=True)


def test_a_malformed_ipv6_bind_is_named_in_the_error() -> None:
    with pytest.raises(ValueError, match=r"tcp://\[::1:5555"):
        check_bind("tcp://[::1:5555", None, insecure=False)


# ---------------------------------------------------------------------- keys directory


@pytest.fixture
def sock() -> Iterator[tuple[zmq.Context[zmq.Socket[bytes]], zmq.Socket[bytes]]]:
    """A ROUTER that is never bound: curve_server only configures it."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    yield ctx, router
    router.close(linger=0)
    ctx.term()


def test_a_missing_coordinator_keypair_is_named(
        tmp_path: Path, sock: tuple[zmq.Context[zmq.Socket[bytes]], zmq.Socket[bytes]]) -> None:
    (tmp_path / "authorized").mkdir()
    with pytest.raises(ValueError) as refused:
        curve_server(*sock, str(tmp_path))
    message = str(refused.value)
    assert str(tmp_path / "coordinator.key_secret") in message and "keygen" in message


def test_a_missing_authorized_directory_is_named(
        tmp_path: Path, sock: tuple[zmq.Context[zmq.Socket[bytes]], zmq.Socket[bytes]]) -> None:
    keygen(tmp_path, "coordinator")
    with pytest.raises(ValueError) as refused:
        curve_server(*sock, str(tmp_path))
    assert str(tmp_path / "authorized") in str(refused.value)


def test_a_public_key_in_place_of_the_keypair_is_named(
        tmp_path: Path, sock: tuple[zmq.Context[zmq.Socket[bytes]], zmq.Socket[bytes]]) -> None:
    public, _ = keygen(tmp_path / "made", "coordinator")
    (tmp_path / "authorized").mkdir()
    (tmp_path / "coordinator.key_secret").write_bytes(public.read_bytes())
    with pytest.raises(ValueError, match="holds no secret key"):
        curve_server(*sock, str(tmp_path))


def test_admitted_peers_are_named_by_their_key_files(
        tmp_path: Path, sock: tuple[zmq.Context[zmq.Socket[bytes]], zmq.Socket[bytes]]) -> None:
    """A node can only announce itself under its own key's name: the name comes from here."""
    authorized = tmp_path / "authorized"
    keygen(authorized, "node-a")
    stranger, _ = keygen(tmp_path / "elsewhere", "node-b")
    auth = NamedKeyAuthenticator(sock[0], authorized)
    node_a, _ = zmq.auth.load_certificate(authorized / "node-a.key")
    node_b, _ = zmq.auth.load_certificate(stranger)
    assert auth.curve_user_id(zmq.utils.z85.decode(node_a)) == "node-a"
    assert auth.curve_user_id(zmq.utils.z85.decode(node_b)) == ""
