from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from daemon_harness import EngineSpec, Node  # noqa: E402

from rollout_watchdog.emulator.common import NO_MODEL_ENV  # noqa: E402
from rollout_watchdog.emulator.testing import free_port, wait_until  # noqa: E402
from rollout_watchdog.refit_bridge.coordinator import Coordinator  # noqa: E402
from rollout_watchdog.watchdog.cgroup import (  # noqa: E402
    CgroupManager,
    cgroup2_mount,
    cgroup_dir,
    own_cgroup,
)

# scripts/test.sh runs the tests in three passes: most on ${RW_TEST_WORKERS:-6} xdist workers;
# then the `heavy` ones on 3 workers (test_ray_fleet whole on one) and beside nothing else: they
# load the whole machine (a Ray cluster, the demos and examples, the benchmarks' smoke runs);
# then the `serial` ones, two at a time and beside nothing else: a flood of connections or
# descriptors, or a bound the main pass's load would blur (a probe in flight, trickling engines).
HEAVY_MODULES = frozenset({
    "test_ray_fleet", "test_demo", "test_demo_fleet", "test_examples", "test_bench_smoke"})
SERIAL_MODULES = frozenset({
    "test_hostile_run", "test_coordinator_hostile", "test_control_hardening",
    "test_node_link_robust", "test_refit_scale", "test_probe"})
# Modules that never update an engine's weights: their emulators start with --no-model (no torch,
# ~1.4 s less CPU per engine start; emulator_command adds it while $RW_EMULATOR_NO_MODEL=1, set
# below for these modules' tests only). Opt-in, so that a new module gets the real model; and
# test_suite_marks.py fails if a module listed here names a weight operation.
NO_MODEL_MODULES = frozenset({
    "test_cli_fleet", "test_containment_daemon", "test_control_hardening", "test_coordinator",
    "test_coordinator_journal", "test_daemon_faults", "test_daemon_interfaces",
    "test_daemon_lifeline", "test_engine_info", "test_events_follower", "test_fleet_client",
    "test_fleet_faults", "test_fleet_harness", "test_generation_hooks", "test_hostile_run",
    "test_incarnations", "test_node_link", "test_node_link_robust", "test_router",
    "test_runtime_engines", "test_runtime_engines_fleet", "test_runtime_engines_logic",
    "test_sdnotify"})
# The heavy pass's modules whose tests share a module-scoped fixture (a Ray cluster): each goes
# whole to one worker; every other heavy test goes alone (HeavyScheduling, below).
HEAVY_WHOLE_MODULES = frozenset({"test_ray_fleet"})
# The other heavy tests that take longest (~15 to 40 s alone), started first, in this order, so
# that no worker is left with a long one at the end while the other waits idle.
HEAVY_LONGEST = {
    "test_examples": ("test_the_ray_grpo_loop_runs_under_churn_with_no_stale_response",
                      "test_the_example_training_loop_runs_to_its_end"),
    "test_bench_smoke": ("test_ray_start_quick_runs", "test_fleet_scale_quick_runs_every_phase"),
    "test_demo_fleet": ("test_fleet_demo_tells_the_story_and_leaves_nothing",)}
SERIAL_TESTS = {   # module: its serial tests
    "test_cli_fleet": frozenset({
        "test_a_silent_peer_gets_an_exit_within_the_timeout_of_the_commands_start"}),
    "test_coordinator": frozenset({"test_fleet_pause_waits_for_the_inflight_probe"}),
    "test_daemon_logic": frozenset({"test_pause_is_acknowledged_only_after_the_inflight_probe"})}
# The modules each pass of scripts/test.sh (its -m expression) may find tests in; the others
# are not even imported (every pytest process of a pass imports what it collects: torch, ray
# and hypothesis cost seconds of CPU each time). (The serial pass collected all for a while: its
# connection flood test timed out when filtered; the cause was the test's own SYN race, fixed.)
PASS_MODULES: dict[str, Callable[[str], bool]] = {
    "not serial and not heavy": lambda m: m not in SERIAL_MODULES | HEAVY_MODULES,
    "heavy": lambda m: m in HEAVY_MODULES,
    "serial": lambda m: m in SERIAL_MODULES or m in SERIAL_TESTS,
}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "serial: after the main pass, two at a time")
    config.addinivalue_line("markers", "heavy: loads the machine; run beside two others at most")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        module = item.module.__name__ if item.module is not None else ""
        name = item.name.split("[")[0]
        if module in SERIAL_MODULES or name in SERIAL_TESTS.get(module, ()):
            item.add_marker(pytest.mark.serial)
        elif module in HEAVY_MODULES:
            item.add_marker(pytest.mark.heavy)
    first = {(m, t): i for i, (m, t) in enumerate(
        (m, t) for m, tests in HEAVY_LONGEST.items() for t in tests)}

    def rank(item: pytest.Item) -> int:   # (a stable sort: the rest keeps its order)
        module = item.module.__name__ if item.module is not None else ""
        return first.get((module, item.name), len(first))
    items.sort(key=rank)


