"""The coordinator's security: CURVE with a ZAP allowlist (pyzmq's own `zmq.auth`), and the
refusal of an open bind without keys.

Keys directory (DESIGN.md): `DIR/coordinator.key_secret` is the coordinator's keypair and
`DIR/authorized/*.key` the public keys let in, nodes and clients alike. Each admitted peer's
messages carry the name of its key file (the ZAP User-Id), so a node can only announce itself
under its own key's name.
"""

from __future__ import annotations

import ipaddress
import logging
import os
from pathlib import Path
from urllib.parse import urlsplit

import zmq
import zmq.auth
import zmq.utils.z85
from zmq.auth.thread import ThreadAuthenticator

from rollout_watchdog.common.keys import load_keypair

log = logging.getLogger(__name__)
COORDINATOR_KEY = "coordinator.key_secret"
AUTHORIZED = "authorized"


def is_local_endpoint(endpoint: str) -> bool:
    """Only this machine can reach it: ipc, inproc, or tcp on a loopback address."""
    scheme, _, rest = endpoint.partition("://")
    if scheme in ("ipc", "inproc"):
        return True
    if scheme != "tcp":
        return False
    try:
        host = urlsplit(f"//{rest}").hostname or ""
    except ValueError:  # an unbalanced '[': check_bind names the endpoint
        return False
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # '*', an interface or a host name: reachable from elsewhere
        return False


def check_bind(bind: str, keys: str | None, insecure: bool) -> None:
    """ValueError naming the problem: the control plane can kill GPU jobs, so an open bind
    needs keys, or the operator's explicit `--insecure`."""
    if "://" not in bind or (bind.startswith("tcp://") and _unparsable(bind)):
        raise ValueError(f"bind endpoint {bind!r} is not a ZMQ endpoint like tcp://0.0.0.0:5555")
    if keys is None and not insecure and not is_local_endpoint(bind):
        raise ValueError(
            f"refusing to bind {bind} without keys: anyone who reaches it could stop GPU jobs. "
            "Give --keys DIR (see `rollout-watchdog keygen`), bind a loopback address, or say "
            "--insecure")


def _unparsable(endpoint: str) -> bool:
    try:
        urlsplit("//" + endpoint.partition("://")[2])
    except ValueError:
        return True
    return False


class NamedKeyAuthenticator(ThreadAuthenticator):
    """The allowlist of `authorized/`, whose admitted peers are named by their key files."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], authorized: Path) -> None:
        super().__init__(ctx)
        self.authorized = authorized
        self.names: dict[bytes, str] = {}
        self.load_names()

    def load_names(self) -> None:
        names = {}
        for path in sorted(self.authorized.glob("*.key")):
            public, _ = zmq.auth.load_certificate(path)
            names[public] = path.stem
        self.names = names   # one assignment: the ZAP thread sees the old map or the new one

    def reload(self) -> None:
        """Read `authorized/` again (keys added or removed); new connections see the change,
        established ones keep going."""
        self.load_names()
        self.configure_curve(domain="*", location=str(self.authorized))
        log.info("reloaded %d authorized key(s) from %s", len(self.names), self.authorized)

    def curve_user_id(self, client_public_key: bytes) -> str:
        return self.names.get(zmq.utils.z85.encode(client_public_key), "")


def curve_server(ctx: zmq.Context[zmq.Socket[bytes]], sock: zmq.Socket[bytes], keys: str
                 ) -> NamedKeyAuthenticator:
    """Make `sock` a CURVE server that admits only `keys/authorized/`; the running
    authenticator (stop it after the socket closes). ValueError names what is missing."""
    directory = Path(keys)
    secret = directory / COORDINATOR_KEY
    authorized = directory / AUTHORIZED
    if not secret.is_file():
        raise ValueError(f"no coordinator keypair {secret}: run `rollout-watchdog keygen "
                         f"{directory} coordinator`")
    if not authorized.is_dir():
        raise ValueError(f"no {authorized}/ directory: put the public keys (NAME.key) of the "
                         "nodes and clients allowed in there")
    if not os.access(secret, os.R_OK):
        raise ValueError(f"cannot read {secret}")
    public, secret_key = load_keypair(secret)
    auth = NamedKeyAuthenticator(ctx, authorized)
    if not auth.names:
        log.warning("%s holds no public key: no node or client can connect", authorized)
    auth.start()
    auth.configure_curve(domain="*", location=str(authorized))
    sock.curve_server = True
    sock.curve_publickey, sock.curve_secretkey = public, secret_key
    return auth
