"""A small client for sglang-router 0.3.x's worker API, and the pure diff the sync loop applies.

The coordinator owns router membership outright: it removes a dead engine at once and adds an
engine only after it reads back the current weight_version. Start the router so that it never
adds, skips or re-admits workers on its own judgement:

- ``--disable-health-check``: the router's own health checks stay off. With them on, a worker
  whose /health fails is skipped (not removed) and taken back once /health passes again, so
  the router, not the coordinator, would decide who serves (a live engine with stale weights
  passes /health): the two would fight. (Its circuit breaker only skips a worker for a while.)
- ``--worker-startup-timeout-secs 10`` (at most WORKER_STARTUP_TIMEOUT_S): ``POST /workers``
  registers in the background, once the worker's /health passes, retrying for this long
  (default 1800 s); a DELETE does not cancel a pending registration, so an engine that died
  between our version check and the POST could otherwise be registered later, when something
  listens on that port again. The coordinator posts an engine again only after this long.
- ``--prometheus-port P``: the default 29000 clashes with any second router on the host.

``POST /workers`` answers 202 and the worker appears in ``GET /workers`` once registered
(~0.1 s with health checks off); ``DELETE /workers/{id}`` takes the router's id, not the URL.
Every call opens its own connection (nothing stale after a router restart) and is bounded by
the client's timeout.
"""

from __future__ import annotations

import sys
import urllib.parse
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from rollout_watchdog.common.errors import RolloutWatchdogError
from rollout_watchdog.common.validate import bracket_host

__all__ = ["RouterClient", "RouterError", "RouterWorker", "normalize_url", "reconcile", "url_key"]

_DEFAULT_PORTS = {"http": 80, "https": 443}
_DETAIL_CHARS = 300


class RouterError(RolloutWatchdogError):
    """A router call failed: unreachable, timed out, or an answer we cannot use. ``status`` is
    the HTTP status when the router answered, None when it did not; ``refused``: the
    connection was refused (a router that is down: not one that is slow)."""

    def __init__(self, router_url: str, action: str, detail: str,
                 status: int | None = None, refused: bool = False) -> None:
        self.router_url = router_url
        self.action = action
        self.detail = detail
        self.status = status
        self.refused = refused
        super().__init__(f"router {router_url}: {action} failed: {detail}")


# The flags of the module docstring, with a round-robin policy and quiet logs.
# How long the router's background job for one POST /workers may stay pending (its
# --worker-startup-timeout-secs): a DELETE does not cancel it, so it must not be doubled.
WORKER_STARTUP_TIMEOUT_S = 10
LAUNCH_FLAGS = ("--policy", "round_robin", "--disable-health-check",
                "--worker-startup-timeout-secs", str(WORKER_STARTUP_TIMEOUT_S),
                "--log-level", "warn")


def launch_argv(host: str, port: int, prometheus_port: int) -> list[str]:
    """The command that starts sglang-router 0.3.x the way the coordinator expects."""
    return [sys.executable, "-m", "sglang_router.launch_router", "--host", host,
            "--port", str(port), "--prometheus-port", str(prometheus_port), *LAUNCH_FLAGS]


@dataclass(frozen=True)
class RouterWorker:
    """One worker as the router lists it (``id`` is what DELETE takes)."""

    id: str
    url: str
    healthy: bool


def normalize_url(url: str) -> str:
    """``scheme://host[:port][/path]`` lower-cased, without a default port or trailing slash, so
    that the URLs the coordinator and the router spell differently compare equal.

    ValueError naming the URL for anything but a plain http(s) URL.
    """
    if not isinstance(url, str):
        raise ValueError(f"a URL must be a string, not {type(url).__name__}")
    parts = urllib.parse.urlsplit(url.strip())
    scheme = parts.scheme.lower()
    if scheme not in _DEFAULT_PORTS or not parts.hostname:
        raise ValueError(f"not an http(s) URL: {url!r}")
    if parts.query or parts.fragment or parts.username or parts.password:
        raise ValueError(f"an engine or router URL takes no query, fragment or credentials: "
                         f"{url!r}")
    try:
        port = parts.port
    except ValueError:
        raise ValueError(f"bad port in URL {url!r}") from None
    host = bracket_host(parts.hostname)
    netloc = host if port in (None, _DEFAULT_PORTS[scheme]) else f"{host}:{port}"
    return f"{scheme}://{netloc}{parts.path.rstrip('/')}"


