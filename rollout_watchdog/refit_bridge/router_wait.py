"""The driver's wait for the router to catch up with the fleet view (`FleetClient.
wait_router_synced`): what `ping` says of the router, its URL lists put together from
`router_urls` pages when a big fleet's do not fit in `ping`."""

from __future__ import annotations

import contextlib
import time
from typing import Any, Protocol

from rollout_watchdog.common.errors import CoordinatorUnavailable
from rollout_watchdog.refit_bridge.router import normalize_url
from rollout_watchdog.refit_bridge.views import NodeView


class Client(Protocol):
    timeout_s: float

    def call(self, cmd: str, args: dict[str, Any] | None = None, *,
             timeout_s: float | None = None) -> tuple[str, Any]: ...

    def nodes(self, node: str | None = None, timeout_s: float | None = None
              ) -> list[NodeView]: ...


def wait_router_synced(client: Client, timeout_s: float, interval_s: float) -> list[str]:
    """See FleetClient.wait_router_synced."""
    deadline = time.monotonic() + timeout_s
    router: dict[str, Any] | None = None
    want: set[str] = set()
    while (left := deadline - time.monotonic()) > 0:
        with contextlib.suppress(CoordinatorUnavailable):
            want = {normalize_url(str(e.url)) for n in client.nodes(timeout_s=left)
                    if n.reachable for e in n.engines if e.serving and e.url}
            _, result = client.call("ping", timeout_s=min(client.timeout_s, left))
            found = result.get("router") if isinstance(result, dict) else None
            if not isinstance(found, dict):
                return []
            lists = with_lists(client, found, deadline)
            if lists is not None:   # (None: they changed while read; read them again)
                router = lists
                desired = {normalize_url(str(url)) for url in router.get("desired") or ()}
                if router.get("synced") is True and desired == want:
                    return [str(url) for url in router.get("listed") or ()]
        time.sleep(max(0.0, min(interval_s, deadline - time.monotonic())))
    seen = "no answer from the coordinator" if router is None else (
        f"it lists {_shown(router.get('listed'))}, the view routes {_shown(sorted(want))}, "
        f"last error {router.get('last_error')!r}")
    raise TimeoutError(f"the router was not in sync within {timeout_s:g} s ({seen})")


def with_lists(client: Client, router: dict[str, Any], deadline: float
               ) -> dict[str, Any] | None:
    """`ping`'s router status with its "listed", "desired" and "pending" filled in from
    `router_urls` pages when `ping` left them out (a fleet of more than STATUS_URLS); None
    when the lists changed while they were read (a page of another generation than `ping`'s:
    its "synced" is not about these lists)."""
    if router.get("listed") is not None:
        return router
    listed: list[str] = []
    desired: dict[str, str | None] = {}
    pending: dict[str, str] = {}
    after = None
    while True:
        left = max(0.001, deadline - time.monotonic())
        _, page = client.call("router_urls", {"after": after},
                              timeout_s=min(client.timeout_s, left))
        if page.get("generation") != router.get("generation"):
            return None
        for entry in page["urls"]:
            url = str(entry["url"])
            if entry["listed"]:
                listed.append(url)
            if entry["desired"]:
                desired[url] = entry["weight_version"]
            if entry["pending"] is not None:
                pending[url] = str(entry["pending"])
        after = page["next"]
        if after is None:
            return {**router, "listed": listed, "desired": desired, "pending": pending}


def _shown(urls: Any, most: int = 20) -> str:
    """A list of URLs for an error message: the first `most` of a long one, and how many."""
    if not isinstance(urls, list) or len(urls) <= most:
        return str(urls)
    return f"{urls[:most]} and {len(urls) - most} more"
