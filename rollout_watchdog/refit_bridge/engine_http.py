"""The refit's HTTP calls to SGLang engines (SGLANG.md): each bounded by a timeout, each
failure a `RolloutWatchdogError` naming the engine, the path and what went wrong."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import requests

from rollout_watchdog.errors import RolloutWatchdogError

MAX_PARALLEL = 64


def post(url: str, path: str, body: dict[str, Any], timeout_s: float) -> Any:
    """POST JSON; the decoded answer. A `{"success": false}` answer is an error too."""
    return _answer(url, path, lambda: requests.post(url.rstrip("/") + path, json=body,
                                                    timeout=timeout_s))


def get(url: str, path: str, timeout_s: float) -> Any:
    return _answer(url, path, lambda: requests.get(url.rstrip("/") + path, timeout=timeout_s))


def _answer(url: str, path: str, send: Callable[[], requests.Response]) -> Any:
    try:
        response = send()
    except requests.RequestException as exc:
        raise RolloutWatchdogError(f"{url}{path}: {type(exc).__name__}: {exc}") from None
    try:
        data = response.json() if response.content else None
    except ValueError:
        data = response.text[:200]
    if response.status_code != 200 or (isinstance(data, dict) and data.get("success") is False):
        message = data.get("message") if isinstance(data, dict) else data
        raise RolloutWatchdogError(f"{url}{path}: HTTP {response.status_code}: {message}")
    return data


def weight_version(url: str, timeout_s: float) -> str | None:
    info = get(url, "/model_info", timeout_s)
    version = info.get("weight_version") if isinstance(info, dict) else None
    return version if isinstance(version, str) else None


def tp_size(url: str, timeout_s: float) -> int:
    """The ranks the engine takes in a weight-update group: its `tp_size`, else 1."""
    info = get(url, "/server_info", timeout_s)
    size = info.get("tp_size") if isinstance(info, dict) else None
    return size if isinstance(size, int) and size > 0 else 1


def stuck(url: str, timeout_s: float) -> bool:
    """Whether the engine's scheduler takes no control call: `/server_info` (which waits on the
    scheduler) gets no answer within `timeout_s` while the server accepts the connection. An
    engine blocked in a collective is stuck; a dead one is not (it is gone)."""
    try:
        requests.get(url.rstrip("/") + "/server_info", timeout=(timeout_s, timeout_s))
    except requests.ConnectTimeout:
        return False
    except requests.Timeout:
        return True
    except requests.RequestException:
        return False
    return False


def on_each(urls: list[str], call: Callable[[str], Any]) -> dict[str, str]:
    """Run `call(url)` for every url at once; {url: error} for those that raised."""
    errors: dict[str, str] = {}
    if not urls:
        return errors
    with ThreadPoolExecutor(min(MAX_PARALLEL, len(urls))) as pool:
        futures = {url: pool.submit(call, url) for url in urls}
        for url, future in futures.items():
            exc = future.exception()
            if exc is not None:
                errors[url] = str(exc)
    return errors
