"""Shared pieces of the refit tests: a fleet of node daemons with emulator engines under an
embedded coordinator, the trainer, generation and the router's worker list."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from daemon_harness import EngineSpec, Node, wait_for

from rollout_watchdog import FleetClient
from rollout_watchdog.emulator.testing import http_request
from rollout_watchdog.refit_bridge.refit_state import GROUPS
from rollout_watchdog.refit_bridge.router import RouterClient, normalize_url
from rollout_watchdog.refit_bridge.views import EngineView

TRAINER = Path(__file__).with_name("refit_trainer.py")
PROMPT = "The rollout fleet"


def weights(seed: int) -> list[tuple[str, Any]]:
    from rollout_watchdog.emulator.model import named_weights
    return list(named_weights(seed))


def start_fleet(make_node: Callable[..., Node], endpoint: str, nodes: int, engines: int,
                flags: tuple[str, ...] = (), **node_kwargs: Any) -> list[Node]:
    out = []
    for i in range(nodes):
        node = make_node([EngineSpec(f"e{j}", flags=flags, extra={"tp_size": 1})
                          for j in range(engines)], node_id=f"node{i}",
                         top={"coordinator": endpoint},
                         # 3 failed probes in a row (1 s timeout each) to restart: these tests
                         # count restarts, and a refit loads a 2-core host
                         probe={"health_interval_s": 0.5, "failure_threshold": 3},
                         **node_kwargs)
        node.start()
        out.append(node)
    return out


def all_healthy(count: int) -> Callable[[list[EngineView]], bool]:
    return lambda view: len(view) == count and all(e.state == "healthy" for e in view)


def by_name(fleet: FleetClient) -> dict[str, EngineView]:
    return {e.name: e for e in fleet.engines()}


def run_trainer(endpoint: str, version: str, seed: int, timeout_s: float = 180.0
                ) -> dict[str, Any]:
    """Run one refit as a trainer does, in a thread of this process (a trainer process of its
    own imports torch, ~3 s of CPU, for nothing these tests check: the ones that kill or stop
    the trainer run refit_trainer.py as a script); its outcome, within `timeout_s`. The
    trainer's weight-update group ends with it, as it did with its process."""
    from refit_trainer import refit_outcome

    outcome: list[dict[str, Any]] = []
    raised: list[BaseException] = []   # raised again here: not taken for a hang

    def trainer() -> None:
        try:
            with FleetClient(endpoint) as fleet:
                try:
                    outcome.append(refit_outcome(fleet, version, seed))
                finally:
                    group = GROUPS.get(fleet.address)
                    if group is not None and GROUPS.discard(fleet.address, group):
                        group.destroy()
        except BaseException as exc:  # noqa: BLE001 - the caller raises it
            raised.append(exc)

    thread = threading.Thread(target=trainer, name=f"trainer {version}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if raised:
        raise raised[0]
    assert outcome, f"the trainer's refit to {version} did not end within {timeout_s:g} s"
    return outcome[0]


def generate(url: str, prompt: str = PROMPT, timeout: float = 10.0
             ) -> tuple[int | None, str, str | None]:
    """(status, text, weight_version) of a greedy generation at `url` (an engine or router)."""
    status, body = http_request(f"{url}/generate", "POST", {
        "text": prompt, "sampling_params": {"max_new_tokens": 12, "temperature": 0}},
        timeout=timeout)
    if status != 200:
        return status, "", None
    answer = json.loads(body)
    return status, str(answer["text"]), answer["meta_info"].get("weight_version")


def router_urls(router_url: str) -> set[str]:
    return RouterClient(router_url).urls()


def wait_router(router_url: str, urls: set[str], what: str, timeout: float = 30.0) -> None:
    want = {normalize_url(u) for u in urls}
    wait_for(lambda: router_urls(router_url) == want, timeout, what)
