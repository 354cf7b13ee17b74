"""Adoption by marker (watchdog/adoption.py, `_marked`): which processes a daemon whose state file
is lost or behind takes for each engine's newest launch, driven with a process table built by
hand."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from rollout_watchdog.common.states import EngineState
from rollout_watchdog.watchdog import adoption
from rollout_watchdog.watchdog.incarnations import Incarnations
from rollout_watchdog.watchdog.process import ProcStat

NODE = "n1:abc123"


def stat(pid: int, pgrp: int, start: float) -> ProcStat:
    return ProcStat(pid, b"S", 1, pgrp, start)


def daemon(marked: list[tuple[ProcStat, str]]) -> Any:
    return SimpleNamespace(
        ops=SimpleNamespace(process_table=lambda: {s.pid: s for s, _ in marked}),
        tracker=SimpleNamespace(escapees=lambda table: marked), incarnations=Incarnations(),
        marker_node=NODE, cgroups=None, clock=SimpleNamespace(wall=lambda: 1000.0))


def test_the_newest_launch_is_taken_led_by_its_group_leader() -> None:
    """Two launches under one number (a daemon that died between a launch and its save): the
    later one. Its main leads its process group; a child is watched, not main. A marker of
    another node whose id merely starts the same is not ours. Every number counts as seen."""
    sup = daemon([
        (stat(10, 10, 5.0), f"{NODE}/e0/1/old"),
        (stat(20, 20, 9.0), f"{NODE}/e0/2/aaa"), (stat(21, 20, 9.5), f"{NODE}/e0/2/aaa"),
        (stat(30, 30, 7.0), f"{NODE}/e0/2/zzz"),    # (an earlier launch of number 2)
        (stat(40, 40, 1.0), f"{NODE}x/e1/9/t")])    # (another node's)
    records = adoption._marked(sup)
    assert records.keys() == {"e0"}
    record = records["e0"]
    assert (record.state, record.incarnation, record.marker) == (
        EngineState.STARTING, 2, f"{NODE}/e0/2/aaa")
    assert record.main == stat(20, 20, 9.0).key
    assert record.procs == {stat(20, 20, 9.0).key: True, stat(21, 20, 9.5).key: False}
    assert sup.incarnations.next("e0") == 3 and sup.incarnations.next("e1") == 1


def test_a_launch_whose_main_died_is_taken_with_no_main() -> None:
    """The main process died while no daemon watched, its children live: no child is taken
    for main (probes would fail up to startup_timeout_s while it holds the GPUs); adopting a
    record with no main fails it as exited at once, its processes killed."""
    child = stat(51, 50, 3.0)
    record = adoption._marked(daemon([(child, f"{NODE}/e0/4/t")]))["e0"]
    assert record.main is None and record.procs == {child.key: False}
