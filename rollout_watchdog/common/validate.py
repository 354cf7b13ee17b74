"""Rules for single values (ids, names, paths, socket addresses), shared by the config and by
the control commands that take the same values from outside (`register`).

Each rule returns the problem as text ending in the offending value, or None; the caller puts
the key or the command in front, so that every refusal is one readable line.
"""

from __future__ import annotations

import ipaddress
import os
import re

_ENGINE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
# An HTTP path as it goes on the request line: printable ASCII, no spaces.
URL_PATH = re.compile(r"/[\x21-\x7e]*")
_LABEL = r"[A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?"
_HOSTNAME = re.compile(rf"{_LABEL}(\.{_LABEL})*")
# sizeof(sockaddr_un.sun_path) on Linux, less the terminating NUL: the longest ipc:// path.
MAX_IPC_PATH_BYTES = 107


def shown(value: object, limit: int = 40) -> str:
    """repr() of a value, cut short so that a 60,000-character id still makes one short line."""
    text = repr(value)
    if len(text) <= limit:
        return text
    length = f", {len(value)} characters" if isinstance(value, str) else ""
    return f"{text[:limit]}... (cut{length})"


def check_engine_id(engine_id: object) -> str | None:
    """Why `engine_id` is not a valid engine id, or None if it is.

    Ids name files (state_dir/logs/ID.log), metric labels and CLI arguments, so they are
    held to a short, plain alphabet; the daemon applies the same rule to `register`.
    """
    if isinstance(engine_id, str) and _ENGINE_ID.fullmatch(engine_id):
        return None
    return ("must be a string of at most 64 letters, digits, '.', '_' or '-', starting with "
            f"a letter or digit (got {shown(engine_id)})")


def text_problem(text: str) -> str | None:
    """Why a name or path is unusable as such: empty, or with control characters."""
    if not text:
        return "must not be empty"
    if not text.isprintable():
        return f"must not contain control or invisible characters, got {shown(text)}"
    return None


def ipc_problem(path: str, *, local: bool) -> str | None:
    """Why `path` (after ipc://) cannot be bound or connected to; `local`: the control socket,
    whose only protection is its file mode, so an abstract socket (no file) is refused."""
    if problem := text_problem(path):
        return f"path {problem}"
    if path.startswith("@") and local:
        return (f"must name a file: an abstract socket ({shown('ipc://' + path)}) has no file "
                "mode, so the 0600 protection cannot apply")
    size = len(os.fsencode(path))
    if size > MAX_IPC_PATH_BYTES:
        return (f"path is {size} bytes, over the {MAX_IPC_PATH_BYTES} that a Unix socket "
                f"address holds: {shown(path, 60)}")
    return None


def bracket_host(host: str) -> str:
    """A host as it goes before `:PORT` in a URL or a tcp:// address: an IPv6 address in
    brackets (once), anything else as it is."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def endpoint_problem(endpoint: str) -> str | None:
    """Why `endpoint` is not a ZMQ endpoint to connect to: tcp://HOST:PORT or ipc://PATH."""
    if endpoint.startswith("ipc://"):
        return ipc_problem(endpoint[len("ipc://"):], local=False)
    usage = f"must be tcp://HOST:PORT or ipc://PATH, got {shown(endpoint)}"
    if not endpoint.startswith("tcp://"):
        return usage
    host, _, port = endpoint[len("tcp://"):].rpartition(":")
    if not re.fullmatch(r"[0-9]{1,5}", port) or not 1 <= int(port) <= 65535:
        return f"{usage} (the port must be 1 to 65535)"
    if host.startswith("[") and host.endswith("]"):
        try:
            ipaddress.IPv6Address(host[1:-1])
            return None
        except ValueError:
            return usage
    return None if len(host) <= 253 and _HOSTNAME.fullmatch(host) else usage


def shorten(text: str, limit: int) -> str:
    """`text` cut to `limit` characters, saying how many were cut (a text for people: a
    reason, a detail; never data)."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text) - limit} characters cut)"


def non_negative(name: str, value: float) -> float:
    """`value`, if it is a number >= 0 (not NaN); ValueError naming `name` otherwise."""
    if not value >= 0:
        raise ValueError(f"{name} must be >= 0, got {value!r}")
    return value
