"""The refit bridge end to end (issue 7): two nodes' emulator engines under node watchdogs, a
coordinator with the real sglang-router, and a trainer; an engine SIGKILLed during
generation, brought back, kept out of the router until the next refit syncs it."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable

import pytest
from daemon_harness import Node, wait_for
from refit_harness import (
    all_healthy,
    by_name,
    generate,
    router_urls,
    run_trainer,
    start_fleet,
    wait_router,
)

from rollout_watchdog import Coordinator, FleetClient
from rollout_watchdog.refit_bridge.router import normalize_url

pytest.importorskip("sglang_router")
from router_harness import Router  # noqa: E402


def test_crash_recover_and_resync_through_the_router(make_node: Callable[..., Node],
                                                     router: Router) -> None:
    with Coordinator(bind="tcp://127.0.0.1:0", node_timeout_s=3.0,
                     router_url=router.url) as coordinator:
        fleet = FleetClient(coordinator.endpoint)
        start_fleet(make_node, coordinator.endpoint, nodes=2, engines=2)
        fleet.wait_until(all_healthy(4), 90)

        # 1. Refit v1 from a trainer: every engine holds v1 and is in the router.
        outcome = run_trainer(coordinator.endpoint, "v1", seed=1)
        assert outcome.get("ok"), outcome
        assert len(outcome["members"]) == 4
        engines = by_name(fleet)
        assert {(e.weight_version, e.serving) for e in engines.values()} == {("v1", True)}
        wait_router(router.url, {str(e.url) for e in engines.values()}, "all four in the router")
        status, v1_text, version = generate(router.url)
        assert status == 200 and version == "v1"

        # 2. SIGKILL an engine while requests flow through the router.
        victim = engines["node0/e0"]
        results: list[tuple[float, int | None]] = []
        stop = threading.Event()

        def load() -> None:
            while not stop.is_set():
                results.append((time.monotonic(), generate(router.url, timeout=5.0)[0]))
        worker = threading.Thread(target=load, daemon=True)
        worker.start()
        try:
            wait_for(lambda: len(results) >= 5, 30, "requests flowing through the router")
            assert victim.pid is not None
            os.kill(victim.pid, signal.SIGKILL)
            survivors = {normalize_url(str(e.url)) for e in engines.values() if e is not victim}
            wait_router(router.url, survivors, "the dead engine out of the router", 10)
            removed_at = time.monotonic()
            wait_for(lambda: len([r for r in results if r[0] > removed_at]) >= 8, 30,
                     "requests after the removal")
        finally:
            stop.set()
            worker.join(10)
        after = [status for at, status in results if at > removed_at]
        assert after and all(status == 200 for status in after), after

        # 3. The watchdog brings it back; pending weights keep it out of the router.
        back = fleet.wait_until(lambda v: any(
            e.name == victim.name and e.incarnation > victim.incarnation
            and e.state == "healthy" for e in v), 60)
        reborn = next(e for e in back if e.name == victim.name)
        assert (reborn.weight_version, reborn.serving) == (None, False)
        ping = fleet.call("ping")[1]
        assert normalize_url(str(victim.url)) not in router_urls(router.url), ping["router"]
        assert normalize_url(str(victim.url)) not in ping["router"]["desired"]

        # 4. Refit v2 rebuilds the group with the new incarnation and syncs everyone.
        outcome = run_trainer(coordinator.endpoint, "v2", seed=2)
        assert outcome.get("ok"), outcome
        assert victim.name in outcome["members"] and len(outcome["members"]) == 4
        engines = by_name(fleet)
        assert {(e.weight_version, e.serving) for e in engines.values()} == {("v2", True)}
        wait_router(router.url, {str(e.url) for e in engines.values()},
                    "every engine back in the router")

        # 5. Same weights everywhere: the same greedy output, at v2, unlike v1's.
        answers = {name: generate(str(e.url)) for name, e in engines.items()}
        assert {a[2] for a in answers.values()} == {"v2"}
        texts = {a[1] for a in answers.values()}
        assert len(texts) == 1, answers
        assert texts != {v1_text}
