"""Issue 13, critical #2 and newcomer 7, the parts without a router: an incarnation names one
process, forever (the node's high-water marks, and the coordinator's weight book keyed on the
process); an unregistered engine leaves the fleet view at once; a relaunched engine is probed
under a node-wide pause."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from daemon_harness import EMULATOR_ENV, EngineSpec, Node, emulator_command, free_port

from rollout_watchdog.common.protocol import Event, Hello
from rollout_watchdog.refit_bridge.fleet import FleetView
from rollout_watchdog.refit_bridge.weights import WeightBook
from rollout_watchdog.watchdog.incarnations import Incarnations
from rollout_watchdog.watchdog.statefile import load_state, save_state

MakeNode = Callable[..., Node]

# ---------------------------------------------------------------------- pure


def test_incarnations_never_repeat_and_adopted_ones_raise_the_mark() -> None:
    marks = Incarnations()
    assert [marks.next("x0"), marks.next("x0"), marks.next("e0")] == [1, 2, 1]
    marks.seen("e0", 7)       # adopted from a state file that predates the marks
    marks.seen("x0", 1)       # never lowers a mark
    assert (marks.next("e0"), marks.next("x0")) == (8, 3)
    assert Incarnations.from_json(marks.to_json()).issued == {"x0": 3, "e0": 8}
    for bad in ([1], {"e0": -1}, {"e0": True}, {"e0": "3"}):
        with pytest.raises(ValueError):
            Incarnations.from_json(bad)


def test_the_marks_outlive_a_clean_stop_and_a_bad_mark_costs_only_the_marks(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "state.json"
    assert save_state(path, "n", {}, {"x0": 4})   # a clean stop: no engine records
    saved = load_state(path)
    assert saved is not None and saved.engines == {} and saved.incarnations == {"x0": 4}
    data = json.loads(path.read_text())
    data["incarnations"] = {"x0": "four"}
    path.write_text(json.dumps(data))
    saved = load_state(path)
    assert saved is not None and saved.incarnations == {} and path.exists()
    assert "incarnation mark" in caplog.text


def test_a_fresh_process_under_a_reused_incarnation_inherits_no_weights() -> None:
    """A daemon that lost its state file hands out incarnation 1 again: the book tells the
    processes apart by the node's `process` identity."""
    old = {"id": "e0", "state": "healthy", "incarnation": 1, "process": "b:100:5.0"}
    fresh = {**old, "process": "b:200:9.0"}
    book = WeightBook()
    book.commit("v1", [("n", "e0", 1)], lambda node, engine, inc: "b:100:5.0")
    assert book.version_of("n", "e0", 1, "b:100:5.0") == "v1" and book.serving("n", old)
    assert book.version_of("n", "e0", 1, "b:200:9.0") is None
    assert not book.serving("n", fresh)
    view = dict(fresh)
    book.decorate("n", view, reachable=True)
    assert (view["weight_version"], view["serving"]) == (None, False)
    view = dict(old)
    book.decorate("n", view, reachable=False)   # its weights current, its node silent
    assert (view["weight_version"], view["serving"]) == ("v1", False)
    # persisted with the process; a book written before it (4 columns) still loads
    again = WeightBook.from_json(json.loads(json.dumps(book.to_json())))
    assert not again.serving("n", fresh) and again.serving("n", old)
    legacy = WeightBook.from_json({"current": "v1", "held": [["n", "e0", 1, "v1"]]})
    assert legacy.serving("n", fresh)   # (no process known: the incarnation alone decides)
    # before any commit, a fresh process is on its disk weights, whatever an abort did
    aborted = WeightBook()
    aborted.held[("n", "e0")] = type(book.held[("n", "e0")])(1, None, "b:100:5.0")
    assert not aborted.serving("n", old) and aborted.serving("n", fresh)


