"""An engine's tp_size (DESIGN: the config's, else "`tp_size` from its `/server_info`, else 1"):
read once per incarnation off the probe path, shown in `status`, and in the fleet view once the
engine's next event carries its status."""

from __future__ import annotations

import http.server
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from daemon_harness import EngineSpec, Node

from rollout_watchdog import Coordinator, FleetClient
from rollout_watchdog.common.server_info import tp_size_of
from rollout_watchdog.common.states import EngineState
from rollout_watchdog.config import EngineConfig, ProbeConfig
from rollout_watchdog.emulator.testing import wait_until
from rollout_watchdog.watchdog.engine import EngineRuntime
from rollout_watchdog.watchdog.engine_info import EngineInfo, read_tp_size
from rollout_watchdog.watchdog.probe import ProbeResult, ProbeRunner


@pytest.mark.parametrize("info, size", [
    ({"tp_size": 4}, 4), ({"tp_size": 1}, 1), ({}, 1), ({"tp_size": 0}, 1),
    ({"tp_size": True}, 1), ({"tp_size": "2"}, 1), ([], 1), (None, 1)])
def test_tp_size_of_is_its_tp_size_else_one(info: Any, size: int) -> None:
    assert tp_size_of(info) == size


@pytest.fixture
def server() -> Iterator[tuple[str, dict[str, Any]]]:
    """A real HTTP server that answers `answer["body"]` with `answer["code"]` (its
    /server_info nothing at all while `answer["hang"]`)."""
    answer: dict[str, Any] = {"code": 200, "body": {"tp_size": 4}, "hang": False}
    release = threading.Event()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if answer["hang"] and self.path == "/server_info":
                release.wait(30)
                return
            data = json.dumps(answer["body"]).encode()
            self.send_response(answer["code"])
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", answer
    finally:
        release.set()
        httpd.shutdown()
        httpd.server_close()


def test_read_tp_size_over_http(server: tuple[str, dict[str, Any]]) -> None:
    url, answer = server
    assert read_tp_size(url, 5.0) == 4
    answer["body"] = {"model_path": "m"}   # an engine that does not say: 1
    assert read_tp_size(url, 5.0) == 1
    answer["code"] = 503
    with pytest.raises(ValueError, match="HTTP 503"):
        read_tp_size(url, 5.0)
    answer["hang"] = True   # never answers: the read ends at its bound
    started = time.monotonic()
    with pytest.raises(OSError):
        read_tp_size(url, 0.5)
    assert time.monotonic() - started < 20   # (its bound, against the server's 30 s)
    with socket.socket() as unused:   # nothing listening
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    with pytest.raises(OSError):
        read_tp_size(f"http://127.0.0.1:{port}", 5.0)


def probe(runner: ProbeRunner, url: str, info: bool) -> ProbeResult:
    assert runner.submit("e0", 1, url + "/health", 30.0, None,
                         url + "/server_info" if info else None)
    return wait_until(runner.drain, 40, interval=0.01, what="the probe's result")[0]


def test_a_starting_engines_probe_reads_its_tp_size_and_never_fails_for_it(
        server: tuple[str, dict[str, Any]]) -> None:
    url, answer = server
    runner = ProbeRunner()
    try:
        assert probe(runner, url, info=False).tp_size is None   # not asked: not read
        found = probe(runner, url, info=True)
        assert found.ok and found.tp_size == 4
        answer["hang"] = True    # /server_info never answers: the probe still passes, soon
        hung = probe(runner, url, info=True)
        assert hung.ok and hung.tp_size is None
        # within INFO_S (1 s), well before the probe's own 30 s and the server's 30 s
        assert hung.finished - hung.started < 15
    finally:
        runner.close()


def engine(engine_id: str, tp: int | None = None) -> EngineRuntime:
    cfg = EngineConfig(id=engine_id, url=f"http://{engine_id}:30000", command=("x",), tp_size=tp,
                       probe=ProbeConfig(health_interval_s=5.0, health_timeout_s=2.0))
    return EngineRuntime(cfg=cfg, state=EngineState.HEALTHY, incarnation=1)


def drive(info: EngineInfo, now: float) -> None:
    """A loop turn at `now`, then until the read it started (if any) is taken."""
    info.tick(now)

    def taken() -> bool:
        info.tick(now)
        return info.next_deadline() is None
    wait_until(taken, 10, interval=0.01, what="the read taken")


def test_each_incarnation_is_read_once_a_failure_later_and_a_configured_size_never() -> None:
    engines = {e.cfg.id: e for e in (engine("a"), engine("b", tp=2))}
    reads: list[str] = []
    answers: list[int | Exception] = [OSError("refused"), 4, 8]

    def read(url: str, timeout_s: float) -> int:
        reads.append(url)
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    emitted: list[tuple[str, str, dict[str, Any]]] = []
    info = EngineInfo(engines, lambda e, kind, **fields: emitted.append((e.id, kind, fields)),
                      read=read)
    a = engines["a"]
    assert a.tp_size is None and engines["b"].tp_size == 2   # not read yet; configured
    drive(info, 100.0)                       # refused: nothing known, tried again later
    assert reads == ["http://a:30000"] and a.tp_size is None
    drive(info, 104.0)                       # within the health interval: not yet
    assert len(reads) == 1
    assert emitted == []
    drive(info, 105.0)
    assert len(reads) == 2 and a.tp_size == 4
    assert emitted == [("a", "tp_size_read", {"detail": "tp_size 4 from /server_info",
                                              "tp_size": 4})]
    drive(info, 200.0)                       # once per incarnation
    assert len(reads) == 2
    a.incarnation, a.state = 2, EngineState.STARTING   # relaunched: not read before healthy
    assert a.tp_size is None
    drive(info, 300.0)
    assert len(reads) == 2
    a.state = EngineState.HEALTHY
    drive(info, 301.0)
    assert len(reads) == 3 and a.tp_size == 8   # b (configured) was never read
    assert [fields["tp_size"] for _, _, fields in emitted] == [4, 8]


def test_status_and_the_fleet_view_show_the_engines_tp_size(
        make_node: Callable[..., Node]) -> None:
    with Coordinator(bind="tcp://127.0.0.1:0", node_timeout_s=5.0) as coordinator:
        node = make_node([EngineSpec("e0"), EngineSpec("e1", extra={"tp_size": 3})],
                         top={"coordinator": coordinator.endpoint})
        node.start()
        node.wait_state("e0", "healthy")
        # read by the probe that found it healthy: the "healthy" event's status carries it
        assert {e["id"]: e["tp_size"] for e in node.status()["engines"]} == {"e0": 1, "e1": 3}
        fleet = FleetClient(coordinator.endpoint)
        fleet.wait_until(lambda view: {e.id: e.tp_size for e in view} == {"e0": 1, "e1": 3}
                         and all(e.state == "healthy" for e in view), 30)
        # A restarted daemon adopts e0, healthy already: its HELLO cannot say e0's tp_size
        # (not read yet); the read's own event brings it to the view (no other event would).
        before = fleet.nodes()[0].boot
        node.kill_daemon()
        node.start()
        wait_until(lambda: (n := fleet.nodes()[0]).boot != before and n.reachable, 30,
                   what="the restarted daemon's HELLO")
        fleet.wait_until(lambda view: {e.id: e.tp_size for e in view} == {"e0": 1, "e1": 3},
                         30)
        assert [e["kind"] for e in node.events("e0")].count("tp_size_read") == 1