def url_key(url: str) -> str:
    """The comparison key of a URL the router lists; one we cannot parse stays as it is (it
    matches nothing desired, so it is removed)."""
    try:
        return normalize_url(url)
    except ValueError:
        return url


def reconcile(desired: Collection[str],
              listed: list[RouterWorker]) -> tuple[list[str], list[RouterWorker]]:
    """(URLs to add, workers to remove) that turn ``listed`` into ``desired``.

    URLs are compared normalized; the URLs to add come back normalized and sorted. A worker
    listed twice under spellings of one URL is kept once; the other entries are removed.
    """
    want = {normalize_url(url) for url in desired}
    kept: set[str] = set()
    to_remove: list[RouterWorker] = []
    for worker in listed:
        key = url_key(worker.url)
        if key in want and key not in kept:
            kept.add(key)
        else:
            to_remove.append(worker)
    return sorted(want - kept), to_remove


class RouterClient:
    """sglang-router's worker API; every call bounded by ``timeout_s``, failures raise
    :class:`RouterError` naming the router URL and the call."""

    def __init__(self, url: str, timeout_s: float = 5.0) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, not {timeout_s!r}")
        self.url = normalize_url(url)
        self.timeout_s = timeout_s

    def workers(self) -> list[RouterWorker]:
        """The workers the router lists now (registered ones only, not pending additions)."""
        answer = self._call("GET", "/workers", "listing workers", (200,))
        body = answer.json_body
        entries = body.get("workers") if isinstance(body, dict) else None
        if not isinstance(entries, list):
            raise RouterError(self.url, "listing workers", f"no 'workers' list in {body!r:.200}",
                              answer.status)
        workers = []
        for entry in entries:
            if not (isinstance(entry, dict) and isinstance(entry.get("id"), str)
                    and isinstance(entry.get("url"), str)):
                raise RouterError(self.url, "listing workers", f"bad worker entry {entry!r:.200}",
                                  answer.status)
            workers.append(RouterWorker(entry["id"], entry["url"],
                                        bool(entry.get("is_healthy", False))))
        return workers

    def urls(self) -> set[str]:
        """The normalized URLs of the workers listed."""
        return {normalize_url(w.url) for w in self.workers()}

    def add(self, url: str) -> None:
        """Ask the router to register ``url`` (normalized); it does so in the background."""
        worker_url = normalize_url(url)
        self._call("POST", "/workers", f"adding {worker_url}", (200, 201, 202),
                   {"url": worker_url})

    def delete(self, worker_id: str) -> bool:
        """Remove the worker with this router id; False if the router does not know it."""
        path = "/workers/" + urllib.parse.quote(worker_id, safe="")
        answer = self._call("DELETE", path, f"removing worker {worker_id}", (200, 202, 204, 404))
        return answer.status != 404

    def _call(self, method: str, path: str, action: str, ok: tuple[int, ...],
              body: dict[str, Any] | None = None) -> _Answer:
        import requests  # (here: a daemon or CLI call that imports this module needs none)
        try:
            resp = requests.request(method, self.url + path, json=body, timeout=self.timeout_s)
        except requests.RequestException as exc:
            refused = isinstance(exc, requests.ConnectionError) \
                and not isinstance(exc, requests.Timeout)
            raise RouterError(self.url, action, _short(exc), refused=refused) from exc
        if resp.status_code not in ok:
            raise RouterError(self.url, action,
                              f"answered {resp.status_code}: {resp.text[:_DETAIL_CHARS]!r}",
                              resp.status_code)
        try:
            parsed: object = resp.json() if resp.content else None
        except ValueError:
            parsed = None
        return _Answer(resp.status_code, parsed)


@dataclass(frozen=True)
class _Answer:
    status: int
    json_body: object


def _short(exc: BaseException) -> str:
    """A requests exception in one line: its innermost cause says what happened."""
    while exc.__context__ is not None and exc.__context__ is not exc:
        exc = exc.__context__
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= _DETAIL_CHARS else text[:_DETAIL_CHARS] + "..."