@pytest.hookimpl(optionalhook=True)   # (xdist's hook: absent under -p no:xdist)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """The heavy pass's scheduler (the others keep xdist's own)."""
    if config.getoption("markexpr", "") != "heavy":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class HeavyScheduling(LoadScopeScheduling):
        """HEAVY_WHOLE_MODULES each whole to one worker, every other test alone. (xdist's
        `loadgroup` would say so with marks, but under pytest 9.2 and xdist 3.8 it splits a
        group, and `loadfile` left one worker idle for the last ~30 s: the other held the
        demos queued behind the Ray example.)"""

        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return path if Path(path).stem in HEAVY_WHOLE_MODULES else nodeid

    return HeavyScheduling(config, log)


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Under one of scripts/test.sh's -m expressions, skip the test modules that hold none of
    that pass's tests (the marks come from the lists above only: test_suite_marks.py)."""
    wanted = PASS_MODULES.get(str(config.getoption("markexpr", "")))
    if wanted is None or collection_path.suffix != ".py" \
            or not collection_path.name.startswith("test_"):
        return None
    return None if wanted(collection_path.stem) else True


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """$RW_EMULATOR_NO_MODEL for the tests of NO_MODEL_MODULES only, set before any fixture of
    the test (module-scoped ones included) starts an engine."""
    if item.module is not None and item.module.__name__ in NO_MODEL_MODULES:
        os.environ[NO_MODEL_ENV] = "1"
    else:
        os.environ.pop(NO_MODEL_ENV, None)


@pytest.fixture
def coordinator() -> Iterator[Coordinator]:
    """An embedded coordinator on a free loopback port (nodes unreachable after 3 s)."""
    with Coordinator(bind="tcp://127.0.0.1:0", node_timeout_s=3.0) as coord:
        yield coord


@pytest.fixture
def router() -> Iterator[Any]:
    """The real sglang-router on free ports (skipped without the test extra's sglang-router);
    its log's last lines are printed (shown when the test failed)."""
    pytest.importorskip("sglang_router", reason="needs sglang-router 0.3.x (the test extra)")
    from router_harness import Router
    started = Router.start()
    yield started
    print(f"---- sglang-router log (last lines)\n{started.log_tail()}")
    started.stop()


@pytest.fixture
def make_node(tmp_path: Path) -> Iterator[Callable[..., Node]]:
    """Build (and later tear down) a daemon over emulator engines: make_node(engines, ...)."""
    nodes: list[Node] = []

    def make(engines: list[EngineSpec], **kwargs: Any) -> Node:
        node = Node(tmp_path / f"n{len(nodes)}", engines, **kwargs)
        nodes.append(node)
        return node

    yield make
    for node in nodes:
        node.cleanup()
        # shown by pytest only when the test failed: what the daemon did
        print(f"---- daemon log of {node.tmp.name} (last 40 lines)")
        print("\n".join(node.log_text().splitlines()[-40:]))


@pytest.fixture
def test_cgroup() -> Iterator[Path]:
    """A fresh cgroup below this process's own, or a skip that says why there is none."""
    mount = cgroup2_mount(Path("/proc/self/mountinfo").read_text())
    if mount is None:
        pytest.skip("no cgroup2 file system is mounted here")
    rel = own_cgroup(Path("/proc/self/cgroup").read_text())
    base = cgroup_dir(*mount, rel) if rel is not None else None
    if base is None:
        pytest.skip(f"this process's cgroup v2 path ({rel}) is not visible under {mount[0]}")
    path = base / f"rwtest-{uuid.uuid4().hex[:8]}"
    try:
        path.mkdir()
    except OSError as exc:
        pytest.skip(f"cannot create a cgroup under {base}: {exc.strerror} (not root, or the "
                    "cgroup2 mount is read-only or not delegated here)")
    try:
        if not (path / "cgroup.kill").exists():
            pytest.skip(f"{path} has no cgroup.kill: the kernel ({os.uname().release}) is older "
                        "than 5.14")
        yield path
    finally:
        CgroupManager.kill(path)
        wait_until(lambda: not CgroupManager.populated(path), 10, what="the test cgroup to empty")
        assert CgroupManager.remove(path)


@pytest.fixture
def standin() -> Iterator[Any]:
    """A stand-in coordinator (tests/fleet_standin.py) for the fleet client and CLI tests."""
    from fleet_standin import StandIn

    server = StandIn(free_port()).start()
    try:
        yield server
    finally:
        server.close()
