"""CURVE keypairs for the fleet link, in pyzmq's certificate format (`zmq.auth`), so that the
coordinator's ZAP authenticator reads them as they are: `DIR/NAME.key` holds the public key
(given to the other side, or put in the coordinator's `authorized/`), `DIR/NAME.key_secret`
the keypair (mode 0600, never leaves the host)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth

from rollout_watchdog.common.validate import check_engine_id


class KeygenError(Exception):
    """A keypair that cannot be written; the message says why."""


def keygen(directory: str | os.PathLike[str], name: str) -> tuple[Path, Path]:
    """Write NAME's keypair into `directory` (created 0700 if missing); the paths of the public
    and the secret file. Never overwrites a key: replacing one silently would lock its holder
    out of the fleet."""
    if (problem := check_engine_id(name)) is not None:
        raise KeygenError(f"key name: {problem}")
    if not zmq.has("curve"):
        raise KeygenError("this libzmq has no CURVE support: cannot make keys")
    folder = Path(directory)
    public, secret = folder / f"{name}.key", folder / f"{name}.key_secret"
    existing = [str(p) for p in (public, secret) if p.exists()]
    if existing:
        raise KeygenError(f"{' and '.join(existing)} already exist(s): not overwritten (remove "
                        "them first to replace the key)")
    old_umask = os.umask(0o077)  # the secret is never readable by others, even for a moment
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        zmq.auth.create_certificates(folder, name)
    except OSError as exc:
        raise KeygenError(f"cannot write keys in {folder}: {exc.strerror or exc}") from exc
    finally:
        os.umask(old_umask)
    public.chmod(0o644)
    return public, secret


def load_keypair(path: str | os.PathLike[str]) -> tuple[bytes, bytes]:
    """The (public, secret) keys of a NAME.key_secret file; ValueError names the file and
    why it is unusable (unreadable, not a certificate, or a public key only)."""
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"unreadable keypair {path}: {exc}") from exc
    if secret is None:
        raise ValueError(f"{path} holds no secret key (a .key_secret file from keygen does)")
    return public, secret


def load_public(path: str | os.PathLike[str]) -> bytes:
    """The public key of a NAME.key (or NAME.key_secret) file; ValueError names the file."""
    try:
        public, _ = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"unreadable public key {path}: {exc}") from exc
    return public


@dataclass(frozen=True)
class ClientKeys:
    """A CURVE client's keys (a node's link, a FleetClient): loaded once, set on each of its
    sockets."""

    public: bytes
    secret: bytes
    server: bytes

    @classmethod
    def load(cls, key: str | os.PathLike[str],
             coordinator_key: str | os.PathLike[str]) -> ClientKeys:
        """From this side's NAME.key_secret and the coordinator's public .key."""
        return cls(*load_keypair(key), load_public(coordinator_key))

    def apply(self, sock: zmq.Socket[bytes]) -> None:
        """Make `sock` (not yet connected) a CURVE client of the coordinator."""
        sock.curve_publickey, sock.curve_secretkey = self.public, self.secret
        sock.curve_serverkey = self.server
