"""A `FleetClient` that holds its CURVE key material instead of key paths.

A pickled `FleetClient` carries paths, which exist on one machine only. Under Ray a client is
handed to actors on every node, so this one carries the keys themselves (z85 text): the client's
keypair and the coordinator's public key. Its pickle holds a secret key: hand it only to the
cluster's own processes (Ray's object store stays inside the cluster).
"""

from __future__ import annotations

from typing import Any

from rollout_watchdog.common.keys import ClientKeys
from rollout_watchdog.refit_bridge.client import FleetClient


class KeyedFleetClient(FleetClient):
    """A `FleetClient` of `address` with CURVE keys given as bytes (z85, as pyzmq's
    certificate files hold them); pickles to the address, the keys and the timeout."""

    def __init__(self, address: str, keys: ClientKeys, timeout_s: float = 5.0) -> None:
        super().__init__(address, timeout_s=timeout_s)
        self._curve = keys

    def __repr__(self) -> str:
        return f"KeyedFleetClient({self.address!r}, curve=True)"

    def __getstate__(self) -> dict[str, Any]:
        keys = self._curve
        assert keys is not None
        return {"address": self.address, "timeout_s": self.timeout_s,
                "keys": [keys.public.decode(), keys.secret.decode(), keys.server.decode()]}

    def __setstate__(self, state: dict[str, Any]) -> None:
        public, secret, server = (str(k).encode() for k in state["keys"])
        self.__init__(state["address"], ClientKeys(public, secret, server),  # type: ignore[misc]
                      state["timeout_s"])
