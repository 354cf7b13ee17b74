"""`KeyedFleetClient`: a CURVE client built from key bytes, whose pickle carries the keys (not
paths that exist on one machine only), as Ray hands clients to actors on other nodes."""

from __future__ import annotations

import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import zmq

from rollout_watchdog import Coordinator, CoordinatorUnavailable
from rollout_watchdog.common.keys import ClientKeys, keygen
from rollout_watchdog.emulator.testing import wait_until
from rollout_watchdog.refit_bridge.keyed_client import KeyedFleetClient

# A process of its own, with no key file: it unpickles the client from stdin and pings.
CHILD = """
import pickle, sys
client = pickle.loads(sys.stdin.buffer.read())
print(client.call("ping")[1]["coordinator"])
"""


def keys(tmp_path: Path) -> ClientKeys:
    """The coordinator's keypair in keys/, a client's in made/ (not yet authorized)."""
    keygen(tmp_path / "keys", "coordinator")
    (tmp_path / "keys" / "authorized").mkdir()
    keygen(tmp_path / "made", "client")
    return ClientKeys.load(tmp_path / "made" / "client.key_secret",
                           tmp_path / "keys" / "coordinator.key")


def test_the_pickle_carries_the_keys_and_works_without_the_key_files(tmp_path: Path) -> None:
    client_keys = keys(tmp_path)
    (tmp_path / "keys" / "authorized" / "client.key").write_bytes(
        (tmp_path / "made" / "client.key").read_bytes())
    with Coordinator(bind="tcp://127.0.0.1:0", keys=str(tmp_path / "keys")) as coordinator:
        client = KeyedFleetClient(coordinator.endpoint, client_keys, timeout_s=10.0)
        data = pickle.dumps(client)
        assert str(tmp_path).encode() not in data   # no path, the keys themselves
        for made in (tmp_path / "made").iterdir():
            made.unlink()
        copy = pickle.loads(data)
        assert isinstance(copy, KeyedFleetClient) and copy.key is None
        assert copy.call("ping")[1]["coordinator"] == coordinator.boot
        done = subprocess.run([sys.executable, "-c", CHILD], input=data, capture_output=True,
                              timeout=60)
        assert done.stdout.decode().strip() == coordinator.boot, done.stderr.decode()[-2000:]
        client.close()
        copy.close()


def test_a_key_not_authorized_hears_nothing(tmp_path: Path) -> None:
    client_keys = keys(tmp_path)
    with Coordinator(bind="tcp://127.0.0.1:0", keys=str(tmp_path / "keys")) as coordinator:
        client = pickle.loads(pickle.dumps(KeyedFleetClient(coordinator.endpoint, client_keys,
                                                            timeout_s=2.0)))
        with pytest.raises(CoordinatorUnavailable, match="CURVE handshake failed"):
            client.call("ping")
        client.close()


def test_a_call_after_libzmq_closed_a_refused_connection_waits_and_names_curve(
        tmp_path: Path) -> None:
    """Once a refused CURVE handshake has closed the DEALER's connection, libzmq takes no
    message until it reconnects: the call's send raised EAGAIN, reported as "the connection
    failed: Resource temporarily unavailable" at once (seen under load). Now the call waits
    for a connection within its timeout, and says what failed."""
    client_keys = keys(tmp_path)
    with Coordinator(bind="tcp://127.0.0.1:0", keys=str(tmp_path / "keys")) as coordinator:
        client = KeyedFleetClient(coordinator.endpoint, client_keys, timeout_s=1.0)
        conn = client._connection()

        def closed() -> bool:   # (a frame taken now goes nowhere: the handshake fails)
            try:
                conn.sock.send(b"", zmq.NOBLOCK)
            except zmq.Again:
                return True
            return False
        wait_until(closed, 10, what="libzmq to close the refused connection")
        with pytest.raises(CoordinatorUnavailable, match="CURVE handshake failed"):
            client.call("ping")
        client.close()
