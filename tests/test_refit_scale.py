"""The refit lock over 20,000 engines (issue 13, Major 4): a real coordinator process, 40 fake
nodes of 500 engines that speak the protocol (fake_nodes.py: real NodeLinks), host names and
URLs of about 130 characters. A client before protocol 1.3 is told TOO_BIG and the lock is
free; one that pages gets a token and every member, commits in the compact form (every member
but one) and releases; then `fleet.refit()` itself takes the lock, gets every member, and
aborts without naming them (every member of the listing is stale) and releases.

At 10,800 engines the acquisition used to answer "ok" without `members` or `token`, leaving
the lock held. Deadlines are generous (a 2-core machine shared with other tests); the run
takes about 30 s. `SCALE_ENGINES` (environment) changes the engine count."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemon_harness import wait_for
from fake_nodes import FakeNodes
from fleet_harness import CoordinatorProcess, start_coordinator_process

from rollout_watchdog import CommandRefused, FleetClient
from rollout_watchdog.common import protocol
from rollout_watchdog.emulator.testing import free_port
from rollout_watchdog.refit_bridge import member_pages

ENGINES_PER_NODE = 500
ENGINES = int(os.environ.get("SCALE_ENGINES", "20000"))
NODES = -(-ENGINES // ENGINES_PER_NODE)
HOST = "gpu-" + "h" * 90 + ".rack-17.cluster.example.com"   # ~130 characters
DEADLINE_S = 120.0


@pytest.fixture
def coordinator(tmp_path: Path) -> Iterator[CoordinatorProcess]:
    process = start_coordinator_process(f"tcp://127.0.0.1:{free_port()}",
                                        ["--node-timeout", "30"],
                                        log_path=tmp_path / "coordinator.log")
    try:
        yield process
    finally:
        process.cleanup()


def test_twenty_thousand_members_come_in_pages_with_their_token_and_release_works(
        coordinator: CoordinatorProcess) -> None:
    fleet = FleetClient(coordinator.endpoint, timeout_s=30.0)
    with FakeNodes(coordinator.endpoint, NODES, ENGINES_PER_NODE,
                   prefix=f"node.{HOST}", host=HOST) as nodes:
        wait_for(lambda: len(fleet.engines()) == NODES * ENGINES_PER_NODE, DEADLINE_S,
                 "every engine in the fleet view", interval=1.0)

        with pytest.raises(CommandRefused, match="1048576") as refused:   # before 1.3
            fleet.call("refit_acquire", {"holder": "old", "version": "v1"}, timeout_s=60)
        assert refused.value.code == protocol.TOO_BIG
        assert fleet.call("ping")[1]["refit"]["holder"] is None       # the lock is free

        first = fleet.call("refit_acquire", {"holder": "t", "version": "v1", "paged": True},
                           timeout_s=60)[1]
        token = first["token"]
        assert isinstance(token, str) and first["next"] is not None
        members = member_pages.collect(first, "refit_acquire", lambda cursor: fleet.call(
            "refit_members", {"holder": "t", "token": token, "after": cursor})[1])
        names = {(m["node_id"], m["id"]) for m in members}
        assert len(members) == len(names) == NODES * ENGINES_PER_NODE
        assert all(m["url"].startswith(f"http://{HOST}:") and m["process"] for m in members)
        assert all(n.commands[-1] == "pause" for n in nodes.nodes)   # the fleet is paused

        left_out = [members[0]["node_id"], members[0]["id"], 1]
        committed = fleet.call("refit_commit", {
            "holder": "t", "token": token, "version": "v1", "release": True,
            "members_except": [left_out]})[1]
        assert committed["members"] == len(members) - 1 and "released" in committed
        assert fleet.call("ping")[1]["refit"] == {"current_version": "v1", "holder": None}
        wait_for(lambda: all(n.commands[-1] == "resume" for n in nodes.nodes), DEADLINE_S,
                 "the refit's pause lifted on every node")
        serving = {(e.node_id, e.id): e.serving for e in fleet.engines()}
        assert not serving.pop((left_out[0], left_out[1])) and all(serving.values())

        with pytest.raises(RuntimeError, match="stop here"), fleet.refit(
                "v2", timeout_s=DEADLINE_S, backend="gloo", master_address="127.0.0.1") as refit:
            assert {(e.node_id, e.id) for e in refit.engines} == names   # FleetClient pages
            assert refit.token != token
            raise RuntimeError("stop here")   # an abort naming no members: all of them
        assert fleet.call("ping")[1]["refit"] == {"current_version": "v1", "holder": None}
        assert not any(e.serving for e in fleet.engines())   # every member is stale
    fleet.close()
