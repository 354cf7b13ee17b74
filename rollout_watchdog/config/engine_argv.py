"""What an engine's URL and argv say of its ports, and whether its program can be found: the
config checks a launch against these before anything runs."""

from __future__ import annotations

import os
import shutil
from urllib.parse import urlsplit

# Flags whose value is a port the engine binds; they must be free before a relaunch.
PORT_FLAGS = ("--port", "--nccl-port")


def url_port(url: str) -> int | None:
    """The TCP port of an http(s) URL with a host, or None if the URL is not one."""
    try:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            return None
        if parts.port is None:
            return 443 if parts.scheme == "https" else 80
        return parts.port or None  # port 0 is no port
    except ValueError:
        return None


def _flag_value(command: tuple[str, ...], i: int, flag: str) -> int | None:
    """The port at argv position i, if it is `flag N` or `flag=N`."""
    arg, value = command[i], None
    if arg == flag and i + 1 < len(command):
        value = command[i + 1]
    elif arg.startswith(flag + "="):
        value = arg.split("=", 1)[1]
    return int(value) if value is not None and value.isdigit() else None


def flag_port(command: tuple[str, ...], flag: str) -> int | None:
    """The first port given to `flag` in an argv, or None."""
    return next((port for i in range(len(command))
                 if (port := _flag_value(command, i, flag)) is not None), None)


def command_ports(command: tuple[str, ...]) -> list[int]:
    """Ports the engine binds according to its argv (`--port N`, `--port=N`, `--nccl-port`),
    in argv order."""
    return [port for i in range(len(command)) for flag in PORT_FLAGS
            if (port := _flag_value(command, i, flag)) is not None]


def command_found(program: str, env: dict[str, str]) -> bool:
    if "/" in program:
        return os.path.isfile(program) and os.access(program, os.X_OK)
    return shutil.which(program, path=env.get("PATH", os.environ.get("PATH"))) is not None
