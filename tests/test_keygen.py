"""`rollout-watchdog keygen DIR NAME`: CURVE keypairs in pyzmq's certificate format, usable as
they are for an authenticated, encrypted ZMQ link."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator


def keygen(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "rollout_watchdog", "keygen", *args],
                          capture_output=True, text=True, timeout=30)


def mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_keys_are_written_private_and_never_overwritten(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    done = keygen(str(keys), "gpu-node-17")
    assert done.returncode == 0, done.stderr
    public, secret = keys / "gpu-node-17.key", keys / "gpu-node-17.key_secret"
    assert (mode(keys), mode(public), mode(secret)) == (0o700, 0o644, 0o600)
    pub, sec = zmq.auth.load_certificate(secret)
    assert sec is not None and zmq.auth.load_certificate(public) == (pub, None)
    before = secret.read_bytes()
    again = keygen(str(keys), "gpu-node-17")
    assert again.returncode == 1 and "not overwritten" in again.stderr
    assert secret.read_bytes() == before


@pytest.mark.parametrize("name", ["", "../x", "a/b", "e0\n", "--all"])
def test_a_bad_name_is_refused(tmp_path: Path, name: str) -> None:
    done = keygen(str(tmp_path), name)
    assert done.returncode != 0
    assert "key name" in done.stderr or "usage:" in done.stderr  # "--all" reads as an option
    assert list(tmp_path.iterdir()) == []


def test_the_keys_authenticate_a_curve_link_and_a_stranger_gets_nothing(tmp_path: Path) -> None:
    """What the coordinator will do: a ZAP authenticator with an allowlist of public keys. The
    allowed client's message arrives; a client with keys of its own that are not on the list
    gets nothing through."""
    for name in ("coordinator", "node", "stranger"):
        assert keygen(str(tmp_path), name).returncode == 0
    allowed = tmp_path / "authorized"
    allowed.mkdir()
    (allowed / "node.key").write_bytes((tmp_path / "node.key").read_bytes())
    ctx = zmq.Context()
    auth = ThreadAuthenticator(ctx)
    auth.start()
    try:
        auth.configure_curve(domain="*", location=str(allowed))
        server_pub, server_sec = zmq.auth.load_certificate(tmp_path / "coordinator.key_secret")
        server = ctx.socket(zmq.ROUTER)
        server.curve_secretkey, server.curve_publickey = server_sec, server_pub
        server.curve_server = True
        port = server.bind_to_random_port("tcp://127.0.0.1")

        def client(name: str) -> zmq.Socket[bytes]:
            pub, sec = zmq.auth.load_certificate(tmp_path / f"{name}.key_secret")
            sock = ctx.socket(zmq.DEALER)
            sock.curve_secretkey, sock.curve_publickey = sec, pub
            sock.curve_serverkey = server_pub
            sock.linger = 0
            sock.connect(f"tcp://127.0.0.1:{port}")
            return sock

        stranger = client("stranger")
        stranger.send(b"from the stranger")
        node = client("node")
        node.send(b"from the node")
        assert server.poll(10_000)
        assert server.recv_multipart()[-1] == b"from the node"
        assert not server.poll(500)  # the stranger's message never arrives
        for sock in (node, stranger, server):
            sock.close()
    finally:
        auth.stop()
        ctx.term()
