"""`FleetClient.wait_router_synced()` (issue 13 §4.6): the router lags the fleet view, and a
trainer can wait until it lists what the coordinator routes. Real router, real node daemons over
emulator engines, an embedded coordinator."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from daemon_harness import Node
from refit_harness import all_healthy, router_urls, start_fleet

from rollout_watchdog import Coordinator, FleetClient
from rollout_watchdog.refit_bridge import router_sync
from rollout_watchdog.refit_bridge.router import normalize_url

pytest.importorskip("sglang_router")
from router_harness import Router  # noqa: E402


def test_wait_router_synced_returns_what_the_router_lists(make_node: Callable[..., Node],
                                                          router: Router,
                                                          monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    with Coordinator(bind="tcp://127.0.0.1:0", node_timeout_s=3.0,
                     router_url=router.url) as coordinator:
        fleet = FleetClient(coordinator.endpoint)
        start_fleet(make_node, coordinator.endpoint, nodes=1, engines=2)
        view = fleet.wait_until(all_healthy(2), 90)
        want = {normalize_url(str(e.url)) for e in view}   # routed at their disk weights

        listed = fleet.wait_router_synced(60)
        assert {normalize_url(u) for u in listed} == want
        assert router_urls(router.url) == want   # the router itself, at that moment

        # A fleet too big for `ping` to list: the lists come in `router_urls` pages.
        with monkeypatch.context() as patch:
            patch.setattr(router_sync, "STATUS_URLS", 1)
            shown = fleet.call("ping")[1]["router"]
            assert shown["listed"] is None and shown["desired_count"] == 2
            assert {normalize_url(u) for u in fleet.wait_router_synced(60)} == want

        # Stopped while the router is down: the router cannot drop it, the wait ends at its
        # bound and says so.
        router.kill()
        fleet.stop("node0/e0")
        fleet.wait_until(lambda v: {e.name: e.state for e in v}["node0/e0"] == "stopped", 30)
        with pytest.raises(TimeoutError, match="router was not in sync within 2 s"):
            fleet.wait_router_synced(2)

        # Back: it returns once the router lists exactly the engine left.
        router.restart()
        survivor = {normalize_url(str(e.url)) for e in view if e.name == "node0/e1"}
        assert {normalize_url(u) for u in fleet.wait_router_synced(60)} == survivor
        assert router_urls(router.url) == survivor


def test_without_a_router_there_is_nothing_to_wait_for(coordinator: Coordinator) -> None:
    assert FleetClient(coordinator.endpoint).wait_router_synced(5) == []
