"""`--route-after-first-refit`: a run resumed from a checkpoint routes no engine until a refit
commits (its engines booted from the base model are stale), with the real sglang-router."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from daemon_harness import Node, wait_for
from fleet_harness import CoordinatorConnection
from refit_harness import all_healthy, router_urls, run_trainer, start_fleet, wait_router

from rollout_watchdog import Coordinator, FleetClient
from rollout_watchdog.refit_bridge.weights import WeightBook

pytest.importorskip("sglang_router")
from router_harness import Router  # noqa: E402


def test_the_weight_book_serves_nothing_before_the_first_commit_when_told() -> None:
    book = WeightBook()
    book.disk_weights_serve = False
    healthy = {"id": "e0", "state": "healthy", "incarnation": 1}
    assert not book.serving("n", healthy)
    book.commit("v1", [("n", "e0", 1)])
    assert book.serving("n", healthy)
    assert not book.serving("n", {**healthy, "incarnation": 2})   # relaunched: pending



def test_no_engine_is_routed_until_the_first_refit_commits(make_node: Callable[..., Node],
                                                           router: Router) -> None:
    with Coordinator(bind="tcp://127.0.0.1:0", node_timeout_s=3.0, router_url=router.url,
                     route_after_first_refit=True) as coordinator:
        fleet = FleetClient(coordinator.endpoint)
        start_fleet(make_node, coordinator.endpoint, nodes=1, engines=2)
        fleet.wait_until(all_healthy(2), 90)
        assert not any(e.serving for e in fleet.engines())

        connection = CoordinatorConnection(coordinator.endpoint)

        def router_told_nothing() -> bool:   # in sync with an empty membership
            status = connection.result("ping")["router"]
            return bool(status["synced"]) and status["desired"] == {}
        try:
            wait_for(router_told_nothing, 15, "the router in sync with no engine")
        finally:
            connection.close()
        assert router_urls(router.url) == set()

        outcome = run_trainer(coordinator.endpoint, "v1", seed=1)
        assert outcome.get("ok"), outcome
        engines = fleet.engines()
        assert all(e.serving and e.weight_version == "v1" for e in engines)
        wait_router(router.url, {str(e.url) for e in engines}, "both engines routed at v1")
