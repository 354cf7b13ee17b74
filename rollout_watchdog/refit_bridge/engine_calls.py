"""The HTTP calls the trainer makes to SGLang engines during a refit (SGLANG.md, "Weight refit").

Plain ``http.client`` so every call has its own socket with its own bounds: a connect timeout,
then a read timeout that, for the calls that block until a collective completes, is as long as
the group's timeout. The socket is handed to ``on_socket`` before the request goes out, so the
caller can shut it down from another thread to free a call that would otherwise wait that long.
"""

from __future__ import annotations

import http.client
import json
import re
import socket
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import urlsplit

from rollout_watchdog.common.errors import RolloutWatchdogError
from rollout_watchdog.common.server_info import SERVER_INFO_PATH, tp_size_of

# SGLang 0.5.21 brought begin_weight_update / end_weight_update, which it then requires.
SESSION_SINCE = (0, 5, 21)

_VERSION = re.compile(r"^\s*v?(\d+)\.(\d+)\.(\d+)")


class EngineCallError(RolloutWatchdogError):
    """One call to one engine failed. ``answered`` is False when no HTTP answer came at all
    (refused, reset, timed out: the engine is likely gone), True for a 4xx/5xx or a
    ``success: false`` answer (the engine is alive and said no)."""

    def __init__(self, detail: str, *, answered: bool) -> None:
        super().__init__(detail)
        self.detail = detail
        self.answered = answered


def split_url(url: str) -> tuple[str, int]:
    """``http://host[:port]`` -> (host, port); 80 when left out (a normalized URL leaves the
    default port out). Anything else is a clear ValueError."""
    parts = urlsplit(url)
    try:
        port = 80 if parts.port is None else parts.port
    except ValueError:   # not a number, or out of range
        port = 0
    if parts.scheme != "http" or not parts.hostname or port == 0:
        raise ValueError(f"engine url {url!r} is not of the form http://HOST:PORT")
    return parts.hostname, port


def call(
    url: str,
    method: str,
    path: str,
    body: dict[str, Any] | None,
    *,
    connect_timeout_s: float,
    read_timeout_s: float,
    on_socket: Callable[[socket.socket], None] | None = None,
) -> dict[str, Any]:
    """One request; returns the JSON answer. Raises EngineCallError on any failure, including
    an answer ``{"success": false}`` (how SGLang reports a refused weight-update call)."""
    host, port = split_url(url)
    conn = http.client.HTTPConnection(host, port, timeout=connect_timeout_s)
    where = f"{method} {url}{path}"
    try:
        try:
            conn.connect()
            assert conn.sock is not None
            conn.sock.settimeout(read_timeout_s)
            if on_socket is not None:
                on_socket(conn.sock)
            data = None if body is None else json.dumps(body).encode()
            headers = {} if data is None else {"Content-Type": "application/json"}
            conn.request(method, path, body=data, headers=headers)
            resp = conn.getresponse()
            raw = resp.read()
        except (OSError, http.client.HTTPException) as exc:
            raise EngineCallError(f"{where}: no answer ({type(exc).__name__}: {exc})",
                                  answered=False) from exc
        try:
            answer = json.loads(raw) if raw else {}
        except ValueError:
            answer = {"message": raw[:200].decode(errors="replace")}
        if not isinstance(answer, dict):
            answer = {"message": str(answer)[:200]}
        if resp.status != 200 or answer.get("success") is False:
            raise EngineCallError(f"{where}: HTTP {resp.status}: {answer.get('message', '')}",
                                  answered=True)
        return answer
    finally:
        conn.close()


def parse_version(version: str) -> tuple[int, int, int]:
    """``0.5.21.post1`` -> (0, 5, 21); a string without major.minor.patch is a ValueError."""
    match = _VERSION.match(version)
    if match is None:
        raise ValueError(f"cannot read an SGLang version from {version!r}")
    major, minor, patch = (int(g) for g in match.groups())
    return major, minor, patch


def uses_session(version: str) -> bool:
    """Whether a server of this version needs begin/end_weight_update around an update."""
    return parse_version(version) >= SESSION_SINCE


# ---------------------------------------------------------------------- the refit's quick calls

MAX_PARALLEL = 64


def post(url: str, path: str, body: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    return call(url, "POST", path, body, connect_timeout_s=timeout_s, read_timeout_s=timeout_s)


def get(url: str, path: str, timeout_s: float) -> dict[str, Any]:
    return call(url, "GET", path, None, connect_timeout_s=timeout_s, read_timeout_s=timeout_s)


def weight_version(url: str, timeout_s: float) -> str | None:
    version = get(url, "/model_info", timeout_s).get("weight_version")
    return version if isinstance(version, str) else None


def tp_size(url: str, timeout_s: float) -> int:
    """The ranks the engine takes in a weight-update group: its `tp_size`, else 1."""
    return tp_size_of(get(url, SERVER_INFO_PATH, timeout_s))


def responsiveness(url: str, timeout_s: float) -> str:
    """"ok" when the engine answers a control call within `timeout_s` (`/server_info` waits on
    the scheduler), "stuck" when it accepts the connection but does not answer (blocked in a
    collective), "gone" when nothing accepts it (dead)."""
    try:
        get(url, "/server_info", timeout_s)
    except EngineCallError as exc:
        if exc.answered:
            return "ok"
        return "stuck" if isinstance(exc.__cause__, TimeoutError) else "gone"
    return "ok"


def on_each(urls: list[str], action: Callable[[str], Any]) -> dict[str, str]:
    """Run `action(url)` for every url at once; {url: error} for those that raised."""
    errors: dict[str, str] = {}
    if not urls:
        return errors
    with ThreadPoolExecutor(min(MAX_PARALLEL, len(urls))) as pool:
        futures = {url: pool.submit(action, url) for url in urls}
        for url, future in futures.items():
            exc = future.exception()
            if exc is not None:
                errors[url] = str(exc)
    return errors
