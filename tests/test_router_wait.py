"""`wait_router_synced`'s reading of a big fleet's router lists, page by page (pure: a stand-in
client answers `nodes`, `ping` and `router_urls`): lists that change between `ping` and its
pages are read again, never taken as in sync."""

from __future__ import annotations

from typing import Any

from rollout_watchdog.refit_bridge import router_sync
from rollout_watchdog.refit_bridge.router_wait import wait_router_synced
from rollout_watchdog.refit_bridge.views import NodeView

X, Y = "http://10.0.0.1:30000", "http://10.0.0.2:30000"


class StandIn:
    """Each `ping` is the next of `rounds`: (ping's router status, the pages that follow it)."""

    timeout_s = 1.0

    def __init__(self, rounds: list[tuple[dict[str, Any], list[dict[str, Any]]]]) -> None:
        self.rounds = rounds
        self.pings = 0
        self.pages: list[dict[str, Any]] = []

    def nodes(self, node: str | None = None, timeout_s: float | None = None
              ) -> list[NodeView]:
        return [NodeView.from_json({"node_id": "n0", "reachable": True, "engines": [
            {"id": f"e{i}", "state": "healthy", "url": url, "serving": True}
            for i, url in enumerate((X, Y))]})]

    def call(self, cmd: str, args: dict[str, Any] | None = None, *,
             timeout_s: float | None = None) -> tuple[str, Any]:
        if cmd == "ping":
            router, self.pages = self.rounds[min(self.pings, len(self.rounds) - 1)]
            self.pings += 1
            return "ok", {"router": router}
        assert cmd == "router_urls"
        return "ok", self.pages.pop(0)


def status(generation: int, synced: bool) -> dict[str, Any]:
    return {"listed": None, "desired": None, "pending": None, "synced": synced,
            "generation": generation, "last_error": None}


def page(generation: int, listed: list[str], desired: list[str]) -> dict[str, Any]:
    every = sorted(set(listed) | set(desired))
    return {"urls": [{"url": u, "listed": u in listed, "desired": u in desired,
                      "weight_version": None, "pending": None} for u in every],
            "next": None, "generation": generation}


def test_lists_changed_between_ping_and_its_pages_are_read_again() -> None:
    client = StandIn([
        # ping: in sync (the router listed X, the old desired set); then Y became desired
        # before the page was read: the page shows both desired, only X listed
        (status(1, True), [page(2, [X], [X, Y])]),
        # read again: not in sync yet (Y is being added)
        (status(2, False), [page(2, [X], [X, Y])]),
        # in sync, the same generation throughout
        (status(3, True), [page(3, [X, Y], [X, Y])]),
    ])
    assert sorted(wait_router_synced(client, 10.0, 0.0)) == [X, Y]
    assert client.pings == 3   # the torn read of the first round was not taken as in sync


def test_a_pending_reason_shows_a_long_reported_version_cut_short() -> None:
    """An engine's answer is unbounded; its reason goes into `ping` and pages of 2,000."""
    why = router_sync._mismatch("v" * 100_000, "v1")
    assert len(why) < 200 and why.startswith("reports weight_version 'vvv") \
        and why.endswith("..., not 'v1'")