def test_the_view_shows_the_process_and_drops_an_unregistered_engine() -> None:
    view = FleetView()
    status = {"id": "x0", "state": "healthy", "incarnation": 2, "process": "b:1:2.0",
              "url": "http://127.0.0.1:1"}
    view.hello(Hello("n", "b1", [status], 0), "n", 1.0, 1.0)
    assert view.process_of("n", "x0", 2) == "b:1:2.0"
    assert view.process_of("n", "x0", 1) is None
    gone = {"ts": 1.0, "node_id": "n", "engine": "x0", "incarnation": 2, "kind": "unregistered",
            "from": None, "to": None, "cause": None, "detail": ""}
    view.event(Event("n", "b1", 1, gone), "n", 1.0, 1.0)   # sent without a status
    assert view.status()["nodes"][0]["engines"] == []
    back = {**gone, "incarnation": 3, "kind": "state", "from": "stopped", "to": "starting"}
    view.event(Event("n", "b1", 2, back, {**status, "state": "starting", "incarnation": 3}),
               "n", 1.0, 1.0)   # registered again: back, as a new incarnation
    assert [(e["id"], e["incarnation"]) for e in view.status()["nodes"][0]["engines"]] == \
        [("x0", 3)]


# ---------------------------------------------------------------------- the real daemon


@pytest.fixture
def server() -> Any:
    """An engine server started by someone else (a Ray actor), on a port of its own."""
    started: list[subprocess.Popen[bytes]] = []
    port = free_port()

    def start() -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(emulator_command(port), env={**os.environ, **EMULATOR_ENV},
                                start_new_session=True)
        started.append(proc)
        return proc

    start.port = port  # type: ignore[attr-defined]
    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _register(node: Node, port: int, pid: int) -> str:
    return str(node.client.call("register", {"engine": "x0", "url": f"http://127.0.0.1:{port}",
                                             "pid": pid})["action"])


def test_registering_again_is_a_new_incarnation_even_after_a_daemon_restart(
        make_node: MakeNode, server: Any) -> None:
    node = make_node([]).start()
    node.engines["x0"] = EngineSpec("x0", port=server.port)
    first = server()
    assert _register(node, server.port, first.pid) == "registered, incarnation 1"
    node.wait_state("x0", "healthy")
    node.client.call("unregister", {"engine": "x0"})
    assert _register(node, server.port, first.pid) == "registered, incarnation 2"
    node.client.call("unregister", {"engine": "x0"})
    assert node.stop_daemon() == 0     # a clean stop: no engine is recorded, the marks are
    node.start()
    second = server() if first.poll() is not None else first
    assert _register(node, server.port, second.pid) == "registered, incarnation 3"
    node.wait_state("x0", "healthy", incarnation=3)
    node.kill_daemon()                 # a crash: x0 is adopted, still incarnation 3
    node.start()
    node.wait_state("x0", "healthy", incarnation=3)
    node.client.call("unregister", {"engine": "x0"})
    assert _register(node, server.port, second.pid) == "registered, incarnation 4"


def test_a_relaunch_is_probed_under_a_node_wide_pause(make_node: MakeNode) -> None:
    """Newcomer 7: SIGKILL during `pause --all`, the node paused again while the engine boots
    (finish_generation() once more): it becomes healthy as soon as it answers, not when the
    pause ends (600 s here), and the pause then holds for it."""
    node = make_node([EngineSpec("e0", flags=("--startup-delay", "2")),
                      EngineSpec("e1")]).start()
    first = node.wait_state("e0", "healthy", timeout=60)
    node.wait_state("e1", "healthy", timeout=60)
    node.client.call("pause", {"all": True, "deadline_s": 600})
    os.kill(first["pid"], signal.SIGKILL)
    node.wait_state("e0", "starting", incarnation=2)
    node.client.call("pause", {"all": True, "deadline_s": 600})
    again = node.wait_state("e0", "healthy", incarnation=2, timeout=60)
    assert again["paused"] is True and node.engine("e1")["paused"] is True
    assert node.engine("e1")["state"] == "healthy"
