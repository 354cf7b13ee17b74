"""The coordinator's Prometheus endpoint (`--metrics-port`), scraped over real HTTP while real
node daemons with emulator engines report to it and a trainer refits them."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from daemon_harness import Node, wait_for
from fleet_harness import start_coordinator_process
from refit_harness import all_healthy, run_trainer, start_fleet

from rollout_watchdog import Coordinator, FleetClient
from rollout_watchdog.emulator.testing import free_port, http_request


def scrape(port: int) -> dict[str, float]:
    """`name{labels}` -> value of every sample the endpoint serves."""
    status, body = http_request(f"http://127.0.0.1:{port}/metrics", timeout=5.0)
    assert status == 200, (status, body[:200])
    samples = {}
    for line in body.decode().splitlines():
        match = re.fullmatch(r"([a-z_]+(?:\{[^}]*\})?) (\S+)", line)
        if match and not line.startswith("#"):
            samples[match.group(1)] = float(match.group(2))
    return samples


def test_the_fleet_in_numbers(make_node: Callable[..., Node]) -> None:
    with Coordinator(bind="tcp://127.0.0.1:0", node_timeout_s=3.0,
                     metrics_port=0) as coordinator:
        port = coordinator.metrics_port
        assert port
        fleet = FleetClient(coordinator.endpoint)
        nodes = start_fleet(make_node, coordinator.endpoint, nodes=2, engines=2)
        fleet.wait_until(all_healthy(4), 90)

        def shows(*want: tuple[str, float]) -> Callable[[], bool]:
            return lambda: all(scrape(port).get(k) == v for k, v in want)

        wait_for(shows(('rollout_watchdog_fleet_nodes{reachable="true"}', 2),
                       ('rollout_watchdog_fleet_engines{state="healthy"}', 4),
                       ("rollout_watchdog_fleet_engines_serving", 4),   # disk weights
                       ('rollout_watchdog_fleet_weight_version{version=""}', 0),
                       ('rollout_watchdog_refit_lock_held{holder="",version=""}', 0)),
                 15, "the fleet's numbers before any refit")

        outcome = run_trainer(coordinator.endpoint, "v1", seed=1)
        assert outcome.get("ok"), outcome
        wait_for(shows(('rollout_watchdog_fleet_weight_version{version="v1"}', 1),
                       ("rollout_watchdog_fleet_engines_serving", 4),
                       ("rollout_watchdog_fleet_engines_pending_weights", 0)),
                 15, "the committed version")
        samples = scrape(port)
        assert samples['rollout_watchdog_refits_total{outcome="committed"}'] == 1
        assert samples['rollout_watchdog_refits_total{outcome="aborted"}'] == 0
        assert samples['rollout_watchdog_refit_duration_seconds_count{outcome="committed"}'] == 1
        assert samples['rollout_watchdog_refit_duration_seconds_sum{outcome="committed"}'] > 0

        nodes[1].kill_daemon()   # SIGKILL: its node goes silent
        wait_for(shows(('rollout_watchdog_fleet_nodes{reachable="true"}', 1),
                       ('rollout_watchdog_fleet_nodes{reachable="false"}', 1),
                       ('rollout_watchdog_fleet_engines{state="healthy"}', 2)),
                 20, "an unreachable node and its engines out of the count")
        assert scrape(port)["rollout_watchdog_fleet_events_relayed_total"] > 0


def test_the_lock_holder_and_its_lease_while_a_trainer_holds_it(
        make_node: Callable[..., Node]) -> None:
    with Coordinator(bind="tcp://127.0.0.1:0", node_timeout_s=3.0,
                     metrics_port=0) as coordinator:
        port = coordinator.metrics_port
        assert port
        fleet = FleetClient(coordinator.endpoint)
        start_fleet(make_node, coordinator.endpoint, nodes=1, engines=1)
        fleet.wait_until(all_healthy(1), 90)
        holder = subprocess.Popen(
            [sys.executable, "tests/refit_trainer.py", coordinator.endpoint, "v9", "1",
             "--hold", "--lease-s", "60"], stdout=subprocess.PIPE, text=True)
        try:
            assert holder.stdout is not None and "token" in holder.stdout.readline()

            def held() -> bool:
                samples = scrape(port)
                lock = [k for k, v in samples.items()
                        if k.startswith("rollout_watchdog_refit_lock_held{") and v == 1]
                return (len(lock) == 1 and 'version="v9"' in lock[0]
                        and samples["rollout_watchdog_refit_lease_remaining_seconds"] > 0)
            wait_for(held, 15, "the holder and its lease")
        finally:
            holder.send_signal(signal.SIGKILL)
            holder.wait(10)
        # the dead holder falls silent: its lease ends, counted as expired
        wait_for(lambda: scrape(port).get(
            'rollout_watchdog_refits_total{outcome="expired"}') == 1, 30, "an expired refit")
        wait_for(lambda: scrape(port).get(
            'rollout_watchdog_refit_lock_held{holder="",version=""}') == 0, 30,
            "the lock free once the coordinator put the members back")


def test_a_port_in_use_is_named() -> None:
    port = free_port()
    with Coordinator(bind="tcp://127.0.0.1:0", metrics_port=port):
        try:
            Coordinator(bind="tcp://127.0.0.1:0", metrics_port=port).start()
        except ValueError as exc:
            assert f"127.0.0.1:{port}" in str(exc)
        else:
            raise AssertionError("a second coordinator served metrics on a port in use")


def test_the_standalone_coordinator_says_where_a_picked_port_serves(tmp_path: Path) -> None:
    """`rollout-watchdog coordinator --metrics-port 0`: the port it picked is in its log, and
    serves the metrics (a user has no other way to find it)."""
    log = tmp_path / "coordinator.log"
    coordinator = start_coordinator_process(f"tcp://127.0.0.1:{free_port()}",
                                            ["--metrics-port", "0"], log_path=log)
    try:
        said = wait_for(lambda: re.search(r"coordinator metrics on http://127\.0\.0\.1:(\d+)"
                                          r"/metrics", log.read_text()), 10, "the log line")
        assert scrape(int(said.group(1)))['rollout_watchdog_fleet_nodes{reachable="true"}'] == 0
    finally:
        coordinator.kill()
